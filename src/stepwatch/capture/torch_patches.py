"""Torch auto-instrumentation: forward, backward, optimizer_step, data_load and h2d spans with
no code change, installed at init (or the moment torch is imported, torch_attach.py) and removed
at shutdown. The same patches record the loss (each scalar backward root), the gradient norm
(``clip_grad_norm_``), the settings of the program's loaders, optimizers and copies
(inferred_metrics.py, program_settings.py), and the time a rank waits in ``dist.barrier()``
between steps (the ``stepwatch.barrier_wait_ms`` mark: what tells the rank that works between
steps from the ones that wait for it there).

Every wrapper follows one rule: do stepwatch's work inside a guard, call the
original outside it, and never catch what the user's code raises. Optimizer steps use torch's
own global optimizer hooks; the rest keep the original and restore it on uninstall.
"""

from __future__ import annotations

import contextvars
import functools
import sys
import threading
import time
from typing import Any

from ..guard import Site, report_internal
from .inferred_metrics import LOSS_ATTRS, PENDING_MAX, InferredMetrics
from .program_settings import ProgramSettings
from .training import TrainingState

__all__ = ["TorchPatches"]

_MARK = "__stepwatch_original__"
BARRIER_WAIT = "stepwatch.barrier_wait_ms"  # analysis/verdicts/inputs.py reads it by name
_BARRIER_ATTRS = {"inferred": True}


class TorchPatches:
    """Installs and removes the patches for one runtime. Idempotent both ways."""

    def __init__(self, state: TrainingState) -> None:
        import torch

        self.torch = torch
        self.state = state
        self._originals: list[tuple[Any, str, Any, bool]] = []
        self._hooks: list[Any] = []
        self._lock = threading.Lock()
        self.installed = False
        from torch.optim import optimizer

        self.inferred = InferredMetrics(state.recorder, torch, state.threads,
                                        optimizer.register_optimizer_step_post_hook)
        self.settings = ProgramSettings(state.recorder, torch)

    def install(self) -> None:
        with self._lock:
            if self.installed:
                return
            torch = self.torch
            try:
                from torch.optim import optimizer
                from torch.utils.data import DataLoader

                self.state.grad_enabled = torch.is_grad_enabled
                before = torch.nn.Module.__call__
                self._patch(torch.nn.Module, "__call__", self._wrap_module_call)
                _follow_in_dynamo(replaced=before, installed=torch.nn.Module.__call__)
                self._patch(torch.autograd, "backward", self._wrap_backward)
                self._patch(torch.autograd, "grad", self._wrap_grad)
                self._patch(DataLoader, "__iter__", self._wrap_loader_iter)
                if _accelerator_present(torch):
                    self._patch(torch.Tensor, "to", self._wrap_to)
                    self._patch(torch.Tensor, "cuda", self._wrap_cuda)
                c10d = _c10d(torch)
                if c10d is not None:  # once per init_process_group, never per step (children.py)
                    self._patch(c10d, "_update_default_pg", _wrap_default_group)
                    # dist.barrier is c10d's function, re-exported: each name a caller may use
                    for owner in (c10d, torch.distributed):
                        if callable(vars(owner).get("barrier")):
                            self._patch(owner, "barrier", self._wrap_barrier)
                clip_grad = getattr(torch.nn.utils, "clip_grad", None)
                for owner in (torch.nn.utils, clip_grad):
                    if owner is not None and callable(vars(owner).get("clip_grad_norm_")):
                        self._patch(owner, "clip_grad_norm_", self._wrap_clip_grad_norm)
                scaler = _grad_scaler(torch)
                if scaler is not None:
                    self._patch(scaler, "scale", self._wrap_scaler_scale)
                self._hooks.append(optimizer.register_optimizer_step_pre_hook(self.state.optimizer_pre))
                self._hooks.append(optimizer.register_optimizer_step_post_hook(self.state.optimizer_post))
                self.state.on_new_optimizer = self.settings.optimizer
                self.state.recorder.before_marks = self.inferred.resolve
            except BaseException:
                self._restore()  # all or nothing: never leave half the patches in place
                raise
            self.installed = True

    def uninstall(self) -> None:
        with self._lock:
            self._restore()
        self.inferred.flush()  # the values still in flight become marks before the last seal

    def _restore(self) -> None:
        for owner, name, original, own in reversed(self._originals):
            if name == "__call__":
                _follow_in_dynamo(replaced=getattr(owner, name), installed=original)
            if own:
                setattr(owner, name, original)
            else:  # inherited (Tensor.to lives on TensorBase): leave the class as it was
                delattr(owner, name)
        self._originals.clear()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        if self.state.on_new_optimizer == self.settings.optimizer:
            self.state.on_new_optimizer = None
        self.installed = False

    def _patch(self, owner: Any, name: str, make: Any) -> None:
        original = getattr(owner, name)
        own = name in vars(owner)
        if hasattr(original, _MARK):  # another runtime's patch still in place: wrap the original
            original = getattr(original, _MARK)
        wrapper = make(original)
        functools.update_wrapper(wrapper, original)
        setattr(wrapper, _MARK, original)
        setattr(owner, name, wrapper)
        self._originals.append((owner, name, original, own))

    # -- forward ------------------------------------------------------------------------------

    def _wrap_module_call(self, original: Any) -> Any:
        state = self.state
        threads = state.threads
        loss_type = self.torch.nn.modules.loss._Loss
        # Whether this thread has a forward open, asked first by every call: a context variable
        # reads in ~0.1k instructions (callgrind) where the thread-local ``threads.me`` takes
        # ~0.5k. It holds the thread's ``_ForwardFlag``, set once (``_getter``); the forward
        # flips the flag in place, as a ``ContextVar.set`` costs ~2.2k (a new context mapping).
        forward_flag: contextvars.ContextVar[_ForwardFlag] = contextvars.ContextVar("stepwatch_forward_open",
                                                                                   default=_CLOSED)
        flag = _getter(forward_flag)
        direct = _is_torch_dispatch(self.torch, original)

        def outer(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            """A call with no forward open on this thread (by this wrapper)."""
            if isinstance(module, loss_type):  # no forward (asked first: a loss call reads no thread-local)
                return original(module, *args, **kwargs)
            held = flag()
            if held is _CLOSED:  # this thread's first forward: its own flag, in its context
                held = _ForwardFlag()
                if flag is not _closed:
                    forward_flag.set(held)
            local = threads.me
            if local.in_forward:
                # A forward an integration opened (Lightning's training_step): nothing it calls
                # is a forward either, so the module calls below take the short path.
                held.open = True
                try:
                    return original(module, *args, **kwargs)
                finally:
                    held.open = False
            model = local.model
            if model is not None and module is not model:
                # Not the traced model. Its submodules stay on this path: it may call the traced
                # model (a DDP or compile wrapper around it), whose call is the forward.
                return original(module, *args, **kwargs)
            span = None
            try:
                local.module_id = id(module)
                # A forward run during backward is activation checkpointing recomputing it.
                span = state.phase_begin(local, "recompute" if local.in_backward else "forward")
            except Exception as exc:  # noqa: BLE001
                report_internal(exc, Site.PATCH_FORWARD)
            local.in_forward = True
            held.open = True
            try:
                return original(module, *args, **kwargs)  # torch's own frame stays in a traceback
            finally:
                held.open = False
                local.in_forward = False
                if span is not None:
                    try:
                        state.phase_end(local, span)
                    except Exception as exc:  # noqa: BLE001
                        report_internal(exc, Site.PATCH_FORWARD_END)

        # Every submodule call inside a forward passes through here. That path must cost the
        # same at any depth of the model: one check, then what torch's own ``__call__``
        # (``Module._wrapped_call_impl``) does, without its frame (the second Python frame and
        # the thread-local read cost ~2k instructions a module call), and with two closure
        # cells (each cell is copied into, and cleared from, every frame: the
        # outer call's bookkeeping lives in ``outer``). In a traceback through a submodule this
        # frame stands where torch's ``_wrapped_call_impl`` stood.
        if direct:
            def __call__(module: Any, *args: Any, **kwargs: Any) -> Any:
                if flag().open or isinstance(module, loss_type):  # a loss module is no forward either
                    if module._compiled_call_impl is None:
                        return module._call_impl(*args, **kwargs)
                    return module._compiled_call_impl(*args, **kwargs)
                return outer(module, args, kwargs)
        else:  # not torch's own __call__ (another tool's wrapper, a torch that does more): call it
            def __call__(module: Any, *args: Any, **kwargs: Any) -> Any:
                if flag().open:
                    return original(module, *args, **kwargs)
                return outer(module, args, kwargs)

        return __call__

    # -- backward -----------------------------------------------------------------------------

    def _wrap_backward(self, original: Any) -> Any:
        """``torch.autograd.backward``, which ``Tensor.backward`` calls (looked up at call time):
        one patch catches both, with one Python frame. A backward run inside another (reentrant
        checkpointing recomputes and back-propagates inside backward) is part of it."""
        state = self.state
        threads = state.threads
        tensor = self.torch.Tensor
        inferred = self.inferred
        loss = inferred.loss
        pending = inferred.pending
        loss_attrs = LOSS_ATTRS
        time_ns = time.time_ns

        def backward(*args: Any, **kwargs: Any) -> Any:
            local = threads.me
            if local.in_backward:
                return original(*args, **kwargs)
            span = None
            try:
                span = state.phase_begin(local, "backward")
            except Exception as exc:  # noqa: BLE001
                report_internal(exc, Site.PATCH_BACKWARD)
            local.in_backward = True
            try:
                result = original(*args, **kwargs)
            finally:
                local.in_backward = False
                if span is not None:
                    try:
                        state.phase_end(local, span)
                    except Exception as exc:  # noqa: BLE001
                        report_internal(exc, Site.PATCH_BACKWARD_END)
            # The loss: a scalar root (Tensor.backward passes itself first). A backward of
            # several tensors, or of a non-scalar, is not one.
            root = args[0] if args else kwargs.get("tensors")
            if isinstance(root, tensor) and root.ndim == 0:
                try:
                    stack = local.stack
                    if (root.is_cpu and local.live is not None and stack and inferred.scaled is None
                            and len(pending) < PENDING_MAX):
                        # The usual backward of a training step, inline (``InferredMetrics.loss``
                        # without its three calls): a host scalar read at once, onto the
                        # innermost open span.
                        pending.append((stack[-1], "loss", root.item(), time_ns(), loss_attrs))
                    else:
                        loss(local, root)
                except Exception as exc:  # noqa: BLE001
                    report_internal(exc, Site.INFERRED_LOSS)
            return result

        return backward

    def _wrap_grad(self, original: Any) -> Any:
        """``torch.autograd.grad`` (a gradient penalty, a physics-informed loss's derivatives, a
        meta-learning inner step): backward work, timed as the step's backward while a step is
        open and its iterations are not watched (then it changes no step's extent: a forward
        after it belongs to the same iteration). Its outputs are no loss."""
        state = self.state
        threads = state.threads

        def grad(*args: Any, **kwargs: Any) -> Any:
            local = threads.me
            if local.in_backward or local.step is None or local.machine.watch:
                return original(*args, **kwargs)
            span = None
            try:
                span = state.phase_begin(local, "backward")
            except Exception as exc:  # noqa: BLE001
                report_internal(exc, Site.PATCH_BACKWARD)
            local.in_backward = True
            try:
                return original(*args, **kwargs)
            finally:
                local.in_backward = False
                if span is not None:
                    try:
                        state.phase_end(local, span)
                    except Exception as exc:  # noqa: BLE001
                        report_internal(exc, Site.PATCH_BACKWARD_END)

        return grad

    # -- a barrier between steps -----------------------------------------------------------------

    def _wrap_barrier(self, original: Any) -> Any:
        """``dist.barrier()``: its wait, when no step is running on this thread, is a
        ``stepwatch.barrier_wait_ms`` mark. Ranks kept in step by a barrier all show the same
        time between steps; the ones that spent it here were waiting for another."""
        state = self.state
        threads = state.threads
        time_ns = time.time_ns

        def barrier(*args: Any, **kwargs: Any) -> Any:
            start = time_ns()
            result = original(*args, **kwargs)
            try:
                if threads.me.live is None:  # inside a step its time is the step's (the residual)
                    state.recorder.mark(BARRIER_WAIT, (time_ns() - start) / 1e6, "point", _BARRIER_ATTRS)
            except Exception as exc:  # noqa: BLE001
                report_internal(exc, Site.PATCH_BARRIER)
            return result

        return barrier

    # -- the gradient norm, and GradScaler's scaled loss ----------------------------------------

    def _wrap_clip_grad_norm(self, original: Any) -> Any:
        threads = self.state.threads
        inferred = self.inferred
        tensor = self.torch.Tensor

        def clip_grad_norm_(*args: Any, **kwargs: Any) -> Any:
            norm = original(*args, **kwargs)
            if isinstance(norm, tensor) and norm.ndim == 0:
                try:
                    inferred.grad_norm(threads.me, norm)
                except Exception as exc:  # noqa: BLE001
                    report_internal(exc, Site.INFERRED_GRAD_NORM)
            return norm

        return clip_grad_norm_

    def _wrap_scaler_scale(self, original: Any) -> Any:
        """``GradScaler.scale``: the loss times the scale goes through backward; the loss
        recorded is the scaler's input."""
        inferred = self.inferred
        tensor = self.torch.Tensor

        def scale(scaler: Any, outputs: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(scaler, outputs, *args, **kwargs)
            if result is not outputs and isinstance(outputs, tensor) and outputs.ndim == 0:
                inferred.scaled = (result, outputs)
                inferred.scaler_seen = True
            return result

        return scale

    # -- optimizer: torch's own global hooks, TrainingState.optimizer_pre/_post themselves -----

    # -- data loading -------------------------------------------------------------------------

    def _wrap_loader_iter(self, original: Any) -> Any:
        state = self.state

        settings = self.settings

        def __iter__(loader: Any) -> Any:
            settings.loader(loader)  # once per loader (it reports its own errors)
            timed = _TimedIterator(original(loader), state, loader)  # user errors pass through
            try:
                state.start_pass(timed.pass_)
            except Exception as exc:  # noqa: BLE001
                report_internal(exc, Site.PATCH_DATA_LOAD_ITER)
            return timed

        return __iter__

    # -- host to device -----------------------------------------------------------------------

    def _wrap_to(self, original: Any) -> Any:
        state = self.state
        torch = self.torch
        settings = self.settings

        def to(*args: Any, **kwargs: Any) -> Any:
            # Most calls are host-side (x.to("cpu"), .to(dtype)): decided from the target first,
            # with a string test, before asking the tensor where it lives; the arguments are
            # passed on as they came.
            if not kwargs:
                target = args[1] if len(args) > 1 else None
                if type(target) is str and target.startswith(_HOST):
                    return original(*args)
            else:
                target = _target(args[1:], kwargs)
            if (not args or target is None or not getattr(args[0], "is_cpu", False)
                    or not _is_accelerator(torch, target)):
                return original(*args, **kwargs)
            return _timed_copy(state, original, args[0], args[1:], kwargs, settings)

        return to

    def _wrap_cuda(self, original: Any) -> Any:
        state = self.state
        settings = self.settings

        def cuda(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            if not tensor.is_cpu:
                return original(tensor, *args, **kwargs)
            return _timed_copy(state, original, tensor, args, kwargs, settings)

        return cuda


_HOST = ("cpu", "meta")


class _ForwardFlag:
    """Whether a forward is open on the thread whose context holds this flag (``open``)."""

    __slots__ = ("open",)

    def __init__(self) -> None:
        self.open = False


_CLOSED = _ForwardFlag()  # a context's flag until its thread's first forward: never opened


def _closed() -> _ForwardFlag:
    return _CLOSED


def _getter(var: contextvars.ContextVar[_ForwardFlag]) -> Any:
    """``var.get``, where a context variable is per thread: each thread starts with its own
    context. On a Python that copies the caller's context into new threads
    (``sys.flags.thread_inherit_context``, 3.14), a thread would share the flag of the thread
    that started it: there every call reads "closed", a forward flips a flag of its own, and the
    thread-local alone decides, as before."""
    return _closed if getattr(sys.flags, "thread_inherit_context", 0) else var.get


def _is_torch_dispatch(torch: Any, original: Any) -> bool:
    """Whether ``original`` is torch's own ``Module.__call__`` whose body (``_compiled_call_impl``
    when set, else ``_call_impl``) the wrapper repeats for submodule calls. Anything else (an
    older or newer torch whose ``__call__`` does more, another tool's wrapper) is called as it is."""
    module = torch.nn.Module
    code = getattr(original, "__code__", None)
    return (original is getattr(module, "_wrapped_call_impl", None) and code is not None
            and set(code.co_names) == {"_compiled_call_impl", "_call_impl"}
            and callable(getattr(module, "_call_impl", None)))


# the modules of torch's compiler that keep the ``nn.Module.__call__`` they saw at their import
_DYNAMO_HOLDERS = ("torch._dynamo.utils", "torch._dynamo.variables.nn_module")


def _follow_in_dynamo(replaced: Any, installed: Any) -> None:
    """``torch.compile`` goes straight to a submodule's ``forward`` (no hook on it) only while
    ``nn.Module.__call__`` is the one its compiler saw at its import; any other it traces, and
    the context variable ours reads stops the graph there: a graph break at every submodule of
    a compiled model (2.8x its step time, an MLP of five layers). Where the compiler is
    imported, its reference follows the ``__call__`` installed; imported later, it sees ours."""
    for name in _DYNAMO_HOLDERS:
        holder = sys.modules.get(name)
        if holder is not None and getattr(holder, "unpatched_nn_module_call", None) is replaced:
            holder.unpatched_nn_module_call = installed


def _accelerator_present(torch: Any) -> bool:
    """Whether host-to-device copies can happen here at all. Without a device (a CPU-only torch,
    a machine with no GPU) ``Tensor.to`` stays torch's own: every ``.to(dtype)`` anywhere in the
    program would otherwise pass through a Python wrapper for nothing (~0.8 µs a call in a
    training loop). A torch too old to tell (no ``torch.accelerator``, before 2.6) is patched."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is None:
        return True
    try:
        return bool(accelerator.is_available())
    except Exception:  # noqa: BLE001 - cannot tell: patch, as before
        return True


def _target(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What ``Tensor.to`` was asked to move to: ``device=``, else its first argument."""
    target = kwargs.get("device")
    if target is None and args:
        target = args[0]
    return target


def _is_accelerator(torch: Any, target: Any) -> bool:
    """True when ``target`` (a device, device string or index, or a tensor) is not the host."""
    if isinstance(target, torch.Tensor):
        return target.device.type not in ("cpu", "meta")
    if isinstance(target, torch.device):
        return target.type not in ("cpu", "meta")
    if isinstance(target, str):
        return not target.startswith(("cpu", "meta"))
    return isinstance(target, int) and not isinstance(target, bool)


def _timed_copy(state: TrainingState, original: Any, tensor: Any, args: Any, kwargs: Any,
                settings: ProgramSettings | None = None) -> Any:
    if settings is not None:
        non_blocking = bool(kwargs.get("non_blocking", False)) if kwargs else False
        if non_blocking not in settings.h2d_seen:  # the first copy of each kind: is its source pinned?
            settings.h2d(tensor, non_blocking)
    local = state.threads.me
    if local.in_forward or local.in_backward:
        # A copy the model makes inside its forward (or a hook in backward) is already forward
        # (backward) time: timing it as h2d too would count it twice (shares above 1).
        return original(tensor, *args, **kwargs)
    span = None
    try:
        span = state.begin_phase("h2d")
    except Exception as exc:  # noqa: BLE001
        report_internal(exc, Site.PATCH_H2D)
    try:
        return original(tensor, *args, **kwargs)
    finally:
        try:
            state.end_phase(span)
        except Exception as exc:  # noqa: BLE001
            report_internal(exc, Site.PATCH_H2D_END)


class _TimedIterator:
    """Wraps a DataLoader iterator: each ``next`` is a fetch, timed from call to return. It is
    also the pass over ``loader`` that automatic epochs follow (``TrainingState.start_pass``)."""

    __slots__ = ("_it", "_state", "pass_")

    def __init__(self, iterator: Any, state: TrainingState, loader: Any = None) -> None:
        self._it = iterator
        self._state = state
        # (loader, start of the pass): what the fetches name as their source. Not the iterator
        # itself, which would keep a finished pass's worker processes alive until the next fetch.
        self.pass_ = (loader, time.time_ns())

    def __iter__(self) -> _TimedIterator:
        return self

    def __next__(self) -> Any:
        start = time.time_ns()
        try:
            batch = next(self._it)  # StopIteration and user errors pass through untouched
        except StopIteration:
            try:
                self._state.end_pass(self.pass_, start)
            except Exception as exc:  # noqa: BLE001
                report_internal(exc, Site.PATCH_DATA_LOAD_END)
            raise
        try:
            self._state.record_fetch(start, time.time_ns(), self.pass_)
        except Exception as exc:  # noqa: BLE001
            report_internal(exc, Site.PATCH_DATA_LOAD)
        return batch

    def __len__(self) -> int:
        return len(self._it)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._it, name)


def _grad_scaler(torch: Any) -> Any:
    """``torch.amp.GradScaler`` (``torch.cuda.amp.GradScaler`` derives from it), when it
    defines ``scale`` itself."""
    amp = getattr(torch, "amp", None)
    scaler = getattr(amp, "GradScaler", None)
    return scaler if scaler is not None and callable(vars(scaler).get("scale")) else None


def _c10d(torch: Any) -> Any:
    """torch's c10d module when it has the function ``init_process_group`` sets the default group
    with: looked up at call time there, so patching it works however the user imported
    ``init_process_group``."""
    dist = getattr(torch, "distributed", None)
    try:
        if dist is None or not dist.is_available():
            return None
        c10d = dist.distributed_c10d
    except Exception:  # noqa: BLE001 - a torch without it: no process group identity
        return None
    return c10d if callable(getattr(c10d, "_update_default_pg", None)) else None


def _wrap_default_group(original: Any) -> Any:
    def _update_default_pg(pg: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(pg, *args, **kwargs)
        if pg is not None:  # None: destroy_process_group
            try:
                from .children import note_process_group

                note_process_group(pg)
            except Exception as exc:  # noqa: BLE001
                report_internal(exc, Site.PATCH_PROCESS_GROUP)
        return result

    return _update_default_pg
