"""What a saved optimizer ``state_dict`` holds: bytes per key and per group, and whose layout it is.

``load_optimizer_state(path)`` reads a file such as a Trainer checkpoint's ``optimizer.pt`` with
``torch.load(weights_only=True)`` (memory-mapped when the file allows it), and
``inspect_state_dict(sd)`` reports on it without building an optimizer. Bytes are counted as
:func:`leanopt.measure` counts them: each storage once, nested dicts (bitsandbytes) followed,
leanopt's quantized entries through their codes and scales, Python numbers as 0 bytes.

Whose state it is: leanopt's optimizers declare it, their registry name in every param group
under ``"optimizer"`` (:func:`leanopt.checkpoint.declared_optimizer`), and that name is what the
report gives. Files without it (torch's, transformers', bitsandbytes', torchao's, and leanopt's
own from before names were declared) are recognized from their state keys and group options
(:func:`recognize_states`), as the family of optimizers their states run: what leanopt's
``load_state_dict`` and :mod:`leanopt.checkpoint` then let such a file load and convert into.
"""

from __future__ import annotations

import math
import pickle
import warnings
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from leanopt.memory.estimate import MiB
from leanopt.memory.measure import StateCounter
from leanopt.optim.identity import (
    BNB_KEY,
    NO_STATE_YET,
    Recognized,
    declared_optimizer,
    quantized_formats,
    recognize_states,
    stacked_emas,
)
from leanopt.optim.peer_states import check_state_dict
from leanopt.optim.registry import REGISTRY
from leanopt.quant import QuantizedState

__all__ = ["InspectError", "Recognized", "StateDictReport", "inspect_file", "inspect_state_dict", "load_optimizer_state",
           "recognize_layout", "recognize_states"]

class InspectError(ValueError):
    """The file is missing, not a torch file, or not an optimizer state_dict."""


@dataclass
class StateDictReport:
    """Breakdown of one optimizer ``state_dict``.

    ``params`` is the number of parameter tensors the param groups list and
    ``params_with_state`` those that have state; ``param_elements`` is the number of elements
    of those params, inferred from the state shapes (None when a layout does not reveal them).
    ``elements`` and ``elements_by_key`` count the states' own elements: a tensor's, and a
    quantized state's (leanopt's, torchao's) as the tensor it stands for -- one per element of
    its shape, so an AdamW moment counts ``param_elements`` whatever its precision; its codes
    and block scales are in ``bytes``. bitsandbytes' keys are its own tensors (``state1``,
    ``absmax1``, ...). ``complete`` is False when only the
    total could be read (torchao's tensor-subclass states do not load with weights_only).
    ``optimizer`` is the registry name the param groups declare (None for a file that declares
    none: ``layout`` was then recognized from its state keys).
    """

    layout: str
    optimizer: str | None = None
    bytes: int = 0
    elements: int = 0
    params: int = 0
    params_with_state: int = 0
    param_elements: int | None = None
    by_key: dict[str, int] = field(default_factory=dict)
    elements_by_key: dict[str, int] = field(default_factory=dict)
    dtypes_by_key: dict[str, list[str]] = field(default_factory=dict)
    groups: list[dict[str, Any]] = field(default_factory=list)
    formats: list[str] = field(default_factory=list)
    complete: bool = True

    @property
    def megabytes(self) -> float:
        return self.bytes / MiB

    @property
    def bytes_per_param(self) -> float | None:
        return self.bytes / self.param_elements if self.param_elements else None

    def as_dict(self) -> dict[str, Any]:
        return {
            "layout": self.layout,
            "optimizer": self.optimizer,
            "complete": self.complete,
            "bytes": self.bytes,
            "megabytes": round(self.megabytes, 3),
            "elements": self.elements,
            "params": self.params,
            "params_with_state": self.params_with_state,
            "param_elements": self.param_elements,
            "bytes_per_param": None if self.bytes_per_param is None else round(self.bytes_per_param, 6),
            "by_key": {
                k: {"bytes": b, "elements": self.elements_by_key.get(k, 0), "dtypes": self.dtypes_by_key.get(k, [])}
                for k, b in self.by_key.items()
            },
            "groups": self.groups,
            "formats": self.formats,
        }


# ---- loading ---------------------------------------------------------------------------------
def load_optimizer_state(path: str | Path) -> dict[str, Any]:
    """``torch.load(path, weights_only=True)`` on the CPU, checked to be an optimizer state_dict.

    A folder is searched for ``optimizer.pt`` (a Trainer checkpoint folder). A dict that holds
    the state_dict under ``"optimizer"`` (or a one-element ``"optimizer_states"`` list) is unwrapped.
    Raises :class:`InspectError` with a one-line message otherwise.
    """
    file = _resolve_file(Path(path))
    try:
        with warnings.catch_warnings():  # torch warns about pickle protocols of non-torch files
            warnings.simplefilter("ignore")
            obj = torch.load(file, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(file))
    except pickle.UnpicklingError as err:
        raise InspectError(_unpickling_message(file, err)) from None
    except Exception as err:  # torch raises RuntimeError, EOFError, ... for non-torch files
        raise InspectError(f"{file}: not a torch checkpoint ({_first_line(err)})") from None
    return _optimizer_state(obj, file)


def _resolve_file(path: Path) -> Path:
    if path.is_dir():
        if (path / "optimizer.pt").is_file():
            return path / "optimizer.pt"
        raise InspectError(f"{path}: a folder without optimizer.pt")
    if not path.is_file():
        raise InspectError(f"{path}: no such file")
    return path


def _optimizer_state(obj: Any, file: Path) -> dict[str, Any]:
    if isinstance(obj, Mapping) and "state" not in obj:
        if isinstance(obj.get("optimizer"), Mapping):
            obj = obj["optimizer"]
        elif isinstance(obj.get("optimizer_states"), list) and len(obj["optimizer_states"]) == 1:
            obj = obj["optimizer_states"][0]
    if (
        not isinstance(obj, Mapping)
        or not isinstance(obj.get("state"), Mapping)
        or not isinstance(obj.get("param_groups"), list)
        or not all(isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in obj["param_groups"])
    ):
        what = f"a dict with keys {sorted(map(str, obj))[:6]}" if isinstance(obj, Mapping) else f"a {type(obj).__name__}"
        raise InspectError(f"{file}: not an optimizer state_dict (it holds {what}; expected 'state' and 'param_groups')")
    try:
        check_state_dict(obj)
    except ValueError as err:
        raise InspectError(f"{file}: {err}") from None
    return dict(obj)


def _unpickling_message(file: Path, err: Exception) -> str:
    unsafe = _unsafe_globals(file)
    if unsafe:
        return (
            f"{file}: holds classes that torch.load(weights_only=True) refuses ({', '.join(unsafe[:3])}); "
            "leanopt does not run a checkpoint's code to inspect it"
        )
    return f"{file}: not a torch checkpoint that torch.load(weights_only=True) reads"


def _unsafe_globals(file: Path) -> list[str]:
    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(file))
    except Exception:
        return []


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0][:120]}" if text else type(err).__name__


def inspect_file(path: str | Path) -> StateDictReport:
    """Report on a saved optimizer state_dict (see :func:`load_optimizer_state`).

    torchao's quantized states are tensor subclasses that torchao allowlists for weights_only
    loading when it is imported: a file that needs them imports ``torchao.optim`` (if
    installed) and loads again. Without torchao the report has the layout and the total bytes
    of the file's tensor data only (``complete=False``).
    """
    try:
        return inspect_state_dict(load_optimizer_state(path))
    except InspectError:
        file = _resolve_file(Path(path))
        torchao_globals = [g for g in _unsafe_globals(file) if g.startswith("torchao.")]
        if not torchao_globals:
            raise
    try:
        import torchao.optim  # noqa: F401  (registers its state classes as safe globals)
    except Exception:
        names = sorted({g.rsplit(".", 1)[-1] for g in torchao_globals})
        report = StateDictReport(layout=f"torchao tensor-subclass states ({', '.join(names)})", complete=False)
        with zipfile.ZipFile(file) as archive:
            report.bytes = sum(i.file_size for i in archive.infolist() if "/data/" in i.filename)
        return report
    return inspect_state_dict(load_optimizer_state(file))


# ---- the report ------------------------------------------------------------------------------
def inspect_state_dict(state_dict: Mapping[str, Any]) -> StateDictReport:
    """Bytes per state key and per param group, and the recognized layout, of a state_dict."""
    sd = _optimizer_state(state_dict, Path("<state_dict>"))
    groups = sd["param_groups"]
    group_of = {pid: gi for gi, g in enumerate(groups) for pid in g["params"]}
    counter = StateCounter()
    dtypes: dict[str, set[str]] = {}
    formats: set[str] = set()
    elements: dict[str, int] = {}
    param_elements: int | None = 0
    for pid, state in sd["state"].items():
        gi = group_of.get(pid, -1)
        if not isinstance(state, Mapping):
            counter.add(state, "<state>", gi)
            continue
        for key, value in _entries(state):
            before = counter.result.elements
            counter.add(value, key, gi)
            own = _quantized_elements(value)
            elements[key] = elements.get(key, 0) + (counter.result.elements - before if own is None else own)
            dtypes.setdefault(key, set()).update(_dtype_names(value))
            if isinstance(value, Mapping) and QuantizedState.is_state_dict(value):
                formats.add(str(value["format"]))
        n = _param_numel(state)
        param_elements = None if n is None or param_elements is None else param_elements + n

    m = counter.result
    report = StateDictReport(
        layout=recognize_layout(sd),
        optimizer=_declared(sd),
        bytes=m.bytes,
        elements=sum(elements.values()),
        params=sum(len(g["params"]) for g in groups),
        params_with_state=len(sd["state"]),
        param_elements=param_elements if sd["state"] else None,
        by_key=dict(m.by_key),
        elements_by_key=elements,
        dtypes_by_key={k: sorted(v) for k, v in dtypes.items()},
        formats=sorted(formats),
    )
    for gi, g in enumerate(groups):
        options = {k: _plain(v) for k, v in g.items() if k not in ("params", "param_names")}
        report.groups.append({"params": len(g["params"]), "bytes": m.by_group.get(gi, 0), "options": options})
    return report


def _entries(state: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """(key, value) pairs to count; bitsandbytes' nested dict is opened into its own keys."""
    out: list[tuple[str, Any]] = []
    for key, value in state.items():
        if key == BNB_KEY and isinstance(value, Mapping):
            out.extend((str(k), v) for k, v in value.items())
        else:
            out.append((str(key), value))
    return out


def _quantized_elements(value: Any) -> int | None:
    """The elements a quantized state stands for (its shape's), or None for anything else
    (counted as its tensors' elements). A leanopt entry's shape comes from the file: only a
    list of non-negative ints is one (the rest count their tensors)."""
    if isinstance(value, Mapping) and QuantizedState.is_state_dict(value):
        shape = value["shape"]
        ints = isinstance(shape, (list, tuple)) and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)
        return math.prod(shape) if ints else None
    if isinstance(value, QuantizedState):
        return math.prod(value.shape)
    if isinstance(value, torch.Tensor) and type(value) not in (torch.Tensor, torch.nn.Parameter) and hasattr(value, "__tensor_flatten__"):
        return value.numel()  # torchao's states: a wrapper of the state's shape over codes and scales
    return None


def _dtype_names(value: Any) -> set[str]:
    if isinstance(value, Mapping) and QuantizedState.is_state_dict(value):
        return {f"quantized:{value['format']}"}
    if isinstance(value, torch.Tensor):
        if type(value) not in (torch.Tensor, torch.nn.Parameter):
            return {type(value).__name__}
        return {str(value.dtype).removeprefix("torch.")}
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return {f"python {type(value).__name__}"}
    return set()


def _param_numel(state: Mapping[str, Any]) -> int | None:
    """Elements of the parameter a state belongs to, read off the state's shapes."""
    nested = state.get(BNB_KEY)
    if isinstance(nested, Mapping) and stacked_emas(nested):
        return nested["state2"].numel()  # state1 holds two EMAs of the param's shape
    flat = {**state, **nested} if isinstance(nested, Mapping) else state
    for key in ("exp_avg", "exp_avg_sq", "exp_avg_fast", "max_exp_avg_sq", "variance", "state1", "momentum_buffer"):
        value = flat.get(key)
        if isinstance(value, Mapping) and QuantizedState.is_state_dict(value):
            shape = value["shape"]  # from the file: only a list of non-negative ints is a shape
            if isinstance(shape, (list, tuple)) and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
                return math.prod(shape)
            return None
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value.numel()
    for row_key, col_key in (("exp_avg_sq_row", "exp_avg_sq_col"), ("row_var", "col_var")):
        row, col = flat.get(row_key), flat.get(col_key)
        if isinstance(row, torch.Tensor) and isinstance(col, torch.Tensor) and col.dim() > 0:
            return row.numel() * col.shape[-1]
    return None


def _plain(value: Any) -> Any:
    """A group option as JSON: tensors (torchao keeps lr as one) become numbers."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else f"tensor{tuple(value.shape)}"
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def _declared(state_dict: Mapping[str, Any]) -> str | None:
    try:
        return declared_optimizer(state_dict)
    except ValueError:
        return None


def recognize_layout(state_dict: Mapping[str, Any]) -> str:
    """Name the optimizer whose ``state_dict`` this is.

    The name its param groups declare (``"leanopt Lion8bit (pow3-s8/b256)"``); for a file that
    declares none, what its state keys and group options show (:func:`recognize_states`: peers'
    files, and leanopt's own from before names were declared).
    """
    states = [s for s in state_dict["state"].values() if isinstance(s, Mapping)]
    formats = quantized_formats(states)
    empty = "" if states else NO_STATE_YET
    quantized = f" ({', '.join(formats)})" if formats else ""
    try:
        declared = declared_optimizer(state_dict)
    except ValueError as err:
        return f"leanopt, inconsistent: {err}"
    if declared is not None:
        cls = REGISTRY.get(declared)
        if cls is None:
            return f"leanopt optimizer {declared!r} (declared; not in this version's registry){quantized}" + empty
        return f"leanopt {cls.__name__}{quantized}" + empty
    return recognize_states(state_dict).layout
