"""Adafactor with transformers' update rule, defaults and state keys, minus its two defects."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from typing import Any, cast

import torch

from leanopt import kernels
from leanopt.kernels.reference import adafactor_schedule
from leanopt.optim.base import LeanOptimizer, as_float
from leanopt.optim.docs import document
from leanopt.optim.elementwise import state_dtype
from leanopt.optim.layout import StateSpec
from leanopt.optim.param_step import ParamStep
from leanopt.optim.registry import register
from leanopt.optim.sharding import is_dtensor, shardable, update_whole
from leanopt.optim.validation import check_beta, check_flag, check_nonnegative


@register
@document
class Adafactor(LeanOptimizer):
    r"""Adafactor (Shazeer & Stern, 2018), exactly ``transformers.Adafactor``'s rule, defaults and keys.

    .. math::
        \begin{aligned}
        &\rho_t \leftarrow \begin{cases}
            \min\big(10^{-6}\,t \text{ if warmup\_init else } 10^{-2},\ 1/\sqrt{t}\big)
            & \text{relative\_step} \\
            \gamma & \text{otherwise} \end{cases} \\
        &\alpha_t \leftarrow \max\big(\epsilon_2, \mathrm{RMS}(\theta_{t-1})\big)\,\rho_t
            \text{ if scale\_parameter else } \rho_t \\
        &\hat\beta_{2,t} \leftarrow 1 - t^{c}, \qquad G_t \leftarrow g_t^2 + \epsilon_1 \\
        &\text{ndim} \ge 2:\ R_t \leftarrow \hat\beta_{2,t} R_{t-1} + (1-\hat\beta_{2,t})\,
            \mathrm{mean}_{-1}(G_t), \quad
            C_t \leftarrow \hat\beta_{2,t} C_{t-1} + (1-\hat\beta_{2,t})\,\mathrm{mean}_{-2}(G_t), \quad
            \hat V_t \leftarrow \frac{R_t \otimes C_t}{\mathrm{mean}_{-1}(R_t)} \\
        &\text{ndim} < 2:\ \hat V_t \leftarrow \hat\beta_{2,t} \hat V_{t-1} + (1-\hat\beta_{2,t})\,G_t \\
        &U_t \leftarrow g_t / \sqrt{\hat V_t}, \qquad
            U_t \leftarrow \alpha_t\,U_t / \max\big(1, \mathrm{RMS}(U_t)/d\big) \\
        &\text{with } \beta_1:\ m_t \leftarrow \beta_1 m_{t-1} + (1-\beta_1)\,U_t, \quad U_t \leftarrow m_t \\
        &\theta_t \leftarrow \theta_{t-1} - \lambda\,\alpha_t\,\theta_{t-1} - U_t
        \end{aligned}

    where :math:`\gamma` is ``lr``, :math:`(\epsilon_1, \epsilon_2)` is ``eps``, :math:`c` is
    ``decay_rate``, :math:`d` is ``clip_threshold`` and :math:`\lambda` is ``weight_decay``.
    Each parameter counts its own steps :math:`t` (a parameter without a gradient is skipped).

    State per parameter: ``step`` (fp32 scalar on the CPU); ``exp_avg_sq_row`` (shape
    ``shape[:-1]``) and ``exp_avg_sq_col`` (``shape[:-2] + shape[-1:]``) for ``ndim >= 2``, else
    ``exp_avg_sq`` (param shape); ``exp_avg`` (param shape) only when ``beta1`` is set. States are
    fp32 (fp64 for fp64 params). :math:`\mathrm{RMS}(\theta)` is recomputed every step, so unlike
    transformers there is no ``RMS`` entry. For fp32 params results equal transformers' to rounding.

    Two differences from ``transformers.Adafactor``, both fixes: ``step(closure)`` runs the
    closure with gradients enabled (transformers runs it under ``no_grad``, so its
    ``backward`` fails), and the fp32 state of bf16/fp16 params stays fp32 through
    ``state_dict``/``load_state_dict`` (transformers' load casts it to the param dtype). A
    transformers Adafactor ``state_dict`` (int ``step``, an ``RMS`` entry) loads and continues.

    **Learning-rate schedulers.** With ``relative_step=True`` (the default) the step size
    :math:`\rho_t` is its own schedule, and each param group's ``lr`` *reports* it: ``rho_1``
    after construction, the ``rho_t`` of the latest step after each step (what transformers'
    ``AdafactorSchedule`` reports). So LR schedulers and ``Trainer(optimizers=(opt, None))``
    run, but they do not change the step: a constant schedule (``LambdaLR(opt, lambda s: 1)``,
    ``ConstantLR(factor=1)``, Trainer's ``lr_scheduler_type="constant"``) is the one that
    makes sense, and one that writes any other lr into a group (Trainer's default linear
    decay, warm-up, cosine) gets a one-time ``UserWarning`` that it is ignored. To schedule
    Adafactor, use ``relative_step=False, lr=...`` (with ``scale_parameter=False`` for a plain
    step size, as Trainer's ``optim="adafactor"`` does): then every torch scheduler applies.

    Args:
        params: parameters or param groups.
        lr: external learning rate; must be ``None`` with ``relative_step`` and set without it
            (default None). A number or a one-element tensor.
        eps: ``(eps1, eps2)``: added to the squared gradient, and the floor of the parameter
            scale (default (1e-30, 1e-3)).
        clip_threshold: the RMS the normalized update is clipped to (default 1.0; must be > 0).
        decay_rate: exponent :math:`c` of the second-moment decay :math:`1 - t^c`
            (default -0.8; must be <= 0).
        beta1: coefficient of the running average of the update; ``None`` keeps no first
            moment (default None).
        weight_decay: decoupled weight decay, scaled by the step size (default 0.0).
        scale_parameter: multiply the step size by the parameter's RMS (default True).
        relative_step: use the time-dependent step size instead of ``lr`` (default True).
        warmup_init: with ``relative_step``, warm the step size up as :math:`10^{-6}t`
            (default False).
        .. args:: rounding backend offload

    Example:
        >>> import torch, leanopt
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = leanopt.Adafactor(model.parameters())
        >>> model(torch.randn(8, 4)).square().mean().backward()
        >>> opt.step()
        >>> sorted(opt.state[model.weight]), sorted(opt.state[model.bias])
        (['exp_avg_sq_col', 'exp_avg_sq_row', 'step'], ['exp_avg_sq', 'step'])
        >>> opt.state[model.weight]["exp_avg_sq_row"].shape
        torch.Size([2])
    """

    name = "adafactor"
    family = "adafactor"
    references = ("transformers.optimization.Adafactor",)
    # transformers saves each param's RMS; leanopt recomputes it every step.
    ignored_state_keys = frozenset({"RMS"})

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor | None = None,
        eps: tuple[float, float] = (1e-30, 1e-3),
        clip_threshold: float = 1.0,
        decay_rate: float = -0.8,
        beta1: float | None = None,
        weight_decay: float = 0.0,
        scale_parameter: bool = True,
        relative_step: bool = True,
        warmup_init: bool = False,
        *,
        rounding: str = "nearest",
        backend: str = "auto",
        offload: str | None = None,
    ) -> None:
        # Positional order and defaults are transformers', so it is a drop-in replacement.
        defaults = dict(
            lr=lr,
            eps=tuple(eps) if isinstance(eps, (tuple, list)) else eps,
            clip_threshold=clip_threshold,
            decay_rate=decay_rate,
            beta1=beta1,
            weight_decay=weight_decay,
            scale_parameter=scale_parameter,
            relative_step=relative_step,
            warmup_init=warmup_init,
            rounding=rounding,
        )
        validate_adafactor_hparams(defaults)
        self._reported: dict[int, float] = {}  # the lr each relative-step group last reported
        self._latest: dict[int, int] = {}  # the largest step count of each group's params
        self._warned_lr_ignored = False
        super().__init__(params, defaults, backend=backend, offload=offload)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_reported", {})
        self.__dict__.setdefault("_latest", {})
        self.__dict__.setdefault("_warned_lr_ignored", False)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        for gi, group in enumerate(self.param_groups):
            steps = [int(self.state[p]["step"]) for p in group["params"] if p in self.state]
            self._latest[gi] = max(steps, default=0)
            if group["relative_step"]:
                if group["lr"] is None:  # a transformers checkpoint: report the step size to come
                    group["lr"] = _relative_step_size(group, self._latest[gi] + 1)
                self._reported[gi] = group["lr"]

    def validate_group(self, group: Mapping[str, Any], *, loaded: bool = False) -> None:
        # A loaded group with relative_step holds the step size it last reported as its lr.
        validate_adafactor_hparams(group, reported_lr=loaded)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if isinstance(param_group.get("eps"), list):
            param_group = {**param_group, "eps": tuple(param_group["eps"])}
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if group["relative_step"]:
            # Schedulers and Trainer read (and scale) each group's lr: report the relative
            # step size of the first step here, the latest one after each step.
            group["lr"] = self._reported[len(self.param_groups) - 1] = _relative_step_size(group, 1)

    def state_layout(self, shape: tuple[int, ...], dtype: torch.dtype, group: Mapping[str, Any]) -> list[StateSpec]:
        sd = state_dtype(dtype)
        shape = tuple(shape)
        specs = [StateSpec("step", (), torch.float32, host=True)]
        if group["beta1"] is not None:
            specs.append(StateSpec("exp_avg", shape, sd))
        if len(shape) >= 2:
            specs.append(StateSpec("exp_avg_sq_row", shape[:-1], sd, reduced_dim=-1))
            specs.append(StateSpec("exp_avg_sq_col", shape[:-2] + shape[-1:], sd, reduced_dim=-2))
        else:
            specs.append(StateSpec("exp_avg_sq", shape, sd))
        return specs

    def update(self, gi: int, group: Mapping[str, Any], items: list[ParamStep], key: str) -> None:
        if group["relative_step"]:
            self._check_lr_untouched(gi, group)
        stepped = []
        for it in items:
            if is_dtensor(it.param) and not shardable(it.param):
                # Fewer rows than ranks: DTensor has no sharding for Adafactor's ops on this
                # param, so every rank updates it whole and keeps its shard.
                update_whole(lambda q, g, st, n=it.step: self._update("reference", key, group, [q], [g], [st], [n]),
                             it.param, it.grad, it.state)  # fmt: skip
            else:
                stepped.append(it)
        by_device: dict[torch.device, list[ParamStep]] = {}
        for it in stepped:
            by_device.setdefault(it.param.device, []).append(it)
        for bucket in by_device.values():
            self._update(self.backend, key, group, [it.param for it in bucket], [it.grad for it in bucket],
                         [it.state for it in bucket], [it.step for it in bucket])  # fmt: skip
        if group["relative_step"] and items:
            # The step size of the group's most advanced param, whichever params this call
            # stepped (offload and release step one at a time): the same report either way.
            latest = self._latest[gi] = max(self._latest.get(gi, 0), *(it.step for it in items))
            # ``group`` is the live param group (a dict in ``param_groups``): the step size is reported there.
            cast(dict[str, Any], group)["lr"] = self._reported[gi] = _relative_step_size(group, latest)

    def _check_lr_untouched(self, gi: int, group: Mapping[str, Any]) -> None:
        lr = group["lr"]
        # A constant schedule (LambdaLR returning 1) writes back the lr it started from: no news.
        if self._warned_lr_ignored or gi not in self._reported or lr in (self._reported[gi], group.get("initial_lr")):
            return
        self._warned_lr_ignored = True
        warnings.warn(
            f"leanopt.Adafactor(relative_step=True) sets its own step size; the lr {lr!r} written into "
            f"param group {gi} (by an LR scheduler or by hand) is ignored, and a learning_rate that Trainer logs is that "
            "schedule's, not the step size taken. To schedule the learning rate, use relative_step=False with lr=... (and "
            "scale_parameter=False for a plain step size); to log the step size taken, pair it with "
            "leanopt.integrations.transformers.RelativeStepSchedule(optimizer).",
            UserWarning,
            stacklevel=3,
        )

    def _update(self, backend: str, key: str, group: Mapping[str, Any], params, grads, states, steps) -> None:
        eps1, eps2 = group["eps"]
        kernels.adafactor(
            backend,
            self._tables,
            key,
            params,
            grads,
            [s.get("exp_avg") for s in states],
            [s.get("exp_avg_sq_row") for s in states],
            [s.get("exp_avg_sq_col") for s in states],
            [s.get("exp_avg_sq") for s in states],
            list(steps),
            lr=None if group["relative_step"] else as_float(group["lr"]),
            eps1=eps1,
            eps2=eps2,
            clip_threshold=group["clip_threshold"],
            decay_rate=group["decay_rate"],
            beta1=group["beta1"],
            weight_decay=group["weight_decay"],
            scale_parameter=group["scale_parameter"],
            relative_step=group["relative_step"],
            warmup_init=group["warmup_init"],
        )


def _relative_step_size(group: Mapping[str, Any], step: int) -> float:
    """``rho_t`` of ``step`` in a ``relative_step`` group: the lr such a group reports."""
    rho, _ = adafactor_schedule(
        max(step, 1), lr=None, decay_rate=group["decay_rate"], relative_step=True, warmup_init=group["warmup_init"]
    )
    return rho


def validate_adafactor_hparams(group: Mapping[str, Any], *, reported_lr: bool = False) -> None:
    """Raise ``ValueError`` for a group Adafactor cannot run (transformers' two checks first).

    ``reported_lr``: with ``relative_step`` the group's ``lr`` may hold the step size the
    optimizer reported (a loaded group); it is checked as a number, not refused.
    """
    lr, relative_step = group["lr"], group["relative_step"]
    for flag in ("relative_step", "warmup_init", "scale_parameter"):
        check_flag(flag, group[flag])
    if lr is not None and relative_step and not reported_lr:
        raise ValueError("Cannot combine manual `lr` and `relative_step=True` options: pass relative_step=False (and "
                         "scale_parameter=False for a plain step size) to use lr, or leave lr out for the relative step")
    if group["warmup_init"] and not relative_step:
        raise ValueError("`warmup_init=True` requires `relative_step=True`")
    if lr is None and not relative_step:
        raise ValueError("`relative_step=False` needs a learning rate `lr`")
    if lr is not None:
        check_nonnegative("lr", lr)
    eps = group["eps"]
    if not isinstance(eps, (tuple, list)) or len(eps) != 2:
        raise ValueError(f"eps must be a pair (eps1, eps2), got {eps!r}")
    check_nonnegative("eps1 (eps[0])", eps[0])
    check_nonnegative("eps2 (eps[1])", eps[1])
    clip = group["clip_threshold"]
    check_nonnegative("clip_threshold", clip)
    if clip == 0:
        # The update is divided by RMS(update)/clip_threshold: 0 gives 0/0 = NaN on a zero gradient.
        raise ValueError("Invalid clip_threshold: 0 (must be > 0)")
    decay_rate = group["decay_rate"]
    if not isinstance(decay_rate, (int, float)) or isinstance(decay_rate, bool) or not decay_rate <= 0:
        # beta2_t = 1 - t^decay_rate would be negative for t > 1 (torch's Adafactor checks this too).
        raise ValueError(f"Invalid decay_rate: {decay_rate!r} (must be <= 0)")
    if group["beta1"] is not None:
        check_beta("beta1", group["beta1"])
    check_nonnegative("weight_decay", group["weight_decay"])
