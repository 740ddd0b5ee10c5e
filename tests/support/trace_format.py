"""The Trace Event Format's documented rules, checked on a parsed trace: the tests of the
Perfetto export on a real run and on synthetic histories share them."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

PHASES = {"X", "M", "C", "i"}  # what the export writes: complete, metadata, counter, instant
METADATA = {"process_name", "process_sort_index", "thread_name", "thread_sort_index"}


def format_problems(trace: dict[str, Any]) -> list[str]:
    """Every break of the format's rules in ``trace`` (empty: none): the JSON object format,
    the phases, each phase's required fields and their types, integer microsecond times, the
    instant scopes, numeric counter series."""
    problems: list[str] = []
    events = trace.get("traceEvents")
    if not isinstance(events, list):
        return ["traceEvents is not a list"]
    for n, e in enumerate(events):
        where = f"event {n} {e.get('ph')} {e.get('name')!r}"
        if e.get("ph") not in PHASES:
            problems.append(f"{where}: phase not one of {sorted(PHASES)}")
            continue
        if not isinstance(e.get("name"), str) or type(e.get("pid")) is not int or type(e.get("tid")) is not int:
            problems.append(f"{where}: name, pid and tid are required (a string and two integers)")
        if e["ph"] == "M":
            key = "sort_index" if e["name"].endswith("sort_index") else "name"
            if e["name"] not in METADATA or key not in e.get("args", {}):
                problems.append(f"{where}: metadata event without args.{key}")
            continue
        if type(e.get("ts")) is not int or e["ts"] < 0:
            problems.append(f"{where}: ts is not a non-negative integer of microseconds")
        if e["ph"] == "X" and (type(e.get("dur")) is not int or e["dur"] < 0 or not isinstance(e.get("cat"), str)):
            problems.append(f"{where}: a complete event needs an integer dur >= 0 and a cat")
        if e["ph"] == "i" and e.get("s") not in ("g", "p", "t"):
            problems.append(f"{where}: an instant event's scope s must be g, p or t")
        if e["ph"] == "C":
            args = e.get("args")
            if not isinstance(args, dict) or not args or not all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) for v in args.values()):
                problems.append(f"{where}: a counter's args must be numeric series")
    return problems


def nesting_problems(events: list[dict[str, Any]]) -> list[str]:
    """Complete events of one thread track that overlap without nesting."""
    tracks: dict[tuple[int, int], list[tuple[int, int, str]]] = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            tracks[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    problems = []
    for track, spans in tracks.items():
        spans.sort(key=lambda s: (s[0], -s[1]))
        stack: list[tuple[int, int, str]] = []
        for span in spans:
            while stack and stack[-1][1] <= span[0]:
                stack.pop()
            if stack and span[1] > stack[-1][1]:
                problems.append(f"track {track}: {span} overlaps {stack[-1]} without nesting")
            stack.append(span)
    return problems


def names(events: list[dict[str, Any]], kind: str) -> dict[tuple[int, int], str]:
    """(pid, tid) -> the process's (``process_name``) or thread's (``thread_name``) name."""
    return {(e["pid"], e["tid"] if kind == "thread_name" else 0): e["args"]["name"]
            for e in events if e["ph"] == "M" and e["name"] == kind}
