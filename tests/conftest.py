import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

# Triton kernels run on the CPU through Triton's interpreter in CI; the variable must be set
# before any kernel module is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
