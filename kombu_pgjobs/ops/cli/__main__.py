"""`python -m kombu_pgjobs.ops.cli`: the `pgjobs` command."""

from .main import main

raise SystemExit(main())
