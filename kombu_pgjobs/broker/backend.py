"""Process-wide state shared by every kombu connection to one database and schema.

A Celery worker opens several kombu connections (consumer, producer pool, events). They all share
one :class:`Backend`, so a worker process holds a small, fixed number of Postgres connections
whatever the number of queues or kombu connections:

* one claim connection per consuming kombu connection (also the LISTEN session),
* one publish connection, shared under a lock,
* one keeper connection, used by the lease keeper thread.

The backend also owns what must outlive a single kombu connection: the buffer of fenced acks
(an ack stays valid across a consumer reconnect because it is fenced on ``(id, claim)``, not on a
connection) and the registry of held leases that the keeper renews.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, cast

import psycopg

from ..errors import (
    DatabaseTimeout,
    DatabaseUnavailable,
    MigrationError,
    PermissionDenied,
    PgJobsError,
    PoolerUnsupported,
    PublishFailed,
)
from ..events import log_event, one_line
from ..options import TransportOptions
from ..store import history, retention
from ..store.core import NewJob, Pair, QueueCore, bounded
from ..store.database import connect
from ..store.schema import current_version as schema_version
from ..store.schema import latest_version, migrate
from .batching import pending
from .unconfirmed import Unconfirmed

__all__ = ["CLAIM_SESSION", "Backend", "add_run_listener", "add_settle_listener", "backend_for",
           "cut_off", "identity", "release_all", "run_listeners", "set_identity",
           "settle_listeners"]

log = logging.getLogger("kombu_pgjobs")

_backends: dict[tuple[str, TransportOptions], Backend] = {}
_backends_lock = threading.Lock()


def denied(exc: psycopg.Error, doing: str) -> PermissionDenied:
    """The coded error for a statement the role may not run (``InsufficientPrivilege``)."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else "permission denied"
    return PermissionDenied(
        f"{doing}: {first}: the role this process connects as lacks the right; connect as "
        "the role of this component (`pgjobs roles` writes them, docs/security.md) or grant it")


def backend_for(conninfo: str, options: TransportOptions) -> Backend:
    """The backend of this process for (conninfo, options); created on first use."""
    key = (conninfo, options)
    with _backends_lock:
        b = _backends.get(key)
        if b is None or b.pid != os.getpid():
            b = Backend(conninfo, options)
            _backends[key] = b
        return b


#: Told of every fenced settle that landed: ``fn(outcome, job_id, claim, headers)`` with outcome
#: ``acked``, ``requeued``, ``dead`` or ``cancelled`` (the ack of a run an operator cancelled
#: became a dead letter): the transport's settle, not yet the run's outcome (celery_ext's
#: ``on_settled`` turns an ``acked`` into its run's word). Told after its statement committed,
#: once, never for a settle that missed its fence. ``headers`` are the delivered message's
#: (``{}`` when not recorded). celery_ext's ``on_settled`` signal is one (see
#: :mod:`celery_ext.settled`). A listener runs on the thread that settled (the consumer, the
#: keeper, a pool thread); one that raises is logged (PGJ-221) and changes nothing.
SettleListener = Callable[[str, int, int, dict[str, Any]], None]
settle_listeners: list[SettleListener] = []
_OUTCOMES = {"ack": "acked", "requeue": "requeued", "reject": "dead", "bury": "dead",
             "cancel": "cancelled"}
#: the most reject reasons / delivery headers remembered for settles still to come
_MAX_REMEMBERED = 100_000


def add_settle_listener(fn: SettleListener) -> None:
    """Register a settle listener for every backend of this process (idempotent)."""
    if fn not in settle_listeners:
        settle_listeners.append(fn)


#: Told when a run this process holds must end: ``fn(why, job_id, claim, headers)`` with why
#: ``cancelled`` (an operator cancelled the message while it runs: ``pgjobs cancel``,
#: ``celery_ext.cancel``, the dashboard) or ``lost`` (the lease is no longer this process's: a
#: renewal found the row rescued, re-claimed or settled elsewhere). The transport cannot stop a
#: task body itself; celery_ext's listener does (it terminates a prefork child, kills a green
#: thread, flags a thread for ``celery_ext.cancelled()``). Called once per run, on the keeper's
#: thread; one that raises is logged and changes nothing. ``headers`` are the delivered
#: message's (kept while any listener is registered).
RunListener = Callable[[str, int, int, dict[str, Any]], None]
run_listeners: list[RunListener] = []


def add_run_listener(fn: RunListener) -> None:
    """Register a run listener for every backend of this process (idempotent)."""
    if fn not in run_listeners:
        run_listeners.append(fn)


def release_all() -> None:
    """Close every backend of this process (its connections and keeper thread)."""
    with _backends_lock:
        backends = list(_backends.values())
        _backends.clear()
    for b in backends:
        b.close()


def _flush_at_exit() -> None:
    """Acks still buffered when the process exits are flushed, not left to lapse: a task
    that ran and was acked must not run again."""
    with _backends_lock:
        backends = [b for b in _backends.values() if b.pid == os.getpid()]
    for b in backends:
        b.flush_pending()
        b.deregister()


atexit.register(_flush_at_exit)


def _forget_after_fork() -> None:
    # A forked child (prefork pool) must not use its parent's sockets or threads; and it is
    # another process: another incarnation.
    global _incarnation
    _backends.clear()
    _incarnation = uuid.uuid4().hex[:8]


#: this process's node name (celery_ext: the Celery worker's, ``-n``), None until told
_node: str | None = None
#: this process's incarnation: a PID reused by a restarted process is another worker
_incarnation = uuid.uuid4().hex[:8]


def identity() -> str:
    """How this process is named as a lease holder, a consumer (``pgjobs workers``) and a
    counter shard: ``node:pid:incarnation`` — the Celery node name when celery_ext told it
    (:func:`set_identity`), else the host name."""
    return f"{_node or socket.gethostname()}:{os.getpid()}:{_incarnation}"


def cut_off(unfinished: set[Pair]) -> tuple[int, int]:
    """:meth:`Backend.cut_off` on every backend of this process. Returns (handed back,
    acked)."""
    with _backends_lock:
        backends = [b for b in _backends.values() if b.pid == os.getpid()]
    handed = acked = 0
    for b in backends:
        h, a = b.cut_off(unfinished)
        handed, acked = handed + h, acked + a
    return handed, acked


def set_identity(node: str) -> None:
    """Name this process after its Celery node (``celery@host``, set by ``-n``): celery_ext
    calls it when the worker starts, before it consumes. Backends already made take the
    name too."""
    global _node
    _node = node
    name = identity()
    with _backends_lock:
        backends = [b for b in _backends.values() if b.pid == os.getpid()]
    for b in backends:
        b.worker = b.core.worker = name


os.register_at_fork(after_in_child=_forget_after_fork)



#: The claim connection's session settings. Its prepared statements always use their generic
#: plan: left to choose, the planner kept re-planning the claim (a custom plan every time:
#: half of Postgres's CPU in a worker). A generic plan is kept until the table's statistics
#: change (a VACUUM, an ANALYZE), and one made while the table was small read it whole: a
#: worker that started on an empty queue kept sequential scans of the job table (the claim
#: index, the lease's rows) while a burst of a million rows arrived. With sequential scans
#: off, the claim reads the job table through its indexes at any size (what it reads must
#: also be named by index conditions, not joins: see sql/job.sql and schema 20).
CLAIM_SESSION = ("SET plan_cache_mode = force_generic_plan", "SET enable_seqscan = off")


class Backend:
    def __init__(self, conninfo: str, options: TransportOptions) -> None:
        self.pid = os.getpid()
        self.conninfo = conninfo
        self.options = options
        self.worker = identity()
        self.core = QueueCore(options.schema, lease_ttl=options.lease_ttl,
                              max_attempts=options.max_attempts, worker=self.worker,
                              hand_off=options.hand_off, history=options.history)
        self._migrated = False
        self._migrate_lock = threading.Lock()
        self._publish_conn: psycopg.Connection[Any] | None = None
        self._publish_lock = threading.RLock()  # close() confirms under its own hold
        # confirm_publish=False: the publish connection sending unconfirmed INSERTs, and the
        # messages a broken one left unconfirmed (sent again on the next connection)
        self._unconfirmed: Unconfirmed | None = None
        self._resend: list[NewJob] = []
        if not options.confirm_publish:
            atexit.register(self._confirm_before_close)
        # fenced acks waiting to be flushed: (id, claim, monotonic time buffered)
        self._acks: list[tuple[int, int, float]] = []
        self._acks_lock = threading.Lock()
        self._ack_listeners: list[Callable[[], None]] = []
        # leases this process holds: id -> claim
        self.held: dict[int, int] = {}
        # held runs an operator cancelled (the keeper's renewal said so): their ack goes to the
        # dead letters as 'cancelled' (job_bury), not to the ack buffer
        self.cancelled: set[Pair] = set()
        # deliveries whose message was settled another way (release()): their ack is dropped
        self._released: set[Pair] = set()
        #: when (monotonic) a settle of this process last landed: the history rollup's turn is
        #: asked for only for a while after one (kombu_pgjobs.store.history.on_tick)
        self.last_settled_at: float | None = None
        # acks taken from the buffer and not yet settled (their rows may already be gone)
        self._settling: set[int] = set()
        self._held_lock = threading.Lock()
        self.consumed: dict[str, int] = {}
        self._churn = 0  # rows settled since the keeper's last vacuum request
        # for settle listeners: the delivered headers of held messages, by (id, claim); and
        # reasons given for rejects to come (celery_ext: Reject(reason)), by Celery task id
        self._delivered: dict[Pair, dict[str, Any]] = {}
        self._reject_reasons: dict[str, str] = {}
        self._consumer_seen = False  # it consumed: its keeper registers it (pgjobs_consumer)
        #: a transaction pooler the keeper ran into (PGJ-112): the consumer raises it, so a
        #: worker stops rather than run while its leases cannot be renewed
        self.unsupported: PoolerUnsupported | None = None
        self._keeper: Keeper | None = None
        self._keeper_lock = threading.Lock()

    # -- connections ---------------------------------------------------------------------
    def connect(self, *, hot: bool = False,
                timeout: float | None = None) -> psycopg.Connection[Any]:
        """A new connection, the schema checked. ``hot``: for the claim connection, whose
        claim statement runs thousands of times (see :data:`CLAIM_SESSION`). ``timeout``:
        seconds after which the failover fence's statement is cancelled (the keeper's bound;
        a migration is never cut short)."""
        # Poll-only mode is for PgBouncer in transaction pooling: no prepared statements there.
        prepare = self.options.use_listen_notify
        conn = connect(self.conninfo, prepare=prepare)
        if hot and prepare:
            for setting in CLAIM_SESSION:
                conn.execute(setting, prepare=False)
        self.ensure_schema(conn)
        if self.options.failover_fence:
            try:
                with bounded(conn, timeout):
                    self.fence_epoch(conn)
            except BaseException:
                conn.close()
                raise
        return conn

    def fence_epoch(self, conn: psycopg.Connection[Any]) -> None:
        """On a new connection: if the server started since claim numbers were last fenced (a
        restart, a promoted standby, a restore), move their base up, once, so none handed out
        before can be handed out again (0022_outage_leases.sql; the claim would do it too,
        this logs it: PGJ-213). One row read when nothing changed."""
        row = conn.execute(self.core.q["epoch_fence"], prepare=False).fetchone()
        if row and row[0] and row[1] is not None:
            log_event("pgjobs.epoch.fenced", base=int(row[1]))

    def ensure_schema(self, conn: psycopg.Connection[Any]) -> None:
        """Migrate on first connect of this process unless auto_migrate is off."""
        if self._migrated:
            return
        with self._migrate_lock:
            if self._migrated:
                return
            try:
                behind = schema_version(conn, self.options.schema) < latest_version()
            except psycopg.errors.InsufficientPrivilege as exc:
                raise denied(exc, f"reading schema {self.options.schema!r}") from exc
            if behind:
                if not self.options.auto_migrate:
                    raise MigrationError(
                        f"schema {self.options.schema!r} is not installed or is out of date, "
                        "and auto_migrate is off: run `pgjobs migrate`")
                migrate(conn, self.options.schema)
            self._migrated = True

    def publishing(self, fn: Callable[[psycopg.Connection[Any]], Any]) -> Any:
        """Run ``fn`` on the shared publish connection (autocommit: durable on return), after
        this process's unconfirmed publishes are confirmed: ``fn`` sees them, in order.

        A connection found dead (a terminated backend, a restarted server) is replaced and
        ``fn`` runs once more on the new one: what ran on the dead one did not commit, or
        (a connection lost in the commit's reply) is fenced or idempotent, or is a publish
        that kombu's own retry would send again anyway."""
        with self._publish_lock:
            for attempt in (1, 2):
                conn = self._publish_connection()
                try:
                    if self._unconfirmed is not None:
                        # an earlier publish's failure is raised at the next publish, not here
                        self._unconfirmed.confirm(raise_failed=False)
                    return fn(conn)
                except psycopg.errors.InsufficientPrivilege as exc:
                    # not a lost connection: kombu must not retry it (forever, for a revoke)
                    raise denied(exc, "publishing") from exc
                except psycopg.OperationalError:
                    if not (conn.closed or conn.broken):
                        raise  # the statement failed (a timeout): the connection is fine
                    self._drop_publish_connection()
                    if attempt == 2:
                        raise
        raise AssertionError("unreachable")  # pragma: no cover

    def settle(self, pairs: list[Pair], *, requeue: bool, uncount: bool) -> None:
        """Fenced requeue (to ready) or bury (``reject``, to the dead letters). When the
        database cannot be reached even on a new connection, the failure is logged, never
        raised at Celery, and these leases are no longer renewed: they lapse and the rows come
        back (an attempt counted) — never stranded behind a lease this process renews.
        Deliveries already handed back (:meth:`hand_back_held`) are skipped."""
        if self._released:
            pairs = [p for p in pairs if p not in self._released]
            if not pairs:
                return
        if requeue:  # a hand-back (uncount: never started) is no outcome: listeners skip it
            self._settle(pairs, "handback" if uncount else "requeue",
                         lambda c: self.core.requeue(c, pairs, uncount=uncount))
        else:
            error = None
            for pair in pairs if self._reject_reasons else ():
                task_id = (self._delivered.get(pair) or {}).get("id")
                reason = self._reject_reasons.pop(task_id, None) \
                    if isinstance(task_id, str) else None
                if reason is not None:
                    error = {"type": "Reject", "message": reason}
            self._settle(pairs, "reject", lambda c: self.core.bury(
                c, pairs, reason="rejected", error=error))

    def note_reject_reason(self, task_id: str, reason: str) -> None:
        """The reason the coming reject of Celery task ``task_id`` gives (``Reject(reason,
        requeue=False)``, told by celery_ext): stored in the dead letter's ``error``. Needs the
        delivery's headers (kept while a settle listener is registered). Bounded: a reason
        whose reject never comes is dropped with the oldest."""
        if len(self._reject_reasons) >= _MAX_REMEMBERED:
            self._reject_reasons.pop(next(iter(self._reject_reasons)))
        self._reject_reasons[task_id] = reason[:64 * 1024]

    def note_delivery(self, job_id: int, claim: int, headers: Any) -> None:
        """Remember a delivered message's headers for the settle and run listeners (only when
        there are any: nothing is kept otherwise)."""
        if (settle_listeners or run_listeners) and isinstance(headers, dict):
            if len(self._delivered) >= _MAX_REMEMBERED:
                self._delivered.pop(next(iter(self._delivered)))
            self._delivered[(job_id, claim)] = headers

    def tell_run(self, why: str, pairs: list[Pair]) -> None:
        """Tell the run listeners that these held runs must end (``cancelled`` or ``lost``)."""
        for pair in pairs:
            headers = self._delivered.get(pair) or {}
            for fn in list(run_listeners):
                try:
                    fn(why, pair[0], pair[1], headers)
                except Exception as exc:
                    log_event("pgjobs.settled.listener_failed", job_id=pair[0],
                              error=one_line(exc))

    def _tell_settled(self, sent: list[Pair], hit: set[int], action: str) -> None:
        outcome = _OUTCOMES.get(action)
        for pair in sent:
            headers = self._delivered.pop(pair, None)
            if pair[0] not in hit or outcome is None:
                continue  # missed its fence: nothing landed, nobody is told
            for fn in list(settle_listeners):
                try:
                    fn(outcome, pair[0], pair[1], headers or {})
                except Exception as exc:
                    log_event("pgjobs.settled.listener_failed", job_id=pair[0],
                              error=one_line(exc))

    def _settle(self, pairs: list[Pair], action: str,
                statement: Callable[[psycopg.Connection[Any]], set[int]]) -> None:
        """Run a fenced settle on the publish connection (once more on a new one if it
        died); if it fails for good, stop renewing its leases so they lapse (PGJ-212)."""
        try:
            hit = self.publishing(statement)
        except (psycopg.Error, PgJobsError) as exc:
            self.forget(pairs)
            log_event("pgjobs.settle.failed", settle=action, count=len(pairs),
                      error=one_line(exc))
            return
        self.settled(pairs, hit, action)

    def bury_malformed(self, rows: list[tuple[Any, str]]) -> None:
        """Dead-letter claimed rows whose message is not a kombu message (reason
        ``malformed``, the parse error recorded): one bad row never stalls the others."""
        for row, error in rows:
            pair = [(row.id, row.claim)]
            log_event("pgjobs.claim.malformed", job_id=row.id, queue=row.queue,
                      error=error[:300])
            # if it fails, its lease lapses: it comes back and is buried then
            self._settle(pair, "bury", lambda c, p=pair, e=error: self.core.bury(
                c, p, reason="malformed", error={"code": "PGJ-211", "message": e}))

    def publish(self, job: NewJob) -> None:
        """Publish one message: held for the batch inside ``kombu_pgjobs.batch()``, sent
        unconfirmed with ``confirm_publish=False``, else inserted before returning.

        A guarded message (an idempotency key or a tenant queue cap) is always confirmed,
        whatever ``confirm_publish`` says: its outcome (inserted, or the holder of its key;
        refused by the cap) is what the publisher acts on, so it must be known at return
        (:func:`kombu_pgjobs.core.take_publish_outcome`).

        Inside an outbox ``transaction()`` block on this database the row is written on the
        block's connection, in the app's transaction (:meth:`in_caller_transaction`)."""
        if self.in_caller_transaction(lambda conn: self.core.publish(conn, job),
                                      guarded=job.guarded):
            return
        held = pending(self)
        if held is not None:  # inside kombu_pgjobs.batch(): inserted when the block exits
            held.append(job)
            return
        if self.options.confirm_publish or job.guarded:
            self.publishing(lambda conn: self.core.publish(conn, job))
            return
        with self._publish_lock:
            self._publish_connection()
            unconfirmed = self._unconfirmed
            assert unconfirmed is not None
            try:
                unconfirmed.send(job)
            except psycopg.OperationalError:
                self._drop_publish_connection()  # this message was not taken: kombu retries it
                raise
            if unconfirmed.broken:
                # taken, sent or not: it goes again, first, on the next connection
                self._drop_publish_connection()

    def in_caller_transaction(self, fn: Callable[[psycopg.Connection[Any]], Any], *,
                              guarded: bool = False) -> bool:
        """Run the message write ``fn`` on the open outbox block's connection (the app's
        transaction) and return True; False outside a block. A guarded write (it may be
        refused by a tenant cap) runs in a savepoint, so a refusal leaves the app's
        transaction usable."""
        app_conn = _block_connection(self)
        if app_conn is None:
            return False
        conn = cast("psycopg.Connection[Any]", app_conn)  # what the core uses of one
        if guarded:
            with app_conn.transaction():
                fn(conn)
        else:
            fn(conn)
        return True

    def confirm_publishes(self, timeout: float | None = None) -> None:
        """Wait until PostgreSQL confirmed every publish this process sent unconfirmed
        (``confirm_publish=False``); raise :class:`PublishFailed` if one failed. A connection
        found broken is replaced once, its unconfirmed messages sent again on the new one."""
        with self._publish_lock:
            for attempt in (1, 2):
                self._publish_connection()
                try:
                    if self._unconfirmed is not None:
                        self._unconfirmed.confirm(timeout)
                    return
                except psycopg.OperationalError:
                    self._drop_publish_connection()
                    if attempt == 2:
                        raise

    def _publish_connection(self) -> psycopg.Connection[Any]:
        """The publish connection (under the publish lock), opened on first use. Publishes a
        broken connection left unconfirmed are sent again on the new one, first."""
        conn = self._publish_conn
        if conn is not None and not conn.closed:
            return conn
        if self.pid != os.getpid():
            raise PgJobsError("a forked process used its parent's pgjobs backend")
        self._drop_publish_connection()  # a closed one's unconfirmed messages go again
        conn = self._publish_conn = self.connect()
        if not self.options.durable_publish:
            # per publish transaction, never a session SET (it would leak behind PgBouncer)
            self.core.commit_async(conn)
        if not self.options.confirm_publish:
            insert = self.core.insert_query("job_insert",
                                            durable=self.options.durable_publish,
                                            own_transaction=True)  # one per message
            self._unconfirmed = Unconfirmed(conn, insert,
                                            prepare=self.options.use_listen_notify)
            if self._resend:
                try:
                    self._unconfirmed.resend(self._resend)
                except psycopg.OperationalError:
                    self._unconfirmed = self._publish_conn = None
                    conn.close()
                    raise
                if not self._unconfirmed.broken:
                    log_event("pgjobs.publish.resent", count=len(self._resend))
                self._resend = []
        return conn

    def _drop_publish_connection(self) -> None:
        conn, self._publish_conn = self._publish_conn, None
        if self._unconfirmed is not None:
            self._resend.extend(self._unconfirmed.jobs)
            for error in self._unconfirmed.take_failed():  # nobody is left to raise them
                log.error("[%s] a publish failed and was not queued: %s", PublishFailed.code,
                          error, extra={"action": "pgjobs.publish.failed"})
            self._unconfirmed = None
        if conn is not None:
            conn.close()

    # -- acks ----------------------------------------------------------------------------
    def buffer_ack(self, job_id: int, claim: int) -> None:
        """Thread-safe and non-blocking: called from pool threads. The ack of a run an
        operator cancelled (its holder learned it) moves the message to the dead letters as
        ``cancelled`` instead, at once."""
        if self._released and (job_id, claim) in self._released:
            self._released.discard((job_id, claim))  # settled already: nothing to ack
            return
        if self.cancelled and (job_id, claim) in self.cancelled:
            self.cancelled.discard((job_id, claim))
            pairs = [(job_id, claim)]
            self._settle(pairs, "cancel", lambda c: self.core.bury(c, pairs, reason="cancelled"))
            return
        with self._acks_lock:
            first = not self._acks
            self._acks.append((job_id, claim, time.monotonic()))
        if first:
            for wake in self._ack_listeners:
                wake()
            keeper = self._keeper
            if keeper is not None:
                keeper.ack_event.set()

    def add_ack_listener(self, wake: Callable[[], None]) -> None:
        self._ack_listeners.append(wake)

    def remove_ack_listener(self, wake: Callable[[], None]) -> None:
        try:
            self._ack_listeners.remove(wake)
        except ValueError:
            pass

    def oldest_ack_age(self) -> float | None:
        with self._acks_lock:
            return time.monotonic() - self._acks[0][2] if self._acks else None

    def take_acks(self) -> list[Pair]:
        with self._acks_lock:
            acks, self._acks = self._acks, []
            self._settling.update(a[0] for a in acks)
        return [(a[0], a[1]) for a in acks]

    def lost(self, pairs: list[Pair], alive: set[int]) -> list[Pair]:
        """Of held pairs a renewal did not find, those really lost: still held, and not acked
        (buffered, or being flushed right now, when the row may be gone already)."""
        with self._acks_lock:
            acking = self._settling | {a[0] for a in self._acks}
        with self._held_lock:
            return [(i, c) for i, c in pairs
                    if i not in alive and i not in acking and self.held.get(i) == c]

    def forget(self, pairs: list[Pair]) -> None:
        """Stop renewing these leases (settled, or lost)."""
        with self._held_lock:
            for job_id, claim in pairs:
                if self.held.get(job_id) == claim:
                    del self.held[job_id]
                self.cancelled.discard((job_id, claim))

    def release(self, pairs: list[Pair]) -> None:
        """These deliveries' messages were settled by a statement of the caller's own, fenced
        on the same ``(id, claim)`` (celery_ext's durable sleep hands its message back parked):
        stop renewing their leases, and drop the ack Celery will send for them (it would only
        miss its fence and log PGJ-201). Bounded: kept until that ack comes."""
        self.forget(pairs)
        with self._held_lock:
            if len(self._released) >= _MAX_REMEMBERED:
                self._released.clear()
            self._released.update(pairs)

    def cut_off(self, unfinished: set[Pair]) -> tuple[int, int]:
        """A cold shutdown of a pool that cannot stop its runs (celery_ext, threads): the
        deliveries in ``unfinished`` (running or not started) go back at once and uncounted
        (an interrupted run is not an attempt); every other one this process holds and has
        not acked finished, its ack waiting in Celery's event loop, which a cold shutdown
        stops: it is acked here. Whatever Celery sends for them later is dropped. Returns
        (handed back, acked)."""
        with self._acks_lock:
            acking = self._settling | {a[0] for a in self._acks}
        held = [(i, c) for i, c in self.held_pairs() if i not in acking]
        back = [p for p in held if p in unfinished]
        done = [p for p in held if p not in unfinished]
        if back:
            self.settle(back, requeue=True, uncount=True)
            self.release(back)
        for pair in done:
            self.buffer_ack(*pair)
        self.release(done)
        return len(back), len(done)

    def renew_soon(self) -> None:
        """Have the keeper renew now, not at its next tick (an operator cancelled a running
        message somewhere: the renewal reads which). At most once a second."""
        keeper = self._keeper
        if keeper is not None:
            keeper.renew_wanted.set()
            keeper.ack_event.set()

    def note_outcome(self, pair: Pair, outcome: str) -> None:
        """The run of held delivery ``pair`` ended as ``outcome`` (``failed``, ``dropped`` or
        ``requeued``: celery_ext, for a Celery retry): its ack counts and records that word
        in the counters and the history instead of ``completed`` (no round trip: it goes with
        the ack)."""
        self.core.note_outcome(pair, outcome)

    def settled(self, sent: list[Pair], hit: set[int], action: str) -> None:
        """Forget settled leases; log fenced misses (never raise at Celery)."""
        self.forget(sent)
        if hit:
            self.last_settled_at = time.monotonic()
        with self._acks_lock:
            self._settling.difference_update(i for i, _ in sent)
            self._churn += len(hit)
            churned = self.options.vacuum_every and self._churn >= self.options.vacuum_every
            if churned:
                self._churn = 0
        if churned and self._keeper is not None:
            self._keeper.vacuum_wanted.set()
            self._keeper.ack_event.set()
        for job_id, claim in sent:
            if job_id not in hit:
                log_event("pgjobs.settle.unowned", job_id=job_id, fence=claim, settle=action)
        if settle_listeners:
            self._tell_settled(sent, hit, action)

    def flush_acks(self, conn: psycopg.Connection[Any], *,
                   timeout: float | None = None) -> int:
        """Settle the buffered acks in one statement (``timeout``: cancelled after that many
        seconds, the keeper's bound). A flush that fails, cancelled included, settled nothing
        (one statement): its acks go back to the buffer with the outcome words noted for
        them, for the next flush."""
        acks = self.take_acks()
        if acks:
            noted = self.core.noted_outcomes(acks)  # the statement takes the words it sends
            try:
                hit = self.core.ack(conn, acks, timeout=timeout)
            except BaseException:
                for pair, word in noted.items():
                    self.core.note_outcome(pair, word)
                self.restore_acks(acks)
                raise
            self.settled(acks, hit, "ack")
        return len(acks)

    def flush_pending(self) -> bool:
        """Flush buffered acks on the publish connection (a new one if it died); what still
        fails stays buffered for the keeper's next tick. True when nothing is left."""
        if self.oldest_ack_age() is None:
            return True
        try:
            self.publishing(self.flush_acks)
        except (psycopg.Error, PgJobsError) as exc:
            log.warning("pgjobs.ack.flush_failed %s", exc, extra={"action": "flush"})
            return False
        return True

    def restore_acks(self, acks: list[Pair]) -> None:
        """Put acks back after a failed flush, so the next flush retries them."""
        now = time.monotonic()
        with self._acks_lock:
            self._acks[:0] = [(i, c, now) for i, c in acks]
            self._settling.difference_update(i for i, _ in acks)

    # -- leases --------------------------------------------------------------------------
    def hold(self, pairs: list[Pair]) -> None:
        with self._held_lock:
            for job_id, claim in pairs:
                self.held[job_id] = claim
        self.keeper()

    def held_pairs(self) -> list[Pair]:
        with self._held_lock:
            return list(self.held.items())

    def consume(self, queues: list[str], delta: int) -> None:
        with self._held_lock:
            for q in queues:
                n = self.consumed.get(q, 0) + delta
                if n > 0:
                    self.consumed[q] = n
                else:
                    self.consumed.pop(q, None)
        if delta > 0:
            first = not self._consumer_seen
            self._consumer_seen = True
            keeper = self.keeper()
            if first:  # listed in pgjobs_consumer now, not a tick later
                keeper.tick_wanted.set()
                keeper.ack_event.set()

    def deregister(self) -> None:
        """A clean stop: stop the keeper (so no tick upserts the row again) and delete this
        process's ``pgjobs_consumer`` row, when it ever consumed. Never raises: a row left
        behind goes after three keeper ticks of another consumer."""
        if not self._consumer_seen or self.pid != os.getpid():
            return
        with self._keeper_lock:
            keeper, self._keeper = self._keeper, None
        if keeper is not None:
            keeper.stop()
        try:
            self.publishing(lambda c: c.execute(self.core.q["consumer_forget"],
                                                {"worker": self.worker}))
            self._consumer_seen = False
        except (psycopg.Error, PgJobsError) as exc:
            log.warning("pgjobs.consumer.deregister_failed %s", one_line(exc),
                        extra={"action": "deregister"})

    def close(self) -> None:
        """Confirm publishes, flush acks, stop the keeper, deregister a consumer and close the
        shared connections."""
        self.deregister()
        with self._keeper_lock:
            keeper, self._keeper = self._keeper, None
        if keeper is not None:
            keeper.stop()
        with self._publish_lock:  # one hold: no publish slips in between
            self._confirm_before_close()
            conn = self._publish_conn
            if conn is None or conn.closed or \
                    conn.pgconn.pipeline_status == psycopg.pq.PipelineStatus.OFF:
                self.flush_pending()  # on this connection, or a new one if it died
            conn, self._publish_conn = self._publish_conn, None
            self._unconfirmed = None
            if conn is not None and not conn.closed:
                conn.close()

    def _confirm_before_close(self) -> None:
        """Unconfirmed publishes get one more connection if theirs broke; past that, say
        how many may be lost."""
        if (self._unconfirmed is None and not self._resend) or self.pid != os.getpid():
            return  # nothing to confirm, or a forked child: the parent's messages and socket
        for attempt in (1, 2):
            try:
                self.confirm_publishes(self.options.connect_timeout)
                return
            except PublishFailed as exc:
                log.error("%s", exc, extra={"action": "pgjobs.publish.failed"})
                return
            except TimeoutError:  # the server may still commit them: never sent again
                with self._publish_lock:
                    lost = len(self._unconfirmed.jobs) if self._unconfirmed else 0
                    self._unconfirmed = None
                    self._resend = []
                log_event("pgjobs.publish.lost", logging.ERROR, count=lost)
                return
            except (psycopg.OperationalError, DatabaseUnavailable):
                if attempt == 2:
                    with self._publish_lock:
                        lost = len(self._resend) + (
                            len(self._unconfirmed.jobs) if self._unconfirmed else 0)
                        self._resend = []
                    log_event("pgjobs.publish.lost", logging.ERROR, count=lost)

    def keeper(self) -> Keeper:
        with self._keeper_lock:
            if self._keeper is None or not self._keeper.is_alive():
                self._keeper = Keeper(self)
                self._keeper.start()
            return self._keeper


#: Most of its time a keeper spends in the vacuums that settled rows ask for.
VACUUM_DUTY = 0.02


class Keeper(threading.Thread):
    """Renews this process's leases, rescues lapsed ones fleet-wide, expires messages/queues.

    It runs in the process that holds the leases, on its own connection, so a CPU-bound task in
    a prefork child cannot starve renewal, and a busy consumer thread cannot either. One tick
    every lease_ttl/3, one statement (plus a renewal when it holds leases).

    Every statement it runs is cancelled after lease_ttl/2 (:attr:`bound`), whatever the
    session's statement_timeout, and before any statement but a renewal it renews again once
    a tick's interval has passed since the last renewal (:meth:`keep_leases`): two renewals
    are never more than lease_ttl/3 + lease_ttl/2 apart, however long a lock holds one of its
    statements. A statement cut short settles nothing and is tried again later.
    """

    def __init__(self, backend: Backend) -> None:
        super().__init__(name="pgjobs-keeper", daemon=True)
        self.backend = backend
        self.stop_event = threading.Event()
        self.ack_event = threading.Event()  # wakes the keeper: acks buffered, or a vacuum wanted
        self.vacuum_wanted = threading.Event()
        self.renew_wanted = threading.Event()  # renew_soon(): a cancel was announced
        self.tick_wanted = threading.Event()  # a whole tick now: the process began consuming
        self._renewed_at = 0.0  # monotonic time of the last renewal
        self._vacuum_after = 0.0  # monotonic time before which no churn vacuum starts
        self._conn: psycopg.Connection[Any] | None = None
        # Acks are normally folded into the consumer's next claim or flushed by it within
        # ack_flush_interval; the keeper flushes them only if nobody did (a kombu user who
        # acked and stopped draining, a flush that failed), a little later so the two rarely
        # race.
        self.ack_grace = max(0.05, 10 * backend.options.ack_flush_interval)
        # Since when (monotonic) this keeper has reached the database without a break: a
        # failed tick, a new connection or a gap between ticks longer than two intervals (a
        # stall) starts it again. It judges other processes gone (rescues their lapsed leases,
        # drops their consumer rows, expires queues) only after a full lease of it: an outage
        # longer than a lease is nobody's lapse (docs/delivery.md).
        self.reachable_since: float | None = None
        self._last_ok: float | None = None
        self._failing = False  # the last tick failed: the next failure is logged at DEBUG

    def run(self) -> None:
        b = self.backend
        interval = b.options.tick_interval
        ack_grace = self.ack_grace
        next_tick = time.monotonic()  # at once: a consumer is listed when it starts
        while not self.stop_event.is_set():
            wake_at = next_tick
            if self.vacuum_wanted.is_set():
                wake_at = min(wake_at, self._vacuum_after)
            self.ack_event.wait(max(0.0, wake_at - time.monotonic()))
            if self.stop_event.is_set():
                break
            try:
                if self.vacuum_wanted.is_set() and time.monotonic() >= self._vacuum_after:
                    self.vacuum_wanted.clear()
                    self.keep_leases(self.connection())
                    started = time.monotonic()
                    try:
                        # Never long enough to hold up the next lease renewal much.
                        b.core.vacuum(self.connection(), timeout=interval / 2)
                    except (psycopg.errors.QueryCanceled, DatabaseTimeout):
                        log.info("pgjobs.keeper.vacuum_cancelled", extra={"action": "keeper"})
                    # At most VACUUM_DUTY of the time vacuuming: a vacuum of a deep table
                    # (its indexes are read whole) waits longer before the next one.
                    took = time.monotonic() - started
                    self._vacuum_after = time.monotonic() + took * (1 / VACUUM_DUTY - 1)
                if self.renew_wanted.is_set() and time.monotonic() - self._renewed_at >= 1.0:
                    self.renew_wanted.clear()
                    self.renew(self.connection(), self.bound)
                if self.ack_event.is_set():
                    self.ack_event.clear()
                    if self.stop_event.wait(ack_grace):
                        break
                    age = b.oldest_ack_age()
                    if age is not None and age >= ack_grace:
                        self.flush(self.connection())
                if time.monotonic() >= next_tick or self.tick_wanted.is_set():
                    self.tick_wanted.clear()
                    next_tick = time.monotonic() + interval
                    self.tick()
            except PoolerUnsupported as exc:  # a configuration error: the consumer raises it
                b.unsupported = exc
                log_event("pgjobs.keeper.unsupported", logging.ERROR, error=exc.message)
                for wake in list(b._ack_listeners):
                    wake()
                break
            except (psycopg.Error, PgJobsError) as exc:  # unreachable database: retry next tick
                # once per outage: it retries every second until the database answers
                log.log(logging.DEBUG if self._failing else logging.WARNING,
                        "pgjobs.keeper.error %s", exc, extra={"action": "keeper"})
                self._failing = True
                self.reachable_since = self._last_ok = None
                # soon again: after an outage, the renewal that revives this process's leases
                # should come well before other keepers judge them (a lease after their own)
                next_tick = min(next_tick, time.monotonic() + min(interval, 1.0))
                if self._conn is not None:
                    self._conn.close()
                    self._conn = None
            except Exception:  # pragma: no cover - never let the keeper die silently
                log.exception("pgjobs.keeper.crash")
        if self._conn is not None:
            self._conn.close()

    def stop(self) -> None:
        self.stop_event.set()
        self.ack_event.set()
        if self is not threading.current_thread():
            self.join(5)

    @property
    def bound(self) -> float:
        """Seconds after which any statement of the keeper is cancelled: half a lease."""
        return self.backend.options.lease_ttl / 2

    def connection(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            self.reachable_since = self._last_ok = None  # a new connection: a new count
            self._conn = self.backend.connect(timeout=self.bound)
        return self._conn

    def keep_leases(self, conn: psycopg.Connection[Any]) -> None:
        """Renew first if a tick's interval has passed since the last renewal: called before
        every statement but a renewal, so that statements cut short at :attr:`bound` one
        after another never hold up the next renewal past the lease."""
        if time.monotonic() - self._renewed_at >= self.backend.options.tick_interval:
            self.renew(conn, self.bound)

    def flush(self, conn: psycopg.Connection[Any]) -> None:
        """Flush the buffered acks (bounded): acks a flush could not settle (cut short at
        :attr:`bound` while a key's lock is held, a failed statement) stay buffered for the
        next tick; fenced, a late one only misses. Only a broken connection raises."""
        self.keep_leases(conn)
        try:
            self.backend.flush_acks(conn, timeout=self.bound)
        except PoolerUnsupported:
            raise
        except (psycopg.Error, PgJobsError) as exc:  # still buffered: the next tick
            cut = (f" (not done within the keeper's bound of {self.bound:g}s, half a lease)"
                   if isinstance(exc, _CUT_SHORT) else "")
            log.warning("pgjobs.ack.flush_failed%s %s", cut, exc, extra={"action": "keeper"})
            if conn.closed or conn.broken:
                raise

    def step(self, conn: psycopg.Connection[Any], what: str, run: Callable[[], Any]) -> Any:
        """One statement of the tick after its maintenance (bounded by ``run`` itself): one
        cut short (cancelled at :attr:`bound`, or past lock_timeout) is logged and skipped,
        the next tick asks again; None then."""
        self.keep_leases(conn)
        try:
            return run()
        except _CUT_SHORT as exc:
            if conn.closed or conn.broken:
                raise
            log.warning("pgjobs.keeper.cancelled %s: not done within %gs (the keeper's bound, "
                        "half a lease); the next tick again: %s", what, self.bound,
                        one_line(str(exc)), extra={"action": "keeper"})
            return None

    def may_judge(self, now: float) -> bool:
        """Whether this keeper reached the database for a full lease without a break (counted
        from the start of this tick, which must follow the last good one closely)."""
        interval = self.backend.options.tick_interval
        if self._last_ok is None or now - self._last_ok > 2 * interval + 1.0:
            self.reachable_since = now
        assert self.reachable_since is not None
        return now - self.reachable_since >= self.backend.options.lease_ttl

    def renew(self, conn: psycopg.Connection[Any], bound: float) -> None:
        """Renew every lease this process holds; tell the run listeners of runs an operator
        cancelled and of leases lost."""
        b = self.backend
        self._renewed_at = time.monotonic()
        held = b.held_pairs()
        if not held:
            return
        alive = b.core.renew(conn, held, timeout=bound)
        lost = b.lost(held, set(alive))
        if lost:
            b.forget(lost)
            for i, c in lost:
                log_event("pgjobs.lease.lost", job_id=i, fence=c)
            b.tell_run("lost", lost)
        cancelled = [(i, c) for i, c in held if alive.get(i) and (i, c) not in b.cancelled]
        if cancelled:
            b.cancelled.update(cancelled)
            for i, c in cancelled:
                log_event("pgjobs.run.cancelled", job_id=i, fence=c)
            b.tell_run("cancelled", cancelled)

    def tick(self) -> None:
        b = self.backend
        conn = self.connection()
        core = b.core
        # Every statement of a tick is cancelled after half a lease (bound): a
        # statement_timeout longer than the lease (60 s by default against 30 s), or a lock
        # another session holds, must not let a stuck tick outlast the leases it renews; and
        # before each statement after the first the keeper renews again once a tick's
        # interval has passed (keep_leases).
        bound = self.bound
        self.renew(conn, bound)  # first: nothing else in the tick may hold up a renewal
        age = b.oldest_ack_age()
        if age is not None and age >= self.ack_grace:
            # Acks a failed flush put back (a broken connection, a consumer that stopped, a
            # flush cut short): every tick retries them until they settle.
            self.flush(conn)
        self.keep_leases(conn)
        # Judged after the renewal and the acks, not before: the database may have held them
        # (a stall under this tick), and every other keeper waited as long to renew; a gap
        # since the last good tick longer than two intervals is a break (may_judge).
        fleet = self.may_judge(time.monotonic())
        outcomes = core.maintain(conn, consumed=list(b.consumed), held=len(b.held),
                                 grace=3 * b.options.tick_interval, fleet=fleet,
                                 timeout=bound)
        self._last_ok = time.monotonic()
        self._failing = False
        for outcome, job_id, queue in outcomes:
            if outcome == "release":  # slots whose holder is gone: free them, wake waiters
                self.step(conn, "release_orphans",
                          lambda: core.release_orphans(conn, timeout=bound))
            elif outcome == "vacuum":  # the server's autovacuum is off
                log_event("pgjobs.keeper.vacuum", logging.INFO, schema=b.options.schema)
                self.step(conn, "vacuum", lambda: core.vacuum(conn, timeout=bound))
            elif outcome == "woken":
                log_event("pgjobs.limit.woken", logging.INFO, job_id=job_id, queue=queue)
            elif outcome == "buried":
                log_event("pgjobs.claim.buried", job_id=job_id, queue=queue)
            elif outcome == "requeued":
                log_event("pgjobs.lease.rescued", logging.INFO, job_id=job_id, queue=queue)
            elif outcome == "queue_expired":
                log_event("pgjobs.queue.expired", logging.INFO, queue=queue)
            elif outcome == "queue_missing" and self.step(
                    conn, "redeclare", lambda q=queue: core.redeclare(conn, q, timeout=bound)):
                log_event("pgjobs.queue.redeclared", queue=queue)
        # the automatic retention sweep's turn (issue 34; the sweep has its own thread and
        # connection), then the history rollup's turn, after settles (issue 34)
        self.step(conn, "retention turn",
                  lambda: retention.on_tick(self, conn, timeout=bound))
        self.step(conn, "history rollup", lambda: history.on_tick(self, conn, timeout=bound))


#: a statement that failed for a cancel (the keeper's bound, statement_timeout) or a lock
#: wait, not for a broken connection
_CUT_SHORT = (psycopg.errors.QueryCanceled, psycopg.errors.LockNotAvailable, DatabaseTimeout)


def _no_block(backend: Backend) -> Any:
    return None


#: the open outbox block's connection for a backend (None outside a block): set by
#: :func:`use_outbox` when kombu_pgjobs.broker.outbox is imported; no block is open before
_block_connection: Callable[[Backend], Any] = _no_block


def use_outbox(connection_for: Callable[[Backend], Any]) -> None:
    """Called by the outbox module at import: the backend writes inside an open block through
    ``connection_for`` (the backend does not import the outbox: the outbox stands above it)."""
    global _block_connection
    _block_connection = connection_for
