"""No import cycles: every module imports on its own in a fresh interpreter, and the package's
import graph (every import statement, lazy ones too) has no cycle."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from ._graph import cycles, import_graph
from ._source import SRC, modules

# Each module in a child forked from an interpreter that has imported nothing of stepwatch: a
# module that only imports in some order (a cycle that happens to resolve) fails here. The
# libraries stepwatch's modules use are imported once before the forks, so that each child
# spends its time on stepwatch's own modules.
_IMPORT_EACH = """
import importlib, os, sys, traceback
for library in ("asyncio", "concurrent.futures", "json", "logging", "sqlite3", "msgspec", "click", "rich.console",
                "numpy", "aiohttp.web", "psutil"):
    try:
        importlib.import_module(library)
    except ImportError:
        pass
assert not any(name.startswith("stepwatch") for name in sys.modules)
failed = []
for name in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            # an optional integration whose library is missing says so with its own error
            code = 0 if type(exc).__name__ == "IntegrationUnavailable" else 1
            traceback.print_exc()
            os._exit(code)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if status != 0:
        failed.append(name)
print("FAILED", *failed)
"""


def test_the_import_graph_has_no_cycle() -> None:
    found = cycles()
    assert found == [], "modules that import each other (directly or through others)"


def test_the_store_interface_knows_no_backend() -> None:
    assert not any(m.startswith("stepwatch.store") for m in import_graph()["stepwatch.store.base"])
    assert "stepwatch.store.sqlite" in import_graph()["stepwatch.store.open"]


_HEAVY = ("torch", "lightning", "transformers", "tensorflow", "numpy")


def _imports_heavy_library_at_top(tree: ast.Module) -> bool:
    """The framework integrations and patches load a framework at import (seconds on a shared
    machine, for each); the graph test above covers them."""
    top = [n for stmt in tree.body for n in ([stmt] if not isinstance(stmt, ast.Try) else stmt.body)]
    for node in top:
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
        if any(n.split(".")[0] in _HEAVY for n in names):
            return True
    return False


@pytest.mark.real
def test_every_module_imports_alone_in_a_fresh_interpreter() -> None:
    names = sorted(n for n, (_, tree) in modules().items()
                   if not n.endswith("__main__") and "_autostart" not in n and not _imports_heavy_library_at_top(tree))
    assert "stepwatch.store.sqlite" in names and "stepwatch.capture.runtime" in names
    proc = subprocess.run([sys.executable, "-c", _IMPORT_EACH, *names], capture_output=True, text=True,
                          timeout=600, cwd=SRC.parent)
    assert proc.stdout.strip() == "FAILED", proc.stdout + proc.stderr[-4000:]
