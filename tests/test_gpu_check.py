"""scripts/gpu_check.sh, the one-shot GPU check (docs/gpu_check.md), kept from rotting.

The dry run (same stages on the CPU at toy sizes, Triton interpreted) runs once for the module;
the tests read the results.json and results.md it writes. It runs one case of each test function
of tests/test_cuda.py on the CPU, so that the CUDA tests' own code does not rot (their parity
checks are tests/test_rules.py's, Triton interpreted). The helpers that only the GPU run exercises
(TinyLlama shapes, the targets' pass/fail) are checked directly.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LEANOPT = ("leanopt-adamw", "leanopt-adamw8bit", "leanopt-adamw4bit", "leanopt-adafactor")


def _load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpu_check", mod)
    spec.loader.exec_module(mod)
    return mod


gpu_check = _load_script()
step_time = gpu_check.benchmark("step_time")  # the timing stage's shapes and candidates


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("gpu_check_out")
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "LEANOPT_CUDA_TESTS_ON_CPU", "TRITON_INTERPRET")}
    env["GPU_CHECK_BUDGET_SCALE"] = "3"  # a loaded CI machine: slower, not wrong
    env.pop("GPU_CHECK_CPU_CASES", None)  # one case of each CUDA test function, as a dry run by hand
    # One intra-op thread per process, as each worker of the suite's `-n 2` has (tests/conftest.py): two
    # threads per process on a loaded 2-core machine spin-wait for each other (the dry run times nothing real).
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    return proc, out


def _results(dry_run) -> dict:
    proc, out = dry_run
    assert (out / "results.json").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "results.json").read_text())


def test_dry_run_passes_every_stage_within_its_budget(dry_run) -> None:
    proc, out = dry_run
    res = _results(dry_run)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert res["schema"] == gpu_check.SCHEMA and res["dry_run"] is True and res["ok"] is True
    assert list(res["stages"]) == [s.name for s in gpu_check.STAGES]
    for name, stage in res["stages"].items():
        assert stage["status"] in ("ok", "skipped"), (name, stage)
        assert 0 <= stage["seconds"] <= stage["budget_s"] + gpu_check.GRACE_S + 10, (name, stage)
    assert res["wall_s"] <= res["total_budget_s"] + 30
    # Everything the device tool brings back: at most 8 files.
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8 and {"results.json", "results.md", "gpu_check.log", "cuda_tests.xml"} <= {p.name for p in files}


def test_dry_run_environment_and_tests(dry_run) -> None:
    st = _results(dry_run)["stages"]
    assert st["env"]["cuda_available"] is False
    assert {"python", "torch", "triton", "leanopt"} <= set(st["env"]["versions"])
    junit = st["tests"]["junit"]
    # Dry: the modules that hold CUDA cases (the GPU run collects all of tests/); tests/test_cuda.py among them.
    assert "tests/test_cuda.py" in gpu_check.cuda_test_files()
    plain = junit[f"pytest {' '.join(gpu_check.cuda_test_files())} -m cuda"]
    emulated = next(v for k, v in junit.items() if "LEANOPT_CUDA_TESTS_ON_CPU" in k)
    # Without CUDA every CUDA case is collected and skipped; on the CPU one case of each function passes (or needs a GPU).
    assert plain["tests"] >= 30 and plain["skipped"] == plain["tests"] and plain["failed"] == plain["errors"] == 0
    assert emulated["passed"] >= 5 and emulated["failed"] == emulated["errors"] == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dry_run_timing(dry_run, dtype: str) -> None:
    t = _results(dry_run)["stages"][f"timing_{dtype}"]
    assert t["params"] == sum(math.prod(s) for s in step_time.llama_shapes(step_time.TOY))
    assert t["copy_bandwidth_GBps"] > 0 and t["rounds"] >= 1
    rows = {r["optimizer"]: r for r in t["results"]}
    names = gpu_check.TIMING_OPTIMIZERS
    assert set(names) <= set(step_time.candidates("triton"))
    # Every candidate is timed or skipped with a reason; leanopt's and torch fused always run.
    assert set(rows) | set(t["skipped"]) == set(names) and not set(rows) & set(t["skipped"])
    assert all(t["skipped"].values())
    for name in LEANOPT + ("torch-adamw-fused",):
        r = rows[name]
        assert r["ms_per_step"] > 0 and r["first_step_s"] > 0 and r["ratio_to_torch_fused"] > 0, r
        assert r["achieved_GBps"] > 0 and r["floor_ms"] > 0
    for name in LEANOPT:
        assert rows[name]["backend"] == "triton"
    bpp = {n: rows[n]["state_bytes_per_param"] for n in LEANOPT}
    assert 7.9 < bpp["leanopt-adamw"] < 8.1 and bpp["leanopt-adafactor"] < 1.0
    assert bpp["leanopt-adamw4bit"] < bpp["leanopt-adamw8bit"] < bpp["leanopt-adamw"]


def test_dry_run_targets_and_markdown(dry_run) -> None:
    _, out = dry_run
    res = _results(dry_run)
    assert len(res["targets"]) == 2 * len(gpu_check.TARGETS)
    for tg in res["targets"]:
        assert tg["measured"] is None or tg["measured"] > 0
        assert tg["pass"] in (True, False, None)
    first = [tg for tg in res["targets"] if tg["target"] == "first_step"]
    assert all(tg["measured"] is not None for tg in first)
    md = (out / "results.md").read_text()
    assert "DRY RUN" in md and "## GPU targets" in md and "## Accuracy" in md
    for tg in gpu_check.TARGETS:
        assert tg[1] in md


def test_dry_run_accuracy(dry_run) -> None:
    acc = _results(dry_run)["stages"]["accuracy"]
    assert {"randn", "hazard"} <= set(acc["scenarios"])
    rows = {r["name"]: r for r in acc["rows"]}
    for name in ("leanopt AdamW8bit", "leanopt AdamW4bit"):
        r = rows[name]
        for s in acc["scenarios"]:
            assert "error" not in r["scenarios"][s], r
        # Safe on sparse gradients, the NaN kept to its own element (skipped: not even that one).
        assert r["scenarios"]["hazard"]["max"] < 0.05 and r["scenarios"]["hazard"]["far"] == 0
        assert r["nan_spread"] == 0
        assert 0.5 < r["bytes_per_param"] < 2.6


def test_dry_run_plan_check(dry_run) -> None:
    # python3 -m leanopt.memory.plan_check --dry-run (the planner's check): the CPU plan against a CPU
    # measurement on the two-layer models, each row within the check's +-5 %.
    stage = _results(dry_run)["stages"]["plan_check"]
    assert stage["status"] == "ok" and stage["result"]["ok"] is True and stage["result"]["dry_run"] is True
    rows = stage["result"]["rows"]
    from leanopt.memory import plan_check

    measured = len(plan_check.DRY_CASES) * len(plan_check.DRY_CONFIGS)  # one configuration per model, dry
    assert len(rows) == measured and all(math.isfinite(r[-1]) and abs(r[-1]) <= 5 for r in rows), rows


def test_dry_run_offload(dry_run) -> None:
    # benchmarks/offload_step.py on the toy model (offload="cpu"): offloaded params equal the CPU
    # reference bit for bit, and every leanopt mode was timed.
    stage = _results(dry_run)["stages"]["offload"]
    assert stage["status"] == "ok", stage
    result = stage["result"]
    assert result["check"]["bit_identical_to_cpu_reference"] is True
    assert {"device", "offload", "offload+release"} <= set(result["modes"])
    assert all(row["iteration"]["median"] > 0 for row in result["modes"].values())
    assert 0.0 <= result["hidden_share"] <= 1.0


def test_dry_run_muon(dry_run) -> None:
    # benchmarks/muon_step.py at 1/32 width (--shapes toy): the three optimizers timed, the NS share, offload's
    # host step bit-identical to the on-device one (both on the CPU here).
    stage = _results(dry_run)["stages"]["muon"]
    assert stage["status"] == "ok", stage
    result = stage["result"]
    assert set(result["ratio_to_torch"]) == {"torch.optim.Muon", "leanopt.Muon", "leanopt.Muon8bit"}
    assert 0.0 < result["ns_share_of_leanopt_step"] <= 1.5 and result["offload"]["bit_identical"] is True
    muon_step = gpu_check.benchmark("muon_step")
    assert sum(math.prod(s) for s in muon_step.shapes_of("tinyllama", None)) == 968_884_224  # TinyLlama's 154 matrices


def test_tinyllama_shapes_are_the_model() -> None:
    shapes = step_time.llama_shapes(step_time.TINYLLAMA)
    assert sum(math.prod(s) for s in shapes) == step_time.TINYLLAMA_PARAMS == 1_100_048_384
    assert len(shapes) == 2 + 22 * 9 + 1
    assert shapes[0] == shapes[-1] == (32000, 2048) and (256, 2048) in shapes and (2048, 5632) in shapes


def test_targets_pass_and_fail_on_ratios() -> None:
    def stage(**ms):
        return {"results": [{"optimizer": k.replace("_", "-"), "ms_per_step": v, "first_step_s": 1.0} for k, v in ms.items()]}

    stages = {"timing_float32": stage(torch_adamw_fused=10.0, leanopt_adamw=9.0, leanopt_adamw8bit=7.0, bnb_adamw8bit=70.0,
                                      leanopt_adamw4bit=5.0, leanopt_adafactor=3.0, hf_adafactor=10.0)}  # fmt: skip
    got = {(t["target"], t["param_dtype"]): t for t in gpu_check.evaluate_targets(stages)}
    assert got[("adamw_vs_fused", "float32")]["pass"] is True
    assert got[("adamw8bit_vs_fused", "float32")]["pass"] is False  # 0.7 > 0.6
    assert got[("adamw8bit_vs_bnb", "float32")]["pass"] is True  # exactly 10x
    assert got[("adamw4bit_vs_fused", "float32")]["pass"] is True
    assert got[("adafactor_vs_hf", "float32")]["pass"] is False  # 0.3 > 0.25
    assert got[("first_step", "float32")]["pass"] is True
    assert all(t["pass"] is None for (k, d), t in got.items() if d == "bfloat16")
    # A partial results dict (a stage killed early) still renders.
    md = gpu_check.markdown({"dry_run": False, "started": "now", "ok": None, "failed_stages": [], "total_budget_s": 345,
                             "command": "x", "stages": {"timing_float32": stages["timing_float32"]}, "targets": []})  # fmt: skip
    assert "leanopt-adamw8bit" in md


@pytest.fixture(scope="module")
def hopper_compile(dry_run) -> dict[str, str]:
    """What the dry run's tests stage got compiling the kernels for sm_90 without a GPU."""
    comp = _results(dry_run)["stages"]["tests"].get("compile_sm90") or {}
    if "skipped" in comp:
        pytest.skip(f"not compiled: {comp['skipped']}")
    assert "error" not in comp, comp
    return comp


# The interpreter runs code that Triton's CUDA compiler refuses (a constexpr rebound inside
# tl.static_range once broke the quantized kernel this way): compile every kernel for sm_90
# (H100/H200) without a GPU, so such an error costs no device time.
@pytest.mark.parametrize(
    "variant",
    range(len(gpu_check.HOPPER_VARIANTS)),
    ids=lambda i: f"{gpu_check.HOPPER_VARIANTS[i][1]}-{gpu_check.HOPPER_VARIANTS[i][2]['P_DTYPE']}",
)
def test_triton_kernels_compile_for_hopper(hopper_compile: dict[str, str], variant: int) -> None:
    assert len(hopper_compile) == len(gpu_check.HOPPER_VARIANTS)
    label, result = list(hopper_compile.items())[variant]
    assert result == "ok", f"{label}: {result}"


def _cuda_test_functions() -> dict[str, bool]:
    """The test functions of tests/test_cuda.py, read from its source: name -> whether it needs a real GPU
    (decorated ``needs_gpu``: skipped with LEANOPT_CUDA_TESTS_ON_CPU=1)."""
    tree = ast.parse((ROOT / gpu_check.CPU_CASES_MODULE).read_text())
    return {
        f.name: any(isinstance(d, ast.Name) and d.id == "needs_gpu" for d in f.decorator_list)
        for f in tree.body
        if isinstance(f, ast.FunctionDef) and f.name.startswith("test_")
    }


def test_one_case_of_every_cuda_test_function_passes_on_the_cpu(dry_run) -> None:
    """One case of each test function of tests/test_cuda.py on the CPU (Triton interpreted), run by the
    dry run's tests stage: every function is there, none fails, and the only ones skipped need a real GPU."""
    junit = _results(dry_run)["stages"]["tests"]["junit"]
    cpu = junit["on the CPU (LEANOPT_CUDA_TESTS_ON_CPU=1), one case of each test function"]
    assert cpu["rc"] == 0 and cpu["failed"] == cpu["errors"] == 0 and not cpu["collection_errors"], cpu
    assert cpu["passed"] + cpu["skipped"] == cpu["tests"] == len(cpu["cases"]), cpu
    assert all("GPU" in why for why in cpu["skip_reasons"]), cpu["skip_reasons"]
    dotted = gpu_check.CPU_CASES_MODULE.removesuffix(".py").replace("/", ".")
    by_function: dict[str, list[str]] = {}
    for case, outcome in cpu["cases"].items():
        classname, _, name = case.partition("::")
        assert classname == dotted, case
        by_function.setdefault(name.split("[")[0], []).append(outcome)
    functions = _cuda_test_functions()
    assert len(functions) >= 9 and set(by_function) == set(functions), sorted(set(functions) ^ set(by_function))
    for name, needs_gpu in functions.items():
        assert by_function[name] == ["skipped" if needs_gpu else "passed"], (name, by_function[name])


def test_dry_run_twins(dry_run) -> None:
    """benchmarks/backend_parity.py in the dry run: each family's elementwise rule (tests/registry.py's
    representatives; the GPU run takes every rule) on its Triton twin (interpreted), its compiled
    graphs and the reference, within tolerance; a rule without a twin checked to run the compiled
    graphs under backend='triton'."""
    from leanopt.kernels import rules
    from leanopt.optim.elementwise import ElementwiseOptimizer
    from registry import GENERIC, representatives

    stage = _results(dry_run)["stages"]["twins"]
    assert stage["status"] == "ok" and not stage["not_run"], stage.get("error")
    rows = {r["case"]: r for r in stage["rows"]}
    elementwise = [c for c in GENERIC if issubclass(c.cls, ElementwiseOptimizer)]
    assert set(rows) == {c.name for c in representatives(elementwise)}
    assert {row["twin"] for row in rows.values()} == {True, False}  # a twin's three pairs and the no-twin path
    for case in GENERIC:
        if case.name not in rows:
            continue
        row = rows[case.name]
        assert row["ok"] and row["dtype"] == "float32", row
        assert row["twin"] == (rules.rule_id(case.cls.rule) is not None), row  # every shipped rule has its twin
        expected = {"compiled~reference", "twin~reference", "twin~compiled"} if row["twin"] else {"compiled~reference", "triton-backend~compiled"}
        assert set(row["pairs"]) == expected and all(p["ok"] for p in row["pairs"].values()), row
    md = (dry_run[1] / "results.md").read_text()
    assert "## Twins" in md and "| rmsprop | float32 | none |" in md
