"""Assembling a worker from its options: the checks that must fail before it joins (sandbox user,
``--preload``), the capability probe, the zygote, and the per-GPU supervisor. The CLI's ``worker`` and
``join`` parse flags into a :class:`WorkerOptions` and call :func:`run`.
"""

from __future__ import annotations

import logging
import os
import pwd
import re
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

from gpumesh import capability
from gpumesh.errors import BrokerError, UsageError
from gpumesh.requirements import parse_resource
from gpumesh.sandbox import landlock, namespaces, tree
from gpumesh.sandbox.warm import Zygote, ZygoteError
from gpumesh.signing import Verifier
from gpumesh.store.broker import Broker
from gpumesh.worker.lending import Lend, parse_lend

log = logging.getLogger("gpumesh.worker")


@dataclass(frozen=True)
class WorkerOptions:
    """What ``gpumesh worker`` was asked for (its flags, already parsed)."""

    name: str | None = None
    score: float | None = None  # a fixed score instead of the benchmark's
    rebench: bool = False
    burst: bool = False  # stop when no work is left
    trust: tuple[str, ...] = ()  # public keys (file paths or inline ed25519:<base64>): run only tasks they signed
    sandbox_user: str | None = None
    warm: bool = True  # tasks fork from a zygote; False: a new interpreter per attempt (--fresh)
    preload: str | None = None
    resources: tuple[str, ...] = ()  # KEY=VALUE, as --resource gives them
    exit_with_parent: int | None = None
    gpus: str | None = None  # one worker process per GPU, under a supervisor
    log_level: str = "info"
    log_format: str = "text"
    rq_logging_level: str = field(default="INFO", compare=False)
    lend: tuple[str, ...] = ()  # --lend: always, idle[=MIN], HH:MM-HH:MM, gpu-free
    pause_when: tuple[str, ...] = ()  # --pause-when CMD: paused while it exits 0
    max_vram_gb: float | None = None
    cpu_cores: int | None = None
    max_task_hours: float | None = None
    accept_from: str | None = None  # NAME,NAME: only jobs submitted with these credentials


# The resource a worker started with --trust publishes: the ids of the keys it trusts, comma-separated.
TRUSTS = "trusts"


def lender_limits(opts: WorkerOptions) -> tuple[Lend, dict[str, Any]]:
    """The parsed --lend/--pause-when, and the resources the lender's limits publish (what dispatch reads:
    max_task_hours, accept_from, cpu_cores, max_vram_gb). UsageError on a bad value."""
    lend = parse_lend(opts.lend, opts.pause_when)
    limits: dict[str, Any] = {}
    if opts.max_task_hours is not None:
        limits["max_task_hours"] = opts.max_task_hours
    if opts.accept_from is not None:
        names = [n.strip() for n in opts.accept_from.split(",") if n.strip()]
        if not names or any(not ACL_NAME.fullmatch(n) for n in names):
            raise UsageError(
                f"--accept-from {opts.accept_from!r}: expected credential names separated by commas, e.g. "
                "--accept-from alice,lab-bob (the names `gpumesh access list` shows)"
            )
        limits["accept_from"] = ",".join(names)
    if opts.cpu_cores is not None:
        have = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        if opts.cpu_cores > have:
            raise UsageError(f"--cpu-cores {opts.cpu_cores}: this worker may use {have} cores; lend at most {have}")
        limits["cpu_cores"] = opts.cpu_cores
    if opts.max_vram_gb is not None:
        limits["max_vram_gb"] = opts.max_vram_gb
    return lend, limits


# A credential's name as --accept-from takes it (ACL user names, as `gpumesh access add` makes them).
ACL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@+-]{0,63}")


def pin_cores(n: int) -> None:
    """Run this worker and everything it starts (the zygote, every task) on ``n`` of the cores it may use."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:n])


def run(broker: Broker, opts: WorkerOptions) -> int:
    """Run a worker (or, with ``gpus``, a supervisor of one per GPU) until it stops; the exit code."""
    lend, limits = lender_limits(opts)
    if opts.gpus is not None:
        return supervise(broker, opts)
    declared: dict[str, Any] = dict(parse_resource(r) for r in opts.resources)
    trusted = [*opts.trust, *[p.strip() for p in broker.settings.trusted_keys.split(",") if p.strip()]]
    verifier = Verifier(trusted) if trusted else None
    if verifier is not None:  # dispatch gives this worker only tasks signed by one of these keys
        declared[TRUSTS] = ",".join(sorted(verifier.keys))
    sandbox_user = check_sandbox_user(opts.sandbox_user, broker.settings.sandbox_python or sys.executable)
    cap = capability.probe(broker.settings.cache_dir, refresh=opts.rebench, score=opts.score, warn=log.warning)
    warning = capability.warning(cap)
    if warning:
        log.warning(warning)
    if opts.cpu_cores is not None:
        pin_cores(opts.cpu_cores)  # before the zygote starts: it and every task inherit the cores
    have = declared.get("vram_gb", cap.resources().get("vram_gb"))
    if opts.max_vram_gb is not None and have is not None:  # what dispatch matches vram_gb requirements against
        declared["vram_gb"] = min(float(have), opts.max_vram_gb)
    declared = {**limits, **declared}
    cuda = os.environ.get("CUDA_VISIBLE_DEVICES")
    zygote = start_zygote(opts.warm, opts.preload, broker.settings.sandbox_python, cuda)
    from gpumesh.worker.worker import MeshWorker  # imports RQ: only when a worker really starts

    w = MeshWorker(
        broker, cap, name=opts.name, cuda_visible_devices=cuda, parent_pid=opts.exit_with_parent,
        verifier=verifier, sandbox_user=sandbox_user, zygote=zygote, resources=declared, lend=lend,
        max_vram_gb=opts.max_vram_gb, lent_path=broker.settings.lent_file,
    )  # fmt: skip
    try:
        w.work(burst=opts.burst, logging_level=opts.rq_logging_level)
    finally:
        if zygote is not None:
            zygote.close()
    if w.fatal:
        raise BrokerError(w.fatal)
    return 0


def start_zygote(warm: bool, preload: str | None, python: str, cuda: str | None) -> Zygote | None:
    """Start the warm executor's zygote before joining, so a failing --preload is a startup error."""
    if preload and not warm:
        raise UsageError("--preload needs the warm executor (it names what the zygote imports); drop --fresh")
    if not warm:
        return None
    zygote = Zygote((preload or "").split(","), python=python, env={"CUDA_VISIBLE_DEVICES": cuda} if cuda else {})
    try:
        zygote.start()
    except ZygoteError as exc:
        raise UsageError(f"{exc}; check the module names, or drop --preload") from None
    return zygote


def namespaces_unavailable(uid: int = -1, gid: int = -1) -> str | None:
    """Why attempts run as ``uid`` (-1: this process's user) cannot have namespaces of their own here (their IPC,
    /dev/shm, keyrings, cache overlays), or None: what a worker started here would find (for `gpumesh doctor`)."""
    return namespaces.unavailable(uid, gid)


def seccomp_refuses() -> str | None:
    """What the seccomp filter every confined task runs under refuses, or None where this machine's architecture
    has none (for `gpumesh doctor`)."""
    from gpumesh.sandbox.launcher import ARCHES, seccomp_described

    if sys.platform.startswith("linux") and os.uname().machine in ARCHES:
        return seccomp_described()
    return None


def landlock_found() -> tuple[int, str | None]:
    """The Landlock ABI a worker started here confines its tasks with, or (0, why) it would run them unconfined
    (for `gpumesh doctor`)."""
    why = landlock.unavailable()
    return (0, why) if why is not None else (landlock.abi(), None)


@dataclass(frozen=True)
class CgroupFound:
    """What a worker started here would find of cgroups (for `gpumesh doctor`)."""

    root: str  # where the cgroup filesystem is mounted
    v2: bool
    base: str | None  # where it would make a cgroup per attempt; None: its attempts would run without one
    own: str | None  # this process's own cgroup, where it looks


def cgroup_found() -> CgroupFound:
    try:
        with open("/proc/self/cgroup") as f:
            own = tree.own_cgroup(f.read(), tree.cgroup_v2())
    except OSError:
        own = None
    return CgroupFound(tree.CGROUP_ROOT, tree.cgroup_v2(), tree.probe_cgroup_base(), own)


def check_sandbox_user(name: str | None, python: str) -> tuple[int, int] | None:
    """(uid, gid) of the user tasks run as, once checked that it can run ``python``; None without one."""
    if not name:
        return None
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise UsageError(f"--sandbox-user: no user named {name!r} on this machine") from None
    if os.geteuid() != 0:
        raise UsageError("--sandbox-user needs the worker to run as root (it switches to that user for each task)")
    if entry.pw_uid == 0:
        raise UsageError("--sandbox-user must not be root")
    try:
        ok = subprocess.run(
            [python, "-c", "import json, ctypes, resource"], user=entry.pw_uid, group=entry.pw_gid, extra_groups=[],
            capture_output=True, cwd="/",
        ).returncode == 0  # fmt: skip
    except OSError:
        ok = False
    if not ok:
        raise UsageError(
            f"--sandbox-user {name} cannot run {python} (it must be able to read the interpreter and its "
            "libraries); install Python where that user can read it and set GPUMESH_SANDBOX_PYTHON"
        )
    return entry.pw_uid, entry.pw_gid


def supervise(broker: Broker, opts: WorkerOptions) -> int:
    """One ``gpumesh worker`` process per GPU, each pinned to its device, restarted when it crashes."""
    from gpumesh.worker.supervisor import Supervisor, parse_gpus

    if opts.preload and not opts.warm:  # said once here, not by every child the supervisor restarts
        raise UsageError("--preload needs the warm executor (it names what the zygote imports); drop --fresh")

    gpus = parse_gpus(opts.gpus or "")
    # The URL goes in each child's environment (GPUMESH_URL), never on its command line (cli/argv.py).
    args = ["--log-level", opts.log_level, "--log-format", opts.log_format]
    args += ["--score", str(opts.score)] if opts.score else []
    args += ["--rebench"] if opts.rebench else []
    args += ["--burst"] if opts.burst else []
    args += [a for path in opts.trust for a in ("--trust", str(path))]
    args += ["--sandbox-user", opts.sandbox_user] if opts.sandbox_user else []
    args += ["--warm" if opts.warm else "--fresh"]
    args += ["--preload", opts.preload] if opts.preload else []
    args += [a for r in opts.resources for a in ("--resource", r)]
    args += [a for v in opts.lend for a in ("--lend", v)]
    args += [a for v in opts.pause_when for a in ("--pause-when", v)]
    for flag, value in (("--max-vram-gb", opts.max_vram_gb), ("--cpu-cores", opts.cpu_cores),
                        ("--max-task-hours", opts.max_task_hours), ("--accept-from", opts.accept_from)):  # fmt: skip
        args += [flag, str(value)] if value is not None else []
    sup = Supervisor(gpus, args, opts.name or socket.gethostname(), restart=not opts.burst, url=broker.url)
    return sup.run()
