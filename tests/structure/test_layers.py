"""Data flows one way: capture -> artifacts -> store -> analysis -> surfaces. Each package may
import only the packages below it in this table (typing-only imports included); a definition two
layers share lives below both (``schema``, ``guard``, ``nvml``, ``phases``...)."""

from __future__ import annotations

from ._graph import import_graph

# The foundation: modules any layer may import, which import no layer themselves.
_FOUNDATION = frozenset({"stepwatch", "errors", "_decode", "guard", "lifetime", "log", "nvml", "phases", "schema"})

# package (second part of the dotted name) -> what it may import besides itself and the foundation.
ALLOWED: dict[str, frozenset[str]] = {
    # the foundation, among itself: only the errors and the phase names
    "stepwatch": frozenset(),  # the root's facade names its lazy modules as strings, imports none
    "errors": frozenset(),
    "_decode": frozenset({"errors"}),  # file decoding that names the file in its errors
    "guard": frozenset(),
    "lifetime": frozenset(),  # a process dies with its parent (prctl), for the launcher and the ranks
    "log": frozenset(),
    "nvml": frozenset(),
    "phases": frozenset(),
    "schema": frozenset({"errors", "phases"}),
    # file formats: read and written by capture, the store and the surfaces alike
    "artifacts": _FOUNDATION,
    # the wire: the ranks' senders and the aggregator's decoder
    "transport": _FOUNDATION,
    # the training process: writes artifacts, sends frames
    "capture": _FOUNDATION | {"artifacts", "transport"},
    # the history: reads artifacts into rows; knows no wire and no capture
    "store": _FOUNDATION | {"artifacts"},
    # reads the history and the artifacts
    "analysis": _FOUNDATION | {"artifacts", "store"},
    # what the surfaces show, computed once from the history (stepwatch/views)
    "views": _FOUNDATION | {"artifacts", "store", "analysis"},
    # feeds in other tools' formats (the Perfetto trace), built from the history
    "exports": _FOUNDATION | {"artifacts", "store", "analysis"},
    # the dashboard and the HTML report: render the views
    "web": _FOUNDATION | {"artifacts", "store", "analysis", "views"},
    # the aggregator and the launcher: the wire in, the history, the final summary (and the
    # dashboard it serves with --ui-port, the report run --report writes)
    "server": _FOUNDATION | {"artifacts", "transport", "store", "analysis", "views", "web"},
    # surfaces: the public loading facade and the CLI
    "telemetry": _FOUNDATION | {"artifacts", "capture"},
    "ui": _FOUNDATION | {"artifacts", "capture", "store", "analysis", "server", "views", "web", "exports"},
    "__main__": frozenset({"ui"}),
}


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_every_package_has_a_row_in_the_table() -> None:
    assert {_package(m) for m in import_graph()} <= set(ALLOWED)


def test_imports_run_down_the_layers_only() -> None:
    against = []
    for module, targets in sorted(import_graph(typing_too=True).items()):
        layer = _package(module)
        for target in sorted(targets):
            other = _package(target)
            if other != layer and other not in ALLOWED[layer]:
                against.append(f"{module} imports {target}")
    assert against == []
