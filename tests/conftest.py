import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

# Triton kernels run on the CPU through Triton's interpreter in CI; the variable must be set
# before any kernel module is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")


# ---- the `cuda` marker: the suite's GPU cases (tests/test_cuda.py; scripts/gpu_check.sh runs them)
# Skipped where CUDA is absent, unless LEANOPT_CUDA_TESTS_ON_CPU=1 runs them on the CPU at small
# sizes (Triton interpreted) to check the tests themselves without a GPU.
CUDA_TESTS_ON_CPU = os.environ.get("LEANOPT_CUDA_TESTS_ON_CPU") == "1"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "cuda: needs a CUDA GPU (TRITON_INTERPRET=0 python3 -m pytest tests -m cuda); skipped without one"
    )


def pytest_collection_modifyitems(config, items):
    import pytest
    import torch

    if CUDA_TESTS_ON_CPU or torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (LEANOPT_CUDA_TESTS_ON_CPU=1 runs these cases on the CPU)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
