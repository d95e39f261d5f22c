"""Backends of leanopt's update rules.

``reference`` is plain tensor maths, one parameter at a time, and the oracle every other
backend is tested against. ``cpu`` is the fast CPU path, ``triton`` the GPU kernels (also
runnable on the CPU under ``TRITON_INTERPRET=1``, which is how CI tests them), ``compiled`` a
rule's own function compiled by Inductor over lists of params on any device
(:mod:`leanopt.kernels.graphs`): what a rule without a Triton twin runs on a GPU, and a second,
independently generated path to hold the Triton kernels against.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from leanopt import tracing

BACKENDS = ("auto", "reference", "cpu", "triton", "compiled")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"Invalid backend: {backend!r} (choose from {', '.join(BACKENDS)})")
    return backend


def resolve_backend(backend: str, device: torch.device) -> str:
    """The backend that runs for tensors on ``device`` when ``backend`` was asked for (inside a
    trace of a GPU step, :mod:`leanopt.tracing`: the one a GPU would run)."""
    trace = tracing.active()
    if trace is not None and trace.device == "cuda":
        check_backend(backend)
        if backend == "cpu":
            raise RuntimeError("backend='cpu' got tensors on cuda")
        return "triton" if backend == "auto" else backend
    if backend == "compiled":
        # Inductor writes Triton kernels for a GPU: the same needs as backend="triton" there.
        if device.type == "cuda" and not triton_available():
            raise RuntimeError("backend='compiled' on cuda tensors needs the triton package (pip install triton)")
        if device.type == "cuda" and triton_interpreted():
            raise RuntimeError("backend='compiled' on cuda tensors needs TRITON_INTERPRET unset (it is 1)")
        return "compiled"
    if backend == "auto":
        # Under TRITON_INTERPRET=1 (how the tests run kernels on the CPU) Triton's interpreter
        # would read CUDA addresses on the host: CUDA tensors take the reference instead.
        if device.type == "cuda" and triton_available() and not triton_interpreted():
            return "triton"
        return "cpu" if device.type == "cpu" else "reference"
    if backend == "triton":
        if not triton_available():
            raise RuntimeError("backend='triton' needs the triton package (pip install triton)")
        if device.type == "cpu" and not triton_interpreted():
            raise RuntimeError("backend='triton' on CPU tensors needs TRITON_INTERPRET=1 (Triton's interpreter)")
        if device.type != "cpu" and triton_interpreted():
            raise RuntimeError(f"backend='triton' on {device.type} tensors needs TRITON_INTERPRET unset (it is 1)")
        return "triton"
    if backend == "cpu" and device.type != "cpu":
        raise RuntimeError(f"backend='cpu' got tensors on {device}")
    return backend


@contextlib.contextmanager
def row_major(lists: Sequence[Sequence[Any] | None], read_only: Sequence[int] = ()) -> Iterator[list[Any]]:
    """``lists`` with every non-contiguous tensor replaced by a contiguous copy, written back after.

    The fast kernels walk flat memory: on a view, a transposed weight or a channels_last param
    that would pair the wrong elements and write outside the param. Copies keep each kernel's
    maths as it is, at the cost of one extra pass over the (rare) strided tensors; lists at
    ``read_only`` positions (gradients) are copied but not written back. Every backend, the
    reference included, sees the same row-major tensors, so reductions (Adafactor's means and
    norms) add up in the same order whatever the param's strides.
    """
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    out: list[Any] = []
    for k, seq in enumerate(lists):
        if seq is None:
            out.append(None)
            continue
        new = []
        for t in seq:
            if isinstance(t, torch.Tensor) and not t.is_contiguous():
                c = t.contiguous()
                if k not in read_only:
                    copies.append((t, c))
                t = c
            new.append(t)
        out.append(new)
    yield out
    for t, c in copies:
        t.copy_(c)


def eager(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``fn`` (an optimizer's ``step``) eagerly when called from a ``torch.compile``'d region.

    ``torch.compile(opt.step)`` and compiled training steps that call ``opt.step()`` then
    graph-break around the step, which runs leanopt's own fused kernels (Triton, torch's fused
    CPU AdamW, graphs leanopt compiles itself). Tracing them gains nothing and breaks:
    ``_fused_adamw_`` fails functionalization, a nested compile cannot be traced, Inductor
    miscompiled Adafactor's ``x.mul_(b).add_(y, alpha=(1-b)/m)`` once ``b`` became a dynamic
    float (the update drifted from 6 % to 55 % off in six steps, silently), and tracing the
    lazily created per-param state recompiles once per param. The caller's forward and
    backward are compiled as usual.
    """
    disabled: list[Callable[..., Any]] = []  # made on the first compiled call: torch.compiler.disable imports
    # torch._dynamo (2 s of `import leanopt`), which a process that never compiles should not pay for

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            if not disabled:
                disabled.append(torch.compiler.disable(fn, recursive=True))
            return disabled[0](*args, **kwargs)
        return fn(*args, **kwargs)

    return run


# ---- one backend decision -------------------------------------------------------------------
# What runs each param's update: ``select`` picks one of these, ``step``/``adafactor`` run them.
IMPLEMENTATIONS = (
    "reference",  # kernels.reference, one param at a time (the oracle)
    "cpu-dense",  # cpu_elementwise.dense: torch's fused AdamW, or the rule compiled
    "cpu-quantized",  # cpu_elementwise.quantized: dequantize -> rule -> requantize, compiled
    "triton-dense",  # triton_elementwise.dense
    "triton-quantized",  # triton_elementwise.quantized
    "cpu-adafactor",  # cpu_adafactor.adafactor
    "triton-adafactor",  # triton_adafactor.adafactor
    "compiled-dense",  # graphs.dense: the rule compiled by Inductor, several params per call, any device
    "compiled-quantized",  # graphs.quantized: dequantize -> rule -> requantize, the same way
)
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def _select_modules() -> tuple[Any, Any, type]:
    # Imported on the first step rather than with leanopt (graphs brings Inductor's helpers),
    # once: an import statement in select would cost each param of each step its lookup.
    from leanopt.kernels import graphs, twins
    from leanopt.quant import QuantizedState

    return graphs, twins, QuantizedState


def select(backend: str, rule: Any, p: torch.Tensor, g: torch.Tensor, states: Sequence[Any],
           hp: Mapping[str, Any] | None = None) -> str:  # fmt: skip
    """The implementation (one of :data:`IMPLEMENTATIONS`) that updates ``p`` by ``rule``
    (``"adafactor"``, or a :class:`~leanopt.kernels.rules.Rule` with its hyper-parameters
    ``hp``) when ``backend`` was asked for. ``p``, ``g`` and ``states`` are the local, row-major
    tensors the kernels see (``None`` for a state the param lacks). The only place a backend is
    chosen, and it routes around each backend's limits instead of running past them: the
    Triton kernels take a rule only where it has a Triton twin taking that many states
    (:data:`leanopt.kernels.twins.TRITON`; a rule defined outside leanopt has none), else the
    next backend that can run it does -- on a GPU the rule's own function compiled by Inductor
    (``compiled-*``, :mod:`leanopt.kernels.graphs`), on CPU tensors (under
    ``TRITON_INTERPRET=1``) the CPU paths, which compile any rule with any number of states
    (the C++ kernel takes its own twins only, :data:`~leanopt.kernels.twins.NATIVE`).
    ``backend="compiled"`` takes the compiled graphs on any device (Adafactor, not a rule: its
    own fast path). Anything else a fast path does not take runs the reference. Inside a trace
    (:mod:`leanopt.tracing`) it decides for fake tensors what it decides for plain ones of
    their shapes and dtypes on the traced device.
    """
    graphs, twins, QuantizedState = _select_modules()
    trace = tracing.active()
    if trace is not None:
        p, g, states = tracing.as_if_real(p), tracing.as_if_real(g), [tracing.as_if_real(s) for s in states]
    device_type = "cuda" if trace is not None and trace.device == "cuda" else p.device.type
    resolved = resolve_backend(backend, p.device)
    plain = type(p) in (torch.Tensor, torch.nn.Parameter) and type(g) is torch.Tensor
    if resolved == "reference" or not plain or p.numel() == 0 or g.shape != p.shape:
        return "reference"
    dtypes = _KERNEL_DTYPES + ((torch.float64,) if resolved in ("cpu", "compiled") else ())
    if p.dtype not in dtypes or g.dtype not in dtypes:
        return "reference"
    present = [s for s in states if s is not None]
    if rule == "adafactor":
        if resolved == "compiled":
            return "cpu-adafactor" if device_type == "cpu" else "triton-adafactor"
        return f"{resolved}-adafactor"
    if hp is None:
        raise TypeError("select: an elementwise rule needs its hyper-parameters (hp)")
    # No Triton twin for this rule and number of states: on a GPU its compiled graph, on CPU
    # tensors (the interpreter) the CPU paths.
    if resolved == "triton" and not twins.takes(twins.TRITON, rule, hp, len(present)):
        resolved = "cpu" if device_type == "cpu" else "compiled"
    if all(type(s) is QuantizedState for s in present) and present:
        # A sharded (FSDP2) param's quantized states share scales across shard edges and are
        # another type: the reference handles them.
        formats = {s.format for s in present}
        bits, block = {f.bits for f in formats}, {f.block_size for f in formats}
        if len(bits) != 1 or len(block) != 1 or p.dtype == torch.float64:
            return "reference"
        (bs,) = block
        if resolved == "triton":
            return "triton-quantized" if bs % 2 == 0 and 2048 % bs == 0 else "reference"
        if resolved == "compiled" and bits == {4} and bs % 2:
            return "reference"  # 4-bit codes are packed in pairs within a block
        takes = graphs.quantized_takes(present, p.device)
        return ("compiled-quantized" if resolved == "compiled" else "cpu-quantized") if takes else "reference"
    if not all(isinstance(s, torch.Tensor) and type(s) is torch.Tensor for s in present):
        return "reference"
    compute = torch.float64 if p.dtype == torch.float64 else torch.float32
    if resolved == "triton":
        # fp32 states, or all bf16 (read as fp32, written with stochastic rounding); fp64 params
        # have no Triton kernel (dtypes above).
        stored = {s.dtype for s in present}
        return "triton-dense" if stored <= {torch.float32} or stored == {torch.bfloat16} else "reference"
    # bf16 states in any mix: the CPU and compiled paths write each with the stochastic rounding
    # of leanopt.quant.bf16 (never torch's fused AdamW or the native kernel, which round to nearest).
    if not all(s.dtype in (compute, p.dtype, torch.bfloat16) for s in present):
        return "reference"
    return "compiled-dense" if resolved == "compiled" else "cpu-dense"


def step(backend: str, rule, tables, key: str, params, grads, states, steps: Sequence[int], hp: Mapping[str, Any], *,
         safe: bool, offsets: Sequence[int] | None = None) -> None:  # fmt: skip
    """``rule`` (:class:`leanopt.kernels.rules.Rule`) on lists of tensors of one device.

    ``states[i]`` are param ``i``'s states in the rule's order (dense tensors in the compute
    dtype, or :class:`~leanopt.quant.QuantizedState`), ``steps[i]`` its new step count, ``hp``
    the rule's hyper-parameters; ``safe``: the low-bit optimizers' mode (floors, skipped
    elements); ``offsets[i]`` (default 0): the flat index of param ``i``'s element 0 in its
    whole tensor (a shard's start), which keys the decay rounding's dither. Each param goes to
    the implementation :func:`select` picks, in row-major form, once the rule's results were
    held to its declaration for the param's signature (:meth:`~leanopt.kernels.rules.Rule.check`).
    """
    offsets = [0] * len(params) if offsets is None else list(offsets)
    if tracing.active() is None:  # a memory trace plans the steps that the real ones check
        flags = rule.flag_values(hp)
        for i, p in enumerate(params):
            rule.check_flags(flags, hp, safe, p, len(states[i]), steps[i])
    n = max((len(s) for s in states), default=0)
    columns = [[s[j] for s in states] for j in range(n)]
    updated = list(params)
    with row_major([params, grads, *columns], read_only=(1,)) as lists:
        params, grads, columns = lists[0], lists[1], lists[2:]
        states = [[c[i] for c in columns] for i in range(len(params))]
        if any(p.dim() == 0 for p in params):
            # A 0-dim param (and its gradient and states) as the 1-element view it is: the compiled
            # graphs take 0-dim tensors for their scalars, and would key, trace and type it as one.
            params, grads = [_one_dim(p) for p in params], [_one_dim(g) for g in grads]
            states = [[_one_dim(s) for s in st] for st in states]
        chosen: dict[str, list[int]] = {}
        for i, p in enumerate(params):
            chosen.setdefault(select(backend, rule, p, grads[i], states[i], hp), []).append(i)
        for impl, idx in chosen.items():
            pick = lambda seq: [seq[i] for i in idx]  # noqa: E731
            if impl == "reference":
                from leanopt.kernels import reference

                for i in idx:
                    reference.rule_step_(rule, params[i], grads[i], states[i], steps[i], hp, safe=safe, offset=offsets[i])
            elif impl.startswith("compiled"):
                from leanopt.kernels import graphs

                if impl == "compiled-dense":
                    graphs.dense(rule, pick(params), pick(grads), pick(states), pick(steps), hp, safe=safe, offsets=pick(offsets))
                else:
                    graphs.quantized(rule, pick(params), pick(grads), pick(states), pick(steps), hp, pick(offsets))
            elif impl.startswith("cpu"):
                from leanopt.kernels import cpu_elementwise

                if impl == "cpu-dense":
                    cpu_elementwise.dense(rule, pick(params), pick(grads), pick(states), pick(steps), hp, safe=safe,
                                          offsets=pick(offsets))  # fmt: skip
                else:
                    cpu_elementwise.quantized(rule, pick(params), pick(grads), pick(states), pick(steps), hp, pick(offsets))
            else:
                from leanopt.kernels import triton_elementwise

                if impl == "triton-dense":
                    triton_elementwise.dense(rule, tables, key, pick(params), pick(grads), pick(states), pick(steps), hp,
                                             safe=safe, offsets=pick(offsets))  # fmt: skip
                else:
                    triton_elementwise.quantized(rule, tables, key, pick(params), pick(grads), pick(states), pick(steps), hp,
                                                 pick(offsets))  # fmt: skip
    bump_versions(updated)


def _one_dim(t: Any) -> Any:
    return t.view(1) if isinstance(t, torch.Tensor) and t.dim() == 0 else t


def bump_versions(params: Sequence[Any]) -> None:
    """Mark ``params`` as modified in place, as a torch in-place op would: their autograd
    version counters go up, so a backward through a graph that saved one of them (its old
    value) raises instead of silently using the new one. The native CPU kernel and the Triton
    kernels write a param's memory directly, which bumps nothing; bumping twice (after a
    ``copy_``) is harmless. Inference tensors have no counter and are left alone."""
    tensors = [p for p in params if isinstance(p, torch.Tensor) and not p.is_inference()]
    if tensors:
        torch._C._increment_version(tensors)


def adafactor(
    backend: str, tables, key: str, params, grads, exp_avgs, exp_avg_sq_rows, exp_avg_sq_cols, exp_avg_sqs, steps, **hp
) -> None:
    """Adafactor on lists of tensors of one device; ``steps`` hold the new step counts.

    State lists hold ``None`` where a param has no such state (``exp_avg`` without ``beta1``, the
    row/column pair of a < 2-D param, ``exp_avg_sq`` of a factored one).
    """
    with row_major([params, grads, exp_avgs, exp_avg_sq_rows, exp_avg_sq_cols, exp_avg_sqs], read_only=(1,)) as lists:
        ps, gs, ms, rows, cols, vs = lists
        _adafactor(backend, tables, key, ps, gs, ms, rows, cols, vs, steps, **hp)
    bump_versions(params)


def _adafactor(
    backend: str, tables, key: str, params, grads, exp_avgs, exp_avg_sq_rows, exp_avg_sq_cols, exp_avg_sqs, steps, **hp
) -> None:
    from leanopt.kernels import reference

    states = (exp_avgs, exp_avg_sq_rows, exp_avg_sq_cols, exp_avg_sqs)
    fast: list[int] = []
    impl = None
    for i, p in enumerate(params):
        chosen = select(backend, "adafactor", p, grads[i], [s[i] for s in states])
        if chosen == "reference":
            reference.adafactor_(p, grads[i], exp_avgs[i], exp_avg_sq_rows[i], exp_avg_sq_cols[i], exp_avg_sqs[i], steps[i], **hp)
        else:
            fast.append(i)
            impl = chosen
    if not fast:
        return
    schedule = {k: hp.pop(k) for k in ("lr", "decay_rate", "relative_step", "warmup_init")}
    scalars = [reference.adafactor_schedule(steps[i], **schedule) for i in fast]
    pick = lambda seq, idx: [seq[i] for i in idx]  # noqa: E731
    if impl == "triton-adafactor":
        from leanopt.kernels import triton_adafactor

        triton_adafactor.adafactor(
            tables, key, pick(params, fast), pick(grads, fast),
            pick(exp_avgs, fast), pick(exp_avg_sq_rows, fast), pick(exp_avg_sq_cols, fast), pick(exp_avg_sqs, fast),
            [r for r, _ in scalars], [b for _, b in scalars], **hp,
        )  # fmt: skip
        return
    from leanopt.kernels import cpu_adafactor

    # One call per (compute dtype, step): params that skipped steps have their own rho_t, beta2_t.
    cohorts: dict[tuple, list[int]] = {}
    for i, (rho, beta2t) in zip(fast, scalars):
        cohorts.setdefault((params[i].dtype == torch.float64, rho, beta2t), []).append(i)
    for (_, rho, beta2t), idx in cohorts.items():
        cpu_adafactor.adafactor(pick(params, idx), pick(grads, idx), pick(exp_avgs, idx), pick(exp_avg_sq_rows, idx),
                                pick(exp_avg_sq_cols, idx), pick(exp_avg_sqs, idx), rho, beta2t, **hp)  # fmt: skip
