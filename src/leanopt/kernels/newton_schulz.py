"""Newton-Schulz orthogonalization: Muon's matrix stage, one matrix at a time.

:func:`zeropower` is ``torch.optim.Muon``'s ``_zeropower_via_newtonschulz`` op for op (the
reference: leanopt's Muon on the reference backend is bit-identical to torch's): the update is
cast to bf16, transposed when it has more rows than columns, divided by its Frobenius norm
(clamped at ``eps``), and ``steps`` times ``A = X X^T; B = b A + c A A; X = a X + B X``.

:func:`orthogonalize` extends it to the params torch refuses, each as matrices the caller
names: a 2-D param is one matrix; a param whose ``flatten`` is set (a convolution's
``[out, in, *kernel]`` weight) is the matrix ``[out, in * prod(kernel)]`` of its flattening, as
KellerJordan's Muon treats a 4-D conv weight; any other param of more than 2 dims is a stack of
matrices over its leading dims (mixture-of-experts weights ``[experts, rows, cols]``), each
orthogonalized on its own. Its temporaries are those of one matrix at a time: the bf16 copy
``X`` (``min * max`` elements) and the Gram matrices ``A``, ``B`` (``min * min`` each) with their
products (:func:`temporary_bytes`), whatever the number of matrices in the stack.

:func:`flops` counts the multiply-adds of the iteration (each ``m x k @ k x n`` product as
``2 m k n``), which a planner sets beside a model's forward and backward.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["COEFFICIENTS", "EPS", "NS_STEPS", "flops", "matrices", "orthogonalize", "temporary_bytes", "zeropower"]

# KellerJordan's quintic (https://kellerjordan.github.io/posts/muon/), torch.optim.Muon's defaults.
COEFFICIENTS = (3.4445, -4.7750, 2.0315)
EPS = 1e-7
NS_STEPS = 5


def zeropower(update: Tensor, coefficients: Sequence[float], steps: int, eps: float) -> Tensor:
    """The orthogonalization of the 2-D ``update`` (a new bf16 tensor), exactly torch's."""
    a, b, c = coefficients
    x = update.to(torch.bfloat16, copy=True)  # a bf16 update is not divided in place
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def matrices(shape: Sequence[int], flatten: bool) -> tuple[int, int, int]:
    """``(count, rows, cols)``: the matrices a param of ``shape`` is orthogonalized as."""
    if len(shape) < 2:
        raise ValueError(f"a param of shape {tuple(shape)} has no matrix to orthogonalize (Muon needs >= 2 dims)")
    if flatten or len(shape) == 2:
        return 1, shape[0], math.prod(shape[1:])
    return math.prod(shape[:-2]), shape[-2], shape[-1]


def orthogonalize(update: Tensor, coefficients: Sequence[float], steps: int, eps: float, *, flatten: bool = False) -> Tensor:
    """``update`` orthogonalized as the matrices of :func:`matrices`, in its own shape (bf16)."""
    count, rows, cols = matrices(update.shape, flatten)
    if count == 1:
        return zeropower(update.reshape(rows, cols), coefficients, steps, eps).view(update.shape)
    out = torch.empty(update.shape, dtype=torch.bfloat16, device=update.device)
    stack, dest = update.reshape(count, rows, cols), out.view(count, rows, cols)
    for k in range(count):  # one matrix's temporaries at a time
        dest[k] = zeropower(stack[k], coefficients, steps, eps)
    return out


def flops(shape: Sequence[int], steps: int, flatten: bool = False) -> int:
    """Floating-point operations of orthogonalizing a param of ``shape``: per matrix of
    ``m <= n`` (after the transpose), ``steps * (4 m^2 n + 2 m^3)``."""
    count, rows, cols = matrices(shape, flatten)
    m, n = min(rows, cols), max(rows, cols)
    return count * steps * (4 * m * m * n + 2 * m**3)


def temporary_bytes(shape: Sequence[int], flatten: bool = False) -> int:
    """Bytes the iteration's own tensors hold at most for one param of ``shape`` beyond its
    inputs: the bf16 result, and the bf16 iterate, two Gram-sized matrices and the next iterate
    of the matrix in flight. A BLAS library adds its own buffers to a bf16 product (on the CPU
    here up to ~3x this for small matrices, measured with the torch profiler): a planner counts
    them from a trace, not from this figure."""
    count, rows, cols = matrices(shape, flatten)
    m, n = min(rows, cols), max(rows, cols)
    one = 2 * (2 * m * n + 2 * m * m)
    return one + (2 * count * rows * cols if count > 1 else 0)
