"""Optimizer offload to host memory (issue 21): ``offload="cpu"`` on every leanopt optimizer.

The device keeps the params (and their gradients while they exist); the host keeps the
optimizer's states -- low-bit ones stay low-bit -- and one host copy of each param, an fp32
master for bf16/fp16 params. A step runs the optimizer's own update (the same kernels,
:meth:`~leanopt.optim.base.LeanOptimizer._update_group`) on the host copy, on a worker thread,
and copies the result into the device param. ``optimizer.state`` is keyed by the device params
as always, so ``state_dict()``/``load_state_dict()`` have the format of the same optimizer
without offload, and a checkpoint moves between the two both ways.

Two ways gradients reach the host:

* **Without release** the device gradients stay (autograd accumulates them, ``clip_grad_norm_``,
  a GradScaler's ``unscale_`` and DDP see them as usual). ``optimizer.step()`` copies each
  gradient to a host buffer, steps it and uploads the param, ``IN_FLIGHT`` buffers in flight at
  a time. A param of an elementwise rule goes in chunks of at most ``CHUNK_ELEMENTS`` (a
  multiple of its quantized states' block size): each chunk of its gradient is copied, stepped
  -- the same kernels on the same elements, their flat index the offset that keys the decay
  rounding's dither, so the same bits -- and uploaded, so the host's gradient buffers (and the
  step's own temporaries) are bounded whatever the largest param (TinyLlama's 65.5M-element
  embedding). Adafactor (statistics of a whole matrix) steps each param whole.
* **With** :func:`leanopt.release_gradients` each gradient is copied to the host as soon as
  autograd has accumulated it (post-accumulate-grad hook; a side stream on CUDA) and the device
  gradient is freed. A host buffer per param accumulates the gradients of several backward
  passes (gradient accumulation), ``optimizer.clip_grad_norm_`` (and ``torch.nn.utils
  .clip_grad_norm_``, which is routed there for these params) clips them on the host, and
  ``optimizer.step()`` steps what is there. Once the loop has shown its shape -- ``k`` backward
  passes per ``step()``, no clipping -- each param of the ``k``-th backward is stepped on the
  worker thread as soon as its gradient is on the host, while backward goes on, and
  ``step()`` waits for the rest. A later step with more backward passes, or a clip after params
  were stepped that way, raises ``RuntimeError`` (the update cannot be taken back).

The host copy follows the device param: a param written outside the optimizer (a model's
``load_state_dict``, an in-place edit under ``no_grad``; anything that bumps its version
counter or replaces its storage) is copied to the host again before its next step. Writes
through ``param.data`` are invisible to the version counter: write the param itself.

What moves data is one small interface, :class:`HostTransport` (host to host, for CPU params:
what the tests exercise) and :class:`CudaTransport` (pinned buffers, two side streams, events:
covered by the ``offload`` stage of ``scripts/gpu_check.sh``).
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import torch

from leanopt.optim.rounding import LOW_PRECISION

OFFLOAD_CHOICES = (None, "cpu")
# Gradient chunks (or whole params) whose host step and upload may be in flight at once without
# release, each in its own host gradient buffer: one being copied while the other is stepped.
IN_FLIGHT = 2
# Elements of a param of an elementwise rule stepped at once on the host (2**22: a 16 MiB fp32
# or 8 MiB bf16 gradient buffer). TinyLlama-1.1B's two 65.5M-element params (embedding, head)
# made the two whole-param buffers 0.24 B/param of host memory; in chunks they are 0.015.
CHUNK_ELEMENTS = 1 << 22


def check_offload(value: Any) -> None:
    if value not in OFFLOAD_CHOICES:
        raise ValueError(f"Invalid offload: {value!r} (choose None, or 'cpu': states and master weights in host memory)")


def host_memory_available() -> int | None:
    """Bytes of host memory the kernel says are available (``MemAvailable``), or None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def master_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a param's host copy: fp32 for bf16/fp16 params (master weights), else its own."""
    return torch.float32 if dtype in LOW_PRECISION else dtype


# ---- transports -----------------------------------------------------------------------------
class HostTransport:
    """Copies for params in host memory: every copy is done when the call returns."""

    pinned = False

    def empty(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def mark(self) -> Any:
        """A point in the device's work (an event on CUDA) that copies of what the device
        computed so far wait for; nothing on the host."""
        return None

    def to_host(self, src: torch.Tensor, dst: torch.Tensor, mark: Any) -> Any:
        """Start copying device tensor ``src`` into host tensor ``dst``; the handle to wait on."""
        dst.copy_(src)
        return None

    def to_device(self, src: torch.Tensor, dst: torch.Tensor, mark: Any) -> Any:
        """Start copying host tensor ``src`` into device tensor ``dst`` (cast to its dtype: the
        nearest value); ``src`` must not change until the handle is waited on."""
        dst.copy_(src)
        return None

    def wait(self, handle: Any) -> None:
        """Block the calling (host) thread until the copy of ``handle`` is done."""

    def finish(self) -> None:
        """Order the device's next work after every upload started so far."""


class CudaTransport(HostTransport):
    """Pinned host buffers, a side stream each way, events (thin: see the gpu_check stage)."""

    pinned = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.down = torch.cuda.Stream(device)  # device -> host (gradients)
        self.up = torch.cuda.Stream(device)  # host -> device (params)
        self._staged: list[tuple[torch.Tensor, torch.cuda.Event]] = []
        self._lock = threading.Lock()

    def empty(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def mark(self) -> Any:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def to_host(self, src: torch.Tensor, dst: torch.Tensor, mark: Any) -> Any:
        self.down.wait_event(mark)
        with torch.cuda.stream(self.down):
            dst.copy_(src, non_blocking=True)
            src.record_stream(self.down)  # the caller may free src (release) before the copy ran
            done = torch.cuda.Event()
            done.record(self.down)
        return done

    def to_device(self, src: torch.Tensor, dst: torch.Tensor, mark: Any) -> Any:
        torch.cuda.set_device(self.device)  # the worker thread's current device
        if src.dtype != dst.dtype:  # an fp32 master of a bf16/fp16 param: rounded on the host
            staged = torch.empty(src.shape, dtype=dst.dtype, pin_memory=True)
            staged.copy_(src)
            src = staged
        with torch.cuda.stream(self.up):
            if mark is not None:  # the backward kernels that still read the param come first
                self.up.wait_event(mark)
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.up)
        with self._lock:
            self._staged.append((src, done))
        return done

    def wait(self, handle: Any) -> None:
        if handle is not None:
            handle.synchronize()

    def finish(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.up)
        with self._lock:
            self._staged = [(t, e) for t, e in self._staged if not e.query()]


def transport_for(device: torch.device) -> HostTransport | None:
    if device.type == "meta":
        return None  # a model being estimated: nothing is ever stepped
    if device.type == "cpu":
        return HostTransport()
    if device.type == "cuda":
        return CudaTransport(device)
    raise ValueError(f"offload='cpu' supports params on cuda or cpu, got params on {device}")


# ---- chunks ---------------------------------------------------------------------------------
def chunk_elements(optimizer: Any, p: torch.Tensor, layout: list[Any]) -> int | None:
    """Elements per chunk of ``p``'s host step (``layout``: its StateSpecs), or None where it is
    stepped whole: a rule that is not elementwise (the optimizer has its own ``_step_group``),
    complex or non-contiguous params. A chunk is a multiple of each quantized state's block
    size, so no block straddles two chunks."""
    from leanopt.optim.elementwise import ElementwiseOptimizer

    if not isinstance(optimizer, ElementwiseOptimizer) or optimizer.__class__._step_group is not ElementwiseOptimizer._step_group:
        return None
    if p.is_complex() or not p.is_floating_point() or not p.is_contiguous():
        return None
    block = 1
    for spec in layout:
        if spec.quant is not None:
            block = math.lcm(block, getattr(spec.quant, "block_size", 1))
    return max(block, CHUNK_ELEMENTS // block * block)


def spans(numel: int, chunk: int | None) -> list[tuple[int, int]] | None:
    """The ``[start, stop)`` ranges of the flat param stepped one after the other (None: whole)."""
    if chunk is None or numel <= chunk:
        return None
    return [(start, min(start + chunk, numel)) for start in range(0, numel, chunk)]


def _state_chunk(value: Any, start: int, stop: int) -> Any:
    """Elements ``[start, stop)`` of a param's state: a view of a dense state's flat memory, or
    a quantized state over its codes and block scales from ``start`` (a block boundary)."""
    from leanopt.quant import QuantizedState

    if isinstance(value, QuantizedState):
        fmt = value.format
        byte0, byte1 = fmt.code_bytes(start), fmt.code_bytes(stop)
        block0 = start // fmt.block_size
        return QuantizedState(value.codes[byte0:byte1], value.absmax[block0:block0 + fmt.num_blocks(stop - start)], fmt,
                              (stop - start,))  # fmt: skip
    return value.view(-1)[start:stop]


def _step_chunk(opt: Any, gi: int, group: Mapping[str, Any], p: torch.Tensor, twin: torch.Tensor, grad: torch.Tensor,
                start: int, stop: int, key: str) -> None:  # fmt: skip
    """``ElementwiseOptimizer._step_group`` on elements ``[start, stop)`` of ``p``'s host copy:
    the rule's kernels on views of the host copy and of the states, ``grad`` the chunk's
    gradient, ``start`` the flat index of its first element (as a shard's offset)."""
    from leanopt import kernels

    state = opt.state[p]
    kernels.step(
        opt.backend, opt.rule, opt._tables, key, [twin.view(-1)[start:stop]], [grad],
        [[_state_chunk(state[k], start, stop) for k in opt.state_keys(group)]],
        opt._steps([p]), opt.rule.hyperparameters(group), safe=opt.safe, offsets=[start],
    )  # fmt: skip


# ---- the engine -----------------------------------------------------------------------------
_ENGINES: weakref.WeakSet[Offload] = weakref.WeakSet()


class Offload:
    """The host side of one offloaded optimizer (``optimizer._offload``)."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = weakref.proxy(optimizer)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        devices = sorted({str(p.device) for p in params})
        if len(devices) > 1:
            raise ValueError(
                f"offload='cpu' needs every param on one device; {type(optimizer).__name__}'s params are on "
                f"{', '.join(devices)} (one optimizer per device)"
            )
        from leanopt.optim.sharding import is_dtensor

        if any(is_dtensor(p) for p in params):
            raise ValueError("offload='cpu' does not support DTensor (FSDP2) params")
        self.device = params[0].device if params else torch.device("cpu")
        self.transport = transport_for(self.device) if params else HostTransport()
        if self.device.type == "cuda" and optimizer.backend == "triton":
            raise ValueError("backend='triton' with offload='cpu': the update runs on the host; use backend='auto' or 'cpu'")
        for gi, group in enumerate(optimizer.param_groups):
            self.check_group(group, gi)
        self._twins: dict[int, torch.Tensor] = {}  # id(param) -> host copy (fp32 master for bf16/fp16)
        self._synced: dict[int, tuple[int, int]] = {}  # id(param) -> (data_ptr, version) after our upload
        self._uploads: dict[int, Any] = {}  # id(param) -> its last upload, not yet waited on
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._futures: list[concurrent.futures.Future] = []
        # Release mode (leanopt.release_gradients): host gradients and the loop's shape.
        self.released = False
        self._grads: dict[int, torch.Tensor] = {}  # id(param) -> host gradient, accumulated
        self._arrived: dict[int, Any] = {}  # id(param) -> what its host gradient waits for
        self._backwards = 0  # backward passes since the last step()/zero_grad()
        self._clipped = False
        self._eager: set[int] = set()  # params stepped inside this step's backward
        self._shape: tuple[int, bool] | None = None  # (backward passes, clipped) of the last step
        if self.transport is not None:
            check_host_memory(self.host_bytes(), "offload='cpu'")
        _ENGINES.add(self)

    # ---- bookkeeping ---------------------------------------------------------------------
    def check_group(self, group: Mapping[str, Any], gi: int | None = None) -> None:
        """Refuse a param group the offloaded step cannot run (another device, a rounding mode)."""
        for p in group.get("params", []):
            if isinstance(p, torch.Tensor) and p.device != self.device:
                raise ValueError(
                    f"offload='cpu' needs every param on one device: param group {gi} has a param on {p.device}, "
                    f"the others are on {self.device} (one optimizer per device)"
                )
        rounding = group.get("rounding", "nearest")
        if rounding == "nearest":
            return
        low = [p for p in group.get("params", []) if isinstance(p, torch.Tensor) and p.dtype in LOW_PRECISION]
        if low or gi is None:
            where = f"param group {gi}" if gi is not None else "a param group"
            raise ValueError(
                f"Invalid rounding: {rounding!r} with offload='cpu' ({where}): the host keeps an fp32 master of each "
                "bf16/fp16 param, which the update runs on, so there is nothing for stochastic rounding or a Kahan "
                "buffer to recover; use rounding='nearest'"
            )

    def host_bytes(self, *, released: bool | None = None) -> int:
        """Host bytes this optimizer's params need at most: host copies, states (from the
        layouts) and gradient buffers -- released, one per param; else the ``IN_FLIGHT``
        largest params' (:func:`host_bytes`)."""
        opt = self.optimizer
        released = self.released if released is None else released
        params = [(p, g) for g in opt.param_groups for p in g["params"] if p.requires_grad]
        layouts = [(p, opt._param_layout(p, g)) for p, g in params]
        return host_bytes([(p, layout, chunk_elements(opt, p, layout)) for p, layout in layouts], released=released)

    def spans(self, p: torch.Tensor, gi: int) -> list[tuple[int, int]] | None:
        """The chunks ``p`` (of param group ``gi``) is stepped in, or None: whole (:func:`spans`)."""
        group = self.optimizer.param_groups[gi]
        return spans(p.numel(), chunk_elements(self.optimizer, p, self.optimizer._param_layout(p, group)))

    def twin(self, p: torch.Tensor) -> torch.Tensor:
        """``p``'s host copy, refreshed from ``p`` if it was written since our last upload."""
        t = self._twins.get(id(p))
        now = (p.data_ptr(), p._version)
        if t is None or t.shape != p.shape or self._synced.get(id(p)) != now:
            transport = self._moving()
            transport.wait(self._uploads.pop(id(p), None))
            if t is None or t.shape != p.shape:
                t = transport.empty(p.shape, master_dtype(p.dtype))
                self._twins[id(p)] = t
            t.copy_(p.detach())
            self._synced[id(p)] = now
        return t

    def state_device(self) -> torch.device:
        return torch.device("cpu") if self.transport is not None else torch.device("meta")

    def _moving(self) -> HostTransport:
        """The transport, for the paths that move data; params on the meta device (a model being
        estimated) have none, and nothing of theirs is ever stepped or copied."""
        transport = self.transport
        if transport is None:
            raise RuntimeError("offload='cpu' with params on the meta device: nothing is stepped or copied (a model being estimated)")
        return transport

    def _submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="leanopt-offload")
        future = self._executor.submit(fn, *args)
        self._futures.append(future)
        return future

    def wait(self) -> None:
        """Wait for every host step and accumulation submitted so far (re-raising their errors)."""
        futures, self._futures = self._futures, []
        error = None
        for f in futures:
            try:
                f.result()
            except BaseException as err:  # noqa: BLE001 - the first error is re-raised below
                error = error or err
        if error is not None:
            raise error

    def _wait_some(self, limit: int) -> None:
        while len(self._futures) >= limit:
            self._futures.pop(0).result()

    # ---- the host step -----------------------------------------------------------------------
    def _host_step(self, p: torch.Tensor, gi: int, index: int, twin: torch.Tensor, grad: torch.Tensor,
                   waits: list[Any], mark: Any, span: tuple[int, int] | None = None) -> None:  # fmt: skip
        """Runs on the worker thread: the optimizer's update of ``p`` on its host copy, then the
        upload; ``span``: only elements ``[start, stop)`` (``grad`` is theirs), the step count
        advanced by the first chunk."""
        transport = self._moving()
        for handle in waits:
            if isinstance(handle, concurrent.futures.Future):
                handle.result()
            else:
                transport.wait(handle)
        transport.wait(self._uploads.pop(id(p), None))  # its last upload has read the host copy
        opt = self.optimizer
        group = opt.param_groups[gi]
        with torch.no_grad():
            if span is None or span[0] == 0:
                opt._advance(p, group)  # the state, created on the host, and its step count
            if grad.dtype != twin.dtype:
                grad = grad.to(twin.dtype)  # a bf16/fp16 gradient for the fp32 master (exact)
            if span is not None:
                start, stop = span
                _step_chunk(opt, gi, group, p, twin, grad, start, stop, f"group{gi}/param{index}/chunk")
                self._uploads[id(p)] = transport.to_device(twin.view(-1)[start:stop], p.view(-1)[start:stop], mark)
                self._synced[id(p)] = (p.data_ptr(), p._version)
                return
            state = opt.state.get(p, {})  # {}: a stateless param (SGD without momentum)
            twin.grad = grad
            opt.state[twin] = state
            try:
                opt._update_group(gi, group, [twin], f"group{gi}/param{index}")
            finally:
                del opt.state[twin]
                twin.grad = None
            self._uploads[id(p)] = transport.to_device(twin, p, mark)
            self._synced[id(p)] = (p.data_ptr(), p._version)

    def step(self) -> None:
        """``optimizer.step()``: step every param with a gradient (host or device) not stepped yet."""
        opt = self.optimizer
        pending = [
            (gi, i, p)
            for gi, g in enumerate(opt.param_groups)
            for i, p in enumerate(g["params"])
            if id(p) not in self._eager and (p.grad is not None or id(p) in self._grads)
        ]
        for gi, i, p in pending:  # every gradient checked before any param changes
            opt._check_grad(p, gi, i)
        transport = self._moving()
        try:
            for gi, i, p in pending:
                twin = self.twin(p)
                host = self._grads.pop(id(p), None)  # released: the host gradient
                arrived = self._arrived.pop(id(p), None) if host is not None else None
                device = p.grad  # without release; released: one set by hand (or None)
                parts: Sequence[tuple[int, int] | None] = self.spans(p, gi) or [None]
                if device is not None and parts[0] is not None:
                    device = device.reshape(-1)  # a view (a copy for a non-contiguous gradient)
                for span in parts:
                    grad = host if host is None or span is None else host.view(-1)[span[0]:span[1]]
                    waits = [] if host is None else [arrived]
                    if device is not None:
                        src = device if span is None else device[span[0]:span[1]]
                        # A slot is free before its buffer exists: IN_FLIGHT buffers at most.
                        self._wait_some(IN_FLIGHT)
                        mark = transport.mark()
                        part = transport.empty(src.shape, src.dtype)
                        waits.append(transport.to_host(src, part, mark))
                        if grad is None:
                            grad = part
                        else:
                            waits = [self._submit(_accumulate, transport, grad, part, waits)]
                        del part, src
                    self._submit(self._host_step, p, gi, i, twin, grad, waits, transport.mark(), span)
                    del grad, waits
                if device is not None and self.released:
                    p.grad = None
                del device, host
            self.wait()
        finally:
            transport.finish()
        if self._backwards:
            self._shape = (self._backwards, self._clipped)
        self._new_cycle()

    def zero_grad(self) -> None:
        """``optimizer.zero_grad()``: drop the host gradients (a step's worth is abandoned)."""
        self.wait()
        self._moving().finish()
        if self._eager:  # params stepped in backward: the loop's step() is only skipped this time
            self._shape = (self._backwards, self._clipped)
        self._grads.clear()
        self._arrived.clear()
        self._new_cycle()

    def _new_cycle(self) -> None:
        self._backwards = 0
        self._clipped = False
        self._eager.clear()

    # ---- release ------------------------------------------------------------------------------
    def backward_started(self) -> None:
        """A released backward pass (outermost) delivered its first gradient."""
        if self._eager:
            k = self._backwards
            raise RuntimeError(
                f"leanopt offload: this step has more than {k} backward pass{'es' if k > 1 else ''}: the last step had "
                f"{k}, so the params of backward pass {k} were already stepped as their gradients arrived, and "
                "cannot take more gradient; call optimizer.step() once per "
                f"{k} backward pass{'es' if k > 1 else ''}, or zero_grad() to start over"
            )
        self._backwards += 1

    def receive(self, p: torch.Tensor, gi: int, index: int, *, outermost: bool) -> None:
        """A released gradient: to the host (accumulated onto what is there), device copy freed;
        stepped at once when the loop's shape says this was its last gradient of the step."""
        grad = p.grad
        if grad is None:  # the release hook calls this once the gradient is accumulated
            raise RuntimeError(f"leanopt offload: param {index} of group {gi} was released without a gradient")
        transport = self._moving()
        mark = transport.mark()
        buf = self._grads.get(id(p))
        if buf is None:
            buf = self._grads[id(p)] = transport.empty(grad.shape, grad.dtype)
            self._arrived[id(p)] = transport.to_host(grad, buf, mark)
        else:
            part = transport.empty(grad.shape, grad.dtype)
            handle = transport.to_host(grad, part, mark)
            self._arrived[id(p)] = self._submit(_accumulate, transport, buf, part, [self._arrived.get(id(p)), handle])
        p.grad = None
        if outermost and self._shape is not None and self._shape == (self._backwards, False):
            self._eager.add(id(p))
            twin = self.twin(p)
            self._grads.pop(id(p))
            arrived = self._arrived.pop(id(p), None)
            chunks: Sequence[tuple[int, int] | None] = self.spans(p, gi) or [None]
            for span in chunks:
                chunk_grad = buf if span is None else buf.view(-1)[span[0]:span[1]]
                self._submit(self._host_step, p, gi, index, twin, chunk_grad, [arrived], mark, span)

    def holds_gradients(self, params: Iterable[torch.Tensor]) -> bool:
        return any(id(p) in self._grads for p in params)

    def stepped_in_backward(self, params: Iterable[torch.Tensor]) -> bool:
        return any(id(p) in self._eager for p in params)

    def clip_grad_norm_(self, params: list[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:  # fmt: skip
        """``torch.nn.utils.clip_grad_norm_`` over ``params``' gradients, wherever they are
        (host buffers of released params, device gradients of the others)."""
        if self._eager:
            raise RuntimeError(
                "leanopt offload: clip_grad_norm_ after params were stepped inside backward (the last step had no "
                "clipping, so this one's params were stepped as their gradients arrived); clip in every step, "
                "or in none"
            )
        self.wait()
        # A released param's gradient is a host buffer, not its .grad: a stand-in holds it there.
        holders: list[torch.Tensor | SimpleNamespace] = []
        grads: list[torch.Tensor] = []
        for p in params:
            if id(p) in self._grads:
                holders.append(SimpleNamespace(grad=self._grads[id(p)]))
                grads.append(self._grads[id(p)])
            elif p.grad is not None:
                holders.append(p)
                grads.append(p.grad)
        device = params[0].device if params else torch.device("cpu")
        total = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
        # torch reads only each one's .grad; its annotation asks for Tensors, which the stand-ins are not.
        torch.nn.utils.clip_grads_with_norm_(holders, max_norm, total, foreach)  # type: ignore[arg-type]
        self._clipped = True
        return total.to(device)

    def clip_grad_value_(self, params: list[torch.Tensor], clip_value: float, foreach: bool | None = None) -> None:
        """``torch.nn.utils.clip_grad_value_`` over ``params``' gradients, wherever they are (as
        :meth:`clip_grad_norm_`): each element clamped to ``[-clip_value, clip_value]``."""
        if self._eager:
            raise RuntimeError(
                "leanopt offload: clip_grad_value_ after params were stepped inside backward (the last step had no "
                "clipping, so this one's params were stepped as their gradients arrived); clip in every step, "
                "or in none"
            )
        self.wait()
        grads = [self._grads[id(p)] if id(p) in self._grads else p.grad for p in params]
        # torch's own clamp of each gradient: the same bits as torch's function on device gradients.
        holders = [SimpleNamespace(grad=g) for g in grads if g is not None]
        # torch reads only each one's .grad; its annotation asks for Tensors, which the stand-ins are not.
        _torch_clip_grad_value_(holders, clip_value, foreach)  # type: ignore[arg-type]
        self._clipped = True

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


def host_bytes(params: list[tuple[torch.Tensor, list[Any], int | None]], *, released: bool) -> int:
    """Host bytes of offloading ``params`` (each with its state layout, a list of StateSpec, and
    its :func:`chunk_elements`): the host copy of each (fp32 for bf16/fp16), its states, and the
    gradient buffers (released: one per param, the bound while gradients accumulate; else the
    ``IN_FLIGHT`` largest buffers, each a whole param's or one chunk's)."""
    total, grads = 0, []
    for p, layout, chunk in params:
        total += p.numel() * torch.empty((), dtype=master_dtype(p.dtype), device="meta").element_size()
        total += sum(spec.nbytes() for spec in layout)
        if released:
            grads.append(p.numel() * p.element_size())
        else:
            parts = spans(p.numel(), chunk) or [(0, p.numel())]
            grads.extend((stop - start) * p.element_size() for start, stop in parts[:IN_FLIGHT])
    grads.sort(reverse=True)
    return total + sum(grads if released else grads[:IN_FLIGHT])


def _accumulate(transport: HostTransport, buf: torch.Tensor, part: torch.Tensor, waits: list[Any]) -> None:
    for handle in waits:
        if isinstance(handle, concurrent.futures.Future):
            handle.result()
        else:
            transport.wait(handle)
    buf.add_(part)  # what autograd does for a second gradient: the same sum, bit for bit


def check_host_memory(needed: int, what: str) -> None:
    available = host_memory_available()
    if available is not None and needed > available:
        raise RuntimeError(
            f"{what} needs {needed / 2**30:.2f} GiB of host memory for host copies, states and gradient buffers; "
            f"{available / 2**30:.2f} GiB are available (MemAvailable)"
        )


# ---- torch.nn.utils.clip_grad_norm_ / clip_grad_value_ over released, offloaded params -------
_torch_clip_grad_norm_ = torch.nn.utils.clip_grad_norm_
_torch_clip_grad_value_ = torch.nn.utils.clip_grad_value_


def _engine_holding(params: list[Any]) -> Offload | None:
    tensors = [p for p in params if isinstance(p, torch.Tensor)]
    for engine in list(_ENGINES):
        # Released, and holding these params' gradients or having stepped them inside this
        # backward (its clip then refuses, naming why): torch's functions would see no gradient.
        if engine.released and (engine.holds_gradients(tensors) or engine.stepped_in_backward(tensors)):
            return engine
    return None


def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:  # fmt: skip
    """``torch.nn.utils.clip_grad_norm_``, aware of gradient release (installed in
    ``torch.nn.utils`` by the first :func:`leanopt.release_gradients`; leanopt's one patch of
    torch): it clips the gradients a released, offloaded optimizer holds in host memory, and
    raises ``RuntimeError`` for params whose gradients an on-device release has already applied
    and freed (torch's would silently clip nothing) -- except a call with ``max_norm=inf``,
    which clips nothing and returns NaN, the norm of gradients that are gone (Trainer makes it
    to log ``grad_norm`` at ``max_grad_norm=0``). Every other call is torch's own."""
    from leanopt.optim.release import CLIP_AFTER_RELEASE, freed_by_release

    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    engine = _engine_holding(params)
    if engine is None and freed_by_release(params) is not None:
        if float(max_norm) != math.inf or error_if_nonfinite:
            raise RuntimeError(CLIP_AFTER_RELEASE)
        device = next(p.device for p in params if isinstance(p, torch.Tensor))
        return torch.full((), math.nan, device=device)
    if engine is None:
        # torch's own, given what it was given (it warns about an empty generator)
        given = (p for p in params) if isinstance(parameters, types.GeneratorType) else params
        return _torch_clip_grad_norm_(given, max_norm, norm_type, error_if_nonfinite, foreach)
    return engine.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)


setattr(clip_grad_norm_, "__wrapped__", _torch_clip_grad_norm_)  # what functools.wraps would set: inspect sees torch's


def clip_grad_value_(parameters: Any, clip_value: float, foreach: bool | None = None) -> None:
    """``torch.nn.utils.clip_grad_value_``, aware of gradient release (installed with
    :func:`clip_grad_norm_`): it clamps the gradients a released, offloaded optimizer holds in
    host memory, and raises ``RuntimeError`` for params whose gradients an on-device release
    has already applied and freed (torch's would silently clamp nothing). Every other call is
    torch's own."""
    from leanopt.optim.release import CLIP_AFTER_RELEASE, freed_by_release

    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    engine = _engine_holding(params)
    if engine is None and freed_by_release(params) is not None:
        raise RuntimeError(CLIP_AFTER_RELEASE.replace("clip_grad_norm_", "clip_grad_value_"))
    if engine is None:
        given = (p for p in params) if isinstance(parameters, types.GeneratorType) else params
        return _torch_clip_grad_value_(given, clip_value, foreach)
    return engine.clip_grad_value_(params, clip_value, foreach)


clip_grad_value_.__wrapped__ = _torch_clip_grad_value_  # type: ignore[attr-defined]


def route_torch_clipping() -> None:
    """Make ``torch.nn.utils.clip_grad_norm_`` (what Trainer and Accelerate call) and
    ``clip_grad_value_`` (Accelerate's ``clip_grad_value_``) see host gradients; for every other
    param each is torch's own function, called as it was."""
    import torch.nn.utils.clip_grad as clip_module

    torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
    clip_module.clip_grad_norm_ = clip_grad_norm_
    torch.nn.utils.clip_grad_value_ = clip_grad_value_
    clip_module.clip_grad_value_ = clip_grad_value_
    route_accelerate_clipping()


def route_accelerate_clipping() -> None:
    """Make ``accelerate.Accelerator.clip_grad_norm_`` (what Trainer calls for ``max_grad_norm``)
    see released gradients, when accelerate is imported (called at the release and again at the
    first released gradient, by when a Trainer has imported it). Since accelerate 1.16 it clips
    with ``get_total_norm`` and ``clip_grads_with_norm_`` over the params whose ``.grad`` is
    set, not through ``torch.nn.utils.clip_grad_norm_``: released params have none (freed, or
    waiting in host memory), so it would clip nothing, silently. Over params a release holds or
    freed, the call is :func:`clip_grad_norm_`'s (host gradients clipped; freed ones refused);
    every other call is accelerate's own."""
    from leanopt.torch_patches import PEER_PATCHES

    (module_name, class_name, attr, _), = PEER_PATCHES  # the one listed: accelerate's clip_grad_norm_
    accelerator = getattr(sys.modules.get(module_name), class_name, None)
    original = getattr(accelerator, attr, None)
    if original is None or getattr(original, "_leanopt_routed", False):
        return

    @functools.wraps(original)
    def routed(self: Any, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        from leanopt.optim.release import freed_by_release

        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if _engine_holding(params) is None and freed_by_release(params) is None:
            return original(self, params, max_norm, norm_type)
        self.unscale_gradients()
        return clip_grad_norm_(params, max_norm, norm_type)

    routed._leanopt_routed = True  # type: ignore[attr-defined]
    setattr(accelerator, attr, routed)

