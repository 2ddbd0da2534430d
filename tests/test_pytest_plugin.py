"""The pytest plugin (issue 33, item 1): docs/testing.md's files run as a user's project would.

* In a fresh virtualenv with ``pip install '<this checkout>[pytest]'`` (pytest-celery 1.x comes
  with it) and no server configured: the embedded server, the plugin's in-process worker with
  no conftest.py, and Celery's own fixtures as the page's section on them sets them up.
* On ``$PGJOBS_TEST_DSN`` under pytest-xdist: a database per worker, each dropped at the end.
* Loaded but not asked for: nothing imported, no warning.

Each run is a pytest subprocess in an empty directory outside this repository (so neither this
project's conftest nor its pyproject options apply).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from .conftest import ROOT

DOC = ROOT / "docs" / "testing.md"
_BLOCK = re.compile(r"^```python\n# (\S+\.py)\n(.*?)^```", re.MULTILINE | re.DOTALL)
_SUMMARY = re.compile(r"^=*\s*(\d+) passed", re.MULTILINE)


#: the page's section with Celery's own fixtures: a project of its own (its conftest.py)
CELERY_SECTION = "## pytest-celery 1.x and Celery's own fixtures"


def doc_files(celery_fixtures: bool = False) -> dict[str, str]:
    """The files docs/testing.md shows, by name (a ```python block opening with ``# name.py``):
    those of the page, or with ``celery_fixtures`` those of its section on Celery's fixtures."""
    head, rest = DOC.read_text("utf-8").split(CELERY_SECTION, 1)
    section, _, tail = rest.partition("\n## ")
    text = section if celery_fixtures else head + tail
    return {m.group(1): f"# {m.group(1)}\n{m.group(2)}" for m in _BLOCK.finditer(text)}


def _doc_tests(celery_fixtures: bool = False) -> int:
    return sum(len(re.findall(r"^def test_", text, re.MULTILINE))
               for text in doc_files(celery_fixtures).values())


@pytest.fixture
def project() -> Iterator[Path]:
    """An empty directory every local account can enter (as root the embedded server runs as
    another account, which must reach the binaries in a venv made there)."""
    base = Path(tempfile.mkdtemp(prefix="pgjobs-user-project-"))
    base.chmod(0o755)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _user_env(**extra: str) -> dict[str, str]:
    """The environment of a user's shell: none of this run's pytest or pgjobs variables."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTEST_", "PGJOBS_")) and k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, **extra}


def _write(project: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (project / name).write_text(text)


def _pytest(python: str, project: Path, env: dict[str, str], *args: str,
            timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([python, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args],
                          cwd=project, env=env, capture_output=True, text=True, timeout=timeout)


def _databases(conninfo: str) -> set[str]:
    with psycopg.connect(conninfo, autocommit=True, connect_timeout=10) as conn:
        return {r[0] for r in conn.execute(
            "SELECT datname FROM pg_database WHERE datname LIKE 'pgjobs_test_%'").fetchall()}


def test_the_page_shows_test_files_that_need_no_conftest() -> None:
    """No extra step: the page's test files need no conftest.py (no ``pytest_plugins`` line)
    and use the plugin's worker; Celery's own fixtures are a section of their own."""
    files = doc_files()
    assert "test_tasks.py" in files and "conftest.py" not in files, sorted(files)
    assert not any("pytest_plugins" in text for text in files.values())
    assert "pgjobs_celery_worker" in files["test_tasks.py"]
    assert _doc_tests() >= 3
    celery = doc_files(celery_fixtures=True)
    assert set(celery) == {"conftest.py", "test_celery_fixtures.py"}, sorted(celery)
    assert "pgjobs_broker_url" in celery["conftest.py"]
    assert "celery.contrib.pytest" in celery["conftest.py"]
    assert _doc_tests(celery_fixtures=True) >= 1


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_docs_project_in_a_fresh_venv_with_pytest_celery_on_the_embedded_server(
        project: Path) -> None:
    """The issue's "done when": a fresh virtualenv, ``pip install 'kombu-pgjobs[pytest]'``,
    the page's files, ``pytest`` with no server configured and nothing added for
    pytest-celery; then the page's project on Celery's own fixtures, in the same venv."""
    venv = project / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    pip = subprocess.run([python, "-m", "pip", "install", "-q", f"{ROOT}[pytest]"],
                         capture_output=True, text=True, timeout=600, env=_user_env())
    if pip.returncode != 0:
        offline = re.search(r"NewConnectionError|Temporary failure in name resolution|"
                            r"No matching distribution found", pip.stderr)
        if offline and os.environ.get("CI") != "true":
            pytest.skip(f"PyPI unreachable: {pip.stderr[-500:]}")
        pytest.fail(f"pip install failed:\n{pip.stdout[-2000:]}\n{pip.stderr[-3000:]}")
    version = subprocess.run(
        [python, "-c", "import pytest_celery; print(pytest_celery.__version__)"],
        capture_output=True, text=True, check=True).stdout.strip()
    assert version.startswith("1."), f"pytest-celery {version}"

    pgdata = project / "pgdata"
    env = _user_env(PGJOBS_EMBEDDED_DIR=str(pgdata))  # where the data lives; nothing else set
    try:
        # the page's files (no conftest.py), then its section on Celery's own fixtures
        for directory, celery_fixtures in (("app", False), ("celery-app", True)):
            user = project / directory
            user.mkdir()
            _write(user, doc_files(celery_fixtures))
            run = _pytest(python, user, env)
            out = run.stdout + run.stderr
            assert run.returncode == 0, f"{directory}:\n{out[-6000:]}"
            passed = _SUMMARY.search(out)
            assert passed and int(passed.group(1)) == _doc_tests(celery_fixtures), \
                f"{directory}:\n{out[-3000:]}"
        # the embedded server ran there, and the session's database is gone
        port = re.search(r"port = (\d+)", (pgdata / "kombu_pgjobs.conf").read_text())
        assert port, "no embedded server was made"
        assert _databases(f"postgresql://postgres@127.0.0.1:{port.group(1)}/postgres") == set()
    finally:
        subprocess.run([python, "-c", "import sys; from kombu_pgjobs import embedded; "
                        "embedded.stop_server(sys.argv[1])", str(pgdata)],
                       capture_output=True, timeout=120)


@pytest.mark.e2e
def test_the_docs_project_on_PGJOBS_TEST_DSN_one_database_per_xdist_worker(
        dsn: str, project: Path) -> None:
    """This project's venv (no pytest-celery), the databases on ``$PGJOBS_TEST_DSN``, two
    xdist workers: each its own database, each dropped at the end."""
    _write(project, doc_files())
    seen = project / "seen"
    seen.mkdir()
    (project / "test_where.py").write_text(
        "import os\nimport pytest\n\n\n@pytest.mark.parametrize('n', range(6))\n"
        "def test_where(n, pgjobs_broker_url, pgjobs_queue_depth):\n"
        "    assert pgjobs_queue_depth('nowhere') == 0\n"
        "    # library modules load as plain source, never through the assertion rewriter\n"
        "    import sys\n"
        "    loaders = {type(sys.modules[m].__loader__).__name__ for m in sys.modules\n"
        "               if m.startswith(('kombu_pgjobs.', 'celery_ext'))\n"
        "               and m != 'kombu_pgjobs.pytest'}\n"
        "    assert 'kombu_pgjobs.store.admin' in sys.modules\n"
        "    assert loaders == {'SourceFileLoader'}, loaders\n"
        f"    (__import__('pathlib').Path({str(seen)!r}) / f'{{n}}').write_text(\n"
        "        os.environ['PYTEST_XDIST_WORKER'] + ' ' + pgjobs_broker_url)\n")
    before = _databases(dsn)
    run = _pytest(sys.executable, project, _user_env(PGJOBS_TEST_DSN=dsn), "-n", "2",
                  "-p", "xdist", "-W", "error::pytest.PytestAssertRewriteWarning")
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    passed = _SUMMARY.search(out)
    assert passed and int(passed.group(1)) == _doc_tests() + 6, out[-3000:]
    by_worker: dict[str, set[str]] = {}
    for f in seen.iterdir():
        worker, url = f.read_text().split(" ", 1)
        by_worker.setdefault(worker, set()).add(url)
    assert all(len(urls) == 1 for urls in by_worker.values()), by_worker
    urls = {u for urls in by_worker.values() for u in urls}
    assert len(urls) == len(by_worker), by_worker  # no two workers share a database
    host = psycopg.conninfo.conninfo_to_dict(dsn).get("host", "127.0.0.1")
    assert all(u.startswith("pgjobs://") and f"@{host}:" in u for u in urls), urls
    # this run's own databases, by the names its workers were given (other tests of this
    # suite make session databases on the same server meanwhile)
    made = {u.rsplit("/", 1)[1] for u in urls}
    assert made.isdisjoint(before)
    assert made & _databases(dsn) == set(), "a session's database was left behind"


def test_the_plugin_does_nothing_until_its_fixtures_are_asked_for(project: Path) -> None:
    """Registered by its entry point in every pytest run, it imports nothing (no psycopg, no
    connection) and warns nothing until a test asks for a fixture of its."""
    (project / "test_plain.py").write_text(
        "import sys\n\n\ndef test_plain(request):\n"
        "    plugin = request.config.pluginmanager.get_plugin('pgjobs')\n"
        "    assert plugin is not None and plugin.__name__ == 'kombu_pgjobs.pytest'\n"
        "    assert 'psycopg' not in sys.modules\n"
        "    assert not [m for m in sys.modules if m.startswith('kombu_pgjobs.') and m not in\n"
        "                ('kombu_pgjobs._alias', 'kombu_pgjobs.pytest')]\n")
    run = _pytest(sys.executable, project, _user_env(), "-W", "error")
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    assert "1 passed" in run.stdout and "warning" not in run.stdout, run.stdout[-2000:]


def test_a_server_that_cannot_be_reached_fails_the_test_never_skips_it(project: Path) -> None:
    (project / "test_needs_db.py").write_text(
        "def test_needs_db(pgjobs_broker_url):\n    pass\n")
    run = _pytest(sys.executable, project, _user_env(
        PGJOBS_TEST_DSN="postgresql://postgres@127.0.0.1:1/nowhere?connect_timeout=3"), "-rs")
    out = run.stdout + run.stderr
    assert run.returncode == 1, out[-3000:]
    assert "1 error" in out and "skipped" not in out, out[-3000:]
    assert "cannot create a test database with $PGJOBS_TEST_DSN" in out, out[-3000:]


def test_the_helpers_answer_nothing_before_anything_connected(dsn: str, project: Path) -> None:
    """A fresh session's database has no pgjobs schema yet: 0 and [], not an error."""
    (project / "test_empty.py").write_text(
        "def test_empty(pgjobs_queue_depth, pgjobs_dead_letters):\n"
        "    assert pgjobs_queue_depth() == 0 and pgjobs_queue_depth('x', 'ready') == 0\n"
        "    assert pgjobs_dead_letters() == [] and pgjobs_dead_letters(queue='x') == []\n")
    run = _pytest(sys.executable, project, _user_env(PGJOBS_TEST_DSN=dsn))
    assert run.returncode == 0 and "1 passed" in run.stdout, (run.stdout + run.stderr)[-3000:]


@pytest.mark.e2e
def test_pgjobs_celery_config_gives_the_app_its_settings(dsn: str, project: Path) -> None:
    """An override of ``pgjobs_celery_config`` reaches ``pgjobs_celery_app``, and its worker
    consumes the queue the settings name; the broker stays the session's database."""
    (project / "conftest.py").write_text(
        "import pytest\n\n\n@pytest.fixture(scope='session')\n"
        "def pgjobs_celery_config():\n    return {'task_default_queue': 'work'}\n")
    (project / "test_config.py").write_text(
        "def test_config(pgjobs_celery_app, pgjobs_celery_worker, pgjobs_broker_url,\n"
        "                pgjobs_queue_depth):\n"
        "    assert pgjobs_celery_app.conf.broker_url == pgjobs_broker_url\n"
        "    assert pgjobs_celery_app.conf.task_default_queue == 'work'\n"
        "    @pgjobs_celery_app.task\n    def add(x, y):\n        return x + y\n\n"
        "    pgjobs_celery_worker.reload()\n"
        "    assert add.delay(2, 3).get(timeout=20) == 5\n"
        "    assert pgjobs_queue_depth('work') == 0\n")
    run = _pytest(sys.executable, project, _user_env(PGJOBS_TEST_DSN=dsn))
    assert run.returncode == 0 and "1 passed" in run.stdout, (run.stdout + run.stderr)[-4000:]
