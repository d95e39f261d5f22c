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


# ---- optimizers defined outside leanopt (tests/registry.py EXTERNAL): registered, as their
# author's leanopt.register would, only while a test of theirs runs, so that no other test sees
# them in leanopt's registry.
def _case_of(request):
    callspec = getattr(request.node, "callspec", None)
    return callspec.params.get("case") if callspec is not None else None


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _external_optimizer_registered(request):
    case = _case_of(request)
    if not getattr(case, "external", False):
        yield
        return
    from registry import registered

    with registered(case):
        yield
