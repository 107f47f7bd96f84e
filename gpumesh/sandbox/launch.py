"""How the worker's side starts the launcher: its command line and the clean environment it gets.

Shared by the fresh runner, the spares and the warm zygote.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Mapping

from gpumesh.sandbox.launcher import COPY_DIR_PREFIX, remove_dir_of

# Variables a task may need from the worker's environment; everything else (the broker URL and
# password included) stays out.
PASS_ENV = (
    "PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TERM",
    "LD_LIBRARY_PATH", "CUDA_HOME", "CUDA_PATH", "HF_HOME", "TORCH_HOME", "XDG_CACHE_HOME",
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE",
    "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "PYTHONPATH", "VIRTUAL_ENV",
)  # fmt: skip

LAUNCHER_COPY = "_gpumesh_launcher.py"


def clean_env(extra: Mapping[str, str]) -> dict[str, str]:
    env = {k: os.environ[k] for k in PASS_ENV if k in os.environ}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def copy_launcher(directory: str) -> str:
    """A copy of launcher.py (standard library only) in ``directory``, a private one of the worker's
    (never the task's), for an interpreter that may not see gpumesh. The launcher removes it as it starts."""
    copy = os.path.join(directory, LAUNCHER_COPY)
    shutil.copyfile(os.path.join(os.path.dirname(__file__), "launcher.py"), copy)
    return copy


def launcher_command(python: str, no_site: bool = False) -> list[str]:
    """How a long-lived helper (the zygote, a spare) starts the launcher: as a module of the worker's
    own interpreter, or, for another one, from a new private copy that the helper removes as it
    starts (so a killed worker leaves none behind). If the command never runs, pass it to
    :func:`forget_launcher_command`. ``no_site``: an environment's interpreter, started with -S -E (its site,
    and any .pth file in it, is added by each attempt once confined)."""
    if no_site:
        return [python, "-u", "-S", "-E", copy_launcher(tempfile.mkdtemp(prefix=COPY_DIR_PREFIX))]
    if python == sys.executable:
        return [python, "-u", "-P", "-m", "gpumesh.sandbox.launcher"]  # -P: not the cwd's modules
    return [python, "-u", copy_launcher(tempfile.mkdtemp(prefix=COPY_DIR_PREFIX))]


def writable_by(path: str, uid: int, gid: int) -> str | None:
    """The first of ``path``, what it resolves to, and their directories that the user ``uid`` (group ``gid``)
    could change or replace, or None. What root runs for a sandbox user must be none of these: the user's own,
    group- or world-writable (a world-writable directory only with the sticky bit, as /tmp has)."""
    seen: set[str] = set()
    for start in (os.path.abspath(path), os.path.realpath(path)):
        p = start
        while p not in seen:
            seen.add(p)
            try:
                st = os.lstat(p)
            except OSError:
                return p
            sticky_dir = stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX
            if not stat.S_ISLNK(st.st_mode) and (
                st.st_uid == uid
                or (st.st_mode & stat.S_IWGRP and st.st_gid == gid)
                or (st.st_mode & stat.S_IWOTH and not sticky_dir)
            ):
                return p
            p = os.path.dirname(p)
    return None


def forget_launcher_command(cmd: list[str]) -> None:
    """Remove the private copy of a :func:`launcher_command` that did not start."""
    remove_dir_of(cmd[-1], COPY_DIR_PREFIX)
