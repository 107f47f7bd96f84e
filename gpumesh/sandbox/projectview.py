"""An attempt's view of its project: the attempt's own directory, where the project's files appear at their
paths as links into the machine's read-only copy of the tree (gpumesh.worker.projects).

Why links in a directory of the attempt's own rather than the tree as the working directory: what a task
creates there (a checkpoint, ``outputs/``, a temp file) belongs to its attempt and goes with it, and what
it does to a project file changes nothing for anyone else: writing through a link is refused (the tree is
read-only to the task: not its user's files, and outside its Landlock write paths), and removing or
renaming a link changes only its own view. One link per top-level entry costs a few system calls per
attempt whatever the project's size; only the folders an attempt must write into (the one holding its
script, the folders its output globs name) are real folders here, each with links to its own entries.

On ext4 each link made and removed updates the journal (tens of microseconds apiece, far more on a busy
disk), so a worker does not make them for every attempt: the directory of an attempt that ended confined
(Landlock kept it to that directory) is reset for an attempt after the next of the same view (:func:`reset`:
what the attempt made there goes, its links are checked and mended) and taken again.
"""

from __future__ import annotations

import functools
import os
import shutil
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gpumesh.sandbox import taskdir


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


@functools.lru_cache(maxsize=64)
def links(view: View, skip: str) -> dict[str, str]:
    """The links :func:`populate` makes at the top of an attempt's directory for a view with nothing to expand
    (name -> target): what a directory made ahead must hold to be taken as made. Made once per view: not to be
    changed by the caller."""
    return {name: os.path.join(view.tree, name) for name in _entries(view.tree) if name != skip}


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
            _make_missing(view, folder, name, fd, owner)


def _make_missing(view: View, folder: str, name: str, fd: int, owner: tuple[int, int] | None) -> None:
    """Make ``folder`` (``name`` in ``fd``), a folder the project lacks, with the ones below it the view needs."""
    os.mkdir(name, 0o755, dir_fd=fd)
    sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
    try:
        for below in sorted(view.expand):
            parent, _, child = below.rpartition("/")
            if parent == folder:
                _make_missing(view, below, child, sub, owner)
        if owner is not None:
            os.fchown(sub, *owner)
    finally:
        os.close(sub)


def reset(workdir: str, fd: int, links: Mapping[str, str], script: str) -> bool:
    """Make an ended attempt's directory (``fd``, opened before the attempt ran) as a directory made ahead for
    the same view would be: only ``links`` (each leading where it should) and an empty output directory; what
    the attempt made there, or changed, goes. Whether it could (a directory renamed, replaced or not this
    user's is left to be removed)."""
    try:
        st = os.fstat(fd)
        if not os.path.samestat(os.stat(workdir, follow_symlinks=False), st) or st.st_uid != os.geteuid():
            return False
        for name in os.listdir(fd):
            if name in links and _leads(name, fd, links[name]):
                continue
            if name == taskdir.OUTPUT and _empty_own_dir(name, fd):
                continue
            if stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                shutil.rmtree(name, dir_fd=fd)  # through the descriptor, never following a link
            else:
                os.unlink(name, dir_fd=fd)
        present = set(os.listdir(fd))
        for name, target in links.items():
            if name not in present:
                os.symlink(target, name, dir_fd=fd)
        if taskdir.OUTPUT not in present:
            os.mkdir(taskdir.OUTPUT, dir_fd=fd)
        os.fchmod(fd, 0o700)
        return script not in links  # and checked again as it is taken (Meanwhile.take_dir_for: taskdir.untouched)
    except OSError:
        return False


def _leads(name: str, fd: int, target: str) -> bool:
    try:
        return os.readlink(name, dir_fd=fd) == target
    except OSError:
        return False


def _empty_own_dir(name: str, fd: int) -> bool:
    try:
        sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
    except OSError:
        return False
    try:
        return os.fstat(sub).st_uid == os.geteuid() and not os.listdir(sub)
    finally:
        os.close(sub)
