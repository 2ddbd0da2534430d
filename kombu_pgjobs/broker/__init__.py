"""The broker: kombu's face on the store.

``transport`` is the kombu Transport and Channel (what ``pgjobs://`` loads); ``consumer`` the
consumer loop and its connection states, with ``waiting`` (wake-ups and hand-offs), ``inflight``
and ``sharding`` (queues over several databases); ``backend`` holds a database's publish and
claim connections for them; the publish paths are ``batching`` (``kombu_pgjobs.batch()``),
``unconfirmed``, ``outbox`` (in the app's own transaction) and ``relay`` (staged rows to another
broker); ``scheduled`` answers ``celery inspect scheduled``.

May import: the store (``kombu_pgjobs.store``), the ground, kombu, psycopg. Never the operator
tools (``kombu_pgjobs.ops``) or celery_ext.
"""
