"""A module imported at its first attribute read.

Every pytest-xdist worker imports every test module to collect it, whichever tests it then runs:
a test module that imports transformers and Lightning at its top costs each worker four seconds
of CPU before its first test. Such a module names them through ``lazy_module`` and pays on the
worker that runs one of its tests.
"""

from __future__ import annotations

import importlib
import importlib.util
import types
from typing import Any


class _LazyModule(types.ModuleType):
    """Reads of its public attributes go to the module itself. Patch the
    module by its dotted name (``monkeypatch.setattr("pkg.module.name", ...)``), not through the
    proxy: pytest's undo reads the target's ``__dict__``. Private and dunder names are not
    forwarded: collection probes every global of a test module for them (``__test__``,
    ``pytestmark``, ``_pytestfixturefunction``), which must not import anything."""

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("_") or attribute == "pytestmark":
            raise AttributeError(attribute)
        return getattr(importlib.import_module(self.__name__), attribute)


def lazy_module(name: str) -> Any:
    """``name``, imported when an attribute of it is first read (``sys.modules`` after that)."""
    return _LazyModule(name)


def installed(name: str) -> bool:
    """Whether the top-level package of ``name`` can be imported, without importing it."""
    return importlib.util.find_spec(name.partition(".")[0]) is not None
