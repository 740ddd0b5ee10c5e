"""Fail-open in one place: every swallowed error names a declared ``Site``, no site is named by
two modules, and the server and store log through the ``stepwatch`` logger, not print."""

from __future__ import annotations

import ast
import enum
import logging
import subprocess
import sys
from collections import defaultdict

import pytest

from stepwatch.guard import Site

from ._source import SRC, modules

# Call sites still passing a site as a string literal: the modules being rewritten elsewhere.
# Their strings must still be declared members, so switching them to ``Site.X`` changes nothing.
_LITERAL_SITES_ALLOWED = {"stepwatch.capture.training", "stepwatch.capture.torch_patches"}


def _site_uses() -> tuple[dict[str, set[str]], list[str]]:
    """Site member value -> modules naming it; and the calls whose site is not a declared name."""
    users: dict[str, set[str]] = defaultdict(set)
    bad: list[str] = []
    for name, (path, tree) in modules().items():
        if name == "stepwatch.guard":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "Site":
                users[Site[node.attr].value].add(name)
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "report_internal"):
                continue
            if len(node.args) < 2:
                continue
            site = node.args[1]
            where = f"{path.relative_to(SRC.parent)}:{node.lineno}"
            if isinstance(site, ast.Constant):
                if name not in _LITERAL_SITES_ALLOWED or site.value not in Site._value2member_map_:
                    bad.append(f"{where}: {site.value!r}")
                else:
                    users[site.value].add(name)
            elif isinstance(site, ast.Subscript) and ast.unparse(site.value) == "self.sites":
                continue  # FrameworkLink: its members are counted below, from its table
            elif not (isinstance(site, ast.Attribute) and ast.unparse(site.value) == "Site"):
                bad.append(f"{where}: {ast.unparse(site)}")
    from stepwatch.capture import integrations

    for sites in integrations._SITES.values():
        for site in sites.values():
            users[site.value].add("stepwatch.capture.integrations")
    return users, bad


def test_every_reported_site_is_a_declared_member_named_by_one_module() -> None:
    users, bad = _site_uses()
    assert bad == [], "report_internal must name a stepwatch.guard.Site member"
    shared = {site: sorted(mods) for site, mods in users.items() if len(mods) > 1}
    assert shared == {}, "a site named by two modules: their errors would share one count and one log line"
    assert sorted(set(Site._value2member_map_) - set(users)) == [], "declared sites that nothing reports"


def test_a_repeated_site_name_fails_at_import() -> None:
    with pytest.raises(ValueError, match="duplicate"):
        enum.unique(enum.StrEnum("Twice", {"A": "sink.append", "B": "sink.append"}))  # type: ignore[call-overload]
    source = (SRC / "guard.py").read_text()
    assert "@enum.unique\nclass Site(enum.StrEnum)" in source


def test_capture_and_transport_use_the_one_guard() -> None:
    """There is one guard module, at the top of the package."""
    assert not (SRC / "capture" / "guard.py").exists()
    for name, (_, tree) in modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module is not None:
                assert not node.module.endswith("capture.guard"), name


def _prints_to_stderr(tree: ast.AST) -> list[int]:
    lines = []
    for func in ast.walk(tree):
        if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef) or func.name == "main":
            continue  # a CLI's main() answers its user on stderr: that is output, not logging
        for node in ast.walk(func):
            if not isinstance(node, ast.Call):
                continue
            text = ast.unparse(node.func)
            if text == "sys.stderr.write" or (
                    text == "print" and any(k.arg == "file" and ast.unparse(k.value) == "sys.stderr"
                                            for k in node.keywords)):
                lines.append(node.lineno)
    return lines


def test_server_and_store_log_instead_of_printing() -> None:
    printing = {}
    for name, (_, tree) in modules().items():
        if name.startswith(("stepwatch.server", "stepwatch.store")) and (lines := _prints_to_stderr(tree)):
            printing[name] = lines
    assert printing == {}


@pytest.mark.real
def test_the_server_entry_sends_the_stepwatch_logger_to_stderr() -> None:
    """The aggregator's warnings keep their ``[stepwatch] ...`` line on a served process's stderr."""
    code = ("import logging, sys; from stepwatch.log import log_to_stderr; log_to_stderr(); log_to_stderr();"
            "logging.getLogger('stepwatch').warning('aggregator: refused a frame (%s): %s', 'oversize', 'x');"
            "logging.getLogger('stepwatch').info('not shown twice')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert proc.stderr.splitlines() == ["[stepwatch] aggregator: refused a frame (oversize): x",
                                        "[stepwatch] not shown twice"]
    from stepwatch.log import logger

    assert logging.getLogger("stepwatch.internal").parent is logger
