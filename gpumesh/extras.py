"""How to install an optional extra: a command that works where this gpumesh came from.

The distribution, gpumesh-pool, is not on the package index (and ``gpumesh`` there is another project), so
asking the index for it with an extra fails, and would install whatever someone later publishes under that
name. A hint names instead the checkout this gpumesh was installed from, the git URL it came from, or, for
any other install, the extra's own requirements, read from the installed metadata.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

DISTRIBUTION = "gpumesh-pool"


def _origin() -> tuple[dict[str, Any] | None, list[str]]:
    """(direct_url.json of the installed distribution or None, its requirement lines); (None, []) if not installed.
    Only an installed one (pip wrote INSTALLER): a checkout's *.egg-info on sys.path says nothing of where from."""
    for dist in importlib.metadata.distributions(name=DISTRIBUTION):
        if dist.read_text("INSTALLER") is None:
            continue
        try:
            direct = json.loads(dist.read_text("direct_url.json") or "null")
        except ValueError:
            direct = None
        return direct if isinstance(direct, dict) else None, list(dist.requires or [])
    return None, []


def extra_requirements(extra: str, requires: list[str]) -> list[str]:
    """The requirements of ``extra`` among a distribution's requirement lines (``NAME>=1; extra == "x"``)."""
    found = []
    for line in requires:
        spec, _, marker = line.partition(";")
        if re.search(rf"""\bextra\s*==\s*["']{re.escape(extra)}["']""", marker):
            found.append(spec.strip())
    return found


def install_command(extra: str, origin: dict[str, Any] | None, requires: list[str], source: Path | None) -> list[str]:
    """The pip arguments that install ``extra`` (gpumesh itself for ``""``): from the checkout (``-e`` when it was
    editable), from the git URL at its commit, else the extra's requirements. ``source``: a source tree to name
    when gpumesh is not installed at all (run from a checkout on sys.path)."""
    brackets = f"[{extra}]" if extra else ""
    url = str((origin or {}).get("url", ""))
    vcs = (origin or {}).get("vcs_info")
    if isinstance(vcs, dict) and url:
        commit = f"@{vcs['commit_id']}" if vcs.get("commit_id") else ""
        return [f"{DISTRIBUTION}{brackets} @ {vcs.get('vcs', 'git')}+{url}{commit}"]
    if origin and isinstance(origin.get("dir_info"), dict) and url.startswith("file:"):
        editable = bool(origin["dir_info"].get("editable"))
        return [*(["-e"] if editable else []), unquote(urlsplit(url).path) + brackets]
    wanted = extra_requirements(extra, requires) if extra else []
    if wanted:
        return wanted
    if source is not None:
        return ["-e", f"{source}{brackets}"]
    return [f"{DISTRIBUTION}{brackets} @ git+<the gpumesh repository's URL>"]


def _source_tree() -> Path | None:
    here = Path(__file__).resolve().parent.parent
    return here if (here / "pyproject.toml").is_file() else None


def pip_command(args: list[str]) -> str:
    """pip's install command with ``args``, for the interpreter running this gpumesh (a bare pip may be another's)."""
    return shlex.join([sys.executable, "-m", "pip", "install", *args])


def install_hint(extra: str = "") -> str:
    """A shell command that installs ``extra`` (or, for ``""``, gpumesh itself) into the environment running
    this gpumesh."""
    origin, requires = _origin()
    return pip_command(install_command(extra, origin, requires, _source_tree()))
