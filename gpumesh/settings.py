"""One settings object: flags over environment (``GPUMESH_*``) over the config file over defaults.

Core code receives a :class:`Settings`; only :meth:`Settings.load` reads the environment (through
:func:`gpumesh.layers.layered`, which `status --json` reads alone to start fast).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from gpumesh.errors import UsageError
from gpumesh.layers import DEFAULT_HEARTBEAT_INTERVAL, DEFAULT_LEASE_TTL, layered
from gpumesh.layers import DEFAULT_URL as DEFAULT_URL  # where callers have always found them
from gpumesh.layers import ENV_PREFIX as ENV_PREFIX
from gpumesh.layers import config_path as config_path


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gpumesh"


class Settings(BaseModel):
    """Everything an operator or a test can tune. Times are seconds (floats allowed)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    url: str = Field(DEFAULT_URL, description="the broker: redis://, rediss:// or redis+sentinel:// (see URLs)")
    lease_ttl: float = Field(
        DEFAULT_LEASE_TTL, gt=0, description="a task's lease lapses this long after the last heartbeat"
    )
    heartbeat_interval: float = Field(
        DEFAULT_HEARTBEAT_INTERVAL, gt=0, description="how often a worker renews its registration and lease"
    )
    tiers: int = Field(
        3,
        ge=1,
        le=16,
        description="tiers (score bands; a worker's is its rank in the fleet as it asks): the RQ queues "
        "gpumesh-tier-0 … that deliveries pass through and the next tasks of each tier wait in (rq-dashboard, "
        "`rq info`); which task a worker takes does not depend on them",
    )
    cache_dir: Path = Field(
        default_factory=_default_cache_dir,
        description="the benchmark cache: $XDG_CACHE_HOME/gpumesh, else ~/.cache/gpumesh",
    )
    log_max_bytes: int = Field(1_000_000, ge=1024, description="stdout+stderr kept per attempt")
    result_max_bytes: int = Field(1_000_000, ge=64, description="largest accepted result line")
    task_memory_mb: int = Field(
        0, ge=0, description="memory cap per task tree (shared pages counted once); 0 = 90% of the machine's memory"
    )
    job_retention: float = Field(7 * 86400, ge=0, description="seconds a finished job is kept; 0 = for ever")
    sandbox_python: str = Field("", description="interpreter for tasks (default: the worker's own)")
    isolation: bool = Field(True, description="worker: confine tasks with Landlock where the kernel has it")
    read_paths: str = Field("", description="worker: more paths tasks may read under isolation (':' or ',')")
    write_paths: str = Field("", description="worker: more paths tasks may write under isolation (':' or ',')")
    cache_paths: str = Field(
        "", description="worker: caches tasks read, each attempt's writes kept in an overlay of its own (':' or ',')"
    )
    signing_key: str = Field("", description="submit: sign every task with this Ed25519 private key file")
    outage_patience: float = Field(
        300.0,
        ge=0,
        le=86400,
        description="how long submit --wait, status --watch, retry --wait, logs -f and top wait out an unreachable "
        "broker (saying so once, and once when it is back)",
    )
    artifacts: str = Field(
        "", description="where tasks' output files go: empty = the broker; else an fsspec URL (s3://bucket/prefix)"
    )
    artifact_file_mb: float = Field(64, ge=0, description="largest output file kept, MiB; 0 = no cap")
    artifact_task_mb: float = Field(64, ge=0, description="output files kept per task, MiB; 0 = no cap")
    artifact_job_mb: float = Field(1024, ge=0, description="output files kept per job, MiB; 0 = no cap")
    artifact_files: int = Field(1000, ge=0, description="output files kept per task; 0 = no cap")
    reuse_idle: float = Field(
        300.0, gt=0, description="worker: seconds a job's reused process (submit --reuse-process) waits idle for a task"
    )
    project_max_mb: float = Field(100, ge=0, description="submit: largest project folder sent, MiB; 0 = no cap")
    project_max_files: int = Field(10_000, ge=0, description="submit: most files a project folder sends; 0 = no cap")
    project_cache: str = Field(
        "", description="worker: where this machine's workers keep projects (default: a folder in the temp dir)"
    )
    project_cache_mb: float = Field(
        10_240,
        ge=0,
        description="worker: projects kept on this machine, MiB (least recently used go first); 0 = no cap",
    )
    envs: bool = Field(True, description="worker: run jobs that bring an environment (worker --no-envs: false)")
    env_cache: str = Field(
        "", description="worker: where this machine's workers build environments (default: a folder in the temp dir)"
    )
    env_cache_mb: int = Field(
        20_480, ge=0, description="worker: environments kept on this machine, MiB (least recently used go first)"
    )
    allow_builds: bool = Field(
        False, description="worker: let an environment build packages from source (the job must allow it too)"
    )
    trusted_keys: str = Field(
        "",
        description="worker: run only tasks signed by these public keys, files or inline ed25519:BASE64 "
        "(comma-separated)",
    )

    stop_grace: float = Field(
        3.0,
        ge=0,
        le=3600,
        description="worker: seconds between a stopped task's SIGTERM and its SIGKILL (a pause, a timeout)",
    )
    pause_probe_interval: float = Field(
        2.0, gt=0, le=3600, description="worker: how often the --lend and --pause-when probes are asked"
    )
    pause_probe_timeout: float = Field(
        10.0, gt=0, le=600, description="worker: a probe that takes longer counts as not allowing work"
    )
    idle_probe: str = Field(
        "", description="worker: a command printing the seconds since the last input (for --lend idle)"
    )
    gpu_probe: str = Field(
        "",
        description="worker: a command printing 'PID, USED_MIB' per GPU process (for --lend gpu-free, --max-vram-gb)",
    )
    checkpoint_every: float = Field(
        0,
        ge=0,
        le=86400,
        description="worker: save each task's GPUMESH_CHECKPOINT_DIR this often (s); 0 = only when asked",
    )
    checkpoint_mb: float = Field(1024, ge=0, description="largest checkpoint kept per task, MiB; 0 = no cap")
    lent_file: str = Field(
        "", description="worker: where `gpumesh lent` reads what ran here (default $XDG_STATE_HOME/gpumesh/lent.jsonl)"
    )

    @model_validator(mode="after")
    def _heartbeat_fits_lease(self) -> Settings:
        if self.heartbeat_interval * 2 > self.lease_ttl:
            raise ValueError(
                f"heartbeat interval ({self.heartbeat_interval}s) must be at most half the lease TTL "
                f"({self.lease_ttl}s), or leases lapse between heartbeats"
            )
        return self

    @property
    def worker_ttl(self) -> float:
        """A worker's registration expires this long after its last heartbeat."""
        return self.lease_ttl

    @classmethod
    def load(cls, **overrides: Any) -> Settings:
        """Build settings from defaults, the config file, ``GPUMESH_*`` variables and ``overrides`` (not None)."""
        values = layered(cls.model_fields, overrides)
        try:
            return cls(**values)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"]) or "settings"
            raise UsageError(f"invalid setting {where}: {err['msg']}") from exc
