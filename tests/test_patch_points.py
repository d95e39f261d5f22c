"""What leanopt replaces in torch is the audited list ``leanopt.torch_patches.TORCH_PATCHES``, and only that.

A listed attribute that the installed torch no longer has, a replacement in ``src/`` that the
list does not name, or a listed one nothing replaces any more: each fails here, so a torch
upgrade or a new patch cannot turn a part of the planner off (or on) without a test saying so.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from typing import Any

import pytest
import torch

from leanopt import torch_patches
from leanopt.memory import cuda_emulation
from leanopt.memory.plan_trace import ShardedLiveStorage
from leanopt.torch_patches import TORCH_PATCHES, patchable, thread_patch

SRC = Path(__file__).resolve().parents[1] / "src" / "leanopt"
FOREIGN = ("torch", "transformers", "triton")  # packages whose attributes a replacement would patch

# Every function in src/ that calls thread_patch, and how this file runs it (test_every_thread_patch_...).
THREAD_PATCH_CALLERS = {
    "memory/cuda_emulation.py:cuda_forward",
    "memory/plan_trace.py:ShardedLiveStorage.__enter__",
}


def _pairs(scope: str) -> set[tuple[int, str]]:
    return {(id(p.owner), name) for p in TORCH_PATCHES if p.scope == scope for name in p.names}


def test_every_listed_attribute_exists_in_the_installed_torch():
    missing = [f"{torch_patches.owner_name(p.owner)}.{name}" for p in TORCH_PATCHES for name in sorted(p.names)
               if not callable(getattr(p.owner, name, None))]  # fmt: skip
    assert not missing, f"TORCH_PATCHES lists attributes this torch ({torch.__version__}) does not have: {missing}"
    assert {p.scope for p in TORCH_PATCHES} <= {"thread", "process"}


def test_the_autocast_points_are_where_torch_defines_the_emulated_ops():
    # Each op of CUDA autocast's fp32 lists is patched on every owner that defines it, and only there:
    # a torch that adds ``Tensor.softplus`` (or drops ``torch.renorm``) fails here, not silently in a plan.
    names = cuda_emulation.CUDA_AUTOCAST_FP32 | cuda_emulation.CUDA_AUTOCAST_FP32_OUTPUT
    assert not cuda_emulation.CUDA_AUTOCAST_FP32 & cuda_emulation.CUDA_AUTOCAST_FP32_OUTPUT
    for owner in (torch, torch.nn.functional, torch.Tensor):
        defined = {name for name in names if callable(getattr(owner, name, None))}
        listed = patchable(owner) - {"scaled_dot_product_attention"}
        assert listed == defined, f"{torch_patches.owner_name(owner)}: listed but not defined {sorted(listed - defined)}, " \
                                  f"defined but not listed {sorted(defined - listed)}"  # fmt: skip
    undefined = [n for n in names if not any(callable(getattr(o, n, None)) for o in (torch, torch.nn.functional, torch.Tensor))]
    assert not undefined


def test_what_the_planner_patches_is_exactly_the_thread_scoped_list():
    # Run every caller of thread_patch and read what is installed meanwhile (torch_patches._PATCHES).
    tracker = ShardedLiveStorage()
    with cuda_emulation.cuda_forward(None), tracker:
        installed = set(torch_patches._PATCHES)
    assert installed == _pairs("thread")
    assert not torch_patches._PATCHES
    assert "pow" not in vars(torch.Tensor) and torch.nn.functional.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention


def test_thread_patch_refuses_an_unlisted_attribute():
    original = torch.nn.functional.gelu
    with pytest.raises(ValueError, match=r"torch\.nn\.functional\.gelu is not in leanopt\.torch_patches\.TORCH_PATCHES"):
        with thread_patch(torch.nn.functional, "gelu", lambda fn: fn):
            pass
    with pytest.raises(ValueError, match=r"torch\.nn\.utils\.clip_grad_norm_ is not in"):  # listed, but process-wide only
        with thread_patch(torch.nn.utils, "clip_grad_norm_", lambda fn: fn):
            pass
    assert torch.nn.functional.gelu is original and not torch_patches._PATCHES


# ---- the source: every replacement of a foreign attribute ----------------------------------------
def _aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> dotted module or object path, from every import in the file (any scope)."""
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    out[a.asname] = a.name
                else:
                    root = a.name.split(".")[0]
                    out[root] = root
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


def _dotted(node: ast.expr, aliases: dict[str, str]) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in aliases:
        return None
    return ".".join([aliases[node.id], *reversed(parts)])


def _resolve(path: str) -> Any:
    parts = path.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], 1):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            obj = importlib.import_module(".".join(parts[: i + 1]))
    return obj


def _functions(tree: ast.Module) -> dict[ast.AST, str]:
    """Each node -> the qualified name of the function (or method) it is in."""
    where: dict[ast.AST, str] = {}

    def visit(node: ast.AST, scope: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = scope
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = f"{scope}.{child.name}" if scope else child.name
            where[child] = inner
            visit(child, inner)

    visit(tree, "")
    return where


def _replacements() -> tuple[set[str], list[tuple[str, str, str]]]:
    """(functions that call thread_patch, [(file:function, owner path, attribute)] for every
    assignment or setattr of an attribute of a torch/transformers/triton object in src/)."""
    callers: set[str] = set()
    found: list[tuple[str, str, str]] = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        tree = ast.parse(path.read_text(), filename=str(path))
        aliases, where = _aliases(tree), _functions(tree)
        for node in ast.walk(tree):
            site = f"{rel}:{where.get(node, '')}"
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "thread_patch" and rel != "torch_patches.py":
                callers.add(site)
            targets: list[tuple[ast.expr, str | None]] = []
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(target, ast.Attribute):
                        targets.append((target.value, target.attr))
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr") and node.args:
                name = node.args[1] if len(node.args) > 1 else None
                targets.append((node.args[0], name.value if isinstance(name, ast.Constant) and isinstance(name.value, str) else None))
            for owner, attr in targets:
                dotted = _dotted(owner, aliases)
                if dotted is not None and dotted.split(".")[0] in FOREIGN:
                    found.append((site, dotted, attr or "<computed>"))
    return callers, found


def test_every_thread_patch_call_in_src_is_run_by_this_file():
    callers, _ = _replacements()
    assert callers == THREAD_PATCH_CALLERS, "a new caller of thread_patch: run it in test_what_the_planner_patches_..."


def test_every_process_wide_replacement_in_src_is_listed():
    # An assignment or setattr on a torch/transformers/triton object anywhere in src/ (torch_patches'
    # own dispatcher aside) must be a listed process-wide pair, and every such pair must be made.
    _, found = _replacements()
    unlisted = [f"{site}: {owner}.{attr}" for site, owner, attr in found
                if attr not in patchable(_resolve(owner), "process")]  # fmt: skip
    assert not unlisted, f"replacements of foreign attributes not in TORCH_PATCHES: {unlisted}"
    made = {(id(_resolve(owner)), attr) for _, owner, attr in found}
    assert made == _pairs("process")


def test_the_peer_patch_points_exist_and_are_routed():
    # accelerate's clip_grad_norm_ (the one peer attribute replaced): present, with the parameters
    # the replacement passes on, replaced while a release is in effect and given back after.
    pytest.importorskip("accelerate")
    import inspect

    import leanopt
    from leanopt.optim import clipping

    for module_name, class_name, attr, by in torch_patches.PEER_PATCHES:
        owner = getattr(importlib.import_module(module_name), class_name)
        original = getattr(owner, attr)
        assert list(inspect.signature(original).parameters)[:4] == ["self", "parameters", "max_norm", "norm_type"]
        assert by == f"{clipping.__name__}.route_accelerate"
        model = torch.nn.Linear(4, 4)
        handle = leanopt.release_gradients(model, leanopt.AdamW(model.parameters()))
        assert getattr(getattr(owner, attr), "_leanopt_original", None) is original
        handle.remove()
        assert getattr(owner, attr) is original
