"""The update of an elementwise rule as a function of tensors, compiled by Inductor, on any device.

Each factory here writes one variant of a rule's update (:mod:`leanopt.kernels.rules`) as a
function of tensors that updates its arguments in place: dense states in the compute dtype
(:func:`dense_update`), states of which some are bf16 and written back with stochastic rounding
(:func:`rounded_update`), and block-quantized states, dequantized, updated and requantized in
one fused loop over whole blocks (:func:`quantized_update`). No host syncs, no device of their
own: the CPU paths (:mod:`leanopt.kernels.cpu_elementwise`) compile them per param and run them
eagerly in chunks, and :func:`dense` / :func:`quantized` compile them over lists of params for
any device -- what a rule without a Triton twin runs on a GPU (``kernels.select``'s
``compiled-dense`` and ``compiled-quantized``), and what ``backend="compiled"`` runs anywhere.

**Several params per call.** :func:`dense` and :func:`quantized` group a param group's params
by what their graph depends on (dtypes, state storage, code books) and run each group in lists
of :data:`MAX_LIST` params and then powers of two (16, 16, 4, 1 for 37 params): one compiled
graph per list length, so a model's step is a few calls, whatever its number of params, and a
group compiles at most five graphs. Each param's sizes are symbolic (one graph serves any
shapes; a one-element param or one-block param is grouped apart, as Dynamo specializes sizes 1);
a quantized block stays a static dimension so its loops vectorize. Every step-dependent number
reaches the graph as a row of one small fp64 table on the param's device, copied from pinned
host memory without a sync; a new step or lr never recompiles.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from leanopt import tracing
from leanopt.kernels.cpu import compiled, flat_alias, own_code, stored_state_options
from leanopt.kernels.multi_tensor import _to_device
from leanopt.kernels.rules import Rule, skipped_elements
from leanopt.quant import codebooks
from leanopt.quant.bf16 import stochastic_bf16
from leanopt.quant.formats import decay_rounded, dither


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def scalar_row(values: Sequence[float]) -> Tensor:
    """The schedule's numbers as one 1-D fp64 CPU tensor: a compiled graph's input, not its
    constants. One tensor, split inside the graph (:func:`_split`): dynamo takes a 0-dim fp64
    input for a Python float, traces it as a symbolic float, then restarts the whole trace to
    make it a tensor again -- a second trace of every graph (6.7-7.1 s of a 30 s cold first
    AdamW8bit step, its dense and quantized graphs, 2 cores, measured 2026-12-04); a 1-D tensor
    is traced once."""
    return torch.tensor(values, dtype=torch.float64)


def _split(c: Tensor) -> tuple[Tensor, ...]:
    """A scalar row (:func:`scalar_row`) as the rule's 0-dim scalars, in :attr:`Rule.scalars` order."""
    return c.unbind(0)


def safe_result(g: Tensor, p: Tensor, new_p: Tensor, new: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
    # reference.rule_step_'s skip: param kept, states zeroed where the element is skipped.
    bad = skipped_elements(g, new)
    return torch.where(bad, p, new_p), [torch.where(bad, 0.0, s) for s in new]


# ---- inside a memory trace (leanopt.tracing) ------------------------------------------------
# Bytes per param element the compiled quantized update allocates while it runs, by code bits.
# Measured here (torch 2.13 Inductor, 2 cores; VmHWM over one step of one param,
# MALLOC_MMAP_THRESHOLD_=65536) for the graph of quantized_update: 8-bit 7.96 and 8.02, 4-bit
# 12.03 and 12.05 B/element for 4.2M- and 22.3M-element params, fp32 or bf16 params (the previous
# AdamW-only kernel: 8.97 and 13.03). Re-measure when that graph changes. The dense graph
# allocates nothing of the param's size (measured: 0.00 B per element, fp32 and bf16 params).
# Every path calls it on at most QUANTIZED_CHUNK elements at a time. The same graph compiled for
# a GPU is planned with these figures: not measured there.
QUANTIZED_TEMP_BYTES = {8: 8, 4: 12}


def traced_dense(*args: Any) -> None:
    """The dense graph on fake tensors: fused and in place, it allocates nothing."""


def traced_quantized(bits: int) -> Callable[..., None]:
    def temporaries(p: Tensor, *args: Any) -> None:
        # p as [blocks, block]: what the fused dequantize -> update -> requantize loop holds.
        temp = torch.empty(p.numel() * QUANTIZED_TEMP_BYTES[bits], dtype=torch.uint8)
        del temp

    return temporaries


# ---- the update functions ---------------------------------------------------------------------
_DENSE_UPDATES: dict[tuple, Callable[..., Any]] = {}
_ROUNDED_UPDATES: dict[tuple, Callable[..., Any]] = {}
_QUANTIZED_UPDATES: dict[tuple, Callable[..., Any]] = {}


def dense_update(rule: Rule, flags: tuple, safe: bool, maximize: bool, n: int) -> Callable[..., Any]:
    """``update(p, g, states, c)``: the dense update, states in the compute dtype (``c``: the
    scalar row, :func:`scalar_row`)."""
    key = (rule, flags, safe, maximize, n)
    update = _DENSE_UPDATES.get(key)
    if update is None:

        def update(p: Tensor, g: Tensor, states: list[Tensor], c: Tensor) -> None:
            pf = p.to(compute_dtype(p.dtype))
            gf = g.to(pf.dtype)
            if maximize:
                gf = -gf
            new_p, new = rule.apply(pf, gf, states, _split(c), flags, safe)
            if safe:
                new_p, new = safe_result(gf, pf, new_p, new)
            p.copy_(new_p)
            for s, v in zip(states, new):
                s.copy_(v)

        _DENSE_UPDATES[key] = update
    return update


def rounded_update(rule: Rule, flags: tuple, safe: bool, maximize: bool, stored: tuple) -> Callable[..., Any]:
    """``update(p, g, states, c, step, offset)``: the dense update of a param whose states ``j``
    with ``stored[j]`` are bf16 (:mod:`leanopt.quant.bf16`), as a function of flat tensors;
    ``step`` and ``offset`` (0-dim int64: the flat index of ``p``'s element 0) key the dither."""
    key = (rule, flags, safe, maximize, stored)
    update = _ROUNDED_UPDATES.get(key)
    if update is None:
        n = len(stored)

        def update(p: Tensor, g: Tensor, states: list[Tensor], c: Tensor, step: Tensor, offset: Tensor) -> None:
            pf = p.to(compute_dtype(p.dtype))
            gf = g.to(pf.dtype)
            if maximize:
                gf = -gf
            read = [s.to(pf.dtype) if bf16 else s for s, bf16 in zip(states, stored)]
            new_p, new = rule.apply(pf, gf, read, _split(c), flags, safe)
            if safe:
                new_p, new = safe_result(gf, pf, new_p, new)
            p.copy_(new_p)
            index = torch.arange(p.numel(), dtype=torch.int64, device=p.device) + offset
            for j, (s, v, bf16) in enumerate(zip(states, new, stored)):
                if bf16:
                    s.copy_(stochastic_bf16(v.float(), dither(index * n + j, step)))
                else:
                    s.copy_(v)

        _ROUNDED_UPDATES[key] = update
    return update


_ENCODE_TABLES: dict[tuple[str, torch.device], Tensor | None] = {}


def encode_tables(book, device: torch.device) -> Tensor | None:
    """A lookup table that replaces the code book's binary search, or ``None`` if it can't.

    The top 16 bits of an fp32 (sign, exponent, 7 mantissa bits) name a bucket of values
    spanning 2^-7 relative; ``below[bucket]`` is the number of midpoints below the bucket. When
    no bucket holds more than one midpoint (true for every code whose neighbouring values
    differ by more than 0.8%), the nearest code of ``y`` is
    ``below[bucket] + (midpoints[below[bucket]] < y)``: ``torch.searchsorted``'s answer. The
    table is int64, ``below | bits(midpoints[below]) << 32`` (``+inf`` past the last), so that
    this takes one gather instead of eight dependent ones (two, while ``below`` and
    the midpoints were separate tables: 15% of the compiled 8-bit step).
    """
    key = (book.name, device)
    tables = tracing.cache(_ENCODE_TABLES)
    if key not in tables:
        thresholds = book.thresholds.to(device="cpu", dtype=torch.float32)
        below, _, usable = codebooks.midpoints_below_buckets(thresholds)
        padded = torch.cat([thresholds, torch.tensor([float("inf")])])
        packed = (padded[below].view(torch.int32).to(torch.int64) << 32) | below
        tables[key] = packed.to(device) if usable else None
    return tables[key]


def quantized_takes(states: Sequence[Any], device: torch.device) -> bool:
    """Whether :func:`quantized_update` runs these states (each code book has a lookup table)."""
    return all(encode_tables(q.format.book(device), device) is not None for q in states)


def _nearest_code(y: Tensor, table: Tensor) -> Tensor:
    entry = table[(y.view(torch.int32) >> 16) & 0xFFFF]
    midpoint = (entry >> 32).to(torch.int32).view(torch.float32)
    return (entry & 0xFFFF) + (midpoint < y).long()


def _unpack(codes: Tensor, rows: int, block: int, bits: int) -> Tensor:
    if bits == 8:
        return codes.long()
    return torch.stack([codes & 15, codes >> 4], -1).view(rows, block).long()


def _pack(index: Tensor, rows: int, block: int, bits: int) -> Tensor:
    if bits == 8:
        return index.to(torch.uint8)
    pairs = index.to(torch.uint8).view(rows, block // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


# Per quantized state, the tensors a quantized update takes: codes [blocks, block bytes], scales
# [blocks], code values, lookup table. Then the dither's key (0-dim int64: the step and the flat
# index of element 0 in the whole tensor), then the rule's scalar row.
PER_STATE = 4


def quantized_update(rule: Rule, flags: tuple, maximize: bool, bits: int, kinds: tuple, zeros: tuple,
                     lasts: tuple) -> Callable[..., Any]:  # fmt: skip
    """``update(p, g, *per_state, step, offset, c)``: the block-quantized update (``p``/``g`` as
    [blocks, block]) in safe mode, with the decay rounding for the states ``kinds`` marks."""
    key = (rule, flags, maximize, bits, kinds, zeros, lasts)
    update = _QUANTIZED_UPDATES.get(key)
    if update is None:
        n = len(kinds)

        def update(p: Tensor, g: Tensor, *rest: Tensor) -> None:
            rows, block = p.shape
            per_state = [rest[k * PER_STATE : (k + 1) * PER_STATE] for k in range(n)]
            step, offset = rest[n * PER_STATE], rest[n * PER_STATE + 1]
            c = _split(rest[n * PER_STATE + 2])
            pf = p.float()
            gf = -g.float() if maximize else g.float()
            dense = [values[_unpack(codes, rows, block, bits)] * absmax.unsqueeze(1) for codes, absmax, values, _ in per_state]
            new_p, new = rule.apply(pf, gf, dense, c, flags, True)
            new_p, new = safe_result(gf, pf, new_p, new)
            p.copy_(new_p)
            for (codes, absmax, values, table), decays, zero, last, old, x in zip(
                per_state, kinds, zeros, lasts, dense, new
            ):
                scale = x.abs().amax(1)
                safe_scale = torch.where(scale > 0, scale, 1.0).unsqueeze(1)
                y = x / safe_scale
                index = _nearest_code(y, table)
                if decays:
                    # Where the gradient is 0: the reference's decay rounding, same dither bits.
                    flat = torch.arange(rows * block, dtype=torch.int64, device=p.device).view(rows, block) + offset
                    u = dither(flat, step)
                    index = decay_rounded(index, y, values, zero, last, gf == 0, old.abs() / safe_scale, u)
                codes.copy_(_pack(index, rows, block, bits))
                absmax.copy_(scale)

        _QUANTIZED_UPDATES[key] = update
    return update


# ---- several params per call, any device ---------------------------------------------------------
MAX_LIST = 16

# Elements per call of a quantized update: its temporaries (QUANTIZED_TEMP_BYTES, 8-12 B per
# element) are bounded by this many elements (8-12 MiB) rather than growing with the largest
# param (an embedding of 11.7M elements: 89 MiB at 8 bits, measured on a MiniLM-shaped model),
# for one more call (~30 us of Python on the CPU) per 1M elements.
QUANTIZED_CHUNK = 1 << 20


def row_spans(rows: int, per_call: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` spans of at most ``per_call`` rows covering ``rows``, none of one row unless
    ``rows`` is one (a one-row input would make dynamo specialize, and compile a second graph)."""
    spans = [(lo, min(lo + per_call, rows)) for lo in range(0, rows, per_call)]
    if len(spans) > 1 and spans[-1][1] - spans[-1][0] == 1:
        spans[-2:] = [(spans[-2][0], rows)]
    return spans

# One compiled graph per (variant, list length): its own code object (kernels.cpu.own_code), so
# no variant counts against another's recompile limit.
_LISTS: dict[tuple, Callable[..., Any]] = {}


def lists(idx: Sequence[int]) -> list[list[int]]:
    """``idx`` cut into lists of :data:`MAX_LIST`, then the rest into lists of powers of two:
    few distinct lengths, each a graph of its own."""
    out, k, size = [], 0, MAX_LIST
    while k < len(idx):
        while size > len(idx) - k:
            size //= 2
        out.append(list(idx[k : k + size]))
        k += size
    return out


def _list_graph(key: tuple, name: str, update: Callable[..., Any], form: str, length: int,
                options: dict[str, Any] | None = None) -> Callable[..., Any]:  # fmt: skip
    """``graph(ps, gs, tensors, scalars, keys)``: ``update`` on each of ``length`` params, with
    param ``i``'s scalar row (:func:`scalar_row`, a row of ``scalars``) and its dither key row (0-dim tensors), in the
    argument order of its ``form``: ``"dense"`` :func:`dense_update`, ``"rounded"``
    :func:`rounded_update`, ``"quantized"`` :func:`quantized_update`; compiled with Inductor
    ``options`` (:func:`leanopt.kernels.cpu.stored_state_options`)."""
    graph = _LISTS.get(key)
    if graph is None:

        def run(ps: list[Tensor], gs: list[Tensor], tensors: list[list[Tensor]], scalars: Tensor, keys: Tensor) -> None:
            for i in range(length):
                c = scalars[i]
                if form == "dense":
                    update(ps[i], gs[i], tensors[i], c)
                elif form == "rounded":
                    update(ps[i], gs[i], tensors[i], c, keys[i, 0], keys[i, 1])
                else:
                    update(ps[i], gs[i], *tensors[i], keys[i, 0], keys[i, 1], c)

        graph = _LISTS[key] = compiled(own_code(run, f"{name}_x{length}"), dynamic=None, options=options)
    return graph


def _table(rows: Sequence[Sequence[float | int]], dtype: torch.dtype, device: torch.device) -> Tensor:
    return _to_device(torch.tensor(rows, dtype=dtype), device)


def dense(rule: Rule, params, grads, states, steps: Sequence[int], hp: Mapping[str, Any], *, safe: bool,
          offsets: Sequence[int] | None = None) -> None:  # fmt: skip
    """``rule`` over params of one device with dense states (compute dtype or bf16), several
    params per compiled call; the arguments as :func:`leanopt.kernels.step` takes them."""
    if tracing.active() is not None:
        return traced_dense()
    offsets = [0] * len(params) if offsets is None else offsets
    flags, maximize = rule.flag_values(hp), bool(hp["maximize"])
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        if p.numel():
            key = (p.dtype, grads[i].dtype, tuple(s.dtype for s in states[i]), p.numel() == 1)
            groups.setdefault(key, []).append(i)
    for (pd, gd, sd, one), idx in groups.items():
        stored = tuple(d == torch.bfloat16 for d in sd)
        rounding = any(stored)
        if rounding:
            update = rounded_update(rule, flags, safe, maximize, stored)
        else:
            update = dense_update(rule, flags, safe, maximize, len(sd))
        variant = (f"{rule.name}_list{'_bf16' if rounding else ''}{'_safe' if safe else ''}{'_max' if maximize else ''}_"
                   + "_".join(str(d).removeprefix("torch.") for d in (pd, gd, *sd)) + ("_one" if one else ""))  # fmt: skip
        options = stored_state_options(sum(stored), lookups=False)
        for part in lists(idx):
            device = params[part[0]].device
            flat = [flat_alias(params[i]) for i in part]
            gs = [flat_alias(grads[i].contiguous()) for i in part]  # a strided gradient: read from a copy, as reshape made
            tensors = [[flat_alias(s) for s in states[i]] for i in part]
            for t in (*flat, *gs, *(s for row in tensors for s in row)):
                torch._dynamo.maybe_mark_dynamic(t, 0)
            scalars = _table([rule.scalar_values(hp, steps[i], safe) for i in part], torch.float64, device)
            keys = _table([(steps[i], offsets[i]) for i in part], torch.int64, device)
            graph_key = (rule, flags, safe, maximize, stored, pd, gd, sd, one, len(part))
            graph = _list_graph(graph_key, variant, update, "rounded" if rounding else "dense", len(part), options)
            graph(flat, gs, tensors, scalars, keys)


def quantized(rule: Rule, params, grads, states, steps: Sequence[int], hp: Mapping[str, Any],
              offsets: Sequence[int] | None = None) -> None:  # fmt: skip
    """``rule`` in safe mode over params of one device whose states are all
    :class:`~leanopt.quant.QuantizedState` of one bit width and block size with lookup tables
    (``kernels.select`` checked that): their whole blocks in spans of at most
    :data:`QUANTIZED_CHUNK` elements, several spans per compiled call; the last partial block of
    each param by the reference. The decay rounding always runs where a state
    decays (it changes nothing where no gradient is 0; asking would sync the device)."""
    from leanopt.kernels import reference

    offsets = [0] * len(params) if offsets is None else offsets
    flags, maximize = rule.flag_values(hp), bool(hp["maximize"])
    kinds = tuple(kind.decays for kind in rule.states(hp))
    # Each param's whole blocks as row spans of at most QUANTIZED_CHUNK elements: the items of
    # the lists, so that a graph's temporaries follow a span, not the largest param.
    groups: dict[tuple, list[tuple[int, int, int]]] = {}
    for i, p in enumerate(params):
        fmt = states[i][0].format
        rows = p.numel() // fmt.block_size
        formats = tuple(q.format for q in states[i])
        for lo, hi in row_spans(rows, max(1, QUANTIZED_CHUNK // fmt.block_size)):
            groups.setdefault((p.dtype, grads[i].dtype, formats, hi - lo == 1), []).append((i, lo, hi))
    for (pd, gd, formats, one), spans in groups.items():
        device = params[spans[0][0]].device
        bits, bs = formats[0].bits, formats[0].block_size
        books = [f.book(device) for f in formats]
        tables = [encode_tables(b, device) for b in books]
        zeros, lasts = tuple(b.zero_index for b in books), tuple(b.thresholds.numel() for b in books)
        row_bytes = formats[0].code_bytes(bs)
        if tracing.active() is not None:
            for i, lo, hi in spans:
                traced_quantized(bits)(params[i].view(-1)[lo * bs : hi * bs])
            continue
        update = quantized_update(rule, flags, maximize, bits, kinds, zeros, lasts)
        variant = (f"{rule.name}_list_quantized_{bits}bit_{len(kinds)}{'_max' if maximize else ''}_"
                   + "_".join(str(d).removeprefix("torch.") for d in (pd, gd)) + ("_one" if one else ""))  # fmt: skip
        options = stored_state_options(len(kinds), lookups=True, decay_rounding=any(kinds))
        for part in lists(range(len(spans))):
            ps, gs, tensors = [], [], []
            for i, lo, hi in (spans[k] for k in part):
                p2 = params[i].detach().view(-1)[lo * bs : hi * bs].view(hi - lo, bs)
                g2 = grads[i].detach().reshape(-1)[lo * bs : hi * bs].view(hi - lo, bs)
                per: list[Tensor] = []
                for q, book, table in zip(states[i], books, tables):
                    assert table is not None, "quantized_takes refuses code books without a lookup table"
                    per += [q.codes[lo * row_bytes : hi * row_bytes].view(hi - lo, row_bytes), q.absmax[lo:hi], book.values, table]
                for t in (p2, g2, *per[0::PER_STATE], *per[1::PER_STATE]):
                    torch._dynamo.maybe_mark_dynamic(t, 0)
                ps.append(p2)
                gs.append(g2)
                tensors.append(per)
            rows_of = [spans[k] for k in part]
            scalars = _table([rule.scalar_values(hp, steps[i], True) for i, _, _ in rows_of], torch.float64, device)
            keys = _table([(steps[i], offsets[i] + lo * bs) for i, lo, _ in rows_of], torch.int64, device)
            key = ("quantized", rule, flags, maximize, bits, kinds, zeros, lasts, pd, gd, bs, one, len(part))
            _list_graph(key, variant, update, "quantized", len(part), options)(ps, gs, tensors, scalars, keys)
    for i, p in enumerate(params):
        n, bs = p.numel(), states[i][0].format.block_size
        full = n // bs * bs
        if full < n:
            reference.partial_block(rule, p.view(-1), grads[i].reshape(-1), states[i], steps[i], hp, offsets[i], full)
