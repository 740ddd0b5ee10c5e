"""The thresholds and gates of the verdict engine, as one documented value a user can override.

The defaults are TraceML 0.5.0's (docs/verdicts.md lists each with the formula it feeds), so a
run judged by both tools gets the same call where the two agree on what they measured. A policy
file (TOML or JSON) and ``key=value`` overrides change any of them; every bad key or value is
refused with a message naming the file and the key, never half-applied.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_POLICY", "NAME_ALIASES", "PolicyError", "VerdictPolicy", "canonical_verdict_name",
           "load_policy"]

GIB = 1 << 30
MIB = 1 << 20

# Older names a user (or an older run's summary) may still write; read as the current ones.
NAME_ALIASES: dict[str, str] = {"WAIT_HEAVY": "RESIDUAL_HEAVY"}
_KEY_ALIASES: dict[str, str] = {"wait_share_warn": "residual_share_warn", "wait_share_crit": "residual_share_crit"}


def canonical_verdict_name(name: str) -> str:
    """The current name of a verdict, given it or an older alias (``WAIT_HEAVY``), any case."""
    upper = str(name).strip().upper()
    return NAME_ALIASES.get(upper, upper)


class PolicyError(ValueError):
    """A policy file or override that cannot be read; the message names the file and the key."""


@dataclass(frozen=True)
class VerdictPolicy:
    """Every threshold and gate of the verdict engine (docs/verdicts.md).

    Shares are fractions of step time (0..1); byte amounts are bytes. ``from_file`` and
    ``with_overrides`` build changed copies; ``load_policy`` is what the CLI calls.
    """

    # window
    live_window_steps: int = 100
    # gates (steps in the window, on the rank with the fewest)
    warmup_steps: int = 2  # fewer: WARMUP, nothing else said
    confident_steps: int = 20  # fewer: nothing above warn
    memory_min_steps: int = 50  # fewer: no memory verdict
    # a phase is known on a rank when its column has a value in at least this share of the
    # rank's window steps (a partial last step does not blank the window)
    min_phase_coverage: float = 0.5
    # step-time shares
    input_share_warn: float = 0.10
    input_share_crit: float = 0.20
    h2d_share_warn: float = 0.10
    h2d_share_crit: float = 0.20
    residual_share_warn: float = 0.10
    residual_share_crit: float = 0.20
    between_steps_share_warn: float = 0.10
    between_steps_share_crit: float = 0.20
    compute_bound_share: float = 0.90  # with every other share under its warn threshold
    # stragglers
    straggler_score_warn: float = 0.10
    straggler_score_crit: float = 0.20
    straggler_cause_coverage_min: float = 0.80
    # memory
    pressure_warn: float = 0.92
    pressure_crit: float = 0.97
    imbalance_skew_warn: float = 0.20
    imbalance_skew_crit: float = 0.30
    imbalance_pressure_warn: float = 0.30
    imbalance_pressure_crit: float = 0.50
    creep_baseline_band: tuple[float, float] = (0.15, 0.25)
    creep_mid_band: tuple[float, float] = (0.45, 0.55)
    creep_recent_band: tuple[float, float] = (0.90, 1.00)
    creep_confirmed_delta_bytes: int = GIB
    creep_early_min_delta_bytes: int = 32 * MIB  # TraceML: > 0 (every clean run's RSS settles upwards)
    creep_score_scale_bytes: int = 100 * MIB
    # system / process
    host_memory_warn: float = 0.80
    host_memory_crit: float = 0.95
    process_rss_warn: float = 0.80
    process_rss_crit: float = 0.95
    gpu_util_low_pct: float = 30.0
    gpu_util_min_samples: int = 5
    # verdict names never reported (aliases accepted: WAIT_HEAVY)
    disabled: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        problems = _problems(self)
        if problems:
            raise PolicyError("; ".join(problems))

    @classmethod
    def from_file(cls, path: str | Path, base: VerdictPolicy | None = None) -> VerdictPolicy:
        """A policy from a TOML (``.toml``) or JSON file: top-level keys, or the same keys under a
        ``[verdicts]`` table; keys it does not name keep ``base``'s (default: the defaults)."""
        path = Path(path)
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise PolicyError(f"{path}: cannot read the verdict policy: {exc.strerror or exc}") from exc
        try:
            data = json.loads(raw) if path.suffix.lower() == ".json" else tomllib.loads(raw.decode("utf-8"))
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            kind = "JSON" if path.suffix.lower() == ".json" else "TOML"
            raise PolicyError(f"{path}: not a {kind} verdict policy: {exc}") from exc
        if not isinstance(data, dict):
            raise PolicyError(f"{path}: a verdict policy is a table of key = value")
        if "verdicts" in data and isinstance(data["verdicts"], dict):
            extra = sorted(k for k in data if k != "verdicts")
            if extra:
                raise PolicyError(f"{path}: keys outside [verdicts]: {', '.join(extra)}")
            data = data["verdicts"]
        return (base or DEFAULT_POLICY).replace(data, source=str(path))

    def with_overrides(self, overrides: Iterable[str], *, source: str = "override") -> VerdictPolicy:
        """A copy with ``key=value`` strings applied (``straggler_score_warn=0.15``,
        ``disabled=WAIT_HEAVY,BETWEEN_STEPS``)."""
        values: dict[str, Any] = {}
        for text in overrides:
            key, sep, value = str(text).partition("=")
            if not sep or not key.strip():
                raise PolicyError(f"{source} {text!r}: expected key=value")
            values[key.strip()] = value.strip()
        return self.replace(values, source=source, from_text=True)

    def replace(self, values: Mapping[str, Any], *, source: str = "policy", from_text: bool = False) -> VerdictPolicy:
        """A copy with ``values`` (key -> value) applied, each checked against its field's type."""
        known = {f.name: f for f in fields(self)}
        changes: dict[str, Any] = {}
        for key, value in values.items():
            name = _KEY_ALIASES.get(str(key), str(key))
            if name not in known:
                raise PolicyError(f"{source}: unknown key {key!r} (docs/verdicts.md lists the keys)")
            changes[name] = _convert(source, str(key), getattr(DEFAULT_POLICY, name), value, from_text)
        try:
            return dataclasses.replace(self, **changes)
        except PolicyError as exc:
            raise PolicyError(f"{source}: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        return {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v) for f in fields(self)}

    def enabled(self, name: str) -> bool:
        return name not in self.disabled


def _convert(source: str, key: str, default: Any, value: Any, from_text: bool) -> Any:
    where = f"{source}: key {key!r}"
    if isinstance(default, bool):  # no bool fields today; kept honest if one comes
        raise PolicyError(f"{where}: not settable")
    if key == "disabled" or isinstance(default, tuple) and (not default or isinstance(default[0], str)):
        items = value.split(",") if from_text and isinstance(value, str) else value
        if isinstance(items, str):
            items = [items]
        if not isinstance(items, list | tuple) or not all(isinstance(i, str) for i in items):
            raise PolicyError(f"{where}: expected a list of verdict names")
        return tuple(sorted({canonical_verdict_name(i) for i in items if i.strip()}))
    if isinstance(default, tuple):  # a band (low, high)
        items = value.split(",") if from_text and isinstance(value, str) else value
        if not isinstance(items, list | tuple) or len(items) != 2:
            raise PolicyError(f"{where}: expected two numbers (low, high)")
        return tuple(_number(where, i, float) for i in items)
    return _number(where, value, type(default))


def _number(where: str, value: Any, kind: type) -> Any:
    if isinstance(value, str):
        text = value.strip()
        try:
            value = int(text) if kind is int and text.lstrip("+-").isdigit() else float(text)
        except ValueError:
            raise PolicyError(f"{where}: {text!r} is not a number") from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PolicyError(f"{where}: expected a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise PolicyError(f"{where}: {value!r} is not a finite number")
    if kind is int:
        if value != int(value):
            raise PolicyError(f"{where}: expected a whole number, got {value!r}")
        return int(value)
    return float(value)


_SHARE_PAIRS = (("input_share_warn", "input_share_crit"), ("h2d_share_warn", "h2d_share_crit"),
                ("residual_share_warn", "residual_share_crit"),
                ("between_steps_share_warn", "between_steps_share_crit"),
                ("straggler_score_warn", "straggler_score_crit"), ("pressure_warn", "pressure_crit"),
                ("imbalance_skew_warn", "imbalance_skew_crit"),
                ("imbalance_pressure_warn", "imbalance_pressure_crit"),
                ("host_memory_warn", "host_memory_crit"), ("process_rss_warn", "process_rss_crit"))


def _problems(policy: VerdictPolicy) -> list[str]:
    """What makes a policy unusable: a negative gate, a crit below its warn, a band out of 0..1."""
    out: list[str] = []
    for name in ("live_window_steps", "warmup_steps", "confident_steps", "memory_min_steps", "gpu_util_min_samples",
                 "creep_confirmed_delta_bytes", "creep_early_min_delta_bytes"):
        if getattr(policy, name) < 0:
            out.append(f"{name} must be >= 0")
    if policy.live_window_steps < 1:
        out.append("live_window_steps must be >= 1")
    if policy.creep_score_scale_bytes < 1:
        out.append("creep_score_scale_bytes must be >= 1")
    for warn, crit in _SHARE_PAIRS:
        low, high = getattr(policy, warn), getattr(policy, crit)
        if low < 0 or high < 0:
            out.append(f"{warn} and {crit} must be >= 0")
        elif high < low:
            out.append(f"{crit} ({high}) is below {warn} ({low})")
    for name in ("min_phase_coverage", "compute_bound_share", "straggler_cause_coverage_min"):
        if not 0 <= getattr(policy, name) <= 1:
            out.append(f"{name} must be in [0, 1]")
    bands = [policy.creep_baseline_band, policy.creep_mid_band, policy.creep_recent_band]
    for name, (low, high) in zip(("creep_baseline_band", "creep_mid_band", "creep_recent_band"), bands):
        if not 0 <= low < high <= 1:
            out.append(f"{name} must be (low, high) with 0 <= low < high <= 1")
    if not 0 <= policy.gpu_util_low_pct <= 100:
        out.append("gpu_util_low_pct must be in [0, 100]")
    return out


DEFAULT_POLICY = VerdictPolicy()


def load_policy(file: str | Path | None = None, overrides: Sequence[str] = ()) -> VerdictPolicy:
    """The policy the CLI uses: the defaults, then ``file`` (TOML or JSON), then each
    ``key=value`` of ``overrides``. Raises PolicyError (a ValueError) naming the file or key."""
    policy = DEFAULT_POLICY if file is None else VerdictPolicy.from_file(file)
    return policy.with_overrides(overrides) if overrides else policy
