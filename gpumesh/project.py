"""A project: the folder a job's script lives in, packed on the submitting machine (DESIGN §10).

:func:`pack` walks DIR and decides what travels: everything but ``.git/``, virtualenvs (a folder with
``pyvenv.cfg``), ``__pycache__``, what ``.gitignore`` files (nested ones too) and ``.gpumeshignore``
exclude (gitignore syntax, matched by ``pathspec``), and files that look like secrets unless an
``--include`` pattern names them. Links that stay inside DIR travel as links; one leading out of it, a
FIFO, a socket or a device is refused with its path. Caps on bytes and files are checked from the
walk's sizes before a byte is read, so a project over them writes nothing.

What travels is a *manifest*: the sorted list of files (path, SHA-256, size, executable bit) and links
(path, target), as canonical JSON; its SHA-256 is the project's *tree digest*, which the job's
signature covers. File contents are stored by their SHA-256 (gpumesh.store.projects), so a resubmit
sends only the files the mesh does not hold.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pathspec

from gpumesh.errors import UsageError

MB = 1 << 20
DEFAULT_MAX_MB = 100.0
DEFAULT_MAX_FILES = 10_000
IGNORE_FILES = (".gitignore", ".gpumeshignore")  # read in every folder; the latter also outside git
ALWAYS_LEFT_OUT = (".git", "__pycache__")  # folders never sent (a virtualenv is recognised by its pyvenv.cfg)
# Names that look like secrets: left out unless --include names them (gitignore syntax).
SECRET_PATTERNS = (
    ".env", ".env.*", "*.pem", "*.key", "id_rsa*", "id_dsa*", "id_ecdsa*", "id_ed25519*", ".netrc", "credentials.json",
    ".pypirc", ".git-credentials",
)  # fmt: skip
_SECRETS = pathspec.GitIgnoreSpec.from_lines(SECRET_PATTERNS)
MANIFEST_VERSION = 1


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative, '/'-separated
    sha256: str
    size: int
    executable: bool


@dataclass
class LeftOut:
    """What the rules kept back, for submit's one line."""

    by_rule: dict[str, int] = field(default_factory=dict)  # ".git", "virtualenv", "__pycache__", ".gitignore"...
    secrets: list[str] = field(default_factory=list)

    def note(self, why: str, n: int = 1) -> None:
        self.by_rule[why] = self.by_rule.get(why, 0) + n


@dataclass
class Packed:
    """A packed project: its manifest (canonical JSON) and digest, and where each file's bytes are here."""

    root: Path
    script: str  # the script's path inside the project ('' for a function's entry script, which is not in it)
    manifest: str
    digest: str
    files: list[FileEntry]
    links: list[tuple[str, str]]
    local: dict[str, Path]  # sha256 -> a file here with those bytes
    left_out: LeftOut
    sent_files: int = 0  # set once stored: how many files (and bytes) this submit had to send
    sent_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def summary(self) -> str:
        """Submit's one line: what was packed and sent, and what the rules left out."""
        line = (
            f"project {self.root}: {len(self.files)} files, {_size(self.total_bytes)}; "
            f"sent {self.sent_files} files, {_size(self.sent_bytes)}"
        )
        rules = [f"{n} {why}" for why, n in sorted(self.left_out.by_rule.items())]
        if rules:
            line += "; left out by rule: " + ", ".join(rules)
        if self.left_out.secrets:
            shown = ", ".join(self.left_out.secrets[:5]) + (" ..." if len(self.left_out.secrets) > 5 else "")
            line += f"; secret-looking, left out (--include GLOB sends one): {shown}"
        return line


def _size(n: int) -> str:
    if n < 10 * 1024:
        return f"{n} B"
    if n < 10 * MB:
        return f"{n / 1024:.1f} KiB"
    return f"{n / MB:.1f} MiB"


class _Rules:
    """The ignore files met on the way down: each applies to the paths below its folder; the deepest that
    says something about a path decides (as git does)."""

    def __init__(self) -> None:
        self.specs: list[tuple[str, pathspec.GitIgnoreSpec, str]] = []  # (folder prefix, spec, file name)

    def add(self, folder: str, directory: Path) -> None:
        for name in IGNORE_FILES:
            p = directory / name
            try:
                if p.is_file() and not p.is_symlink():
                    lines = p.read_text(encoding="utf-8", errors="replace").splitlines()
                    self.specs.append((folder, pathspec.GitIgnoreSpec.from_lines(lines), name))
            except OSError:
                continue

    def ignored_by(self, rel: str, is_dir: bool) -> str | None:
        """The ignore file that leaves ``rel`` out, or None."""
        verdict: str | None = None
        for folder, spec, name in self.specs:
            if folder and not rel.startswith(folder):
                continue
            sub = rel[len(folder) :] + ("/" if is_dir else "")
            res = spec.check_file(sub)
            if res.include is not None:
                verdict = name if res.include else None
        return verdict


def _is_venv(directory: Path) -> bool:
    return (directory / "pyvenv.cfg").is_file()


def pack(
    root: str | Path, script: str | Path | None = None, include: Iterable[str] = (),
    max_mb: float = DEFAULT_MAX_MB, max_files: int = DEFAULT_MAX_FILES,
) -> Packed:  # fmt: skip
    """Pack the folder ``root`` (``script``: a file that must lie inside it, None for a function's entry
    script, which checks its own module file with :func:`check_inside`). UsageError (exit 2) naming the
    path for a folder that cannot be sent: missing, a link out of it, a FIFO or device, over a cap."""
    top = Path(root).expanduser()
    if not top.is_dir():
        raise UsageError(f"--project {root}: no such folder")
    top = top.resolve()
    script_rel = check_inside(top, script) if script is not None else ""
    rescue = pathspec.GitIgnoreSpec.from_lines(list(include)) if include else None
    rules = _Rules()
    left = LeftOut()
    found: list[tuple[str, Path, int, bool]] = []
    links: list[tuple[str, str]] = []
    sizes: dict[str, int] = {}
    for dirpath, dirnames, filenames in os.walk(top, followlinks=False):
        here = Path(dirpath)
        folder = here.relative_to(top).as_posix()
        folder = "" if folder == "." else folder + "/"
        rules.add(folder, here)
        keep_dirs = []
        for name in sorted(dirnames):
            rel, full = folder + name, here / name
            if full.is_symlink():
                links.append((rel, _link_target(top, full, rel)))
                continue
            why = _left_out_dir(name, full, rel, rules)
            if why and not (rescue is not None and rescue.match_file(rel + "/")):
                left.note(why)
                continue
            keep_dirs.append(name)
        dirnames[:] = keep_dirs
        for name in sorted(filenames):
            rel, full = folder + name, here / name
            st = full.lstat()
            if stat.S_ISLNK(st.st_mode):
                links.append((rel, _link_target(top, full, rel)))
                continue
            if not stat.S_ISREG(st.st_mode):
                raise UsageError(f"--project: {full} is not a regular file (a FIFO, socket or device); remove it or "
                                 "list it in .gpumeshignore")  # fmt: skip
            rescued = rescue is not None and rescue.match_file(rel)
            ignored = rules.ignored_by(rel, False)
            if ignored and not rescued and rel != script_rel:
                left.note(f"by {ignored}")
                continue
            if _SECRETS.match_file(rel) and not rescued:
                left.secrets.append(rel)
                continue
            found.append((rel, full, st.st_size, bool(st.st_mode & 0o111)))
            sizes[rel] = st.st_size
    if script_rel and script_rel not in sizes:
        raise UsageError(f"the script {script_rel} is left out of the project by its ignore rules; --include it")
    _check_caps(top, sizes, max_mb, max_files)
    files, local = _hash_all(found)
    return _packed(top, script_rel, files, sorted(links), local, left)


def _packed(
    top: Path, script_rel: str, files: list[FileEntry], links: list[tuple[str, str]], local: dict[str, Path],
    left: LeftOut,
) -> Packed:  # fmt: skip
    manifest = manifest_text(files, links)
    digest = hashlib.sha256(manifest.encode()).hexdigest()
    return Packed(top, script_rel, manifest, digest, files, links, local, left)


def manifest_text(files: list[FileEntry], links: list[tuple[str, str]]) -> str:
    """The canonical JSON the tree digest is the SHA-256 of."""
    doc = {
        "v": MANIFEST_VERSION,
        "files": [[f.path, f.sha256, f.size, int(f.executable)] for f in sorted(files, key=lambda f: f.path)],
        "links": [[p, t] for p, t in sorted(links)],
    }
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=True)


def check_inside(top: Path, script: str | Path) -> str:
    """``script``'s path inside ``top``, '/'-separated; UsageError when it lies outside."""
    path = Path(script).expanduser().resolve()
    try:
        return path.relative_to(top).as_posix()
    except ValueError:
        raise UsageError(
            f"the script {script} is outside the project folder {top}: put it inside, or pass the folder that holds it"
        ) from None


def _left_out_dir(name: str, full: Path, rel: str, rules: _Rules) -> str | None:
    if name in ALWAYS_LEFT_OUT:
        return name
    if _is_venv(full):
        return "virtualenv"
    ignored = rules.ignored_by(rel, True)
    return f"by {ignored}" if ignored else None


def _link_target(top: Path, link: Path, rel: str) -> str:
    """A link's target, relative, once it stays inside ``top``; UsageError naming it otherwise."""
    target = os.readlink(link)
    resolved = (link.parent / target).resolve()
    if not resolved.is_relative_to(top) or not resolved.exists():
        raise UsageError(
            f"--project: {link} is a symbolic link leading out of {top} (to {target}); copy what it names into the "
            "folder, or list it in .gpumeshignore"
        )
    relative = posixpath.relpath(resolved.relative_to(top).as_posix(), posixpath.dirname(rel) or ".")
    return relative


def _check_caps(top: Path, sizes: dict[str, int], max_mb: float, max_files: int) -> None:
    total = sum(sizes.values())
    over = []
    if max_files and len(sizes) > max_files:
        over.append(f"{len(sizes)} files, over the cap of {max_files} (GPUMESH_PROJECT_MAX_FILES)")
    if max_mb and total > max_mb * MB:
        over.append(f"{_size(total)}, over the cap of {max_mb:g} MiB (GPUMESH_PROJECT_MAX_MB)")
    if not over:
        return
    by_folder: dict[str, list[int]] = {}
    for rel, size in sizes.items():
        head = rel.split("/", 1)[0] + ("/" if "/" in rel else "")
        entry = by_folder.setdefault(head, [0, 0])
        entry[0] += size
        entry[1] += 1
    largest = sorted(by_folder.items(), key=lambda kv: (-kv[1][0], -kv[1][1]))[:3]
    shown = ", ".join(f"{name} ({_size(b)}, {n} files)" for name, (b, n) in largest)
    raise UsageError(
        f"--project {top}: {' and '.join(over)}; largest: {shown}. List what need not travel in .gpumeshignore, "
        "or raise the cap"
    )


def _hash_all(found: list[tuple[str, Path, int, bool]]) -> tuple[list[FileEntry], dict[str, Path]]:
    files: list[FileEntry] = []
    local: dict[str, Path] = {}
    for rel, full, _size_seen, executable in found:
        digest = hashlib.sha256()
        size = 0
        try:
            with open(full, "rb") as f:
                while chunk := f.read(1 << 20):
                    digest.update(chunk)
                    size += len(chunk)
        except OSError as exc:
            raise UsageError(f"--project: cannot read {full}: {exc.strerror or exc}") from None
        sha = digest.hexdigest()
        files.append(FileEntry(rel, sha, size, executable))
        local.setdefault(sha, full)
    return files, local


def parse_manifest(text: str) -> dict[str, Any]:
    """A stored manifest, checked before any path in it names anything on a worker's disk."""
    doc = json.loads(text)
    if not isinstance(doc, dict) or doc.get("v") != MANIFEST_VERSION:
        raise ValueError("not a project manifest this version of gpumesh reads")
    for entry in doc["files"]:
        safe_rel(entry[0])
        if not (isinstance(entry[1], str) and len(entry[1]) == 64 and isinstance(entry[2], int)):
            raise ValueError(f"malformed entry for {entry[0]!r}")
    for path, target in doc["links"]:
        safe_rel(path)
        joined = posixpath.normpath(posixpath.join(posixpath.dirname(path), target))
        if not isinstance(target, str) or target.startswith("/") or joined == ".." or joined.startswith("../"):
            raise ValueError(f"link {path!r} leads out of the project")
    return doc


def safe_rel(path: Any) -> str:
    """A relative, normalised path that stays inside its folder; ValueError otherwise."""
    if not isinstance(path, str) or not path or "\0" in path or "\\" in path:
        raise ValueError(f"unusable path {path!r}")
    norm = posixpath.normpath(path)
    if norm != path or path.startswith("/") or norm == ".." or norm.startswith("../") or norm == ".":
        raise ValueError(f"path {path!r} would leave the project folder")
    return path
