import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

# Triton kernels run on the CPU through Triton's interpreter in CI; the variable must be set
# before any kernel module is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (the README's `-n 2`) each worker gets its share of the cores, so that two
# workers do not run 2 intra-op threads each on 2 cores; a test that needs more sets its own.
if os.environ.get("PYTEST_XDIST_WORKER"):
    _share = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))
    # Inductor compiles in a pool of as many subprocesses as there are cores, started in each worker
    # that compiles: on a worker's share of the cores, in the worker itself.
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(_share))
    import torch as _torch

    _torch.set_num_threads(_share)


# ---- the order pytest-xdist hands out files ---------------------------------------------------
# `--dist loadfile` (the README's command) runs each file on one worker, so that its module
# fixtures, imports and compiled graphs are paid once; by default xdist hands out the files with
# the most tests first, which can leave a file of a few long tests (the GPU check's dry run, the
# compare runs) for the end while the other worker idles. The files below, the longest first
# (worker seconds on 2 cores; measured with --durations=0), go first instead: longest-first
# scheduling ends the two workers within about the last files' time of each other. Any file not
# listed follows in collection order; a plain run without xdist keeps the collection order.
LONGEST_FIRST = [  # the files of 20 s and more, 2026-12-04 04:37 and 05:01 UTC (cold Inductor cache, as on a fresh machine)
    "tests/test_rules.py", "tests/test_plan.py", "tests/test_gpu_check.py", "tests/test_cpu_paths.py",
    "tests/test_plan_process.py", "tests/test_rounding.py", "tests/test_compare.py", "tests/test_release.py",
    "tests/test_distributed.py", "tests/test_native_build.py", "tests/test_plan_muon.py", "tests/test_bf16_states.py",
    "tests/test_offload.py", "tests/test_trainer.py", "tests/test_contract.py", "tests/test_peer_convert.py",
    "tests/test_plan_probe.py", "tests/test_compiled_graphs.py", "tests/test_plan_offload.py", "tests/test_doctor.py",
    "tests/test_cli.py", "tests/test_trainer_features.py", "tests/test_backends.py", "tests/test_quiet_output.py",
    "tests/test_muon_distributed.py",
]  # fmt: skip


# ---- the garbage collector -----------------------------------------------------------------------
# A full collection scans every object alive: with torch and transformers imported, ~450,000 that
# live as long as the process, ~0.25 CPU-s a collection. Accelerate's free_memory (the end of every
# Trainer.train()), leanopt's plan and doctor and the tests themselves collect explicitly, hundreds
# of times in a run. What exists once the tests are collected is frozen (gc.freeze: kept out of
# every later collection); what the tests make is collected as before.
def pytest_collection_finish(session):
    import gc

    gc.collect()
    gc.freeze()


def pytest_sessionfinish(session, exitstatus):
    import gc

    gc.unfreeze()  # the interpreter's exit sees the objects as usual


def _xdist_worker() -> bool:
    return bool(os.environ.get("PYTEST_XDIST_WORKER"))


# ---- the `cuda` marker: the suite's GPU cases (tests/test_cuda.py; scripts/gpu_check.sh runs them)
# Skipped where CUDA is absent, unless LEANOPT_CUDA_TESTS_ON_CPU=1 runs them on the CPU at small
# sizes (Triton interpreted) to check the tests themselves without a GPU.
CUDA_TESTS_ON_CPU = os.environ.get("LEANOPT_CUDA_TESTS_ON_CPU") == "1"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "cuda: needs a CUDA GPU (TRITON_INTERPRET=0 python3 -m pytest tests -m cuda); skipped without one"
    )
    if LONGEST_FIRST and getattr(config.option, "dist", "no") == "loadfile":
        # xdist's controller: hand the files out in the collection order the workers send
        # (pytest_collection_modifyitems below), not sorted by their number of tests.
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    import pytest
    import torch

    if LONGEST_FIRST and _xdist_worker():
        rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
        items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: files keep their order

    if CUDA_TESTS_ON_CPU or torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (LEANOPT_CUDA_TESTS_ON_CPU=1 runs these cases on the CPU)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


# ---- optimizers defined outside leanopt (tests/registry.py EXTERNAL): registered, as their
# author's leanopt.register would, only while a test of theirs runs, so that no other test sees
# them in leanopt's registry. A test is theirs when one of its parameters is the case or its
# name (the integration suites parametrize by name).
def _case_of(request):
    callspec = getattr(request.node, "callspec", None)
    if callspec is None:
        return None
    from registry import GENERIC

    for value in callspec.params.values():
        for case in GENERIC:
            if case.external and (value is case or (isinstance(value, str) and value == case.name)):
                return case
    return None


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
