"""Resolve a declared environment once, on the submitting machine, into a pinned, hash-checked lock.

uv's universal resolution (``uv pip compile --universal --generate-hashes``) gives one requirements file with
markers for every platform and a hash for every file a worker may install; a project with a ``uv.lock`` is
exported from it (``uv export --frozen``) and the extra declarations resolved under its pins. The lock's digest
covers its text, the Python it asks for and whether it allows source builds: the job's signature covers it.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

from gpumesh.envs.declare import Declared
from gpumesh.errors import UsageError

_LOWER = re.compile(r"(?:>=|==|~=)\s*(\d+\.\d+)")


def uv_binary() -> str:
    """The uv executable that ships with gpumesh (the ``uv`` package on PyPI)."""
    try:
        from uv import find_uv_bin
    except ImportError:  # pragma: no cover - uv is a dependency
        raise UsageError("uv is not installed here; run: pip install uv") from None
    return str(find_uv_bin())


@dataclass(frozen=True)
class Lock:
    """A resolved environment: what every worker installs exactly."""

    text: str  # requirements.txt lines, each pinned (==) with its hashes
    requires_python: str = ""
    allow_builds: bool = False

    @property
    def digest(self) -> str:
        return digest_of(self.text, self.requires_python, self.allow_builds)

    @property
    def packages(self) -> list[str]:
        """``name==version`` of each locked package (markers left out)."""
        out = []
        for line in self.text.splitlines():
            line = line.strip()
            if line and not line.startswith(("#", "-")):
                out.append(line.split(";")[0].split(" ")[0].strip())
        return out


def digest_of(text: str, requires_python: str, allow_builds: bool) -> str:
    canon = json.dumps([text, requires_python, bool(allow_builds)], separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()


def python_version(requires_python: str) -> str:
    """The lowest minor version a ``requires-python`` allows (what the universal resolution starts from)."""
    m = _LOWER.search(requires_python)
    return m.group(1) if m else ""


def _run(cmd: list[str], what: str, cwd: str | None = None) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UsageError(f"{what}: uv could not run ({exc})") from None
    if proc.returncode != 0:
        msg = proc.stderr.strip() or proc.stdout.strip() or f"uv exited with {proc.returncode}"
        raise UsageError(f"{what}: the environment cannot be resolved:\n{msg}")
    return proc.stdout


def from_pylock(text: str, name: str) -> str:
    """A ``pylock.toml`` (PEP 751) as the pinned, hashed requirements it stands for: locked already."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{name} is not valid TOML ({exc})") from None
    out = []
    for pkg in data.get("packages", []):
        if not isinstance(pkg, dict) or not pkg.get("name") or not pkg.get("version"):
            raise UsageError(f"{name}: every package needs a name and a version (a VCS or folder one cannot travel)")
        files = [*pkg.get("wheels", []), *([pkg["sdist"]] if isinstance(pkg.get("sdist"), dict) else [])]
        hashes = sorted(
            {f["hashes"]["sha256"] for f in files if isinstance(f, dict) and "sha256" in f.get("hashes", {})}
        )
        if not hashes:
            raise UsageError(f"{name}: {pkg['name']} has no sha256 hash; a lock must name every file's hash")
        marker = f" ; {pkg['marker']}" if pkg.get("marker") else ""
        out.append(
            f"{pkg['name']}=={pkg['version']}{marker} \\\n" + " \\\n".join(f"    --hash=sha256:{h}" for h in hashes)
        )
    return "".join(line + "\n" for line in out)


def lock(declared: Declared, project: Path | None = None) -> Lock | None:
    """Resolve ``declared`` with uv (the submitting machine's index settings); None for no environment.
    A resolution that fails is a UsageError with uv's own message."""
    if declared.empty and not (project is not None and (project / "uv.lock").is_file() and declared.sources):
        return None
    uv = uv_binary()
    rp = declared.requires_python
    what = "environment"
    with tempfile.TemporaryDirectory(prefix="gpumesh-lock-") as tmp:
        src = Path(tmp) / "requirements.in"
        lines = list(declared.dependencies)
        if declared.requirements:
            (Path(tmp) / "requirements.txt").write_text(declared.requirements)
            lines.append("-r requirements.txt")
        pinned = from_pylock(declared.pylock, declared.requirements_name) if declared.pylock else ""
        if pinned and not lines:  # locked already: used as it is
            return Lock(pinned, rp, declared.allow_builds)
        if pinned:  # more declared beside it: resolved under its pins
            (Path(tmp) / "pylock.txt").write_text(pinned)
            lines.append("-c pylock.txt")
        src.write_text("\n".join(lines) + "\n")
        cmd = [uv, "pip", "compile", "--universal", "--generate-hashes", "--no-header", "--no-annotate", "--quiet"]
        if not declared.allow_builds:
            cmd += ["--only-binary", ":all:"]
        version = python_version(rp)
        if rp and not version:
            raise UsageError(f"requires-python {rp!r}: give a lower bound such as '>=3.11'")
        if version:
            cmd += ["--python-version", version]
        if project is not None and (project / "uv.lock").is_file():
            exported = _run(
                [uv, "export", "--frozen", "--format", "requirements-txt", "--no-emit-project", "--no-dev",
                 "--no-header", "--no-annotate", "--project", str(project), "--quiet"],
                f"{project / 'uv.lock'}",
            )  # fmt: skip
            (Path(tmp) / "uv-lock.txt").write_text(exported)
            cmd += ["--constraint", "uv-lock.txt"]
        text = _run([*cmd, str(src)], what, cwd=tmp)
    text = "".join(line + "\n" for line in text.splitlines() if line.strip() and not line.startswith("#"))
    return Lock(text, rp, declared.allow_builds)


def check_lock(text: str) -> str | None:
    """Why a lock must not be installed (a line that names an index, a file, a URL or an option), or None.
    Where packages come from is the worker's owner's choice, never the job's."""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#") or line.startswith("--hash="):
            continue
        if line.startswith("-"):
            return f"the lock carries an option ({line.split()[0]}); a job cannot name where packages come from"
        head = line.split(";")[0]
        if "==" not in head or "@" in head or "://" in line:
            return f"the lock has an unpinned or direct-URL line ({head.strip()[:60]})"
    return None


def env_requirements(env: Lock) -> list[str]:
    """What a job with ``env`` requires of a worker: that it builds envs, and a Python the lock allows."""
    out = ["envs=yes"]
    version = python_version(env.requires_python)
    if version:
        want = python_resource(version)
        out.append(f"python>={want}" if ">=" in env.requires_python else f"python={want}")
    return out


def python_resource(version: str) -> str:
    """A minor version as the ``python`` resource holds it, a number that compares as versions do: 3.9 is
    ``3.09``, 3.12 is ``3.12`` (so 3.9 < 3.10 < 3.12 numerically too)."""
    major, _, minor = version.partition(".")
    return f"{int(major)}.{int(minor or 0):02d}"


def env_label(digest: str) -> str:
    return digest[:12]


__all__ = ["Lock", "check_lock", "digest_of", "env_requirements", "lock", "python_version", "uv_binary"]
