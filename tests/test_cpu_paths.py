"""Every CPU path of a rule gives the same bits, so a step may take any of them.

An elementwise optimizer's fp32 params take, on the CPU, the native kernel where it is loaded,
the compiled graph of the rule, or the same function run eagerly (no C++ compiler,
``LEANOPT_NO_COMPILE``, or the native kernel still building in the background, where a compile
would stall the step). The native kernel builds in a background thread on first use, so one
run can switch paths between two steps: its results must not depend on when. Here every
registered elementwise optimizer takes the same steps on each path, on fresh random inputs with
exact-zero gradients (the decay rounding) and sizes that are not whole blocks or vector widths,
and params and states are compared to the bit: native = compiled = eager, and, for the low-bit
optimizers (safe mode: correctly rounded square roots on every path), = the reference. bf16
params with a twin in the kernel take it too: native = eager (= the reference for the low-bit
optimizers). So does Muon's momentum (an fp32 direction from fp32 or bf16 gradients).

The background build itself runs in a subprocess with a fresh extensions cache and a compiler
wrapper that sleeps first: the first steps must not wait for it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from leanopt.kernels import cpu_elementwise, cpu_native, graphs, twins
from leanopt.optim.elementwise import ElementwiseOptimizer
from registry import BF16_STATES, OPTIMIZERS
from test_user_rules import dynamo_only  # noqa: F401 - the fixture

ELEMENTWISE = [c for c in OPTIMIZERS if issubclass(c.cls, ElementwiseOptimizer)]


def _train(case, mode: str, shapes, steps: int = 5, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Params and state tensors after ``steps`` steps on ``mode``'s path (params and gradients of ``dtype``)."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]
    backend = "reference" if mode == "reference" else "cpu"
    opt = case.cls(case.param_groups(params), **{**case.kwargs, "backend": backend})
    for _ in range(steps):
        for p in params:
            g = torch.randn(p.shape, generator=gen) * 1e-2
            g[torch.rand(p.shape, generator=gen) < 0.3] = 0
            p.grad = g.to(dtype)
        opt.step()
    out = []
    for p in params:
        out.append(p.detach().clone())
        for value in opt.state[p].values():
            out += [t.clone() for t in ([value] if isinstance(value, torch.Tensor) else [value.codes, value.absmax])]
    return out


@pytest.fixture
def paths(monkeypatch):
    if not cpu_native.available():
        pytest.skip(f"native CPU kernel unavailable: {cpu_native.build_error()}")

    def run(case, mode, shapes, dtype=torch.float32):
        if mode == "native":
            return _train(case, mode, shapes, dtype=dtype)
        with cpu_native.disabled():
            if mode == "eager":
                monkeypatch.setattr(cpu_elementwise, "can_compile", lambda: False)
            try:
                return _train(case, mode, shapes, dtype=dtype)
            finally:
                monkeypatch.undo()

    return run


# A param of whole blocks, one with a partial block and a size no vector width divides, and one
# under min_quant_size (dense states in the low-bit optimizers).
SHAPES = [(96, 512), (77, 259), (1000,)]


@pytest.mark.parametrize("case", ELEMENTWISE, ids=str)
def test_native_compiled_and_eager_paths_agree_to_the_bit(case, paths) -> None:
    got = {mode: paths(case, mode, SHAPES) for mode in ("native", "compiled", "eager")}
    modes = ["compiled", "eager"]
    if case.cls.safe:  # the low-bit optimizers: the reference too
        got["reference"] = paths(case, "reference", SHAPES)
        modes.append("reference")
    for mode in modes:
        for i, (a, b) in enumerate(zip(got["native"], got[mode])):
            same = torch.equal(a.view(torch.int32), b.view(torch.int32)) if a.dtype == torch.float32 else torch.equal(a, b)
            assert same, f"{case}: tensor {i} ({tuple(a.shape)} {a.dtype}) differs between native and {mode}"


# The optimizers whose rule the kernel has: their bf16 params and gradients go there too (widened
# per block or chunk, the new param rounded to the nearest bf16), quantized states and dense.
NATIVE_TWIN = [c for c in ELEMENTWISE if c.cls.rule.name in twins.NATIVE]


@pytest.mark.parametrize("case", NATIVE_TWIN, ids=str)
def test_bf16_params_take_the_native_kernel_to_the_bit(case, paths, monkeypatch) -> None:
    """bf16 params and gradients: the native kernel and the eager graph to the bit, and the
    reference for the low-bit optimizers (safe mode: correctly rounded roots on every path); the
    compiled graph of bf16 params is tests/test_rules.py's test_compiled_cpu_path_matches_reference."""
    calls = []
    for name in ("step_blocks", "dense"):
        real = getattr(cpu_native, name)
        monkeypatch.setattr(cpu_native, name, lambda *a, real=real, **k: calls.append(a[1].dtype) or real(*a, **k))
    native = paths(case, "native", SHAPES, torch.bfloat16)
    assert set(calls) == {torch.bfloat16}
    for mode in ("eager", "reference") if case.cls.safe else ("eager",):
        for i, (a, b) in enumerate(zip(native, paths(case, mode, SHAPES, torch.bfloat16))):
            assert torch.equal(a, b), f"{case}: tensor {i} ({tuple(a.shape)} {a.dtype}) differs between native and {mode}"


# bf16 states (leanopt.quant.bf16: stochastic rounding keyed on the element's global index and the
# step) of the rules with a twin in the kernel: native = eager to the bit for the states; the
# params to the bit too, but where the eager path takes torch's own square root (AdamW outside
# safe mode, to the bit torch.optim.AdamW's: one ulp off the correctly rounded root on ~17 % of
# inputs, kernels.rules.sqrt), which moves 0.05-0.1 % of params (measured: at most 1.2e-7, 4e-8
# of the tensor's largest param). The compiled graph,
# on the family's representative, stores the same states (its params: tests/test_bf16_states.py).
BF16_NATIVE = [c for c in BF16_STATES if c.cls.rule.name in twins.NATIVE]


@pytest.mark.parametrize("case", BF16_NATIVE, ids=str)
def test_bf16_states_take_the_native_kernel_to_the_bit(case, paths, monkeypatch) -> None:
    calls = []
    real = cpu_native.dense
    monkeypatch.setattr(cpu_native, "dense", lambda *a, **k: calls.append({s.dtype for s in a[3]}) or real(*a, **k))
    native = paths(case, "native", SHAPES)
    assert calls and all(torch.bfloat16 in dtypes for dtypes in calls)
    assert any(t.dtype == torch.bfloat16 for t in native)
    for i, (a, b) in enumerate(zip(native, paths(case, "eager", SHAPES))):
        what = f"{case}: tensor {i} ({tuple(a.shape)} {a.dtype})"
        if a.dtype == torch.bfloat16 or a.dim() == 0:  # a state, or the step count
            assert torch.equal(a, b) and torch.equal(a.view(-1).view(torch.int16 if a.dtype == torch.bfloat16 else torch.int32),
                                                     b.view(-1).view(torch.int16 if a.dtype == torch.bfloat16 else torch.int32)), what  # fmt: skip
        else:  # a param
            err = ((a - b).abs().max() / a.abs().max()).item()
            assert err <= 1e-6 and (a != b).float().mean() <= 2e-3, (what, err, (a != b).sum())
    if case.represents:
        compiled = paths(case, "compiled", SHAPES)
        for i, (a, b) in enumerate(zip(native, compiled)):
            if a.dtype == torch.bfloat16:
                assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"{case}: state {i} differs from compiled"


# Muon's momentum (an elementwise rule with a twin in the kernel, none in Triton) writes an fp32
# direction: from a bf16 param's gradient over its fp32 buffer (the dense loop), and from either
# dtype over a block-quantized buffer (the block loops). Native = eager to the bit, with and
# without Nesterov; the compiled graph too on the family's representative, Nesterov, bf16 (the
# graph CUDA runs; the quantized machinery around the rule is AdamW8bit's, compiled above).
MUON = [c for c in OPTIMIZERS if getattr(c.cls, "momentum_storage", None) is not None]


@pytest.mark.parametrize("nesterov", [True, False], ids=["nesterov", "plain"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", MUON, ids=str)
def test_muons_momentum_takes_the_native_kernel_to_the_bit(case, dtype, nesterov, paths, monkeypatch) -> None:
    case = dataclasses.replace(case, kwargs={**case.kwargs, "nesterov": nesterov})
    seen = []  # (rule, param dtype, gradient dtype) of each native call
    for name in ("step_blocks", "dense"):
        real = getattr(cpu_native, name)
        monkeypatch.setattr(cpu_native, name, lambda *a, real=real, **k: seen.append((a[0].name, a[1].dtype, a[2].dtype)) or real(*a, **k))
    native = paths(case, "native", SHAPES, dtype)
    quantized = hasattr(case.cls.momentum_storage, "state_bits")
    momentum = {(p, g) for rule, p, g in seen if rule == "muon_momentum"}
    # fp32 gradients over an fp32 buffer take torch.optim.Muon's own two ops (tests/test_muon.py)
    assert momentum == ({(torch.float32, dtype)} if quantized or dtype == torch.bfloat16 else set()), seen
    modes = ["eager"] + (["compiled"] if case.represents and dtype == torch.bfloat16 and nesterov else [])
    for mode in modes:
        for i, (a, b) in enumerate(zip(native, paths(case, mode, SHAPES, dtype))):
            assert torch.equal(a, b), f"{case}: tensor {i} ({tuple(a.shape)} {a.dtype}) differs between native and {mode}"


@pytest.mark.parametrize("case", [c for c in MUON if c.represents], ids=str)
def test_muons_bf16_momentum_takes_the_native_kernel_to_the_bit(case, paths, monkeypatch) -> None:
    """A bf16 momentum buffer (``state_dtype=torch.bfloat16``, stochastically rounded): the
    kernel's bf16-state loop with Muon's rule, native = eager to the bit."""
    case = dataclasses.replace(case, kwargs={**case.kwargs, "state_dtype": torch.bfloat16})
    seen = []
    real = cpu_native.dense
    monkeypatch.setattr(cpu_native, "dense", lambda *a, **k: seen.append((a[0].name, {s.dtype for s in a[3]})) or real(*a, **k))
    native = paths(case, "native", SHAPES)
    assert ("muon_momentum", {torch.bfloat16}) in seen, seen
    assert any(t.dtype == torch.bfloat16 for t in native)
    for i, (a, b) in enumerate(zip(native, paths(case, "eager", SHAPES))):
        assert torch.equal(a, b), f"{case}: tensor {i} ({tuple(a.shape)} {a.dtype}) differs between native and eager"


# ---- the background build -------------------------------------------------------------------
STEPS = textwrap.dedent("""
    import json, sys, time, torch, leanopt
    from leanopt.kernels import cpu_native
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(256, 1024, generator=gen))
    opt = leanopt.AdamW8bit([p], lr=1e-2)
    times, pending = [], []
    for step in range(6):
        if step == 3 and sys.argv[1] == "wait":
            open(sys.argv[2], "w").close()  # three steps taken: the compiler may go on
            cpu_native.available()  # the build done: the last steps run natively
        p.grad = torch.randn(p.shape, generator=gen)
        p.grad[:, ::4] = 0
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
        pending.append(cpu_native.pending())
    print(json.dumps({"times": times, "pending": pending, "ready": cpu_native.ready(),
                      "error": cpu_native.build_error(), "sum": p.double().sum().item(),
                      "bits": p.detach().view(torch.int32).sum().item()}))
""")


def _run(env: dict[str, str], *how: str) -> tuple[dict, str]:
    proc = subprocess.run([sys.executable, "-c", STEPS, *how], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **env})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.fixture(scope="module")
def warm() -> dict:
    """STEPS on the machine's cache, the kernel loaded from the first step: the bits the runs
    below must give (one process for both tests)."""
    if not cpu_native.available():
        pytest.skip(f"native CPU kernel unavailable: {cpu_native.build_error()}")
    seen, _ = _run({}, "go")
    return seen


@pytest.mark.slow
def test_the_first_steps_never_wait_for_the_build(tmp_path: Path, warm: dict) -> None:
    """A fresh extensions cache and a compiler that says what ``-march=native`` means (the cache
    key) and compiles only once the process has taken three steps (or after 120 s): a step that
    waited for the build would wait for that bound and see the kernel ready. The steps run
    (eagerly) while the kernel builds, then natively, with the bits of a run that had the kernel
    from its first step. Its version queries and the link are not held: waiting on them as well
    would show nothing more."""
    if not cpu_native.available():
        pytest.skip(f"native CPU kernel unavailable: {cpu_native.build_error()}")
    from leanopt.kernels.cpu import cxx_compiler

    release, held = tmp_path / "release", tmp_path / "held-c++"
    wait = f"i=0; while [ ! -e '{release}' ] && [ $i -lt 1200 ]; do sleep 0.1; i=$((i + 1)); done"
    held.write_text(f'#!/bin/sh\ncase " $* " in *" -### "*|*" -c "*) {wait};; esac\nexec {cxx_compiler()} "$@"\n')
    held.chmod(0o755)
    fresh, stderr = _run({"TORCH_EXTENSIONS_DIR": str(tmp_path / "cache"), "CXX": str(held)}, "wait", str(release))
    # Three steps done before the build was, none of them waiting for it (the compiler was held
    # until they were done): no timing involved.
    assert fresh["pending"][:3] == [True, True, True], fresh
    assert fresh["ready"] and fresh["pending"][3:] == [False] * 3, fresh
    assert stderr.count("building the native CPU kernel in the background") == 1, stderr
    assert warm["ready"] and not any(warm["pending"]), warm  # the machine's cache: the kernel from the first step
    assert (fresh["bits"], fresh["sum"]) == (warm["bits"], warm["sum"])


def test_without_a_compiler_one_line_and_the_same_bits(tmp_path: Path, warm: dict) -> None:
    """No C++ compiler (a slim container): one line says so and what it costs, no torch
    banners or per-graph failures, and the steps give the native kernel's bits."""
    if not cpu_native.available():
        pytest.skip(f"native CPU kernel unavailable: {cpu_native.build_error()}")
    none, stderr = _run({"CXX": str(tmp_path / "no-such-c++"), "TORCH_EXTENSIONS_DIR": str(tmp_path / "c")}, "go")
    lines = [ln for ln in stderr.splitlines() if ln.strip() and "torchao" not in ln and "_pytree" not in ln]
    assert len(lines) == 1 and "no C++ compiler" in lines[0] and "no-such-c++" in lines[0], stderr
    assert not none["ready"] and "no C++ compiler" in none["error"]
    assert (none["bits"], none["sum"]) == (warm["bits"], warm["sum"])


def test_build_kernels_says_where_or_why_not(tmp_path: Path) -> None:
    ok = subprocess.run([sys.executable, "-m", "leanopt", "build-kernels"], capture_output=True, text=True, timeout=600)
    if not cpu_native.available():
        pytest.skip(f"native CPU kernel unavailable: {cpu_native.build_error()}")
    assert ok.returncode == 0 and "native CPU kernel ready" in ok.stdout and cpu_native.build_folder() in ok.stdout, ok
    env = {**os.environ, "CXX": str(tmp_path / "no-such-c++"), "TORCH_EXTENSIONS_DIR": str(tmp_path / "c")}
    bad = subprocess.run([sys.executable, "-m", "leanopt", "build-kernels"], capture_output=True, text=True, timeout=600, env=env)
    assert bad.returncode == 2 and not bad.stdout, bad
    assert bad.stderr.strip().splitlines() == [f"leanopt: error: the native CPU kernel cannot be built: no C++ compiler "
                                               f"({tmp_path / 'no-such-c++'} not found)"]  # fmt: skip


def test_a_choice_runs_the_faster_way_and_retries_the_other() -> None:
    from leanopt.kernels.cpu import Choice

    choice, taken = Choice(), []
    cost = {True: 3.0, False: 1.0}  # the second way is faster ...
    for call in range(200):
        if call == 100:
            cost = {True: 1.0, False: 4.0}  # ... until the machine changes
        way = choice.pick()
        taken.append(way)
        choice.record(way, cost[way])
    first, second = taken[6:100], taken[120:]
    assert taken[:6] == [True, False] * 3  # both ways measured before choosing
    assert 0 < first.count(True) <= len(first) // 8 + 1  # retried, rarely
    assert second.count(True) >= len(second) - len(second) // 8 - 1  # followed the change
    assert choice.interval >= 2 * Choice.FIRST  # retries thin out while the choice stands


@pytest.mark.parametrize("threads", [2, 3])
def test_adafactor_spread_or_in_order_gives_the_same_bits(monkeypatch, threads: int) -> None:
    import leanopt

    shapes = [(700, 300), (64, 2000), (5, 30, 200), (3000,), (1, 1)]
    gen = torch.Generator().manual_seed(7)
    start = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(4)]

    def run(way: str) -> list[torch.Tensor]:
        monkeypatch.setenv("LEANOPT_CPU_SPREAD", way)
        params = [torch.nn.Parameter(p.clone()) for p in start]
        opt = leanopt.Adafactor(params, beta1=0.9, weight_decay=0.01)
        for step in grads:
            for p, g in zip(params, step):
                p.grad = g.clone()
            opt.step()
        return [p.detach() for p in params]

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        spread, in_order = run("1"), run("0")
    finally:
        torch.set_num_threads(old)
    for a, b in zip(spread, in_order):
        assert torch.equal(a, b)


# ---- the compiled quantized update's temporaries ----------------------------------------------------
@pytest.mark.usefixtures("dynamo_only")
@pytest.mark.parametrize("backend", ["cpu", "compiled"])
def test_the_compiled_quantized_update_runs_in_bounded_chunks(monkeypatch, backend: str) -> None:
    """Where the native kernel does not take a param (fp16 params, a rule without a C++
    twin, no kernel), and on the compiled path of any device (lists of spans), the quantized
    graph runs over at most ``QUANTIZED_CHUNK`` elements at a time: its temporaries (8-12 B per
    element) follow the chunk, not the largest param (an 11.7M-element embedding: 89 MiB at 8
    bits). The same bits as one call over the whole param: the decay rounding's dither is keyed
    on each chunk's global offset."""
    import leanopt
    from leanopt.compare.meter import TensorPeak

    numel, chunk = 1 << 19, 1 << 15
    # Lists of 4 spans, not MAX_LIST (16): the same code path, a quarter of the graph to trace.
    monkeypatch.setattr(graphs, "MAX_LIST", 4)
    gen = torch.Generator().manual_seed(0)
    init = torch.randn(numel, generator=gen)
    grads = [torch.randn(numel, generator=gen) * (torch.rand(numel, generator=gen) > 0.3) for _ in range(3)]

    def train(per_call: int) -> tuple[list[torch.Tensor], int]:
        monkeypatch.setattr(graphs, "QUANTIZED_CHUNK", per_call)
        w = torch.nn.Parameter(init.clone())
        opt = leanopt.AdamW8bit([w], lr=1e-2, backend=backend)
        with cpu_native.disabled():
            for g in grads[:-1]:
                w.grad = g.clone()
                opt.step()
            w.grad = grads[-1].clone()
            meter = TensorPeak()
            if not meter.start():
                pytest.skip("the torch profiler does not run here")
            opt.step()
            peak = meter.stop()
        state = opt.state[w]
        return [w.detach(), *(t for k in ("exp_avg", "exp_avg_sq") for t in (state[k].codes, state[k].absmax))], peak or 0

    whole, whole_peak = train(numel)
    chunked, chunked_peak = train(chunk)
    assert all(torch.equal(a, b) for a, b in zip(whole, chunked))
    # Temporaries: proportional to what one call takes (the eager-run graph here holds tens of
    # bytes per element; Inductor's fused loop 8), so 16x fewer elements per call, 16x less.
    assert chunked_peak * 8 <= whole_peak, (chunked_peak, whole_peak)
    assert chunked_peak <= 200 * chunk, chunked_peak


def test_row_spans_never_leave_a_single_row() -> None:
    assert graphs.row_spans(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert graphs.row_spans(9, 4) == [(0, 4), (4, 9)]
    assert graphs.row_spans(1, 4) == [(0, 1)]
    assert graphs.row_spans(4, 4) == [(0, 4)]


# ---- the Inductor options of the graphs over stored states ------------------------------------------
@pytest.mark.parametrize("backend", ["cpu", "compiled"])
def test_graphs_over_stored_states_take_their_inductor_options(monkeypatch, backend: str) -> None:
    """The graphs that decode and re-encode stored states compile with
    ``kernels.cpu.stored_state_options``. Quantized states: no bounds check of the code-book
    gathers (their indices are in range by construction). Two stored states or more (AdamW's
    quantized or bf16 pair): scalar loops, where Inductor's vector code stepped slower
    (docs/benchmarks.md); not the quantized graph with the decay rounding (a gradient with an
    exact 0 on the CPU path; always on the compiled lists), nor one state (Lion's): the vector
    code was faster there. ``torch.compile`` is recorded here, not run: what the compiled graphs
    compute is held to the reference by test_rules and test_bf16_states."""
    import leanopt
    from leanopt.kernels import cpu

    seen: dict[str, dict | None] = {}

    def record(fn, **kwargs):
        seen[fn.__name__] = kwargs.get("options")
        return fn

    monkeypatch.setattr(torch, "compile", record)
    monkeypatch.setattr(cpu, "can_compile", lambda: True)
    monkeypatch.setattr(cpu_elementwise, "can_compile", lambda: True)
    runs = {"AdamW8bit": (leanopt.AdamW8bit, {}, False), "AdamW8bit, a 0 in the gradient": (leanopt.AdamW8bit, {}, True),
            "Lion8bit": (leanopt.Lion8bit, {}, False), "AdamW-bf16-states": (leanopt.AdamW, {"state_dtype": torch.bfloat16}, False),
            "Lion-bf16-states": (leanopt.Lion, {"state_dtype": torch.bfloat16}, False)}  # fmt: skip
    got = {}
    for label, (cls, kwargs, zero) in runs.items():
        seen.clear()
        for cache in ("_QUANTIZED", "_ROUNDED", "_DENSE"):  # each run compiles its graphs afresh
            monkeypatch.setattr(cpu_elementwise, cache, {})
        monkeypatch.setattr(graphs, "_LISTS", {})
        p = torch.nn.Parameter(torch.randn(64, 256).to(torch.bfloat16))
        p.grad = torch.randn_like(p)
        if zero:
            p.grad.view(-1)[::7] = 0
        with cpu_native.disabled():  # where the kernel runs (fp32 and bf16 params), nothing is compiled
            cls([p], lr=1e-3, backend=backend, **kwargs).step()
        stored = {name: options for name, options in seen.items() if "quantized" in name or "bf16" in name}
        assert len(stored) == 1, (label, seen)
        got[label] = next(iter(stored.values()))
    no_check, scalar = {"assert_indirect_indexing": False}, {"cpp.simdlen": 0}
    plain_pair = no_check if backend == "compiled" else {**no_check, **scalar}  # the lists always decay-round
    assert got == {"AdamW8bit": plain_pair, "AdamW8bit, a 0 in the gradient": no_check, "Lion8bit": no_check,
                   "AdamW-bf16-states": scalar, "Lion-bf16-states": None}  # fmt: skip
