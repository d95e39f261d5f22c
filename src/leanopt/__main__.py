"""``python -m leanopt``: the ``leanopt`` command."""

from leanopt.cli import main

raise SystemExit(main())
