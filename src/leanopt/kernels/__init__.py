"""Backends of leanopt's update rules.

``reference`` is plain tensor maths, one parameter at a time, and the oracle every other
backend is tested against. ``cpu`` is the fast CPU path, ``triton`` the GPU kernels (also
runnable on the CPU under ``TRITON_INTERPRET=1``, which is how CI tests them).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

BACKENDS = ("auto", "reference", "cpu", "triton")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"Invalid backend: {backend!r} (choose from {', '.join(BACKENDS)})")
    return backend


def resolve_backend(backend: str, device: torch.device) -> str:
    """The backend that runs for tensors on ``device`` when ``backend`` was asked for."""
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
    disabled = torch.compiler.disable(fn, recursive=True)

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return disabled(*args, **kwargs)
        return fn(*args, **kwargs)

    return run


def adamw(backend: str, tables, key: str, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, step_tensors, **hp) -> None:
    """AdamW on lists of tensors of one device; ``step_tensors`` already hold the new step."""
    with row_major([params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs], read_only=(1,)) as lists:
        _adamw(backend, tables, key, *lists, step_tensors, **hp)


def _adamw(backend: str, tables, key: str, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, step_tensors, **hp) -> None:
    if backend == "triton":
        from leanopt.kernels import triton_adamw

        steps = [int(s.item()) for s in step_tensors]  # host tensors: no device sync
        triton_adamw.adamw(tables, key, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, **hp)
    elif backend == "cpu":
        from leanopt.kernels import cpu

        cpu.adamw(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, step_tensors, **hp)
    else:
        from leanopt.kernels import reference

        for i, p in enumerate(params):
            vmax = max_exp_avg_sqs[i] if max_exp_avg_sqs is not None else None
            reference.adamw_(p, grads[i], exp_avgs[i], exp_avg_sqs[i], vmax, int(step_tensors[i].item()), **hp)


def adafactor(
    backend: str, tables, key: str, params, grads, exp_avgs, exp_avg_sq_rows, exp_avg_sq_cols, exp_avg_sqs, step_tensors, **hp
) -> None:
    """Adafactor on lists of tensors of one device; ``step_tensors`` already hold the new step.

    State lists hold ``None`` where a param has no such state (``exp_avg`` without ``beta1``, the
    row/column pair of a < 2-D param, ``exp_avg_sq`` of a factored one). The fast backends take
    plain (not DTensor), contiguous, non-empty tensors; the rest runs the reference.
    """
    with row_major([params, grads, exp_avgs, exp_avg_sq_rows, exp_avg_sq_cols, exp_avg_sqs], read_only=(1,)) as lists:
        _adafactor(backend, tables, key, *lists, step_tensors, **hp)


def _adafactor(
    backend: str, tables, key: str, params, grads, exp_avgs, exp_avg_sq_rows, exp_avg_sq_cols, exp_avg_sqs, step_tensors, **hp
) -> None:
    from leanopt.kernels import reference

    steps = [int(s.item()) for s in step_tensors]  # host tensors: no device sync
    states = (exp_avgs, exp_avg_sq_rows, exp_avg_sq_cols, exp_avg_sqs)
    fast: list[int] = []
    for i, p in enumerate(params):
        if backend != "reference" and _adafactor_fast_path_takes(backend, p, grads[i], [s[i] for s in states]):
            fast.append(i)
        else:
            reference.adafactor_(p, grads[i], *(s[i] for s in states), steps[i], **hp)
    if not fast:
        return
    schedule = {k: hp.pop(k) for k in ("lr", "decay_rate", "relative_step", "warmup_init")}
    from leanopt.kernels.reference import adafactor_schedule

    scalars = [adafactor_schedule(steps[i], **schedule) for i in fast]
    pick = lambda seq, idx: [seq[i] for i in idx]  # noqa: E731
    if backend == "triton":
        from leanopt.kernels import triton_adafactor

        triton_adafactor.adafactor(
            tables, key, pick(params, fast), pick(grads, fast), *(pick(s, fast) for s in states),
            [r for r, _ in scalars], [b for _, b in scalars], **hp,
        )  # fmt: skip
        return
    from leanopt.kernels import cpu

    # One call per (compute dtype, step): params that skipped steps have their own rho_t, beta2_t.
    cohorts: dict[tuple, list[int]] = {}
    for i, (rho, beta2t) in zip(fast, scalars):
        cohorts.setdefault((params[i].dtype == torch.float64, rho, beta2t), []).append(i)
    for (_, rho, beta2t), idx in cohorts.items():
        cpu.adafactor(pick(params, idx), pick(grads, idx), *(pick(s, idx) for s in states), rho, beta2t, **hp)


def _adafactor_fast_path_takes(backend: str, p: torch.Tensor, g: torch.Tensor, states: list) -> bool:
    dtypes = (torch.float32, torch.bfloat16, torch.float16) + ((torch.float64,) if backend == "cpu" else ())
    return (
        type(p) in (torch.Tensor, torch.nn.Parameter)
        and type(g) is torch.Tensor
        and p.numel() > 0
        and p.dtype in dtypes
        and g.dtype in dtypes
        and g.shape == p.shape
        and p.is_contiguous()
        and g.is_contiguous()
        and all(s is None or s.is_contiguous() for s in states)
    )


def _quantized_kernel_takes(m, v, p: torch.Tensor) -> bool:
    """Whether the fused quantized kernels handle these moments (else the reference runs)."""
    from leanopt.quant import QuantizedState

    if p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if isinstance(m, QuantizedState) and isinstance(v, QuantizedState):
        # Code books hold distinct sorted values (spare codes pad the end), so the index the
        # threshold search returns is the code itself, as in BlockFormat.encode_.
        fm, fv = m.format, v.format
        return fm.bits == fv.bits and fm.block_size == fv.block_size and fm.block_size % 2 == 0 and 2048 % fm.block_size == 0
    return isinstance(m, torch.Tensor) and isinstance(v, torch.Tensor) and m.dtype == v.dtype == torch.float32


def adamw_quantized(backend: str, tables, key: str, params, grads, exp_avgs, exp_avg_sqs, step_tensors, **hp) -> None:
    """AdamW8bit/AdamW4bit's rule on lists of one device; moments are QuantizedStates or dense."""
    with row_major([params, grads, exp_avgs, exp_avg_sqs], read_only=(1,)) as lists:
        _adamw_quantized(backend, tables, key, *lists, step_tensors, **hp)


def _adamw_quantized(backend: str, tables, key: str, params, grads, exp_avgs, exp_avg_sqs, step_tensors, **hp) -> None:
    from leanopt.kernels import reference

    steps = [int(s.item()) for s in step_tensors]  # host tensors: no device sync
    slack = 1 + reference.MOMENT_BOUND_SLACK
    floor_divs = [reference.adam_moment_bound(hp["beta1"], hp["beta2"], s) * slack for s in steps]
    fast = [] if backend == "reference" else [i for i, p in enumerate(params) if _quantized_kernel_takes(exp_avgs[i], exp_avg_sqs[i], p)]
    if fast and backend == "triton":
        from leanopt.kernels import triton_adamw, triton_quant

        quant = [i for i in fast if not isinstance(exp_avgs[i], torch.Tensor)]
        dense = [i for i in fast if isinstance(exp_avgs[i], torch.Tensor)]
        for idx, launch in ((quant, triton_quant.adamw_quantized), (dense, triton_adamw.adamw)):
            if not idx:
                continue
            pick = lambda seq: [seq[i] for i in idx]  # noqa: E731
            if launch is triton_adamw.adamw:
                launch(tables, key + "/dense", pick(params), pick(grads), pick(exp_avgs), pick(exp_avg_sqs), None,
                       pick(steps), pick(floor_divs), **hp)  # fmt: skip
            else:
                launch(tables, key, pick(params), pick(grads), pick(exp_avgs), pick(exp_avg_sqs), pick(steps),
                       pick(floor_divs), **hp)  # fmt: skip
    elif fast and backend == "cpu":
        from leanopt.kernels import cpu

        pick = lambda seq: [seq[i] for i in fast]  # noqa: E731
        cpu.adamw_quantized(pick(params), pick(grads), pick(exp_avgs), pick(exp_avg_sqs), pick(steps), pick(floor_divs), **hp)
    taken = set(fast)
    for i, p in enumerate(params):
        if i not in taken:
            reference.adamw_quantized_(p, grads[i], exp_avgs[i], exp_avg_sqs[i], steps[i], **hp)
