"""A job file, ``gpumesh.toml`` (DESIGN §10): what ``gpumesh submit`` and ``Mesh.submit_file`` read instead of
flags, and what ``gpumesh init`` writes from what it finds in a folder.

Paths in it are relative to the file's folder. An unknown key or a value of the wrong type is bad input
naming the key and the file.
"""

from __future__ import annotations

import ast
import json
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gpumesh.errors import UsageError
from gpumesh.models import parse_payloads

NAME = "gpumesh.toml"


class JobTable(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    script: str
    payloads: str | list[dict[str, Any]]
    project: str | None = None
    name: str = ""
    priority: int = 0
    requires: list[str] = Field(default_factory=list)
    timeout: float | int = 3600
    max_attempts: int = 3
    retry_on: list[str] | None = None
    outputs: list[str] = Field(default_factory=list)
    include: list[str] = Field(default_factory=list)
    reuse_process: bool = False


class EnvTable(BaseModel):
    """``[env]``: the packages that travel with the job (docs/environments.md)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    dependencies: list[str] = Field(default_factory=list)
    requirements: str | None = None
    python: str = ""
    allow_builds: bool = False
    preload: list[str] = Field(default_factory=list)


class JobFile(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    job: JobTable
    env: EnvTable | None = None


class Spec:
    """A job file, read and checked: its paths made absolute (relative to its folder)."""

    def __init__(self, path: Path, job: JobTable, env: EnvTable | None = None) -> None:
        self.path = path
        self.job = job
        self.env = env
        self.base = path.parent

    @property
    def requirements(self) -> Path | None:
        return self._abs(self.env.requirements) if self.env is not None and self.env.requirements else None

    def _abs(self, value: str) -> Path:
        p = Path(value).expanduser()
        return p if p.is_absolute() else self.base / p

    @property
    def script(self) -> Path:
        return self._abs(self.job.script)

    @property
    def project(self) -> Path | None:
        return self._abs(self.job.project) if self.job.project is not None else None

    def payloads(self) -> list[dict[str, Any]]:
        raw = self.job.payloads
        if isinstance(raw, list):
            return parse_payloads(json.dumps(raw), f"{self.path}: job.payloads")
        source = self._abs(raw)
        try:
            text = source.read_text(encoding="utf-8")
        except OSError as exc:
            raise UsageError(f"{self.path}: job.payloads: cannot read {source}: {exc.strerror or exc}") from None
        return parse_payloads(text, str(source))

    def submit_kwargs(self) -> dict[str, Any]:
        """Mesh.submit's arguments (script and payloads among them)."""
        j = self.job
        out: dict[str, Any] = {
            "script": self.script, "payloads": self.payloads(), "name": j.name or None, "priority": j.priority,
            "requires": j.requires, "timeout": float(j.timeout), "max_attempts": j.max_attempts, "outputs": j.outputs,
            "include": j.include, "project": self.project, "reuse_process": j.reuse_process,
        }  # fmt: skip
        if j.retry_on is not None:
            out["retry_on"] = j.retry_on
        if self.env is not None:
            out.update(dependencies=self.env.dependencies, requirements=self.requirements, python=self.env.python,
                       allow_builds=self.env.allow_builds, preload=self.env.preload)  # fmt: skip
        return out


def load(path: Path) -> Spec:
    """Read and check a job file; UsageError (exit 2) naming the file and the key for anything wrong."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(
            f"no job file {path}: give a SCRIPT, or write one with `gpumesh init` (or name another with -f FILE)"
        ) from None
    except OSError as exc:
        raise UsageError(f"cannot read the job file {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{path} is not valid TOML: {exc}") from None
    try:
        parsed = JobFile.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        err = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])  # a typo explains the rest
        key = ".".join(str(p) for p in err["loc"] if not str(p).startswith(("function-", "list[", "str")))
        if err["type"] == "extra_forbidden":
            raise UsageError(
                f"{path}: unknown key {key!r}; see docs/projects.md for the keys a job file takes"
            ) from None
        if err["type"] == "missing":
            raise UsageError(f"{path}: {key} is required") from None
        raise UsageError(f"{path}: {key}: {err['msg']} (got {_show(err.get('input'))})") from None
    return Spec(path.resolve(), parsed.job, parsed.env)


def _show(value: Any) -> str:
    try:
        return json.dumps(value)[:60]
    except (TypeError, ValueError):
        return type(value).__name__


# -- gpumesh init ------------------------------------------------------------------------------------


def _has_main_guard(path: Path) -> bool:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return False
    for node in tree.body:
        if isinstance(node, ast.If) and "__name__" in ast.unparse(node.test) and "__main__" in ast.unparse(node.test):
            return True
    return False


def guess(folder: Path) -> dict[str, str | None]:
    """What ``init`` finds in ``folder``: the script (the one .py at the top with a ``__main__`` guard, or the
    only .py there), a payloads*.json file and a requirements file."""
    top = sorted(p for p in folder.glob("*.py") if p.is_file())
    guarded = [p for p in top if _has_main_guard(p)]
    script = guarded[0] if len(guarded) == 1 else top[0] if len(top) == 1 else None
    payloads = sorted(folder.glob("payloads*.json"))
    reqs = [p for p in ("requirements.txt", "pylock.toml", "pyproject.toml") if (folder / p).is_file()]
    return {
        "script": script.name if script else None,
        "payloads": payloads[0].name if payloads else None,
        "requirements": reqs[0] if reqs else None,
    }


def template(found: dict[str, str | None]) -> str:
    """A commented job file from what :func:`guess` found."""
    script = found["script"]
    payloads = found["payloads"]
    lines = [
        "# gpumesh job file: `gpumesh submit` reads it when given no script (-f FILE for another).",
        "# Paths are relative to this file's folder. Flags given to submit override these values.",
        "[job]",
        f'script = "{script}"'
        if script
        else '# script = "SCRIPT.py"   # no one script with a __main__ guard found: name it',
        f'payloads = "{payloads}"'
        if payloads
        else '# payloads = "payloads.json"   # or inline: payloads = [{lr = 0.1}]',
        'project = "."                # ship this folder with the job (.gitignore and .gpumeshignore apply)',
        '# name = ""',
        "# priority = 0",
        '# requires = ["vram_gb>=16"]',
        "# timeout = 3600             # seconds per attempt",
        "# max_attempts = 3",
        '# outputs = ["outputs/*"]    # files the task writes to bring back (gpumesh pull)',
        '# include = [".env.example"] # secret-looking files to send anyway',
        "# reuse_process = false      # true: one process per worker runs the tasks; the script defines main(payload)",
    ]
    reqs = found["requirements"]
    lines += [
        "",
        "# The packages travel with the job: locked at submit (uv), built once per worker machine",
        "# (docs/environments.md). Uncomment [env] and what you need.",
        "# [env]",
        f'# requirements = "{reqs}"   # found here'
        if reqs and reqs != "pyproject.toml"
        else "# (pyproject.toml found: its dependencies travel with the project, its uv.lock honoured)"
        if reqs
        else '# requirements = "requirements.txt"   # or pylock.toml',
        '# dependencies = ["numpy"]   # or a PEP 723 block in the script',
        '# python = ">=3.11"',
        '# preload = ["numpy"]        # warm workers import these once per job, in its own sandboxed process',
    ]
    return "\n".join(lines) + "\n"
