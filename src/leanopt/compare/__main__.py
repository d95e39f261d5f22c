"""``python -m leanopt.compare [options]``: the same as ``leanopt compare``."""

import sys

from leanopt.compare.command import main

sys.exit(main())
