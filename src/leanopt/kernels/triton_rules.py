"""The rules of :mod:`leanopt.kernels.rules` as ``@triton.jit`` helpers, one per rule.

Each helper takes fp32 values ``(p, g, s0, s1, s2)`` (``g`` already negated under
``maximize``; states a rule does not have are passed through unchanged), a pointer ``c`` to
this tensor's row of the scalar table (the rule's ``scalar_values``, rounded to fp32 once, at
the positions :data:`leanopt.kernels.twins.TRITON` declares for it), the rule's flags as bits
(``FLAGS``: bit k is ``rule.flags[k]``) and ``SAFE``, and returns the new ``(p, s0, s1, s2)``.
:func:`rule_update` picks the helper by the rule's number (:func:`leanopt.kernels.rules.rule_id`,
the one numbering the C++ kernel uses too); the kernels in ``triton_elementwise`` call only
that, and only for the rules :func:`leanopt.kernels.twins.takes` says have a helper here
(``kernels.select`` sends the others elsewhere). The parity tests hold each helper to the
torch elementwise function of the same rule.
"""

from __future__ import annotations

import triton
import triton.language as tl

from leanopt.kernels.rules import RULES, rule_id
from leanopt.kernels.triton_common import is_finite

ADAMW_ID: tl.constexpr = tl.constexpr(rule_id(RULES["adamw"]))
LION_ID: tl.constexpr = tl.constexpr(rule_id(RULES["lion"]))
ADEMAMIX_ID: tl.constexpr = tl.constexpr(rule_id(RULES["ademamix"]))
SGD_ID: tl.constexpr = tl.constexpr(rule_id(RULES["sgd"]))


@triton.jit
def adamw_rule(p, g, m, v, vmax, c, AMSGRAD: tl.constexpr, SAFE: tl.constexpr):
    # twins.TRITON["adamw"]: decay, lerp_weight, beta2, one_minus_beta2, eps, step_size, bc2_sqrt, floor
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
def lion_rule(p, g, m, s1, s2, c, SAFE: tl.constexpr):
    # twins.TRITON["lion"]: decay, beta1, one_minus_beta1, beta2, one_minus_beta2, lr
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
def ademamix_rule(p, g, m1, m2, nu, c, SAFE: tl.constexpr):
    # twins.TRITON["ademamix"]: decay, beta1, one_minus_beta1, beta3, one_minus_beta3, beta2,
    # one_minus_beta2, bc1, alpha, bc2_sqrt, eps, lr, floor_fast, floor_slow
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
def sgd_rule(p, g, buf, s1, s2, c, NESTEROV: tl.constexpr, N_STATES: tl.constexpr):
    # twins.TRITON["sgd"]: weight_decay, momentum, buffer_decay, buffer_weight, lr
    d = g + tl.load(c) * p
    if N_STATES > 0:
        buf = buf * tl.load(c + 2) + tl.load(c + 3) * d
        if NESTEROV:
            d = d + tl.load(c + 1) * buf
        else:
            d = buf
    p = p - tl.load(c + 4) * d
    return p, buf, s1, s2


@triton.jit
def rule_update(p, g, s0, s1, s2, c, RULE: tl.constexpr, FLAGS: tl.constexpr, SAFE: tl.constexpr,
                N_STATES: tl.constexpr):  # fmt: skip
    """The helper of rule number ``RULE`` (:func:`leanopt.kernels.rules.rule_id`); a number
    without a helper fails to compile (``kernels.select`` never sends one) instead of running
    another rule."""
    if RULE == ADAMW_ID:
        p, s0, s1, s2 = adamw_rule(p, g, s0, s1, s2, c, (FLAGS & 1) != 0, SAFE)
    elif RULE == LION_ID:
        p, s0, s1, s2 = lion_rule(p, g, s0, s1, s2, c, SAFE)
    elif RULE == ADEMAMIX_ID:
        p, s0, s1, s2 = ademamix_rule(p, g, s0, s1, s2, c, SAFE)
    elif RULE == SGD_ID:
        p, s0, s1, s2 = sgd_rule(p, g, s0, s1, s2, c, (FLAGS & 1) != 0, N_STATES)
    else:
        tl.static_assert(False, "no Triton helper for this rule number")
    return p, s0, s1, s2


@triton.jit
def skipped_elements(g, s0, s1, s2, N_STATES: tl.constexpr):
    """rules.skipped_elements: ``g * g`` not finite (g NaN/Inf or ``|g| >= 2^64`` in fp32) or
    a new state not finite."""
    ok = is_finite(g * g)
    if N_STATES > 0:
        ok = ok & is_finite(s0)
    if N_STATES > 1:
        ok = ok & is_finite(s1)
    if N_STATES > 2:
        ok = ok & is_finite(s2)
    return ~ok
