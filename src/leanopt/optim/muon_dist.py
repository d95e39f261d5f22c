"""Muon under ``torch.distributed``: each matrix orthogonalized whole, exactly once, by one owner rank.

Newton-Schulz reads a whole matrix, so under DDP (every rank holds every matrix) each rank
would repeat every other rank's work, and under FSDP2 (each rank holds a dim-0 shard) no rank
holds a matrix at all. :class:`leanopt.Muon` therefore splits its step in two when a process
group is in use (:func:`exchange_group`):

1. Each rank runs the momentum of its params as in one process (under FSDP2 on its local shard:
   the rule is elementwise) and queues the update direction, cast to bf16 -- the first thing
   Newton-Schulz does to it, so sending the bf16 copy changes no bit -- as a
   :class:`MatrixStage`.
2. At the end of ``step()`` (and each time the queue reaches :data:`BUCKET_ELEMENTS`) an
   exchange (:func:`orthogonalize_stages`) runs the queue: every matrix has an owner rank
   (:func:`owners`: largest first to the least-loaded rank, from the global shapes, so the same
   on every rank); one ``all_to_all`` sends each owner the shards of
   its matrices (a replicated matrix is already whole on its owner), each owner runs
   Newton-Schulz once per matrix, and a second ``all_to_all`` sends each rank its shard of each
   result (under DDP: the whole result). Each rank then decays and steps its params (shards).

Every element goes through the one-process arithmetic (the same momentum, the same
Newton-Schulz of the same bf16 matrix, the same decay and step), so the params after a step are
bit-identical to one process's given the same gradients (tests/test_muon_distributed.py).

Nothing is silent: before anything is stepped the ranks compare what they are about to step
(:func:`check_ranks_agree`: a digest of each param's position, shape and sharding, and for a
param that is not a shard a checksum of its bits and its gradient's), so a rank that steps
other params, or a plain param that is not the same on every rank (a model that is not wrapped
in DDP), is a ``ValueError`` naming the param on every rank, with nothing changed; after the
exchange the ranks add up what each orthogonalized (:class:`Orthogonalized`) and a total other
than the queue is a ``RuntimeError``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from leanopt.kernels import newton_schulz
from leanopt.optim.sharding import _shard_ranges, is_dtensor, local

__all__ = ["BUCKET_ELEMENTS", "LOCAL", "MatrixStage", "Orthogonalized", "check_placement", "check_ranks_agree", "exchange_group", "orthogonalize_stages",
           "owners"]  # fmt: skip

# ``process_group="local"``: every rank orthogonalizes its own matrices (one model per rank).
LOCAL = "local"
# An exchange starts once the queued matrices hold this many elements (global shapes, so every
# rank cuts the queue at the same place): 2**26, 128 MiB of bf16 directions under DDP, bounds
# what a step holds at once (one matrix larger than that goes alone).
BUCKET_ELEMENTS = 1 << 26


@dataclass(frozen=True)
class Orthogonalized:
    """What the last step orthogonalized: ``params`` (``elements``, ``matrices``: a stacked
    param counts each of its matrices) on this rank, and ``total_*`` over the ranks of the
    process group (one process: the same)."""

    params: int = 0
    elements: int = 0
    matrices: int = 0
    total_params: int = 0
    total_elements: int = 0
    total_matrices: int = 0
    world_size: int = 1

    def __add__(self, other: Orthogonalized) -> Orthogonalized:
        return Orthogonalized(self.params + other.params, self.elements + other.elements, self.matrices + other.matrices,
                              self.total_params + other.total_params, self.total_elements + other.total_elements,
                              self.total_matrices + other.total_matrices, max(self.world_size, other.world_size))  # fmt: skip


def counted(shape: Sequence[int], flatten: bool) -> tuple[int, int, int]:
    """``(params, elements, matrices)`` one orthogonalized param of ``shape`` adds to the count."""
    count, rows, cols = newton_schulz.matrices(shape, flatten)
    return 1, count * rows * cols, count


@dataclass
class MatrixStage:
    """One param's matrix stage, waiting for the exchange: ``direction`` is the bf16 update
    direction of this rank's shard (``sharded``: a ``Shard(0)`` DTensor) or of the whole matrix
    (a plain or replicated param), ``shape`` the param's global shape."""

    param: torch.Tensor
    direction: torch.Tensor
    index: tuple[int, int]  # (group, position) in the optimizer: the key of its owner
    label: str
    shape: tuple[int, ...]
    sharded: bool
    flatten: bool
    coefficients: tuple[float, float, float]
    steps: int
    eps: float
    decay: float  # the factor the param is multiplied by first (1 - lr * weight_decay)
    step_size: float  # the adjusted lr the orthogonalized update is subtracted with

    def ranges(self, world: int) -> list[tuple[int, int]]:
        """The flat ``[start, stop)`` of each rank's piece of the whole matrix."""
        rows = self.shape[0]
        return _shard_ranges(rows, numel(self.shape) // rows if rows else 0, world)

    def apply(self, ortho: torch.Tensor) -> None:
        """Decay and step this rank's param (shard) with its piece of the orthogonalized update."""
        p = local(self.param)
        p.mul_(self.decay)
        p.add_(ortho.view(p.shape).to(p.device), alpha=-self.step_size)


def numel(shape: Sequence[int]) -> int:
    return int(torch.Size(shape).numel())


def check_placement(p: Any, label: str, cls: str) -> bool:
    """Whether the DTensor ``p`` of a Muon group is sharded (``Shard(0)`` on a 1-D mesh, FSDP2)
    rather than replicated; ``ValueError`` naming it for any other placement."""
    from torch.distributed.tensor import Replicate, Shard

    placements = tuple(p.placements)
    if p.device_mesh.ndim != 1 or len(placements) != 1:
        raise ValueError(f"{cls}: {label} is a DTensor on a {p.device_mesh.ndim}-D mesh {placements}: Muon gathers a "
                         "matrix over a 1-D mesh only (FSDP2's Shard(0), or Replicate); HSDP and tensor-parallel "
                         "placements are not built")  # fmt: skip
    (pl,) = placements
    if type(pl) is Shard and pl.dim % max(p.ndim, 1) == 0:
        return True
    if isinstance(pl, Replicate):
        return False
    raise ValueError(f"{cls}: {label} is a DTensor placed as {pl!r}: Muon gathers a matrix from Shard(0) shards (FSDP2) "
                     "or takes it Replicate()d; other placements are not built")  # fmt: skip


def _ranks(group: Any) -> list[int]:
    import torch.distributed as dist

    return list(dist.get_process_group_ranks(group))


def exchange_group(setting: Any, params: Sequence[tuple[str, torch.Tensor]], cls: str) -> Any | None:
    """The process group Muon's matrix stage is spread over, or None (one process: each matrix
    orthogonalized where it is stepped).

    ``setting`` is the optimizer's ``process_group``: None (a DTensor's mesh group, else the
    default group once ``torch.distributed`` is initialized with more than one rank), a process
    group, or :data:`LOCAL`. Every DTensor of ``params`` (``(label, param)`` of the Muon
    groups) must be on the same ranks as that group: ``ValueError`` naming it otherwise.
    """
    dtensors = [(label, p) for label, p in params if is_dtensor(p)]
    if isinstance(setting, str):
        if setting != LOCAL:
            raise ValueError(f"{cls}: invalid process_group {setting!r} (None, a process group, or {LOCAL!r})")
        if dtensors:
            raise ValueError(f"{cls}: {dtensors[0][0]} is a DTensor (FSDP2) but process_group={LOCAL!r}: a shard "
                             "cannot be orthogonalized on its own; leave process_group to its default")  # fmt: skip
        return None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    if setting is not None and dist.get_rank(setting) < 0:
        raise ValueError(f"{cls}: rank {dist.get_rank()} is not in the process_group it was given")
    group, origin = setting, "process_group"
    for label, p in dtensors:
        mesh_group = p.device_mesh.get_group(0)
        if group is None:
            group, origin = mesh_group, f"the mesh of {dtensors[0][0]}"
        elif _ranks(mesh_group) != _ranks(group):
            raise ValueError(f"{cls}: {label} is sharded over ranks {_ranks(mesh_group)}, {origin} holds ranks "
                             f"{_ranks(group)}: Muon exchanges a step's matrices over one process group")  # fmt: skip
    if group is None:
        group = dist.group.WORLD
    if not dtensors and dist.get_world_size(group) == 1:
        return None
    return group


def owners(costs: Sequence[int], world: int, first: int = 0) -> list[int]:
    """The owner rank of each matrix of ``costs``: largest first, each to the rank with the
    least work so far (ties: rank ``first``, then the ranks after it; equal costs: the earlier
    matrix first). It reads only its arguments, so every rank gets the same owners; the caller
    moves ``first`` on from one exchange to the next, so that exchanges of one matrix (gradient
    release, a matrix larger than a bucket) do not all land on rank 0."""
    load = [0] * world
    out = [0] * len(costs)
    for k in sorted(range(len(costs)), key=lambda k: (-costs[k], k)):
        r = min(range(world), key=lambda r: (load[r], (r - first) % world))
        out[k] = r
        load[r] += costs[k]
    return out


def _digest(lines: Sequence[str]) -> int:
    return int.from_bytes(hashlib.blake2b("\n".join(lines).encode(), digest_size=7).digest(), "little")


def _bits_sum(t: torch.Tensor) -> torch.Tensor:
    """The sum of ``t``'s bit patterns as integers: replicas that agree to the bit give the same sum."""
    flat = t.detach().reshape(-1)
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    return flat.view(ints).sum(dtype=torch.int64)


def check_ranks_agree(entries: Sequence[tuple[str, torch.Tensor, torch.Tensor, bool]], group: Any, cls: str) -> None:
    """Collective, before anything is stepped: ``ValueError`` (on every rank alike) unless every
    rank is about to step the same Muon params (``(label, param, grad, sharded)``, in order) and
    every param that is not a shard has the same bits, and the same gradient, on every rank."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    device = local(entries[0][1]).device if entries else collective_device([], group)
    lines = [f"{label} {list(p.shape)} {'shard' if sharded else 'whole'}" for label, p, _, sharded in entries]
    header = torch.tensor([len(entries), _digest(lines)], dtype=torch.int64, device=device)
    headers = [torch.empty_like(header) for _ in range(world)]
    dist.all_gather(headers, header, group=group)
    if any(not torch.equal(h, headers[0]) for h in headers):
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, lines, group=group)
        for r, theirs in enumerate(everyone):
            if theirs != everyone[0]:
                first = next((k for k, (a, b) in enumerate(zip(everyone[0], theirs)) if a != b), min(len(theirs), len(everyone[0])))
                ours = everyone[0][first] if first < len(everyone[0]) else "nothing"
                other = theirs[first] if first < len(theirs) else "nothing"
                raise ValueError(f"{cls}: the ranks would step different Muon matrices: matrix {first} is {ours} on rank 0 "
                                 f"and {other} on rank {r} (every rank of the process group must step the same params; "
                                 f"for one model per rank pass process_group={LOCAL!r})")  # fmt: skip
    whole = [(label, p, g) for label, p, g, sharded in entries if not sharded]
    if not whole:
        return
    sums = torch.stack([torch.stack([_bits_sum(local(p)), _bits_sum(local(g))]) for _, p, g in whole]).to(device)
    everyone_sums = [torch.empty_like(sums) for _ in range(world)]
    dist.all_gather(everyone_sums, sums, group=group)
    for r, theirs in enumerate(everyone_sums):
        differ = (theirs != everyone_sums[0]).any(dim=1).nonzero()
        if differ.numel():
            label = whole[int(differ[0, 0])][0]
            raise ValueError(f"{cls}: {label} (or its gradient) differs between rank 0 and rank {r} (this is rank {rank}): "
                             "a Muon param that is a plain tensor under torch.distributed must be the same on every rank "
                             "(wrap the model in DistributedDataParallel, or shard it with FSDP2); for one model per rank "
                             f"pass process_group={LOCAL!r}")  # fmt: skip


Orthogonalize = Callable[[torch.Tensor, MatrixStage], torch.Tensor]


def orthogonalize_stages(stages: Sequence[MatrixStage], owner: Sequence[int], group: Any,
                         orthogonalize: Orthogonalize) -> tuple[list[torch.Tensor], Orthogonalized]:  # fmt: skip
    """Collective: each stage's piece of its orthogonalized update on this rank (flat bf16), and the
    count. ``owner[k]`` is the rank that runs ``orthogonalize(whole, stage)`` for stage ``k``
    (the same list on every rank: :func:`owners`); two ``all_to_all`` calls move the pieces."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    device = collective_device(stages, group)
    ranges = [s.ranges(world) if s.sharded else [] for s in stages]
    mine = [k for k in range(len(stages)) if owner[k] == rank]

    # Gather: every rank sends each owner its shards of the owner's sharded matrices.
    send: list[list[torch.Tensor]] = [[] for _ in range(world)]
    for k, s in enumerate(stages):
        if s.sharded:
            send[owner[k]].append(s.direction.reshape(-1))
    in_splits = [sum(t.numel() for t in parts) for parts in send]
    out_splits = [sum(ranges[k][src][1] - ranges[k][src][0] for k in mine if stages[k].sharded) for src in range(world)]
    received = _all_to_all([t for parts in send for t in parts], in_splits, out_splits, group, device)
    pieces: dict[int, list[torch.Tensor]] = {k: [] for k in mine}
    at = 0
    for src in range(world):
        for k in mine:
            if stages[k].sharded:
                length = ranges[k][src][1] - ranges[k][src][0]
                pieces[k].append(received[at : at + length])
                at += length
    del send

    # Newton-Schulz, once per matrix, on its owner.
    done = Orthogonalized()
    results: dict[int, torch.Tensor] = {}
    for k in mine:
        s = stages[k]
        whole = torch.cat(pieces.pop(k)) if s.sharded else s.direction.reshape(-1)
        results[k] = orthogonalize(whole.view(s.shape), s).reshape(-1)
        params, elements, matrices = counted(s.shape, s.flatten)
        done = done + Orthogonalized(params, elements, matrices)
    del received

    # Scatter: each owner sends every rank its shard of each result (a replicated one: all of it).
    back: list[list[torch.Tensor]] = [[] for _ in range(world)]
    for dst in range(world):
        for k in mine:
            start, stop = ranges[k][dst] if stages[k].sharded else (0, results[k].numel())
            back[dst].append(results[k][start:stop])
    in_splits = [sum(t.numel() for t in parts) for parts in back]

    def size_here(k: int) -> int:
        return ranges[k][rank][1] - ranges[k][rank][0] if stages[k].sharded else numel(stages[k].shape)

    out_splits = [sum(size_here(k) for k in range(len(stages)) if owner[k] == src) for src in range(world)]
    returned = _all_to_all([t for parts in back for t in parts], in_splits, out_splits, group, device)
    del back, results
    out: list[torch.Tensor] = [returned[:0]] * len(stages)
    at = 0
    for src in range(world):
        for k in range(len(stages)):
            if owner[k] == src:
                out[k] = returned[at : at + size_here(k)]
                at += size_here(k)

    counts = torch.tensor([done.params, done.elements, done.matrices], dtype=torch.int64, device=device)
    dist.all_reduce(counts, group=group)
    total_params, total_elements, total_matrices = (int(c) for c in counts)
    total = Orthogonalized(done.params, done.elements, done.matrices, total_params, total_elements, total_matrices, world)
    if total.total_params != len(stages):
        raise RuntimeError(f"Muon: {total.total_params} matrices were orthogonalized over the ranks for the {len(stages)} "
                           "queued this step (the owners disagree)")  # fmt: skip
    return out, total


def collective_device(stages: Sequence[MatrixStage], group: Any) -> torch.device:
    """Where this rank's tensors of the exchange live: its directions' device (NCCL takes CUDA
    tensors only, also for the small headers and counts)."""
    import torch.distributed as dist

    if stages:
        return stages[0].direction.device
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_to_all(parts: list[torch.Tensor], in_splits: list[int], out_splits: list[int], group: Any,
                device: torch.device) -> torch.Tensor:  # fmt: skip
    import torch.distributed as dist

    sent = torch.cat(parts) if parts else torch.empty(0, dtype=torch.bfloat16, device=device)
    received = torch.empty(sum(out_splits), dtype=torch.bfloat16, device=device)
    dist.all_to_all_single(received, sent, out_splits, in_splits, group=group)
    return received
