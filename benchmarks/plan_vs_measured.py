"""``leanopt plan``'s predicted peak against a real training step on this machine.

    python benchmarks/plan_vs_measured.py                 # the table in docs/plan.md (~75 min)
    python benchmarks/plan_vs_measured.py --sets bf16     # only the pure-bf16 rows (base, bf16, release)
    python benchmarks/plan_vs_measured.py --cases small   # the tiny models tests/test_plan.py uses
    python benchmarks/plan_vs_measured.py --gpus 2        # FSDP2 over 2 gloo ranks: per-rank peaks

A configuration is (optimizer, precision, checkpointing[, rounding[, release]]): pure ``bf16`` is
the model in bf16 with the optimizer built with ``rounding=``; release is
``leanopt.release_gradients(model, optimizer)`` around the same loop.

Each configuration runs in a fresh process (``MALLOC_MMAP_THRESHOLD_=65536``: glibc serves every
block of 64 KiB and more with its own mmap, so a freed tensor leaves the resident set at once):

1. warm-up: a forward, backward and two optimizer steps on a one-layer model of the same
   architecture, same precision, checkpointing, optimizer, rounding and release (thread pools,
   oneDNN, the optimizer compiling its update: one-time set-up, as ``leanopt compare`` puts it in
   the baseline); the kernels' scratch buffers it leaves (Adafactor's) are dropped: the measured
   model makes its own;
2. baseline: the anonymous resident memory (``RssAnon``);
3. the model is built (random weights, train mode), two steps are run, the kernel's high-water
   mark is reset (``/proc/self/clear_refs``), the third step is run;
4. measured = ``VmHWM`` − file-backed RSS − baseline: the peak of the third step over the memory
   before the model was built.

The figures of docs/plan.md are measured so. ``measure_cases(..., warmup_steps=1, measured_step=2)``
(what the tests use, to halve the bf16 matmuls of a CPU without bf16 instructions) warms up on one
step and measures the second: on the twelve small configurations of tests/test_plan.py, within
0.7 % of the above (2026-12-05).

Predicted = ``leanopt.memory.plan.plan(...)`` for the same configuration.

``--gpus N`` (N > 1): one ``torchrun --nproc_per_node N`` launch (gloo, CPU, one thread per rank)
per model runs its configurations one after the other; on every rank, as above, with the process
group initialized before the warm-up (gloo's fixed costs are in the baseline) and the model
sharded as ``plan`` plans it (``fully_shard`` on each transformer block, then the root; the batch
per rank = ``batch``). Each rank's measured peak is printed beside rank 0's prediction
(``plan(..., gpus=N)``; every rank's shards are padded to the same size).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from typing import Any

CASES = {
    # name: (preset, batch, seq, [(optimizer, precision, checkpointing)])
    "distilbert": ("distilbert-base-cased", 8, 128),
    "gpt2": ("gpt2", 4, 256),
}
# (optimizer, precision, checkpointing[, rounding of pure bf16[, gradient release]])
CONFIGS = [("adamw", "fp32", False), ("adamw8bit", "bf16-mixed", False), ("adafactor", "fp32", False), ("adamw", "fp32", True)]
BF16_CONFIGS = [("adamw", "bf16", False, "kahan"), ("adamw", "bf16", False, "stochastic"), ("adamw8bit", "bf16", False, "kahan"),
                ("adafactor", "bf16", False, "kahan"), ("adafactor", "bf16", False, "stochastic"), ("adamw", "bf16", True, "kahan")]
RELEASE_CONFIGS = [("adamw", "fp32", False, None, True), ("adamw8bit", "bf16-mixed", False, None, True),
                   ("adafactor", "fp32", False, None, True), ("adamw", "fp32", True, None, True),
                   ("adamw", "bf16", False, "kahan", True), ("adamw", "bf16", True, "stochastic", True)]
SETS = {"base": CONFIGS, "bf16": BF16_CONFIGS, "release": RELEASE_CONFIGS}
DIST_CONFIGS = [("adamw", "fp32", False), ("adafactor", "fp32", False), ("adamw8bit", "fp32", False),
                ("adamw8bit", "bf16-mixed", False), ("adamw", "fp32", True)]

# A few MB each: what tests/test_plan.py runs.
_TINY_DISTILBERT = ("DistilBertForSequenceClassification", "DistilBertConfig",
                    {"vocab_size": 8000, "dim": 256, "n_layers": 2, "n_heads": 4, "hidden_dim": 1024,
                     "max_position_embeddings": 256, "num_labels": 2})
_TINY_GPT2 = ("GPT2LMHeadModel", "GPT2Config", {"vocab_size": 8000, "n_positions": 256, "n_embd": 256, "n_layer": 2, "n_head": 4})
_NARROW_DISTILBERT = (*_TINY_DISTILBERT[:2], {**_TINY_DISTILBERT[2], "dim": 128, "hidden_dim": 512})
_NARROW_GPT2 = (*_TINY_GPT2[:2], {**_TINY_GPT2[2], "n_embd": 128})
SMALL = {
    "tiny-distilbert": (*_TINY_DISTILBERT, 16, 128),
    "tiny-gpt2": (*_TINY_GPT2, 8, 128),
    # Fewer sequences, for the bf16 and bf16-mixed steps: a CPU without bf16 matrix instructions
    # (AVX2) runs a bf16 matmul 40-100x slower than an fp32 one.
    "tiny-distilbert-4seq": (*_TINY_DISTILBERT, 4, 128),
    "tiny-gpt2-2seq": (*_TINY_GPT2, 2, 128),
    # Half as wide, for Muon: its Newton-Schulz iterations are bf16 matmuls, 1/8 of the FLOPs.
    "narrow-distilbert": (*_NARROW_DISTILBERT, 16, 128),
    "narrow-gpt2": (*_NARROW_GPT2, 8, 128),
    "narrow-gpt2-2seq": (*_NARROW_GPT2, 2, 128),  # Muon8bit bf16-mixed: its matmuls are bf16
    # One short sequence: the optimizer's step, not backward, is the peak (Muon's Newton-Schulz
    # temporaries are in the figure compared).
    "narrow-distilbert-step": (*_NARROW_DISTILBERT, 1, 8),
}  # fmt: skip


def full_config(config: tuple) -> tuple[str, str, bool, str | None, bool]:
    """(optimizer, precision, checkpointing[, rounding[, release]]) with the defaults filled in."""
    optimizer, precision, ckpt, *rest = config
    rounding = rest[0] if rest else None
    release = bool(rest[1]) if len(rest) > 1 else False
    return optimizer, precision, bool(ckpt), rounding, release


def offloaded(config: tuple) -> bool:
    """A configuration's sixth item: ``offload="cpu"`` (default False)."""
    return bool(config[5]) if len(config) > 5 else False


def _encode(config: tuple) -> str:
    optimizer, precision, ckpt, rounding, release = full_config(config)
    return f"{optimizer}:{precision}:{int(ckpt)}:{rounding or ''}:{int(release)}:{int(offloaded(config))}"


def _decode(text: str) -> tuple[str, str, bool, str | None, bool]:
    optimizer, precision, ckpt, rounding, release = (text.split(":") + ["", "0"])[:5]
    return optimizer, precision, ckpt == "1", rounding or None, release == "1"


def _decode_offload(text: str) -> bool:
    return (text.split(":") + ["", "0", "0"])[5] == "1"


def _status_kib() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if rest.strip().endswith("kB"):
                out[key] = int(rest.split()[0])
    return out


def model_spec(case: str) -> tuple[str, str, dict[str, Any], int, int]:
    """(model class, config class, config values, batch, seq) of a case."""
    if case in SMALL:
        return SMALL[case]
    from leanopt.memory.presets import PRESETS

    preset, batch, seq = CASES[case]
    p = PRESETS[preset]
    return p.model_class, p.config_class, dict(p.config), batch, seq


def build(case: str, *, tiny: bool = False) -> Any:
    import transformers

    model_class, config_class, values, _, _ = model_spec(case)
    values = dict(values)
    if tiny:  # the warm-up's model: the same code paths, one layer
        for key in ("n_layers", "n_layer", "num_hidden_layers"):
            if key in values:
                values[key] = 1
    config = getattr(transformers, config_class)(**values)
    return getattr(transformers, model_class)(config)


def step_fn(model: Any, optimizer: Any, precision: str, batch: int, seq: int, device: str = "cpu") -> Any:
    """One training step, as ``plan`` plans it, on ``device`` (``"cpu"``, or ``"cuda"`` for
    ``leanopt.memory.plan_check``). Under ``leanopt.release_gradients`` the optimizer steps
    inside ``backward`` and ``step()``/``zero_grad()`` are no-ops: the same loop runs."""
    import torch

    vocab = model.config.vocab_size
    input_ids = torch.randint(0, vocab, (batch, seq), device=device)
    if type(model).__name__.endswith("ForSequenceClassification"):
        labels = torch.randint(0, model.config.num_labels, (batch,), device=device)
    else:
        labels = input_ids

    def step() -> None:
        with torch.autocast(device, dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def prepare(model: Any, optimizer: str, precision: str, checkpointing: bool, *, sharded: bool = False,
            rounding: str | None = None, release: bool = False, offload: bool = False) -> Any:
    import warnings

    import torch

    from leanopt.memory.estimate import resolve_optimizer
    from leanopt.memory.plan_model import over_model

    if precision == "bf16":
        model.to(torch.bfloat16)
    model.train()
    if checkpointing:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    if sharded:
        from leanopt.memory.plan_fsdp import shard_blocks

        shard_blocks(model)
    kwargs = {"rounding": rounding} if rounding else {}
    if offload:
        kwargs["offload"] = "cpu"
    cls = resolve_optimizer(optimizer)
    opt = cls(over_model(cls, model), **kwargs)  # Muon: its groups of the model
    if release:
        import leanopt

        opt._leanopt_release = leanopt.release_gradients(model, opt)  # kept alive with the optimizer
    return opt


def worker(case: str, optimizer: str, precision: str, checkpointing: bool, *, sharded: bool = False,
           rounding: str | None = None, release: bool = False, offload: bool = False, warmup_steps: int = 2,
           measured_step: int = 3) -> int:
    """Run in a fresh process: the measured peak of step ``measured_step`` (after ``warmup_steps``
    on the one-layer model), in bytes (``sharded``: this rank's, under FSDP2, in an initialized
    process group)."""
    import gc

    import torch

    from leanopt.compare.meter import use_mmap_for_large_blocks

    use_mmap_for_large_blocks()  # as MALLOC_MMAP_THRESHOLD_=65536, also where the variable is not read
    torch.manual_seed(0)
    _, _, _, batch, seq = model_spec(case)
    # 1. warm-up on a small model of the same architecture
    tiny = build(case, tiny=True)
    opt = prepare(tiny, optimizer, precision, checkpointing, sharded=sharded, rounding=rounding, release=release, offload=offload)
    warm = step_fn(tiny, opt, precision, batch, seq)
    for _ in range(warmup_steps):
        warm()
    _unrelease(opt)
    del tiny, opt, warm
    _drop_kernel_workspaces()
    gc.collect()
    barrier = _barrier if sharded else lambda: None
    barrier()
    # 2. baseline
    base = _status_kib()["RssAnon"]
    # 3. the model, the steps before the measured one, reset the high-water mark, the measured step
    model = build(case)
    opt = prepare(model, optimizer, precision, checkpointing, sharded=sharded, rounding=rounding, release=release, offload=offload)
    step = step_fn(model, opt, precision, batch, seq)
    for _ in range(measured_step - 1):
        step()
    gc.collect()
    barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    step()
    s = _status_kib()
    file_backed = s.get("RssFile", 0) + s.get("RssShmem", 0)
    _unrelease(opt)
    del model, opt, step
    gc.collect()
    return (s["VmHWM"] - file_backed - base) * 1024


def _drop_kernel_workspaces() -> None:
    """The CPU kernels keep scratch buffers between steps (Adafactor's row blocks: up to 4 MiB a
    slot), per thread and for the whole process. The warm-up model's would serve the measured
    model and sit in the baseline (the measured peak was then 3-4 MiB under the trace for every
    Adafactor row); dropped, the measured model makes its own, as the first model of a process does."""
    from leanopt.kernels import cpu

    workspaces = getattr(cpu, "_workspaces", None)
    if workspaces is not None:
        workspaces.__dict__.pop("pool", None)


def _unrelease(opt: Any) -> None:
    handle = getattr(opt, "_leanopt_release", None)
    if handle is not None:
        handle.remove()


def _barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def dist_worker(case: str, configs: list[str]) -> None:
    """Under torchrun: every rank measures each configuration; rank 0 prints [[rank 0, rank 1, ...], ...]."""
    import datetime

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    torch.set_num_threads(1)
    measured = []
    for config in configs:
        optimizer, precision, ckpt, rounding, release = _decode(config)
        mine = worker(case, optimizer, precision, ckpt, sharded=True, rounding=rounding, release=release)
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        measured.append(every)
    if dist.get_rank() == 0:
        print(json.dumps(measured), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    # The measurements are out; skip the interpreter's teardown, where gloo's threads can abort a
    # rank ("terminate called without an active exception", seen once in CI after a full run).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def torchrun(script: str, args: list[str], nproc: int, env: dict[str, str], timeout: float, what: str) -> str:
    """The stdout of ``torchrun --nproc_per_node nproc script *args`` on a free local port.

    The launch has its own session, so that a timeout ends torchrun's workers too. One retry,
    on a fresh port, when a rank was aborted or crashed by a signal (gloo's rare abort is the
    launcher's failure, not the run's); a deterministic failure fails twice. A timeout or a
    failure is a RuntimeError naming ``what``, with the stderr tails."""
    import signal
    import socket

    failures: list[str] = []
    for _ in range(2):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
               "--master_port", str(port), script, *args]  # fmt: skip
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            raise RuntimeError(f"torchrun {what} timed out after {timeout} s:\n{stderr[-2000:]}") from None
        if proc.returncode == 0:
            return stdout
        failures.append(f"exit {proc.returncode}:\n{stderr[-3000:]}")
        if not re.search(r"Signal (6|11) \(", stderr):  # a Python error in a rank: no retry
            break
    raise RuntimeError(f"torchrun {what} failed:\n" + "\n--- the retry ---\n".join(failures))


def measure_dist(case: str, configs: list[tuple[str, str, bool]], gpus: int, timeout: float = 1800) -> list[list[int]]:
    """Each rank's measured peak of ``configs`` on ``case`` under FSDP2 over ``gpus`` gloo ranks (one launch)."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    stdout = torchrun(__file__, ["--dist-worker", case, *map(_encode, configs)], gpus, env, timeout, f"{case} {configs}")
    return json.loads(stdout.strip().splitlines()[-1])


def measure(case: str, configs: list[tuple[str, str, bool]]) -> list[int]:
    """Measured peaks of ``configs`` on ``case``, one after the other in one fresh process
    (the full benchmark starts one process per configuration)."""
    (measured,) = measure_cases([(case, configs)])
    return measured


def measure_cases(runs: list[tuple[str, list[tuple]]], *, warmup_steps: int = 2, measured_step: int = 3) -> list[list[int]]:
    """:func:`measure` of several (case, configs), one after the other in one fresh process: each
    configuration has its own warm-up, baseline and measured model, so a process's start and
    imports are paid once for them all. ``warmup_steps`` (>= 1) and ``measured_step`` (>= 2: the
    optimizer's state exists before it): :func:`worker`'s."""
    if warmup_steps < 1 or measured_step < 2:
        raise ValueError(f"warmup_steps must be >= 1 and measured_step >= 2, got {warmup_steps} and {measured_step}")
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, __file__, "--steps", f"{warmup_steps},{measured_step}"]
    for case, configs in runs:
        cmd += ["--worker", case, *map(_encode, configs)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"worker {runs} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def predict(case: str, optimizer: str, precision: str, checkpointing: bool, gpus: int = 1, rounding: str | None = None,
            release: bool = False, offload: bool = False) -> int:  # fmt: skip
    """The planned step's peak; ``offload``: of the offloaded row, plus its ``host_bytes`` (on the
    CPU the process holds both)."""
    from leanopt.memory.plan import plan

    model = build_meta(case)
    _, _, _, batch, seq = model_spec(case)
    (row,) = plan(model, batch=batch, seq=seq, gpus=gpus, optimizers=[optimizer], precisions=[precision],
                  checkpointing=[checkpointing], roundings=[rounding] if rounding else None, grad_release=[release],
                  process=False, offload=offload)[-1:]  # fmt: skip
    if offload:
        assert row.offload
        return row.peak_bytes + row.host_bytes
    return row.peak_bytes


def predict_all(case: str, configs: list[tuple], gpus: int = 1) -> list[int]:
    """:func:`predict` of each configuration, from as few plans as there are (precision, rounding,
    release, offload) among them: a plan traces each forward/backward and each step once for all
    the rows it makes."""
    from leanopt.memory.plan import plan

    model = build_meta(case)
    _, _, _, batch, seq = model_spec(case)
    groups: dict[tuple, list[tuple]] = {}
    for config in configs:
        optimizer, precision, ckpt, rounding, release = full_config(config)
        groups.setdefault((precision, rounding, release, offloaded(config)), []).append(config)
    planned: dict[tuple, int] = {}
    for (precision, rounding, release, offload), group in groups.items():
        optimizers = list(dict.fromkeys(full_config(c)[0] for c in group))
        ckpts = list(dict.fromkeys(full_config(c)[2] for c in group))
        rows = plan(model, batch=batch, seq=seq, gpus=gpus, optimizers=optimizers, precisions=[precision], checkpointing=ckpts,
                    roundings=[rounding] if rounding else None, grad_release=[release], process=False, offload=offload)  # fmt: skip
        # An offloaded row's host memory is the same CPU's: predicted with its device peak, as predict() does.
        peaks = {(r.optimizer, r.checkpointing): r.peak_bytes + ((r.host_bytes or 0) if offload else 0)
                 for r in rows if r.offload == offload and r.rounding == rounding}  # fmt: skip
        for config in group:
            optimizer, _, ckpt, _, _ = full_config(config)
            planned[config] = peaks[optimizer, ckpt]
    return [planned[config] for config in configs]


def build_meta(case: str) -> Any:
    import torch

    with torch.device("meta"):
        return build(case)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="full", help="full, small, or comma-separated case names")
    parser.add_argument("--sets", default="base,bf16,release", help=f"comma-separated configuration sets: {', '.join(SETS)}")
    parser.add_argument("--worker", nargs="+", action="append", metavar="CASE OPTIMIZER:PRECISION:CKPT",
                        help=argparse.SUPPRESS)  # fmt: skip
    parser.add_argument("--steps", default="2,3", help=argparse.SUPPRESS)  # --worker's: warm-up steps, measured step
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--gpus", type=int, default=1, help="N > 1: FSDP2 over N gloo ranks (torchrun), per-rank peaks")
    parser.add_argument("--dist-worker", nargs="+", metavar="CASE OPTIMIZER:PRECISION:CKPT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.dist_worker:
        dist_worker(args.dist_worker[0], args.dist_worker[1:])
        return 0
    if args.worker:  # measure_cases: one list of peaks per --worker CASE CONFIG...
        warmup_steps, measured_step = map(int, args.steps.split(","))
        measured = []
        for case, *configs in args.worker:
            peaks = []
            for config in configs:
                optimizer, precision, ckpt, rounding, release = _decode(config)
                peaks.append(worker(case, optimizer, precision, ckpt, rounding=rounding, release=release,
                                    offload=_decode_offload(config), warmup_steps=warmup_steps,
                                    measured_step=measured_step))  # fmt: skip
            measured.append(peaks)
        print(json.dumps(measured))
        return 0
    cases = {"full": list(CASES), "small": list(SMALL)}.get(args.cases) or args.cases.split(",")
    rows = []
    if args.gpus > 1:
        return _main_dist(cases, args.gpus, args.json)
    configs = [c for name in args.sets.split(",") for c in SETS[name.strip()]]
    for case in cases:
        for config in configs:
            optimizer, precision, ckpt, rounding, release = full_config(config)
            t0 = time.perf_counter()
            predicted = predict(case, optimizer, precision, ckpt, rounding=rounding, release=release)
            t1 = time.perf_counter()
            (measured,) = measure(case, [config])
            err = 100.0 * (predicted - measured) / measured
            row = {"case": case, "optimizer": optimizer, "precision": precision, "rounding": rounding, "checkpointing": ckpt,
                   "grad_release": release, "predicted_mib": round(predicted / 2**20, 1),
                   "measured_mib": round(measured / 2**20, 1), "error_pct": round(err, 1), "plan_s": round(t1 - t0, 1)}  # fmt: skip
            rows.append(row)
            if not args.json:
                mode = f"{precision} {rounding}" if rounding else precision
                print(f"| {case} | {optimizer} | {mode} | {'on' if ckpt else 'off'} | {'on' if release else 'off'} | "
                      f"{row['predicted_mib']:,.0f} | {row['measured_mib']:,.0f} | {err:+.1f} % |", flush=True)  # fmt: skip
    if args.json:
        print(json.dumps(rows, indent=2))
    return 0


def _main_dist(cases: list[str], gpus: int, as_json: bool) -> int:
    rows = []
    for case in cases:
        predicted = [predict(case, o, p, c, gpus) for o, p, c in DIST_CONFIGS]
        measured = measure_dist(case, DIST_CONFIGS, gpus)
        for (optimizer, precision, ckpt), pred, per_rank in zip(DIST_CONFIGS, predicted, measured):
            errs = [100.0 * (pred - m) / m for m in per_rank]
            row = {"case": case, "gpus": gpus, "optimizer": optimizer, "precision": precision, "checkpointing": ckpt,
                   "predicted_mib": round(pred / 2**20, 1), "measured_mib": [round(m / 2**20, 1) for m in per_rank],
                   "error_pct": [round(e, 1) for e in errs]}  # fmt: skip
            rows.append(row)
            if not as_json:
                for rank, (m, e) in enumerate(zip(per_rank, errs)):
                    print(f"| {case} | {rank} | {optimizer} | {precision} | {pred / 2**20:,.0f} | {m / 2**20:,.0f} | {e:+.1f} % |", flush=True)
    if as_json:
        print(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
