"""Where settings come from, without building them: the config file, then ``GPUMESH_*`` variables, then
what a caller passes (flags), later over earlier. :class:`gpumesh.settings.Settings` validates what this
gathers; a command that needs one or two values and must start fast (``status --json``) reads them here
and leaves everything else to Settings (imports no pydantic).
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import click

from gpumesh.errors import UsageError

ENV_PREFIX = "GPUMESH_"
DEFAULT_URL = "redis://127.0.0.1:6379/0"
DEFAULT_LEASE_TTL = 30.0  # s; also how long a worker counts as live after its last heartbeat
DEFAULT_HEARTBEAT_INTERVAL = 5.0  # s
# Every setting's name, as Settings names its fields (tests/cli/test_cli_start.py checks they agree): the
# config file's keys a command that reads some settings here may meet.
NAMES = (
    "url", "lease_ttl", "heartbeat_interval", "tiers", "cache_dir", "log_max_bytes", "result_max_bytes",
    "task_memory_mb", "job_retention", "sandbox_python", "isolation", "read_paths", "write_paths", "cache_paths",
    "signing_key",
    "outage_patience", "artifacts", "artifact_file_mb", "artifact_task_mb", "artifact_job_mb", "artifact_files",
    "trusted_keys", "project_max_mb", "project_max_files", "project_cache", "project_cache_mb",
    "stop_grace", "pause_probe_interval", "pause_probe_timeout", "idle_probe", "gpu_probe", "checkpoint_every",
    "checkpoint_mb", "lent_file", "reuse_idle",
    "envs", "env_cache", "env_cache_mb", "allow_builds",
)  # fmt: skip


def config_path() -> Path:
    """Where ``gpumesh config init`` writes and every command reads the config file."""
    override = os.environ.get(ENV_PREFIX + "CONFIG")
    return Path(override) if override else Path(click.get_app_dir("gpumesh")) / "config.toml"


def layered(names: Iterable[str], overrides: dict[str, Any]) -> dict[str, Any]:
    """The raw values of these settings, unchecked: the config file's, over them ``GPUMESH_<NAME>`` (not
    empty), over them ``overrides`` (not None). The config file's other keys come along (Settings refuses
    those it does not know). An unreadable config file is a UsageError."""
    values: dict[str, Any] = {}
    path = config_path()
    if path.is_file():
        try:
            values.update(tomllib.loads(path.read_text()))
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise UsageError(f"config file {path} is unreadable ({exc}); fix it or delete it") from exc
    for name in names:
        env = os.environ.get(ENV_PREFIX + name.upper())
        if env not in (None, ""):
            values[name] = env
    values.update({k: v for k, v in overrides.items() if v is not None})
    return values
