"""An attempt's view of its project: the attempt's own directory, where the project's files appear at their
paths as links into the machine's read-only copy of the tree (gpumesh.worker.projects).

Why links in a directory of the attempt's own rather than the tree as the working directory: what a task
creates there (a checkpoint, ``outputs/``, a temp file) belongs to its attempt and goes with it, and what
it does to a project file changes nothing for anyone else: writing through a link is refused (the tree is
read-only to the task: not its user's files, and outside its Landlock write paths), and removing or
renaming a link changes only its own view. One link per top-level entry costs a few system calls per
attempt whatever the project's size; only the folders an attempt must write into (the one holding its
script, the folders its output globs name) are real folders here, each with links to its own entries.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class View:
    """What an attempt's directory shows: ``tree`` (a materialised tree's folder), with the folders
    ``expand`` made real (their entries linked one by one)."""

    tree: str
    expand: frozenset[str] = frozenset()


def folders_to_expand(script: str, globs: Iterable[str]) -> frozenset[str]:
    """The folders an attempt writes into: the script's (the runner writes the script there) and the literal
    leading folders of each output glob (``outputs/*.json``: outputs), with every folder above them."""
    out: set[str] = set()
    candidates = [script.rsplit("/", 1)[0] if "/" in script else ""]
    for glob in globs:
        parts = glob.strip("/").split("/")[:-1]
        literal = []
        for part in parts:
            if any(c in part for c in "*?[\\"):
                break
            literal.append(part)
        candidates.append("/".join(literal))
    for folder in candidates:
        parts = [p for p in folder.split("/") if p and p not in (".", "..")]
        for i in range(1, len(parts) + 1):
            out.add("/".join(parts[:i]))
    return frozenset(out)


@functools.lru_cache(maxsize=4096)
def _entries(folder: str) -> tuple[str, ...]:
    """A tree folder's names: a tree never changes, so each is listed once per worker."""
    return tuple(sorted(os.listdir(folder)))


def populate(view: View, dir_fd: int, skip: str, owner: tuple[int, int] | None) -> None:
    """Make the view in the attempt's directory (``dir_fd``, the worker's until handed over). ``skip``: the
    script's path, which the runner writes itself; ``owner``: the task's user (--sandbox-user), who owns
    what is made here, so that its attempt may remove or replace it."""
    _fill(view, "", dir_fd, skip, owner)


def _fill(view: View, rel: str, fd: int, skip: str, owner: tuple[int, int] | None) -> None:
    source = os.path.join(view.tree, rel) if rel else view.tree
    for name in _entries(source):
        path = f"{rel}/{name}" if rel else name
        if path == skip:
            continue
        if (
            path in view.expand
            and os.path.isdir(os.path.join(source, name))
            and not os.path.islink(os.path.join(source, name))
        ):
            os.mkdir(name, 0o755, dir_fd=fd)
            sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            try:
                _fill(view, path, sub, skip, owner)
                if owner is not None:
                    os.fchown(sub, *owner)
            finally:
                os.close(sub)
            continue
        os.symlink(os.path.join(source, name), name, dir_fd=fd)
        if owner is not None:
            os.chown(name, *owner, dir_fd=fd, follow_symlinks=False)
    # Folders the script or an output glob names that the project lacks: made here, the attempt's own.
    for folder in sorted(view.expand):
        parent, _, name = folder.rpartition("/")
        if parent == rel and name not in _entries(source):
            os.mkdir(name, 0o755, dir_fd=fd)
            sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            try:
                _fill_missing(view, folder, sub, owner)
                if owner is not None:
                    os.fchown(sub, *owner)
            finally:
                os.close(sub)


def _fill_missing(view: View, rel: str, fd: int, owner: tuple[int, int] | None) -> None:
    """Folders below a folder the project lacks, that the view needs too."""
    for folder in sorted(view.expand):
        parent, _, name = folder.rpartition("/")
        if parent == rel:
            os.mkdir(name, 0o755, dir_fd=fd)
            sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            try:
                _fill_missing(view, folder, sub, owner)
                if owner is not None:
                    os.fchown(sub, *owner)
            finally:
                os.close(sub)
