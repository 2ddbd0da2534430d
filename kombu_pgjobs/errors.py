"""Errors with stable codes.

Every error pgjobs raises derives from :class:`PgJobsError` and carries a ``code`` that is never
renumbered or reused. Codes are grouped by area:

* ``PGJ-1xx`` database, URL and configuration
* ``PGJ-2xx`` leases and fencing (logged, never raised at Celery)
* ``PGJ-3xx`` concurrency and limits
* ``PGJ-4xx`` dead letters and operator commands
* ``PGJ-5xx`` outbox and tenants
* ``PGJ-6xx`` scheduler and leadership
* ``PGJ-7xx`` migrations
* ``PGJ-8xx`` webhooks

The class docstring is the default message; pass a more specific one where it helps the user fix
the mistake. ``docs/reference/errors.md`` lists every code (a unit test keeps the two in step).
"""

from __future__ import annotations

import psycopg

__all__ = [
    "BulkRefused",
    "ConfigurationError",
    "DatabaseTimeout",
    "DatabaseUnavailable",
    "EgressRefused",
    "EmbeddedServerError",
    "InvalidArgument",
    "InvalidCatchUp",
    "InvalidLimit",
    "InvalidLimitKey",
    "InvalidName",
    "InvalidOption",
    "InvalidSSL",
    "InvalidSchedule",
    "InvalidScheduleEntry",
    "InvalidTaskOption",
    "InvalidTenant",
    "InvalidTenantOption",
    "InvalidURL",
    "InvalidWebhookEndpoint",
    "InvalidWebhookEvent",
    "InvalidWebhookSetting",
    "KeyBusy",
    "MessageError",
    "MessageTooLarge",
    "MigrationError",
    "NotFound",
    "NotInTransaction",
    "OutboxBypassed",
    "OutboxNotInstalled",
    "OutboxUnserializable",
    "PermissionDenied",
    "PgJobsError",
    "PoolerUnsupported",
    "PublishFailed",
    "ScheduleEntryExists",
    "ScheduleEntryNotFound",
    "SchemaTooNew",
    "ShardUnavailable",
    "StateConflict",
    "TenantMismatch",
    "TenantRequired",
    "UnknownQueue",
    "UnknownState",
    "UnknownTimezone",
    "UnsupportedConnection",
    "UsageError",
    "WebhookEndpointDisabled",
    "WebhookEndpointNotFound",
    "WebhookRejected",
    "WebhookSecretLocked",
    "WebhookSignatureInvalid",
    "WebhookThrottled",
    "WebhookUnavailable",
    "all_error_classes",
]


class PgJobsError(Exception):
    """pgjobs failed."""

    code = "PGJ-000"

    def __init__(self, message: str | None = None) -> None:
        self.message = message or (self.__doc__ or "").strip().splitlines()[0]
        super().__init__(f"[{self.code}] {self.message}")


class ConfigurationError(PgJobsError):
    """The pgjobs configuration is invalid."""

    code = "PGJ-100"


class InvalidURL(ConfigurationError):
    """The broker URL is malformed: use pgjobs://user:password@host:port/database."""

    code = "PGJ-101"


class InvalidOption(ConfigurationError):
    """A transport option has an invalid value; see docs/reference/configuration.md."""

    code = "PGJ-102"


class InvalidName(ConfigurationError):
    """A schema, queue or exchange name is invalid."""

    code = "PGJ-103"


class DatabaseUnavailable(PgJobsError):
    """PostgreSQL could not be reached; check the broker URL and that the server runs."""

    code = "PGJ-104"


class EmbeddedServerError(PgJobsError):
    """The embedded PostgreSQL server could not be started; install kombu-pgjobs[embedded]."""

    code = "PGJ-105"


class MessageError(PgJobsError):
    """A message could not be published: its properties are invalid."""

    code = "PGJ-106"


class PublishFailed(PgJobsError):
    """A publish sent without confirmation (confirm_publish=False) failed in PostgreSQL."""

    code = "PGJ-107"


class DatabaseTimeout(PgJobsError, psycopg.DatabaseError):
    """A statement ran into the lock_timeout or statement_timeout transport option.

    A channel error, never a connection error: the connection is fine, the statement was
    cancelled (a table locked by someone else, a runaway statement), so kombu and Celery must
    not reconnect in a loop over it. It is also a ``psycopg.DatabaseError`` (not an
    ``OperationalError``), so code that handles database errors around a statement still does."""

    code = "PGJ-108"


class InvalidSSL(ConfigurationError):
    """The TLS settings (broker_use_ssl, Connection(ssl=...), ?ssl= in the URL) cannot be
    mapped to libpq: use ssl=True, libpq names (sslmode, sslrootcert, sslcert, sslkey) or
    cert_reqs/ca_certs/certfile/keyfile."""

    code = "PGJ-109"


class MessageTooLarge(MessageError):
    """A message is larger than the ``max_message_bytes`` transport option allows: nothing was
    written. Keep large data in the app's tables (or object storage) and send its key."""

    code = "PGJ-110"


class PermissionDenied(PgJobsError):
    """The database role this process connects as lacks a right the operation needs (a
    publisher role deleting rows, a role with no grant on the schema): raised at once, never
    retried as if the connection had failed. Give the role the rights of its component
    (``pgjobs roles``, docs/security.md) or connect as another."""

    code = "PGJ-111"


class PoolerUnsupported(ConfigurationError):
    """The server does not hold this connection's prepared statements (one it made is
    missing, or another client's has its name): a transaction pooler (PgBouncer with
    ``pool_mode = transaction``) sits between this process and PostgreSQL, and the transport's
    default session mode (prepared statements, LISTEN) cannot work through it. Set the
    transport option ``use_listen_notify=False`` (no prepared statements, polling;
    docs/operations.md, Behind PgBouncer), or pool in session mode.

    Not a connection error: never retried as one. A publish raises it at the caller, a
    consumer at every claim from then on, and a Celery worker exits with it."""

    code = "PGJ-112"


class ShardUnavailable(DatabaseUnavailable):
    """The database of one shard of a shard map could not be reached. Only that shard's queues
    are affected: their publishes (and ``basic_get``, ``queue_purge``, a passive declare) raise
    this; their consumers wait while the shard's claim connection reconnects by itself; acks
    of messages held from it stay buffered until it is back. The default database and the
    other shards go on (docs/sharding.md).

    A :class:`DatabaseUnavailable`, so a kombu connection error: kombu's publish retry
    (Celery's ``retry_policy``) sends the message again, each time on a reconnect that opens
    only the default database; when the retries are used up the publisher gets this error
    (kombu wraps it in its ``OperationalError``) and nothing was written. Start the shard's
    server, or check its URL in the shard map."""

    code = "PGJ-113"
    #: the shard's database as operators see it (``host:port/database``, never a password)
    shard: str | None = None


class InvalidLimit(PgJobsError):
    """A concurrency limit or rate is invalid: a limit is a whole number of at least 1."""

    code = "PGJ-301"


class KeyBusy(PgJobsError):
    """A message was refused because its concurrency key was full (when_busy='fail').

    Not raised at the publisher: the claim settles the message into the dead letters (reason
    ``refused``) with this code in its error, and its task body never runs."""

    code = "PGJ-302"


class InvalidLimitKey(InvalidLimit):
    """A concurrency key is invalid: a key function must return a non-empty string of at most
    200 characters."""

    code = "PGJ-303"


class NotFound(PgJobsError):
    """No such message, queue or dead letter."""

    code = "PGJ-401"


class UnknownState(PgJobsError):
    """No such message state: use ready, delayed, running, waiting or dead."""

    code = "PGJ-402"


class UnknownQueue(NotFound):
    """No such queue: it has no declaration, no messages and no dead letters."""

    code = "PGJ-403"


class BulkRefused(PgJobsError):
    """A bulk operator command was refused: name a queue and keep --limit within its range."""

    code = "PGJ-404"


class InvalidArgument(PgJobsError):
    """An operator command argument is invalid (a duration, timestamp, id or cursor)."""

    code = "PGJ-405"


class StateConflict(PgJobsError):
    """The message is running: wait for it to finish or its lease to lapse, or cancel it."""

    code = "PGJ-406"


class InvalidTaskOption(ConfigurationError):
    """A celery_ext task option is invalid (max_attempts, terminal, retry_after, retryable...)."""

    code = "PGJ-407"


class UsageError(InvalidArgument):
    """The command line is not a valid pgjobs command: see `pgjobs COMMAND --help`.

    The CLI's own argument parser raises it (unknown command or option, missing or malformed
    argument) so that a usage error is answered like any other bad input: its code, exit status
    2, and JSON under ``--json``."""

    code = "PGJ-408"


class TenantRequired(InvalidTaskOption):
    """The app sets ``pgjobs_tenant_required = True`` and a task was declared without
    ``tenant=``: declare whose work it is (``tenant=lambda *a, **kw: kw["org_id"]``) or
    ``tenant="none"`` for work that acts for no tenant."""

    code = "PGJ-501"


class InvalidTenantOption(InvalidTaskOption):
    """A task's ``tenant=`` is neither a callable of the task's arguments nor ``"none"``."""

    code = "PGJ-502"


class InvalidTenant(PgJobsError):
    """A task's tenant function raised on the task's arguments, or returned something other than
    a non-empty string of at most 200 characters without control characters: nothing was
    written (at publish), or the body did not run (in the worker)."""

    code = "PGJ-503"


class TenantMismatch(PgJobsError):
    """A message's ``x-pgjobs-tenant`` header names another tenant than the task's declaration
    gives for the message's arguments: the header is attribution, never authority, so the body
    is not run under either (the message was published by hand or tampered with)."""

    code = "PGJ-504"


class InvalidIdempotencyKey(PgJobsError):
    """A message's idempotency key (``apply_async(idempotency_key=...)``, a task's declared
    ``idempotency_key=`` function, or the ``x-pgjobs-idempotency-key`` header) is not a
    non-empty string of at most 200 characters without control characters, or the function
    raised: nothing was written."""

    code = "PGJ-505"


class TenantQueueFull(PgJobsError):
    """Publishing would give a tenant more live messages (ready, delayed, waiting or running)
    than ``pgjobs_tenant_max_queued`` allows: nothing was written. Publish again once some of
    the tenant's messages have run, or raise the cap."""

    code = "PGJ-506"


class MigrationError(PgJobsError):
    """The pgjobs schema could not be migrated."""

    code = "PGJ-701"


class SchemaTooNew(MigrationError):
    """The pgjobs schema is newer than this version of kombu-pgjobs: upgrade kombu-pgjobs (every
    process that uses the schema) before using it."""

    code = "PGJ-702"


# -- webhooks (PGJ-8xx) -------------------------------------------------------------------------
class InvalidWebhookEndpoint(ConfigurationError):
    """A webhook endpoint is invalid: an http(s) URL with a host and no user:password, a secret
    of 16 to 1000 characters without control characters, disable_after a whole number in
    1-1000000. Nothing was written."""

    code = "PGJ-801"


class WebhookEndpointNotFound(NotFound):
    """No webhook endpoint with this id (see `pgjobs webhooks ls`)."""

    code = "PGJ-802"


class InvalidWebhookSetting(ConfigurationError):
    """A ``pgjobs_webhook_*`` app setting is invalid; see docs/reference/configuration.md."""

    code = "PGJ-803"


class InvalidWebhookEvent(PgJobsError):
    """A webhook event cannot be sent: its type or id is not a non-empty string of at most 200
    characters without control characters, or its payload is not JSON. Nothing was written."""

    code = "PGJ-804"


class EgressRefused(PgJobsError):
    """A webhook endpoint resolves to an address pgjobs refuses to connect to (private,
    loopback, link-local, unspecified, multicast, reserved or cloud metadata): add the host or
    network to ``pgjobs_webhook_allow_hosts`` if it is really meant."""

    code = "PGJ-805"


class WebhookRejected(PgJobsError):
    """The endpoint answered with a status that retrying cannot change (a 4xx other than 408 or
    429, a redirect, or any other non-2xx): the delivery failed for good."""

    code = "PGJ-806"


class WebhookUnavailable(PgJobsError):
    """The endpoint answered 408 or 5xx, or could not be reached or did not answer in time: the
    delivery is retried with exponential backoff."""

    code = "PGJ-807"


class WebhookThrottled(WebhookUnavailable):
    """The endpoint answered 429 (or 503 with Retry-After): the next attempt waits the time it
    named."""

    code = "PGJ-808"


class WebhookEndpointDisabled(PgJobsError):
    """The webhook endpoint is disabled (by an operator, or after too many consecutive failed
    deliveries): the delivery was not attempted. `pgjobs webhooks enable ID` turns it back on;
    `pgjobs dead requeue` then sends what was dead-lettered meanwhile."""

    code = "PGJ-809"


class WebhookSignatureInvalid(PgJobsError):
    """A received webhook's signature does not verify: missing or malformed header, timestamp
    outside the tolerance, or no signature made with any of the given secrets."""

    code = "PGJ-810"


class WebhookSecretLocked(PgJobsError):
    """An endpoint's secret is stored encrypted and this process cannot decrypt it: none of
    the keys in ``pgjobs_webhook_secret_keys`` opens it (a key missing or rotated out too
    early), or the ``cryptography`` package is missing. The delivery is retried (another
    worker may hold the key); nothing was sent."""

    code = "PGJ-811"
class InvalidSchedule(ConfigurationError):
    """A schedule is invalid: crontab text that does not parse or never matches, an interval
    that is not a positive number of seconds, or a schedule type the leader scheduler does not
    support. Raised at scheduler start or at ``pgjobs schedule add``; nothing was written."""

    code = "PGJ-601"


class UnknownTimezone(ConfigurationError):
    """A schedule names a time zone that is not an IANA time zone (``Europe/Paris``, ``UTC``)."""

    code = "PGJ-602"


class InvalidCatchUp(ConfigurationError):
    """A catch-up policy is not ``skip``, ``once`` or ``all``, or its cap is not a whole number
    in 1-10000."""

    code = "PGJ-603"


class InvalidScheduleEntry(ConfigurationError):
    """A schedule entry is invalid (its name, task, arguments or options), or a scheduler
    setting is out of range."""

    code = "PGJ-604"


class ScheduleEntryNotFound(ConfigurationError):
    """No schedule entry has this name: see ``pgjobs schedule ls``."""

    code = "PGJ-605"


class ScheduleEntryExists(ConfigurationError):
    """A schedule entry with this name exists: remove it first, or pass ``--replace``."""

    code = "PGJ-606"
# -- the operator dashboard (PGJ-430..449) ------------------------------------------------------
class DashboardNotInstalled(ConfigurationError):
    """The dashboard's web packages are not installed: ``pip install 'kombu-pgjobs[dashboard]'``."""

    code = "PGJ-430"


class DashboardTokenRequired(ConfigurationError):
    """The dashboard's write mode needs a token of at least 16 characters (``--auth-token`` or
    ``PGJOBS_DASHBOARD_TOKEN``): without one it would let anyone who reaches the port change
    queues. Leave out ``--write`` for the read-only dashboard."""

    code = "PGJ-431"


class DashboardReadOnly(PgJobsError):
    """The dashboard is read-only (the default): start it with ``--write`` and a token to allow
    actions. Answered with HTTP 403; nothing was changed."""

    code = "PGJ-432"


class DashboardUnauthorized(PgJobsError):
    """The dashboard action came without the write token, or with a wrong one: sign in with
    the token (or send ``Authorization: Bearer TOKEN``). Answered with HTTP 403; nothing was
    changed."""

    code = "PGJ-433"


class DashboardCsrfFailed(PgJobsError):
    """The dashboard form came without a valid CSRF token (a forged cross-site request, or a
    form older than the server): reload the page and submit again. Answered with HTTP 403;
    nothing was changed."""

    code = "PGJ-434"


class DashboardExposed(ConfigurationError):
    """``pgjobs dashboard`` bound to an address other than loopback without a read token:
    anyone who reaches the port would read every message body, header, error and traceback.
    Give a read token (``--read-token`` or ``PGJOBS_DASHBOARD_READ_TOKEN``), or say
    ``--public-read`` if that is really meant. Refused at start."""

    code = "PGJ-435"


class DashboardWeakToken(DashboardTokenRequired):
    """A dashboard token (write or read) is too easy to guess: not printable ASCII, fewer than
    8 distinct characters, or under 64 bits by length x log2(distinct characters); or the read
    token equals the write token. Make one with ``python -c 'import secrets;
    print(secrets.token_urlsafe(24))'``. Refused at start."""

    code = "PGJ-436"


class DashboardHostRefused(PgJobsError):
    """The request's ``Host`` header is not one the dashboard answers (a DNS-rebinding page, or
    a name missing from ``--allowed-host``). Answered with HTTP 400."""

    code = "PGJ-437"


class DashboardLoginThrottled(PgJobsError):
    """Too many wrong tokens in a row from this address: the next try must wait (HTTP 429 with
    ``Retry-After``); it was not checked."""

    code = "PGJ-438"


class DashboardSignInRequired(PgJobsError):
    """This dashboard needs a token to read: sign in at ``/login`` with the read token (or the
    write token), or send ``Authorization: Bearer TOKEN``. A browser is sent to the sign-in
    page; a script gets HTTP 401."""

    code = "PGJ-439"


class DashboardSearchRefused(PgJobsError):
    """A dashboard history search the dashboard will not run: an args/kwargs containment value
    that is not JSON (an array for the args, an object for the kwargs), or a scan larger than
    the bound (the search reads at most that many of the newest messages and dead letters; a
    wider one is the CLI's or a SQL console's). Answered with HTTP 400; nothing was read."""

    code = "PGJ-440"


__all__ += ["DashboardSearchRefused"]
__all__ += ["DashboardCsrfFailed", "DashboardExposed", "DashboardHostRefused",
            "DashboardLoginThrottled", "DashboardNotInstalled", "DashboardReadOnly",
            "DashboardSignInRequired", "DashboardTokenRequired", "DashboardUnauthorized",
            "DashboardWeakToken"]


def all_error_classes() -> list[type[PgJobsError]]:
    """Every error class, for the code-uniqueness test and the errors reference. A subclass
    that does not set a ``code`` of its own is its base's error, not another one (celery_ext's
    ``steps.Fenced`` is ``StepFenced`` as a task body raises it), and is not listed."""
    seen: list[type[PgJobsError]] = []
    stack: list[type[PgJobsError]] = [PgJobsError]
    while stack:
        cls = stack.pop()
        if "code" in cls.__dict__:
            seen.append(cls)
        stack.extend(cls.__subclasses__())
    return seen


# -- the transactional outbox (issue 13): PGJ-510..529 ----------------------------------------
class NotInTransaction(PgJobsError):
    """A transaction() block was opened on a connection that is not in a usable transaction
    (autocommit with none open, a failed one, a closed connection), or the transaction ended
    inside the block: open the transaction first and end it after the block. Nothing was
    written."""

    code = "PGJ-510"


class OutboxNotInstalled(PgJobsError):
    """The outbox table is not in the app's database: run ``pgjobs migrate --dsn APP_DB``
    (with the schema the app stages into). Nothing was written."""

    code = "PGJ-511"


class OutboxUnserializable(PgJobsError):
    """A message published in a transaction() block for a broker elsewhere has properties,
    headers or declarations that cannot be stored as JSON for the relay. Nothing was written."""

    code = "PGJ-512"


class OutboxBypassed(PgJobsError):
    """A message reached a pgjobs broker on another database directly inside a transaction()
    block: it would commit on its own, outside the app's transaction. Publish through
    ``kombu_pgjobs.outbox.publish()`` or ``celery_ext.transaction()``. Nothing was written."""

    code = "PGJ-513"


class UnsupportedConnection(PgJobsError):
    """``celery_ext.transaction(conn)`` was given something it cannot publish through: it takes
    a psycopg 3 connection, a SQLAlchemy Session or Connection on psycopg 3, or (no argument)
    Django's connection inside ``transaction.atomic()``."""

    code = "PGJ-514"



class InvalidShardMap(ConfigurationError):
    """The ``shards`` transport option (or ``--shards``/``$PGJOBS_SHARDS``) is not a mapping of
    queue patterns to database URLs (a dict, or a JSON object); see docs/sharding.md."""

    code = "PGJ-230"


class InvalidShardPattern(InvalidShardMap):
    """A queue pattern of the shard map is invalid: use a queue name, a glob with ``*`` and
    ``?`` only, or ``*`` alone; remote control (``*.pidbox``) and events (``celeryev.*``)
    always stay on the broker URL's database."""

    code = "PGJ-231"


class InvalidShardURL(InvalidShardMap):
    """A database URL of the shard map is invalid: use pgjobs://user:password@host:port/db
    (a host and a database are required)."""

    code = "PGJ-232"


__all__ += ["InvalidShardMap", "InvalidShardPattern", "InvalidShardURL"]


# -- durable steps (celery_ext.steps, issue 32): PGJ-9xx ----------------------------------------
class StepsUnavailable(ConfigurationError):
    """Durable steps run only in a worker's run of a delivered message: a Celery worker on a
    ``pgjobs://`` broker, the app set up with ``celery_ext.install(app)``, the task
    ``bind=True`` and ``acks_late=True`` (the message stays held while the body runs)."""

    code = "PGJ-901"


class DuplicateStep(PgJobsError):
    """A step name was used twice in one run: names are the replay key, so each step of a
    run needs its own (``charge``, ``charge-2``, or a name built from a loop's item)."""

    code = "PGJ-902"


class StepFenced(PgJobsError):
    """A step's write was refused: this run no longer holds its message (its lease lapsed and
    another worker took it over, it was settled elsewhere, or an operator cancelled it).
    Nothing was written; the run ends (the message's current holder goes on)."""

    code = "PGJ-903"


class InvalidStep(PgJobsError):
    """A step's arguments are invalid: a name or event that is not a non-empty string of at
    most 200 characters without control characters, a key that is not a string or a whole
    number, a duration or timeout that is not a finite number of seconds in 0 to 100 years, or
    a result or event data that is not JSON (or larger than ``max_message_bytes``)."""

    code = "PGJ-904"


class EventTimeout(PgJobsError):
    """``steps.wait_for_event`` reached its timeout before an event of its name and key was
    emitted. Recorded as the step's error; the task's retry policy decides what happens next
    (a retry waits again, with a new deadline)."""

    code = "PGJ-905"


class StepMismatch(PgJobsError):
    """A step name is stored for another kind of step (``run``, ``sleep``, ``event``) or
    another event or key than this run asks for: the task's code changed between runs, or
    builds its names from something that is not the same on every run. Rename the step, or
    run the task again from that step (``pgjobs requeue ID --from-step NAME``)."""

    code = "PGJ-906"


class StepNotFound(NotFound):
    """``pgjobs requeue --from-step`` named a step the message's task has not recorded (see
    ``pgjobs steps TASK_ID``), or a message whose task id cannot be read. Nothing changed."""

    code = "PGJ-907"


class EmitElsewhere(PgJobsError):
    """``celery_ext.steps.emit`` inside a ``transaction()`` block whose connection is not the
    broker's database: an event is a row of the broker's schema, and it cannot be written in a
    transaction of another database. Emit after the app's commit, or keep the pgjobs schema in
    the app's database. Nothing was written."""

    code = "PGJ-908"


__all__ += ["DuplicateStep", "EmitElsewhere", "EventTimeout", "InvalidStep", "StepFenced",
            "StepMismatch", "StepNotFound", "StepsUnavailable"]
