"""docs/reference/schema.md against the live catalogue of a freshly migrated schema.

The reference drifted once (versions 1 to 3 described while 4 existed, function signatures and
the verdict type of an earlier draft). These tests read what Postgres says is there and what
the page says, in both directions, so a migration that adds a table, column, index, trigger or
function, or changes a signature, fails here until the page says so.
"""

from __future__ import annotations

import re
from typing import Any

import psycopg
import pytest

from kombu_pgjobs.store.schema import latest_version, migrate, migrations

from .conftest import ROOT

DOC = ROOT / "docs" / "reference" / "schema.md"


@pytest.fixture
def live(db: psycopg.Connection[Any], schema: str) -> str:
    migrate(db, schema)
    return schema


def _text() -> str:
    return DOC.read_text("utf-8")


def _sections(text: str) -> dict[str, str]:
    """Body of each ``### `name` ...`` section, by name."""
    found: dict[str, str] = {}
    parts = re.split(r"^### `(\w+)`[^\n]*$", text, flags=re.MULTILINE)
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        found[name] = body.split("\n## ", 1)[0]
    return found


def _table_cells(text: str, heading: str) -> list[str]:
    """First cells of the markdown table(s) under ``heading`` (up to the next heading)."""
    body = text.split(heading, 1)[1]
    body = re.split(r"^#{2,3} ", body, maxsplit=1, flags=re.MULTILINE)[0]
    return [m.group(1) for m in re.finditer(r"^\| `([^`]+)`", body, flags=re.MULTILINE)]


def test_every_table_and_column_is_described(db, live):
    tables = [r[0] for r in db.execute(
        "SELECT table_name FROM information_schema.tables WHERE table_schema = %s "
        "ORDER BY table_name", (live,)).fetchall()]
    assert "pgjobs_job" in tables and "pgjobs_migration" in tables
    sections = _sections(_text())
    missing_tables = [t for t in tables if t not in sections]
    assert not missing_tables, f"tables without a section in schema.md: {missing_tables}"
    missing: list[str] = []
    for table in tables:
        columns = [r[0] for r in db.execute(
            "SELECT column_name FROM information_schema.columns "
            "WHERE table_schema = %s AND table_name = %s ORDER BY ordinal_position",
            (live, table)).fetchall()]
        missing += [f"{table}.{c}" for c in columns if f"`{c}`" not in sections[table]]
    assert not missing, f"columns schema.md does not describe: {missing}"
    documented = [n for n in sections if n.startswith("pgjobs_")
                  and n not in ("pgjobs_job_wake_v3", "pgjobs_job_delayed_v1",
                                "pgjobs_event_wake_v1")]
    assert sorted(documented) == tables, "schema.md describes a table that does not exist"


def _functions(db: psycopg.Connection[Any], schema: str) -> dict[str, str]:
    return dict(db.execute(
        "SELECT p.proname, pg_get_function_identity_arguments(p.oid) FROM pg_proc AS p "
        "JOIN pg_namespace AS n ON n.oid = p.pronamespace WHERE n.nspname = %s",
        (schema,)).fetchall())


def test_every_function_is_documented_with_its_signature(db, live):
    live_functions = _functions(db, live)
    documented: dict[str, str] = {}
    for cell in _table_cells(_text(), "### Functions and type"):
        m = re.fullmatch(r"(\w+)\((.*)\)", cell)
        if m:
            documented[m.group(1)] = m.group(2)
    doc_only = {k: v for k, v in documented.items() if live_functions.get(k) != v}
    live_only = {k: v for k, v in live_functions.items() if documented.get(k) != v}
    assert documented == live_functions, (
        "schema.md's function table and the catalogue disagree:\n"
        f"  only in the doc: {doc_only}\n  only live: {live_only}")


def test_the_verdict_type_is_documented_with_its_fields(db, live):
    fields = [r[0] for r in db.execute(
        "SELECT a.attname FROM pg_type AS t JOIN pg_namespace AS n ON n.oid = t.typnamespace "
        "JOIN pg_attribute AS a ON a.attrelid = t.typrelid AND a.attnum > 0 "
        "WHERE n.nspname = %s AND t.typname = 'pgjobs_verdict' ORDER BY a.attnum",
        (live,)).fetchall()]
    assert fields == ["verdict", "on_key"]
    row = next(line for line in _text().splitlines() if line.startswith("| `pgjobs_verdict` |"))
    assert all(f"`{f}`" in row for f in fields), row
    described = set(re.findall(r"`(\w+)`", row.split("`verdict`", 1)[1].split("`on_key`")[0]))
    # the verdicts the admission function can return, as written in its body
    body = db.execute(
        "SELECT prosrc FROM pg_proc AS p JOIN pg_namespace AS n ON n.oid = p.pronamespace "
        "WHERE n.nspname = %s AND p.proname = 'pgjobs_admit_v2'", (live,)).fetchone()[0]
    returned = set(re.findall(r"ROW\('(\w+)'", body)) | {"ok"}
    assert described == returned, f"doc says {sorted(described)}, code returns {sorted(returned)}"


def test_every_index_and_trigger_is_documented(db, live):
    indexes = {r[0]: r[1] for r in db.execute(
        "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = %s", (live,)).fetchall()}
    cells = _table_cells(_text(), "## Indexes")
    assert sorted(cells) == sorted(indexes), "schema.md's index table and the catalogue disagree"
    text = _text()
    for name, definition in indexes.items():
        where = definition.split(" WHERE ", 1)[1] if " WHERE " in definition else None
        if where is None:
            continue
        row = next(line for line in text.splitlines() if line.startswith(f"| `{name}` |"))
        words = set(re.findall(r"[a-z_]+", where.lower())) - {"text", "and", "is", "not",
                                                                "null"}
        missing = [w for w in words if w not in row]
        assert not missing, f"{name}: the doc's predicate lacks {missing} of {where}"
    triggers = [r[0] for r in db.execute(
        "SELECT t.tgname FROM pg_trigger AS t JOIN pg_class AS c ON c.oid = t.tgrelid "
        "JOIN pg_namespace AS n ON n.oid = c.relnamespace "
        "WHERE n.nspname = %s AND NOT t.tgisinternal", (live,)).fetchall()]
    assert triggers
    for trigger in triggers:
        assert f"### `{trigger}`" in text, f"trigger {trigger} has no section in schema.md"


def test_the_latest_version_and_every_migration_are_stated(db, live):
    text = _text()
    latest = latest_version()
    m = re.search(r"describes\s+versions 1 to (\d+) \(the latest\)", text)
    assert m and int(m.group(1)) == latest, f"schema.md must say: versions 1 to {latest}"
    applied = db.execute(f'SELECT max(version) FROM "{live}".pgjobs_migration').fetchone()[0]
    assert applied == latest
    section = text.split("## Migrations", 1)[1]
    rows = [f"{int(v):04d}:{f}" for v, f in
            re.findall(r"^\| (\d+) \| `([^`]+)` \|", section, flags=re.MULTILINE)]
    files = [f"{mg.version:04d}:{mg.version:04d}_{mg.name}.sql" for mg in migrations()]
    assert rows == files, "the Migrations table lists every migration file, in order"
    for mg in migrations():
        assert f"`{mg.name}`" in text, f"pgjobs_migration.name {mg.name!r} not named"
