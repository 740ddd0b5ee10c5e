"""Put on ``PYTHONPATH`` by the suite (tests/conftest.py), so every process the suite starts
imports torch's compiler only if something compiles.

torch imports ``torch._dynamo`` the first time an optimizer is built or steps (1.3 s of CPU,
more than most test programs' whole training): ``Optimizer.add_param_group`` and ``zero_grad``
and the functional optimizers are wrapped in ``torch._disable_dynamo``, and every built-in
optimizer's ``step`` in ``_use_grad_for_differentiable``, which calls ``torch._dynamo.
graph_break()``. Until ``torch._dynamo`` has been imported no frame can be compiling, so both
are no-ops: this gives them wrappers that go straight to the function until then, and to torch's
own wrapper after. Numerically nothing changes (tests/structure/test_eager_torch.py trains the
same model with and without it), and each program still runs real torch.

Nothing here may break a process: a torch whose internals moved is left alone (the suite is
then slower, not wrong). Like stepwatch's own ``sitecustomize`` this module then steps aside
and imports the environment's next one.
"""

from __future__ import annotations

import functools
import importlib.machinery
import os
import sys
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))


def _compiler_loaded() -> bool:
    return "torch._dynamo" in sys.modules


def _lazy_disable_dynamo(original: Any) -> Any:
    def disable_dynamo(fn: Any = None, recursive: bool = True) -> Any:
        if fn is None:
            return functools.partial(disable_dynamo, recursive=recursive)
        disabled = original(fn, recursive)

        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            return disabled(*args, **kwargs) if _compiler_loaded() else fn(*args, **kwargs)

        return inner

    return disable_dynamo


def _lazy_use_grad(original: Any) -> Any:
    def use_grad_for_differentiable(func: Any) -> Any:
        with_breaks = original(func)

        @functools.wraps(func)
        def use_grad(*args: Any, **kwargs: Any) -> Any:
            if _compiler_loaded():
                return with_breaks(*args, **kwargs)
            import torch

            before = torch.is_grad_enabled()
            try:
                torch.set_grad_enabled(args[0].defaults["differentiable"])
                return func(*args, **kwargs)
            finally:
                torch.set_grad_enabled(before)

        return use_grad

    return use_grad_for_differentiable


# module -> (attribute, what wraps it), each replaced the moment the module has run
_PATCHES = {
    "torch._compile": ("_disable_dynamo", _lazy_disable_dynamo),
    "torch.optim.optimizer": ("_use_grad_for_differentiable", _lazy_use_grad),
}


class _Finder:
    """A meta path finder needs only ``find_spec``: ``importlib.abc`` would import
    ``importlib.resources`` (and ``tempfile``, ``zipfile``) into each of the suite's processes."""

    def __init__(self) -> None:
        self.pending = dict(_PATCHES)

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        patch = self.pending.pop(name, None)
        if patch is None:
            return None
        if not self.pending:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        attribute, wrap = patch
        exec_module = spec.loader.exec_module

        def exec_and_patch(module: Any) -> None:
            exec_module(module)
            original = getattr(module, attribute, None)
            if callable(original):
                setattr(module, attribute, wrap(original))

        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


if "torch" not in sys.modules:
    sys.meta_path.insert(0, _Finder())

# step aside for the environment's own sitecustomize, if any
_me = sys.modules.pop("sitecustomize", None)
_path = sys.path[:]
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
try:
    import sitecustomize  # noqa: F401
except ImportError:
    pass
finally:
    sys.path[:] = _path
    if "sitecustomize" not in sys.modules and _me is not None:
        sys.modules["sitecustomize"] = _me
