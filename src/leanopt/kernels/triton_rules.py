"""The rules of :mod:`leanopt.kernels.rules` as ``@triton.jit`` helpers, one per rule.

Each helper takes fp32 values ``(p, g, s0, s1, s2)`` (``g`` already negated under
``maximize``; states a rule does not have are passed through unchanged), a pointer ``c`` to
this tensor's row of the scalar table (the rule's ``scalars``, rounded to fp32 once), the
rule's one static flag and ``SAFE``, and returns the new ``(p, s0, s1, s2)``.
:func:`rule_update` picks the helper by the rule's ``triton_id``; the kernels in
``triton_elementwise`` call only that. The parity tests hold each helper to the torch
elementwise function of the same rule.
"""

from __future__ import annotations

import triton
import triton.language as tl

from leanopt.kernels.triton_common import is_finite


@triton.jit
def adamw_rule(p, g, m, v, vmax, c, AMSGRAD: tl.constexpr, SAFE: tl.constexpr):
    decay = tl.load(c)
    w1 = tl.load(c + 1)
    beta2 = tl.load(c + 2)
    one_minus_beta2 = tl.load(c + 3)
    eps = tl.load(c + 4)
    step_size = tl.load(c + 5)
    bc2_sqrt = tl.load(c + 6)
    p = p * decay
    m = m + w1 * (g - m)
    v = v * beta2 + one_minus_beta2 * g * g
    if SAFE:
        v = tl.maximum(v, m * m / tl.load(c + 7))  # the second-moment floor
    d = v
    if AMSGRAD:
        vmax = tl.maximum(vmax, v)
        d = vmax
    p = p - step_size * (m / (tl.sqrt(d) / bc2_sqrt + eps))
    return p, m, v, vmax


@triton.jit
def lion_rule(p, g, m, s1, s2, c, FLAG: tl.constexpr, SAFE: tl.constexpr):
    decay = tl.load(c)
    beta1 = tl.load(c + 1)
    one_minus_beta1 = tl.load(c + 2)
    beta2 = tl.load(c + 3)
    one_minus_beta2 = tl.load(c + 4)
    lr = tl.load(c + 5)
    u = m * beta1 + one_minus_beta1 * g
    # torch.sign: +-1, 0 at 0, NaN at NaN (u * 0 keeps the NaN).
    sign = tl.where(u > 0, 1.0, tl.where(u < 0, -1.0, u * 0.0))
    p = p * decay - lr * sign
    m = m * beta2 + one_minus_beta2 * g
    return p, m, s1, s2


@triton.jit
def ademamix_rule(p, g, m1, m2, nu, c, FLAG: tl.constexpr, SAFE: tl.constexpr):
    decay = tl.load(c)
    beta1 = tl.load(c + 1)
    one_minus_beta1 = tl.load(c + 2)
    beta3 = tl.load(c + 3)
    one_minus_beta3 = tl.load(c + 4)
    beta2 = tl.load(c + 5)
    one_minus_beta2 = tl.load(c + 6)
    bc1 = tl.load(c + 7)
    alpha = tl.load(c + 8)
    bc2_sqrt = tl.load(c + 9)
    eps = tl.load(c + 10)
    lr = tl.load(c + 11)
    m1 = m1 * beta1 + one_minus_beta1 * g
    m2 = m2 * beta3 + one_minus_beta3 * g
    nu = nu * beta2 + one_minus_beta2 * g * g
    if SAFE:
        nu = tl.maximum(tl.maximum(nu, m1 * m1 / tl.load(c + 12)), m2 * m2 / tl.load(c + 13))
    p = p * decay - lr * ((m1 / bc1 + alpha * m2) / (tl.sqrt(nu) / bc2_sqrt + eps))
    return p, m1, m2, nu


@triton.jit
def rule_update(p, g, s0, s1, s2, c, RULE: tl.constexpr, FLAG: tl.constexpr, SAFE: tl.constexpr):
    """The helper of rule ``RULE`` (``Rule.triton_id``)."""
    if RULE == 0:
        p, s0, s1, s2 = adamw_rule(p, g, s0, s1, s2, c, FLAG, SAFE)
    elif RULE == 1:
        p, s0, s1, s2 = lion_rule(p, g, s0, s1, s2, c, FLAG, SAFE)
    else:
        p, s0, s1, s2 = ademamix_rule(p, g, s0, s1, s2, c, FLAG, SAFE)
    return p, s0, s1, s2


@triton.jit
def skipped_elements(g, s0, s1, s2, N_STATES: tl.constexpr):
    """rules.skipped_elements: ``g * g`` not finite (g NaN/Inf or ``|g| >= 2^64`` in fp32) or
    a new state not finite."""
    ok = is_finite(g * g) & is_finite(s0)
    if N_STATES > 1:
        ok = ok & is_finite(s1)
    if N_STATES > 2:
        ok = ok & is_finite(s2)
    return ~ok
