"""The comparison's protocol as data, importing no torch: the default task and the tasks' names,
the lr grid and the seeds of each protocol, the peers' names, the training modes a contender name
may add and the precisions, so that ``leanopt compare`` checks its arguments (:func:`check_names`)
before it imports torch. tests/test_newcomer.py holds the names to the tasks and contenders."""

from __future__ import annotations

__all__ = ["DEFAULT_TASK", "LR_MULTIPLIERS", "MODES", "PEER_CONTENDERS", "PRECISIONS", "SEEDS", "TASK_NAMES", "check_names",
           "unknown_mode", "unknown_optimizer", "unknown_task"]  # fmt: skip

DEFAULT_TASK = "bytes-gpt"
# The built-in tasks (compare.tasks.BUILTIN_TASKS), then the aliases that pick one by what is installed.
TASK_NAMES = ("bytes-gpt", "digits", "distilbert-trainer", "minilm-tweets", "minilm-docstrings", "minilm")
# The peers a comparison runs besides those leanopt.catalog names (compare.contenders.CONTENDERS).
PEER_CONTENDERS = ("bnb-adamw8bit", "torchao-adamw8bit", "torchao-adamw4bit")

# The tuning protocol, by --quick: lr multipliers of each optimizer's centre, and seed count.
# The full one is sized to run every default optimizer in about half an hour on 2 loaded cores.
LR_MULTIPLIERS = {True: [1 / 3, 1.0, 3.0], False: [0.25, 0.5, 1.0, 2.0, 4.0]}
SEEDS = {True: 2, False: 3}

# ---- training modes ------------------------------------------------------------------------------
# What each mode suffix of a contender name switches on (``adamw+bf16-kahan``).
MODES: dict[str, str] = {
    "fp32": "fp32 weights, gradients and states; no autocast",
    "bf16-mixed": "fp32 weights (the master weights), gradients and states; forward under "
    "torch.autocast(bfloat16)",
    "bf16-nearest": "pure bf16: bf16 weights and gradients, no fp32 copy, no autocast; the optimizer's "
    "rounding='nearest' (updates under half a bf16 ulp are lost)",
    "bf16-stochastic": "pure bf16 (as bf16-nearest) with rounding='stochastic' (unbiased random rounding of "
    "each update)",
    "bf16-kahan": "pure bf16 (as bf16-nearest) with rounding='kahan' (a bf16 compensation buffer, 2 B/param, "
    "carries what each rounding lost)",
    "bf16-states": "the optimizer's moments stored in bf16 (state_dtype=torch.bfloat16, each write "
    "stochastically rounded): half of fp32 states' memory, without 8-bit's code books",
    "release": "leanopt.release_gradients(model, optimizer): each param stepped inside backward and its "
    "gradient freed at once (optimizer.step() and zero_grad() are no-ops; no clipping, no accumulation)",
}
# The precisions a name without a precision mode can train in (``--precision``).
PRECISIONS = ("fp32", "bf16-mixed")


def unknown_task(name: str) -> str:
    return f"unknown task {name!r}; built-in: {', '.join(TASK_NAMES)}, or hf:<model>:<dataset>"


def unknown_optimizer(name: str, known: set[str]) -> str:
    return f"unknown optimizer {name!r}; known: {', '.join(sorted(known))} (each may take modes after '+': {', '.join(MODES)})"


def unknown_mode(mode: str, given: str, optimizer: str) -> str:
    return f"unknown training mode {mode!r} in {given!r}; modes: {', '.join(MODES)} (e.g. {optimizer}+bf16-kahan)"


def check_names(task: str, optimizers: str | None) -> None:
    """``ValueError`` naming the first unknown task, optimizer or training mode of a comparison
    (what ``get_task`` and ``contender`` would refuse by name; whether an optimizer can run a mode
    is theirs to say). An optimizer registered in this process (``leanopt.register``) is known."""
    import sys

    from leanopt.catalog import BUILTIN_OPTIMIZERS, PEER_NAMES

    if not task.startswith("hf:") and task not in TASK_NAMES:
        raise ValueError(unknown_task(task))
    registry = sys.modules.get("leanopt.optim.registry")  # imported only where something registered
    known = {*BUILTIN_OPTIMIZERS, *PEER_NAMES, *PEER_CONTENDERS, *(registry.REGISTRY if registry else ())}
    for given in (optimizers or "").split(","):
        name, *modes = given.strip().lower().split("+")
        if not given.strip():
            continue
        if name.strip() not in known:
            raise ValueError(unknown_optimizer(name.strip(), known))
        for mode in modes:
            if mode.strip() not in MODES:
                raise ValueError(unknown_mode(mode.strip(), given.strip(), name.strip()))
