"""The operator tools: what a person (or a scraper) uses to look at and act on the queues.

``cli/`` is ``pgjobs``, one module per command group; ``dashboard/`` the web dashboard;
``metrics`` and ``prometheus`` the metrics exposition; ``flower`` Flower's broker page;
``common`` what the CLI and the dashboard share (the DSN, an Admin, the words an operator
reads).

May import: the broker, the store, the ground. Nothing below imports it.
"""
