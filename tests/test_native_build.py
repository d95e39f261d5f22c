"""The native CPU kernel's build, cache and load (kernels.cpu_native): it survives its own failures.

* A build killed mid-way (timeout, OOM killer, preemption) leaves torch's ``lock`` file in the
  extensions cache: no later process may wait on it forever.
* A damaged cached ``.so`` (an interrupted copy of ``~/.cache``, a full disk) must be rebuilt,
  not loaded (loading a truncated one is a SIGBUS).
* The cache key follows what the compiler targets with ``-march=native``, on any architecture,
  the compiler, and the torch installation and Python it builds against.

Processes that build run as subprocesses with their own ``TORCH_EXTENSIONS_DIR``; one build per
module (``built``), restored to the same path for each test that damages it (a copy elsewhere
would be rebuilt: torch's ``build.ninja`` names the folder). Skipped where the kernel cannot be
built (no compiler)."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from leanopt.kernels import cpu_native

# A cold build takes ~8 s on 2 idle cores, several times that on a loaded machine: a process
# still running after this long is stuck, not slow.
TIMEOUT_S = 300

# AdamW8bit on the default CPU backend (the native kernel where it loads) against the reference
# backend, 3 steps on one param of whole blocks and a partial one; what the process saw, as JSON.
STEP = textwrap.dedent("""
    import json, torch, leanopt
    from leanopt.kernels import cpu_native
    torch.manual_seed(0)
    p = torch.randn(64, 256 + 13)
    fast, ref = torch.nn.Parameter(p.clone()), torch.nn.Parameter(p.clone())
    opts = [leanopt.AdamW8bit([fast], lr=1e-2, min_quant_size=0),
            leanopt.AdamW8bit([ref], lr=1e-2, min_quant_size=0, backend="reference")]
    for _ in range(3):
        g = torch.randn(p.shape)
        fast.grad, ref.grad = g.clone(), g.clone()
        for opt in opts:
            opt.step()
    print(json.dumps({"available": cpu_native.available(), "error": cpu_native.build_error(),
                      "diff": (fast - ref).abs().max().item(), "scale": ref.abs().max().item()}))
""")

BUILD = "from leanopt.kernels import cpu_native; print(cpu_native.available(), cpu_native.build_error())"


def _env(cache: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LEANOPT_NO_NATIVE", "LEANOPT_NO_COMPILE")}
    return {**env, "TORCH_EXTENSIONS_DIR": str(cache), **extra}


def _step(cache: Path, **extra: str) -> tuple[dict, str]:
    """STEP in a new process on ``cache``; its JSON line and its stderr. A process that has not
    finished in TIMEOUT_S fails the test (it would have waited forever)."""
    try:
        proc = subprocess.run([sys.executable, "-c", STEP], env=_env(cache, **extra), capture_output=True, text=True,
                              timeout=TIMEOUT_S, check=False)  # fmt: skip
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"the step hung for {TIMEOUT_S} s: {(err.stderr or b'')[-2000:]!r}")
    assert proc.returncode == 0, f"rc {proc.returncode} ({_signal(proc.returncode)}): {proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def _signal(rc: int) -> str:
    return signal.Signals(-rc).name if rc < 0 else "exit"


def _assert_native_and_right(seen: dict) -> None:
    assert seen["available"], seen["error"]
    # tests/test_cpu_native.py's tolerance: the kernel's sqrt is correctly rounded, torch's not.
    assert seen["diff"] <= 2e-6 * seen["scale"] + 1e-7, seen


def _kill_a_build(cache: Path) -> tuple[Path | None, str | None]:
    """SIGKILL a process building in ``cache`` (and its compiler) mid-build, as the OOM killer or
    a job's preemption does: torch's ``lock`` it left, or why it could not be killed mid-build."""
    builder = subprocess.Popen([sys.executable, "-c", BUILD], env=_env(cache), start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not list(cache.glob("leanopt_cpu_native_*/lock")):  # torch's baton: the build has begun
            if builder.poll() is not None:
                return None, "the builder ended before its build began"
            if time.monotonic() >= deadline:
                return None, "the builder never began building"
            time.sleep(0.05)
        time.sleep(1.0)  # into the compile (a cold one takes ~9 s)
        if builder.poll() is not None:
            return None, "the build finished before it could be killed"
    finally:
        os.killpg(builder.pid, signal.SIGKILL)
        builder.wait()
    locks = list(cache.glob("leanopt_cpu_native_*/lock"))  # what the killed build left
    return (locks[0], None) if len(locks) == 1 else (None, f"the killed build left {len(locks)} locks")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """One build in a cache of its own, made by the process that follows a build killed mid-way
    in that cache (``killed``: what was left and seen, for
    test_a_build_killed_midway_does_not_block_the_next_process; the module's only cold build
    besides the damaged kernel's); ``restore()`` puts the pristine build back at the same path
    (mtimes kept, so ninja sees it up to date)."""
    from leanopt.kernels import cpu

    if cpu.cxx_compiler() is None:
        pytest.skip("native CPU kernel unavailable: no C++ compiler")
    cache = tmp_path_factory.mktemp("native") / "cache"
    lock, problem = _kill_a_build(cache)
    seen, _ = _step(cache)
    if not seen["available"]:
        pytest.skip(f"native CPU kernel unavailable: {seen['error']}")
    killed = SimpleNamespace(problem=problem, seen=seen, lock_left=lock is not None and lock.exists())
    [folder] = cache.glob("leanopt_cpu_native_*")
    [library] = folder.glob("*.so")
    pristine = cache.parent / "pristine"
    shutil.copytree(cache, pristine)

    def restore() -> None:
        shutil.rmtree(cache)
        shutil.copytree(pristine, cache)

    return SimpleNamespace(cache=cache, folder=folder, library=library, restore=restore, killed=killed)


def _mtimes(folder: Path) -> dict[str, int]:
    """The build's products (object and library) by name: changed when anything was rebuilt."""
    return {f.name: f.stat().st_mtime_ns for f in folder.iterdir() if f.suffix in (".o", ".so")}


# ---- a killed build -------------------------------------------------------------------------------
def test_a_stale_build_lock_is_broken_and_the_cache_used(built) -> None:
    """The ``lock`` a killed build leaves: the next process removes it and loads the cached
    build (verified, not rebuilt) instead of waiting forever."""
    built.restore()
    before = _mtimes(built.folder)
    (built.folder / "lock").touch()
    seen, _ = _step(built.cache)
    _assert_native_and_right(seen)
    assert not (built.folder / "lock").exists()
    assert _mtimes(built.folder) == before, "a good cached build was rebuilt"


def test_a_build_killed_midway_does_not_block_the_next_process(built) -> None:
    """SIGKILL a building process (and its compiler) mid-build, as the OOM killer or a job's
    preemption does: the next process builds and runs the kernel (the module's build, ``built``:
    made so, it costs no cold build of its own)."""
    assert built.killed.problem is None, built.killed.problem
    _assert_native_and_right(built.killed.seen)
    assert not built.killed.lock_left


def test_a_live_builder_is_waited_for_boundedly_then_the_step_falls_back(monkeypatch, tmp_path, caplog) -> None:
    """Another process holding the build lock (building, or stuck) is waited for at most
    ``_BUILD_WAIT_S``; then the kernel is unavailable with one warning (the compiled path runs)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_native, "_state", {})
    monkeypatch.setattr(cpu_native, "_BUILD_WAIT_S", 0.5, raising=False)
    folder = Path(cpu_native.build_folder())
    folder.mkdir(parents=True)
    holder = os.open(folder / cpu_native._LOCK_NAME, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)  # its own open file: held against this process's other one
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="leanopt"):
            assert not cpu_native.available()
            assert not cpu_native.available()
        assert time.monotonic() - start < 30
    finally:
        os.close(holder)
    assert "build lock" in cpu_native.build_error() and str(folder) in cpu_native.build_error()
    lines = [r.getMessage() for r in caplog.records if "in the background" not in r.getMessage()]
    assert len(lines) == 1 and "native CPU kernel is unavailable" in lines[0], lines
    assert not list(folder.glob("*.so"))


def test_without_file_locks_the_wait_on_torchs_lock_is_bounded(monkeypatch, tmp_path) -> None:
    """Where ``flock`` is unsupported (some network file systems) a stale ``lock`` cannot be
    told from a live one: it is waited for at most ``_BUILD_WAIT_S``, then a TimeoutError that
    names the file and what to do."""

    def no_locks(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    monkeypatch.setattr(cpu_native, "_BUILD_WAIT_S", 0.3)
    (tmp_path / "lock").touch()
    with pytest.raises(TimeoutError, match=r"lock has been there for 0\.3 s.*delete it"), cpu_native._build_lock(str(tmp_path)):
        pytest.fail("entered the build with torch's lock in place")
    (tmp_path / "lock").unlink()
    with cpu_native._build_lock(str(tmp_path)):  # no lock: nothing to wait for
        pass


# ---- a damaged cached kernel ---------------------------------------------------------------------
def test_a_damaged_cached_kernel_is_rebuilt_not_loaded(built) -> None:
    """A truncated ``.so`` that ninja takes for up to date (its mtime is the newest) is a SIGBUS
    when loaded: it is rebuilt, and the step runs the kernel and is right."""
    built.restore()
    whole = built.library.stat().st_size
    with open(built.library, "r+b") as f:
        f.truncate(whole // 2)
    seen, _ = _step(built.cache)
    _assert_native_and_right(seen)
    assert built.library.stat().st_size > whole // 2, "not rebuilt"


# ---- the cache key -------------------------------------------------------------------------------
def _fake_compiler(folder: Path, name: str, expansion: str, rc: int = 0) -> Path:
    """A compiler that answers ``-###`` with ``expansion`` (as gcc and clang print the flags
    ``-march=native`` stands for, on stderr) and counts its calls in ``<name>.calls``."""
    script = folder / name
    script.write_text(f"#!/bin/sh\necho x >> '{folder / (name + '.calls')}'\necho '{expansion}' >&2\nexit {rc}\n")
    script.chmod(0o755)
    return script


def _calls(script: Path) -> int:
    calls = script.with_name(script.name + ".calls")
    return len(calls.read_text().splitlines()) if calls.exists() else 0


def test_the_cache_key_follows_the_compilers_target(monkeypatch, tmp_path) -> None:
    """Two CPUs whose compiler expands ``-march=native`` differently (an aarch64 Neoverse N1
    and V1, which /proc/cpuinfo's x86 lines do not tell apart) get different builds; the same
    expansion, the same build. The probe runs once per process."""
    n1 = _fake_compiler(tmp_path, "n1", ' "-march=armv8.2-a+crypto+fp16+rcpc+dotprod" "-mtune=neoverse-n1"')
    v1 = _fake_compiler(tmp_path, "v1", ' "-march=armv8.4-a+crypto+sve+bf16+i8mm+rng" "-mtune=neoverse-v1"')
    twin = _fake_compiler(tmp_path, "twin", ' "-march=armv8.2-a+crypto+fp16+rcpc+dotprod" "-mtune=neoverse-n1"')
    names = {}
    for script in (n1, v1, twin):
        monkeypatch.setenv("CXX", str(script))
        names[script.name] = [cpu_native._name() for _ in range(3)]
    assert names["n1"][0] != names["v1"][0], "the key ignores what the compiler targets"
    assert names["twin"][0] == names["n1"][0]
    assert names["n1"][0].startswith("leanopt_cpu_native_")
    for script in (n1, v1, twin):
        assert len(set(names[script.name])) == 1
        assert _calls(script) == 1, "the probe runs once per process"


def test_the_cache_key_falls_back_to_the_cpu_when_the_probe_fails(monkeypatch, tmp_path) -> None:
    """No compiler, or one that refuses the probe: the key is the CPU's own description (the
    machine and /proc/cpuinfo's lines that do not change from one read to the next)."""
    failing = _fake_compiler(tmp_path, "failing", "error: unrecognized option", rc=1)
    keys = []
    for cxx in (str(tmp_path / "missing-c++"), str(failing)):
        monkeypatch.setenv("CXX", cxx)
        keys.append(cpu_native._target_key())
        assert cpu_native._name().startswith("leanopt_cpu_native_")
    assert keys[0] == keys[1]
    assert platform.machine() in keys[0] and "unrecognized" not in keys[0]
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            features = [line.partition(":")[2].split() for line in f if line.startswith(("flags", "Features"))][:1]
        assert all(set(words) <= set(keys[0].split()) for words in features)  # the ISA extensions
        assert "MHz" not in keys[0]  # varies from one read to the next
    assert cpu_native._target_key() == keys[1]  # the same process, the same answer


def test_the_cache_key_follows_the_torch_installation_and_python(monkeypatch) -> None:
    """Two virtual environments with the same torch version build with other include and library
    folders (and possibly another Python): each gets its own folder, so neither rebuilds what
    the other built; the same installation, the same folder."""
    import sysconfig

    import torch.utils.cpp_extension as ext

    monkeypatch.setattr(cpu_native, "_target_key", lambda: "one CPU")  # no compiler probe

    def venv(root: str, python_include: str = "/usr/include/python3.11", suffix: str = ".cpython-311-x86_64-linux-gnu.so"):
        monkeypatch.setattr(ext, "include_paths", lambda device_type="cpu", **kw: [f"{root}/torch/include", f"{root}/torch/include/api"])
        monkeypatch.setattr(ext, "library_paths", lambda device_type="cpu", **kw: [f"{root}/torch/lib"])
        monkeypatch.setattr(sysconfig, "get_path", lambda name, scheme=None, **kw: python_include if name == "include" else "")
        real = sysconfig.get_config_var
        monkeypatch.setattr(sysconfig, "get_config_var", lambda name: suffix if name == "EXT_SUFFIX" else real(name))
        return cpu_native._name()

    a = venv("/home/u/venv-a/lib/python3.11/site-packages")
    b = venv("/home/u/venv-b/lib/python3.11/site-packages")
    assert a != b, "two torch installations of one version share a build folder"
    assert venv("/home/u/venv-a/lib/python3.11/site-packages") == a
    assert venv("/home/u/venv-a/lib/python3.11/site-packages", python_include="/opt/py312/include/python3.12") != a
    assert venv("/home/u/venv-a/lib/python3.11/site-packages", suffix=".cpython-312-x86_64-linux-gnu.so") != a
    assert a.startswith("leanopt_cpu_native_")


def test_the_cache_key_names_the_compiler_where_it_cannot_be_asked(monkeypatch, tmp_path) -> None:
    """A compiler that does not answer ``-###`` is keyed by its resolved path: two of them never
    share a build; a compiler that answers is keyed by its answer (its version and programs)."""
    keys = []
    for name in ("c++-a", "c++-b"):
        _fake_compiler(tmp_path, name, "error: unrecognized option", rc=1)
        monkeypatch.setenv("CXX", str(tmp_path / name))
        inputs = cpu_native.build_inputs()
        assert inputs["compiler"] == str(tmp_path / name)
        keys.append(cpu_native._name())
    assert keys[0] != keys[1]
    answering = _fake_compiler(tmp_path, "gcc-13", ' "-march=znver4" gcc version 13.2.0')
    monkeypatch.setenv("CXX", str(answering))
    assert cpu_native.build_inputs()["compiler"] == "" and "gcc version 13.2.0" in cpu_native.build_inputs()["target"]
