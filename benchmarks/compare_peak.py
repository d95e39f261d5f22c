"""The process peak a ``leanopt compare`` run reports on the CPU, per optimizer, and what it holds.

    python benchmarks/compare_peak.py                          # adamw, adamw8bit, adamw4bit, native kernel cached
    python benchmarks/compare_peak.py --variants cached,cold,cold-waited,compiled --profiler both
    python benchmarks/compare_peak.py --json

Each row is a fresh process that does what ``leanopt compare`` does for its first run on the CPU
(src/leanopt/compare/meter.py): a warm-up forward, backward and step on a throwaway model, the
meter's baseline (glibc's mmap threshold pinned at 64 KiB, ``VmHWM`` reset), a new model, three
training steps; then the growth of the anonymous resident set (the report's "process peak MiB")
and, with the profiler, the growth of the tensor bytes alive (the report's "peak MiB", the torch
profiler's count). Model: a MiniLM-shaped BERT for sequence classification (6 layers, 384 wide,
22.7M parameters, random weights), batch 8 x 48 tokens, one thread, lr 3e-4.

Variants (an optimizer's state and path):

* ``cached``: the native CPU kernel built before (the machine's cache);
* ``cold``: a fresh ``TORCH_EXTENSIONS_DIR``: the kernel builds in the background (20-50 s), the
  measured steps run the eager path meanwhile -- a fresh clone's first compare;
* ``cold-waited``: the same, the warm-up waiting for the build (``cpu_native.available()``);
* ``compiled``: ``LEANOPT_NO_NATIVE=1``: the compiled quantized graph (as for bf16/fp16 params);
* ``reference``: ``backend="reference"``.

``--profiler on`` measures as compare does (the profiler recording while the resident set is
read), ``off`` the resident set alone, ``both`` each in its own process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

WORKER = textwrap.dedent("""
    import gc, json, os, sys
    name, backend, wait, profiler = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4] == "1"
    import torch, transformers, leanopt
    from leanopt.compare.meter import PeakMemory, TensorPeak, use_mmap_for_large_blocks
    from leanopt.kernels import cpu_native
    torch.set_num_threads(1)
    cfg = transformers.BertConfig(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                                  intermediate_size=1536, num_labels=3)
    gen = torch.Generator().manual_seed(0)
    def build():
        torch.manual_seed(0)
        return transformers.BertForSequenceClassification(cfg)
    def step(model, opt):
        x, y = torch.randint(0, 30522, (8, 48), generator=gen), torch.randint(0, 3, (8,), generator=gen)
        model(input_ids=x, labels=y).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    make = lambda ps: leanopt.optim.optimizer_class(name)(ps, lr=3e-4, backend=backend)
    model = build(); opt = make(model.parameters()); step(model, opt); del model, opt; gc.collect()
    if wait:
        cpu_native.available()
    building = cpu_native.pending()
    use_mmap_for_large_blocks()
    memory, tensors = PeakMemory(torch.device("cpu")), TensorPeak()
    memory.reset()
    if profiler:
        tensors.start()
    model = build(); opt = make(model.parameters())
    for _ in range(3):
        step(model, opt)
    tensor_peak = tensors.stop() if profiler else None
    print(json.dumps({"rss_peak": memory.peak(), "tensor_peak": tensor_peak, "state": leanopt.measure(opt).bytes,
                      "building_during_steps": building}))
""")

VARIANTS = ("cached", "cold", "cold-waited", "compiled", "reference")


def measure(name: str, variant: str, profiler: bool, cache: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | {"PYTHONWARNINGS": "ignore",
                                                                                    "OMP_NUM_THREADS": "1"}  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    if variant.startswith("cold"):
        env["TORCH_EXTENSIONS_DIR"] = tempfile.mkdtemp(prefix="leanopt-cold-")
    elif cache:
        env["TORCH_EXTENSIONS_DIR"] = cache
    if variant == "compiled":
        env["LEANOPT_NO_NATIVE"] = "1"
    backend = "reference" if variant == "reference" else "auto"
    args = [name, backend, "1" if variant == "cold-waited" else "0", "1" if profiler else "0"]
    proc = subprocess.run([sys.executable, "-c", WORKER, *args], capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--optimizers", default="adamw,adamw8bit,adamw4bit")
    ap.add_argument("--variants", default="cached", help=f"comma-separated: {', '.join(VARIANTS)}")
    ap.add_argument("--profiler", choices=["on", "off", "both"], default="on")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    from leanopt.kernels import cpu_native

    cache = os.path.dirname(cpu_native.build_folder())
    if "cached" in args.variants:
        cpu_native.build()  # the machine's cache holds the kernel before the cached rows
    rows = []
    for variant in args.variants.split(","):
        for name in args.optimizers.split(","):
            if variant != "cached" and name == "adamw":
                continue  # fp32 AdamW runs torch's fused kernel: no native kernel, no compiled graph
            for profiler in {"on": [True], "off": [False], "both": [True, False]}[args.profiler]:
                row = {"optimizer": name, "variant": variant, "profiler": profiler, **measure(name, variant, profiler, cache)}
                rows.append(row)
                if not args.json:
                    mib = lambda b: "-" if b is None else f"{b / 2**20:8.1f}"  # noqa: E731
                    print(f"{name:10s} {variant:12s} profiler {'on ' if profiler else 'off'}  process peak {mib(row.get('rss_peak'))} "
                          f"MiB  tensor peak {mib(row.get('tensor_peak'))} MiB  state {mib(row.get('state'))} MiB"
                          f"{'  (kernel building during the steps)' if row.get('building_during_steps') else ''}"
                          f"{'  ' + row['error'] if 'error' in row else ''}", flush=True)  # fmt: skip
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
