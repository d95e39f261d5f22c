"""Reading the optimizer checkpoints ``leanopt convert`` takes, without running their code.

:func:`read_checkpoint` opens

* a torch file (a Trainer ``optimizer.pt``, a folder holding one, a dict with the state under
  ``"optimizer"``): :func:`leanopt.memory.inspect.load_optimizer_state`, ``weights_only=True``;
* a file whose states are torchao's tensor subclasses (``OptimState8bit``, ``OptimState4bit``,
  ``OptimStateFp8``), which ``weights_only`` refuses unless torchao is imported. They are read
  into stand-ins (:class:`TorchaoState`) registered under exactly torchao's class names, for
  this load only, and only when those are the only classes the file names: a stand-in holds
  the codes, scales and code book the file carries and nothing else, so no torchao code runs
  (torchao need not be installed) and nothing but torch's allowlisted rebuild functions is
  called. Loading with ``weights_only=False`` would run whatever the file's pickle says;
  allowlisting torchao's real classes would run their constructors on the file's data and
  need torchao;
* a ``torch.distributed.checkpoint`` (DCP) folder (``.metadata`` and ``__<rank>_0.distcp``
  files), e.g. written under FSDP2 on N ranks (:func:`read_dcp`): each tensor is reassembled
  whole from its ranks' chunks. torch's own reader (``dcp_to_torch_save``) unpickles
  ``.metadata`` and the non-tensor entries with plain :mod:`pickle`, which runs any code the
  file names; here ``.metadata`` is unpickled with only DCP's metadata classes allowed, every
  other entry with ``torch.load(weights_only=True)``, and the sizes the metadata claims are
  checked against the bytes the files hold before anything is allocated.

Every failure is a ``ValueError`` (:class:`leanopt.memory.inspect.InspectError`) of one line
naming the file and, where it is one entry's, the entry.
"""

from __future__ import annotations

import io
import math
import os
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeGuard

import torch

from leanopt.memory.inspect import InspectError, _first_line, _optimizer_state, _unsafe_globals, load_optimizer_state
from leanopt.optim.identity import TORCHAO_STATES

__all__ = ["TorchaoState", "read_checkpoint", "read_dcp"]

DCP_METADATA = ".metadata"


def read_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The optimizer state_dict in ``path`` (see the module): a torch file, a folder holding
    ``optimizer.pt``, a file with torchao states, or a DCP folder (the optimizer's part of it:
    the one entry holding ``state`` and ``param_groups``, e.g. ``"optim"``)."""
    path = Path(path)
    if path.is_dir() and (path / DCP_METADATA).is_file():
        return _optimizer_part(read_dcp(path), path)
    try:
        return load_optimizer_state(path)
    except InspectError:
        file = path / "optimizer.pt" if path.is_dir() else path
        named = _unsafe_globals(file)
        if not named or any(name not in TORCHAO_STATES for name in named):
            raise
    with torch.serialization.safe_globals([(_STAND_INS[name], name) for name in named]):
        try:
            obj = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - a state torchao would not have saved: one line
            raise InspectError(f"{file}: holds torchao states that are not what torchao saves ({_first_line(err)})") from None
    return _optimizer_state(obj, file)


# ---- torchao's states, without torchao --------------------------------------------------------
class TorchaoState(torch.Tensor):
    """A torchao optimizer state as its file holds it: ``codes``, ``scale``, ``qmap`` (the code
    book, absent for fp8), ``signed``, ``block_size`` and (4-bit) ``_shape``, on a wrapper of
    the state's shape that has no data of its own. It does nothing: the conversion reads its
    fields (:mod:`leanopt.checkpoint`); ``leanopt.measure``'s counting sees through it."""

    torchao_class: ClassVar[str]
    tensor_attrs: ClassVar[tuple[str, ...]] = ("codes", "scale", "qmap")
    _fields: ClassVar[frozenset[str]] = frozenset({"codes", "scale", "qmap", "signed", "block_size", "_shape"})

    def __setattr__(self, name: str, value: Any) -> None:
        # The file's pickle sets attributes by name: only the fields torchao saves are taken.
        if name not in self._fields:
            raise ValueError(f"a {self.torchao_class.rsplit('.', 1)[-1]} has no field {name!r}")
        super().__setattr__(name, value)

    # torch.Tensor binds __torch_dispatch__ to a builtin (_C._disabled_torch_dispatch_impl), so its stub
    # types it as a plain function, while a subclass must define it as a classmethod (torch's docs).
    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        # torch requires a wrapper subclass to dispatch; this one has no data to compute with.
        raise TypeError(f"a torchao state read without torchao holds its fields only; {func} cannot run on it")

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return [a for a in self.tensor_attrs if isinstance(self.__dict__.get(a), torch.Tensor)], None

    # torch's would read the (absent) data. mypy refuses every annotated override of torch's untyped
    # Tensor.__repr__ here, even (*args: Any, **kwargs: Any) -> str (mypy 2.4.1, torch 2.13).
    def __repr__(self) -> str:  # type: ignore[override]
        return f"{type(self).__name__}(shape={tuple(self.shape)})"


class _State8bit(TorchaoState):
    torchao_class = "torchao.optim.subclass_8bit.OptimState8bit"


class _State4bit(TorchaoState):
    torchao_class = "torchao.optim.subclass_4bit.OptimState4bit"


class _StateFp8(TorchaoState):
    torchao_class = "torchao.optim.subclass_fp8.OptimStateFp8"
    tensor_attrs = ("codes", "scale")


_STAND_INS: dict[str, type] = {cls.torchao_class: cls for cls in (_State8bit, _State4bit, _StateFp8)}
assert set(_STAND_INS) == set(TORCHAO_STATES)


# ---- DCP folders ------------------------------------------------------------------------------
# What a DCP .metadata pickle may name: DCP's own metadata records and the plain values in them.
_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING",
                                              "MetadataIndex", "StorageMeta"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.planner": {"LoadItemType", "WriteItemType"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}  # fmt: skip
_MAX_PATH_DEPTH = 64


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"names {module}.{name}, which a DCP checkpoint's metadata does not hold")


def read_dcp(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """The whole state_dict saved in DCP ``folder`` (``{"model": ..., "optim": ...}`` as it was
    given to ``torch.distributed.checkpoint.save``), every tensor whole, in one process (no
    process group): the same dict ``dcp_to_torch_save`` writes, read without plain pickle."""
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        TensorStorageMetadata,
    )

    folder = Path(folder)
    meta_file = folder / DCP_METADATA
    try:
        with open(meta_file, "rb") as f:
            meta = _MetadataUnpickler(f).load()
    except Exception as err:  # noqa: BLE001 - whatever a damaged pickle raises: one line
        raise InspectError(f"{meta_file}: not a DCP checkpoint's metadata ({_first_line(err)})") from None
    entries = getattr(meta, "state_dict_metadata", None)
    storage = getattr(meta, "storage_data", None)
    paths = getattr(meta, "planner_data", None) or {}
    if not isinstance(entries, Mapping) or not isinstance(storage, Mapping) or not isinstance(paths, Mapping):
        raise InspectError(f"{meta_file}: not a DCP checkpoint's metadata (no state_dict_metadata / storage_data)")
    reader = _Reader(folder)
    out: dict[str, Any] = {}
    try:
        where = {(getattr(k, "fqn", None), _offsets(getattr(k, "offset", None))): v for k, v in storage.items()}
        # Every entry's byte ranges are checked, against their files and one another, before
        # any entry is allocated or read.
        plans: list[tuple[str, Any]] = []
        for fqn, entry in entries.items():
            if not isinstance(fqn, str):
                raise ValueError(f"entry {fqn!r}: not a key")
            if isinstance(entry, TensorStorageMetadata):
                plans.append((fqn, _plan_tensor(reader, fqn, entry, where)))
            elif isinstance(entry, BytesStorageMetadata):
                info = where.get((fqn, None))
                if info is None:
                    raise ValueError(f"entry {fqn!r}: no data")
                reader.claim(info, fqn)
                plans.append((fqn, info))
            else:
                raise ValueError(f"entry {fqn!r}: unknown kind {type(entry).__name__}")
        reader.check_disjoint()
        for fqn, plan in plans:
            value = _read_tensor(reader, fqn, plan) if isinstance(plan, _TensorPlan) else _load(reader.read(plan, fqn), fqn)
            _put(out, paths.get(fqn, (fqn,)), value, fqn, len(entries))
    except ValueError as err:
        raise InspectError(f"{folder}: {err}") from None
    except (TypeError, AttributeError, KeyError, IndexError, OverflowError, RuntimeError) as err:  # a damaged record
        raise InspectError(f"{folder}: not a DCP checkpoint leanopt reads ({_first_line(err)})") from None
    finally:
        reader.close()
    return out


class _Reader:
    """Byte ranges of a DCP folder's data files, checked to lie inside them and to be disjoint."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.files: dict[str, Any] = {}
        self.ranges: dict[str, list[tuple[int, int, str]]] = {}

    def read(self, info: Any, fqn: str) -> bytes:
        f, offset, length = self.check(info, fqn)
        f.seek(offset)
        return f.read(length)

    def check(self, info: Any, fqn: str) -> tuple[Any, int, int]:
        """The open data file of ``info`` (a ``_StorageInfo``) and its byte range, checked to lie in it."""
        rel, offset, length = getattr(info, "relative_path", None), getattr(info, "offset", None), getattr(info, "length", None)
        if getattr(info, "transform_descriptors", None):
            raise ValueError(f"entry {fqn!r}: stored with transforms {info.transform_descriptors!r} (compression), not read here")
        if not isinstance(rel, str) or not rel or os.path.basename(rel) != rel or rel.startswith("."):
            raise ValueError(f"entry {fqn!r}: data file {rel!r} is not a file of the checkpoint folder")
        if not (_byte_count(offset) and _byte_count(length)):
            raise ValueError(f"entry {fqn!r}: byte range {offset!r}+{length!r} is not a pair of non-negative ints")
        f = self.files.get(rel)
        if f is None:
            try:
                f = self.files[rel] = open(self.folder / rel, "rb")
            except OSError as err:
                raise ValueError(f"entry {fqn!r}: cannot open its data file {rel} ({err.strerror or err})") from None
        size = os.fstat(f.fileno()).st_size
        if offset + length > size:
            raise ValueError(f"entry {fqn!r}: bytes {offset:,}..{offset + length:,} lie outside {rel} ({size:,} bytes)")
        return f, offset, length

    def claim(self, info: Any, fqn: str) -> int:
        """Check ``info``'s byte range (:meth:`check`) and note it as ``fqn``'s, for
        :meth:`check_disjoint`; its length."""
        _, offset, length = self.check(info, fqn)
        self.ranges.setdefault(info.relative_path, []).append((offset, offset + length, fqn))
        return length

    def check_disjoint(self) -> None:
        """No two claimed ranges share a byte. DCP writes each chunk's bytes once; a metadata that
        points many chunks at one range would make a folder of kilobytes a tensor of gigabytes
        (each chunk passes its own checks), so the chunks' total could exceed the files' bytes."""
        for rel, ranges in self.ranges.items():
            ranges.sort()
            for (_, end, first), (start, _, second) in zip(ranges, ranges[1:]):
                if start < end:
                    same = "the same bytes" if first == second else f"bytes of entry {first!r}"
                    raise ValueError(f"entry {second!r}: a chunk at bytes {start:,}.. of {rel} reads {same}: "
                                     "each chunk's bytes are its own")  # fmt: skip

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def _offsets(value: Any) -> tuple[int, ...] | None:
    return None if value is None else tuple(value)


@dataclass(frozen=True)
class _TensorPlan:
    """A tensor entry's dtype, shape and chunks (offsets, sizes, storage info), checked."""

    dtype: torch.dtype
    size: tuple[int, ...]
    chunks: list[tuple[tuple[int, ...], tuple[int, ...], Any]]


def _plan_tensor(reader: _Reader, fqn: str, entry: Any, where: Mapping[Any, Any]) -> _TensorPlan:
    """A tensor entry's chunks, each checked to lie in its shape and in its data file with at
    least its elements' bytes, and all to tile the shape: nothing is read or allocated."""
    dtype = getattr(getattr(entry, "properties", None), "dtype", None)
    size = _shape(getattr(entry, "size", None), fqn, "size")
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"entry {fqn!r}: dtype {dtype!r} is not a torch dtype")
    chunks = getattr(entry, "chunks", None)
    if not isinstance(chunks, list) or not chunks:
        raise ValueError(f"entry {fqn!r}: no chunks")
    planned = []
    for chunk in chunks:
        offsets = _shape(getattr(chunk, "offsets", None), fqn, "chunk offsets")
        sizes = _shape(getattr(chunk, "sizes", None), fqn, "chunk sizes")
        if len(offsets) != len(size) or len(sizes) != len(size) or any(o + s > n for o, s, n in zip(offsets, sizes, size)):
            raise ValueError(f"entry {fqn!r}: chunk at {list(offsets)} of {list(sizes)} lies outside its shape {list(size)}")
        info = where.get((fqn, offsets))
        if info is None:
            raise ValueError(f"entry {fqn!r}: no data for its chunk at {list(offsets)}")
        # A chunk's bytes (inside its file, its own) hold at least its elements: a size the
        # files cannot back is refused before the whole tensor is allocated.
        length = reader.claim(info, fqn)
        if length < math.prod(sizes) * dtype.itemsize:
            raise ValueError(f"entry {fqn!r}: its chunk at {list(offsets)} of {list(sizes)} has only {length:,} bytes")
        planned.append((offsets, sizes, info))
    boxes = [(o, s) for o, s, _ in planned]
    if sum(math.prod(s) for _, s in boxes) != math.prod(size) or _overlap(boxes):
        raise ValueError(f"entry {fqn!r}: its chunks do not tile its shape {list(size)}")
    return _TensorPlan(dtype, size, planned)


def _read_tensor(reader: _Reader, fqn: str, plan: _TensorPlan) -> torch.Tensor:
    whole = torch.empty(plan.size, dtype=plan.dtype)
    for offsets, sizes, info in plan.chunks:
        part = _load(reader.read(info, fqn), fqn)
        if not isinstance(part, torch.Tensor) or tuple(part.shape) != sizes or part.dtype != plan.dtype:
            shown = f"{part.dtype} {list(part.shape)}" if isinstance(part, torch.Tensor) else type(part).__name__
            raise ValueError(f"entry {fqn!r}: its chunk at {list(offsets)} holds {shown}, not {plan.dtype} {list(sizes)}")
        whole[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] = part
    return whole


def _load(data: bytes, fqn: str) -> Any:
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise ValueError(f"entry {fqn!r}: holds what torch.load(weights_only=True) refuses ({_first_line(err)})") from None
    except Exception as err:  # noqa: BLE001 - a damaged record: one line naming it
        raise ValueError(f"entry {fqn!r}: not a torch record ({_first_line(err)})") from None


def _shape(value: Any, fqn: str, what: str) -> tuple[int, ...]:
    if not isinstance(value, (torch.Size, tuple, list)) or len(value) > 64 or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in value
    ):
        raise ValueError(f"entry {fqn!r}: {what} {value!r} is not a list of non-negative ints")
    return tuple(value)


def _overlap(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> bool:
    """Whether two of the chunks share an element (one chunk per rank: a few, compared pairwise)."""
    def meet(a: tuple[tuple[int, ...], tuple[int, ...]], b: tuple[tuple[int, ...], tuple[int, ...]]) -> bool:
        return all(oa < ob + sb and ob < oa + sa for oa, sa, ob, sb in zip(a[0], a[1], b[0], b[1])) and all(
            s > 0 for s in (*a[1], *b[1])
        )

    return any(meet(boxes[i], boxes[j]) for i in range(len(boxes)) for j in range(i + 1, len(boxes)))


def _byte_count(n: Any) -> TypeGuard[int]:
    """Whether ``n`` is an offset or a length in bytes: an int >= 0 (not a bool)."""
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


def _put(root: dict[str, Any], path: Any, value: Any, fqn: str, entries: int) -> None:
    """Set ``value`` at ``path`` (DCP's planner data: keys, and list indexes for lists such as
    ``param_groups``) inside ``root``, making the dicts and lists on the way."""
    if not isinstance(path, (tuple, list)) or not path or len(path) > _MAX_PATH_DEPTH:
        raise ValueError(f"entry {fqn!r}: its place {path!r} is not a key path")
    node: Any = root
    for key, after in zip(path, (*path[1:], None)):
        if not (isinstance(key, str) or (isinstance(key, int) and not isinstance(key, bool) and 0 <= key < entries)):
            raise ValueError(f"entry {fqn!r}: its place {list(path)!r} holds the key {key!r}")
        if isinstance(node, list) != isinstance(key, int):
            raise ValueError(f"entry {fqn!r}: its place {list(path)!r} mixes list indexes and keys")
        if isinstance(node, list) and isinstance(key, int):  # (both or neither, from the check above)
            node.extend([None] * (key + 1 - len(node)))
        if after is None:
            node[key] = value
        else:
            if (node[key] if isinstance(node, list) else node.get(key)) is None:
                node[key] = [] if isinstance(after, int) and not isinstance(after, bool) else {}
            node = node[key]


def _optimizer_part(saved: dict[str, Any], folder: Path) -> dict[str, Any]:
    """The optimizer state_dict among a DCP checkpoint's entries."""
    def is_optimizer(v: Any) -> bool:
        return isinstance(v, Mapping) and isinstance(v.get("state"), Mapping) and isinstance(v.get("param_groups"), list)

    found = [k for k, v in saved.items() if is_optimizer(v)]
    if not is_optimizer(saved) and len(found) != 1:
        what = "no entry" if not found else f"entries {found}"
        raise InspectError(f"{folder}: a DCP checkpoint whose {what} holds an optimizer state_dict ('state' and "
                           f"'param_groups'; its entries: {sorted(map(str, saved))[:6]})")  # fmt: skip
    sd = dict(saved if is_optimizer(saved) else saved[found[0]])
    # DCP saves dict keys as strings: a state_dict saved with int param ids (optimizer.state_dict()
    # rather than get_state_dict's names) gets its ids back, as its groups list them.
    ids = {str(pid): pid for g in sd["param_groups"] if isinstance(g, Mapping) for pid in g.get("params") or () if isinstance(pid, int)}
    sd["state"] = {ids.get(k, k) if isinstance(k, str) else k: v for k, v in sd["state"].items()}
    return sd

