"""Bookkeeping shared by every leanopt optimizer: validation, lazy state, safe save/load.

A subclass supplies ``state_layout`` (what state a parameter gets) and ``update`` (its rule, on
explicit :class:`~leanopt.optim.param_step.ParamStep` items). Where a step runs -- on the
device, or offloaded to the host -- is the business of the optimizer's ``placement``
(:mod:`leanopt.optim.placement`), which ``step``, ``zero_grad``, state creation and
``state_dict``/``load_state_dict`` delegate to; gradient release attaches to the placement
(:mod:`leanopt.optim.release`), clipping asks it (:mod:`leanopt.optim.clipping`). The base
allocates state from the layout, and its ``load_state_dict`` checks, before anything is
changed, that the state is of the optimizer's family (by the name it declares, or by its state
keys: :func:`leanopt.optim.identity.recognize_states`) and every incoming tensor against the
layout, keeps fp32 state fp32 for bf16/fp16 params
(``torch.optim.Optimizer`` would cast it to the param dtype), and converts between dense and
quantized forms of the same state key.
"""

from __future__ import annotations

import copy
import math
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from leanopt import kernels, tracing
from leanopt.kernels.multi_tensor import TableCache
from leanopt.optim import clipping
from leanopt.optim import rounding as rounding_module
from leanopt.optim.identity import declared_optimizer, recognize_states
from leanopt.optim.layout import StateSpec, convert_saved
from leanopt.optim.offload import Offloaded, check_offload
from leanopt.optim.param_step import ParamStep, chunk_elements, chunks
from leanopt.optim.peer_states import as_leanopt_state
from leanopt.optim.placement import OnDevice, Placement
from leanopt.optim.rounding import LOW_PRECISION, check_rounding, rounding_dither, stochastic_round
from leanopt.optim.sharding import allocate_state, checkpoint_value, is_dtensor, load_value
from leanopt.optim.validation import check_flag
from leanopt.quant import QuantizedState


def backend_for_torch_flags(
    cls: str, backend: str, *, foreach: bool | None = None, fused: bool | None = None,
    capturable: bool = False, differentiable: bool = False,
) -> str:  # fmt: skip
    """The backend that torch's implementation flags ask for, so that a call written for
    ``torch.optim.AdamW``/``SGD`` runs unchanged.

    ``fused=True`` or ``foreach=True``: leanopt's fast path, which ``backend="auto"`` already
    picks (Triton on CUDA, the compiled or native CPU kernel on CPU; each a multi-tensor,
    one-pass update: torch's fused and foreach in one). ``foreach=False`` (torch's per-tensor
    loop), with ``fused`` not True: ``"reference"``, the plain per-tensor maths every fast path
    is tested against. ``fused=False`` alone, and ``None``: leanopt's own choice, as torch
    makes its own. These flags only choose when ``backend`` is ``"auto"``: an explicit backend
    they contradict (``backend="reference", fused=True``) is a ``ValueError``.
    ``capturable=True`` (CUDA-graph capture) and ``differentiable=True`` (autograd through
    ``step``) cannot be honoured and are a ``ValueError`` naming them; False is accepted.
    """
    for name, value in (("foreach", foreach), ("fused", fused)):
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"{name} must be True, False or None, got {value!r}")
    check_flag("capturable", capturable)
    check_flag("differentiable", differentiable)
    if capturable:
        raise ValueError(
            f"{cls}: capturable=True is not supported: leanopt keeps each step count on the host and launches its "
            "kernels with host scalars, so a step cannot be captured in a CUDA graph (torch.compile(optimizer.step) "
            "is supported)"
        )
    if differentiable:
        raise ValueError(
            f"{cls}: differentiable=True is not supported: leanopt's step updates params and states in place under "
            "no_grad, so autograd cannot differentiate through it (use torch.optim's optimizer for that)"
        )
    if fused and foreach:
        raise ValueError(f"{cls}: fused=True and foreach=True cannot both be set (as in torch)")
    fast = bool(fused or foreach)
    wanted = "auto" if fast else "reference" if foreach is False else None
    if wanted is None:
        return backend
    if backend == "auto":
        return wanted
    if (backend == "reference") == fast:
        given = "fused=True" if fused else "foreach=True" if foreach else "foreach=False"
        raise ValueError(f"{cls}: {given} asks for {'a fast' if fast else 'the reference'} backend, but backend={backend!r}")
    return backend


def as_float(value: Any) -> float:
    """A group's ``lr`` (a number or a one-element tensor) as the float the kernels take."""
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


def _unguarded(method: Callable[..., Any]) -> Callable[..., Any]:
    """A bound method of ``torch.optim.Optimizer`` as leanopt calls it. torch guards
    ``add_param_group``, ``zero_grad``, ``state_dict`` and ``load_state_dict`` against dynamo's
    tracing (``torch._disable_dynamo``), and the guard's first call imports dynamo: ~1.1 s of
    CPU, most of what building an optimizer costs in a fresh process (a CLI command, a probe).
    Until dynamo is imported in this process nothing can be tracing the call, so the function
    under the guard runs; once it is, the guarded method, as torch's own optimizers call it."""
    inner = getattr(getattr(method, "__func__", None), "__wrapped__", None)
    if inner is None or "torch._dynamo" in sys.modules:
        return method
    return inner.__get__(method.__self__)  # type: ignore[attr-defined]  # a bound method


class LeanOptimizer(torch.optim.Optimizer):
    """Base class of leanopt's optimizers (bookkeeping only; the maths is in ``kernels``).

    A subclass gives ``state_layout`` (what state a param gets) and ``update`` (its rule on
    explicit tensors: :class:`~leanopt.optim.param_step.ParamStep` items). Where a step runs is
    the ``placement``'s business (:mod:`leanopt.optim.placement`): ``step``, ``zero_grad``,
    where states are created and what waits before a save or load are delegated to it.
    """

    # Complex params: stepped on their real view (as torch's AdamW does), or refused with a
    # ValueError when the param group is added (so ``leanopt.estimate`` refuses them too).
    supports_complex: bool = False
    # Whether the update of an element reads only that element (every elementwise rule): such
    # a param may be stepped in chunks, which bounds the temporaries of offload and rounding.
    chunkable: ClassVar[bool] = False
    # Whether leanopt.plan(gpus > 1) traces this optimizer's step under FSDP2: False for a step
    # that exchanges tensors between the ranks (Muon's owners), which a one-process trace cannot run.
    fsdp_planned: ClassVar[bool] = True
    # The declared identity: the registry name (leanopt.optim.registry), saved in every param
    # group under "optimizer", and the rule it runs (optimizers of one family -- AdamW,
    # AdamW8bit, AdamW4bit -- load each other's states; others refuse them by name).
    name: ClassVar[str]
    family: ClassVar[str]
    # The classes this one stands in for ("package.module.Class"): its positional parameters
    # (after ``params``) have their names and places, and its defaults theirs where the names
    # agree, so a call ported positionally means the same (tests/test_generic.py checks it).
    references: ClassVar[tuple[str, ...]] = ()
    # State keys a loaded state may hold that this optimizer drops: a peer's bookkeeping it
    # recomputes. Any other key outside the layout is another rule's state, and is refused.
    ignored_state_keys: ClassVar[frozenset[str]] = frozenset()
    # Set True on the instance while released (torch's GradScaler reads it by getattr: its step
    # then calls step() instead of unscaling gradients the hooks freed). Declared, not assigned.
    _step_supports_amp_scaling: bool

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any], *, backend: str = "auto",
                 offload: str | None = None) -> None:  # fmt: skip
        # The backend is how to compute and the placement where: neither is a hyper-parameter,
        # neither is saved.
        self.backend = kernels.check_backend(backend)
        check_offload(offload)
        self._tables = TableCache()
        self.placement: Placement = OnDevice(self)
        super().__init__(params, {**self._complete_defaults(defaults), "optimizer": self.name})
        if offload is not None:
            self.placement = Offloaded(self)

    @classmethod
    def groups_for_model(cls, model: torch.nn.Module) -> Any:
        """What this optimizer is built over for a whole ``model`` when only the model is given
        (``leanopt.estimate(model, cls)``): its params; Muon splits them into its groups."""
        return [p for p in model.parameters() if p.requires_grad]

    @property
    def offload(self) -> str | None:
        """Where states and master weights live: ``None`` (with the params) or ``"cpu"``."""
        return self.placement.offload

    def _complete_defaults(self, defaults: dict[str, Any]) -> dict[str, Any]:
        """The defaults every param group gets: the optimizer's, plus what a mixin adds."""
        return dict(defaults)

    def zero_grad(self, set_to_none: bool = True) -> None:
        # Gradients the placement holds elsewhere (offloaded, released) are dropped or zeroed
        # first; torch's zero_grad then does p.grad.
        self.placement.zero_grad(set_to_none)
        _unguarded(super().zero_grad)(set_to_none)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # torch's __getstate__ keeps defaults, state and param_groups: a copy (deepcopy, pickle)
        # is a plain optimizer on the device, without placement or release.
        super().__setstate__(state)
        self.__dict__.setdefault("backend", "auto")
        self.__dict__.setdefault("_tables", TableCache())
        if not isinstance(self.__dict__.get("placement"), Placement):
            self.placement = OnDevice(self)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:  # fmt: skip
        """``torch.nn.utils.clip_grad_norm_`` over this optimizer's params, returning the total norm.

        It sees their gradients wherever they are (:mod:`leanopt.optim.clipping`): in host
        memory with ``offload="cpu"`` and :func:`leanopt.release_gradients`, and it refuses
        (``RuntimeError``) gradients a release already applied inside backward.
        """
        params = [p for g in self.param_groups for p in g["params"]]
        return clipping.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)

    # ---- validation -----------------------------------------------------------------------
    def validate_group(self, group: Mapping[str, Any], *, loaded: bool = False) -> None:
        """Raise ``ValueError`` if ``group`` (options merged over the defaults) cannot run.

        The one check of a group's options: the constructor, ``add_param_group`` and
        ``load_state_dict`` (``loaded=True``: a group from a checkpoint) all call it.
        """

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not isinstance(param_group, Mapping):
            raise TypeError(f"param group must be a dict, got {type(param_group).__name__}")
        param_group = dict(param_group)
        params = param_group.get("params")
        if isinstance(params, torch.Tensor):
            param_group["params"] = [params]
        elif params is not None and not isinstance(params, set):  # torch itself rejects sets
            param_group["params"] = list(params)  # a generator is consumed once, here
        if not self.supports_complex:
            for i, item in enumerate(param_group.get("params") or []):
                p = item[1] if isinstance(item, tuple) and len(item) == 2 else item
                if isinstance(p, torch.Tensor) and p.is_complex():
                    name = f" {item[0]!r}" if isinstance(item, tuple) else ""
                    raise ValueError(
                        f"{type(self).__name__} does not support complex params: param {i}{name} of group "
                        f"{len(self.param_groups)} is {p.dtype} (use leanopt.AdamW, or optimize torch.view_as_real(p))"
                    )
        merged = {**self.defaults, **{k: v for k, v in param_group.items() if k != "params"}}
        if merged["optimizer"] != self.name:
            raise ValueError(f"param group 'optimizer' is {merged['optimizer']!r}; this optimizer is {self.name!r}")
        self.validate_group(merged)
        check_rounding(merged.get("rounding", "nearest"))
        self.placement.check_group({**merged, "params": param_group.get("params") or []}, len(self.param_groups))
        _unguarded(super().add_param_group)(param_group)
        self.placement.group_added()

    def _check_grad(self, p: torch.Tensor, gi: int, pi: int) -> None:
        """Refuse a gradient no backend can apply, before any param or state is changed."""
        g = p.grad
        if g is None:
            return
        if g.layout != torch.strided:  # sparse COO/CSR and the other sparse layouts
            raise RuntimeError(
                f"leanopt.{type(self).__name__} does not support sparse gradients "
                f"(param {pi} of group {gi} has a {g.layout} gradient)"
            )
        if g.shape != p.shape:
            raise ValueError(
                f"{type(self).__name__}: param {pi} of group {gi} has shape {tuple(p.shape)} but its "
                f"gradient has shape {tuple(g.shape)}"
            )
        if not (p.is_floating_point() or p.is_complex()):
            # torch's optimizers raise here too; the kernels would truncate each update toward 0.
            raise ValueError(
                f"{type(self).__name__}: param {pi} of group {gi} is {p.dtype} and has a gradient: only "
                "floating-point params can be optimized (set its .grad to None, or leave it out of the optimizer)"
            )
        state = self.state.get(p)
        if not state:
            return
        # A param converted since its state was made (model.double() after the optimizer was
        # built): fp64 params keep fp64 states, complex ones complex states, the others fp32 or
        # bf16. Refused before any param changes; offloaded, the fp32 host copy would otherwise
        # go on training an fp64 param in fp32, silently. (Dtypes first: the shape compare only
        # for a state whose dtype disagrees; the fp32 step count is no moment, whatever its shape.)
        fp64, complex_ = p.dtype == torch.float64, p.dtype.is_complex
        for key, value in state.items():
            if (key != "step" and isinstance(value, torch.Tensor)
                    and ((value.dtype == torch.float64) != fp64 or value.dtype.is_complex != complex_)
                    and value.shape == p.shape):  # fmt: skip
                raise RuntimeError(
                    f"{type(self).__name__}: param {pi} of group {gi} is {p.dtype}, but its optimizer state was made "
                    f"for a {value.dtype} param (the model was converted after the optimizer was built); build the "
                    "optimizer after converting the model"
                )

    # ---- layout -------------------------------------------------------------------------
    def is_chunkable(self, group: Mapping[str, Any]) -> bool:
        """Whether params of ``group`` may be stepped in pieces: ``chunkable``, unless a rule
        that differs between groups says otherwise (Muon's aux groups are, its matrices not)."""
        return self.chunkable

    def state_layout(
        self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype, group: Mapping[str, Any]
    ) -> list[StateSpec]:
        """The state a parameter of this ``shape``/``dtype`` in ``group`` gets after a step."""
        raise NotImplementedError

    def _param_layout(self, p: torch.Tensor, group: Mapping[str, Any]) -> list[StateSpec]:
        # ``p.shape`` is the global shape for a DTensor, so layouts never depend on sharding.
        specs = self.state_layout(tuple(p.shape), p.dtype, group)
        if group.get("rounding", "nearest") == "kahan" and p.dtype in LOW_PRECISION:
            # What the last rounding of a low-precision param lost (leanopt.optim.rounding).
            specs.append(StateSpec("kahan_comp", tuple(p.shape), p.dtype))
        return specs

    def _init_state(self, p: torch.Tensor, group: Mapping[str, Any]) -> dict[str, Any]:
        """``p``'s state, created from its layout on the placement's state device if it has none
        (a stateless param -- SGD without momentum -- gets no entry, as torch keeps none)."""
        state = self.state.get(p)
        if not state:
            layout = self._param_layout(p, group)
            if not layout:
                return {}
            state = self.state[p]
            device = self.placement.state_device(p)
            for spec in layout:
                state[spec.key] = allocate_state(spec, p) if is_dtensor(p) else spec.allocate(device)
        return state

    @staticmethod
    def _advance(state: dict[str, Any]) -> int:
        """Count one more step in ``state``; the new count (0 for a param that keeps none)."""
        if "step" not in state:
            return 0
        state["step"] += 1
        return int(state["step"].item())

    @staticmethod
    def _step_count(state: Mapping[str, Any]) -> int:
        """The step count in ``state``, a host tensor read without a device sync (0 if none)."""
        return int(state["step"].item()) if "step" in state else 0

    # ---- step -----------------------------------------------------------------------------
    @kernels.eager
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every param that has a gradient (see the class for the rule).

        Gradients are checked first (sparse, wrong shape: an error before anything changes).
        Under :func:`leanopt.release_gradients` params the release applied inside ``backward``
        are not stepped again (see :mod:`leanopt.optim.release`).
        """
        loss = self._closure_loss(closure)
        self.placement.step()
        return loss

    @torch.no_grad()
    def step_param(self, p: torch.Tensor) -> None:
        """Update ``p`` alone from its gradient now: the maths :meth:`step` applies to it (what
        gradient release runs inside ``backward``). A param without a gradient is left alone;
        one this optimizer does not hold is a ``ValueError``."""
        for gi, group in enumerate(self.param_groups):
            for i, q in enumerate(group["params"]):
                if q is p:
                    if p.grad is not None:
                        self._check_grad(p, gi, i)
                        self._step_params(gi, [(i, p)], f"group{gi}/param{i}")
                    return
        raise ValueError(f"{type(self).__name__}.step_param: the tensor (shape {tuple(p.shape)}) is not one of its params")

    def _step_params(self, gi: int, params: Sequence[tuple[int, torch.Tensor]], key: str) -> None:
        """Step ``params`` of group ``gi`` (each with its index in the group) from their
        ``.grad``: state created, step counted, the update run (``key`` names the kernels'
        cached launch tables for this list)."""
        group = self.param_groups[gi]
        items = []
        for i, p in params:
            state = self._init_state(p, group)
            grad = p.grad
            if grad is None:  # the callers pass only params with a gradient
                raise RuntimeError(f"{type(self).__name__}: param {i} of group {gi} has no gradient to step")
            items.append(ParamStep(p, grad, state, self._advance(state), (gi, i)))
        self._run(gi, group, items, key)

    def _run(self, gi: int, group: Mapping[str, Any], items: list[ParamStep], key: str) -> None:
        """:meth:`update`, with low-precision params written back as ``group["rounding"]`` says."""
        rounding = group.get("rounding", "nearest")
        rounded = [it for it in items if rounding != "nearest" and it.param.dtype in LOW_PRECISION]
        plain = [it for it in items if not (rounding != "nearest" and it.param.dtype in LOW_PRECISION)]
        if plain:
            self.update(gi, group, plain, key)
        for item in rounded:
            self._step_rounded(gi, group, item, rounding, f"{key}/rounded")

    def _step_rounded(self, gi: int, group: Mapping[str, Any], item: ParamStep, rounding: str, key: str) -> None:
        """The rule on an fp32 copy of the param (plus its compensation), with the param's own
        state, then the result written back with the group's rounding: in chunks for a
        ``chunkable`` rule, so the copies are those of one chunk (:mod:`leanopt.optim.rounding`)."""
        p = item.param
        if is_dtensor(p):
            raise ValueError(f"rounding={rounding!r} is not supported for DTensor (FSDP2) params (param {item.index[1]} "
                             f"of group {gi})")  # fmt: skip
        blocks = [v.format.block_size for v in item.state.values() if isinstance(v, QuantizedState)]
        chunk = chunk_elements(self.is_chunkable(group) and item.grad.is_contiguous(), p, blocks, rounding_module.ROUNDING_CHUNK)
        for part in chunks(item, chunk):
            master = part.param.float()
            comp = part.state.get("kahan_comp") if rounding == "kahan" else None
            if comp is not None:
                master.add_(comp.float())
            self.update(gi, group, [ParamStep(master, part.grad.float(), part.state, part.step, part.index, part.offset)], key)
            # Written back in pieces of at most ROUNDING_CHUNK elements, so that the rounding's own
            # temporaries are one piece's where the rule took the param whole (Adafactor).
            size = rounding_module.ROUNDING_CHUNK
            whole = not (part.param.is_contiguous() and master.is_contiguous() and (comp is None or comp.is_contiguous()))
            flat = [(part.param, master, comp, 0)] if whole else [
                (part.param.view(-1)[i : i + size], master.view(-1)[i : i + size], None if comp is None else comp.view(-1)[i : i + size], i)
                for i in tracing.walked(list(range(0, master.numel(), size)))
            ]  # fmt: skip
            for target, exact, compensation, at in flat:
                if compensation is not None:
                    nearest = exact.to(p.dtype)
                    compensation.copy_(exact.sub_(nearest.float()))
                    target.copy_(nearest)
                else:
                    u = rounding_dither(exact.numel(), part.offset + at, part.step, gi, item.index[1], exact.device)
                    target.copy_(stochastic_round(exact, p.dtype, u))

    def update(self, gi: int, group: Mapping[str, Any], items: list[ParamStep], key: str) -> None:
        """The rule: update each item's ``param`` and states in place from its ``grad`` (state
        created, step counted). ``key`` names the kernels' cached launch tables for this list."""
        raise NotImplementedError

    def _closure_loss(self, closure: Callable[[], Any] | None) -> Any:
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    # ---- save / load --------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        self.placement.wait()  # steps in flight (offloaded: on the host) finish first
        # torch runs the post hooks inside its state_dict; run them here instead, so that they
        # see (and may edit or replace) the state_dict this method returns.
        post_hooks = self._optimizer_state_dict_post_hooks
        self._optimizer_state_dict_post_hooks = OrderedDict()
        try:
            sd = _unguarded(super().state_dict)()
        finally:
            self._optimizer_state_dict_post_hooks = post_hooks
        params = [p for g in self.param_groups for p in g["params"]]

        def saved(pid: Any, st: Any) -> Any:
            # Entries under other keys (a hook may add one, as torch allows) are saved as they are.
            if not (isinstance(pid, int) and 0 <= pid < len(params) and isinstance(st, Mapping)):
                return st
            param = params[pid]
            if is_dtensor(param):
                # A sharded (DTensor) param's quantized shards are saved as a DTensor, for DCP to reshard.
                st = {k: checkpoint_value(v, param) for k, v in st.items()}
            # Quantized entries become plain dicts of tensors/ints/strings: weights_only-safe.
            return {k: (v.to_state_dict() if isinstance(v, QuantizedState) else v) for k, v in st.items()}

        sd["state"] = {pid: saved(pid, st) for pid, st in sd["state"].items()}
        for hook in list(post_hooks.values()):
            result = hook(self, sd)
            if result is not None:
                sd = result
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Registered hooks see what torch's own load would show them: the full state_dict
        # before, the installed state after (torch's load below only restores param_groups).
        pre_hooks, post_hooks = self._optimizer_load_state_dict_pre_hooks, self._optimizer_load_state_dict_post_hooks
        for hook in list(pre_hooks.values()):
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        state_dict = as_leanopt_state(state_dict, type(self))  # a peer's file of this family: bitsandbytes', torchao's
        if not isinstance(state_dict, Mapping) or "state" not in state_dict or "param_groups" not in state_dict:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: expected a dict with 'state' and "
                "'param_groups' (an optimizer state_dict)"
            )
        cls = type(self).__name__
        saved_groups = state_dict["param_groups"]
        if not isinstance(saved_groups, (list, tuple)):
            raise ValueError(f"{cls}.load_state_dict: 'param_groups' is a {type(saved_groups).__name__}, expected a list")
        for gi, saved in enumerate(saved_groups):
            if not isinstance(saved, Mapping) or not isinstance(saved.get("params"), (list, tuple)):
                raise ValueError(f"{cls}.load_state_dict: param group {gi} is not a dict with a 'params' list")
        if not isinstance(state_dict["state"], Mapping):
            raise ValueError(f"{cls}.load_state_dict: 'state' is a {type(state_dict['state']).__name__}, expected a dict")
        # Whose state it is first: another family's file is refused as such, whatever its groups.
        origin = self._loaded_identity(state_dict)
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"{cls}.load_state_dict: the state_dict has {len(saved_groups)} param groups, the optimizer has "
                f"{len(self.param_groups)}{origin.other_rule()}"
            )
        self.placement.wait()
        # Options a checkpoint lacks (saved before they existed) take the constructor's values,
        # as torch's optimizers do; every group is then checked as the constructor checks it.
        filled_groups = []
        for gi, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            try:
                filled = {**self._loaded_defaults(saved, group), **saved, **self._kept_on_load(group)}
                filled["optimizer"] = self.name
                self.validate_group(filled, loaded=True)
                check_rounding(filled.get("rounding", "nearest"))
                self.placement.check_group({**filled, "params": group["params"]}, gi)
            except ValueError as err:
                raise ValueError(f"{cls}.load_state_dict: param group {gi}: {err}{origin.other_rule()}") from None
            filled_groups.append(filled)
        saved_groups = filled_groups
        id_to_param: dict[Any, tuple[torch.Tensor, dict[str, Any], str]] = {}
        for gi, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    f"{cls}.load_state_dict: param group {gi} has "
                    f"{len(saved['params'])} params in the state_dict, {len(group['params'])} "
                    "in the optimizer"
                )
            names = group.get("param_names") or [None] * len(group["params"])
            for pi, (pid, p, name) in enumerate(zip(saved["params"], group["params"], names)):
                label = f"param {pid} (group {gi}, index {pi}"
                label += f", {name!r}" if name else ""
                label += f", shape {tuple(p.shape)})"
                id_to_param[pid] = (p, group, label)

        # Validate and convert everything first, so that a bad state_dict changes nothing.
        converted: dict[Any, Any] = {}
        for pid, saved_state in state_dict["state"].items():
            if pid not in id_to_param:
                if isinstance(pid, int):
                    raise ValueError(f"{cls}.load_state_dict: state for unknown param id {pid!r}")
                converted[pid] = copy.deepcopy(saved_state)  # a hook's own entry: kept, as torch does
                continue
            p, group, label = id_to_param[pid]
            converted[p] = self._convert_loaded_state(p, _merged_group(group, saved_groups, pid), saved_state, label, origin)

        # Let torch restore param_groups with no state (and without the hooks), then put ours.
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        try:
            _unguarded(super().load_state_dict)({"state": {}, "param_groups": saved_groups})
        finally:
            self._optimizer_load_state_dict_pre_hooks = pre_hooks
            self._optimizer_load_state_dict_post_hooks = post_hooks
        for p, st in converted.items():
            self.state[p] = st
        for post_hook in list(post_hooks.values()):
            post_hook(self)

    def group_defaults(self, group: Mapping[str, Any]) -> dict[str, Any]:
        """The options a group like ``group`` takes for the keys it does not set: the defaults
        (Muon: its aux groups, their rule's)."""
        return dict(self.defaults)

    def storage(self, group: Mapping[str, Any]) -> LeanOptimizer:
        """The optimizer whose layout methods (``state_keys``, ``quantizes``, ``state_format``)
        describe the states of ``group``: this one (Muon: the group's rule runner)."""
        return self

    def _loaded_defaults(self, saved: Mapping[str, Any], group: Mapping[str, Any]) -> dict[str, Any]:
        """What a loaded group ``saved`` (for this optimizer's ``group``) takes for the options it
        lacks: the defaults; ``ValueError`` where it cannot be a state of ``group``."""
        return {k: v for k, v in self.group_defaults(saved).items() if k not in saved}

    def _kept_on_load(self, group: Mapping[str, Any]) -> dict[str, Any]:
        """Options of this optimizer's ``group`` that a loaded group does not replace (the
        loaded states are converted to them instead): none here; LowBit's storage options."""
        return {}

    def _loaded_identity(self, state_dict: Mapping[str, Any]) -> _Origin:
        """Where a loaded ``state_dict`` comes from, once it is known to be a state of this
        optimizer's family: the name its groups declare, or -- for a state_dict that declares
        none (torch's, transformers', a leanopt file from before names were declared) -- the
        family its states and group options show (:func:`leanopt.optim.identity.recognize_states`).
        Another family's state, declared or recognized, is a ``ValueError`` naming both."""
        from leanopt.optim.registry import REGISTRY

        cls = type(self).__name__
        try:
            saved = declared_optimizer(state_dict)
        except ValueError as err:
            raise ValueError(f"{cls}.load_state_dict: {err}") from None
        if saved is not None:
            other = REGISTRY.get(saved)
            if other is None:
                raise ValueError(f"{cls}.load_state_dict: the state_dict was saved by an unknown optimizer {saved!r}")
            if getattr(other, "family", None) != self.family:
                raise ValueError(
                    f"{cls}.load_state_dict: the state_dict was saved by {other.__name__} ({other.family} rule); "
                    f"{cls} runs the {self.family} rule and cannot continue it (load it into {other.__name__})"
                )
            return _Origin(f"the state_dict declares {saved!r}", self.family, state_dict)
        seen = recognize_states(state_dict)
        if seen.family == self.family:
            return _Origin(f"the state_dict declares no optimizer and its states are {seen.layout}'s", self.family)
        if seen.family is None:
            raise ValueError(
                f"{cls}.load_state_dict: the state_dict declares no optimizer and its states are not a "
                f"{self.family}-rule state leanopt recognizes ({seen.layout}); leanopt's own state_dicts "
                "declare their optimizer, a peer's is read from its state keys (torch's AdamW/Adam, "
                "transformers' Adafactor)"
            )
        members = [c.__name__ for c in REGISTRY.values() if getattr(c, "family", None) == seen.family]
        raise ValueError(
            f"{cls}.load_state_dict: the state_dict declares no optimizer and its states are {seen.layout}'s "
            f"({seen.family} rule); {cls} runs the {self.family} rule and cannot continue it "
            f"(load it into leanopt.{', '.join(members)})"
        )

    def _convert_loaded_state(
        self, p: torch.Tensor, group: Mapping[str, Any], saved: Mapping[str, Any], label: str, origin: _Origin
    ) -> dict[str, Any]:
        """Check ``saved`` against the layout of ``p`` and return the state to install."""
        cls = type(self).__name__
        if not isinstance(saved, Mapping):
            raise ValueError(f"{cls}.load_state_dict: state of {label} is not a dict")
        out: dict[str, Any] = {}
        layout = self._param_layout(p, group)
        keys = {spec.key for spec in layout}

        def refuse(problem: str) -> ValueError:
            held = ", ".join(sorted(map(str, saved))) or "nothing"
            return ValueError(
                f"{cls}.load_state_dict: {origin.words}, but the state of {label} holds {held}: {problem} "
                f"(the {self.family} rule's state: {', '.join(sorted(keys))}){origin.other_rule()}"
            )

        # A key the rule has no place for is another rule's state (AdamW's exp_avg_sq in a file
        # declaring Lion): refused, not dropped. A rounding's compensation and a peer's
        # bookkeeping this optimizer recomputes (``ignored_state_keys``) are dropped.
        extra = [k for k in saved if k not in keys and k != "kahan_comp" and k not in self.ignored_state_keys]
        if extra:
            raise refuse(f"{', '.join(map(repr, extra))} has no place in it")
        target = torch.empty(0, device=self.placement.state_device(p))  # offloaded: states are converted onto the host
        for spec in layout:
            if spec.key not in saved:
                # A state saved without compensation (another rounding) continues from none.
                alt = spec.allocate(target.device) if spec.key == "kahan_comp" and not is_dtensor(p) else self._missing_state(spec, target, saved)
                if alt is None:
                    raise refuse(f"it has no {spec.key!r}")
                out[spec.key] = alt
                continue
            where = f"{cls}.load_state_dict: {spec.key!r} of {label}"
            if spec.key == "step":
                _check_step(saved["step"], where)
            if is_dtensor(p):
                out[spec.key] = load_value(spec, saved[spec.key], p, where)
            else:
                out[spec.key] = convert_saved(spec, saved[spec.key], target, where)
        return out

    def _missing_state(self, spec: StateSpec, p: torch.Tensor, saved: Mapping[str, Any]) -> Any:
        """Value for a layout key absent from a loaded state, or ``None`` to refuse."""
        return None


@dataclass(frozen=True)
class _Origin:
    """What a loaded state_dict was taken for (``words``, for the errors that follow): a state of
    ``family``, by the name it declares (``declared`` is then the state_dict) or by its states."""

    words: str
    family: str
    declared: Mapping[str, Any] | None = field(default=None, repr=False, compare=False)

    def other_rule(self) -> str:
        """For a declared state_dict whose states show another family: a clause saying which."""
        if self.declared is None:
            return ""
        seen = recognize_states(self.declared)
        return "" if seen.family in (None, self.family) else f"; its states are {seen.layout}'s (the {seen.family} rule)"


def _merged_group(group: Mapping[str, Any], saved_groups: Sequence[Mapping[str, Any]], pid: Any) -> dict[str, Any]:
    # Layout options (amsgrad, quantize, beta1...) come from the saved group: that is what
    # the optimizer will run with after loading.
    for sg in saved_groups:
        if pid in sg["params"]:
            merged = dict(group)
            merged.update({k: v for k, v in sg.items() if k != "params"})
            return merged
    return dict(group)


def _check_step(value: Any, where: str) -> None:
    """A step count: a finite, whole number >= 0 (a number or a one-element tensor)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex():
            raise ValueError(f"{where} must be a one-element tensor, got shape {tuple(value.shape)}")
        number = float(value.item())
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    else:
        raise ValueError(f"{where} is a {type(value).__name__}, expected a step count")
    if not (math.isfinite(number) and number >= 0 and number == int(number)):
        raise ValueError(f"{where} is {number!r}, expected a whole number >= 0")
