"""A hand-written C++ kernel for block-quantized states on the CPU.

One pass per block, all of a param's blocks spread over torch's intra-op threads
(``at::parallel_for``): decode each state's codes through its code book's value table, run the
rule (the rules with a twin here, :data:`leanopt.kernels.twins.NATIVE`: AdamW with or without
AMSGrad, Lion, AdEMAMix, SGD with momentum, with or without Nesterov, Muon's momentum, with or
without Nesterov; safe mode always: second-moment floors and
:func:`~leanopt.kernels.rules.skipped_elements`), keep the new states in block-sized local
buffers while their block maximum is reduced, then encode (the nearest code by the
:class:`Tables`, the decay rounding of :meth:`~leanopt.quant.formats.BlockFormat.code_indices`
where the gradient is exactly 0) and pack. fp32 or bf16 params and gradients (each either: Muon's
momentum writes an fp32 direction from a bf16 param's gradient): a bf16 block is widened to fp32
in a block-sized buffer and a param's new values rounded to the nearest bf16 (ties to even), what
``param.copy_(update)`` does on the other CPU paths, so the bits are theirs.

Where the CPU has AVX-512 (``-march=native``), decode, encode and the decay rounding run 16
lanes at a time with intrinsics: a table of 16 values is one register (``vpermps``), one of 256
is eight two-register permutes and a blend (a vector gather loads lane by lane and cost ~1
cycle per element here); the nearest 4-bit code is four permute steps down a binary tree of
the midpoints, the nearest 8-bit code one gather from an L1-sized bucket table. These loops
compute the same fp32 operations as the portable ones, which run elsewhere (and the last
``block % 16`` elements of each block): the two agree bit for bit (:func:`portable`, tests).

The maths is fp32 with every schedule scalar rounded to fp32 and no contraction into FMAs
except where torch's own kernel uses one (``lerp``), so it follows
:func:`~leanopt.kernels.reference.rule_step_` operation by operation -- except ``sqrt``: torch's
CPU ``sqrt`` goes through MKL's VML and is one ulp off the correctly rounded root on ~20 % of
inputs here, the kernel's is correctly rounded (as Inductor's is), so an update may differ by
an ulp (tests/test_cpu_native.py).

Built on first use with :func:`torch.utils.cpp_extension.load` (``-O3 -march=native``; the
source includes ``Python.h`` and ``ATen/Parallel.h`` only, its Python module written against
Python's C API, so a cold build takes ~9 s on 2 cores) and cached
under a name keyed on everything the build depends on (:func:`build_inputs`: the source,
the flags, what the compiler makes of ``-march=native`` here, the compiler, this torch
installation's headers and libraries, Python's). The build survives its own failures:
a build killed mid-way never blocks the next process (:func:`_build_lock`), a damaged cached library is rebuilt, not loaded
(its size and hash are recorded at build time), and no process waits more than
``_BUILD_WAIT_S`` for another's build. If anything fails (no compiler, no headers, that wait),
:func:`available` is False and :func:`build_error` says why: importing this module never builds
and never fails.

:func:`leanopt.kernels.cpu_elementwise.quantized` runs the params :func:`takes` accepts here
(fp32 or bf16 params and gradients, a rule with a twin here) and the others in its compiled
graph; a failed build falls back to that graph with one warning. The same rules over dense fp32
states (a low-bit optimizer's params below ``min_quant_size``; Lion, AdEMAMix, SGD and AdamW
with fp32 states, of fp32 or bf16 params, but AdamW's fp32 params outside safe mode, which
torch's fused kernel runs; Muon's fp32 momentum of a bf16 param, or in safe mode), SGD without
a momentum (no state), and the same with bf16 states (``state_dtype=torch.bfloat16``: read
widened, written with :mod:`leanopt.quant.bf16`'s stochastic rounding, the dither keyed on the
element's global index and the step) run in :func:`dense`
(:func:`leanopt.kernels.cpu_elementwise.dense` sends them): the states updated in place, in
chunks of 256 elements, so no Inductor compile on the first step (AdamW8bit's first step was
2.2 s, all of it compiling the dense graph for its small params; SGD's 3.0 s; AdamW's with bf16
states 5.3 s).
``LEANOPT_NO_NATIVE`` (a boolean, read at the first build, with one warning when on:
docs/environment.md) or :func:`disabled` (tests) turns the kernel off. Under ``FakeTensorMode`` (memory
planning) a native update is in place and allocates nothing of the param's size, so nothing
runs for the whole blocks.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.resources
import json
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

try:
    import fcntl
except ImportError:  # Windows: no flock; torch's baton is then waited for, boundedly
    fcntl = None  # type: ignore[assignment]  # the module's name stands for "no flock" here

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily
from torch.utils._python_dispatch import _disable_current_modes

from leanopt import tracing
from leanopt.environment import flag
from leanopt.kernels import reference
from leanopt.kernels.rules import RULES, rule_id
from leanopt.kernels.twins import NATIVE, flag_bits
from leanopt.kernels.twins import takes as twin_takes
from leanopt.quant import codebooks
from leanopt.quant.codebooks import _build
from leanopt.quant.formats import DECAY_GROWTH_RATIO, DECAY_PROGRESS

log = logging.getLogger(__name__)

# The kernel's C++ source, shipped beside this module (package data) and built from it.
_SOURCE = (importlib.resources.files("leanopt.kernels") / "cpu_native.cpp").read_text()

# The rule numbers (leanopt.kernels.rules.rule_id) the source's switch reads: one numbering for
# this kernel and the Triton helpers, generated from the rules.
_RULE_DEFINES = [f"-DLEANOPT_RULE_{name.upper()}={rule_id(rule)}" for name, rule in RULES.items() if name in NATIVE]
_CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", *_RULE_DEFINES]
# at::parallel_for is OpenMP in the header: without -fopenmp it runs serially. The libgomp.so.1
# linked here is the one torch has already loaded (same soname), so there is one runtime.
_LDFLAGS = ["-fopenmp"]

_lock = threading.Lock()
_state: dict[str, Any] = {}
_off: list[bool] = []
_portable: list[bool] = []


@contextlib.contextmanager
def disabled():
    """Within it, :func:`takes` answers False (the compiled graph runs): tests of that path."""
    _off.append(True)
    try:
        yield
    finally:
        _off.pop()


@contextlib.contextmanager
def portable():
    """Within it, the kernel runs its portable loops even where its AVX-512 loops are compiled
    in (tests: the two agree bit for bit)."""
    _portable.append(True)
    try:
        yield
    finally:
        _portable.pop()


def vectorized() -> bool:
    """Whether the built kernel has its AVX-512 loops (``-march=native`` on an AVX-512 CPU)."""
    module = _module()
    return bool(module is not None and module.avx512())


def dither(base: int, n: int, step: int) -> Tensor:
    """The kernel's dither for elements ``base .. base + n - 1`` (its AVX-512 loop where compiled
    in, unless within :func:`portable`): :func:`leanopt.quant.formats.dither`'s numbers (tests)."""
    module = _module()
    assert module is not None, build_error()
    out = torch.empty(int(n), dtype=torch.float32)
    module.dither_values(out.data_ptr(), int(base), int(n), int(step), not _portable)
    return out


# ---- build, cache and load ----------------------------------------------------------------------
# leanopt's own lock in the build folder, taken before torch's: the kernel frees a flock when
# its holder dies, so a killed builder never leaves this one behind. Torch's baton (``lock``, a
# file that exists while a build runs and holds no pid) is only ever created under ours, so
# finding it while holding ours means its builder died mid-build: it is removed, where torch
# would wait for it forever.
_LOCK_NAME = "leanopt.lock"
_BATON_NAME = "lock"
# The size and SHA-256 of the library the last good build produced, checked before every load:
# ninja takes a truncated library (an interrupted copy of the cache, a full disk) for up to
# date, and loading one is a SIGBUS.
_MANIFEST_NAME = "leanopt_build.json"
# How long to wait for another process's build (a cold one takes ~9 s) before running without
# the kernel.
_BUILD_WAIT_S = 120.0
# How long the first step waits for a cached extension to load (well under this); one that must be
# built (~9 s) is not waited for: the build goes on in the background.
_FIRST_WAIT_S = 1.0
# /proc/cpuinfo fields that differ between reads, cores or boots, none of which changes the code
# the compiler makes: left out of the fallback cache key.
_VARYING = {"processor", "cpu mhz", "bogomips", "core id", "apicid", "initial apicid", "siblings", "cpu cores",
            "physical id", "cpu number", "microcode", "bugs", "power management"}  # fmt: skip


def _compiler() -> tuple[str, ...]:
    """The C++ compiler ``load`` builds with (``$CXX``, else ``c++``), as a command."""
    from torch.utils.cpp_extension import get_cxx_compiler

    return tuple(shlex.split(get_cxx_compiler()))


@functools.cache
def _compiler_target(compiler: tuple[str, ...]) -> str | None:
    """What ``-march=native`` stands for to ``compiler``: its driver's ``-###`` answer, where gcc
    and clang spell out the target CPU and every ISA extension they enable for it, on any
    architecture (x86's cpuinfo ``flags``, aarch64's ``Features``, POWER, z). None if the probe
    fails. Once per process and compiler (one compiler call)."""
    try:
        # In "/" and the C locale: clang prints the working directory, gcc translates its text.
        probe = subprocess.run([*compiler, "-march=native", "-###", "-E", "-x", "c++", "-"], stdin=subprocess.DEVNULL,
                               capture_output=True, text=True, timeout=60, cwd="/", env={**os.environ, "LC_ALL": "C"},
                               check=False)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    answer = (probe.stdout + probe.stderr).strip()
    return answer if probe.returncode == 0 and answer else None


@functools.cache
def _cpu_description() -> str:
    """The machine and every /proc/cpuinfo line that names what the CPU is and can do (not its
    clock or core numbers): the cache key where the compiler cannot be asked."""
    lines = {platform.machine()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, colon, _ = line.partition(":")
                if colon and key.strip().lower() not in _VARYING:
                    lines.add(" ".join(line.split()))
    except OSError:
        pass
    return "\n".join(sorted(lines))


def _target_key() -> str:
    """What the ``-march=native`` build depends on: the compiler's expansion of it, or, where
    that probe fails, the CPU's description."""
    target = _compiler_target(_compiler())
    return _cpu_description() if target is None else target


def build_inputs() -> dict[str, str]:
    """Everything the build's command and result depend on, by what it is: the source, leanopt's
    flags, what ``-march=native`` means here (:func:`_target_key`: its code must not be loaded on
    another CPU sharing the cache folder, an NFS home or a docker volume), the compiler (its
    resolved path), torch (its version, and the include and library folders of this
    installation: two virtual environments with the same torch version build with different
    ``-isystem`` and ``-L`` paths, and sharing one folder made each process rebuild what the
    other had built), and Python (its include folder, the extension suffix and the ABI tag). The
    compiler's own answer to ``-###`` names its version and programs; where it cannot be asked,
    its resolved path stands for it."""
    import sysconfig

    from torch.utils.cpp_extension import include_paths, library_paths

    compiler = list(_compiler())
    compiler[0] = shutil.which(compiler[0]) or compiler[0]
    return {
        "source": _SOURCE,
        "flags": " ".join(_CFLAGS + _LDFLAGS),
        "target": _target_key(),
        "compiler": "" if _compiler_target(_compiler()) is not None else " ".join(compiler),
        "torch": torch.__version__,
        "torch_include": os.pathsep.join(include_paths("cpu")),
        "torch_lib": os.pathsep.join(library_paths("cpu")),
        "python_include": str(sysconfig.get_path("include", scheme="nt" if os.name == "nt" else "posix_prefix")),
        "python_abi": f"{sys.implementation.cache_tag} {sysconfig.get_config_var('EXT_SUFFIX')}",
    }


def _name() -> str:
    """Extension name keyed on :func:`build_inputs`: one cached build per distinct build."""
    key = "\0".join(f"{k}={v}" for k, v in build_inputs().items())
    return f"leanopt_cpu_native_{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def build_folder() -> str:
    """Where the extension is built and cached: ``$TORCH_EXTENSIONS_DIR`` (else torch's default
    root) / :func:`_name`."""
    from torch.utils.cpp_extension import get_default_build_root

    return os.path.join(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root(), _name())


def _module(wait: bool = True) -> Any | None:
    """The loaded extension, or None where it is unavailable (:func:`build_error` says why).
    The first call decides: a cached build is loaded at once; else the build starts, in a
    background thread, and ``wait=False`` returns None while it runs (the steps take the other
    CPU paths meanwhile, with the same results), ``wait=True`` waits for it."""
    if "module" not in _state:
        with _lock:
            if "module" not in _state and "thread" not in _state:
                _start()
                thread = _state.get("thread")
                if thread is not None:
                    # A cached build loads within this; a build to be made is not waited for at all:
                    # the first step runs another CPU path at once (the thread says which, first).
                    _state["decided"].wait(timeout=_FIRST_WAIT_S)
                    if _state.get("cached"):
                        thread.join(timeout=_FIRST_WAIT_S)
    thread = _state.get("thread")
    if wait and thread is not None and "module" not in _state:
        thread.join()
    return _state.get("module")


def _start() -> None:
    """Decide how the extension comes (under ``_lock``): not at all (switched off, no compiler,
    no ninja: one line saying so), loaded from the cache now, or built in a background thread."""
    from torch.utils.cpp_extension import is_ninja_available

    from leanopt.kernels import cpu

    if flag("LEANOPT_NO_NATIVE"):
        _state["error"] = "disabled by LEANOPT_NO_NATIVE"
        log.warning("leanopt: LEANOPT_NO_NATIVE is set: the native CPU kernel is off and low-bit CPU steps run "
                    "the compiled path, several times slower (unset it, or set it to 0, to use the kernel)")  # fmt: skip
    elif cpu.cxx_compiler() is None:
        _state["error"] = f"no C++ compiler ({os.environ.get('CXX') or 'c++'} not found)"
        cpu.can_compile()  # says it, once, for the kernel and the compiled rules together
    elif not is_ninja_available():
        _state["error"] = "ninja not found (pip install ninja)"
        log.warning("leanopt: the native CPU kernel cannot be built: ninja not found (pip install ninja); low-bit "
                    "CPU steps run the compiled path, several times slower")  # fmt: skip
    if "error" in _state:
        _state["module"] = None
        return
    # Even the cache key asks the compiler (what -march=native means here): all in the thread.
    _state["decided"] = threading.Event()  # set once the thread knows whether a cached build is there
    _state["thread"] = thread = threading.Thread(target=_build_now, name="leanopt-native-build", daemon=False)
    thread.start()


def _build_now() -> None:
    try:
        _state["cached"] = cached = _cached()
    finally:
        _state["decided"].set()
    if not cached:
        log.warning("leanopt: building the native CPU kernel in the background (once per machine, ~9 s); until it "
                    "is ready, the CPU steps it takes run another CPU path, with the same results (AdamW outside "
                    "low-bit storage: within fp32 rounding)")  # fmt: skip
    start = time.perf_counter()
    try:
        module = _build_extension()
    except Exception as err:  # no headers, a broken toolchain, a build lock held too long...
        text = str(err).strip().splitlines()
        _state["error"] = f"{type(err).__name__}: {text[-1] if text else ''}"
        log.warning("leanopt: the native CPU kernel is unavailable, low-bit CPU steps run the slower compiled "
                    "path (%s)", _state["error"])  # fmt: skip
        module = None
    else:
        _state["build_seconds"] = time.perf_counter() - start
        if _state["build_seconds"] > _FIRST_WAIT_S:
            log.info("leanopt: the native CPU kernel is ready (built in %.1f s)", _state["build_seconds"])
    _state["module"] = module


def _cached() -> bool:
    """Whether a verified build of this source sits in the cache (loading it compiles nothing)."""
    from torch.utils.cpp_extension import LIB_EXT

    folder = build_folder()
    try:
        with open(os.path.join(folder, "cpu_native.cpp")) as f:
            same = f.read() == _SOURCE
    except OSError:
        return False
    return same and _verified(folder, os.path.join(folder, os.path.basename(folder) + LIB_EXT))


def _build_extension() -> Any:
    """Build (or load the cached build of) the extension, under :func:`_build_lock`; a cached
    library that does not match what its build recorded is rebuilt from scratch. ``load`` with
    the source written to the build folder rather than ``load_inline``, which would include
    ``torch/extension.h`` (three quarters of the build time): the source includes Python.h and
    ATen/Parallel.h only. The file is rewritten only when it differs, so ninja rebuilds only
    when the source does."""
    from torch.utils.cpp_extension import LIB_EXT, load

    folder = build_folder()
    name = os.path.basename(folder)
    library = os.path.join(folder, name + LIB_EXT)
    os.makedirs(folder, exist_ok=True)
    with _build_lock(folder):
        if not _verified(folder, library):
            _remove_build(folder, library)
        source = os.path.join(folder, "cpu_native.cpp")
        try:
            with open(source) as f:
                same = f.read() == _SOURCE
        except OSError:
            same = False
        if not same:
            _write_atomically(source, _SOURCE)  # a concurrent reader never sees half a file
        module = load(name=name, sources=[source], extra_cflags=_CFLAGS, extra_ldflags=_LDFLAGS,
                      build_directory=folder, verbose=False)  # fmt: skip
        _write_atomically(os.path.join(folder, _MANIFEST_NAME), json.dumps(_digest(library)))
    return module


@contextlib.contextmanager
def _build_lock(folder: str) -> Iterator[None]:
    """Held around a build and load in ``folder``: leanopt's ``flock``, waited for at most
    ``_BUILD_WAIT_S``; holding it, a torch baton found in the folder is stale and removed.
    Where ``flock`` is unsupported (some network file systems) a stale baton cannot be told
    from a live one: it is waited for at most ``_BUILD_WAIT_S`` too. ``TimeoutError`` past it."""
    baton = os.path.join(folder, _BATON_NAME)
    fd = os.open(os.path.join(folder, _LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o666)
    try:
        if _flock(fd, folder):
            if os.path.exists(baton):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(baton)
                log.info("leanopt: removed %s, left by a native-kernel build that was killed", baton)
        else:
            deadline = time.monotonic() + _BUILD_WAIT_S
            while os.path.exists(baton):
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{baton} has been there for {_BUILD_WAIT_S:g} s: a build killed mid-way "
                                       "leaves it; delete it if no process is building the kernel")  # fmt: skip
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # frees the flock


def _flock(fd: int, folder: str) -> bool:
    """Take ``flock`` on ``fd``, waiting at most ``_BUILD_WAIT_S``; False where file locks are
    unsupported."""
    if fcntl is None:
        return False
    deadline = time.monotonic() + _BUILD_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"another process has held the build lock of {folder} for {_BUILD_WAIT_S:g} s "
                                   "(building the kernel, or stuck)") from None  # fmt: skip
            time.sleep(0.05)
        except OSError:  # ENOLCK, EINVAL: no file locks on this file system
            return False


def _digest(library: str) -> dict[str, Any] | None:
    try:
        with open(library, "rb") as f:
            data = f.read()
    except OSError:
        return None
    return {"library": os.path.basename(library), "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _verified(folder: str, library: str) -> bool:
    """Whether ``library`` is what the last good build in ``folder`` recorded."""
    try:
        with open(os.path.join(folder, _MANIFEST_NAME)) as f:
            recorded = json.load(f)
    except (OSError, ValueError):
        return False
    digest = _digest(library)
    return digest is not None and recorded == digest


def _remove_build(folder: str, library: str) -> None:
    """Remove the library, the object files and ninja's records of them, so that the next build
    starts from the source: a build killed mid-compile can leave a partial object file that
    ninja would take for up to date."""
    doomed = [library, os.path.join(folder, ".ninja_log"), os.path.join(folder, ".ninja_deps")]
    doomed += [os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".o")]
    for path in doomed:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def _write_atomically(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def available() -> bool:
    """Whether the extension builds (or is cached) and loads here; builds it on first call, and
    waits for a build under way."""
    return _module() is not None


def ready() -> bool:
    """Whether the extension is loaded now; never waits (the first call starts the build in the
    background, or loads the cached one). The steps ask this one."""
    return _module(wait=False) is not None


def pending() -> bool:
    """Whether the extension is being built in the background now."""
    thread = _state.get("thread")
    return thread is not None and thread.is_alive() and "module" not in _state


def build() -> float:
    """Build (or load) the extension now, waiting for it: seconds it took; ``RuntimeError``
    naming the cause where it cannot be built (``leanopt build-kernels``)."""
    start = time.perf_counter()
    if _module() is None:
        raise RuntimeError(f"the native CPU kernel cannot be built: {build_error()}")
    return time.perf_counter() - start


def build_error() -> str | None:
    """Why :func:`available` is False (None while it is True or before the first try)."""
    return _state.get("error")


def build_seconds() -> float | None:
    """Seconds the first :func:`available` took in this process (compile or cache load)."""
    return _state.get("build_seconds")


# ---- tables -------------------------------------------------------------------------------------
class Tables(NamedTuple):
    """A code book as the kernel reads it. The nearest code of a finite ``y`` with ``|y| <= 1``
    is ``torch.searchsorted(midpoints, y)``: the kernel finds it

    * for 4-bit codes, by descending ``tree`` (:func:`eytzinger`) four levels in the AVX-512
      loops, by counting the 15 midpoints below ``y`` in the portable ones (``buckets`` is
      unused for them);
    * for 8-bit codes, as ``k + (thresholds[k] < y)`` where
      ``k = buckets[key]`` is the number of midpoints below ``y``'s bucket. ``key``
      (``bucket_key`` in the kernel) is the fp32's sign, its exponent clamped to ``low .. 127``
      and its top 7 mantissa bits: ``2 * (128 - low) * 128`` uint8 entries, 6-12 KB for the
      shipped codes, which stay in L1 where the 2^16 int32 entries of every top-16-bit prefix
      (256 KB) did not. Exponents below ``low`` answer as ``low``'s row, which :func:`_tables`
      makes sure is one constant per sign."""

    values: Tensor  # fp32, 2^bits decode values
    thresholds: Tensor  # fp32 midpoints, padded with +inf to >= 256 entries
    tree: Tensor  # the midpoints (+inf-padded to 2^bits - 1) as a binary tree from index 1 (eytzinger); read for 4-bit codes
    buckets: Tensor  # uint8, plus 4 bytes of padding (32-bit gathers)
    low: int
    zero: int  # the code of 0
    last: int  # the number of midpoints


_TABLES: dict[str, Tables | None] = {}


def tables(book: Any) -> Tables | None:
    """The kernel's :class:`Tables` for a code book, or None when its midpoints are too close
    for them (two in one bucket, or more than 255 below one; none of the shipped codes)."""
    cached = tracing.cache(_TABLES)
    if book.name not in cached:
        # Real tensors even when first asked inside a FakeTensorMode trace (leanopt.plan): the
        # kernel's tables are host memory the step reads, never a fake; and real values, with
        # no dispatch mode in the way (the plan's storage tracker answers every data-dependent
        # scalar with 1 or True).
        with unset_fake_temporarily(), _disable_current_modes():
            cached[book.name] = _tables(_build(book.name, torch.device("cpu")))
    return cached[book.name]


def _tables(book: Any) -> Tables | None:
    thresholds = book.thresholds.to(device="cpu", dtype=torch.float32)
    below, finite, usable = codebooks.midpoints_below_buckets(thresholds)
    # Every top-16-bit prefix as (sign, exponent, 7 mantissa bits); |y| <= 1: exponents <= 127.
    full = below.view(2, 256, 128)[:, :128]
    assert bool(finite.view(2, 256, 128)[:, :128].all())
    # The lowest exponent row, per sign, holding an answer other than that of +-0: every row
    # below the table's bottom row (and that row) gives the same answer, so clamping is exact.
    differs = (full != full[:, :1, :1]).any(dim=2)
    first = min(int(row.nonzero()[0]) if bool(row.any()) else 127 for row in differs)
    low = max(first - 1, 0)
    kept = full[:, low:]
    if not usable or int(kept.max()) > 255:
        return None
    last = thresholds.numel()
    padded = torch.cat([thresholds, torch.full((max(16, 256 - last),), float("inf"))]).contiguous()
    values = book.values.to(device="cpu", dtype=torch.float32).contiguous()
    buckets = torch.cat([kept.reshape(-1).to(torch.uint8), torch.zeros(4, dtype=torch.uint8)])
    bits = int(values.numel()).bit_length() - 1
    tree = eytzinger(torch.cat([thresholds, torch.full(((1 << bits) - 1 - last,), float("inf"))]))
    return Tables(values, padded, tree, buckets, low, int(book.zero_index), last)


def eytzinger(ordered: Tensor) -> Tensor:
    """The ``2^L - 1`` sorted keys as a complete binary search tree in one array: node ``j``
    (from 1; entry 0 is +inf, unused) has children ``2j`` and ``2j + 1``. Descending from node
    1, right where the node is ``< y``, ends at leaf ``2^L + `` the number of keys below ``y``."""
    n = ordered.numel()
    assert (n + 1) & n == 0, "2^L - 1 keys"
    out = torch.full((n + 1,), float("inf"), dtype=ordered.dtype)
    keys = iter(ordered.tolist())

    def fill(j: int) -> None:  # in-order: left subtree, node, right subtree
        if j <= n:
            fill(2 * j)
            out[j] = next(keys)
            fill(2 * j + 1)

    fill(1)
    return out


# The params and gradients the loops take: fp32, and bf16 widened to fp32 per block and (a param)
# rounded back to the nearest bf16, as ``p.copy_(update)`` rounds on the other CPU paths. A
# param and its gradient may differ (Muon's momentum: an fp32 direction from a bf16 gradient).
_PARAM_DTYPES = (torch.float32, torch.bfloat16)
_PARAM_BF16, _GRAD_BF16 = 1, 2  # the kernel's ``dtypes`` bits
# Dense states: fp32, or bf16 written with leanopt.quant.bf16's stochastic rounding.
_STATE_DTYPES = (torch.float32, torch.bfloat16)
_PLAIN = (Tensor, torch.nn.Parameter)


def eligible(rule: Any, p: Tensor, g: Tensor, states: Sequence[Any], hp: Mapping[str, Any]) -> bool:
    """Whether :func:`quantized` can run this param, once the extension is there: a rule with a
    twin here taking this many states (:data:`leanopt.kernels.twins.NATIVE`), an fp32 or bf16 CPU
    param with an fp32 or bf16 gradient, quantized states of one bit width and block size whose
    code books have bucket tables (4-bit: even blocks)."""
    from leanopt.quant import QuantizedState

    if _off or p.device.type != "cpu" or p.dtype not in _PARAM_DTYPES or g.dtype not in _PARAM_DTYPES:
        return False
    if not states or not twin_takes(NATIVE, rule, hp, len(states)) or not all(isinstance(q, QuantizedState) for q in states):
        return False
    fmt = states[0].format
    if any(q.format.bits != fmt.bits or q.format.block_size != fmt.block_size for q in states):
        return False
    if fmt.bits == 4 and fmt.block_size % 2:
        return False
    return all(tables(q.format.book("cpu")) is not None for q in states)


def takes(rule: Any, p: Tensor, g: Tensor, states: Sequence[Any], hp: Mapping[str, Any]) -> bool:
    """Whether :func:`quantized` runs this param natively now: :func:`eligible`, and the
    extension loaded (:func:`_usable`)."""
    return eligible(rule, p, g, states, hp) and _usable()


def eligible_dense(rule: Any, p: Tensor, g: Tensor, states: Sequence[Tensor], hp: Mapping[str, Any]) -> bool:
    """Whether :func:`dense` can run this param, once the extension is there: a rule with a
    twin here taking this many states (:data:`leanopt.kernels.twins.NATIVE`), real (not fake)
    contiguous CPU tensors of the param's size: an fp32 or bf16 param, an fp32 or bf16 gradient,
    fp32 or bf16 states (bf16: :mod:`leanopt.quant.bf16`'s stochastic rounding)."""
    if _off or not twin_takes(NATIVE, rule, hp, len(states)) or p.dtype not in _PARAM_DTYPES or g.dtype not in _PARAM_DTYPES:
        return False
    n = p.numel()
    for t in (p, g, *states):
        # A plain tensor is never fake; is_fake (the slow test) only for subclasses.
        if type(t) not in _PLAIN and (not isinstance(t, Tensor) or is_fake(t)):
            return False
        if t.device.type != "cpu" or not t.is_contiguous() or t.numel() != n:
            return False
        if t is not p and t is not g and t.dtype not in _STATE_DTYPES:
            return False
    return True


def takes_dense(rule: Any, p: Tensor, g: Tensor, states: Sequence[Tensor], hp: Mapping[str, Any]) -> bool:
    """Whether :func:`dense` runs this param now: :func:`eligible_dense`, and the extension loaded."""
    return eligible_dense(rule, p, g, states, hp) and _usable()


def usable() -> bool:
    """Whether a step may call the extension now (see :func:`_usable`): with :func:`eligible` or
    :func:`eligible_dense` already answered, what :func:`takes` / :func:`takes_dense` add."""
    return _usable()


def _usable() -> bool:
    """The extension loaded, for a step: never waited for (:func:`ready`), except in a memory
    trace, which plans the steps that run once it is there."""
    return available() if tracing.active() is not None else ready()


def _param_addrs(p: Tensor, g: Tensor, numel: int) -> tuple[int, int, int]:
    """The addresses of a param and its gradient (each fp32 or bf16), and which of them are bf16
    (the kernel's ``dtypes`` bits): what the kernel's entry points take."""
    for t, what in ((p, "param"), (g, "grad")):
        if t.dtype not in _PARAM_DTYPES:
            raise ValueError(f"native kernel: {what} must be a float32 or bfloat16 tensor, not {t.dtype}")
    dtypes = (_PARAM_BF16 if p.dtype == torch.bfloat16 else 0) | (_GRAD_BF16 if g.dtype == torch.bfloat16 else 0)
    return _addr(p, p.dtype, numel, "param"), _addr(g, g.dtype, numel, "grad"), dtypes


def _addr(t: Tensor, dtype: torch.dtype, numel: int, what: str) -> int:
    """``t.data_ptr()`` once ``t`` is a contiguous CPU tensor of ``dtype`` with at least
    ``numel`` elements: the kernel takes addresses, so nothing else may reach it."""
    if not t.is_cpu or t.dtype != dtype or not t.is_contiguous() or t.numel() < numel:
        raise ValueError(f"native kernel: {what} must be a contiguous CPU {dtype} tensor of >= {numel} elements, "
                         f"got {t.dtype} {tuple(t.shape)} on {t.device}{'' if t.is_contiguous() else ', strided'}")  # fmt: skip
    return t.data_ptr()


def dense(rule: Any, p: Tensor, g: Tensor, states: Sequence[Tensor], step: int, hp: Mapping[str, Any], safe: bool,
          offset: int = 0) -> None:  # fmt: skip
    """One param's step with dense fp32 or bf16 states, in place (:func:`takes_dense` params:
    fp32 or bf16): the rule of :func:`leanopt.kernels.reference.rule_step_`, skipping elements in
    safe mode; a bf16 state written with :mod:`leanopt.quant.bf16`'s stochastic rounding, keyed
    on ``step`` and the global index (``offset``: the flat index of ``p``'s element 0 in its
    whole tensor)."""
    module = _module()
    assert module is not None, build_error()
    n = p.numel()
    for t in states:
        if t.dtype not in _STATE_DTYPES:
            raise ValueError(f"native kernel: a dense state must be float32 or bfloat16, not {t.dtype}")
    stored = sum(1 << j for j, t in enumerate(states) if t.dtype == torch.bfloat16)
    module.step_dense(rule_id(rule), flag_bits(rule, hp), bool(hp["maximize"]), bool(safe), *_param_addrs(p, g, n), n,
                      [_addr(t, t.dtype, n, "state") for t in states],
                      list(rule.scalar_values(hp, step, safe)), stored, int(step), int(offset))  # fmt: skip


def step_blocks(rule: Any, p: Tensor, g: Tensor, states: Sequence[Any], step: int, hp: Mapping[str, Any],
                offset: int, blocks: int) -> None:  # fmt: skip
    """The first ``blocks`` whole blocks of one param (flat, contiguous, each of ``p`` and ``g``
    fp32 or bf16) and its quantized ``states``, in place."""
    module = _module()
    assert module is not None, build_error()
    rid, flags = rule_id(rule), flag_bits(rule, hp)
    fixed = _fixed_args(rule, (rid, flags), hp, tuple(q.format for q in states))
    bits, bs, cb_per_block = fixed[1], fixed[2], fixed[3]
    n = blocks * bs
    f32, u8 = torch.float32, torch.uint8
    module.step_blocks(
        rid, flags, bits, bs, bool(hp["maximize"]), *_param_addrs(p, g, n), blocks,
        [_addr(q.codes, u8, blocks * cb_per_block, "codes") for q in states],
        [_addr(q.absmax, f32, blocks, "absmax") for q in states], *fixed[4:],
        int(step), int(offset), list(rule.scalar_values(hp, step, True)),
        float(DECAY_PROGRESS), float(DECAY_GROWTH_RATIO), not _portable,
    )  # fmt: skip


# What step_blocks passes that depends only on the rule and the states' formats, per
# (rule, rule id, formats): the tables' addresses and numbers. Each entry holds its Tables,
# so the addresses stay valid even if the tables cache is emptied (leanopt.plan's trace does).
_FIXED: dict[tuple, tuple] = {}


def _fixed_args(rule: Any, rid: tuple, hp: Mapping[str, Any], formats: tuple) -> tuple:
    key = (rule.name, rid, formats)
    fixed = _FIXED.get(key)
    if fixed is None:
        fmt = formats[0]
        found = [tables(f.book("cpu")) for f in formats]
        tabs = [t for t in found if t is not None]
        if any(f.bits != fmt.bits or f.block_size != fmt.block_size for f in formats) or len(tabs) != len(found):
            raise ValueError("native kernel: the states must share one bit width and block size, with tables")
        ptrs = [[getattr(t, name).data_ptr() for t in tabs] for name in ("values", "thresholds", "tree", "buckets")]
        numbers = [[t.low for t in tabs], [t.zero for t in tabs], [t.last for t in tabs]]
        decays = [int(k.decays) for k in rule.states(hp)]
        fixed = _FIXED[key] = (tabs, fmt.bits, fmt.block_size, fmt.code_bytes(fmt.block_size), *ptrs, *numbers, decays)
    return fixed


def quantized(rule: Any, params, grads, states, steps: Sequence[int], hp: Mapping[str, Any],
              offsets: Sequence[int] | None = None) -> None:  # fmt: skip
    """Drop-in for :func:`leanopt.kernels.cpu_elementwise.quantized` on params :func:`takes`
    accepts: whole blocks natively, the last partial block by the reference."""
    offsets = [0] * len(params) if offsets is None else offsets
    for i, p in enumerate(params):
        n = p.numel()
        if n == 0:
            continue
        qs = states[i]
        fmt = qs[0].format
        bs = fmt.block_size
        full = n // bs
        flat_p, flat_g = p.view(-1), grads[i].reshape(-1).contiguous()
        if full and not (is_fake(p) or p.device.type == "meta"):  # a trace: in place, nothing allocated
            step_blocks(rule, flat_p, flat_g, qs, steps[i], hp, offsets[i], full)
        if full * bs < n:
            reference.partial_block(rule, flat_p, flat_g, qs, steps[i], hp, offsets[i], full * bs)
