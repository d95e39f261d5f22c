"""What the CPU fast paths share: compiling a rule once, and reused scratch buffers.

The CPU paths themselves are one module per kind of rule: ``cpu_elementwise`` (AdamW, Lion,
AdEMAMix -- any rule of :mod:`leanopt.kernels.rules` -- on dense or block-quantized states)
and ``cpu_adafactor`` (Adafactor's factored second moment). Without a working compiler a
compiled function runs eagerly; a graph whose compile failed runs eagerly by itself and
:func:`compile_failures` says why.
"""

from __future__ import annotations

import functools
import logging
import os
import shlex
import shutil
import threading
import time
import types
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
from torch import Tensor

from leanopt import tracing
from leanopt.environment import flag, setting

log = logging.getLogger(__name__)

# Why compiling a graph failed, by the graph's name (reported by :func:`compile_failures`):
# each such graph runs eagerly; every other graph is still compiled.
_FAILED: dict[str, str] = {}


def compile_failures() -> dict[str, str]:
    """The graphs whose compile failed in this process, by name, with why (one line each)."""
    return dict(_FAILED)


def compile_disabled() -> bool:
    """Whether ``LEANOPT_NO_COMPILE`` (a boolean: :func:`leanopt.environment.flag`) asks the
    rules to run eagerly; a value that is not a boolean is a ``ValueError``."""
    return flag("LEANOPT_NO_COMPILE")


def cxx_compiler() -> str | None:
    """The path of the C++ compiler that torch's builds use (``$CXX``, else ``c++``), or None
    where there is none (a slim container): then neither Inductor nor the native kernel can
    build, and asking them only prints torch's banners and failures."""
    cxx = os.environ.get("CXX", "").strip()
    name = shlex.split(cxx)[0] if cxx else "c++"
    return shutil.which(name)


# What was announced once (one line per process, not one per rule or graph).
_told: set[str] = set()


def tell_once(key: str, message: str, *args: Any) -> None:
    if key not in _told:
        _told.add(key)
        log.warning(message, *args)


def can_compile() -> bool:
    """Whether the rules are compiled: not turned off and a C++ compiler present. Otherwise every
    graph runs eagerly (the same functions, the same results), said once. A graph whose own
    compile failed runs eagerly by itself (:func:`compiled`)."""
    if compile_disabled():
        # Silence here once cost a 5-7x slower low-bit step nobody could see.
        tell_once("disabled", "leanopt: LEANOPT_NO_COMPILE is set: the CPU update rules run eagerly, several "
                  "times slower than compiled (unset it, or set it to 0, to compile them)")  # fmt: skip
        return False
    if cxx_compiler() is None:
        tell_once("no-compiler", "leanopt: no C++ compiler (%s not found): the native CPU kernel cannot be built and "
                  "the CPU update rules run eagerly, several times slower (install g++ or clang)",
                  os.environ.get("CXX") or "c++")  # fmt: skip
        return False
    return True


class Graph:
    """``fn`` compiled on its first call (``dynamic=True``: every size symbolic; ``None``: static
    except dims the caller marks dynamic); where the rules are not compiled (:func:`can_compile`)
    or compiling this graph failed, ``fallback`` runs instead (the same results: ``fn`` itself by
    default; the CPU paths give ``fn`` run over cache-sized chunks).

    A compile that fails is told apart from an error of the function itself by running the
    fallback on the same arguments (a failed compile has run nothing, and ``fn`` writes its
    results last): if that raises too, the error is the function's -- a user rule's typo -- and
    it propagates as itself, the graph still compiled on the next call and nothing else touched;
    if it runs, the compile failed (an unsupported platform, a broken toolchain, an op dynamo
    cannot trace), and this graph alone runs the fallback from then on, said once with its name.
    Other graphs -- other rules, dtypes, bf16 states, the low-bit paths -- are compiled as
    before."""

    def __init__(self, fn: Callable[..., Any], dynamic: bool | None = True, fallback: Callable[..., Any] | None = None,
                 options: dict[str, Any] | None = None) -> None:  # fmt: skip
        functools.update_wrapper(self, fn)
        self.fn, self.dynamic, self.options = fn, dynamic, options
        self.eager = fallback or fn
        self.impl: Callable[..., Any] | None = None
        self.failed: str | None = None

    @property
    def name(self) -> str:
        return getattr(self.fn, "__name__", repr(self.fn))

    def status(self) -> str:
        """``"not run"``, ``"compiled"``, ``"eager"`` (the rules are not compiled here) or
        ``"failed: <why>"`` (this graph's compile failed: it runs the fallback)."""
        if self.failed is not None:
            return f"failed: {self.failed}"
        if self.impl is None:
            return "not run"
        return "eager" if self.impl is self.eager else "compiled"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        impl = self.impl
        if impl is None:
            impl = self.impl = (torch.compile(self.fn, dynamic=self.dynamic, fullgraph=True, options=self.options)
                                if can_compile() else self.eager)  # fmt: skip
        if impl is self.eager:
            return self.eager(*args, **kwargs)
        try:
            return impl(*args, **kwargs)
        except Exception as err:  # told apart below, outside this handler: the function's own error stands alone
            failure = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        result = self.eager(*args, **kwargs)  # raises the function's own error, if it has one
        self.failed = _FAILED[self.name] = failure
        self.impl = self.eager
        log.warning("leanopt: compiling the update graph %s failed; it runs eagerly, several times slower (%s)",
                    self.name, failure)  # fmt: skip
        return result


def compiled(fn: Callable[..., Any], dynamic: bool | None = True, fallback: Callable[..., Any] | None = None,
             options: dict[str, Any] | None = None) -> Graph:  # fmt: skip
    """``fn`` as a :class:`Graph`: compiled on first call (with Inductor ``options``, e.g.
    :func:`stored_state_options`), ``fallback`` (default ``fn``) where it cannot be."""
    return Graph(fn, dynamic, fallback, options)


def stored_state_options(stored: int, lookups: bool, decay_rounding: bool = False) -> dict[str, Any] | None:
    """Inductor options for a graph that decodes and re-encodes ``stored`` states kept in a
    storage format (block-quantized codes, bf16 states with stochastic rounding).

    * ``lookups``: the graph gathers from tables at indices that are in range by construction
      (a code into its code book's values, the top 16 bits of an fp32 into the 2^16-entry encode
      table), so Inductor's bounds check of every gathered element (``assert_indirect_indexing``)
      is left out.
    * Two states or more, without the quantized decay rounding: scalar loops
      (``cpp.simdlen=0``), which g++ vectorises where it can. Inductor's vector code emulates each
      gather one lane at a time. On the AVX2 build machine (2026-12-05, 4M bf16 params, one
      thread; first number with vector code, second with scalar loops), the step took, in ms:
      AdamW8bit 85 -> 70, AdamW4bit 145 -> 86, AdEMAMix8bit 107 -> 99, bf16-state AdamW 86 -> 73,
      AdEMAMix 114 -> 102, and it compiled in ~55 % of the time. With one state the vector code
      was faster (Lion8bit 41 against 70 ms, bf16-state Lion 46 against 65) and is kept. So is it
      for the graph with the decay rounding (``decay_rounding``: the chunks whose gradient holds
      an exact 0), where it was faster too: AdamW8bit 139-141 against 165-166 ms, AdamW4bit 157
      against 200. CPU code only: a graph compiled for a GPU ignores it.
    """
    options: dict[str, Any] = {}
    if lookups:
        options["assert_indirect_indexing"] = False
    if stored >= 2 and not decay_rounding:
        options["cpp.simdlen"] = 0
    return options or None


def own_code(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """A copy of ``fn`` with its own code object named ``name``.

    Dynamo keeps compiled graphs, guards and its recompile limit (8) per code object: closures
    made by one factory share theirs, so each rule's, dtype's or flag's variant would count
    against the others' limit (and the reference would run once it is hit). A copy per variant
    keeps every variant's graphs apart.
    """
    code = fn.__code__.replace(co_name=name)
    copy = types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


def flat_alias(t: Tensor) -> Tensor:
    """``t``'s elements (contiguous) as a detached 1-D tensor on the same memory that is not a
    view: a graph that writes into a view is guarded on its base's shape (dynamo replays the
    write through the base), so a 1-D param and a 2-D one would compile the same graph twice."""
    t = t.detach()  # a view only where t is one
    if t.dim() == 1 and not t._is_view():
        return t
    if not t.is_contiguous():
        return t.view(-1)  # raises as a view of it would: the paths give contiguous tensors
    return t.new_empty(0).set_(t.untyped_storage(), t.storage_offset(), (t.numel(),), (1,))


def compiled_per_dtypes(fn: Callable[..., Any], fallback: Callable[..., Any] | None = None,
                        options: dict[str, Any] | None = None) -> Callable[..., Any]:  # fmt: skip
    """``compiled(fn, fallback=fallback)`` once per combination of its tensor arguments' dtypes,
    called with flat, detached tensors that are not views (:func:`flat_alias`): each graph then
    only meets a few guard variants (a one-element tensor or not) and never dynamo's recompile
    limit, which a model's many ranks, dtypes and ``requires_grad`` flags would hit in one graph
    (then the reference would run)."""
    graphs: dict[tuple, Callable[..., Any]] = {}

    def flat(a: Any) -> Any:
        if isinstance(a, (list, tuple)):
            return [flat(x) for x in a]
        return flat_alias(a) if isinstance(a, Tensor) and a.dim() != 0 else a

    def dtypes(a: Any) -> tuple:
        if isinstance(a, (list, tuple)):
            return tuple(d for x in a for d in dtypes(x))
        return (a.dtype,) if isinstance(a, Tensor) and a.dim() != 0 else ()

    @functools.wraps(fn)
    def run(*args: Any) -> Any:
        args = tuple(flat(a) for a in args)
        key = dtypes(args)
        graph = graphs.get(key)
        if graph is None:
            name = f"{fn.__name__}_" + "_".join(str(d).removeprefix("torch.") for d in key)
            graph = graphs[key] = compiled(own_code(fn, name), fallback=fallback, options=options)
        return graph(*args)

    run.graphs = graphs  # type: ignore[attr-defined]  # each dtype combination's Graph (its status)
    return run


# Scratch buffers of the CPU paths, reused step after step (no page faults from fresh
# allocations); a memory trace has a pool of its own (leanopt.tracing).
_workspaces = threading.local()


# The worker threads of spread(): kept from step to step, so that their workspaces are too.
_spread_pool: dict[int, Any] = {}
_spread_lock = threading.Lock()
_in_spread = threading.local()


class Choice:
    """Which of two ways to run the same work is faster here and now, from the wall time of the
    calls themselves. The first calls alternate until each way has ``SAMPLES`` times; then the
    way whose median of its last ``SAMPLES`` times is lower runs, and the other is tried again
    after ``interval`` calls (8, doubling to 256 while the choice stands, back to 8 when it
    changes), so a machine that becomes busy or idle is followed within a few hundred calls at a
    cost of at most one call in 8 taken the slower way. For work whose result is the same to
    the bit either way (the caller's guarantee): only the time depends on the choice."""

    SAMPLES, FIRST, LONGEST = 3, 8, 256

    def __init__(self) -> None:
        self.seconds: dict[bool, list[float]] = {True: [], False: []}
        self.interval = self.FIRST
        self.calls = 0

    def best(self) -> bool:
        def median(way: bool) -> float:
            return sorted(self.seconds[way])[len(self.seconds[way]) // 2]

        return median(True) <= median(False)

    def ready(self) -> bool:
        return all(len(t) >= self.SAMPLES for t in self.seconds.values())

    def pick(self) -> bool:
        """The way to take on this call (``True``: the first way)."""
        if not self.ready():
            return len(self.seconds[True]) <= len(self.seconds[False])
        best = self.best()
        self.calls += 1
        if self.calls >= self.interval:
            self.calls = 0
            return not best
        return best

    def record(self, way: bool, seconds: float) -> None:
        before = self.best() if self.ready() else None
        self.seconds[way] = (self.seconds[way] + [seconds])[-self.SAMPLES :]
        if before is not None and way != before:  # a retry of the other way
            self.interval = self.FIRST if self.best() != before else min(self.interval * 2, self.LONGEST)


_choices: dict[Hashable, Choice] = {}


def spread(run: Callable[[Any], None], items: Sequence[Any], *, choose: Hashable | None = None) -> None:
    """``run(item)`` for every item, on up to ``torch.get_num_threads()`` Python threads that
    take the next item as they finish one (torch releases the GIL in its ops), each torch op on
    one intra-op thread. For work made of many small ops (the eager rules' chunks, Adafactor's
    passes over one param): torch's OpenMP regions around each op wait at their barriers for a
    descheduled partner on a busy machine, and the ops of one param are too small to share.
    Items must be independent (the same bits in any order). Serial under a memory trace
    (leanopt.tracing is per thread), inside a spread, or with one thread.

    With ``choose`` (a key for the call site and its work), each call runs either spread or in order with
    torch's own threads, whichever :class:`Choice` measured faster for that name: on an idle
    machine the GIL hand-offs of the Python threads cost more than they save (Adafactor on
    TinyLlama-shaped params, 2 threads: 23-27 ms spread, 15-22 ms in order), on a busy one the
    OpenMP barriers cost far more (34-38 ms spread, 111-161 ms in order at load 3).
    ``LEANOPT_CPU_SPREAD`` (a boolean, :func:`leanopt.environment.setting`: on spreads, off runs in
    order, unset measures) fixes the choice; a value that is not a boolean is a ``ValueError``."""
    workers = min(torch.get_num_threads(), len(items))
    if workers <= 1 or tracing.active() is not None or getattr(_in_spread, "on", False):
        for item in items:
            run(item)
        return
    if choose is None:
        _spread(run, items)
        return
    fixed = setting("LEANOPT_CPU_SPREAD")
    if fixed is not None:
        (_spread if fixed else _in_order)(run, items)
        return
    choice = _choices.get(choose)
    if choice is None:
        choice = _choices.setdefault(choose, Choice())
    way = choice.pick()
    start = time.perf_counter()
    (_spread if way else _in_order)(run, items)
    choice.record(way, time.perf_counter() - start)


def _in_order(run: Callable[[Any], None], items: Sequence[Any]) -> None:
    for item in items:
        run(item)


def _spread(run: Callable[[Any], None], items: Sequence[Any]) -> None:
    threads = torch.get_num_threads()
    with _spread_lock:
        pool = _spread_pool.get(threads)
        if pool is None:
            import concurrent.futures

            pool = _spread_pool[threads] = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="leanopt-cpu")

    def call(item: Any) -> None:
        _in_spread.on = True
        try:
            with torch.no_grad():  # grad mode is per thread; the steps run under no_grad
                run(item)
        finally:
            _in_spread.on = False

    torch.set_num_threads(1)
    try:
        for future in [pool.submit(call, item) for item in items]:
            future.result()
    finally:
        torch.set_num_threads(threads)


def workspace(slot: int, numel: int, dtype: torch.dtype) -> Tensor:
    """A reused flat buffer of at least ``numel`` elements (one per thread, slot and dtype)."""
    key = (slot, dtype)
    pool = tracing.cache(_workspaces.__dict__.setdefault("pool", {}))
    buf = pool.get(key)
    if buf is None or buf.numel() < numel:
        buf = pool[key] = torch.empty(numel, dtype=dtype)
    return buf[:numel]
