"""What packages a job declares, from any of the standard places (no resolution here: see ``lock``)."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from gpumesh.errors import UsageError

# PEP 723's reference expression for an inline metadata block.
_BLOCK = re.compile(r"(?m)^# /// (?P<type>[a-zA-Z0-9-]+)$\s(?P<content>(^#(| .*)$\s)+)^# ///$")


@dataclass(frozen=True)
class Declared:
    """A job's declared environment: requirement lines (PEP 508), a requirements file's text, requires-python."""

    dependencies: tuple[str, ...] = ()
    requirements: str = ""  # a requirements.txt's text (its own name kept for messages)
    requirements_name: str = ""
    pylock: str = ""  # a pylock.toml's text: locked already, used as it is
    requires_python: str = ""
    allow_builds: bool = False
    sources: tuple[str, ...] = field(default=(), compare=False)  # where each part came from, for messages

    @property
    def empty(self) -> bool:
        return not (self.dependencies or self.requirements.strip() or self.pylock)


def pep723(source: str, name: str = "the script") -> tuple[list[str], str]:
    """(dependencies, requires-python) of a script's ``# /// script`` block; ([], "") without one."""
    blocks = [m for m in _BLOCK.finditer(source) if m.group("type") == "script"]
    if not blocks:
        return [], ""
    if len(blocks) > 1:
        raise UsageError(f"{name} has more than one '# /// script' block; keep one (PEP 723)")
    content = "".join(
        line[2:] if line.startswith("# ") else line[1:] for line in blocks[0].group("content").splitlines(keepends=True)
    )
    try:
        meta = tomllib.loads(content)
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{name}: its '# /// script' block is not valid TOML ({exc})") from None
    deps = meta.get("dependencies", [])
    if not isinstance(deps, list) or not all(isinstance(d, str) for d in deps):
        raise UsageError(f'{name}: dependencies in its script block must be a list of strings, such as ["numpy"]')
    rp = meta.get("requires-python", "")
    if not isinstance(rp, str):
        raise UsageError(f'{name}: requires-python in its script block must be a string, such as ">=3.11"')
    return deps, rp


def _project_deps(folder: Path) -> tuple[list[str], str]:
    """A project's ``[project].dependencies`` and ``requires-python`` from its pyproject.toml, if any."""
    path = folder / "pyproject.toml"
    if not path.is_file():
        return [], ""
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise UsageError(f"{path}: cannot be read ({exc}); fix the file or leave --project out") from None
    proj = data.get("project", {})
    deps = proj.get("dependencies", []) if isinstance(proj, dict) else []
    rp = proj.get("requires-python", "") if isinstance(proj, dict) else ""
    return [d for d in deps if isinstance(d, str)], rp if isinstance(rp, str) else ""


def declare(
    source: str | None = None,
    script_name: str = "the script",
    with_: tuple[str, ...] | list[str] = (),
    requirements: str | Path | None = None,
    dependencies: tuple[str, ...] | list[str] = (),
    project: Path | None = None,
    python: str = "",
    allow_builds: bool = False,
) -> Declared:
    """Everything a job declares, merged: the script's block, the project's pyproject.toml (with ``uv.lock``
    honoured as constraints, see ``lock``), ``--requirements`` and ``--with``/``dependencies=``."""
    deps: list[str] = []
    rp = python
    sources: list[str] = []
    if source is not None:
        d, p = pep723(source, script_name)
        deps += d
        rp = rp or p
        if d:
            sources.append(f"{script_name}'s script block")
    if project is not None:
        d, p = _project_deps(project)
        deps += d
        rp = rp or p
        if d:
            sources.append(f"{project / 'pyproject.toml'}")
    for spec in [*with_, *dependencies]:
        if not isinstance(spec, str) or not spec.strip():
            raise UsageError(f"--with / dependencies: {spec!r} is not a requirement such as 'numpy>=1.26'")
        deps.append(spec.strip())
    req_text = pylock = req_name = ""
    if requirements is not None:
        path = Path(requirements).expanduser()
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"--requirements {requirements}: cannot be read ({exc})") from None
        if path.name == "pylock.toml" or (path.name.startswith("pylock.") and path.suffix == ".toml"):
            pylock = text
        else:
            req_text = text
        req_name = str(path)
        sources.append(str(path))
    if with_ or dependencies:
        sources.append("--with")
    return Declared(tuple(deps), req_text, req_name, pylock, rp, allow_builds, tuple(sources))
