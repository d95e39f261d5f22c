"""The commands print the user's business only: what transformers says about the models leanopt
builds for `plan`, torchao's import-time complaints and torch's NumPy warning stay off stderr,
while a warning about the user's own config still reaches it. (compare's "skipped" notices, once
each: tests/test_compare.py::test_skipped_optimizers_are_named_once.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


def python(code: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, timeout=900)


def test_plan_keeps_transformers_notes_about_its_own_models_off_stderr(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    # bos/eos 50256 outside a 2,000-token vocabulary: the user's config, which transformers should flag
    transformers.GPT2Config(vocab_size=2000, n_positions=64, n_embd=64, n_layer=2, n_head=4).to_json_file(tmp_path / "config.json")
    done = python(f"""
import sys
from leanopt.cli import main
sys.exit(main(["plan", {str(tmp_path)!r}, "--batch", "2", "--seq", "16", "--optimizers", "adamw", "--precisions", "fp32",
               "--grad-release", "off", "--no-process"]))
""")
    assert done.returncode == 0, done.stderr
    assert "│ on " in done.stdout  # a checkpointed row was planned: the use_cache note had its cause
    assert "incompatible with gradient checkpointing" not in done.stderr, done.stderr
    assert "loss_type=None" not in done.stderr, done.stderr
    assert "bos_token_id must be" in done.stderr  # the user's business stays


def test_no_torchao_import_noise() -> None:
    pytest.importorskip("torchao")
    pytest.importorskip("transformers")
    done = python("import leanopt, sys; print('torchao' in sys.modules)")
    assert (done.returncode, done.stderr) == (0, "")
    # building a transformers model imports torchao, whose extensions built for another Python
    # log "Failed to load ..._C_mxfp8..." and torch's _pytree "register_constant()" warnings
    done = python("""
import sys
from leanopt.cli import main
code = main(["estimate", "distilbert-base-cased", "--optimizers", "adamw"])
print("torchao" in sys.modules)
sys.exit(code)
""")
    assert done.returncode == 0 and done.stdout.splitlines()[-1] == "True", done.stderr
    assert done.stderr == "", done.stderr
    # The same from the Python API (no CLI to set logging up): quiet while leanopt builds the
    # model, and the peers' loggers left as they were for the user's own imports afterwards.
    done = python("""
import logging, sys
from leanopt.memory.presets import resolve_model
resolve_model("distilbert-base-cased")
print("torchao" in sys.modules, logging.getLogger("torchao").level, logging.getLogger("torch.utils._pytree").level)
""")
    assert done.returncode == 0 and done.stdout.splitlines()[-1] == "True 0 0", done.stderr
    assert done.stderr == "", done.stderr


def test_version_without_numpy_says_nothing_else() -> None:
    # numpy is not a dependency: as if it were not installed (import numpy raises ImportError)
    done = python("""
import sys
sys.modules["numpy"] = None
from leanopt.cli import main
sys.exit(main(["--version"]))
""")
    assert (done.returncode, done.stdout.strip(), done.stderr) == (0, "leanopt 0.1.0", "")
