"""Backends of leanopt's update rules.

``reference`` is plain tensor maths, one parameter at a time, and the oracle every other
backend is tested against. ``cpu`` is the fast CPU path, ``triton`` the GPU kernels (also
runnable on the CPU under ``TRITON_INTERPRET=1``, which is how CI tests them).
"""

from __future__ import annotations

import importlib.util
import os

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
        if device.type == "cuda" and triton_available():
            return "triton"
        return "cpu" if device.type == "cpu" else "reference"
    if backend == "triton":
        if not triton_available():
            raise RuntimeError("backend='triton' needs the triton package (pip install triton)")
        if device.type == "cpu" and not triton_interpreted():
            raise RuntimeError("backend='triton' on CPU tensors needs TRITON_INTERPRET=1 (Triton's interpreter)")
        return "triton"
    if backend == "cpu" and device.type != "cpu":
        raise RuntimeError(f"backend='cpu' got tensors on {device}")
    return backend


def adamw(backend: str, tables, key: str, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, step_tensors, **hp) -> None:
    """AdamW on lists of tensors of one device; ``step_tensors`` already hold the new step."""
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
