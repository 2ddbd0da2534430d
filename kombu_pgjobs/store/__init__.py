"""The store: every SQL statement and whatever runs one on the queue's tables.

``sql/`` holds every runtime statement as named statements (``*.sql``, read with
importlib.resources from this package), ``schema/`` the versioned migrations; ``core`` is the
queue core (publish, claim, settle), ``database`` the connections (and ``embedded`` a private
server), ``admin`` the operator's reads and bulk writes; the feature stores keep their own
tables: ``history``, ``audit``, ``retention``, ``steps``, ``scheduling``, ``webhooks``,
``revoke``.

May import: the ground (``kombu_pgjobs.errors``, ``events``, ``options``, ``url``, ``shardmap``,
``green``, ``limits``, ``recurrence``), each other, psycopg. Never kombu's face
(``kombu_pgjobs.broker``), the operator tools (``kombu_pgjobs.ops``) or celery_ext.
"""
