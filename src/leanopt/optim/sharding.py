"""How leanopt's optimizers keep the state of a DTensor (FSDP2) param: placement, allocation, checkpoints.

``torch.distributed.fsdp.fully_shard`` turns each param into a ``DTensor`` sharded on dim 0.
``LeanOptimizer`` calls into this module for such params (and only for them):

* The layout comes from the *global* shape (``p.shape`` of a DTensor is global): the same state
  keys, shapes, dtypes and quantize-or-not decisions as in one process, on any number of ranks.
* :func:`allocate_state`: an entry of the param's shape gets the param's placements
  (``zeros_like`` semantics); an entry that is the param reduced over one dim
  (``StateSpec.reduced_dim``: Adafactor's row and column statistics) keeps the param's sharding
  on the other dims and is replicated over the reduced one; a scalar (``step``) stays a plain
  CPU tensor, the same on every rank; a quantized entry is a ``QuantizedState`` of this rank's
  shard on the whole tensor's block grid (:func:`quantized_shard`): a block that straddles two
  shards gets one scale, all-reduced, so codes and scales are exactly the one-process ones.
* Elementwise rules (AdamW, 8/4-bit AdamW) run on the local shards (:func:`local`): the fast
  kernels never see a DTensor, and each element's arithmetic is the one-process arithmetic.
* Adafactor runs its reference maths on the DTensors: DTensor's dispatch all-reduces the column
  statistics (a mean over the sharded rows) and the two RMS norms, so the factored statistics
  are over the global rows and columns. A param with fewer rows than ranks, on which DTensor
  cannot run those ops, is updated whole (:func:`update_whole`).
* ``state_dict`` holds DTensors (quantized shards dequantized: :func:`checkpoint_value`), so
  ``torch.distributed.checkpoint`` saves, loads and reshards the state like a model's weights;
  :func:`load_value` quantizes again and also accepts a one-process checkpoint.

Nothing here imports torch.distributed at module level: plain params never reach it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeGuard

import torch

from leanopt.optim.layout import StateSpec, convert_saved
from leanopt.quant import QuantizedState
from leanopt.quant.formats import may_hold_true

if TYPE_CHECKING:  # the annotations only: nothing here imports torch.distributed when unused
    from torch.distributed.tensor import DTensor

__all__ = [
    "ShardQuantizedState",
    "allocate_state",
    "checkpoint_value",
    "is_dtensor",
    "load_value",
    "local",
    "quantized_shard",
    "shardable",
    "shard_offset",
    "shared_blocks",
    "state_placements",
    "update_whole",
]


def is_dtensor(t: Any) -> TypeGuard[DTensor]:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (without importing it when unused)."""
    return type(t).__name__ == "DTensor" and hasattr(t, "to_local") and hasattr(t, "placements")


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a view sharing its memory); any other tensor as it is."""
    return t.to_local() if is_dtensor(t) else t


def _reduced_dim(spec: StateSpec, shape: tuple[int, ...]) -> int | None:
    """The dim of ``shape`` that ``spec`` reduces away, if ``spec.shape`` is ``shape`` minus one dim."""
    declared = getattr(spec, "reduced_dim", None)
    if declared is not None:
        return declared % len(shape)
    candidates = [k for k in range(len(shape)) if shape[:k] + shape[k + 1 :] == tuple(spec.shape)]
    if not candidates:
        return None
    return candidates[0] if len(candidates) == 1 else -1


def state_placements(spec: StateSpec, p: DTensor) -> tuple[Any, ...] | None:
    """Placements of the DTensor state ``spec`` of DTensor param ``p``; ``None``: a plain tensor.

    Raises ``ValueError`` for a state whose relation to the param's shape is unknown or
    ambiguous (a square matrix's row and column statistics both have shape ``[n]``: the layout
    must say which dim it reduces, ``StateSpec.reduced_dim``).
    """
    from torch.distributed.tensor import Replicate, Shard

    shape = tuple(p.shape)
    if spec.host or spec.shape == ():
        return None
    if tuple(spec.shape) == shape:
        return tuple(p.placements)
    k = _reduced_dim(spec, shape)
    if k is None or k < 0:
        why = "ambiguous (several dims could have been reduced)" if k == -1 else "not the param's shape nor one dim less"
        raise ValueError(
            f"state {spec.key!r} of shape {tuple(spec.shape)} for a DTensor param of shape {shape}: {why}; "
            "set StateSpec.reduced_dim in the optimizer's state_layout"
        )
    out: list[Any] = []
    for pl in p.placements:
        if isinstance(pl, Shard):
            d = pl.dim % len(shape)
            out.append(Replicate() if d == k else Shard(d - 1 if d > k else d))
        elif isinstance(pl, Replicate):
            out.append(pl)
        else:
            raise ValueError(f"a param placed as {pl} has no optimizer state placement")
    return tuple(out)


def _dim0_sharding(p: DTensor) -> tuple[int, int] | None:
    """``(mesh_dim, ranks)`` when ``p`` is sharded on dim 0 over one mesh dim and replicated over
    any others (FSDP2, HSDP): then each shard is one contiguous range of the flat order."""
    from torch.distributed.tensor import Replicate, Shard

    found = None
    for mesh_dim, pl in enumerate(p.placements):
        if isinstance(pl, Shard) and pl.dim % max(p.ndim, 1) == 0 and found is None:
            found = (mesh_dim, p.device_mesh.size(mesh_dim))
        elif not isinstance(pl, Replicate):
            return None
    return found


def _shard_ranges(rows: int, row_numel: int, ranks: int) -> list[tuple[int, int]]:
    # DTensor's Shard(0) (and FSDP2) splits rows as torch.chunk does: ceil(rows / ranks) each.
    chunk = -(-rows // ranks) if rows else 0
    return [(min(r * chunk, rows) * row_numel, min((r + 1) * chunk, rows) * row_numel) for r in range(ranks)]


def shard_offset(p: Any) -> int:
    """Flat index, in the whole tensor, of this rank's first element of DTensor ``p`` when it is
    sharded on dim 0 (FSDP2, HSDP); 0 for any other tensor or sharding."""
    if not is_dtensor(p):
        return 0
    sharding = _dim0_sharding(p)
    if sharding is None:
        return 0
    rows = p.shape[0] if p.ndim else 1
    ranges = _shard_ranges(rows, p.numel() // rows if rows else 0, sharding[1])
    return ranges[p.device_mesh.get_local_rank(sharding[0])][0]


def shared_blocks(p: DTensor, block_size: int) -> list[int] | None:
    """The blocks (of the whole tensor's flat order) that straddle a shard boundary of ``p``.

    Empty when every shard starts on a block boundary (``ceil(rows / ranks) * row_numel`` a
    multiple of ``block_size``, e.g. any matrix with rows a multiple of 256 long). ``None`` for
    a sharding other than dim 0 (shards are then not ranges of the flat order).
    """
    sharding = _dim0_sharding(p)
    if sharding is None:
        return None
    rows = p.shape[0] if p.ndim else 1
    row_numel = p.numel() // rows if rows else 0
    starts = [start for start, _ in _shard_ranges(rows, row_numel, sharding[1])[1:]]
    return sorted({b // block_size for b in starts if 0 < b < p.numel() and b % block_size})


class ShardQuantizedState(QuantizedState):
    """A :class:`~leanopt.quant.QuantizedState` of one shard whose blocks are the *whole*
    tensor's blocks: its first block starts ``lead`` elements before the shard does.

    A block that straddles shards gets the same scale on every rank (an all-reduce of the block
    maxima), so codes, scales and dequantized values are exactly the one-process ones. Used
    only when some block straddles a shard boundary (:func:`shared_blocks`); ``quantize_`` is
    then a collective over the param's mesh dim: every rank calls it, for the same states in
    the same order, as an optimizer step and ``load_state_dict`` do.
    """

    __slots__ = ("lead", "shared", "n_shared", "group")

    def __init__(self, codes, absmax, format, shape, lead: int, shared: list[tuple[int, int]], n_shared: int, group) -> None:
        super().__init__(codes, absmax, format, shape)
        self.lead = lead  # elements of the first block that lie before this shard
        self.shared = shared  # (local block, index among the shared blocks)
        self.n_shared = n_shared
        self.group = group

    def _padded(self, flat: torch.Tensor) -> torch.Tensor:
        bs, nb = self.format.block_size, self.absmax.numel()
        if nb == 0:  # an empty shard (fewer rows than ranks): it still joins the all-reduce
            return flat.new_zeros(0, bs)
        return torch.nn.functional.pad(flat, (self.lead, nb * bs - self.lead - flat.numel())).view(nb, bs)

    def dequantize(self) -> torch.Tensor:
        idx = self.format._unpack(self.codes, self.numel)
        vals = self._padded(self.format.book(self.codes.device).values[idx.long()])
        return vals.mul_(self.absmax.view(-1, 1)).view(-1)[self.lead : self.lead + self.numel].view(self.shape)

    def quantize_(self, x: torch.Tensor, decay: Any = None) -> None:
        import torch.distributed as dist

        # The same operations as BlockFormat.encode_, on the whole tensor's block grid.
        blocks = self._padded(x.reshape(-1).float())
        scale = blocks.abs().amax(dim=1) if blocks.numel() else blocks.new_zeros(0)
        maxima = torch.zeros(self.n_shared, dtype=torch.float32, device=scale.device)
        for j, k in self.shared:
            maxima[k] = scale[j]
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=self.group)  # maxima are >= 0
        for j, k in self.shared:
            scale[j] = maxima[k]
        safe_scale = torch.where(scale > 0, scale, torch.ones_like(scale)).view(-1, 1)
        y = blocks / safe_scale
        decay_y = None
        if decay is not None and may_hold_true(decay.mask):
            decay_y = decay.scaled(safe_scale, self.format.block_size, self.lead)
        idx = self.format.code_indices(y.view(-1)[self.lead : self.lead + self.numel], decay_y)
        self.codes.copy_(self.format._pack(idx.to(torch.uint8)))
        self.absmax.copy_(scale)

    def _like(self, codes: torch.Tensor, absmax: torch.Tensor) -> ShardQuantizedState:
        return ShardQuantizedState(codes, absmax, self.format, self.shape, self.lead, self.shared, self.n_shared, self.group)

    def clone(self) -> ShardQuantizedState:
        return self._like(self.codes.clone(), self.absmax.clone())

    def __deepcopy__(self, memo: dict) -> ShardQuantizedState:
        return self.clone()


def quantized_shard(spec: StateSpec, p: DTensor) -> QuantizedState:
    """Zero quantized state ``spec`` for this rank's shard of DTensor ``p``, blocked like the whole tensor."""
    fmt = spec.quant
    if fmt is None:
        raise ValueError(f"quantized_shard: state {spec.key!r} is not a quantized state (its StateSpec has no quant)")
    mine = local(p)
    block: int = getattr(fmt, "block_size", 0)  # 0: a format without blocks, nothing straddles
    shared = shared_blocks(p, block) if block else []
    if not shared:
        if shared is None:
            warnings.warn(
                f"{spec.key!r} of a DTensor param placed {tuple(p.placements)}: only dim-0 sharding keeps "
                "the one-process quantization blocks; each shard is blocked on its own here, so results "
                "differ from one process at the level of quantization error.",
                stacklevel=4,
            )
        return fmt.zeros(tuple(mine.shape), mine.device)
    sharding = _dim0_sharding(p)
    if sharding is None:  # shared_blocks found straddling blocks only under a dim-0 sharding
        raise RuntimeError(f"quantized_shard: {spec.key!r}: blocks straddle shards but the param is not sharded on dim 0")
    mesh_dim, ranks = sharding
    rows = p.shape[0] if p.ndim else 1
    start, end = _shard_ranges(rows, p.numel() // rows, ranks)[p.device_mesh.get_local_rank(mesh_dim)]
    lead = start % block
    nb = -(-(lead + end - start) // block) if end > start else 0
    first = start // block
    index = {b: k for k, b in enumerate(shared)}
    mine_shared = [(j, index[first + j]) for j in range(nb) if first + j in index]
    plain = fmt.zeros((end - start,), mine.device)
    absmax = torch.zeros(nb, dtype=torch.float32, device=mine.device)
    group = p.device_mesh.get_group(mesh_dim)
    return ShardQuantizedState(plain.codes, absmax, fmt, tuple(mine.shape), lead, mine_shared, len(shared), group)


def allocate_state(spec: StateSpec, p: torch.Tensor) -> Any:
    """Zero state for ``spec`` of param ``p``: ``spec.allocate`` for a plain param; for a DTensor
    a DTensor placed by :func:`state_placements`, or, for a quantized entry, the quantized state
    of this rank's shard on the whole tensor's block grid (:func:`quantized_shard`).

    ``LeanOptimizer._init_state`` calls it for every layout entry of a DTensor param.
    """
    if not is_dtensor(p):
        return spec.allocate(p.device)
    if spec.quant is not None:
        return quantized_shard(spec, p)
    placements = state_placements(spec, p)
    if placements is None:
        return spec.allocate(p.device)
    from torch.distributed.tensor import zeros

    return zeros(tuple(spec.shape), dtype=spec.dtype, device_mesh=p.device_mesh, placements=list(placements))


def _from_local(t: torch.Tensor, like: DTensor, placements: Any = None) -> DTensor:
    from torch.distributed.tensor import DTensor

    shape = like.shape
    stride = torch.empty(shape, device="meta").stride()
    placements = like.placements if placements is None else placements
    return DTensor.from_local(t, like.device_mesh, placements, run_check=False, shape=shape, stride=stride)


def checkpoint_value(value: Any, p: DTensor) -> Any:
    """The ``state_dict`` form of one state entry of DTensor param ``p``.

    A quantized shard becomes a fp32 DTensor placed like ``p`` (dequantized): a checkpoint
    of sharded quantized states must be reshardable, and codes and block scales cut at shard
    boundaries are not a DTensor that ``torch.distributed.checkpoint`` can reshard. Loading
    quantizes it again (:func:`load_value`); dequantize -> quantize gives back the same codes and
    scales, so the round trip is exact. Other entries are returned as they are.
    """
    if isinstance(value, QuantizedState):
        return _from_local(value.dequantize(), p)
    return value


def load_value(spec: StateSpec, value: Any, p: DTensor, where: str) -> Any:
    """A saved value of state ``spec`` of DTensor param ``p`` -> the form :func:`allocate_state` gives.

    Accepts what :func:`checkpoint_value` saves (DTensors, from any number of ranks: DCP
    reshards them), and a one-process state of the whole tensor (a plain tensor, or a quantized
    state dict of the whole shape; every rank must pass the same one), from which each rank
    keeps its own shard. Raises ``ValueError`` as ``LeanOptimizer.load_state_dict`` does.
    """
    import dataclasses
    if isinstance(value, Mapping) and QuantizedState.is_state_dict(value):
        try:
            value = QuantizedState.from_state_dict(value, device=local(p).device)
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{where}: corrupt quantized state ({err})") from None
    if isinstance(value, QuantizedState):
        value = value.dequantize()  # a whole-tensor state: every rank cuts its own shard below
    dense = convert_saved(dataclasses.replace(spec, quant=None, dtype=torch.float32) if spec.quant else spec, value, p, where)
    if spec.quant is not None:
        if not is_dtensor(dense):
            dense = _shard_of(dense, p, tuple(p.placements))
        state = quantized_shard(spec, p)
        state.quantize_(local(dense))  # a collective for a ShardQuantizedState: all ranks load alike
        return state
    placements = state_placements(spec, p)
    if placements is None:
        return dense.full_tensor() if is_dtensor(dense) else dense
    if not is_dtensor(dense):
        return _shard_of(dense, p, placements)
    return dense


def _shard_of(whole: torch.Tensor, p: DTensor, placements: Any) -> DTensor:
    from torch.distributed.tensor import distribute_tensor

    # src_data_rank=None: every rank holds the whole value and slices its own shard, no messages.
    return distribute_tensor(whole, p.device_mesh, list(placements), src_data_rank=None)


def shardable(p: DTensor) -> bool:
    """Whether DTensor's sharding propagation accepts ``p``'s placements: every sharded dim at
    least as long as the number of ranks it is split over (``torch.distributed.tensor``'s
    ``is_tensor_shardable``). A 1-row matrix on 2 ranks is not: DTensor then finds no strategy
    for some in-place and ``out=`` ops (``mul(out=)``, ``copy_``) that Adafactor's maths uses."""
    from torch.distributed.tensor import Shard

    for mesh_dim, pl in enumerate(p.placements):
        if isinstance(pl, Shard) and p.shape[pl.dim] < p.device_mesh.size(mesh_dim):
            return False
    return True


def update_whole(fn: Callable[..., Any], p: DTensor, grad: Any, state: Mapping[str, Any]) -> Any:
    """Run ``fn(param, grad, state)`` on whole tensors (``grad``: ``p``'s), then keep this rank's shards.

    For the few DTensor params DTensor cannot run an update on (:func:`shardable`: fewer rows
    than ranks, so at most ``ranks - 1`` rows): ``p``, its grad and its DTensor state entries
    are all-gathered, every rank runs the same one-process update on them (identical inputs,
    identical results), and each copies its own shards back. Plain entries (``step``) are
    passed as they are. A collective: every rank calls it for the same params in the same order.
    """
    whole_p = p.full_tensor()
    grad = grad.full_tensor() if is_dtensor(grad) else grad
    whole = {k: (v.full_tensor() if is_dtensor(v) else v) for k, v in state.items()}
    out = fn(whole_p, grad, whole)
    local(p).copy_(_shard_of(whole_p, p, p.placements).to_local())
    for k, v in state.items():
        if is_dtensor(v):
            local(v).copy_(_shard_of(whole[k], v, v.placements).to_local())
    return out
