"""The verdict policy: TraceML's defaults, a file (TOML or JSON) and key=value overrides, each
refusal naming the file and the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepwatch.analysis.verdicts import DEFAULT_POLICY, VerdictPolicy, diagnose, load_policy
from stepwatch.analysis.verdicts.policy import PolicyError, canonical_verdict_name
from tests.support import examples
from tests.support.verdict_rows import steps


def test_a_toml_file_then_overrides(tmp_path: Path) -> None:
    path = tmp_path / "verdicts.toml"
    path.write_text('[verdicts]\ninput_share_warn = 0.3\ninput_share_crit = 0.5\nwait_share_warn = 0.15\n'
                    'disabled = ["WAIT_HEAVY", "between_steps"]\ncreep_recent_band = [0.8, 1.0]\n')
    policy = load_policy(path, ["straggler_score_warn=0.05", "live_window_steps=50"])
    assert (policy.input_share_warn, policy.input_share_crit, policy.residual_share_warn) == (0.3, 0.5, 0.15)
    assert policy.disabled == ("BETWEEN_STEPS", "RESIDUAL_HEAVY")
    assert policy.creep_recent_band == (0.8, 1.0)
    assert (policy.straggler_score_warn, policy.live_window_steps) == (0.05, 50)
    assert policy.straggler_score_crit == DEFAULT_POLICY.straggler_score_crit
    # 26 % input: crit by default, nothing under this policy's 30 %
    rows = steps(0, 100, fetch=3.0)
    assert diagnose(rows).primary.name == "INPUT_BOUND"
    assert diagnose(rows, policy=policy).primary.name != "INPUT_BOUND"


def test_a_json_file_with_top_level_keys(tmp_path: Path) -> None:
    path = tmp_path / "policy.json"
    path.write_text(json.dumps({"pressure_warn": 0.8, "creep_confirmed_delta_bytes": 512 << 20}))
    policy = VerdictPolicy.from_file(path)
    assert policy.pressure_warn == 0.8 and policy.creep_confirmed_delta_bytes == 512 << 20
    assert load_policy(None, ()) is DEFAULT_POLICY


@pytest.mark.parametrize(("text", "says"), [
    ("input_share_warn = 'high'", "key 'input_share_warn'"),
    ("no_such_key = 1", "unknown key 'no_such_key'"),
    ("input_share_warn = 0.5", "input_share_crit (0.2) is below input_share_warn (0.5)"),
    ("live_window_steps = 2.5", "key 'live_window_steps': expected a whole number"),
    ("creep_mid_band = [0.6, 0.4]", "creep_mid_band"),
    ("disabled = 3", "key 'disabled'"),
    ("[verdicts\n", "not a TOML verdict policy"),
    ("x = 1\n[verdicts]\ny = 2", "keys outside [verdicts]: x"),
])
def test_a_bad_file_is_refused_naming_it_and_the_key(tmp_path: Path, text: str, says: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(PolicyError) as error:
        load_policy(path, ())
    assert str(path) in str(error.value) and says in str(error.value)


def test_bad_overrides_and_missing_files(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="expected key=value"):
        load_policy(None, ["input_share_warn"])
    with pytest.raises(PolicyError, match="'pressure_crit': 'lots' is not a number"):
        load_policy(None, ["pressure_crit=lots"])
    with pytest.raises(PolicyError, match="not a finite number"):
        load_policy(None, ["pressure_crit=nan"])
    with pytest.raises(PolicyError, match="cannot read the verdict policy"):
        load_policy(tmp_path / "absent.toml", ())
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(PolicyError, match="a table of key = value"):
        load_policy(tmp_path / "bad.json", ())
    assert issubclass(PolicyError, ValueError)


def test_aliases() -> None:
    assert canonical_verdict_name("wait_heavy") == "RESIDUAL_HEAVY"
    assert canonical_verdict_name("INPUT_BOUND") == "INPUT_BOUND"
    assert DEFAULT_POLICY.with_overrides(["wait_share_crit=0.4"]).residual_share_crit == 0.4


def test_the_policy_round_trips_through_its_dict(tmp_path: Path) -> None:
    path = tmp_path / "all.json"
    path.write_text(json.dumps(DEFAULT_POLICY.to_dict()))
    assert VerdictPolicy.from_file(path) == DEFAULT_POLICY


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.text(max_size=30), max_size=4))
def test_any_override_text_gives_a_policy_or_a_policy_error(overrides: list[str]) -> None:
    try:
        policy = load_policy(None, overrides)
    except PolicyError as error:
        assert "\n" not in str(error) or "override" in str(error)
    else:
        assert isinstance(policy, VerdictPolicy)
