"""Which params of a model Muon orthogonalizes, decided by what its modules are, not by names.

:func:`muon_groups` returns the param groups of one :class:`~leanopt.Muon` for a whole model.
Matching parameter names (``"embed" in name``) breaks on the first model that names its layers
otherwise (Adam-mini's partition found no embedding in unknown models); the module types and a
transformers model's own accessors do not depend on names:

* **aux rule** (``use_muon=False``): the weights of ``nn.Embedding``/``nn.EmbeddingBag`` modules
  and of a transformers model's ``get_input_embeddings()``; its ``get_output_embeddings()`` (the
  LM head) and every param outside its ``base_model`` (a task head: a classifier); any param
  sharing its memory with an embedding's weight (tied); the modules or params passed as
  ``head``; every param of fewer than 2 dims (norms, biases, scales).
* **Muon** (``use_muon=True``): every other param of >= 2 dims. Convolution weights
  (``nn.Conv1d/2d/3d`` and their transposes) go to a group with ``"flatten": True`` (each
  orthogonalized as its 2-D flattening); other params of more than 2 dims are stacks of
  matrices over their leading dims (mixture-of-experts weights), each orthogonalized alone.

A model's params that do not require a gradient are left out (nothing steps them). A plain ``nn.Module``
has no marked output head: its last ``nn.Linear`` goes to Muon unless it is passed as ``head``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["MuonGroups", "Route", "muon_groups", "muon_groups_with_decay"]

_EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)
_CONVS = (nn.modules.conv._ConvNd,)


@dataclass(frozen=True)
class Route:
    """Where one param went: ``rule`` is ``"muon"``, ``"muon (flattened)"``, ``"muon (stacked)"``
    or the aux rule's name; ``why`` says what decided it."""

    name: str
    shape: tuple[int, ...]
    rule: str
    why: str


class MuonGroups(list):  # type: ignore[type-arg]  # a list of param-group dicts, as torch takes them
    """The param groups :func:`muon_groups` made (a ``list`` of dicts, for ``leanopt.Muon``),
    with :attr:`routes`: where each param went and why (``str()`` prints them as a table)."""

    def __init__(self, groups: Iterable[dict[str, Any]], routes: list[Route]) -> None:
        super().__init__(groups)
        self.routes = routes

    def table(self) -> str:
        width = max((len(r.name) for r in self.routes), default=4)
        shapes = [" x ".join(map(str, r.shape)) or "scalar" for r in self.routes]
        swidth = max((len(s) for s in shapes), default=5)
        lines = [f"{'param':<{width}}  {'shape':<{swidth}}  {'rule':<16}  why"]
        lines += [f"{r.name:<{width}}  {s:<{swidth}}  {r.rule:<16}  {r.why}" for r, s in zip(self.routes, shapes)]
        counts: dict[str, int] = {}
        for r in self.routes:
            kind = "muon" if r.rule.startswith("muon") else "aux"
            counts[kind] = counts.get(kind, 0) + int(torch.Size(r.shape).numel())
        lines.append(f"{counts.get('muon', 0):,} params orthogonalized by Muon, {counts.get('aux', 0):,} by the aux rule")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _accessor(model: nn.Module, name: str) -> nn.Module | None:
    """What a transformers model's ``get_input_embeddings``/``get_output_embeddings`` returns
    (None where the model has no such accessor, or it has no such module)."""
    getter = getattr(model, name, None)
    if not callable(getter):
        return None
    try:
        found = getter()
    except (NotImplementedError, AttributeError):
        return None
    return found if isinstance(found, nn.Module) else None


def _embedding_modules(model: nn.Module) -> list[nn.Module]:
    found: list[nn.Module] = [m for m in model.modules() if isinstance(m, _EMBEDDINGS)]
    emb = _accessor(model, "get_input_embeddings")
    return found + ([emb] if emb is not None else [])


def _head_params(model: nn.Module) -> dict[int, str]:
    """id(param) -> why, for a transformers model's output embeddings and task head."""
    out: dict[int, str] = {}
    head = _accessor(model, "get_output_embeddings")
    for p in head.parameters() if head is not None else ():
        out.setdefault(id(p), "output head (get_output_embeddings)")
    base = getattr(model, "base_model", None)
    if isinstance(base, nn.Module) and base is not model:
        inside = {id(p) for p in base.parameters()}
        for p in model.parameters():
            if id(p) not in inside:
                out.setdefault(id(p), "task head (outside the model's base_model)")
    return out


def _storage(t: torch.Tensor) -> tuple[Any, ...] | None:
    if t.device.type == "meta" or type(t) not in (torch.Tensor, nn.Parameter):
        return None
    return (str(t.device), t.untyped_storage().data_ptr())


def muon_groups(
    model_or_params: nn.Module | Iterable[Any],
    *,
    aux: str | None = None,
    aux_lr: float | None = None,
    aux_betas: tuple[float, float] | None = None,
    aux_eps: float | None = None,
    aux_weight_decay: float | None = None,
    head: Iterable[nn.Module | torch.Tensor] = (),
    verbose: bool = False,
) -> MuonGroups:
    """Param groups for one ``leanopt.Muon`` over a whole model (see the module for the rules).

    ``model_or_params``: a model (routed by what its modules are), or params (tensors, or
    ``(name, tensor)`` pairs: routed by their number of dims only), or param groups (each
    split by dims, its options kept for both parts; see :func:`_split_groups`). Given params,
    frozen ones are routed too (they may be unfrozen later); one that is not floating (an
    integer buffer, never stepped) stays with the matrices. ``aux`` names the aux rule
    of the ``use_muon=False`` group (default: the optimizer's ``aux``); ``aux_lr``,
    ``aux_betas``, ``aux_eps``, ``aux_weight_decay`` set its options (default: that rule's
    defaults, e.g. AdamW's lr 1e-3). ``head``: modules or params that go to the aux rule too.
    ``verbose`` prints :meth:`MuonGroups.table`. Groups left empty are dropped.

    >>> import torch, leanopt
    >>> model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    >>> groups = leanopt.muon_groups(model, aux_lr=3e-4)
    >>> [(g["use_muon"], len(g["params"])) for g in groups]
    [(True, 1), (False, 4)]
    >>> print(groups.routes[1])
    Route(name='1.weight', shape=(8, 8), rule='muon', why='matrix')
    """
    aux_options: dict[str, Any] = {k: v for k, v in (("aux", aux), ("lr", aux_lr), ("betas", aux_betas), ("eps", aux_eps),
                                      ("weight_decay", aux_weight_decay)) if v is not None}  # fmt: skip
    from_model = isinstance(model_or_params, nn.Module)
    named: list[tuple[str, torch.Tensor]] = []
    reasons: dict[int, str] = {}
    convs: set[int] = set()
    if isinstance(model_or_params, nn.Module):
        model = model_or_params
        named = list(model.named_parameters())
        embeddings = _embedding_modules(model)
        tied = {}
        for m in embeddings:
            for w in m.parameters():
                reasons.setdefault(id(w), f"embedding ({type(m).__name__})")
                key = _storage(w)
                if key is not None:
                    tied[key] = type(m).__name__
        for pid, why in _head_params(model).items():
            reasons.setdefault(pid, why)
        for _, p in named:
            key = _storage(p)
            if key is not None and key in tied:
                reasons.setdefault(id(p), f"tied to an embedding ({tied[key]})")
        for m in model.modules():
            if isinstance(m, _CONVS):
                convs.update(id(w) for key_name, w in m.named_parameters(recurse=False) if key_name == "weight")
    else:
        items = list(model_or_params)
        if any(isinstance(item, Mapping) for item in items):
            out = _split_groups(items, aux_options)
            if verbose:
                print(out.table())
            return out
        for i, item in enumerate(items):
            named.append((item[0], item[1]) if isinstance(item, tuple) and len(item) == 2 else (f"param {i}", item))
    for item in head:
        for given in item.parameters() if isinstance(item, nn.Module) else [item]:
            reasons[id(given)] = "head (given)"
    aux_name = str(aux_options.get("aux", "aux rule"))
    matrices: list[torch.Tensor] = []
    flattened: list[torch.Tensor] = []
    rest: list[torch.Tensor] = []
    routes: list[Route] = []
    for name, p in named:
        if not isinstance(p, torch.Tensor):
            raise ValueError(f"muon_groups: {name} is {type(p).__name__}, not a tensor")
        if not p.requires_grad and from_model:
            continue
        shape = tuple(p.shape)
        why = reasons.get(id(p)) or (f"{p.dim()}-D (norm, bias or scale)" if _aux_by_dims(p) else "")
        if why:
            rest.append(p)
            routes.append(Route(name, shape, aux_name, why))
        elif id(p) in convs:
            flattened.append(p)
            routes.append(Route(name, shape, "muon (flattened)", "convolution weight"))
        else:
            matrices.append(p)
            routes.append(Route(name, shape, *_matrix_route(p)))
    groups: list[dict[str, Any]] = []
    if matrices:
        groups.append({"params": matrices, "use_muon": True})
    if flattened:
        groups.append({"params": flattened, "use_muon": True, "flatten": True})
    if rest:
        groups.append({"params": rest, "use_muon": False, **aux_options})
    out = MuonGroups(groups, routes)
    if verbose:
        print(out.table())
    return out


def _aux_by_dims(p: torch.Tensor) -> bool:
    """A param of < 2 dims that could be trained (floating: a frozen one may be unfrozen later)."""
    return p.dim() < 2 and (p.is_floating_point() or p.is_complex())


def _matrix_route(p: torch.Tensor) -> tuple[str, str]:
    if p.dim() < 2:
        return "muon", "never stepped (not floating)"
    return ("muon", "matrix") if p.dim() == 2 else ("muon (stacked)", f"{p.dim() - 2}-D stack of matrices")


def _split_groups(groups: list[Any], aux_options: Mapping[str, Any]) -> MuonGroups:
    """Param groups (Trainer's decay and no-decay groups, say) each split by dims alone: a group
    that says ``use_muon`` is kept as it is; otherwise its params of < 2 dims that require a
    gradient (:func:`_aux_by_dims`) go to an aux group right after it, with the group's options (``aux_options`` fill
    the keys it does not set), the rest stay in place as a Muon group."""
    out: list[dict[str, Any]] = []
    routes: list[Route] = []
    aux_name = str(aux_options.get("aux", "aux rule"))
    for gi, group in enumerate(groups):
        if not isinstance(group, Mapping):
            raise ValueError(f"muon_groups: item {gi} is {type(group).__name__}; mix no param groups with params")
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        if "use_muon" in group:
            out.append({**group, "params": params})
            rule = "muon" if group["use_muon"] else aux_name
            routes += [Route(f"group {gi} param {i}", tuple(p.shape), rule, "the group says use_muon") for i, p in enumerate(params)]
            continue
        aux = [p for p in params if _aux_by_dims(p)]
        rest = [p for p in params if not _aux_by_dims(p)]
        if rest:
            out.append({**group, "params": rest, "use_muon": True})
        if aux:
            out.append({**aux_options, **group, "params": aux, "use_muon": False})
        for i, p in enumerate(params):
            why = f"{p.dim()}-D (norm, bias or scale)" if _aux_by_dims(p) else ""
            rule, because = (aux_name, why) if why else _matrix_route(p)
            routes.append(Route(f"group {gi} param {i}", tuple(p.shape), rule, because))
    return MuonGroups(out, routes)


def muon_groups_with_decay(model: nn.Module, weight_decay: float | None, **aux: Any) -> list[dict[str, Any]]:
    """:func:`muon_groups` of ``model`` (``aux``: its ``aux_*`` keywords) with Trainer's
    weight-decay rule: the Muon matrices and the aux params of >= 2 dims (embeddings, heads)
    take ``weight_decay`` (None: the optimizer's), the aux params of < 2 dims (biases, norms) none."""
    groups: list[dict[str, Any]] = []
    for group in muon_groups(model, aux_weight_decay=weight_decay, **aux):
        if group["use_muon"]:
            groups.append(group)
            continue
        matrices = [p for p in group["params"] if p.dim() >= 2]
        vectors = [p for p in group["params"] if p.dim() < 2]
        groups += [{**group, "params": matrices}] if matrices else []
        groups += [{**group, "params": vectors, "weight_decay": 0.0}] if vectors else []
    return groups
