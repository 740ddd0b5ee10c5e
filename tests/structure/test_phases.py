"""The phase names come from one table (``stepwatch.phases``): the capture's span names and step
attrs, the history's ``steps`` columns, the span-tree derivation and the summary's shares are
all derived from it, and a step's row is the same whichever way it reaches the history."""

from __future__ import annotations

import ast

from hypothesis import given
from hypothesis import strategies as st

from stepwatch.analysis import summary
from stepwatch.capture import spans
from stepwatch.phases import PHASES, RESIDUAL, SHARES, SPAN_NAMES, STEP_ATTRS, STEP_COLUMNS
from stepwatch.store.base import COLUMNS
from stepwatch.store.rows import derive_steps, step_row

from ._source import modules

S = "00000000-0000-4000-8000-000000000001"
_ALL_NAMES = {*SPAN_NAMES, *SHARES, *STEP_ATTRS, *STEP_COLUMNS}


def test_optimizer_is_the_optimizer_step_phase_under_its_summary_name() -> None:
    optimizer = next(p for p in PHASES if p.share == "optimizer")
    assert (optimizer.span, optimizer.attr, optimizer.column) == ("optimizer_step", "optimizer_step_ns", "optimizer_ns")
    assert RESIDUAL.share == "wait" and SHARES[-1] == "wait"


def test_every_user_derives_its_names_from_the_table() -> None:
    assert spans.PHASES == SPAN_NAMES
    assert summary.PHASES == SHARES
    assert [c for c, _ in COLUMNS["steps"]][5:] == ["step_ns", *STEP_COLUMNS]
    assert tuple(spans.step_attrs(spans.OpenSpan(1, "step", None, 0, 0, None, 1), 10)) == ("step_ns", *STEP_ATTRS)


def test_no_module_spells_a_list_of_phase_names() -> None:
    """A tuple, list, set or dict of three or more phase names outside the table is a second
    definition that the next phase (``recompute``) would miss."""
    spelled = []
    for name, (path, tree) in modules().items():
        if name == "stepwatch.phases":
            continue
        for node in ast.walk(tree):
            items = node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else \
                node.keys if isinstance(node, ast.Dict) else []
            names = {i.value for i in items if isinstance(i, ast.Constant) and i.value in _ALL_NAMES}
            if len(names) >= 3:
                spelled.append(f"{path.name}:{node.lineno}: {sorted(names)}")
    assert spelled == []


_times = st.lists(st.integers(0, 10**12), min_size=len(PHASES), max_size=len(PHASES))


@given(_times, st.integers(0, 10**13))
def test_a_step_row_is_the_same_from_its_attrs_and_from_its_span_tree(times: list[int], step_ns: int) -> None:
    """stepwatch's steps carry their breakdown in attrs (``step_attrs``); the SDK's are derived
    from their phase children (``derive_steps``). Both give one row, with the residual as wait."""
    start = 1_000
    open_step = spans.OpenSpan(7, "step", None, 3, start, None, 1,
                               phase_ns=dict(zip(SPAN_NAMES, times)))
    attrs = spans.step_attrs(open_step, start + step_ns)
    from_attrs = step_row({"name": "step", "index": 3, "start_ns": start, "end_ns": start + step_ns,
                           "attrs": attrs}, S, 0)
    children = [(f"c{i}", "s", phase.span, None, 0, took, None) for i, (phase, took) in enumerate(zip(PHASES, times))]
    derived = derive_steps(S, 0, [("s", None, "step", 3, start, start + step_ns, None), *children])
    assert from_attrs is not None and len(derived) == 1
    assert tuple(from_attrs[c] for c, _ in COLUMNS["steps"]) == derived[0]
    spent = sum(t for phase, t in zip(PHASES, times) if phase.in_residual)
    assert from_attrs[RESIDUAL.column] == max(0, step_ns - spent)
