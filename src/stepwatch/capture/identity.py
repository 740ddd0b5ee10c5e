"""Which rank of which job this process is, from the launcher's environment.

Explicit values win over the environment; torchrun, Open MPI and Slurm are recognised in that
order (spec: "Distributed env inference"); a plain process is rank 0 of a world of 1.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import msgspec

from ..errors import ConfigError

__all__ = ["DistributedIdentity", "resolve_distributed_identity"]

# (rank, local_rank, world_size, job id) per launcher, most specific first.
_LAUNCHERS: tuple[tuple[str, str, str, str | None], ...] = (
    ("STEPWATCH_RANK", "STEPWATCH_LOCAL_RANK", "STEPWATCH_WORLD_SIZE", "STEPWATCH_JOB_ID"),
    ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE", None),
    ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_JOB_ID"),
)


class DistributedIdentity(msgspec.Struct, frozen=True, kw_only=True):
    """Rank identity as written into every telemetry record."""

    job_id: str | None = None
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    source: str = "default"


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw.strip())
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer") from None


def _job_id(env: Mapping[str, str], job_var: str | None) -> str | None:
    """The launcher's job id; torchrun writes ``TORCHELASTIC_RUN_ID=none`` when given no run id,
    which means none, while "none" from any other launcher is a name like any other."""
    value = env.get(job_var) if job_var else None
    return None if job_var == "TORCHELASTIC_RUN_ID" and value == "none" else value


def resolve_distributed_identity(
    *,
    job_id: str | None = None,
    rank: int | None = None,
    local_rank: int | None = None,
    world_size: int | None = None,
    env: Mapping[str, str] | None = None,
) -> DistributedIdentity:
    """Resolves this process's identity.

    Args:
        job_id, rank, local_rank, world_size: explicit overrides; each wins over the environment.
        env: the environment to read (``os.environ`` when not given).

    Raises:
        ConfigError: a variable is not an integer, or the result breaks
            ``0 <= rank, local_rank < world_size``.
    """
    env = os.environ if env is None else env
    found: dict[str, object] = {}
    source = "default"
    for rank_var, local_var, size_var, job_var in _LAUNCHERS:
        env_rank = _env_int(env, rank_var)
        env_size = _env_int(env, size_var)
        if env_rank is None and env_size is None:
            continue
        found = {
            "rank": env_rank,
            "local_rank": _env_int(env, local_var),
            "world_size": env_size,
            "job_id": _job_id(env, job_var),
        }
        source = rank_var.split("_")[0].lower() if rank_var != "RANK" else "torchrun"
        break
    resolved_rank = rank if rank is not None else found.get("rank")
    resolved_rank = 0 if resolved_rank is None else resolved_rank
    resolved_local = local_rank if local_rank is not None else found.get("local_rank")
    resolved_size = world_size if world_size is not None else found.get("world_size")
    resolved_size = 1 if resolved_size is None else resolved_size
    resolved_local = 0 if resolved_local is None else resolved_local
    resolved_job = job_id if job_id is not None else found.get("job_id")
    if any(v is not None for v in (job_id, rank, local_rank, world_size)):
        source = "explicit" if source == "default" else f"explicit+{source}"
    identity = DistributedIdentity(
        job_id=resolved_job or None,  # type: ignore[arg-type]
        rank=int(resolved_rank),  # type: ignore[arg-type]
        local_rank=int(resolved_local),  # type: ignore[arg-type]
        world_size=int(resolved_size),  # type: ignore[arg-type]
        source=source,
    )
    if identity.world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {identity.world_size}")
    for name in ("rank", "local_rank"):
        value = getattr(identity, name)
        if not 0 <= value < identity.world_size:
            raise ConfigError(f"{name} must be >= 0 and < world_size ({identity.world_size}), got {value}")
    return identity
