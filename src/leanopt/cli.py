"""The ``leanopt`` command: argument parsing and printing only; the work is in :mod:`leanopt.memory`,
:mod:`leanopt.checkpoint` and :mod:`leanopt.compare`.

    leanopt estimate MODEL [--optimizers adamw,adafactor,...] [--json]
    leanopt plan MODEL --batch B --seq S [--budget 24GiB] [--optimizers ...] [--precisions fp32,bf16-mixed,bf16]
                 [--roundings kahan,stochastic] [--grad-release off|on|both] [--accum K] [--no-process] [--json]
    leanopt doctor MODEL --batch B --seq S [--optimizer adamw] [--precision fp32|bf16-mixed|bf16] [--checkpointing] [--json]
    leanopt inspect optimizer.pt [--json]
    leanopt convert SRC DST --to NAME   (of the same family: adamw8bit, lion4bit, ...; torch-adamw) [--rule lion]
    leanopt compare [--quick] [...]
    leanopt build-kernels                (the native CPU kernel, now rather than on first use)
    leanopt --version

Every error exits with status 2 and one line on stderr. ``--json`` output is strict JSON
(non-finite numbers are written as the strings ``"nan"``, ``"inf"``, ``"-inf"``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

# Only modules that import no torch: arguments, optimizer and model names and files are checked
# (`check=` of each command) before torch is imported, which takes seconds; each command imports
# what it needs inside (tests/test_newcomer.py).
from leanopt import __version__
from leanopt.arguments import Parser, UsageError, whole_number
from leanopt.catalog import BUILTIN_OPTIMIZERS, PEER_NAMES, ROUNDINGS, TORCH_ADAMW, TORCH_MUON, known_optimizer, optimizer_families
from leanopt.memory.presets import locate_model
from leanopt.tables import console as _console
from leanopt.tables import new_table, print_table
from leanopt.writing import write_atomically

if TYPE_CHECKING:
    from leanopt.memory.inspect import StateDictReport
    from leanopt.memory.presets import ModelSource
    from leanopt.memory.training import TrainingMemory

MiB = 1024**2

TABLE_PRECISIONS = ("fp32", "bf16-mixed")
# Printed as paragraphs under the tables, wrapped to the terminal's width.
NOTES = (
    "MB = MiB (1024² bytes). state: the optimizer's state, MB and bytes per param. fp32, bf16-mixed: training MB "
    "= weights + gradients + master weights + optimizer state; no activations. fp32: 4 + 4 B/param + state. "
    "bf16-mixed (torch.autocast, Trainer(bf16=True)): 2 (bf16 weights) + 4 (fp32 grads) + 4 (fp32 master weights) "
    "B/param + state. Formulas: docs/memory.md."
)
MODE_NOTES = (
    "A column per mode, its --json key: fp32, bf16-mixed as above; bf16: pure bf16 weights and gradients "
    "(2 + 2 B/param), no master weights, rounding='nearest'; bf16-stochastic, bf16-kahan: rounding='stochastic', "
    "'kahan' (kahan adds a 2 B/param compensation). Persistent memory only: a stochastic/kahan step also makes "
    "fp32 copies of one chunk of 2**20 elements at a time. Grad release (leanopt.release_gradients): gradients = the largest param's. "
    "n/a: not a leanopt optimizer."
)


CliError = UsageError  # what the commands raise for a one-line error


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="leanopt",
        description="Optimizer memory: estimate it for a model, inspect and convert a saved state, "
        "compare optimizers by training.",
        epilog="`leanopt COMMAND --help` for a command's arguments. Errors exit with status 2 and one line.",
    )
    parser.add_argument("--version", action="version", version=f"leanopt {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser, title="commands", metavar="COMMAND")

    # Each help= is one line of `leanopt --help` (under 56 characters: no wrap at 80 columns).
    est = sub.add_parser(
        "estimate",
        help="optimizer state and training memory for a model",
        description="Optimizer state and training memory (weights, gradients, master weights, state) "
        "for a model, built on the meta device: nothing is downloaded but a config.",
    )
    est.add_argument(
        "model",
        help="a preset (distilbert-base-cased, gpt2, llama-2-7b, ...), a config.json or a folder with one, "
        "a Hugging Face Hub id, or a parameter count (7b, 125m, 65783042)",
    )
    known = ", ".join([*BUILTIN_OPTIMIZERS, *PEER_NAMES])
    est.add_argument(
        "--optimizers",
        help=f"comma-separated names (default: leanopt's and torch-adamw); known: {known}",
    )
    est.add_argument("--json", action="store_true", help="print JSON instead of a table")
    est.set_defaults(run=cmd_estimate, check=_check_estimate)

    pl = sub.add_parser(
        "plan",
        help="will training fit: peak memory per setup",
        description="Peak memory of one steady-state training step (weights, gradients, optimizer state, "
        "activations, temporaries) for each optimizer x precision (pure bf16: x rounding) x activation "
        "checkpointing x gradient release, traced on fake tensors: nothing is allocated or downloaded but a config.",
    )
    pl.add_argument("model", help="a preset (distilbert-base-cased, gpt2, llama-2-7b, ...), a config.json or a folder "
                    "with one, or a Hugging Face Hub id")  # fmt: skip
    pl.add_argument("--batch", type=whole_number, required=True, help="sequences per step")
    pl.add_argument("--seq", type=whole_number, required=True, help="tokens per sequence")
    pl.add_argument("--budget", help="memory to fit in: 24GiB, 24GB, 500MiB or bytes")
    pl.add_argument("--gpus", type=whole_number, default=1, help="ranks to shard over with FSDP2 (fully_shard per block and root; per-rank peak, batch per rank)")
    pl.add_argument("--optimizers", help=f"comma-separated (default: %(leanopt.memory.plan:DEFAULT_OPTIMIZERS)s); known: {known}")
    pl.add_argument("--precisions", help="comma-separated (default: %(leanopt.memory.plan:PLAN_PRECISIONS)s; bf16 = pure bf16, no master weights)")
    pl.add_argument("--roundings", help="rounding= of the pure-bf16 rows, comma-separated (default: %(leanopt.memory.plan:DEFAULT_ROUNDINGS)s); "
                    f"known: {', '.join(ROUNDINGS)}")  # fmt: skip
    pl.add_argument("--grad-release", choices=("off", "on", "both"), default="both",
                    help="rows with leanopt.release_gradients (optimizer step inside backward; leanopt's optimizers, one process)")  # fmt: skip
    pl.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="whose memory: cpu (the process's resident bytes) or cuda (torch.cuda.max_memory_allocated "
                    "on one GPU: the caching allocator's blocks, fused attention, CUDA autocast, the Triton kernels; "
                    "planned on the CPU, no GPU needed)")  # fmt: skip
    pl.add_argument("--accum", type=whole_number, default=1, help="micro-batches per optimizer step (gradient accumulation; "
                    "--batch is the micro-batch): the peak with gradients held across them")  # fmt: skip
    pl.add_argument("--no-process", action="store_true", help="skip process_bytes (the CPU's one-time costs are measured "
                    "once per model class, precision and optimizer in a subprocess, ~10-50 s, then cached): --budget is then compared "
                    "with the step's peak")  # fmt: skip
    pl.add_argument("--allocator", choices=["pinned", "glibc"], default="pinned",
                    help="what the CPU's process MB assume: pinned (default) for a training process that calls "
                    "leanopt.pin_allocator() first; glibc models glibc's default heap for one that changes nothing "
                    "(it keeps freed blocks: 18-32 %% more on the small models of docs/plan.md; one more trace per row, seconds each, then cached)")  # fmt: skip
    pl.add_argument("--offload", action="store_true", help="also rows with offload='cpu' (states and fp32 masters in host "
                    "memory: host MB; leanopt's optimizers, fp32 and pure bf16), ranked after the on-device rows")  # fmt: skip
    pl.add_argument("--json", action="store_true", help="print the rows as JSON")
    pl.set_defaults(run=cmd_plan, check=_check_plan)

    doc = sub.add_parser(
        "doctor",
        help="run real steps and say where the memory went",
        description="Build the model (random weights), train a few real steps of it on random input ids, measure "
        "the last step's peak (the profiler's memory events; the process's resident set or the CUDA allocator's "
        "statistics), attribute it to weights, gradients, optimizer state, master weights, activations, "
        "temporaries and runtime overhead, and show the plan beside each.",
    )
    doc.add_argument("model", help="a preset, a config.json or a folder with one, or a Hugging Face Hub id")
    doc.add_argument("--batch", type=whole_number, required=True, help="sequences per step")
    doc.add_argument("--seq", type=whole_number, required=True, help="tokens per sequence")
    doc.add_argument("--optimizer", default="adamw", help=f"one name (default adamw); known: {known}")
    doc.add_argument("--precision", choices=("fp32", "bf16-mixed", "bf16"), default="fp32",
                     help="fp32; bf16-mixed (autocast bf16 over fp32 weights); bf16 (the model in bf16)")  # fmt: skip
    doc.add_argument("--rounding", choices=ROUNDINGS, help="pure bf16: the optimizer's rounding= (default: its own)")
    doc.add_argument("--checkpointing", action="store_true", help="activation checkpointing on")
    doc.add_argument("--steps", type=int, default=3, help="steps to run; the last is measured (default 3)")
    doc.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    doc.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    doc.set_defaults(run=cmd_doctor, check=_check_doctor)

    ins = sub.add_parser(
        "inspect",
        help="what a saved optimizer state holds (optimizer.pt)",
        description="Bytes per state key and per param group of a saved optimizer state_dict, and whose "
        "it is: the optimizer leanopt's files declare in their param groups (\"optimizer\"), or, for "
        "peers' files, the one their state keys show. Loaded with torch.load(weights_only=True) on the CPU.",
    )
    ins.add_argument("file", help="optimizer.pt, or a checkpoint folder that holds one")
    ins.add_argument("--json", action="store_true", help="print JSON instead of tables")
    ins.set_defaults(run=cmd_inspect, check=_check_inspect)

    families = optimizer_families()
    conv = sub.add_parser(
        "convert",
        help="re-save a state for another optimizer of its family",
        description="Read a saved optimizer state_dict (e.g. a Trainer optimizer.pt, a DCP checkpoint folder) and "
        f"write it for another optimizer of the same family (the same rule): {', '.join('/'.join(f) for f in families.values() if len(f) > 1)}, "
        f"or for torch.optim.AdamW ({TORCH_ADAMW}) or torch.optim.Muon ({TORCH_MUON}). The source is the optimizer its param groups declare "
        "(\"optimizer\"); a file without one is read as the family its states show: torch.optim.AdamW, older "
        "leanopt files, torch.optim.Muon and KellerJordan's MuonWithAuxAdam, bitsandbytes' AdamW8bit/Lion8bit/AdEMAMix8bit and "
        "torchao's AdamW8bit/AdamW4bit (dequantized "
        "with their own code books and scales). The result declares --to and loads into it. Another family is refused.",
    )
    conv.add_argument("src", help="the optimizer state_dict to read: optimizer.pt, a folder holding one, or a "
                      "torch.distributed.checkpoint folder")  # fmt: skip
    conv.add_argument("dst", help="where to write the converted state_dict")
    conv.add_argument("--to", required=True, type=str.lower, choices=[*BUILTIN_OPTIMIZERS, TORCH_ADAMW, TORCH_MUON], metavar="NAME",
                      help=f"the optimizer to convert for, of the source's family; one of: {', '.join(BUILTIN_OPTIMIZERS)}, "
                      f"{TORCH_ADAMW} (plain torch.optim.AdamW state, from any AdamW-family file), {TORCH_MUON} "
                      "(torch.optim.Muon state, from a Muon-family file of Muon groups)")  # fmt: skip
    conv.add_argument("--rule", type=str.lower, choices=sorted(families), metavar="RULE",
                      help="the rule the source's states run where they do not say: bitsandbytes' one-state files "
                      "(Lion8bit and SGD8bit save the same keys): --rule lion")  # fmt: skip
    conv.add_argument("--block-size", type=int, help="elements per scale of a low-bit target (default: the class's, "
                      "256 for 8-bit, 128 for 4-bit)")
    conv.add_argument("--min-quant-size", type=int, default=4096, help="smaller params keep fp32 states (default 4096)")
    conv.add_argument("--state-dtype", type=str.lower, choices=["float32", "bfloat16"], default="float32", metavar="DTYPE",
                      help="the dtype of the target's dense states: float32 (default) or bfloat16 (the state_dtype= of "
                      "AdamW, Lion, AdEMAMix, SGD and their low-bit siblings' small params; rounded to nearest once, then "
                      "the optimizer rounds its own writes stochastically)")  # fmt: skip
    conv.add_argument("--force", action="store_true", help="overwrite DST if it exists")
    conv.set_defaults(run=cmd_convert, check=_check_convert)

    comp = sub.add_parser(
        "compare",
        help="train with each optimizer: memory, speed, loss",
        add_help=False,
        prefix_chars="\0",  # every argument goes to `leanopt.compare` unparsed
    )
    comp.add_argument("rest", nargs=argparse.REMAINDER)
    comp.set_defaults(run=cmd_compare)

    kern = sub.add_parser(
        "build-kernels",
        help="build the native CPU kernel now (else it builds in the background on first use)",
        description="Build (or load from the cache) the native CPU kernel of the low-bit optimizers, and say "
        "where it is: once per machine, ~9 s. Without it, the first training run builds it in the background.",
    )
    kern.set_defaults(run=cmd_build_kernels)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``leanopt`` and ``python -m leanopt``; returns the exit status."""
    try:
        parser = build_parser()
        args = parser.parse_args(_attach_dashed_values(parser, sys.argv[1:] if argv is None else list(argv)))
        if getattr(args, "check", None) is not None:
            args.check(args)
        return args.run(args)
    except SystemExit as exit_:  # --help
        return int(exit_.code or 0)
    except CliError as err:
        return _fail(str(err))
    except BrokenPipeError:  # `leanopt ... | head`: the reader left, nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (ValueError, OSError, ImportError) as err:
        return _fail(str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__)
    except KeyboardInterrupt:
        return 130
    except Exception as err:  # a bug, but the contract is one line and status 2
        return _fail(f"internal error: {type(err).__name__}: {err}".splitlines()[0])


def _attach_dashed_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``--budget -1GiB`` as ``--budget=-1GiB``: argparse takes a value that starts with '-' and is
    not a plain number for an option and answers "expected one argument"; attached, the value
    reaches its own check, which names what is wrong with it. Only for options that take one
    value, and only a value with a single leading '-' (``--budget --json`` stays as it is)."""
    takes_value = {opt for action in _all_actions(parser) if type(action) is argparse._StoreAction and action.nargs is None
                   for opt in action.option_strings}  # fmt: skip
    out: list[str] = []
    i = 0
    while i < len(argv):
        token, following = argv[i], argv[i + 1] if i + 1 < len(argv) else ""
        if token in takes_value and following.startswith("-") and not following.startswith("--") and len(following) > 1:
            out.append(f"{token}={following}")
            i += 2
        else:
            out.append(token)
            i += 1
    return out


def _all_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """Every action of ``parser`` and of its subcommands' parsers."""
    actions = list(parser._actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                actions += _all_actions(sub)
    return actions


def _fail(message: str) -> int:
    print(f"leanopt: error: {message}", file=sys.stderr)
    return 2


def _json(data: Any) -> str:
    """Strict JSON (``json.loads`` in any language reads it): NaN and infinities, which a saved
    state's options may hold, become the strings ``"nan"``, ``"inf"``, ``"-inf"``."""
    return json.dumps(_finite(data), indent=2, allow_nan=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "nan", "inf", "-inf": float() reads them back
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _quiet_peer_import_warnings() -> None:
    # Building transformers models imports torchao when installed; a torchao built for another
    # Python logs one warning per missing extension, which is noise on a CLI's stderr.
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    # A meta kernel that fails under fake tensors (a size that overflows at --seq 10^9) is logged
    # by torch with its traceback (24 lines) before it raises; plan reports it in one line.
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)
    _quiet_transformers()


# What transformers says about the models leanopt builds, not about the user's: plan turns
# activation checkpointing on itself ("`use_cache=True` is incompatible with gradient
# checkpointing. Setting `use_cache=False`", or "Caching is incompatible ..." in transformers 5),
# and a config without a loss_type gets "`loss_type=None` was set in the config but it is
# unrecognized" on the first loss. A config the user wrote (a token id outside the vocabulary)
# is still reported.
_NOT_THE_USERS = re.compile(r"incompatible with gradient checkpointing|`loss_type=None` was set in the config")


class _LeanoptsOwnModels(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not _NOT_THE_USERS.search(record.getMessage())


def _quiet_transformers() -> None:
    """Drop :data:`_NOT_THE_USERS` messages at transformers' own handler (the records come from
    its many module loggers, a logger's filter would see only its own)."""
    if importlib.util.find_spec("transformers") is None:
        return
    from transformers.utils import logging as hf_logging

    for handler in hf_logging.get_logger("transformers").handlers:
        if not any(isinstance(f, _LeanoptsOwnModels) for f in handler.filters):
            handler.addFilter(_LeanoptsOwnModels())


def _mb(nbytes: int | None) -> str:
    if nbytes is None:
        return "n/a"
    mb = nbytes / MiB
    return f"{mb:.1f}" if mb < 10 else f"{mb:,.0f}"


def _per_param(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value:.2f}" if value >= 0.1 or value == 0 else f"{value:.2g}"


# ---- estimate ------------------------------------------------------------------------------------
# ---- what is checked before torch is imported ---------------------------------------------------
def _named_optimizers(spec: str | None, option: str = "--optimizers") -> list[str] | None:
    """The names of a comma-separated option, each known (a one-line ValueError names one that is
    not); None when the option was not given."""
    if spec is None:
        return None
    names = [known_optimizer(n) for n in spec.split(",") if n.strip()]
    if not names:
        raise CliError(f"{option} is empty")
    return names


def _check_estimate(args: argparse.Namespace) -> None:
    _named_optimizers(args.optimizers)
    locate_model(args.model)


def _check_plan(args: argparse.Namespace) -> None:
    _named_optimizers(args.optimizers)
    if locate_model(args.model)[0] == "count":
        raise CliError(f"{args.model!r} is a bare parameter count: a plan needs the model (a preset, config.json or Hub id)")


def _check_doctor(args: argparse.Namespace) -> None:
    _named_optimizers(args.optimizer, "--optimizer")
    if locate_model(args.model)[0] == "count":
        raise CliError(f"{args.model!r} is a bare parameter count: the doctor builds the model (a preset, config.json or Hub id)")


def _saved_state(path: str, *, dcp: bool = False) -> None:
    """A saved optimizer state is there: a file, or a folder holding optimizer.pt (or, ``dcp``, a
    torch.distributed.checkpoint folder); the messages are the loader's own."""
    found = Path(path)
    if found.is_dir():
        if not ((found / "optimizer.pt").is_file() or (dcp and (found / ".metadata").is_file())):
            raise CliError(f"{found}: a folder without optimizer.pt")
    elif not found.is_file():
        raise CliError(f"{found}: no such file")


def _check_inspect(args: argparse.Namespace) -> None:
    _saved_state(args.file)


def _check_convert(args: argparse.Namespace) -> None:
    _saved_state(args.src, dcp=True)
    dst = os.fspath(args.dst)
    folder = os.path.dirname(dst) or "."
    if not os.path.isdir(folder):
        reason = "no such folder" if not os.path.exists(folder) else "not a folder:"
        raise CliError(f"cannot write {dst}: {reason} {folder}")
    if os.path.isdir(dst):
        raise CliError(f"cannot write {dst}: it is a folder")
    if os.path.exists(dst) and not args.force:
        raise CliError(f"{dst} exists (use --force to overwrite)")


def _optimizer_names(spec: str | None) -> list[str]:
    from leanopt.memory.estimate import OPTIMIZER_NAMES, available_optimizers, resolve_optimizer

    names = _named_optimizers(spec)
    if names is None:
        return [n for n in available_optimizers() if OPTIMIZER_NAMES[n].startswith("leanopt:")] + ["torch-adamw"]
    for name in names:
        resolve_optimizer(name)  # a one-line ValueError for a peer that is not installed
    return names


def _class_name(name: str) -> str:
    from leanopt.memory.estimate import resolve_optimizer

    cls = resolve_optimizer(name)
    module = "leanopt" if cls.__module__.startswith("leanopt.") else cls.__module__.replace("torch.optim._", "torch.optim.")
    module = "torch.optim" if module.startswith("torch.optim.") else module
    return f"{module}.{cls.__name__}"


def estimate_rows(source: ModelSource, names: list[str]) -> list[dict[str, Any]]:
    """One row per optimizer: state and the training totals per precision (None: unknown)."""
    from leanopt.memory.presets import shape_dependent
    from leanopt.memory.training import TRAINING_MODES, supports_training_modes, training_memory

    rows = []
    for name in names:
        row: dict[str, Any] = {"name": name, "class": _class_name(name)}
        if not source.exact_shapes and shape_dependent(name):
            row.update(state_bytes=None, state_elements=None, bytes_per_param=None, by_key=None, training=None,
                       training_grad_release=None, training_offload=None)
        else:
            per_precision: dict[str, TrainingMemory] = {
                p: training_memory(source.params, name, precision=p) for p in ("fp32", "bf16-mixed", "bf16")
            }
            state = per_precision["fp32"].state
            training: dict[str, Any] = {p: m.as_dict() for p, m in per_precision.items()}
            released: dict[str, Any] = {}
            lean = supports_training_modes(name)
            for precision, rounding in TRAINING_MODES:
                key = _mode_key(precision, rounding)
                kwargs: dict[str, Any] = {"rounding": rounding} if rounding else {}  # optimizer keywords, as training_memory's
                if key not in training:  # bf16-stochastic, bf16-kahan: leanopt's optimizers only
                    training[key] = training_memory(source.params, name, precision=precision, **kwargs).as_dict() if lean else None
                # Release keeps the largest param's gradient: a bare count has no params to tell it.
                released[key] = (
                    training_memory(source.params, name, precision=precision, grad_release=True, **kwargs).as_dict()
                    if lean and source.exact_shapes else None
                )
            row.update(
                state_bytes=state.bytes,
                state_elements=state.elements,
                bytes_per_param=round(state.bytes_per_param, 6),
                by_key=dict(state.by_key),
                training=training,
                training_grad_release=released,
                training_offload=_offload_modes(source, name) if lean and source.exact_shapes else None,
                with_momentum=_with_momentum(source, name) if state.bytes == 0 else None,
            )
        rows.append(row)
    return rows


WITH_MOMENTUM = 0.9  # what the note under estimate's table shows for an optimizer whose default keeps no state


def _label(row: dict[str, Any]) -> str:
    """The optimizer's name, with the default its row assumes where that default keeps no state."""
    return f"{row['name']} (m=0)" if row.get("with_momentum") else row["name"]


def _with_momentum(source: ModelSource, name: str) -> dict[str, Any] | None:
    """The state of an optimizer whose defaults keep none (SGD's ``momentum=0``, torch's default)
    with ``momentum=0.9``: what it keeps as usually run. None for one without a ``momentum``."""
    import inspect

    from leanopt.memory.estimate import estimate, resolve_optimizer

    if "momentum" not in inspect.signature(resolve_optimizer(name)).parameters:
        return None
    state = estimate(source.params, name, momentum=WITH_MOMENTUM)
    return {"momentum": WITH_MOMENTUM, "state_bytes": state.bytes, "bytes_per_param": round(state.bytes_per_param, 6)}


OFFLOAD_MODES = (("fp32", False), ("bf16", False), ("fp32", True), ("bf16", True))


def _offload_modes(source: ModelSource, name: str) -> dict[str, Any]:
    """``offload="cpu"`` (leanopt's optimizers; params with shapes: the host gradient buffers are
    the largest params' or chunks'): device bytes (``total``) and ``host_bytes``, per precision,
    without and with gradient release."""
    from leanopt.memory.training import training_memory

    return {
        precision + ("-grad-release" if release else ""): training_memory(
            source.params, name, precision=precision, grad_release=release, offload=True
        ).as_dict()
        for precision, release in OFFLOAD_MODES
    }


def _mode_key(precision: str, rounding: str | None) -> str:
    """The key of a training mode in ``estimate --json``: ``fp32``, ``bf16-mixed``, ``bf16`` (nearest
    rounding, as before there were others), ``bf16-stochastic``, ``bf16-kahan``."""
    return precision if rounding in (None, "nearest") else f"{precision}-{rounding}"


def cmd_estimate(args: argparse.Namespace) -> int:
    from leanopt.memory.presets import resolve_model

    names = _optimizer_names(args.optimizers)
    _quiet_peer_import_warnings()
    source = resolve_model(args.model)
    rows = estimate_rows(source, names)
    if args.json:
        print(_json(
            {
                "model": source.name,
                "description": source.description,
                "params": source.param_count,
                "tensors": source.tensors,
                "exact_shapes": source.exact_shapes,
                "megabytes_are": "MiB (1024**2 bytes)",
                "optimizers": rows,
            }
        ))
        return 0

    console = _console()
    tensors = f" in {source.tensors:,} tensors" if source.tensors is not None else ""
    console.print(f"[bold]{source.name}[/bold]: {source.description}")
    console.print(f"{source.param_count:,} trainable parameters{tensors}")
    table = new_table()  # headers short enough for 80 columns; NOTES says what they are
    table.add_column("optimizer")
    table.add_column("class")
    table.add_column("state", justify="right")
    table.add_column("B/param", justify="right")
    for precision in TABLE_PRECISIONS:
        table.add_column(precision, justify="right")
    for row in rows:
        training = row["training"] or {}
        table.add_row(
            _label(row),
            row["class"],
            _mb(row["state_bytes"]),
            _per_param(row["bytes_per_param"]),
            *(_mb(training[p]["total"]) if training else "n/a" for p in TABLE_PRECISIONS),
        )
    print_table(console, table)
    note = NOTES
    stateless = [row for row in rows if row.get("with_momentum")]
    if stateless:
        figures = ", ".join(f"{row['name']} {_per_param(row['with_momentum']['bytes_per_param'])} B/param "
                            f"({_mb(row['with_momentum']['state_bytes'])} MB)" for row in stateless)  # fmt: skip
        note += f" (m=0): momentum=0, SGD's default as torch's, keeps no state; with momentum={WITH_MOMENTUM:g}: {figures}."
    if not source.exact_shapes:
        unknown = [_class_name(row["name"]).removeprefix("leanopt.") for row in rows if row["state_bytes"] is None]
        note += " A bare count has no shapes: one 1-D tensor is assumed."
        if unknown:
            note += f" n/a: the state depends on matrix shapes ({', '.join(unknown)})."
    console.print(note, style="dim", highlight=False)
    _print_modes(console, rows, source.exact_shapes)
    return 0


def _print_modes(console: Console, rows: list[dict[str, Any]], exact_shapes: bool) -> None:
    """Training memory of every mode (columns) for every optimizer (rows): one table without
    gradient release, one with it (a row per optimizer keeps 80 columns whatever the count)."""
    from leanopt.memory.training import TRAINING_MODES

    keys = [_mode_key(precision, rounding) for precision, rounding in TRAINING_MODES]
    for released in (False, True) if exact_shapes else (False,):
        title = "training MB by mode, with grad release" if released else "training MB by mode"
        modes = new_table(title)
        modes.add_column("optimizer")
        for key in keys:
            modes.add_column(key, justify="right")
        for row in rows:
            table = row.get("training_grad_release" if released else "training") or {}
            modes.add_row(_label(row), *(_mb(table[k]["total"]) if table.get(k) else "n/a" for k in keys))
        console.print()
        print_table(console, modes)
    if any(row.get("training_offload") for row in rows):
        modes = new_table("training MB with offload='cpu': device / host")
        modes.add_column("optimizer")
        for precision, release in OFFLOAD_MODES:
            modes.add_column(precision + (" release" if release else ""), justify="right")
        for row in rows:
            table = row.get("training_offload") or {}
            cells = []
            for precision, release in OFFLOAD_MODES:
                value = table.get(precision + ("-grad-release" if release else ""))
                cells.append(f"{_mb(value['total'])} / {_mb(value['host_bytes'])}" if value else "n/a")
            modes.add_row(_label(row), *cells)
        console.print()
        print_table(console, modes)
        console.print("offload: device = weights and gradients (released: the largest param's); host = host copies "
                      "(fp32 masters of bf16 params), states and host gradient buffers (released: one per param).",
                      style="dim", highlight=False)  # fmt: skip
    note = MODE_NOTES
    if not exact_shapes:
        note += " A bare count has no largest param: no grad release table (name a preset or a config)."
    console.print(note, style="dim", highlight=False)


# ---- inspect -------------------------------------------------------------------------------------
_SHOWN_OPTIONS = ("lr", "betas", "beta1", "eps", "weight_decay")


def _split(text: str | None, what: str) -> list[str] | None:
    if text is None:
        return None
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError(f"--{what} is empty")
    return items


def _mib(nbytes: int) -> str:
    mb = nbytes / 2**20
    return f"{mb:.1f}" if mb < 10 else f"{mb:,.0f}"


# plan's breakdown columns: short headers (the legend under the table gives the kinds' names).
PLAN_HEADERS = {"gradients": "grads", "optimizer_state": "state", "activations": "activ."}


class _MeasuringOnStderr:
    """The planner's measuring (the ``leanopt.memory`` loggers' INFO lines: what a first plan of a
    model measures, each setup as it is done, that it is cached) shown on stderr while inside."""

    def __enter__(self) -> None:
        self.logger = logging.getLogger("leanopt.memory")
        self.level = self.logger.level
        self.handler = logging.StreamHandler(sys.stderr)
        self.handler.setFormatter(logging.Formatter("%(message)s"))
        self.logger.addHandler(self.handler)
        self.logger.setLevel(logging.INFO)

    def __exit__(self, *exc: object) -> None:
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.level)


def _flops(n: float) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:,.0f} FLOP"


def _newton_schulz_lines(rows: list[Any]) -> list[str]:
    """One line per distinct Newton-Schulz cost among ``rows`` (Muon's): its FLOPs per step beside
    the model's forward and backward."""
    from leanopt.memory.plan import FLOPS_PER_PARAM_TOKEN

    by_cost: dict[Any, list[str]] = {}
    for r in rows:
        if r.newton_schulz is not None:
            names = by_cost.setdefault(r.newton_schulz, [])
            if r.optimizer not in names:
                names.append(r.optimizer)
    return [f"Newton-Schulz ({', '.join(names)}): {_flops(c.flops)} per step, {100 * c.share:.1f} % of the model's forward+backward "
            f"({_flops(c.model_flops)}: {FLOPS_PER_PARAM_TOKEN} x {c.params:,} trainable params x {c.tokens:,} tokens)"
            for c, names in by_cost.items()]  # fmt: skip


def cmd_plan(args: argparse.Namespace) -> int:
    """``leanopt plan``: a table ranked by precision kept (or ``--json``); errors are ValueErrors."""
    if sys.stderr.isatty():  # at once, for the one watching (a script's stderr keeps its one-line errors)
        print(f"leanopt plan: tracing a training step of {args.model} per setup on fake tensors (nothing is allocated)",
              file=sys.stderr, flush=True)  # fmt: skip
    from leanopt.memory.plan import KINDS, nothing_fits, parse_bytes, plan, recommend

    _quiet_peer_import_warnings()
    try:
        budget = parse_bytes(args.budget) if args.budget is not None else None
    except OverflowError:  # more digits than a float holds: float("9" * 400) is inf
        shown = args.budget if len(args.budget) <= 24 else args.budget[:21] + "..."
        raise CliError(f"--budget {shown}: too large a number (24GiB, 500MiB or a number of bytes)") from None
    with _MeasuringOnStderr():
        rows = plan(
            args.model,
            batch=args.batch,
            seq=args.seq,
            budget=budget,
            gpus=args.gpus,
            optimizers=_split(args.optimizers, "optimizers"),
            precisions=_split(args.precisions, "precisions"),
            roundings=_split(args.roundings, "roundings"),
            grad_release={"off": [False], "on": [True], "both": [False, True]}[args.grad_release],
            device=args.device,
            accum=args.accum,
            process=not args.no_process,
            offload=args.offload,
            allocator=args.allocator,
        )
    if args.json:
        print(_json([r.as_dict() for r in rows]))
        return 0
    console = _console()
    whose = "one GPU's torch.cuda.max_memory_allocated" if args.device == "cuda" else "the process's resident memory"
    accum = f" x {args.accum} micro-batches" if args.accum > 1 else ""
    console.print(f"[bold]{args.model}[/bold]: one training step at batch {args.batch}{accum}, seq {args.seq}, peak of {whose} "
                  "per setup (MB = MiB)", highlight=False)  # fmt: skip
    # Short headers (PLAN_HEADERS, explained under the table) and the verdict beside the peaks: a
    # narrow terminal gets the setup, the peaks and the verdict first, then the breakdown.
    table = new_table()
    left = ("optimizer", "precision", "ckpt", "release")
    compared = "process" if any(r.compared == "process_bytes" for r in rows) else "step"
    budget_title = ["fits"] if budget is not None else []
    host_title = ["host MB"] if args.offload else []  # offloaded rows' host_bytes; "-": on the device
    for title in (*left, "step MB", "process MB", *host_title, *budget_title, *(PLAN_HEADERS.get(k, k.replace("_", " ")) for k in KINDS)):
        table.add_column(title, justify="left" if title in left else "center" if title in budget_title else "right")
    for r in rows:
        process = "-" if r.process_bytes is None else _mib(r.process_bytes)
        cells = [r.optimizer, _precision(r), "on" if r.checkpointing else "off", "on" if r.grad_release else "off",
                 _mib(r.peak_bytes), process]  # fmt: skip
        if args.offload:
            cells.append("-" if r.host_bytes is None else _mib(r.host_bytes))
        if budget is not None:
            cells.append(("[green]✔[/green]" if r.fits else "[red]✘[/red]") + ("" if r.compared == "process_bytes" else " (step)"))
        table.add_row(*cells, *(_mib(r.breakdown[k]) for k in KINDS))
    print_table(console, table, keys=len(left))
    console.print("step MB = " + " + ".join(PLAN_HEADERS.get(k, k) + (f" ({k.replace('_', ' ')})" if k in PLAN_HEADERS else "")
                                            for k in KINDS), style="dim", highlight=False)  # fmt: skip
    for line in _newton_schulz_lines(rows):
        console.print(line, highlight=False)
    in_step = [r for r in rows if r.peak_in == "optimizer step"]
    if in_step:
        rounded = [r.breakdown["other"] for r in in_step if r.rounding in ("kahan", "stochastic")]
        console.print(f"{len(in_step)} of {len(rows)} rows peak in optimizer.step(), after backward has freed the activations: "
                      "activ. is 0 there, and checkpointing does not lower such a peak" + (
                          f"; pure bf16 with kahan or stochastic rounding steps each param through fp32 copies (other: up to "
                          f"{_mib(max(rounded))} MB, for the largest param)" if rounded else ""), style="dim", highlight=False)  # fmt: skip
    if budget is not None:
        unknown = [r for r in rows if r.compared != "process_bytes"]
        said = (f"fits: {compared} MB ≤ the --budget of {_mib(budget)} MB. "
                "budget compared with process MB (step MB, the step's peak, + what the process needs besides: "
                + ("the CUDA context, cuBLAS's workspace, the allocator's segments" if args.device == "cuda"
                   else "the one-time costs of a first step, measured once and cached") + ")")  # fmt: skip
        if unknown:
            said += f"; with the step's peak where process MB is unknown ({unknown[0].process_source})"
        console.print(said, highlight=False)
    elif rows and rows[0].process_source:
        console.print(f"process MB: {rows[0].process_source}", style="dim", highlight=False)
    best = recommend(rows)
    if budget is None:
        line = "no --budget: nothing to check against"
    elif best is None:
        line = nothing_fits(rows, budget, batch=args.batch, seq=args.seq, device=args.device)
    else:
        line = (f"recommended: {best.optimizer}, {_precision(best)}, activation checkpointing "
                f"{'on' if best.checkpointing else 'off'}, gradient release {'on' if best.grad_release else 'off'} "
                f"({_mib(best.peak_bytes)} MB step peak, {'?' if best.process_bytes is None else _mib(best.process_bytes)} MB process)")  # fmt: skip
        if best.offload:
            host = best.host_bytes  # set on every offloaded row; "?" as for process_bytes if not
            line += (f", offload='cpu': nothing fits on the device without it ({'?' if host is None else _mib(host)} MB of host memory for "
                     "states, fp32 masters and gradient buffers)")  # fmt: skip
    console.print(line, highlight=False)
    if args.offload:
        console.print("host MB: rows with offload='cpu' (host copies, fp32 masters of bf16 params, states, host gradient "
                      "buffers); their step MB is the device's" + (" (on the CPU the same memory: fits counts both)"
                      if args.device == "cpu" else ""), style="dim", highlight=False)  # fmt: skip
    kernels = "CUDA kernels (--device cuda)" if args.device == "cuda" else "CPU kernels (GPU memory: --device cuda)"
    console.print(f"MB = MiB. Second step's peak (state exists), {kernels}, docs/plan.md; "
                  "--gpus N: rank 0's peak under FSDP2 (fp32 and bf16-mixed, no release). bf16 = pure bf16 with the "
                  "optimizer's rounding; release: leanopt.release_gradients (no grad clipping or accumulation).",
                  style="dim", highlight=False)  # fmt: skip
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    """``leanopt doctor``: build the model, run real steps, print the attributed table."""
    from leanopt.memory.doctor import CATEGORIES, build_and_diagnose, render

    _quiet_peer_import_warnings()
    with _MeasuringOnStderr():  # the plan beside it may measure a first step's costs
        d = build_and_diagnose(args.model, batch=args.batch, seq=args.seq, optimizer=args.optimizer, precision=args.precision,
                               rounding=args.rounding, checkpointing=args.checkpointing, steps=args.steps, device=args.device)  # fmt: skip
    if args.json:
        print(_json(d.as_dict()))
        return 0
    print(f"{args.model}: {args.optimizer}, {args.precision}{' ' + args.rounding if args.rounding else ''}, checkpointing "
          f"{'on' if args.checkpointing else 'off'}, batch {args.batch}, seq {args.seq}, {d.steps} steps on {d.device} "
          f"(the last measured; MiB)")  # fmt: skip
    for line in render(d):
        print(line)
    for line in d.explanations:
        print(f"- {line}")
    print(f"({d.plan_note}; measured: {d.method}; categories: {', '.join(CATEGORIES)})")
    return 0


def _precision(row: Any) -> str:
    return f"{row.precision} {row.rounding}" if row.rounding else row.precision


def cmd_inspect(args: argparse.Namespace) -> int:
    from leanopt.memory.inspect import inspect_file

    _quiet_peer_import_warnings()
    report = inspect_file(args.file)
    if args.json:
        print(_json({"file": str(args.file), **report.as_dict()}))
        return 0
    _print_report(_console(), str(args.file), report)
    return 0


def _family_note(name: str) -> str:
    """``" (convert --to: lion, lion8bit, lion4bit)"`` for a registered name with siblings."""
    from leanopt.checkpoint import family_members

    try:
        members = family_members(name)
    except ValueError:  # declared by a leanopt that knows more optimizers than this one
        return " (not in this version's registry)"
    return f" (convert --to: {', '.join(members)})" if len(members) > 1 else ""


def cmd_convert(args: argparse.Namespace) -> int:
    import torch

    from leanopt.checkpoint import check_loads, convert_checkpoint
    from leanopt.checkpoint_files import read_checkpoint
    from leanopt.memory.inspect import inspect_file, inspect_state_dict

    dst = os.fspath(args.dst)  # checked before the (possibly long) conversion: _check_convert
    # One-line errors for missing / non-optimizer / hostile files; torchao and DCP read without their code.
    state_dict = read_checkpoint(args.src)
    before_bytes = inspect_state_dict(state_dict).bytes
    # A state of another family (lion8bit -> adamw), an entry that is not its param's: one line
    # naming the file and the entry. The written file must load into --to before it becomes DST.
    try:
        done = convert_checkpoint(state_dict, args.to, block_size=args.block_size, min_quant_size=args.min_quant_size,
                                  rule=args.rule, state_dtype=args.state_dtype)  # fmt: skip
        write_atomically(dst, lambda f: torch.save(done.state_dict, f),
                         check=lambda tmp: check_loads(torch.load(tmp, weights_only=True, mmap=True), done.target, done.shapes))  # fmt: skip
    except ValueError as err:
        raise CliError(f"{args.src}: {err}") from None
    after = inspect_file(dst)
    before = done.source if done.read_as == done.source else f"{done.read_as}, as {done.source}"
    print(f"{args.src} ({before}, {_mb(before_bytes)} MB of state) -> {dst} ({after.optimizer or done.target}, "
          f"{_mb(after.bytes)} MB of state)")  # fmt: skip
    for note in done.notes:
        print(f"note: {note}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from leanopt.compare import main as compare_main

    # compare checks its own arguments (--lr, --steps, --out) before any training starts.
    return compare_main([a for a in args.rest if a != "--"])


def cmd_build_kernels(args: argparse.Namespace) -> int:
    from leanopt.kernels import cpu_native

    quiet = logging.getLogger("leanopt")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # the cause is this command's one line, not a warning too
    try:
        seconds = cpu_native.build()
    except RuntimeError as err:
        raise CliError(str(err)) from None
    finally:
        quiet.setLevel(level)
    avx = "AVX-512 loops" if cpu_native.vectorized() else "portable loops"
    print(f"native CPU kernel ready ({avx}) in {seconds:.1f} s: {cpu_native.build_folder()}")
    return 0


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, list):
        return "(" + ", ".join(_short(v) for v in value) + ")"
    return str(value)


def _print_report(console: Console, file: str, r: StateDictReport) -> None:
    console.print(f"[bold]{file}[/bold]: {r.layout}", highlight=False)
    if r.optimizer is not None:
        console.print(f"declared optimizer: {r.optimizer}{_family_note(r.optimizer)}", style="dim", highlight=False)
    elif r.complete:
        console.print("no declared optimizer: recognized from its state keys and options", style="dim", highlight=False)
    if not r.complete:
        console.print(f"tensor data: {r.bytes:,} bytes ({_mb(r.bytes)} MB); no per-key breakdown without loading its classes")
        return
    elements = f", {r.param_elements:,} param elements" if r.param_elements else ""
    per_param = f", {_per_param(r.bytes_per_param)} B/param" if r.bytes_per_param else ""
    # Two lines: what the file holds, then what it weighs (one line was 101 columns for a small file).
    console.print(f"{r.params:,} param tensors in {len(r.groups)} group{'s' if len(r.groups) != 1 else ''} ({r.params_with_state:,} with state{elements})")
    console.print(f"state: {r.bytes:,} bytes ({_mb(r.bytes)} MB){per_param}")
    if r.formats:
        console.print(f"quantized formats: {', '.join(r.formats)}")
    keys = new_table()
    for title in ("state key", "dtype", "elements", "bytes", "MB (MiB)"):
        keys.add_column(title, justify="left" if title in ("state key", "dtype") else "right")
    for key, nbytes in r.by_key.items():
        keys.add_row(key, ", ".join(r.dtypes_by_key.get(key, [])), f"{r.elements_by_key.get(key, 0):,}", f"{nbytes:,}", f"{nbytes / MiB:,.2f}")
    print_table(console, keys)
    if r.formats:
        console.print("elements: each state's own; a quantized state has one per param element (its codes and block "
                      "scales are in bytes)", style="dim", highlight=False)  # fmt: skip
    groups = new_table()
    for title in ("group", "params", "MB (MiB)", "options"):  # options: free text, may wrap at its spaces
        groups.add_column(title, justify="left" if title == "options" else "right",
                          overflow="fold" if title == "options" else "ellipsis")  # fmt: skip
    for gi, g in enumerate(r.groups):
        shown = ", ".join(f"{k}={_short(g['options'][k])}" for k in _SHOWN_OPTIONS if k in g["options"])
        groups.add_row(str(gi), f"{g['params']:,}", f"{g['bytes'] / MiB:,.2f}", shown)
    print_table(console, groups)
