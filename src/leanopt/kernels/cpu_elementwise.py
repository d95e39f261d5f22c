"""Elementwise rules (:mod:`leanopt.kernels.rules`) on the CPU, dense or block-quantized.

* AdamW whose states have the param's dtype (fp32, fp64 params), outside safe mode: torch's
  own fused CPU kernel (``aten::_fused_adamw_``), one vectorised pass over a group's tensors.
* Other fp32 or bf16 params with fp32 or bf16 states of the rules with a C++ twin (a low-bit
  optimizer's small params, AdamW, Lion, AdEMAMix, SGD, Muon's momentum): the hand-written C++
  kernel's dense loop (:func:`leanopt.kernels.cpu_native.dense`; bf16 states with
  :mod:`leanopt.quant.bf16`'s stochastic rounding), where it builds: no compile on the first step.
* Any other dense case: the rule's elementwise function, compiled once per (rule, flags,
  dtypes) by Inductor with dynamic shapes (no per-shape recompiles); a one-element param runs it
  eagerly (Dynamo would compile a second graph for size 1; the same bits).
* Block-quantized states: fp32 or bf16 params and gradients of the rules with a C++ twin go to the hand-written
  C++ kernel (:mod:`leanopt.kernels.cpu_native`, one pass per block) when it builds here; any
  other case: dequantize -> rule -> requantize, compiled as one fused loop over whole blocks,
  for any rule and any number of states (a param of one block runs it eagerly, as a one-element
  one does). Encoding replaces the code book's binary search with one gather from a 2^16-entry
  lookup table (:func:`encode_tables`).

Scalars of the schedule reach the compiled graphs as 0-dim fp64 tensors, so a new step or lr
does not recompile.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from leanopt import tracing
from leanopt.kernels import cpu_native, graphs, reference
from leanopt.kernels.cpu import can_compile, compiled, compiled_per_dtypes, own_code, spread, stored_state_options

# What the planner and tests read here: the compiled quantized update's temporaries, the lookup
# tables and their cache, the nearest-code gather (leanopt.kernels.graphs holds them).
from leanopt.kernels.graphs import _ENCODE_TABLES as _ENCODE_TABLES
from leanopt.kernels.graphs import QUANTIZED_TEMP_BYTES as QUANTIZED_TEMP_BYTES
from leanopt.kernels.graphs import _nearest_code as _nearest_code
from leanopt.kernels.graphs import encode_tables as encode_tables
from leanopt.kernels.rules import ADAMW, Rule
from leanopt.quant.formats import may_hold_true

# ---- dense states ---------------------------------------------------------------------------
_DENSE: dict[tuple, Callable[..., Any]] = {}


def _dense_graph(rule: Rule, flags: tuple, safe: bool, maximize: bool, n: int) -> Callable[..., Any]:
    if tracing.active() is not None:  # a compiled graph cannot take fake tensors
        return graphs.traced_dense
    key = (rule, flags, safe, maximize, n)
    graph = _DENSE.get(key)
    if graph is None:
        variant = f"{rule.name}_dense{'_safe' if safe else ''}{'_max' if maximize else ''}_" + "_".join(map(str, map(int, flags)))
        update = graphs.dense_update(rule, flags, safe, maximize, n)
        graph = _DENSE[key] = compiled_per_dtypes(own_code(update, variant), fallback=functools.partial(_dense_eager, update))
    return graph


# ---- the eager path ---------------------------------------------------------------------------
# Where the rules are not compiled (no C++ compiler, LEANOPT_NO_COMPILE, a failed compile) and
# while the native kernel builds in the background, the steps run the very functions the graphs
# compile, eagerly, over chunks of EAGER_CHUNK elements (whole blocks): each op's temporaries
# then stay in cache and the allocator reuses them, where whole-tensor eager ops made ~200
# passes over fresh memory (5.5 s for a 4096 x 4096 AdamW8bit step, 100x the native kernel).
# The results are the compiled graphs' and the native kernel's, to the bit (rules.lerp,
# rules.sqrt; tests/test_cpu_paths.py), so a step may take either.
EAGER_CHUNK = 1 << 15


def _over_chunks(run: Callable[[int], None], chunks: int) -> None:
    """``run(k)`` for every chunk ``k``, spread over a few Python threads (torch releases the GIL
    in its ops; :func:`leanopt.kernels.cpu.spread`), each op on one intra-op thread. Eager ops on
    a chunk are too small for torch's OpenMP regions, whose barriers wait for a descheduled
    partner on a busy machine: thousands of regions made the eager step 20x slower at load 5
    (measured). Chunks are independent: the same bits in any order."""
    workers = max(1, min(torch.get_num_threads(), chunks))

    def worker(w: int) -> None:
        for k in range(w, chunks, workers):
            run(k)

    spread(worker, range(workers))


def _eager(eligible_native: bool) -> bool:
    """Whether a param runs the eager path: the rules are not compiled here, or the native
    kernel that would take it is still building (compiling a graph now would stall the step)."""
    return not can_compile() or (eligible_native and cpu_native.pending())


def _single(n: int) -> bool:
    """Whether a param of ``n`` elements (dense) or ``n`` blocks (quantized) runs eagerly: Dynamo
    specializes a size of 1, so one element or one block would compile a graph of its own, for a
    step of a few microseconds. Eager and compiled give the same bits (tests/test_cpu_paths.py)."""
    return n == 1


def _dense_eager(update: Callable[..., Any], p: Tensor, g: Tensor, states: Sequence[Tensor], c: Tensor) -> None:
    flat = [t.view(-1) for t in (p, g, *states)]
    n = flat[0].numel()

    def chunk(k: int) -> None:
        lo, hi = k * EAGER_CHUNK, min((k + 1) * EAGER_CHUNK, n)
        update(flat[0][lo:hi], flat[1][lo:hi], [t[lo:hi] for t in flat[2:]], c)

    _over_chunks(chunk, -(-n // EAGER_CHUNK))


# ---- bf16 states (leanopt.quant.bf16) ------------------------------------------------------
# The native kernel writes bf16 states with the same stochastic rounding (the rules with a C++
# twin); torch's fused AdamW does not. Any other param with a bf16 state runs the rule's function
# with its states upcast, and each bf16 state written back through the shared dither, compiled
# once per (rule, flags, which states are bf16) and dtypes, or eagerly over chunks (the same
# bits: the dither is keyed on global indices).
_ROUNDED: dict[tuple, Callable[..., Any]] = {}


def _dense_rounded(rule: Rule, flags: tuple, safe: bool, maximize: bool, p: Tensor, g: Tensor, states: Sequence[Tensor],
                   c: Tensor, step: int, offset: int, eager: bool) -> None:  # fmt: skip
    if tracing.active() is not None:
        return  # taken to allocate nothing of the param's size, as the dense graph (not measured)
    stored = tuple(s.dtype == torch.bfloat16 for s in states)
    update = graphs.rounded_update(rule, flags, safe, maximize, stored)
    step_t, offset_t = torch.tensor(step, dtype=torch.int64), torch.tensor(offset, dtype=torch.int64)
    if eager or _single(p.numel()):
        _rounded_eager(update, p, g.contiguous(), states, c, step_t, offset_t)
        return
    key = (rule, flags, safe, maximize, stored)
    graph = _ROUNDED.get(key)
    if graph is None:
        variant = f"{rule.name}_bf16_states{'_safe' if safe else ''}{'_max' if maximize else ''}_" + "_".join(
            map(str, map(int, flags + stored)))  # fmt: skip
        graph = _ROUNDED[key] = compiled_per_dtypes(own_code(update, variant), fallback=functools.partial(_rounded_eager, update),
                                                    options=stored_state_options(sum(stored), lookups=False))  # fmt: skip
    graph(p, g, list(states), c, step_t, offset_t)


def _rounded_eager(update: Callable[..., Any], p: Tensor, g: Tensor, states: Sequence[Tensor], c: Tensor,
                   step: Tensor, offset: Tensor) -> None:  # fmt: skip
    """:func:`leanopt.kernels.graphs.rounded_update` over chunks, each with its own global offset."""
    flat = [t.view(-1) for t in (p, g, *states)]
    n, first = flat[0].numel(), int(offset)

    def chunk(k: int) -> None:
        lo, hi = k * EAGER_CHUNK, min((k + 1) * EAGER_CHUNK, n)
        update(flat[0][lo:hi], flat[1][lo:hi], [t[lo:hi] for t in flat[2:]], c, step,
               torch.tensor(first + lo, dtype=torch.int64))  # fmt: skip

    _over_chunks(chunk, -(-n // EAGER_CHUNK))


def _fusable(rule: Rule, safe: bool, p: Tensor, g: Tensor, states: Sequence[Tensor]) -> bool:
    return rule is ADAMW and not safe and g.dtype == p.dtype and all(s.dtype == p.dtype for s in states)


def dense(rule: Rule, params, grads, states, steps: Sequence[int], hp: Mapping[str, Any], *, safe: bool,
          offsets: Sequence[int] | None = None) -> None:  # fmt: skip
    """``rule`` over CPU params with dense states in the compute dtype or bf16 (``states[i]``:
    param ``i``'s states, in the rule's order); ``steps`` hold the new step counts; ``offsets[i]``
    (default 0): the flat index of param ``i``'s element 0 in its whole tensor, which keys the
    stochastic rounding of bf16 states."""
    flags = rule.flag_values(hp)
    fused: dict[torch.dtype, list[int]] = {}
    for i, p in enumerate(params):
        if p.numel() == 0:
            continue
        bf16_states = torch.bfloat16 in [s.dtype for s in states[i]]
        if not bf16_states and _fusable(rule, safe, p, grads[i], states[i]):
            fused.setdefault(p.dtype, []).append(i)
            continue
        offset = 0 if offsets is None else offsets[i]
        eligible = cpu_native.eligible_dense(rule, p, grads[i], states[i], hp)
        if eligible and cpu_native.usable():  # takes_dense, without checking the tensors twice
            cpu_native.dense(rule, p, grads[i], states[i], steps[i], hp, safe, offset)
            continue
        scalars = graphs.scalar_row(rule.scalar_values(hp, steps[i], safe))
        if bf16_states:
            _dense_rounded(rule, flags, safe, hp["maximize"], p, grads[i], states[i], scalars, steps[i], offset,
                           _eager(eligible))  # fmt: skip
            continue
        if (_eager(eligible) or _single(p.numel())) and tracing.active() is None:
            update = graphs.dense_update(rule, flags, safe, hp["maximize"], len(states[i]))
            _dense_eager(update, p, grads[i].contiguous(), states[i], scalars)
            continue
        graph = _dense_graph(rule, flags, safe, hp["maximize"], len(states[i]))
        graph(p, grads[i], list(states[i]), scalars)
    for idx in fused.values():
        pick = lambda k: [states[i][k] for i in idx]  # noqa: E731
        amsgrad = hp["amsgrad"]
        # The kernel only reads each param's step count: one tensor per distinct count.
        counts = {n: torch.tensor(float(n)) for n in {steps[i] for i in idx}}
        torch._fused_adamw_(
            [params[i] for i in idx], [grads[i] for i in idx], pick(0), pick(1), pick(2) if amsgrad else [],
            [counts[steps[i]] for i in idx],
            lr=hp["lr"], beta1=hp["beta1"], beta2=hp["beta2"], weight_decay=hp["weight_decay"], eps=hp["eps"],
            amsgrad=amsgrad, maximize=hp["maximize"],
        )  # fmt: skip


# ---- block-quantized states -----------------------------------------------------------------
_QUANTIZED: dict[tuple, Callable[..., Any]] = {}


def _quantized_graph(rule: Rule, flags: tuple, maximize: bool, bits: int, kinds: tuple, zeros: tuple,
                     lasts: tuple) -> Callable[..., Any]:  # fmt: skip
    # One graph per (rule, flags, bits, state kinds, zero codes); the block size is a static
    # dimension of the 2-D inputs and only the number of blocks is dynamic, so loops vectorise.
    if tracing.active() is not None:  # a compiled graph cannot take fake tensors
        return graphs.traced_quantized(bits)
    key = (rule, flags, maximize, bits, kinds, zeros, lasts)
    graph = _QUANTIZED.get(key)
    if graph is None:
        variant = f"{rule.name}_quantized_{bits}bit{'_max' if maximize else ''}_{len(_QUANTIZED)}"
        update = graphs.quantized_update(rule, flags, maximize, bits, kinds, zeros, lasts)

        def fallback(p2: Tensor, g2: Tensor, *rest: Tensor) -> None:
            n = len(kinds) * graphs.PER_STATE
            _quantized_chunks(update, update, p2, g2, list(rest[:n]), rest[n], int(rest[n + 1]), rest[n + 2])

        graph = _QUANTIZED[key] = compiled(own_code(update, variant), dynamic=None, fallback=fallback,
                                           options=stored_state_options(len(kinds), lookups=True, decay_rounding=any(kinds)))  # fmt: skip
    return graph


def _quantized_eager(rule: Rule, flags: tuple, maximize: bool, bits: int, kinds: tuple, zeros: tuple, lasts: tuple,
                     p2: Tensor, g2: Tensor, tensors: list[Tensor], step: int, offset: int, c: Tensor) -> None:  # fmt: skip
    """:func:`leanopt.kernels.graphs.quantized_update` over chunks of whole blocks; the decay
    rounding only in chunks whose gradient holds an exact 0 (elsewhere it changes nothing)."""
    plain = graphs.quantized_update(rule, flags, maximize, bits, (False,) * len(kinds), zeros, lasts)
    rounding = graphs.quantized_update(rule, flags, maximize, bits, kinds, zeros, lasts) if any(kinds) else plain
    _quantized_chunks(plain, rounding, p2, g2, tensors, torch.tensor(step, dtype=torch.int64), offset, c)


def _quantized_chunks(plain: Callable[..., Any], rounding: Callable[..., Any], p2: Tensor, g2: Tensor,
                      tensors: list[Tensor], step: Tensor, offset: int, c: Tensor) -> None:  # fmt: skip
    """``plain`` (or ``rounding``, where a chunk's gradient holds an exact 0) over chunks of
    whole blocks of ``p2``/``g2`` ([blocks, block]), each with its global offset."""
    rows, block = p2.shape
    per_chunk = max(1, EAGER_CHUNK // block)

    def chunk(k: int) -> None:
        lo, hi = k * per_chunk, min((k + 1) * per_chunk, rows)
        views = _row_views(p2, g2, tensors, lo, hi)
        update = rounding if rounding is not plain and bool((views[1] == 0).any()) else plain
        update(*views, step, torch.tensor(offset + lo * block, dtype=torch.int64), c)

    _over_chunks(chunk, -(-rows // per_chunk))


def _row_views(p2: Tensor, g2: Tensor, tensors: Sequence[Tensor], lo: int, hi: int) -> list[Tensor]:
    """Rows ``lo:hi`` of the param, the gradient and each state's codes and scales, with each
    state's code values and lookup table: a quantized update's tensor arguments."""
    views = [p2[lo:hi], g2[lo:hi]]
    for j in range(0, len(tensors), graphs.PER_STATE):
        codes, absmax, values, table = tensors[j : j + graphs.PER_STATE]
        views += [codes[lo:hi], absmax[lo:hi], values, table]
    return views


def _any_zero(g: Tensor) -> Tensor:
    return (g == 0).any()


_ANY_ZERO = compiled(_any_zero)


def _has_zero(g: Tensor) -> bool:
    """Whether ``g`` holds an exact 0 (one compiled pass: ~0.1 ns/element); True for a tensor
    without data (a shape-only trace takes every branch)."""
    if g.device.type == "meta" or is_fake(g):
        return True
    return may_hold_true(_ANY_ZERO(g.detach().view(-1)))


def quantized(rule: Rule, params, grads, states, steps: Sequence[int], hp: Mapping[str, Any],
              offsets: Sequence[int] | None = None) -> None:  # fmt: skip
    """``rule`` in safe mode over CPU params whose states are all :class:`QuantizedState` of
    one bit width and block size (``kernels.select`` checked that); ``offsets[i]``: the flat
    index of param ``i``'s element 0 in its whole tensor (default 0)."""
    offsets = [0] * len(params) if offsets is None else offsets
    native = [i for i, p in enumerate(params) if p.numel() and cpu_native.takes(rule, p, grads[i], states[i], hp)]
    if native:
        pick = lambda seq: [seq[i] for i in native]  # noqa: E731
        cpu_native.quantized(rule, pick(params), pick(grads), pick(states), pick(steps), hp, pick(offsets))
    flags = rule.flag_values(hp)
    kinds = tuple(kind.decays for kind in rule.states(hp))
    done = set(native)
    for i, p in enumerate(params):
        if i in done:
            continue
        n = p.numel()
        if n == 0:
            continue
        qs = states[i]
        fmt = qs[0].format
        books = [q.format.book(p.device) for q in qs]
        tables = [graphs.encode_tables(b, p.device) for b in books]
        bs = fmt.block_size
        full = (n // bs) * bs
        if full:
            rows, row_bytes = full // bs, fmt.code_bytes(bs)
            tensors: list[Tensor] = []
            for q, book, table in zip(qs, books, tables):
                if table is None:  # quantized_takes refuses such states before they get here
                    raise ValueError(f"compiled CPU kernel: the {q.format} code book has no lookup table (quantized_takes)")
                tensors += [q.codes[: rows * row_bytes].view(rows, row_bytes), q.absmax[:rows], book.values, table]
            p2 = p.view(-1)[:full].view(rows, bs)
            g2 = grads[i].reshape(-1)[:full].view(rows, bs)
            zeros_ = tuple(b.zero_index for b in books)
            lasts = tuple(b.thresholds.numel() for b in books)
            scalars = graphs.scalar_row(rule.scalar_values(hp, steps[i], True))
            if (_eager(cpu_native.eligible(rule, p, grads[i], qs, hp)) or _single(rows)) and tracing.active() is None:
                _quantized_eager(rule, flags, hp["maximize"], fmt.bits, kinds, zeros_, lasts, p2, g2, tensors, steps[i],
                                 offsets[i], scalars)  # fmt: skip
                if full < n:
                    reference.partial_block(rule, p.view(-1), grads[i].reshape(-1), qs, steps[i], hp, offsets[i], full)
                continue
            # The decay rounding changes only elements whose gradient is exactly 0: without any,
            # the graph without it stores the same codes (and skips the dither: ~30% of the step).
            decays = kinds if not any(kinds) or _has_zero(g2) else (False,) * len(kinds)
            graph = _quantized_graph(rule, flags, hp["maximize"], fmt.bits, decays, zeros_, lasts)
            step_t = torch.tensor(steps[i], dtype=torch.int64)
            for lo, hi in graphs.row_spans(rows, max(1, graphs.QUANTIZED_CHUNK // bs)):
                views = _row_views(p2, g2, tensors, lo, hi)
                # The views the graph takes, not their bases: a base's size would be traced as a
                # constant and the first graph compiled for one shape only (then a second, dynamic one).
                for t in (*views[:2], *views[2 :: graphs.PER_STATE], *views[3 :: graphs.PER_STATE]):
                    torch._dynamo.maybe_mark_dynamic(t, 0)
                graph(*views, step_t, torch.tensor(offsets[i] + lo * bs, dtype=torch.int64), scalars)
        if full < n:
            reference.partial_block(rule, p.view(-1), grads[i].reshape(-1), qs, steps[i], hp, offsets[i], full)
