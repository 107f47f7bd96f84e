"""A job's ``preload`` (DESIGN §10): in warm mode a worker imports it once per job and env, in a zygote of that
job's own that is confined as its tasks are before anything of the env runs. Real `gpumesh worker` processes, a
real Redis and a real uv; the packages are tiny wheels built here and served from a local --find-links folder."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import redis

import gpumesh
from gpumesh.sandbox import landlock, namespaces

from ..api.test_projects import SYSTEM_PYTHON, can_sandbox_user
from ..conftest import Workers, pid_alive, wait_until
from ..conftest import gpumesh as run_cli
from .test_envs import MEDDLE, builds, finished, index, make_wheel

__all__ = ["index"]  # the fixture, used by name

# Imported once per job's zygote: where and when it was, and what it could reach (each try's outcome).
PRELOADED = """\
import os, time
PID = os.getpid()
AT = time.time_ns()
TAG = {tag!r}
"""

SHOW = """\
# /// script
# dependencies = ["gmpre"]
# ///
import json, os, sys
before = "gmpre" in sys.modules
seen = getattr(sys, "gm_left_by_a_task", None)
sys.gm_left_by_a_task = os.getpid()
shm = os.path.exists("/dev/shm/gm-left-by-a-task")
try:
    open("/dev/shm/gm-left-by-a-task", "w").close()
except OSError:
    pass
ipc = mq = False
if json.load(sys.stdin).get("private"):  # a SysV segment and a POSIX message queue, in the job's own IPC namespace
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    ipc = libc.shmget(0x676D6C66, 0, 0) >= 0
    libc.shmget(0x676D6C66, 4096, 0o1000 | 0o600)  # IPC_CREAT
    name = b"/gm-left-by-a-task"
    mq = libc.mq_open(name, os.O_RDONLY) >= 0
    libc.mq_open(name, os.O_CREAT | os.O_RDWR, 0o600, None)
import gmpre
print(json.dumps({"before": before, "seen": seen, "pid": os.getpid(), "zygote": gmpre.PID, "at": gmpre.AT,
                  "tag": gmpre.TAG, "shm": shm, "ipc": ipc, "mq": mq}))
"""


def submit(script: Path, env: dict[str, str], *args: str, n: int = 3, private: bool = False) -> str:
    payloads = [{"i": i, "private": private} for i in range(n)]
    ran = run_cli("submit", str(script), "--payloads", "-", "--json", *args, env=env, input=json.dumps(payloads))
    assert ran.returncode == 0, ran.stderr
    return str(json.loads(ran.stdout)["job_id"])


@pytest.mark.processes
def test_warm_tasks_find_their_job_s_preload_imported_and_still_start_fresh(
    index: Path, workers: Workers, env: dict[str, str], tmp_path: Path
) -> None:
    """Every task of a job finds the preload imported by one process that is not the task's; a global one task sets
    is not seen by the next. Two jobs of the same env with different preloads each get their own zygote (the
    module was imported apart), and a job's zygote goes once its job has ended."""
    make_wheel(index, "gmpre", "1.0", {"gmpre.py": PRELOADED.format(tag="pre"), "gmpre_extra.py": "X = 1\n"})
    script = tmp_path / "show.py"
    script.write_text(SHOW)
    workers.start("--warm")
    private = namespaces.unavailable() is None  # the job's own /dev/shm and IPC, emptied after each task
    first = finished(submit(script, env, "--preload", "gmpre", private=private), workers)
    second = finished(submit(script, env, "--preload", "gmpre,gmpre_extra", "--preload", "json"), workers)
    for results in (first, second):
        assert all(isinstance(r, dict) and r["before"] and r["seen"] is None for r in results), results
        assert not private or not any(r["shm"] or r["ipc"] or r["mq"] for r in results), results  # type: ignore[index]
        assert len({r["zygote"] for r in results}) == 1  # type: ignore[index]
        assert all(r["zygote"] != r["pid"] for r in results)  # type: ignore[index]
    z1, z2 = first[0]["zygote"], second[0]["zygote"]  # type: ignore[index]
    assert z1 != z2 and first[0]["at"] != second[0]["at"], "two jobs must not share a preload zygote"  # type: ignore[index]
    wait_until(lambda: not pid_alive(z1) and not pid_alive(z2), timeout=30, what="the ended jobs' zygotes to go")
    assert len(builds(tmp_path / "envs")) == 1  # one env for both jobs


def _hostile_wheel(links: Path, marker: Path, secret: Path) -> None:
    """gmhostile: a preload that, at import in its zygote, tries to write ``marker``, read ``secret`` (root's
    alone) and every gpumesh worker's environment (where the broker's URL is), and records what it got; a .pth
    file that writes ``marker`` too, wherever the env's site runs."""
    tries = f"""\
import os
import re
GOT = {{"environ": []}}
def _try(f):
    try:
        return f() or "done"
    except OSError as exc:
        return type(exc).__name__
GOT["write"] = _try(lambda: open({str(marker)!r}, "w").write("preload"))
GOT["read"] = _try(lambda: open({str(secret)!r}).read())
for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
    try:
        cmdline = open(f"/proc/{{pid}}/cmdline", "rb").read()
    except OSError:
        continue
    if b"gpumesh\\x00worker" in cmdline:
        GOT["environ"].append(_try(lambda: open(f"/proc/{{pid}}/environ", "rb").read().decode(errors="replace")))
GOT["env"] = sorted(k for k in os.environ if "GPUMESH_URL" in k or "REDIS" in k)
GOT["uid"] = os.getuid()
"""
    hook = f"import os; open({str(marker)!r}, 'w').write('pth')\n"
    make_wheel(
        links, "gmhostile", "1.0", {"gmhostile.py": tries, "gmhostile_hook.pth": hook, "gmevil.py": "VALUE = 7\n"}
    )


HOSTILE = MEDDLE.replace('dependencies = ["gmevil"]', 'dependencies = ["gmhostile"]').replace(
    "print(json.dumps(out))", 'import gmhostile\nout["got"] = gmhostile.GOT\nprint(json.dumps(out))'
)
REFUSED = ("PermissionError", "OSError")


@pytest.mark.security
@pytest.mark.skipif(landlock.abi() < 1, reason="this kernel has no Landlock")
@pytest.mark.parametrize("user", [None, "nobody"])
def test_a_preload_and_its_env_run_only_confined_and_tasks_cannot_change_the_env(
    index: Path, workers: Workers, env: dict[str, str], tmp_path: Path, user: str | None
) -> None:
    """The preload and the env's .pth run in the job's zygote, confined before either: neither writes outside, reads
    a file of root's alone, nor reads a worker's environment (where the broker's URL is), with and without a
    sandbox user. A task that writes into its env's site-packages is refused, and the next task sees the original
    files."""
    marker = tmp_path.parent / f"preload-ran-{uuid.uuid4().hex}"
    secret = tmp_path.parent / f"secret-{uuid.uuid4().hex}"
    secret.write_text("only root reads this")
    secret.chmod(0o600)
    _hostile_wheel(index, marker, secret)
    extra: list[str] = []
    cache: Path | None = None
    if user:
        if not can_sandbox_user:
            pytest.skip("--sandbox-user needs a root worker on Linux and a Python the task user can read")
        extra = ["--sandbox-user", user]
        cache = Path(tempfile.mkdtemp(prefix="gpumesh-test-envs-"))
        os.chmod(cache, 0o755)
        links = cache / "wheels"  # the build runs as that user, who must read the owner's package folder
        shutil.copytree(index, links)
        os.chmod(links, 0o755)
        workers.env = {**workers.env, "GPUMESH_ENV_CACHE": str(cache), "GPUMESH_SANDBOX_PYTHON": SYSTEM_PYTHON,
                       "UV_FIND_LINKS": str(links)}  # fmt: skip
    script = tmp_path / "hostile.py"
    script.write_text(HOSTILE)
    try:
        workers.start("--warm", *extra)
        for r in finished(submit(script, env, "--preload", "gmhostile", n=2), workers):
            assert isinstance(r, dict)
            assert r["value"] == 7
            assert {r[k] for k in ("change", "create", "remove", "rename")} <= set(REFUSED), r
            got = r["got"]
            assert got["write"] in REFUSED and got["read"] in REFUSED, got
            assert got["environ"] and set(got["environ"]) <= set(REFUSED), got
            assert got["env"] == [], got
            if user:
                import pwd

                assert got["uid"] == pwd.getpwnam(user).pw_uid
        assert not marker.exists(), "a preload or a .pth file of the env ran outside the sandbox"
    finally:
        marker.unlink(missing_ok=True)
        secret.unlink(missing_ok=True)
        if cache is not None:
            workers.stop_all()
            for dirpath, _dirs, _files in os.walk(cache):
                os.chmod(dirpath, 0o755)
            shutil.rmtree(cache, ignore_errors=True)


@pytest.mark.processes
def test_a_preload_that_does_not_import_fails_the_job_s_tasks_naming_it(
    index: Path, workers: Workers, env: dict[str, str], tmp_path: Path
) -> None:
    """A preload that raises at import: each task fails (kind script) with one line naming the module, and the
    worker lives on to run the next job."""
    make_wheel(
        index, "gmpre", "1.0", {"gmpre.py": PRELOADED.format(tag="pre"), "gmbroken.py": "raise ValueError('nope')\n"}
    )
    script = tmp_path / "show.py"
    script.write_text(SHOW)
    proc = workers.start("--warm")
    job_id = submit(script, env, "--preload", "gmbroken", n=2)
    with gpumesh.connect() as mesh:
        job = mesh.job(job_id)
        assert job.wait(timeout=120).status == "failed"
        errors = [r.error or "" for r in job.results()]
    assert all(e.splitlines()[0] == "preload gmbroken: ValueError: nope" for e in errors), errors
    assert proc.poll() is None
    assert finished(submit(script, env, "--preload", "gmpre", n=1), workers)[0]["before"]  # type: ignore[index]


@pytest.mark.core
@pytest.mark.parametrize(
    "args, said",
    [
        (["--preload", "os;import"], "'os;import' is not a module name"),
        (["--preload", "a..b"], "'a..b' is not a module name"),
        (["--preload", "class"], "'class' is not a module name"),
        (["--preload", "json", "--no-env"], "preload names modules of the job's environment"),
        (["--preload", "json", "--reuse-process"], "preload is for warm workers"),
    ],
)
def test_bad_preload_is_one_line_exit_2_and_writes_nothing(
    index: Path, env: dict[str, str], tmp_path: Path, r: redis.Redis, args: list[str], said: str
) -> None:
    make_wheel(index, "gmpre", "1.0", {"gmpre.py": PRELOADED.format(tag="pre")})
    script = tmp_path / "show.py"
    script.write_text(SHOW.replace("print(json.dumps(", "def main(p):\n    return 1\nprint(json.dumps("))
    before = sorted(r.keys("*"))
    ran = run_cli("submit", str(script), "--payloads", "-", *args, env=env, input='[{"i": 0}]')
    assert ran.returncode == 2, ran.stderr
    assert said in ran.stderr and len(ran.stderr.strip().splitlines()) == 1, ran.stderr
    assert "Traceback" not in ran.stderr
    assert sorted(r.keys("*")) == before


@pytest.mark.processes
def test_a_job_file_s_env_preload_and_the_api_s_preload_reach_the_worker(
    index: Path, workers: Workers, env: dict[str, str], tmp_path: Path
) -> None:
    """[env] preload in gpumesh.toml, and preload= on submit: the warm tasks find the module imported."""
    make_wheel(index, "gmpre", "1.0", {"gmpre.py": PRELOADED.format(tag="pre")})
    (tmp_path / "show.py").write_text(SHOW)
    (tmp_path / "gpumesh.toml").write_text(
        '[job]\nscript = "show.py"\npayloads = [{i = 0}]\n\n[env]\npreload = ["gmpre"]\n'
    )
    workers.start("--warm")
    ran = run_cli("submit", "--json", env=env, cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert finished(json.loads(ran.stdout)["job_id"], workers)[0]["before"]  # type: ignore[index]
    with gpumesh.connect() as mesh:
        job = mesh.submit(tmp_path / "show.py", [{"i": 0}], preload=["gmpre"])
        assert finished(job.id, workers)[0]["before"]  # type: ignore[index]


@pytest.mark.security
def test_the_signature_covers_the_preload(
    index: Path, workers: Workers, env: dict[str, str], tmp_path: Path, r: redis.Redis
) -> None:
    """A worker credential can write a job's hash: a preload changed, added or removed there makes a trusting
    worker refuse the job's tasks, as a rewritten lock does; the honest job runs."""
    from gpumesh import signing
    from gpumesh.store import keys

    make_wheel(index, "gmpre", "1.0", {"gmpre.py": PRELOADED.format(tag="pre"), "gmpre_extra.py": "X = 1\n"})
    script = tmp_path / "show.py"
    script.write_text(SHOW)
    priv, pub = signing.generate(tmp_path / "keys")
    with gpumesh.connect() as mesh:
        jobs = [mesh.submit(script, [{"i": 0}], sign_key=priv, max_attempts=1, preload=p) for p in
                (["gmpre"], ["gmpre"], [], ["gmpre"], ["gmpre"])]  # fmt: skip
        changed, added_to, added, removed, honest = jobs
        r.hset(keys.job(changed.id), "preload", "gmpre_extra")
        r.hset(keys.job(added_to.id), "preload", "gmpre,gmpre_extra")
        r.hset(keys.job(added.id), "preload", "gmpre")
        r.hdel(keys.job(removed.id), "preload")
        workers.start("--warm", "--trust", signing.inline(signing.public_key(pub)))
        for job in (changed, added_to, added, removed):
            assert job.wait(timeout=120).status == "failed"
            (row,) = job.results()
            assert row.error_kind == "refused" and "signature" in (row.error or ""), row
        assert honest.wait(timeout=120).status == "done", honest.results()


@pytest.mark.processes
def test_a_preload_may_be_a_module_of_the_job_s_project(
    index: Path, workers: Workers, env: dict[str, str], tmp_path: Path
) -> None:
    """With --project, a preload names a module of the project as well as of the env: it is imported once per job,
    and each task finds it imported."""
    make_wheel(index, "gmpre", "1.0", {"gmpre.py": PRELOADED.format(tag="pre")})
    proj = tmp_path / "proj"
    (proj / "mylib").mkdir(parents=True)
    (proj / "mylib" / "__init__.py").write_text("")
    (proj / "mylib" / "model.py").write_text("import os\nLOADED_BY = os.getpid()\n")
    (proj / "show.py").write_text(
        SHOW.replace("import gmpre\n", "import gmpre\nfrom mylib import model\n").replace(
            '"tag": gmpre.TAG,', '"tag": gmpre.TAG, "model": "mylib.model" in sys.modules and model.LOADED_BY,'
        )
    )
    workers.start("--warm")
    job_id = submit(proj / "show.py", env, "--project", str(proj), "--preload", "gmpre,mylib.model", n=2)
    results = finished(job_id, workers)
    assert all(isinstance(r, dict) and r["model"] == r["zygote"] != r["pid"] for r in results), results


LIAR = """\
import __main__
_told = __main__._reply
def _reply(fd, msg):  # the launcher's, replaced: the attempt's pid becomes another process's
    _told(fd, {{"pid": {decoy}}} if set(msg) == {{"pid"}} else msg)
__main__._reply = _reply
"""


@pytest.mark.security
@pytest.mark.skipif(landlock.abi() < 1, reason="this kernel has no Landlock")
def test_a_preload_zygote_that_names_another_process_moves_and_signals_nothing(
    index: Path, workers: Workers, env: dict[str, str], tmp_path: Path
) -> None:
    """The preload zygote runs the job's code, which can rewrite what it tells the worker: a pid that is not its
    own attempt's (a process of the host) is refused. The worker neither moves it into the attempt's cgroup nor
    signals it, and the attempt fails (kind lost)."""
    import subprocess

    decoy = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        cgroup_before = Path(f"/proc/{decoy.pid}/cgroup").read_text()
        make_wheel(
            index, "gmpre", "1.0", {"gmpre.py": PRELOADED.format(tag="pre"), "gmliar.py": LIAR.format(decoy=decoy.pid)}
        )
        script = tmp_path / "show.py"
        script.write_text(SHOW)
        workers.start("--warm")
        job_id = submit(script, env, "--preload", "gmliar", "--max-attempts", "1", n=1)
        with gpumesh.connect() as mesh:
            job = mesh.job(job_id)
            assert job.wait(timeout=120).status == "failed"
            (row,) = job.results()
        assert row.error_kind == "lost" and "no child of its own" in (row.error or ""), row
        assert decoy.poll() is None, "the worker signalled a process the zygote named"
        assert Path(f"/proc/{decoy.pid}/cgroup").read_text() == cgroup_before
    finally:
        decoy.kill()
        decoy.wait()


# A preload that leaves a thread running in its zygote: it counts, in a file of the zygote's HOME, as long as it runs.
TICKER = """\
import os, threading, time
HOME = os.environ["HOME"]
def _tick():
    n = 0
    while True:
        n += 1
        with open(os.path.join(HOME, "ticks"), "w") as f:
            f.write(str(n))
        time.sleep(0.02)
threading.Thread(target=_tick, daemon=True).start()
"""

TICKS = """\
# /// script
# dependencies = ["gmpre"]
# ///
import gmticker, json, os
print(json.dumps({"home": gmticker.HOME, "pid": os.getpid(), "zygote": os.getppid()}))
"""


@pytest.mark.security
def test_a_preload_zygote_runs_nothing_between_its_job_s_attempts(
    index: Path, workers: Workers, env: dict[str, str], tmp_path: Path
) -> None:
    """What a job's preload leaves running in its zygote (here a thread) runs only while an attempt of that job
    does: once the attempt is over the zygote uses nothing of the machine (another job's task may run now), and the
    job's next task still finds it, as it was."""
    make_wheel(index, "gmpre", "1.0", {"gmpre.py": PRELOADED.format(tag="pre"), "gmticker.py": TICKER})
    script = tmp_path / "ticks.py"
    script.write_text(TICKS)
    # a heartbeat seldom enough that the ended job's zygote is not closed while it is watched here
    workers.start("--warm", GPUMESH_HEARTBEAT_INTERVAL="20", GPUMESH_LEASE_TTL="60")
    results = finished(submit(script, env, "--preload", "gmticker", n=2), workers)
    homes = {r["home"] for r in results}  # type: ignore[index]
    assert len(homes) == 1, results  # one zygote served both tasks
    ticks = Path(next(iter(homes))) / "ticks"

    def count() -> int:
        try:
            return int(ticks.read_text() or 0)
        except (OSError, ValueError):
            return -1

    before = count()
    assert before > 0, "the preload's thread never ran"
    time.sleep(1.0)
    assert count() == before, "the job's preload ran on after its last attempt"


@pytest.mark.security
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_paused_preload_zygote_goes_with_its_worker(
    index: Path, workers: Workers, env: dict[str, str], tmp_path: Path, sig: int
) -> None:
    """A job's zygote, stopped between its attempts with the thread its preload left running, goes when the worker
    stops or is killed: nothing of the job stays on the machine."""
    make_wheel(index, "gmpre", "1.0", {"gmpre.py": PRELOADED.format(tag="pre"), "gmticker.py": TICKER})
    script = tmp_path / "ticks.py"
    script.write_text(TICKS)
    proc = workers.start("--warm", GPUMESH_HEARTBEAT_INTERVAL="20", GPUMESH_LEASE_TTL="60")
    (result,) = finished(submit(script, env, "--preload", "gmticker", n=1), workers)
    zygote = result["zygote"]  # type: ignore[index]
    assert pid_alive(zygote)
    os.kill(proc.pid, sig)
    proc.wait(timeout=60)
    wait_until(lambda: not pid_alive(zygote), timeout=30, what="the job's zygote to go")
    home = Path(result["home"])  # type: ignore[index]
    wait_until(lambda: not home.parent.exists(), timeout=30, what="the job's zygote's directory to go")


# A preload whose zygote grows once its job's attempt has started: a thread that takes 600 MB a moment after import.
HOG = """\
import threading, time
HELD = []
def _grow():
    time.sleep(1.5)
    for _ in range(60):
        HELD.append(bytearray(10 << 20))
        time.sleep(0.01)
threading.Thread(target=_grow, daemon=True).start()
"""

WAITS = """\
# /// script
# dependencies = ["gmpre"]
# ///
import gmhog, time
time.sleep(12)
print("{}")
"""


@pytest.mark.security
def test_what_a_preload_zygote_holds_counts_in_its_job_s_memory_cap(
    index: Path, workers: Workers, env: dict[str, str], tmp_path: Path
) -> None:
    """The job's memory cap bounds its zygote too while an attempt runs: a preload that grows past the cap once the
    attempt has started fails the attempt for memory, as the same code in the task would."""
    make_wheel(index, "gmpre", "1.0", {"gmpre.py": PRELOADED.format(tag="pre"), "gmhog.py": HOG})
    script = tmp_path / "waits.py"
    script.write_text(WAITS)
    workers.start("--warm", GPUMESH_TASK_MEMORY_MB="300")
    job_id = submit(script, env, "--preload", "gmhog", "--max-attempts", "1", n=1)
    with gpumesh.connect() as mesh:
        job = mesh.job(job_id)
        assert job.wait(timeout=120).status == "failed", [(r.status, r.error) for r in job.results()]
        (row,) = job.results()
    assert row.error_kind == "memory", (row.error_kind, row.error)


# A preload that writes in its zygote's HOME, then fails: the error names that HOME.
LEAKY = """\
import os
import re
with open(os.path.join(os.environ["HOME"], "big"), "wb") as f:
    f.write(b"x" * (1 << 20))
{end}
"""


@pytest.mark.security
@pytest.mark.parametrize(
    "end",
    [
        "raise ValueError(os.environ['HOME'])",
        "import sys; print(os.environ['HOME'], file=sys.stderr, flush=True); os._exit(3)",
    ],
)
def test_a_preload_zygote_that_does_not_start_leaves_no_directory(
    index: Path, workers: Workers, env: dict[str, str], tmp_path: Path, end: str
) -> None:
    """A preload zygote that fails to start (its preload raises, or it exits without a word) leaves nothing of what
    it wrote on the worker's disk."""
    make_wheel(index, "gmpre", "1.0", {"gmpre.py": PRELOADED.format(tag="pre"), "gmleak.py": LEAKY.format(end=end)})
    script = tmp_path / "show.py"
    script.write_text(SHOW)
    workers.start("--warm")
    job_id = submit(script, env, "--preload", "gmleak", "--max-attempts", "1", n=2)
    with gpumesh.connect() as mesh:
        mesh.job(job_id).wait(timeout=120)
    log = workers.log(0)
    homes = {Path(p) for p in re.findall(r"(/\S+/\.zygote-home)\b", log)}
    with gpumesh.connect() as mesh:
        errors = [r.error or "" for r in mesh.job(job_id).results()]
    homes |= {Path(p) for e in errors for p in re.findall(r"(/\S+/\.zygote-home)\b", e)}
    assert homes, (errors, log[-2000:])
    wait_until(lambda: not any(h.parent.exists() for h in homes), timeout=30, what="the zygotes' directories to go")
