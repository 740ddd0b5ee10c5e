"""Advice that names the program's own settings: the DataLoader, optimizer and copy settings
the capture read from the objects that ran (``stepwatch.dataloader``, ``stepwatch.optimizer``
and ``stepwatch.h2d`` summary marks, capture/program_settings.py) go into the evidence and the
next step of ``INPUT_BOUND``, ``H2D_BOUND`` and ``COMPUTE_BOUND`` ("num_workers is 2 on a
2-core machine: ...").

Pure over what ``load_program_settings`` reads; ``with_settings`` returns the diagnosis with
those verdicts rewritten and every other finding as it was. A session with no settings marks
(an older capture, a program without a DataLoader) keeps the generic advice.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

from ..store.base import HistoryStore
from .verdicts.model import Diagnosis, Verdict

__all__ = ["ProgramSettings", "load_program_settings", "session_versions", "with_settings"]

_NAMES = {"stepwatch.dataloader": "dataloaders", "stepwatch.optimizer": "optimizers", "stepwatch.h2d": "h2d"}
_SELECT = ("SELECT rank, name, attrs FROM marks WHERE session_id = ? AND name IN (?, ?, ?) "
           "ORDER BY rank, ts_ns")
_FUSED = ("Adam", "AdamW", "SGD", "Adagrad", "Adamax", "NAdam", "RAdam", "RMSprop", "Adadelta", "ASGD", "Rprop")

ProgramSettings = dict[int, dict[str, list[dict[str, Any]]]]  # rank -> kind -> settings records


def load_program_settings(store: HistoryStore, session_id: str) -> ProgramSettings:
    """Each rank's recorded loader, optimizer and copy settings, in the order they were seen."""
    out: ProgramSettings = {}
    for row in store.query(_SELECT, (session_id, *_NAMES)):
        attrs = row["attrs"]
        if isinstance(attrs, str):
            try:
                attrs = json.loads(attrs)
            except ValueError:
                continue
        if isinstance(attrs, Mapping):
            kinds = out.setdefault(int(row["rank"]), {"dataloaders": [], "optimizers": [], "h2d": []})
            kinds[_NAMES[row["name"]]].append(dict(attrs))
    return out


_VERSIONS = ("SELECT rank, attrs FROM marks WHERE session_id = ? AND name = 'stepwatch.versions' "
             "ORDER BY rank, ts_ns")


def session_versions(store: HistoryStore, session_id: str) -> dict[str, str]:
    """The versions the lowest rank that recorded them trained with (``stepwatch.versions``,
    capture/program_settings.py: torch, cuda, python, stepwatch, platform), as text; empty for
    a session that recorded none (no torch, an older capture). A value it had none of (``cuda`` on
    a CPU build of torch) is left out."""
    for row in store.query(_VERSIONS, (session_id,)):
        attrs = row["attrs"]
        try:
            attrs = json.loads(attrs) if isinstance(attrs, str) else attrs
        except ValueError:
            continue
        if isinstance(attrs, Mapping):
            return {str(k): str(v) for k, v in attrs.items() if isinstance(v, (str, int, float)) and v != ""}
    return {}


def with_settings(diagnosis: Diagnosis, settings: ProgramSettings) -> Diagnosis:
    """``diagnosis`` with the program's settings in the verdicts they bear on."""
    if not settings:
        return diagnosis

    def advise(verdict: Verdict) -> Verdict:
        rank = verdict.ranks[0] if verdict.ranks and verdict.ranks[0] in settings else min(settings)
        mine = settings[rank]
        rewrite = _ADVICE.get(verdict.name)
        if rewrite is None:
            return verdict
        found = rewrite(mine)
        if found is None:
            return verdict
        evidence, advice = found
        short = _short(mine, verdict.name)
        return dataclasses.replace(
            verdict, evidence={**verdict.evidence, **({"settings": short} if short else {}),
                               "program": {"rank": rank, **evidence}},
            next_step=f"{advice}. In general: {verdict.next_step}" if verdict.next_step else advice)

    return Diagnosis(advise(diagnosis.primary), tuple(advise(v) for v in diagnosis.step_time),
                     diagnosis.memory, diagnosis.system)


def _short(settings: Mapping[str, Sequence[Mapping[str, Any]]], name: str) -> str | None:
    """The settings in one line, for the text summary's evidence (the JSON has them all)."""
    if name == "COMPUTE_BOUND":
        return "; ".join(f"{o.get('class')} fused {o.get('fused')}, foreach {o.get('foreach')}"
                         for o in settings.get("optimizers") or ()) or None
    loader = _loader(settings)
    parts = []
    if loader is not None:
        keys = ("num_workers", "pin_memory", "prefetch_factor", "persistent_workers", "batch_size")
        parts.append(f"{loader.get('class')}: " + ", ".join(f"{k} {loader.get(k)}" for k in keys))
        cores, _ = _cores(loader)
        if cores is not None:
            parts.append(f"{cores} cores")
    if name.startswith("H2D"):
        kinds = sorted({("non_blocking" if c.get("non_blocking") else "blocking") for c in settings.get("h2d") or ()})
        if kinds:
            parts.append("copies " + " and ".join(kinds))
    return "; ".join(parts) or None


def _loader(settings: Mapping[str, Sequence[Mapping[str, Any]]]) -> Mapping[str, Any] | None:
    """The loader the advice is about: the first one iterated (a script's training loader comes
    before its evaluation loader), with its index."""
    loaders = settings.get("dataloaders") or ()
    return loaders[0] if loaders else None


def _on_accelerator(settings: Mapping[str, Sequence[Mapping[str, Any]]]) -> bool:
    """Whether the program trains on a device (its optimizer's parameters, or copies seen)."""
    devices = {o.get("param_device") for o in settings.get("optimizers") or ()}
    return bool(settings.get("h2d")) or any(d not in (None, "cpu", "meta") for d in devices)


def _cores(loader: Mapping[str, Any]) -> tuple[int | None, str]:
    cores = loader.get("usable_cpus") or loader.get("host_cpus")
    return (cores, f"a {cores}-core machine") if isinstance(cores, int) else (None, "this machine")


def _loader_name(loader: Mapping[str, Any]) -> str:
    size = loader.get("dataset_len")
    dataset = f"{loader.get('dataset')}" + (f" of {size}" if isinstance(size, int) else "")
    return f"{loader.get('class') or 'DataLoader'} over {dataset} (batch_size {loader.get('batch_size')})"


def _input_advice(settings: Mapping[str, Sequence[Mapping[str, Any]]]) -> tuple[dict[str, Any], str] | None:
    loader = _loader(settings)
    if loader is None:
        return None
    workers = loader.get("num_workers")
    cores, machine = _cores(loader)
    said: list[str] = []
    if workers == 0:
        said.append(f"num_workers is 0 on {machine}: every batch of {_loader_name(loader)} is loaded on the "
                    f"training thread, between steps; set num_workers"
                    + (f" (up to about {max(1, cores - 1)} here, fewer per rank when several ranks share it)"
                       if cores else ""))
    elif isinstance(workers, int) and cores is not None and workers >= cores - 1:
        said.append(f"num_workers is {workers} on {machine}: more workers will not help there; make each item "
                    f"of {loader.get('dataset')} cheaper (decode, augment or cache less per item) or use a "
                    f"machine with more cores")
    elif isinstance(workers, int):
        said.append(f"num_workers is {workers} on {machine}: raise it"
                    + (f" (up to about {cores - 1})" if cores else ""))
    prefetch = loader.get("prefetch_factor")
    if isinstance(workers, int) and workers > 0:
        if isinstance(prefetch, int):
            said.append(f"prefetch_factor is {prefetch}: a larger one absorbs slow items")
        if loader.get("persistent_workers") is False:
            said.append("persistent_workers is False: the workers restart at every epoch")
    if loader.get("pin_memory") is False and _on_accelerator(settings):
        said.append("pin_memory is False: pin_memory=True speeds the copy to the device")
    return {"dataloader": dict(loader)}, "; ".join(said) if said else f"{_loader_name(loader)}"


def _h2d_advice(settings: Mapping[str, Sequence[Mapping[str, Any]]]) -> tuple[dict[str, Any], str] | None:
    copies = settings.get("h2d") or ()
    loader = _loader(settings)
    if not copies and loader is None:
        return None
    said: list[str] = []
    kinds = {c.get("non_blocking") for c in copies}
    if copies and True not in kinds:
        said.append("every copy to the device seen was blocking: .to(device, non_blocking=True)")
    unpinned = [c for c in copies if c.get("source_pinned") is False]
    if unpinned:
        said.append("the copies' source tensors are not pinned"
                    + (" (pin_memory is False on the DataLoader)" if loader is not None and loader.get("pin_memory")
                       is False else "") + ": pin_memory=True")
    elif loader is not None and loader.get("pin_memory") is False:
        said.append(f"pin_memory is False on {_loader_name(loader)}: pin_memory=True")
    evidence: dict[str, Any] = {"h2d_copies": [dict(c) for c in copies]}
    if loader is not None:
        evidence["dataloader"] = {k: loader.get(k) for k in ("class", "pin_memory", "num_workers", "batch_size")}
    return evidence, "; ".join(said) if said else "copies are non_blocking from pinned memory already"


def _compute_advice(settings: Mapping[str, Sequence[Mapping[str, Any]]]) -> tuple[dict[str, Any], str] | None:
    optimizers = settings.get("optimizers") or ()
    if not optimizers:
        return None
    said: list[str] = []
    for opt in optimizers:
        name = opt.get("class")
        if opt.get("fused") is True:
            continue
        on_device = opt.get("param_device") not in (None, "cpu")
        if name in _FUSED and on_device:
            foreach = opt.get("foreach")
            said.append(f"{name} runs with fused={opt.get('fused')}, foreach={foreach}"
                        f"{' (torch picks foreach here)' if foreach is None else ''}: fused=True fuses its update "
                        f"into one kernel")
    evidence = {"optimizers": [dict(o) for o in optimizers]}
    return evidence, "; ".join(said) if said else (
        "the optimizer (" + ", ".join(str(o.get("class")) for o in optimizers) + ") is not where to look first")


_ADVICE = {"INPUT_BOUND": _input_advice, "INPUT_STRAGGLER": _input_advice, "H2D_BOUND": _h2d_advice,
           "H2D_STRAGGLER": _h2d_advice, "COMPUTE_BOUND": _compute_advice}
