"""Distributed identity from launcher environments (telemetry-event-v3.md, "Distributed env inference")."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stepwatch.capture.identity import resolve_distributed_identity
from stepwatch.errors import ConfigError

# (rank, local_rank, world_size, job id) variables of each launcher named by the spec
LAUNCHERS = {
    "torchrun": ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"),
    "openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE", None),
    "slurm": ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_JOB_ID"),
}


def launcher_env(style: str, rank: int, local_rank: int, world_size: int, job: str | None = None) -> dict[str, str]:
    rank_var, local_var, size_var, job_var = LAUNCHERS[style]
    env = {rank_var: str(rank), local_var: str(local_rank), size_var: str(world_size)}
    if job_var is not None and job is not None:
        env[job_var] = job
    return env


def as_tuple(identity: object) -> tuple[object, int, int, int]:
    return (identity.job_id, identity.rank, identity.local_rank, identity.world_size)  # type: ignore[attr-defined]


def test_single_process_defaults() -> None:
    assert as_tuple(resolve_distributed_identity(env={})) == (None, 0, 0, 1)


def test_unrelated_environment_gives_the_defaults() -> None:
    env = {"PATH": "/usr/bin", "HOME": "/root", "CUDA_VISIBLE_DEVICES": "0,1", "NODE_RANK": "3"}
    assert as_tuple(resolve_distributed_identity(env=env)) == (None, 0, 0, 1)


def test_torchrun() -> None:
    env = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "TORCHELASTIC_RUN_ID": "run-42",
           "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1"}
    assert as_tuple(resolve_distributed_identity(env=env)) == ("run-42", 5, 1, 8)


def test_torchrun_without_run_id_has_no_job_id() -> None:
    env = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}
    assert as_tuple(resolve_distributed_identity(env=env)) == (None, 1, 1, 2)


def test_open_mpi() -> None:
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4"}
    assert as_tuple(resolve_distributed_identity(env=env)) == (None, 3, 0, 4)


def test_slurm() -> None:
    env = {"SLURM_PROCID": "6", "SLURM_LOCALID": "2", "SLURM_NTASKS": "16", "SLURM_JOB_ID": "918273"}
    assert as_tuple(resolve_distributed_identity(env=env)) == ("918273", 6, 2, 16)


def test_torchrun_under_slurm_reports_the_torchrun_rank() -> None:
    """srun starting torchrun: Slurm's task is one node, torchrun's ranks are the workers."""
    env = {**launcher_env("slurm", 1, 0, 2, "777"), **launcher_env("torchrun", 5, 1, 8, "tr")}
    assert as_tuple(resolve_distributed_identity(env=env)) == ("tr", 5, 1, 8)


def test_missing_local_rank_defaults_to_zero() -> None:
    assert as_tuple(resolve_distributed_identity(env={"RANK": "3", "WORLD_SIZE": "4"})) == (None, 3, 0, 4)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"rank": 3}, ("run-1", 3, 1, 4)),
        ({"local_rank": 0}, ("run-1", 2, 0, 4)),
        ({"world_size": 16, "rank": 15}, ("run-1", 15, 1, 16)),
        ({"job_id": "mine"}, ("mine", 2, 1, 4)),
        ({"job_id": "j", "rank": 0, "local_rank": 0, "world_size": 1}, ("j", 0, 0, 1)),
    ],
)
def test_explicit_values_win_over_the_environment(overrides: dict[str, object], expected: tuple) -> None:
    env = launcher_env("torchrun", 2, 1, 4, "run-1")
    assert as_tuple(resolve_distributed_identity(env=env, **overrides)) == expected  # type: ignore[arg-type]


def test_explicit_values_without_environment() -> None:
    identity = resolve_distributed_identity(env={}, job_id="j", rank=2, local_rank=1, world_size=3)
    assert as_tuple(identity) == ("j", 2, 1, 3)


def test_explicit_world_size_is_checked_against_environment_rank() -> None:
    with pytest.raises(ConfigError):
        resolve_distributed_identity(env=launcher_env("slurm", 5, 0, 8), world_size=4)


@pytest.mark.parametrize("style", sorted(LAUNCHERS))
@pytest.mark.parametrize("position", [0, 1, 2])
@pytest.mark.parametrize("value", ["abc", "1.5", "2x", "0x10", "one"])
def test_non_integer_variable_is_a_config_error_naming_it(style: str, position: int, value: str) -> None:
    env = launcher_env(style, 0, 0, 2)
    name = LAUNCHERS[style][position]
    env[name] = value
    with pytest.raises(ConfigError) as info:
        resolve_distributed_identity(env=env)
    assert name in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("style", sorted(LAUNCHERS))
@pytest.mark.parametrize(
    ("rank", "local_rank", "world_size"),
    [(2, 0, 2), (0, 2, 2), (9, 0, 4), (0, 0, 0), (-1, 0, 2), (0, -1, 2), (1, 0, -3)],
)
def test_identity_outside_the_world_is_a_config_error(
    style: str, rank: int, local_rank: int, world_size: int
) -> None:
    with pytest.raises(ConfigError):
        resolve_distributed_identity(env=launcher_env(style, rank, local_rank, world_size))


def test_rank_without_world_size_cannot_exceed_the_single_process_world() -> None:
    with pytest.raises(ConfigError):
        resolve_distributed_identity(env={"RANK": "3"})


@pytest.mark.parametrize(
    "overrides",
    [{"rank": 4, "world_size": 4}, {"local_rank": 1}, {"rank": -1}, {"world_size": 0}, {"local_rank": -2}],
)
def test_explicit_identity_outside_the_world_is_a_config_error(overrides: dict[str, int]) -> None:
    with pytest.raises(ConfigError):
        resolve_distributed_identity(env={}, **overrides)  # type: ignore[arg-type]


def test_process_environment_is_read_when_no_env_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("STEPWATCH_RANK", "STEPWATCH_LOCAL_RANK", "STEPWATCH_WORLD_SIZE", "STEPWATCH_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in launcher_env("torchrun", 1, 0, 3, "env-run").items():
        monkeypatch.setenv(name, value)
    assert as_tuple(resolve_distributed_identity()) == ("env-run", 1, 0, 3)


job_ids = st.text(st.characters(blacklist_categories=("Cs", "Cc")), min_size=1, max_size=16).filter(str.strip)


@st.composite
def identities(draw: st.DrawFn) -> tuple[int, int, int]:
    world_size = draw(st.integers(min_value=1, max_value=2**31))
    rank = draw(st.integers(min_value=0, max_value=world_size - 1))
    local_rank = draw(st.integers(min_value=0, max_value=world_size - 1))
    return rank, local_rank, world_size


@given(st.sampled_from(sorted(LAUNCHERS)), identities(), job_ids)
def test_any_valid_identity_from_any_launcher_is_resolved(
    style: str, ident: tuple[int, int, int], job: str
) -> None:
    rank, local_rank, world_size = ident
    identity = resolve_distributed_identity(env=launcher_env(style, rank, local_rank, world_size, job))
    # torchrun writes TORCHELASTIC_RUN_ID=none when no run id was given: no job id (test below)
    no_job = LAUNCHERS[style][3] is None or (LAUNCHERS[style][3] == "TORCHELASTIC_RUN_ID" and job == "none")
    expected_job = None if no_job else job
    assert as_tuple(identity) == (expected_job, rank, local_rank, world_size)


@given(st.sampled_from(sorted(LAUNCHERS)), st.integers(min_value=1, max_value=2**31), st.data())
def test_any_rank_at_or_above_world_size_is_refused(style: str, world_size: int, data: st.DataObject) -> None:
    rank = data.draw(st.integers(min_value=world_size, max_value=world_size + 2**31))
    with pytest.raises(ConfigError):
        resolve_distributed_identity(env=launcher_env(style, rank, 0, world_size))


def test_torchrun_run_id_none_is_no_job_id() -> None:
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "none"}
    assert as_tuple(resolve_distributed_identity(env=env)) == (None, 0, 0, 2)


def test_only_torchrun_gives_none_the_meaning_of_no_job() -> None:
    # found by hypothesis: a Slurm job named "none" lost its id
    env = launcher_env("slurm", 0, 0, 1, "none")
    assert as_tuple(resolve_distributed_identity(env=env)) == ("none", 0, 0, 1)


def test_a_contradictory_launcher_environment_does_not_stop_the_program(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import stepwatch
    from stepwatch.guard import reset_swallowed, swallowed

    reset_swallowed()
    monkeypatch.setenv("RANK", "3")  # no WORLD_SIZE: a world of one cannot hold rank 3
    runtime = stepwatch.init(out=tmp_path / "run")
    assert runtime.active is False
    assert list(swallowed()) == ["init.identity"]
    with pytest.raises(ConfigError):  # the caller's own arguments still raise
        stepwatch.init(out=tmp_path / "run", rank=3)
