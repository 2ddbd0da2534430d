"""The shard map: which database each queue lives on.

``broker_transport_options = {"shards": {"billing": "pgjobs://app@db2/jobs",
"reports.*": "pgjobs://app@db3/jobs", "*": "pgjobs://app@db1/jobs"}}`` (a dict, or the same
as a JSON object) routes each queue's publishes and claims to one database. A queue resolves,
in this order, to:

1. the URL of its exact name;
2. the URL of the most specific glob that matches it (``*`` any run of characters, ``?`` one
   character; most literal characters first, then map order);
3. the URL of ``"*"``;
4. the broker URL's database (the *default* database).

Remote control (``*.pidbox``, Celery's pidbox and reply queues) and events (``celeryev.*``)
never move: they, and every binding, stay on the default database. A pattern that names them
is refused (``PGJ-231``).

This module only parses and resolves; it opens no connection (:mod:`kombu_pgjobs.broker.sharding`
composes the per-database backends and consumer loops).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import InvalidShardMap, InvalidShardPattern, InvalidShardURL, InvalidURL
from .url import masked
from .url import parse as parse_url

__all__ = ["DEFAULT", "ShardMap", "is_pinned", "parse", "shard_label"]

#: the name of the broker URL's database in tags, labels and the CLI's SHARD column
DEFAULT = "default"
MAX_PATTERN = 200
#: a pattern's characters: anything printable but glob brackets (no character classes)
_BAD_PATTERN = re.compile(r"[\[\]\x00-\x1f\x7f]")


def is_pinned(queue: str) -> bool:
    """Queues that always stay on the default database: Celery's remote control (pidbox and
    reply queues end with ``.pidbox``) and event receivers (``celeryev.<uuid>``)."""
    return queue.endswith(".pidbox") or queue.startswith("celeryev.")


def _glob(pattern: str) -> re.Pattern[str]:
    return re.compile("".join(".*" if c == "*" else "." if c == "?" else re.escape(c)
                              for c in pattern) + r"\Z", re.DOTALL)


def _check_pattern(pattern: Any) -> str:
    if not isinstance(pattern, str) or not pattern:
        raise InvalidShardPattern(f"shard map: queue pattern {pattern!r} is not a non-empty "
                                  "string")
    if len(pattern) > MAX_PATTERN:
        raise InvalidShardPattern(f"shard map: queue pattern {pattern[:40]!r}… is longer "
                                  f"than {MAX_PATTERN} characters")
    if _BAD_PATTERN.search(pattern) or not pattern.isprintable():
        raise InvalidShardPattern(
            f"shard map: queue pattern {pattern!r} is not a queue name or a glob with * and ? "
            "only (no [...] classes, no control characters)")
    if pattern != "*" and (pattern.rstrip("*?").endswith("pidbox")
                           or pattern.startswith("celeryev") or is_pinned(pattern)):
        raise InvalidShardPattern(
            f"shard map: queue pattern {pattern!r} names remote control or event queues, "
            "which always stay on the broker URL's database")
    return pattern


def _check_url(pattern: str, url: Any) -> str:
    if not isinstance(url, str) or not url:
        raise InvalidShardURL(f"shard map: the URL of {pattern!r} is not a non-empty string: "
                              f"{url!r}")
    try:
        parts = parse_url(url)
    except InvalidURL as exc:
        raise InvalidShardURL(f"shard map: the URL of {pattern!r}: {exc.message}") from None
    if not parts.hosts:
        raise InvalidShardURL(f"shard map: the URL of {pattern!r} ({masked(url)!r}) names no "
                              "host: a shard is a server's database, never the embedded one")
    if not parts.dbname or "/" in parts.dbname:
        raise InvalidShardURL(f"shard map: the URL of {pattern!r} ({masked(url)!r}) names no "
                              "database (pgjobs://user@host:port/database)")
    return url


def shard_label(url: str) -> str:
    """How a shard's database is named to operators (metrics label, the CLI's SHARD column):
    ``host:port/database``, never the user or password."""
    parts = parse_url(url)
    hosts = ",".join(f"{h}:{p}" if p else h for h, p in parts.hosts)
    return f"{hosts}/{parts.dbname}"


@dataclass(frozen=True)
class ShardMap:
    """A validated shard map. ``urls``: the distinct database URLs in map order; shard ``i``
    (1-based) is ``urls[i - 1]``, shard 0 is the default database."""

    exact: tuple[tuple[str, int], ...]
    globs: tuple[tuple[str, int], ...]  # most specific first
    fallback: int  # the shard of "*", or 0
    urls: tuple[str, ...]
    _compiled: dict[str, re.Pattern[str]] = field(default_factory=dict, compare=False,
                                                  hash=False, repr=False)

    def shard_of(self, queue: str) -> int:
        """The shard number of ``queue`` (0: the default database)."""
        if is_pinned(queue):
            return 0
        for name, shard in self.exact:
            if name == queue:
                return shard
        for pattern, shard in self.globs:
            rx = self._compiled.get(pattern)
            if rx is None:
                rx = self._compiled[pattern] = _glob(pattern)
            if rx.match(queue):
                return shard
        return self.fallback

    def as_dict(self) -> dict[str, str]:
        """The map as given (pattern -> URL), for display (mask the passwords)."""
        out = {p: self.urls[s - 1] for p, s in (*self.exact, *self.globs) if s}
        if self.fallback:
            out["*"] = self.urls[self.fallback - 1]
        return out


def parse(raw: Any) -> ShardMap | None:
    """Validate a shard map (a mapping, or a JSON object as text); None when it is empty.
    Raises PGJ-230 (not a map), PGJ-231 (a bad pattern), PGJ-232 (a bad URL)."""
    if raw is None or isinstance(raw, ShardMap):
        return raw
    if isinstance(raw, (str, bytes)):
        try:
            raw = json.loads(raw)
        except ValueError as exc:
            raise InvalidShardMap(f"shard map is not valid JSON: {exc}") from None
    if not isinstance(raw, Mapping):
        raise InvalidShardMap(f"shard map must be a mapping of queue patterns to database "
                              f"URLs, got {type(raw).__name__}")
    if not raw:
        return None
    urls: list[str] = []
    exact: list[tuple[str, int]] = []
    globs: list[tuple[int, int, str, int]] = []
    fallback = 0
    for order, (pattern, url) in enumerate(raw.items()):
        pattern = _check_pattern(pattern)
        url = _check_url(pattern, url)
        if url not in urls:
            urls.append(url)
        shard = urls.index(url) + 1
        if pattern == "*":
            fallback = shard
        elif "*" in pattern or "?" in pattern:
            literal = sum(c not in "*?" for c in pattern)
            globs.append((-literal, order, pattern, shard))
        else:
            exact.append((pattern, shard))
    return ShardMap(exact=tuple(exact), globs=tuple((p, s) for _, _, p, s in sorted(globs)),
                    fallback=fallback, urls=tuple(urls))
