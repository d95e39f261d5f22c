"""Optimizer offload to host memory: ``offload="cpu"`` on every leanopt optimizer.

The device keeps the params (and their gradients while they exist); the host keeps the
optimizer's states -- low-bit ones stay low-bit -- and one host copy of each param, an fp32
master for bf16/fp16 params. A step runs the optimizer's own update (``update``, the same
kernels) on the host copy, on a worker thread, and copies the result into the device param.
``optimizer.state`` is keyed by the device params as always, so ``state_dict()``/
``load_state_dict()`` have the format of the same optimizer without offload, and a checkpoint
moves between the two both ways. :class:`Offloaded` is the optimizer's placement
(:mod:`leanopt.optim.placement`).

Two ways gradients reach the host:

* **Without release** the device gradients stay (autograd accumulates them, ``clip_grad_norm_``,
  a GradScaler's ``unscale_`` and DDP see them as usual). ``optimizer.step()`` copies each
  gradient to a host buffer, steps it and uploads the param, ``IN_FLIGHT`` buffers in flight at
  a time. A param of a ``chunkable`` rule goes in chunks of at most
  :data:`~leanopt.optim.param_step.CHUNK_ELEMENTS` (a multiple of its quantized states' block
  size): each chunk of its gradient is copied, stepped -- the same kernels on the same elements,
  their flat index the offset that keys the decay rounding's dither, so the same bits -- and
  uploaded, so the host's gradient buffers (and the step's own temporaries) are bounded whatever
  the largest param (TinyLlama's 65.5M-element embedding). Adafactor (statistics of a whole
  matrix) steps each param whole.
* **With** :func:`leanopt.release_gradients` each gradient is copied to the host as soon as
  autograd has accumulated it (post-accumulate-grad hook; a side stream on CUDA) and the device
  gradient is freed. A host buffer per param accumulates the gradients of several backward
  passes (gradient accumulation); ``optimizer.clip_grad_norm_`` (and torch's and accelerate's,
  routed there while gradients wait: :mod:`leanopt.optim.clipping`) clips them on the host, and
  ``optimizer.step()`` steps what is there; ``zero_grad()`` drops them (or zeroes them, with
  ``set_to_none=False``), as the usual loop drops its gradients. Only when the release declares
  it (``step_in_backward=k``) are the params of the ``k``-th backward pass after a ``step()``
  stepped on the worker thread as their gradients arrive, while backward goes on
  (:mod:`leanopt.optim.release` says what such a loop may not do).

The host copy follows the device param: a param written outside the optimizer (a model's
``load_state_dict``, an in-place edit under ``no_grad``; anything that bumps its version
counter or replaces its storage) is copied to the host again before its next step. Writes
through ``param.data`` are invisible to the version counter: write the param itself. A param
converted to another dtype after the optimizer was built (``model.double()``) is refused at its
next step, as the kernels refuse it on the device.

What moves data is one small interface, :class:`HostTransport` (host to host, for CPU params:
what the tests exercise) and :class:`CudaTransport` (pinned buffers, two side streams, events:
covered by the ``offload`` stage of ``scripts/gpu_check.sh``).
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from leanopt.optim import clipping, param_step
from leanopt.optim.param_step import ParamStep, chunk_elements, spans, state_chunk
from leanopt.optim.placement import Pending, Placement
from leanopt.optim.rounding import LOW_PRECISION
from leanopt.optim.sharding import is_dtensor

OFFLOAD_CHOICES = (None, "cpu")
# Gradient chunks (or whole params) whose host step and upload may be in flight at once without
# release, each in its own host gradient buffer: one being copied while the other is stepped.
# TinyLlama-1.1B's two 65.5M-element params (embedding, head) made two whole-param buffers
# 0.24 B/param of host memory; two chunks of CHUNK_ELEMENTS are 0.015.
IN_FLIGHT = 2


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


# ---- the placement ---------------------------------------------------------------------------
class Offloaded(Placement):
    """States and a host copy of each param in host memory, stepped there (see the module)."""

    offload = "cpu"

    def __init__(self, optimizer: Any) -> None:
        super().__init__(optimizer)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        devices = sorted({str(p.device) for p in params})
        if len(devices) > 1:
            raise ValueError(
                f"offload='cpu' needs every param on one device; {type(optimizer).__name__}'s params are on "
                f"{', '.join(devices)} (one optimizer per device)"
            )
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
        # Released gradients (leanopt.release_gradients): in host buffers until step().
        self._grads: dict[int, torch.Tensor] = {}  # id(param) -> host gradient, accumulated
        self._arrived: dict[int, Any] = {}  # id(param) -> what its host gradient waits for
        if self.transport is not None:
            check_host_memory(self.host_bytes(), "offload='cpu'")

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
        released = self.release is not None if released is None else released
        params = [(p, g) for g in opt.param_groups for p in g["params"] if p.requires_grad]
        layouts = [(p, g, opt._param_layout(p, g)) for p, g in params]
        return host_bytes([(p, layout, self._chunk(p, layout, g)) for p, g, layout in layouts], released=released)

    def check_release_memory(self) -> None:
        if self.transport is not None:
            extra = self.host_bytes(released=True) - self.host_bytes(released=False)
            check_host_memory(extra, "release_gradients with offload='cpu' (host gradient buffers)")

    def _chunk(self, p: torch.Tensor, layout: list[Any], group: Mapping[str, Any]) -> int | None:
        blocks = [getattr(s.quant, "block_size", 1) for s in layout if s.quant]
        return chunk_elements(self.optimizer.is_chunkable(group), p, blocks, param_step.CHUNK_ELEMENTS)

    def spans(self, p: torch.Tensor, gi: int) -> list[tuple[int, int]] | None:
        """The chunks ``p`` (of param group ``gi``) is stepped in, or None: whole (:func:`spans`)."""
        group = self.optimizer.param_groups[gi]
        return spans(p.numel(), self._chunk(p, self.optimizer._param_layout(p, group), group))

    def twin(self, p: torch.Tensor, gi: int, index: int) -> torch.Tensor:
        """``p``'s host copy, refreshed from ``p`` if it was written since our last upload."""
        t = self._twins.get(id(p))
        if t is not None and t.dtype != master_dtype(p.dtype):
            # On the device the kernels refuse the mismatch; here the fp32 copy would train the
            # converted param in the old precision, silently.
            raise RuntimeError(
                f"offload='cpu': param {index} of group {gi} is {p.dtype}, but its host copy and states were made for "
                f"a {t.dtype} param (the model was converted after the optimizer was built); build the optimizer "
                "after converting the model"
            )
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

    def host_copy(self, p: torch.Tensor) -> torch.Tensor | None:
        """``p``'s host copy as the last step left it (an fp32 master for a bf16/fp16 param), or
        None before ``p``'s first step; not refreshed from ``p`` (:meth:`twin` is)."""
        return self._twins.get(id(p))

    def state_device(self, p: torch.Tensor) -> torch.device:
        return torch.device("cpu") if self.transport is not None else torch.device("meta")

    def matrix_device(self, t: torch.Tensor) -> torch.device:
        # The params' device: a matrix product there is ~1000x the host's (docs/muon.md).
        return self.device if self.transport is not None else t.device

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
            state = opt._init_state(p, group)  # on the host
            step = opt._advance(state) if span is None or span[0] == 0 else opt._step_count(state)
            if grad.dtype != twin.dtype:
                grad = grad.to(twin.dtype)  # a bf16/fp16 gradient for the fp32 master (exact)
            item = ParamStep(twin, grad, state, step, (gi, index))
            src, dst, key = twin, p, f"group{gi}/param{index}"
            if span is not None:
                start, stop = span
                item = ParamStep(twin.view(-1)[start:stop], grad, {k: state_chunk(v, start, stop) for k, v in state.items()},
                                 step, (gi, index), offset=start)  # fmt: skip
                src, dst, key = item.param, p.view(-1)[start:stop], f"{key}/chunk"
            opt._run(gi, group, [item], key)
            self._uploads[id(p)] = transport.to_device(src, dst, mark)
            self._synced[id(p)] = (p.data_ptr(), p._version)

    def has_gradient(self, p: torch.Tensor) -> bool:
        return p.grad is not None or id(p) in self._grads

    def step_pending(self, skip: Iterable[int] = (), zeros: Iterable[int] = ()) -> list[Pending]:
        """Step every param with a gradient (host or device) or in ``zeros``, but ``skip``; the
        device gradients are copied down ``IN_FLIGHT`` buffers at a time (see the module)."""
        pending = self.pending(skip, zeros)
        opt = self.optimizer
        for gi, i, p in pending:  # every gradient checked before any param changes
            opt._check_grad(p, gi, i)
        transport = self._moving()
        try:
            for gi, i, p in pending:
                twin = self.twin(p, gi, i)
                host = self._grads.pop(id(p), None)  # released: the host gradient
                arrived = self._arrived.pop(id(p), None) if host is not None else None
                device = p.grad  # without release; released: one set by hand (or None)
                if host is None and device is None:  # a zero gradient the usual loop would hold
                    host = transport.empty(p.shape, p.dtype).zero_()
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
                del device, host
            self.wait()
        finally:
            transport.finish()
            self._held_changed()
        return pending

    def discard(self, set_to_none: bool) -> None:
        """``optimizer.zero_grad()``: the host gradients are dropped, or zeroed and kept (what
        ``set_to_none=False`` does to a ``p.grad``: the next backward adds to 0, ``step()``
        steps a param that got none with 0)."""
        self.wait()
        if self.transport is not None:
            self.transport.finish()
        if set_to_none:
            self._grads.clear()
            self._arrived.clear()
        else:
            for key, buf in self._grads.items():
                _wait_all(self.transport, [self._arrived.pop(key, None)])
                buf.zero_()
        self._held_changed()

    # ---- release -------------------------------------------------------------------------------
    def take(self, p: torch.Tensor, gi: int, index: int, *, apply: bool, outermost: bool = True) -> None:
        """A released gradient: to the host (accumulated onto what is there), device copy freed;
        with ``apply``, its param is stepped at once on the worker thread (the whole gradient
        has arrived: the backward the release declared)."""
        grad = p.grad
        if grad is None:  # the release hook calls this once the gradient is accumulated
            raise RuntimeError(f"leanopt offload: param {index} of group {gi} was released without a gradient")
        transport = self._moving()
        mark = transport.mark()
        buf = self._grads.get(id(p))
        if buf is None:
            buf = self._grads[id(p)] = transport.empty(grad.shape, grad.dtype)
            self._arrived[id(p)] = transport.to_host(grad, buf, mark)
            self._held_changed()
        else:
            part = transport.empty(grad.shape, grad.dtype)
            handle = transport.to_host(grad, part, mark)
            self._arrived[id(p)] = self._submit(_accumulate, transport, buf, part, [self._arrived.get(id(p)), handle])
        p.grad = None
        if apply:
            twin = self.twin(p, gi, index)
            self._grads.pop(id(p))
            arrived = self._arrived.pop(id(p), None)
            chunks: Sequence[tuple[int, int] | None] = self.spans(p, gi) or [None]
            for span in chunks:
                chunk_grad = buf if span is None else buf.view(-1)[span[0]:span[1]]
                self._submit(self._host_step, p, gi, index, twin, chunk_grad, [arrived], mark, span)

    def held_gradients(self, params: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        """The host gradients of ``params`` (for clipping), each whole: a device gradient a param
        got since (a backward after the release was removed) is added to it and freed."""
        held = {id(p): p for p in params if id(p) in self._grads}
        if not held:
            return {}
        self.wait()
        transport = self._moving()
        for key, p in held.items():
            _wait_all(transport, [self._arrived.pop(key, None)])
            if p.grad is not None:
                part = transport.empty(p.grad.shape, p.grad.dtype)
                transport.wait(transport.to_host(p.grad, part, transport.mark()))
                self._grads[key].add_(part)  # what autograd would have added: the same sum
                p.grad = None
        return {key: self._grads[key] for key in held}

    def applied(self, params: list[torch.Tensor]) -> list[str]:
        return []

    def _held_changed(self) -> None:
        """Clipping asks this placement while it holds host gradients (also after its release
        was removed, until they are stepped or dropped)."""
        if self._grads:
            clipping.engage(self)
        else:
            clipping.disengage(self)

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


def _wait_all(transport: HostTransport | None, waits: list[Any]) -> None:
    for handle in waits:
        if isinstance(handle, concurrent.futures.Future):
            handle.result()
        elif transport is not None:
            transport.wait(handle)
