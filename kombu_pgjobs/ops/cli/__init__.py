"""``pgjobs``, the command line: ``main`` builds the parser and runs a command (the queue
commands are there); every other command group is a module of its own that ``main`` registers:
``relay`` (relay, outbox), ``schedule``, ``webhooks``, ``steps``, ``history``, ``roles``,
``bulk``.

May import: ``kombu_pgjobs.ops.common``, the dashboard's ``command`` (``pgjobs dashboard``),
metrics, the broker, the store, the ground. The command groups import ``ops.common``, never
``main``.
"""
