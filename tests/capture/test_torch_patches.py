"""The torch patches (torch_patches.py): installed at init, removed at shutdown,
transparent to user exceptions, fail-open on their own errors, h2d only for accelerator copies,
and never a ``synchronize()``."""

from __future__ import annotations

import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from torch import nn
from torch.optim import optimizer as optim_module
from torch.utils.data import DataLoader, Dataset, TensorDataset

import stepwatch
from stepwatch import guard
from stepwatch.artifacts.spool import LoadedSpool
from stepwatch.capture import torch_patches
from stepwatch.capture.torch_patches import _is_accelerator, _target
from stepwatch.capture.training import TrainingState
from tests.support.capture import finish, start
from tests.support.spool_tree import named

pytestmark = pytest.mark.usefixtures("training_test")

STEPWATCH_DIR = str(Path(stepwatch.__file__).resolve().parent)
TARGETS = [(nn.Module, "__call__"), (torch.autograd, "backward"), (torch.autograd, "grad"),
           (DataLoader, "__iter__"), (torch.Tensor, "to"), (torch.Tensor, "cuda")]
# Taken at collection, before any test starts a runtime: whether each name is the owner's own
# attribute (Tensor.to is inherited from TensorBase) must be the same after every shutdown.
OWN_AT_IMPORT = {target: target[1] in vars(target[0]) for target in TARGETS}
OWN_CALL = nn.Module.__call__
REAL_ACCELERATOR_CHECK = torch_patches._accelerator_present  # the conftest makes it say yes


def names(spool: LoadedSpool, name: str) -> list[dict[str, Any]]:
    return sorted((s for s in spool.spans if s["name"] == name), key=lambda s: s["start_ns"])


def kids(spool: LoadedSpool, span: dict[str, Any]) -> list[str]:
    return [s["name"] for s in spool.spans if s["parent_id"] == span["id"]]


def train(epochs: int = 2, seed: int = 0) -> list[float]:
    """A small seeded training run with the full API; the same losses traced or not."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    loader = DataLoader(TensorDataset(torch.randn(24, 4), torch.randn(24, 1)), batch_size=5, shuffle=True)
    losses = []
    for _ in stepwatch.epochs(epochs):
        for x, y in loader:
            with stepwatch.trace_step(model):
                loss = nn.functional.mse_loss(model(x.to(torch.float32)), y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                stepwatch.mark("loss", loss)
                losses.append(loss.item())
    return losses


# -- install and uninstall -------------------------------------------------------------------


@pytest.mark.real
def test_patches_installed_at_init_and_restored_at_shutdown_twice(tmp_path: Path) -> None:
    originals = {target: getattr(*target) for target in TARGETS}
    own = {target: target[1] in vars(target[0]) for target in TARGETS}
    assert own == OWN_AT_IMPORT  # no earlier test left a class attribute behind either
    hooks = (len(optim_module._global_optimizer_pre_hooks), len(optim_module._global_optimizer_post_hooks))

    for cycle in range(2):
        start(tmp_path / f"run{cycle}")
        for target, original in originals.items():
            patched = getattr(*target)
            assert patched is not original, target
            assert patched.__wrapped__ is original and patched.__name__ == original.__name__
        assert len(optim_module._global_optimizer_pre_hooks) == hooks[0] + 1
        assert len(optim_module._global_optimizer_post_hooks) == hooks[1] + 1
        train(epochs=1)
        spool = finish(tmp_path / f"run{cycle}")

        for target, original in originals.items():
            assert getattr(*target) is original, target
            assert (target[1] in vars(target[0])) == own[target], target  # no leftover class attribute
        assert (len(optim_module._global_optimizer_pre_hooks), len(optim_module._global_optimizer_post_hooks)) == hooks
        steps = names(spool, "step")
        assert len(steps) == 5
        assert all(sorted(kids(spool, s)) == ["backward", "data_load", "forward", "optimizer_step"] for s in steps)
        # the versions the process trains with, once a runtime, with its first loader's settings
        versions = [m for m in spool.marks if m["name"] == "stepwatch.versions"]
        assert [(m["value"], m["kind"], m["attrs"]["torch"]) for m in versions] == [
            (torch.__version__, "summary", torch.__version__)]


def test_a_compiled_model_is_one_graph_and_its_steps_are_recorded(tmp_path: Path) -> None:
    """torch.compile goes straight to each submodule's forward under stepwatch as it does
    without it (no graph break at our ``__call__``), here with its compiler imported before
    stepwatch starts; at shutdown the compiler holds torch's own ``__call__`` again."""
    dynamo = pytest.importorskip("torch._dynamo")
    from torch._dynamo import utils as dynamo_utils
    from torch._dynamo.variables import nn_module as dynamo_modules

    dynamo.reset()
    dynamo_utils.counters.clear()
    start(tmp_path)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3)], nn.Linear(8, 1))
    compiled = torch.compile(model, backend="eager")
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        loss = compiled(torch.randn(4, 8)).pow(2).mean()
        sgd.zero_grad()
        loss.backward()
        sgd.step()
    try:
        assert dict(dynamo_utils.counters["graph_break"]) == {}
        assert dynamo_utils.counters["stats"]["unique_graphs"] == 1, dict(dynamo_utils.counters)  # the whole model
    finally:
        spool = finish(tmp_path)
        dynamo.reset()
    assert len(named(spool, "step")) == 3 and len(named(spool, "forward")) == 3
    assert dynamo_utils.unpatched_nn_module_call is OWN_CALL and dynamo_modules.unpatched_nn_module_call is OWN_CALL


def test_a_process_that_never_trains_records_no_versions(tmp_path: Path) -> None:
    start(tmp_path)  # torch is imported: the patches go in
    stepwatch.mark("only", 1)
    nn.Linear(2, 1)(torch.ones(1, 2))  # a forward alone: no loader, optimizer or copy
    spool = finish(tmp_path)
    assert [m["name"] for m in spool.marks] == ["only"]


@pytest.mark.real
@pytest.mark.skipif(torch.accelerator.is_available(), reason="tests the path of a host with no accelerator")
def test_without_an_accelerator_tensor_to_stays_torchs_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No device, no host-to-device copy: ``Tensor.to``/``.cuda`` are left alone (this torch is
    CPU-only: the check is torch's own), and the other phases are recorded as ever."""
    monkeypatch.setattr(torch_patches, "_accelerator_present", REAL_ACCELERATOR_CHECK)
    to, cuda = torch.Tensor.to, torch.Tensor.cuda
    start(tmp_path)
    assert torch.Tensor.to is to and torch.Tensor.cuda is cuda
    assert nn.Module.__call__ is not OWN_CALL  # the rest is patched
    train(epochs=1)
    spool = finish(tmp_path)
    steps = names(spool, "step")
    assert len(steps) == 5 and not names(spool, "h2d")
    assert all(sorted(kids(spool, s)) == ["backward", "data_load", "forward", "optimizer_step"] for s in steps)


# -- user exceptions pass through untouched --------------------------------------------------


class UserError(Exception):
    pass


_raised: list[UserError] = []


def _boom(where: str) -> None:
    error = UserError(where)
    _raised.append(error)
    raise error


class _ForwardRaises(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _boom("forward")
        return x


class _BackwardRaises(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        _boom("backward")
        return grad


class _StepRaises(torch.optim.SGD):
    def step(self, closure: Any = None) -> Any:
        _boom("optimizer_step")


class _GetitemRaises(Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        _boom("data_load")
        return torch.zeros(4)


class _ToRaises(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", None) in ("to", "cuda"):
            _boom("h2d")
        return super().__torch_function__(func, types, args, kwargs or {})


def _forward(model: nn.Module, x: torch.Tensor) -> None:
    with stepwatch.trace_step(model):
        model(x)


def _backward(model: nn.Module, x: torch.Tensor) -> None:
    with stepwatch.trace_step(model):
        _BackwardRaises.apply(model(x)).sum().backward()


def _optimizer(model: nn.Module, x: torch.Tensor) -> None:
    optimizer = _StepRaises(model.parameters(), lr=0.1)
    with stepwatch.trace_step(model):
        model(x).sum().backward()
        optimizer.step()


def _data(model: nn.Module, x: torch.Tensor) -> None:
    for batch in DataLoader(_GetitemRaises(), batch_size=2):
        with stepwatch.trace_step(model):
            model(batch)


def _to(model: nn.Module, x: torch.Tensor) -> None:
    with stepwatch.trace_step(model):
        x.as_subclass(_ToRaises).to("cuda", non_blocking=True)


SITES = {"forward": _forward, "backward": _backward, "optimizer_step": _optimizer, "data_load": _data, "h2d": _to}


def _raise_at(site: str) -> tuple[UserError, UserError]:
    torch.manual_seed(0)
    model = _ForwardRaises() if site == "forward" else nn.Linear(4, 1)
    with pytest.raises(UserError) as caught:
        SITES[site](model, torch.randn(2, 4))
    return caught.value, _raised[-1]


def _user_frames(error: BaseException) -> list[tuple[str, str, int | None]]:
    return [(f.filename, f.name, f.lineno) for f in traceback.extract_tb(error.__traceback__)
            if not f.filename.startswith(STEPWATCH_DIR)]


@pytest.mark.real
@pytest.mark.parametrize("site", list(SITES))
def test_user_exceptions_propagate_unchanged(tmp_path: Path, site: str) -> None:
    plain, plain_raised = _raise_at(site)  # no runtime: the reference traceback
    assert plain is plain_raised

    start(tmp_path)
    traced, traced_raised = _raise_at(site)
    spool = finish(tmp_path)

    assert traced is traced_raised  # the very object the user's code raised
    assert traced.args == (site,)
    assert _user_frames(traced) == _user_frames(plain)  # only stepwatch's own frames were added
    assert traceback.extract_tb(traced.__traceback__)[-1].name == "_boom"
    assert type(traced.__context__) is type(plain.__context__) and traced.__cause__ is None
    if site != "data_load":  # the fetch fails before a step opens
        (step,) = names(spool, "step")
        assert step["attrs"]["error"] == "UserError"
        assert site in kids(spool, step)


@pytest.mark.real
def test_training_goes_on_after_an_optimizer_error(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    failing = _StepRaises(model.parameters(), lr=0.1)
    working = torch.optim.SGD(model.parameters(), lr=0.1)
    start(tmp_path)
    with pytest.raises(UserError):
        with stepwatch.trace_step(model):
            model(torch.randn(2, 4)).sum().backward()
            failing.step()
    for _ in range(3):
        with stepwatch.trace_step(model):
            model(torch.randn(2, 4)).sum().backward()
            working.step()
            working.zero_grad()
    spool = finish(tmp_path)

    first, *rest = names(spool, "step")
    (dangling,) = [s for s in names(spool, "optimizer_step") if s["parent_id"] == first["id"]]
    assert dangling["attrs"] == {"unclosed": True}  # its post hook never ran
    assert len(rest) == 3
    for step in rest:
        assert sorted(kids(spool, step)) == ["backward", "forward", "optimizer_step"]
        assert "error" not in step["attrs"] and step["attrs"]["optimizer_step_ns"] > 0


class _SleepySGD(torch.optim.SGD):
    def step(self, closure: Any = None) -> Any:
        time.sleep(0.002)
        result = super().step(closure)  # SGD.step has torch's hook wrapper too
        time.sleep(0.002)
        return result


@pytest.mark.real
def test_nested_optimizer_steps_are_one_phase(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    torch.optim.SGD(model.parameters(), lr=0.1)  # SGD.step itself gets torch's hook wrapper
    optimizer = _SleepySGD(model.parameters(), lr=0.1)
    start(tmp_path)
    for _ in range(3):
        with stepwatch.trace_step(model):
            model(torch.randn(2, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    spool = finish(tmp_path)

    steps = names(spool, "step")
    assert len(steps) == 3
    for step in steps:
        (phase,) = [s for s in names(spool, "optimizer_step") if s["parent_id"] == step["id"]]
        assert "unclosed" not in phase["attrs"]
        assert kids(spool, phase) == []
        assert step["attrs"]["optimizer_step_ns"] == phase["end_ns"] - phase["start_ns"] >= 4_000_000


# -- submodule calls ------------------------------------------------------------------------


class _Depth(nn.Module):
    """Records, at each call of its forward, how many frames lie between it and ``outer``'s."""

    def __init__(self, frames: list[int], inner: nn.Module | None = None) -> None:
        super().__init__()
        self.frames = frames
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inner is not None:
            return self.inner(x)
        frame, depth = sys._getframe().f_back, 1
        while frame is not None and frame.f_code is not _Depth.forward.__code__:
            frame, depth = frame.f_back, depth + 1
        self.frames.append(depth)
        return x * 2


def test_submodule_calls_cost_no_frame_of_their_own(tmp_path: Path) -> None:
    """The wrapper's cost per submodule call must not grow a step with the model's depth (issue
    15: ~1.5k instructions a module call, a Python frame more than torch's own): between an
    outer forward and a submodule's forward lie as many frames as without stepwatch."""
    frames: list[int] = []
    model = _Depth(frames, inner=_Depth(frames))
    x = torch.ones(2)
    model(x)
    start(tmp_path)
    with stepwatch.trace_step(model):
        traced = model(x)
    inferred = model(x)  # no trace_step: still one forward, the outer call
    spool = finish(tmp_path)

    assert frames == [frames[0]] * 3  # plain, traced, inferred
    assert torch.equal(traced, inferred) and torch.equal(traced, x * 2)
    assert len(names(spool, "forward")) == 2


def test_a_submodule_compiled_call_is_the_one_called(tmp_path: Path) -> None:
    """``Module.compile()`` sets ``_compiled_call_impl``; torch's ``__call__`` calls it instead
    of ``_call_impl``, and so does the wrapper's path for submodule calls."""
    calls: list[int] = []
    inner = nn.Linear(2, 2)
    inner._compiled_call_impl = lambda x: calls.append(1) or x + 1  # type: ignore[assignment]
    model = nn.Sequential(inner)
    start(tmp_path)
    with stepwatch.trace_step(model):
        out = model(torch.zeros(2))
    finish(tmp_path)
    assert calls == [1] and torch.equal(out, torch.ones(2))


def test_a_wrapper_around_the_traced_model_leaves_the_forward_to_it(tmp_path: Path) -> None:
    """``trace_step(model)`` with a wrapper called (DDP, a compile wrapper): the wrapper's call
    is not the model's, and the model's call inside it is the forward. A guard for the short
    path of submodule calls, which must not swallow it."""
    model = nn.Linear(2, 2)
    wrapper = nn.Sequential(model)
    start(tmp_path)
    with stepwatch.trace_step(model):
        wrapper(torch.zeros(2))
    spool = finish(tmp_path)
    (step,) = names(spool, "step")
    assert kids(spool, step) == ["forward"]


def test_a_thread_started_in_a_forward_has_its_own_forward(tmp_path: Path) -> None:
    """Whether a forward is open is per thread: a module called by a thread that the model's
    forward starts (DataParallel's replicas) is that thread's own outer call, its own forward."""
    began: list[tuple[str, int]] = []
    real = TrainingState.phase_begin

    def spy(self: TrainingState, local: Any, name: str, *args: Any, **kwargs: Any) -> Any:
        began.append((name, threading.get_ident()))
        return real(self, local, name, *args, **kwargs)

    other = nn.Linear(2, 2)

    class _Spawns(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            worker = threading.Thread(target=other, args=(x,))
            worker.start()
            worker.join()
            return x

    start(tmp_path)
    with mock.patch.object(TrainingState, "phase_begin", spy):
        _Spawns()(torch.zeros(2))
    stepwatch.shutdown()
    forwards = [ident for name, ident in began if name == "forward"]
    assert len(forwards) == 2 and len(set(forwards)) == 2


# -- stepwatch's own failures are swallowed, counted and change nothing ----------------------


def _raise_internal(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("stepwatch bug (injected)")


@pytest.mark.real
@pytest.mark.parametrize("method", ["phase_begin", "phase_end", "record_fetch", "open_step"])
def test_internal_failure_is_swallowed_and_training_unchanged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              method: str) -> None:
    reference = train()
    monkeypatch.setattr(TrainingState, method, _raise_internal)
    start(tmp_path)
    traced = train()
    stepwatch.shutdown()

    assert traced == reference  # bit-identical losses with the same seed
    counts = guard.swallowed()
    assert counts and sum(counts.values()) >= len(reference)
    assert all(isinstance(e, RuntimeError) for e in guard.recent_swallowed())
    guard.reset_swallowed()  # expected here; the fixture fails on anything else


# -- host to device --------------------------------------------------------------------------


class _FakeDeviceCopy(torch.Tensor):
    """A CPU tensor whose .to(<accelerator>) / .cuda() is a slow plain copy, as on a GPU host."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", None) in ("to", "cuda"):
            time.sleep(0.002)
            with torch._C.DisableTorchFunctionSubclass():
                return args[0].clone()
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.real
def test_h2d_spans_only_for_accelerator_copies(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    x = torch.randn(2, 4)
    start(tmp_path)
    with stepwatch.trace_step(model):  # host-side conversions: no h2d
        x.to("cpu")
        x.to(torch.float64)
        x.to(device="cpu", dtype=torch.float16)
        x.to(torch.empty(0))
        model(x).sum().backward()
    with stepwatch.trace_step(model):  # copies to an accelerator: one h2d span each
        fake = x.as_subclass(_FakeDeviceCopy)
        moved = fake.to("cuda", non_blocking=True)
        fake.cuda()
        model(moved).sum().backward()
    spool = finish(tmp_path)

    host, device = names(spool, "step")
    assert "h2d" not in kids(spool, host) and host["attrs"]["h2d_ns"] == 0
    copies = [s for s in names(spool, "h2d") if s["parent_id"] == device["id"]]
    assert len(copies) == 2
    h2d_ns = sum(s["end_ns"] - s["start_ns"] for s in copies)
    assert device["attrs"]["h2d_ns"] == h2d_ns >= 4_000_000
    busy = sum(device["attrs"][f"{p}_ns"] for p in ("h2d", "forward", "backward", "optimizer_step"))
    assert device["attrs"]["wait_ns"] == max(0, device["attrs"]["step_ns"] - busy)


_cuda_tensor = mock.Mock(spec=torch.Tensor)
_cuda_tensor.device = torch.device("cuda", 0)


@pytest.mark.parametrize(("args", "kwargs", "expected"), [
    (("cuda",), {}, True), (("cuda:1",), {}, True), (("mps",), {}, True), (("xpu:0",), {}, True),
    ((torch.device("cuda", 0),), {}, True), ((0,), {}, True), ((3,), {}, True),
    ((), {"device": "cuda"}, True), ((torch.float16,), {"device": torch.device("cuda")}, True),
    ((_cuda_tensor,), {}, True),
    (("cpu",), {}, False), (("meta",), {}, False), ((torch.device("cpu"),), {}, False), ((True,), {}, False),
    ((torch.float16,), {}, False), ((), {"dtype": torch.float16}, False), ((), {}, False), ((None,), {}, False),
    ((torch.empty(0),), {}, False), ((torch.empty(0, device="meta"),), {}, False),
])
def test_targets_accelerator(args: tuple[Any, ...], kwargs: dict[str, Any], expected: bool) -> None:
    assert _is_accelerator(torch, _target(args, kwargs)) is expected  # as the Tensor.to wrapper decides


# -- never synchronize -----------------------------------------------------------------------


@pytest.mark.real
def test_never_synchronizes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def forbidden(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> None:
            calls.append(name)
            raise AssertionError(f"{name} called during a traced run")
        return call

    monkeypatch.setattr(torch.cuda, "synchronize", forbidden("torch.cuda.synchronize"))
    monkeypatch.setattr(torch.cuda.Event, "synchronize", forbidden("Event.synchronize"))
    monkeypatch.setattr(torch.cuda.Stream, "synchronize", forbidden("Stream.synchronize"))
    start(tmp_path, spool_interval=0.05, interval=0.02)
    losses = train(epochs=2)
    stepwatch.snapshot(nn.Linear(2, 2), "full")
    time.sleep(0.1)  # a few background ticks and seals too
    spool = finish(tmp_path)

    assert calls == []
    assert len(losses) == 10 and len(names(spool, "step")) == 10


def test_misused_patched_calls_raise_what_torch_raises(tmp_path: Path) -> None:
    """The patches read their arguments before calling torch: an unbound call with nothing to
    call on still raises torch's own error type, not one of ours."""
    def errors() -> list[type[BaseException]]:
        found = []
        for call in (lambda: nn.Module.__call__(), lambda: torch.Tensor.to(), lambda: torch.Tensor.to(device="cuda"),
                     lambda: torch.Tensor.to("not a tensor", "cuda")):
            with pytest.raises(Exception) as caught:
                call()
            found.append(type(caught.value))
        return found

    plain = errors()
    start(tmp_path)
    assert errors() == plain
