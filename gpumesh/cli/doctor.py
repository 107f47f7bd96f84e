"""``gpumesh doctor``: what this machine and the broker look like, and what is wrong.

Each check is a small function that returns :class:`Line` (status ok / warn / fail, what it found, and for
warn and fail the fix in one sentence). A check that breaks is a ``fail`` line of its own, never a traceback,
and an unreachable broker is one ``fail`` line while the machine checks still run.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import unquote, urlsplit

import click
import redis

import gpumesh
from gpumesh.cli.helpers import emit_json, json_option, url_option
from gpumesh.errors import UsageError
from gpumesh.extras import install_hint
from gpumesh.models import Capability
from gpumesh.settings import Settings
from gpumesh.store.connection import client, command, mask_url, text, translate

Status = Literal["ok", "warn", "fail"]

SOCKET_TIMEOUT = 3.0  # s the broker may take to answer before it counts as unreachable
TORCH_TIMEOUT = 120.0  # s importing torch may take in the child (slow on a cold disk, never a hang)
SMI_TIMEOUT = 10.0
SKEW_WARN, SKEW_FAIL = 1.0, 30.0  # s between this machine's clock and the broker's
OTHER_PROJECT = "gpumesh"  # the name on PyPI of another project (versions 3.x); ours is gpumesh-pool


@dataclass(frozen=True)
class Line:
    """One check's result: what ``gpumesh doctor`` prints as a line, and ``--json`` as an object."""

    check: str
    status: Status
    detail: str
    fix: str | None = None


def ok(check: str, detail: str) -> Line:
    return Line(check, "ok", detail)


def warn(check: str, detail: str, fix: str) -> Line:
    return Line(check, "warn", detail, fix)


def fail(check: str, detail: str, fix: str) -> Line:
    return Line(check, "fail", detail, fix)


# -- this machine ----------------------------------------------------------------------------------


def python_line(version: tuple[int, ...] = tuple(sys.version_info[:3])) -> Line:
    shown = ".".join(map(str, version))
    if version[:2] < (3, 11):
        return fail(
            "python",
            f"{shown} ({sys.executable}): gpumesh needs 3.11 or newer",
            "Install Python 3.11 or newer and install gpumesh with it (in a checkout: python3.11 -m pip install -e .).",
        )
    return ok("python", f"{shown} ({sys.executable})")


def gpumesh_line() -> Line:
    return ok("gpumesh", f"{gpumesh.__version__} ({Path(gpumesh.__file__ or '').parent})")


def _top_level(dist: importlib.metadata.Distribution) -> set[str]:
    names = set((dist.read_text("top_level.txt") or "").split())
    return names or {f.parts[0] for f in dist.files or () if f.parts and not f.parts[0].endswith(".dist-info")}


def _where(dist: importlib.metadata.Distribution) -> str:
    direct = json.loads(dist.read_text("direct_url.json") or "{}")
    if direct.get("dir_info", {}).get("editable"):
        return "editable, from " + unquote(urlsplit(direct.get("url", "")).path)
    return str(dist.locate_file(""))


def installed_providers() -> list[tuple[str, str, str]]:
    """(name, version, where) of every installed distribution that provides the ``gpumesh`` package. Only
    installed ones (an INSTALLER file, as pip writes): a source tree's *.egg-info on sys.path is not one."""
    seen: dict[tuple[str, str, str], None] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"] or ""
        if name and dist.read_text("INSTALLER") is not None and "gpumesh" in _top_level(dist):
            seen[(name, dist.version, _where(dist))] = None
    return list(seen)


def _is_other_project(name: str, version: str) -> bool:
    major = version.split(".", 1)[0]
    return name.lower().replace("_", "-") == OTHER_PROJECT and major.isdigit() and int(major) >= 3


def distribution_line() -> Line:
    providers = installed_providers()
    shown = ", ".join(f"{n} {v} ({w})" for n, v, w in providers)
    other = [f"{n} {v}" for n, v, _ in providers if _is_other_project(n, v)]
    if other:
        return warn(
            "distribution",
            f"{', '.join(other)} is installed: that is another project on PyPI, not this one (gpumesh-pool)",
            f"Run pip uninstall gpumesh, then reinstall this project: {install_hint()}",
        )
    if len(providers) > 1:
        return warn(
            "distribution",
            f"several installed distributions provide the gpumesh package, each overwriting the other: {shown}",
            "Run pip uninstall on all but one of them, then reinstall that one (pip install --force-reinstall).",
        )
    if not providers:
        return ok("distribution", f"none installed: imported from the source tree at {Path(gpumesh.__file__ or '')}")
    return ok("distribution", shown)


@dataclass(frozen=True)
class Torch:
    """What a child process found importing torch; ``error`` when it could not."""

    version: str = ""
    cuda: bool = False
    cuda_version: str | None = None
    devices: int = 0
    error: str = ""


_TORCH_CHILD = """
import json, torch
cuda = torch.cuda.is_available()
print(json.dumps({"version": torch.__version__, "cuda": cuda, "cuda_version": torch.version.cuda,
                  "devices": torch.cuda.device_count() if cuda else 0}))
"""


def probe_torch() -> Torch | None:
    """torch as a task would see it, or None when it is not installed (then it is never imported). Imported
    in a child process: this one never initialises CUDA (see gpumesh.capability), and a broken install
    that crashes its interpreter is a line here, not a crash of doctor."""
    if importlib.util.find_spec("torch") is None:
        return None
    try:
        proc = subprocess.run(
            [sys.executable, "-P", "-c", _TORCH_CHILD],
            capture_output=True,
            text=True,
            timeout=TORCH_TIMEOUT,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return Torch(error=f"importing torch took over {TORCH_TIMEOUT:.0f} s")
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        return Torch(error=f"importing torch failed: {tail}")
    return Torch(**json.loads(proc.stdout.strip().splitlines()[-1]))


def probe_driver() -> tuple[str | None, str]:
    """(NVIDIA driver version or None, what nvidia-smi said): None when there is no nvidia-smi or it failed."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None, "not found on PATH (no NVIDIA driver here)"
    try:
        proc = subprocess.run(
            [exe, "--query-gpu=driver_version,name", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=SMI_TIMEOUT, check=False,
        )  # fmt: skip
    except (subprocess.TimeoutExpired, OSError) as exc:
        return None, f"nvidia-smi did not answer: {exc}"
    rows = [r.split(",", 1) for r in proc.stdout.strip().splitlines() if r.strip()]
    if proc.returncode != 0 or not rows:
        tail = ((proc.stderr or proc.stdout).strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        return None, f"nvidia-smi failed: {tail}"
    names = ", ".join(r[-1].strip() for r in rows)
    return rows[0][0].strip(), f"driver {rows[0][0].strip()}: {names}"


def _describe(cap: Capability) -> str:
    memory = f", {cap.vram_gb} GiB VRAM" if cap.vram_gb is not None else ""
    return (
        f"{cap.device} {cap.device_name}{memory}, {cap.cpu_cores} cores, {cap.ram_gb} GiB RAM, "
        f"score {cap.score_gflops:.4g} GFLOP/s ({cap.backend})"
    )


def device_line(cache_dir: Path, torch: Torch | None) -> Line:
    from gpumesh import capability

    cap = capability.load(cache_dir)
    if cap is None:
        return warn(
            "device",
            f"no benchmark cached yet ({capability.cache_file(cache_dir)}): a worker benchmarks before it starts",
            "Run gpumesh bench --save, or start a worker: it benchmarks on its first start and caches the score.",
        )
    if not cap.comparable:
        return warn(
            "device",
            f"{_describe(cap)}: a pure-Python score, not comparable with other machines'",
            "Run pip install numpy, then gpumesh bench --save.",
        )
    if cap.device == "cpu" and torch is not None and torch.cuda:
        return warn(
            "device",
            f"{_describe(cap)}: cached for the CPU, but torch sees CUDA, so workers rank this machine far too low",
            "Run gpumesh bench --save (or gpumesh worker --rebench).",
        )
    return ok("device", _describe(cap))


def torch_line(torch: Torch | None, driver: str | None) -> Line:
    if torch is None:
        if driver is not None:
            return warn(
                "torch",
                f"not installed, though this machine has an NVIDIA GPU (driver {driver}): tasks and the benchmark "
                "run on the CPU",
                "Run pip install torch (what the gpu extra installs).",
            )
        return ok("torch", "not installed (tasks and the benchmark use the CPU)")
    if torch.error:
        return warn("torch", torch.error, "Reinstall torch (pip install --force-reinstall torch).")
    if torch.cuda:
        return ok("torch", f"{torch.version}, CUDA {torch.cuda_version} available ({torch.devices} device(s))")
    if driver is not None:
        return warn(
            "torch",
            f"{torch.version} cannot use CUDA (torch.cuda.is_available() is False) though driver {driver} is there",
            "Install a torch build for CUDA that this driver supports (pip install torch from pytorch.org's index).",
        )
    return ok("torch", f"{torch.version}, CUDA not available (torch.cuda.is_available() is False)")


def nvidia_smi_line(found: str) -> Line:
    if found.startswith("nvidia-smi "):  # it is there, and failed or hung
        return warn("nvidia-smi", found, "Check the NVIDIA driver: run nvidia-smi by itself to see its error.")
    return ok("nvidia-smi", found)


def numpy_line() -> Line:
    if importlib.util.find_spec("numpy") is None:
        return warn(
            "numpy",
            "not installed, though gpumesh-pool depends on it (installed with --no-deps?): without it (or torch) "
            "the CPU benchmark falls back to pure Python, whose score is not comparable with other machines'",
            "Run pip install numpy, then gpumesh bench --save.",
        )
    try:
        version = importlib.metadata.version("numpy")
    except importlib.metadata.PackageNotFoundError:
        version = "installed"
    return ok("numpy", version)


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def cache_line(cache_dir: Path) -> Line:
    fix = f"Make {cache_dir} writable, or set GPUMESH_CACHE_DIR (cache_dir in the config file) to a writable directory."
    if cache_dir.is_dir():
        try:
            with tempfile.TemporaryFile(dir=cache_dir):
                pass
        except OSError as exc:
            return warn("cache", f"{cache_dir} is not writable ({exc.strerror}): workers re-benchmark every start", fix)
        return ok("cache", f"{cache_dir} writable")
    base = _nearest_existing(cache_dir)
    if not base.is_dir():
        return warn("cache", f"{base} is not a directory, so {cache_dir} cannot be created", fix)
    if not os.access(base, os.W_OK | os.X_OK):
        return warn("cache", f"{cache_dir} cannot be created: {base} is not writable", fix)
    return ok("cache", f"{cache_dir} (not created yet; {base} is writable)")


UNIX_SOCKETS_FIX = (
    "Run root workers with --sandbox-user USER (a user in neither the docker group nor an agent's); "
    "Landlock ABI 9 (Linux 7.1+) confines pathname Unix sockets."
)


def unix_socket_exposure(abi: int) -> str:
    """What Unix sockets a worker's tasks can still reach on this machine ("" when none of note)."""
    said = []
    if os.geteuid() == 0:
        said.append(
            "a root worker without --sandbox-user runs tasks as uid 0, which reach root's Unix sockets "
            "(systemd's, docker.sock) despite Landlock"
        )
    if abi < 9:
        said.append(f"ABI {abi} leaves pathname Unix sockets reachable to tasks (docker.sock, ssh-agent)")
    return "; ".join(said)


def landlock_line() -> Line:
    """What the sandbox's own probe finds (sandbox.landlock, as a worker started here asks it)."""
    from gpumesh.worker.build import landlock_found

    abi, why = landlock_found()
    if why is None:
        scoped = "" if abi >= 6 else "; before ABI 6 a task may still signal processes of the worker's user"
        said = f"ABI {abi}: workers confine tasks to the system, Python and their own directory{scoped}"
        sockets = unix_socket_exposure(abi)
        if sockets:
            return warn("landlock", f"{said}; but {sockets}", UNIX_SOCKETS_FIX)
        return ok("landlock", said)
    return warn(
        "landlock",
        f"{why}: tasks are not isolated from the host's files",
        "Run workers on Linux 5.13+ with Landlock enabled (add landlock to the lsm= kernel boot parameter).",
    )


NAMESPACES_FIX = (
    "Let users make user namespaces (sysctl user.max_user_namespaces > 0; kernel.unprivileged_userns_clone=1 on "
    "Debian kernels; kernel.apparmor_restrict_unprivileged_userns=0 on Ubuntu 23.10+), or run the worker as root "
    "with --sandbox-user."
)


def namespaces_line() -> Line:
    """Whether each attempt gets its own IPC, /dev/shm and keyring here: as this user, and as an unprivileged one
    (what a non-root worker and --sandbox-user get) when this is root."""
    from gpumesh.worker.build import namespaces_unavailable

    what = "each attempt has its own SysV IPC, /dev/shm (within its memory cap), keyrings and --cache-path overlays"
    mine = namespaces_unavailable()
    if os.geteuid() != 0:
        if mine is None:
            return ok("namespaces", f"{what} (user namespaces, no privilege needed)")
        return warn("namespaces", f"{mine}: tasks share /dev/shm, SysV IPC and the user keyring", NAMESPACES_FIX)
    try:
        entry = pwd.getpwnam("nobody")
        unprivileged = namespaces_unavailable(entry.pw_uid, entry.pw_gid)
    except KeyError:
        unprivileged = "no user nobody to try as"
    if mine is None and unprivileged is None:
        return ok("namespaces", f"{what}, for a root worker and as an unprivileged user (--sandbox-user, non-root)")
    if mine is None:
        return warn(
            "namespaces",
            f"{what} for a root worker, but not as an unprivileged user ({unprivileged}): with --sandbox-user, and "
            "for non-root workers, tasks share /dev/shm, SysV IPC and the user keyring",
            NAMESPACES_FIX,
        )
    return warn("namespaces", f"{mine}: tasks share /dev/shm, SysV IPC and the user keyring", NAMESPACES_FIX)


def seccomp_line() -> Line:
    """What the seccomp filter every confined task runs under refuses, or why there is none here."""
    from gpumesh.worker.build import seccomp_refuses

    refused = seccomp_refuses()
    if refused is not None:
        return ok("seccomp", f"tasks run under a seccomp filter that refuses {refused}")
    return warn(
        "seccomp",
        f"no seccomp filter for {os.uname().machine}: tasks may call keyctl and make namespaces of their own",
        "Run workers on Linux x86_64 or aarch64.",
    )


def cgroup_line() -> Line:
    """Where the sandbox's own probe (sandbox.tree) would have a worker started here make a cgroup per attempt."""
    from gpumesh.worker.build import cgroup_found

    fix = (
        "Run the worker where it may manage its own cgroup: as root, in a systemd unit with Delegate=yes, "
        "or in a container with a writable /sys/fs/cgroup."
    )
    found = cgroup_found()
    root = Path(found.root)
    if found.v2:
        shown = "v2"
    elif (root / "pids").is_dir():
        hybrid = (root / "unified" / "cgroup.controllers").exists()
        shown = "v1 (hybrid, v2 at /sys/fs/cgroup/unified)" if hybrid else "v1"
    else:
        return warn("cgroup", f"no cgroup filesystem at {root}: task trees cannot be confined by cgroups", fix)
    if found.base is None:
        where = f"in {found.own}" if found.own else f"under {root} (this process's own cgroup is not visible there)"
        return warn("cgroup", f"{shown}; a worker started here could not make a cgroup per attempt {where}", fix)
    base = found.base.rstrip("/") or "/"
    controllers = ""
    if found.v2:
        controllers = " (controllers: " + ((Path(base) / "cgroup.controllers").read_text().strip() or "none") + ")"
    return ok("cgroup", f"{shown}; a worker started here makes a cgroup per attempt in {base}{controllers}")


def probe_gpu() -> tuple[str | None, Torch | None, str]:
    """(driver version, torch, what nvidia-smi said); a probe that breaks is said in its line."""
    try:
        driver, smi = probe_driver()
    except Exception as exc:  # noqa: BLE001 - doctor reports whatever it finds, its own failures too
        driver, smi = None, f"nvidia-smi could not be checked: {type(exc).__name__}: {exc}"
    try:
        torch = probe_torch()
    except Exception as exc:  # noqa: BLE001
        torch = Torch(error=f"probing torch failed: {type(exc).__name__}: {exc}")
    return driver, torch, smi


def machine_lines(settings: Settings) -> list[Line]:
    driver, torch, smi = probe_gpu()
    checks: list[tuple[str, Callable[[], Line]]] = [
        ("python", python_line),
        ("gpumesh", gpumesh_line),
        ("distribution", distribution_line),
        ("device", lambda: device_line(settings.cache_dir, torch)),
        ("torch", lambda: torch_line(torch, driver)),
        ("nvidia-smi", lambda: nvidia_smi_line(smi)),
        ("numpy", numpy_line),
        ("cache", lambda: cache_line(settings.cache_dir)),
        ("landlock", landlock_line),
        ("namespaces", namespaces_line),
        ("seccomp", seccomp_line),
        ("cgroup", cgroup_line),
        ("lend idle", lambda: lend_idle_line(settings.idle_probe)),
        ("envs", lambda: envs_line(settings)),
    ]
    return [guarded(name, check) for name, check in checks]


def lend_idle_line(fixture: str) -> Line:
    """What `worker --lend idle` would read on this machine, and what it reads now."""
    from gpumesh.worker import lending

    sources = lending.idle_sources(fixture)
    if not sources:
        return ok("lend idle", "no source of the last keyboard or mouse input here (no X display with xprintidle, no "
                  "logged-in terminal): a worker with --lend idle would stay paused; use --lend HH:MM-HH:MM or "
                  "--pause-when CMD")  # fmt: skip
    try:
        idle = f"{lending.idle_seconds(5.0, fixture):.0f} s since the last input"
    except lending.ProbeError as exc:
        idle = f"unreadable now ({exc})"
    return ok("lend idle", f"--lend idle reads {', '.join(sources)}: {idle}")


def envs_line(settings: Settings) -> Line:
    """Environments (gpumesh.envs): uv here, and this machine's cache of built envs, with failed builds."""
    import subprocess

    from gpumesh.envs.cache import EnvCache, default_root
    from gpumesh.envs.lock import uv_binary

    if not settings.envs:
        return ok("envs", "off (GPUMESH_ENVS=false): workers here take only jobs without an environment")
    try:
        ran = subprocess.run([uv_binary(), "--version"], capture_output=True, text=True, timeout=30)
        uv = ran.stdout.strip() if ran.returncode == 0 else ""
    except (OSError, subprocess.TimeoutExpired, UsageError):
        uv = ""
    if not uv:
        return fail("envs", "uv is not usable here: jobs with packages cannot be locked or built",
                    "pip install --force-reinstall uv")  # fmt: skip
    cache = EnvCache(settings.env_cache or default_root(), settings.env_cache_mb)
    entries = cache.entries()
    ready = [e for e in entries if e["state"] == "ready"]
    failed = [e for e in entries if e["state"] == "failed"]
    size = sum(int(str(e["bytes"])) for e in ready) / 2**20
    detail = f"{uv}; {len(ready)} built in {cache.root} ({size:.0f} of {settings.env_cache_mb} MiB)"
    if failed:
        return warn("envs", f"{detail}; {len(failed)} failed build(s) this machine will not retry",
                    "gpumesh envs shows uv's message; fix the worker's index settings, then gpumesh envs --prune")  # fmt: skip
    return ok("envs", detail)


def guarded(name: str, check: Callable[[], Line]) -> Line:
    """A check that breaks is a fail line of its own: doctor never ends in a traceback."""
    try:
        return check()
    except Exception as exc:  # noqa: BLE001 - doctor reports whatever it finds, its own failures too
        return crashed(name, exc)


def crashed(name: str, exc: Exception) -> Line:
    return fail(name, f"the check itself failed: {type(exc).__name__}: {exc}", "Report this as a gpumesh bug.")


# -- the broker ------------------------------------------------------------------------------------


def _server_name(info: dict[str, Any]) -> str:
    if info.get("server_name") == "valkey" and info.get("valkey_version"):
        return f"Valkey {info['valkey_version']}"
    return f"Redis {info.get('redis_version', '(version unknown)')}"


def unreachable_fix(exc: redis.RedisError) -> str:
    text_ = str(exc)
    if isinstance(exc, redis.AuthenticationError) or "WRONGPASS" in text_ or "NOAUTH" in text_:
        return "Put the right user and password in the broker URL (--url or GPUMESH_URL)."
    if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
        return "Start Redis there (gpumesh serve starts one), or point --url or GPUMESH_URL at the broker."
    return "Point --url or GPUMESH_URL at a Redis server: something answered there, but not as Redis does."


def reachable_line(r: redis.Redis, url: str) -> Line:
    try:
        text(r).ping()  # connects
        start = time.perf_counter()
        text(r).ping()
        rtt = (time.perf_counter() - start) * 1000
        try:
            version = _server_name(dict(r.info("server")))
        except redis.ResponseError:
            version = "version unknown (INFO refused)"
    except redis.RedisError as exc:
        return fail("broker", str(translate(exc, url)), unreachable_fix(exc))
    return ok("broker", f"{mask_url(url)} reachable, {version} ({rtt:.1f} ms round trip)")


def _config(r: redis.Redis, name: str) -> str | None:
    """A CONFIG GET value, or None when CONFIG is refused (an ACL, a managed Redis) or answers nothing."""
    try:
        return text(r).config_get(name).get(name)
    except redis.ResponseError:
        return None


REFUSED_FIX = "Run gpumesh doctor --url with an admin user's URL to check it."


def persistence_line(r: redis.Redis) -> Line:
    aof, save = _config(r, "appendonly"), _config(r, "save")
    if aof is None or save is None:
        return warn("persistence", "cannot tell (CONFIG refused)", REFUSED_FIX)
    if aof == "yes":
        fsync = _config(r, "appendfsync") or "?"
        rdb = f", RDB snapshots (save {save})" if save else ""
        shown = f"append-only file on (appendfsync {fsync}){rdb}"
        if fsync == "always":
            return ok("persistence", f"{shown}: every acknowledged lease and result is on disk, so it survives a crash")
        lost = {"everysec": "the last second or two", "no": "what the OS has not written yet (~30 s)"}.get(
            fsync, "an unknown amount (the fsync policy could not be read)"
        )
        return warn(
            "persistence",
            f"{shown}: a crash of Redis or its machine may lose {lost} of acknowledged results; those tasks run again",
            "Run CONFIG SET appendfsync always on the broker (and put appendfsync always in redis.conf); "
            "gpumesh serve uses always unless started with --fsync everysec.",
        )
    if save:
        return ok("persistence", f"RDB snapshots only (save {save}): a crash loses the writes since the last one")
    return warn(
        "persistence",
        "none (appendonly no, save ''): a broker crash or restart loses the queue and every job",
        "Run CONFIG SET appendonly yes on the broker (and put appendonly yes in redis.conf), or run it with "
        "gpumesh serve, which persists.",
    )


def maxmemory_line(r: redis.Redis) -> Line:
    policy = _config(r, "maxmemory-policy")
    if policy is None:
        return warn("maxmemory-policy", "cannot tell (CONFIG refused)", REFUSED_FIX)
    limit = int(_config(r, "maxmemory") or 0)
    cap = f"maxmemory {limit / 2**20:.0f} MiB" if limit else "no maxmemory"
    if policy == "noeviction":
        return ok("maxmemory-policy", f"noeviction ({cap})")
    return warn(
        "maxmemory-policy",
        f"{policy}, not noeviction ({cap}): under memory pressure Redis evicts keys, queued tasks and results "
        "among them",
        "Run CONFIG SET maxmemory-policy noeviction on the broker (and put it in redis.conf).",
    )


def _acl_fields(reply: Any) -> dict[str, Any]:
    """ACL GETUSER's flat [name, value, ...] reply (RESP2) or map (RESP3) as a dict."""
    if isinstance(reply, dict):
        return {str(k): v for k, v in reply.items()}
    return {str(reply[i]): reply[i + 1] for i in range(0, len(reply) - 1, 2)}


def acl_line(r: redis.Redis, url: str) -> Line:
    try:
        user = str(command(r, "ACL", "WHOAMI"))
    except redis.ResponseError as exc:
        if "unknown" in str(exc).lower():
            return ok("acl", "no ACLs (Redis before 6): one password for everyone")
        return ok("acl", f"{urlsplit(url).username or 'default'}: restricted (ACL WHOAMI refused)")
    try:
        fields = _acl_fields(command(r, "ACL", "GETUSER", user))
    except redis.ResponseError:
        return ok("acl", f"{user}: restricted (may not read its own ACL)")
    rules = str(fields.get("commands", ""))
    flags = [str(f) for f in fields.get("flags", [])]
    nopass = ", no password" if "nopass" in flags else ""
    if rules.startswith("+@all") and " -" not in rules:
        return ok("acl", f"{user}: admin (all commands){nopass}")
    shown = rules if len(rules) <= 60 else rules[:57] + "..."
    return ok("acl", f"{user}: restricted ({shown}){nopass}")


def clock_line(r: redis.Redis, now: Callable[[], float] = time.time) -> Line:
    before = now()
    sec, usec = text(r).time()
    after = now()
    skew = (before + after) / 2 - (sec + usec / 1e6)
    detail = f"this machine is {abs(skew):.3f} s {'ahead of' if skew >= 0 else 'behind'} the broker"
    fix = "Sync this machine's clock with NTP (timedatectl set-ntp true, or chrony)."
    if abs(skew) > SKEW_FAIL:
        return fail("clock", f"{detail}: leases are timed by the broker, but logs and retention mix clocks", fix)
    if abs(skew) > SKEW_WARN:
        return warn("clock", f"{detail}: logs and job retention mix the two clocks", fix)
    return ok("clock", detail)


def workers_line(settings: Settings) -> Line:
    from gpumesh.store.broker import Broker

    broker = Broker(settings, retries=1, health_check=False)
    try:
        found = broker.workers()
    except redis.ResponseError as exc:
        return warn("workers", f"cannot tell ({exc})", REFUSED_FIX)
    finally:
        broker.close()
    if not found:
        return warn(
            "workers",
            "none live: jobs wait in the queue until one joins",
            f"Start one: gpumesh worker {broker.url_masked}",
        )
    shown = ", ".join(f"{w.name} ({w.device}, {w.score_gflops:.4g} GFLOP/s, {w.state})" for w in found[:5])
    more = f" and {len(found) - 5} more" if len(found) > 5 else ""
    return ok("workers", f"{len(found)} live: {shown}{more}")


def versions_line(settings: Settings, r: redis.Redis) -> Line:
    """Which gpumesh protocols the broker serves, and which gpumesh versions its live workers run: a warning
    when they run more than one, or when this machine's protocol is not served."""
    from gpumesh._version import PROTOCOL, __version__
    from gpumesh.store import protocols
    from gpumesh.store.broker import Broker

    served, loaded_by = protocols.served_by(r)
    broker = Broker(settings, retries=1, health_check=False)
    try:
        found = broker.workers()
    finally:
        broker.close()
    counts: dict[str, int] = {}
    for w in found:
        counts[w.release] = counts.get(w.release, 0) + 1
    runs = ", ".join(f"{release} on {n} worker{'s' * (n > 1)}" for release, n in sorted(counts.items(), reverse=True))
    if served:
        broker_said = f"the broker serves protocol {protocols.span(served)} (loaded by gpumesh {loaded_by or '?'})"
    else:  # no record: not prepared by serve or access load-functions (of 0.3.0 or later); ask the functions
        served = protocols.present(r)
        broker_said = (f"the broker has functions of protocol {protocols.span(served)}" if served
                       else "the broker has no gpumesh functions this version knows") + (
            " (and no record of what it serves: not prepared by `gpumesh serve` or `access load-functions` of "
            "gpumesh 0.3.0 or later)"
        )  # fmt: skip
    upgrade = "Upgrading a mesh: docs/how-to/upgrade.md (the broker first, then workers in any order)."
    if served and PROTOCOL not in served and not (PROTOCOL - 1 in served and protocols.fallback()):
        return warn("versions", f"{broker_said}; this gpumesh {__version__} speaks protocol {PROTOCOL}", upgrade)
    if len(counts) > 1:
        return warn(
            "versions",
            f"{broker_said}; the mesh runs {len(counts)} gpumesh versions: {runs}. Workers one protocol behind "
            "keep working; two behind stop at start",
            "Upgrade the older workers when you can. " + upgrade,
        )
    return ok("versions", f"{broker_said}" + (f"; every live worker runs {runs.split(' on ')[0]}" if runs else ""))


def broker_lines(settings: Settings) -> list[Line]:
    url = settings.url
    try:
        r = client(url, decode=True, socket_timeout=SOCKET_TIMEOUT, retries=0, health_check=False)
    except UsageError as exc:
        return [fail("broker", str(exc), "Pass --url redis://HOST:PORT/DB or set GPUMESH_URL.")]
    try:
        first = reachable_line(r, url)
        if first.status == "fail":
            return [first]  # the rest would only say the same, each after a timeout
        checks: list[tuple[str, Callable[[], Line]]] = [
            ("persistence", lambda: persistence_line(r)),
            ("maxmemory-policy", lambda: maxmemory_line(r)),
            ("acl", lambda: acl_line(r, url)),
            ("clock", lambda: clock_line(r)),
            ("workers", lambda: workers_line(settings)),
            ("versions", lambda: versions_line(settings, r)),
        ]
        return [first, *_broker_checks(checks, url)]
    finally:
        r.close()


def _broker_checks(checks: Iterable[tuple[str, Callable[[], Line]]], url: str) -> list[Line]:
    """Run the checks in turn; a broker that stops answering ends them (each would wait out a timeout)."""
    lines = []
    for name, check in checks:
        try:
            lines.append(check())
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            fix = "Check the broker and its network: it stopped answering partway through; run gpumesh doctor again."
            lines.append(fail(name, str(translate(exc, url)), fix))
            break
        except Exception as exc:  # noqa: BLE001 - doctor reports whatever it finds, its own failures too
            lines.append(crashed(name, exc))
    return lines


# -- the command -----------------------------------------------------------------------------------


def load_settings(url: str | None) -> tuple[Settings, Line | None]:
    try:
        return Settings.load(url=url), None
    except UsageError as exc:
        fallback = Settings.model_validate({"url": url} if url else {})
        fix = "Correct it in the config file (gpumesh config show prints it) or in its GPUMESH_* variable."
        return fallback, fail("settings", f"{exc}; checking with the defaults", fix)


def run_checks(url: str | None) -> list[Line]:
    settings, problem = load_settings(url)
    lines = [problem] if problem else []
    return lines + machine_lines(settings) + broker_lines(settings)


COLOURS = {"ok": "green", "warn": "yellow", "fail": "red"}


def print_lines(lines: list[Line]) -> None:
    width = max(len(line.check) for line in lines)
    for line in lines:
        status = click.style(f"{line.status:<4}", fg=COLOURS[line.status], bold=line.status != "ok")
        click.echo(f"{status}  {line.check:<{width}}  {line.detail}")
        if line.fix:
            click.echo(f"{'':4}  {'':<{width}}  fix: {line.fix}")
    warns = sum(line.status == "warn" for line in lines)
    fails = sum(line.status == "fail" for line in lines)
    click.echo(f"\n{len(lines)} checks: {fails} failed, {warns} warned")


@click.command()
@url_option
@json_option
@click.pass_context
def doctor(ctx: click.Context, url: str | None, as_json: bool) -> None:
    """Check this machine and the broker, and say how to fix what is wrong.

    One line per check, each ok, warn or fail, with the fix for a warn or fail: Python, the installed
    gpumesh, the device and its cached benchmark, torch, nvidia-smi, numpy, the benchmark cache, Landlock,
    cgroups; then the broker: reachable and its version, persistence, maxmemory-policy, the ACL user,
    clock skew, live workers. Exit code 1 when a check fails, else 0 (warnings do not fail).

    \b
    Example:
      gpumesh doctor --url redis://submitter:PASSWORD@10.0.0.5:6390/0   # a serve broker
      gpumesh doctor --url redis://:PASSWORD@10.0.0.5:6390/0            # the compose broker
      gpumesh doctor --json | jq '.[] | select(.status != "ok")'
    """
    lines = run_checks(url)
    if as_json:
        emit_json([asdict(line) for line in lines])
    else:
        print_lines(lines)
    if any(line.status == "fail" for line in lines):
        ctx.exit(1)
