"""Child-process entry of a comparison: ``python -m leanopt.compare.worker`` (spec on stdin)."""

from leanopt.compare.runner import worker_main

if __name__ == "__main__":
    raise SystemExit(worker_main())
