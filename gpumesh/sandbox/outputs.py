"""The files an attempt left in its output dir (``GPUMESH_OUTPUT_DIR``), read without following anything
the task could have planted there.

The worker may hold more privilege than the task (root, with ``--sandbox-user``), and the directory is
the task's: every directory is opened relative to its parent's descriptor (``os.fwalk``, which never
follows a symlink and checks that a directory was not swapped mid-walk) and every file with
``O_NOFOLLOW | O_NONBLOCK``, then checked with ``fstat`` on the open descriptor. Only regular files
with a single link are read: a symlink, a FIFO, a device or socket, or a hard link (which could name a
file the task itself may not read) is skipped with a note. Called once the attempt's whole process
tree is gone, so nothing changes the files while they are read.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Found:
    """A regular file: ``path`` relative to the output dir, '/'-separated; ``fd`` open for reading (the
    caller closes it)."""

    path: str
    size: int
    fd: int


@dataclass(frozen=True)
class Skipped:
    path: str
    reason: str


def walk(output_dir: str, dir_fd: int | None = None) -> Iterator[Found | Skipped]:
    """Every entry under ``output_dir``, in a stable order: a directory's files (sorted), then each of its
    subdirectories (sorted), depth first. With ``dir_fd`` (the attempt's directory, opened before the task
    could touch it) ``output_dir`` is a name in it: a task that renamed its directory and planted a
    symlink in its place cannot point the walk elsewhere."""
    try:
        top = os.open(output_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
    except OSError:
        return  # the task removed (or replaced) its output dir: nothing to collect
    try:
        yield from _walk_fd(top)
    finally:
        os.close(top)


def _walk_fd(top: int) -> Iterator[Found | Skipped]:
    for dirpath, dirnames, filenames, dirfd in os.fwalk(".", dir_fd=top, follow_symlinks=False):
        dirnames.sort()
        rel = "" if dirpath == "." else dirpath.removeprefix("./") + "/"
        for name in list(dirnames):
            if _is_link(name, dirfd):
                dirnames.remove(name)
                yield Skipped(rel + name, "a symbolic link (never followed)")
        for name in sorted(filenames):
            yield _open(rel + name, name, dirfd)


def _is_link(name: str, dirfd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dirfd, follow_symlinks=False).st_mode)
    except OSError:
        return True


def _open(path: str, name: str, dirfd: int) -> Found | Skipped:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY, dir_fd=dirfd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a symlink, refused by O_NOFOLLOW
            return Skipped(path, "a symbolic link (never followed)")
        return Skipped(path, f"cannot be read ({exc.strerror})")
    st = os.fstat(fd)
    why = None
    if not stat.S_ISREG(st.st_mode):
        why = "not a regular file (a FIFO, socket or device)"
    elif st.st_nlink != 1:
        why = "a hard link (it may name a file outside the output dir)"
    if why:
        os.close(fd)
        return Skipped(path, why)
    return Found(path, st.st_size, fd)


def walk_with_globs(
    output_dir: str, dir_fd: int, globs: tuple[str, ...], leave_out: frozenset[str] = frozenset()
) -> Iterator[Found | Skipped]:
    """:func:`walk` of the output dir, then the files of the attempt's directory (``dir_fd``) that the job's
    output ``globs`` match (gitignore syntax, relative to the directory), read as safely. Not matched: the
    output dir itself, the names of ``leave_out`` (the script) and links (a project's files are links into
    its tree: never outputs). A path met twice is kept once (the output dir's copy)."""
    seen: set[str] = set()
    for entry in walk(output_dir, dir_fd=dir_fd):
        seen.add(entry.path)
        yield entry
    if not globs:
        return
    import pathspec

    spec = pathspec.GitIgnoreSpec.from_lines(list(globs))
    top = os.open(".", os.O_RDONLY | os.O_DIRECTORY, dir_fd=dir_fd)
    try:
        for dirpath, dirnames, filenames, dirfd in os.fwalk(".", dir_fd=top, follow_symlinks=False):
            rel = "" if dirpath == "." else dirpath.removeprefix("./") + "/"
            if not rel:
                dirnames[:] = [d for d in dirnames if d != output_dir]
            dirnames.sort()
            for name in sorted(filenames):
                path = rel + name
                if path in leave_out or not spec.match_file(path) or _is_link(name, dirfd):
                    continue
                if path in seen:
                    yield Skipped(path, "the output dir holds a file of the same path, which is kept")
                    continue
                seen.add(path)
                yield _open(path, name, dirfd)
    finally:
        os.close(top)
