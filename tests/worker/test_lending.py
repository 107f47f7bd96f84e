"""Lenders in control: a worker pauses when its owner needs the machine (--lend, --pause-when), keeps to the
limits its owner set (--max-task-hours, --accept-from, --cpu-cores, --max-vram-gb), records what ran on the
machine (`gpumesh lent`), and hands a paused task back without spending an attempt. Real workers, a real Redis,
real signals; the probes read fixtures (a flag file, a command) in place of a desktop and a GPU."""

from __future__ import annotations

import json
import os
import stat
import textwrap
import time
from pathlib import Path

import pytest
import redis

from gpumesh.store import keys

from ..conftest import Workers, gpumesh, pid_alive, wait_until, written

FAST_PROBE = {"GPUMESH_PAUSE_PROBE_INTERVAL": "0.2", "GPUMESH_STOP_GRACE": "2"}

# A task that counts, a step every 0.1 s, writes where it got to, and on SIGTERM says so before it exits.
COUNTER = """
import json, os, signal, sys, time
tmp = {tmp!r}
attempt = os.environ["GPUMESH_ATTEMPT"]
def term(*_):
    open(os.path.join(tmp, "term-" + attempt), "w").write(str(time.time()))
    sys.exit(1)
signal.signal(signal.SIGTERM, term)
open(os.path.join(tmp, "pid-" + attempt), "w").write(str(os.getpid()))
for i in range({steps}):
    time.sleep(0.1)
print(json.dumps({{"worker": os.environ["GPUMESH_WORKER_ID"], "attempt": int(attempt)}}))
"""


def counter(tmp: Path, steps: int = 40) -> Path:
    path = tmp / "count.py"
    path.write_text(textwrap.dedent(COUNTER.format(tmp=str(tmp), steps=steps)))
    return path


def submit_one(env: dict[str, str], path: Path, *args: str) -> tuple[str, str]:
    p = gpumesh("submit", str(path), "--payloads", "-", *args, env=env, input='[{"n": 1}]')
    assert p.returncode == 0, p.stderr
    job = p.stdout.strip()
    return job, keys.task_id(job, 0)


def workers_json(env: dict[str, str]) -> list[dict]:
    p = gpumesh("workers", "--json", env=env)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


@pytest.mark.processes
def test_a_pause_hands_the_task_back_unspent_and_it_runs_elsewhere(env, workers: Workers, r: redis.Redis, tmp_path):
    flag = tmp_path / "owner-is-back"
    lender = workers.start("--name", "lender", "--pause-when", f"test -e {flag}", **FAST_PROBE)
    job, tid = submit_one(env, counter(tmp_path, steps=60), "--max-attempts", "1")
    wait_until(lambda: written(tmp_path / "pid-1"), what="attempt 1 on the lender")
    first = int((tmp_path / "pid-1").read_text())
    (tmp_path / "pid-1").unlink()
    workers.start("--name", "other")  # idle beside the lender
    t0 = time.time()
    flag.write_text("")
    wait_until(lambda: written(tmp_path / "term-1"), timeout=10, what="SIGTERM to the paused task")
    term_after = float((tmp_path / "term-1").read_text()) - t0
    wait_until(lambda: not pid_alive(first), timeout=10, interval=0.01, what="the paused task's process gone")
    freed_after = time.time() - t0
    # handed back unspent: the next attempt is attempt 1 again, on the other worker
    wait_until(lambda: written(tmp_path / "pid-1"), timeout=15, interval=0.01, what="the task running elsewhere")
    elsewhere_after = time.time() - t0
    shown = {w["name"]: w for w in workers_json(env)}["lender"]
    assert shown["state"] == "paused" and shown["paused"].startswith("--pause-when"), shown
    assert "paused: --pause-when" in gpumesh("workers", env=env).stdout
    wait_until(lambda: r.hget(keys.task(tid), "status") == "done", timeout=30, what="the task done elsewhere")
    print(f"\npause -> SIGTERM in the task {term_after:.2f} s, its process gone {freed_after:.2f} s, "
          f"running elsewhere {elsewhere_after:.2f} s")  # fmt: skip
    result = json.loads(r.hget(keys.task(tid), "result"))
    assert result["worker"].startswith("other-")  # the paused lender took nothing more
    st = json.loads(gpumesh("status", job, "--json", env=env).stdout)
    assert st["status"] == "done" and st["paused_handbacks"] == 1 and st["paused_lost_s"] > 0  # --max-attempts 1 held
    assert "handed back by pauses" in gpumesh("status", job, env=env).stdout
    flag.unlink()
    wait_until(lambda: not {w["name"]: w for w in workers_json(env)}["lender"].get("paused"), timeout=10,
               what="the lender to resume")  # fmt: skip
    assert lender.poll() is None
    log = workers.log(0)
    assert "paused: --pause-when" in log and "resumed" in log


def fixture(path: Path, text: str) -> str:
    """A probe's fixture: a command that prints what ``path`` holds (changed by the test as it goes)."""
    path.write_text(text)
    return f"cat {path}"


def paused_of(env: dict[str, str]) -> dict[str, str | None]:
    return {w["name"]: w.get("paused") for w in workers_json(env)}


@pytest.mark.processes
def test_each_probe_pauses_and_a_broken_one_counts_as_not_allowed(env, workers: Workers, r: redis.Redis, tmp_path):
    idle, gpu = tmp_path / "idle", tmp_path / "gpu"
    now = time.localtime()
    later = (now.tm_hour + 2) % 24  # a window that does not hold now
    workers.start("--name", "idle", "--lend", "idle=1", GPUMESH_IDLE_PROBE=fixture(idle, "10\n"), **FAST_PROBE)
    # another process (this test's) on the GPU
    workers.start("--name", "gpu", "--lend", "gpu-free", GPUMESH_GPU_PROBE=fixture(gpu, f"{os.getpid()}, 900\n"),
                  **FAST_PROBE)  # fmt: skip
    workers.start("--name", "hangs", "--pause-when", "sleep 30", GPUMESH_PAUSE_PROBE_TIMEOUT="0.5", **FAST_PROBE)
    workers.start("--name", "night", "--lend", f"{later:02d}:00-{(later + 1) % 24:02d}:00", **FAST_PROBE)
    job, tid = submit_one(env, counter(tmp_path, steps=1))
    shown = wait_until(lambda: (s := paused_of(env)) and all(s.values()) and s, what="every worker paused")
    assert shown["idle"].startswith("owner active"), shown
    assert shown["gpu"] == f"the GPU is in use by pid {os.getpid()}", shown
    assert "probe failed (it did not answer within 0.5 s)" in shown["hangs"], shown
    assert shown["night"].startswith("outside "), shown
    time.sleep(2)
    assert r.hget(keys.task(tid), "status") == "queued"  # no paused worker took it
    assert all(w.poll() is None for w in workers.procs)  # the hanging probe stopped nothing
    assert workers.log(2).count("counted as not allowed until it answers") == 1  # said once, not at every probe
    idle.write_text("600\n")  # the owner left the keyboard ten minutes ago
    wait_until(lambda: r.hget(keys.task(tid), "status") == "done", timeout=20, what="the idle worker to take it")
    assert json.loads(r.hget(keys.task(tid), "result"))["worker"].startswith("idle-")
    gpu.write_text("")  # nothing else on the GPU any more: the gpu-free worker resumes too
    wait_until(lambda: not paused_of(env)["gpu"], timeout=10, what="the gpu-free worker to resume")
    assert "paused: the GPU is in use" in workers.log(1) and "resumed" in workers.log(1)


@pytest.mark.core
def test_bad_lending_options_are_refused_in_one_line(env, r: redis.Redis):
    for args, says in (
        (["--lend", "25:00-01:00"], "--lend '25:00-01:00': expected always, idle[=MINUTES], gpu-free"),
        (["--lend", "idle=soon"], "--lend idle=soon: idle takes minutes"),
        (["--accept-from", "a b"], "--accept-from 'a b': expected credential names"),
        (["--cpu-cores", "4096"], "--cpu-cores 4096: this worker may use"),
    ):
        p = gpumesh("worker", *args, env=env)
        assert p.returncode == 2, (args, p.stderr)
        assert says in p.stderr and "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert r.zcard(keys.WORKERS) == 0


@pytest.mark.security
def test_dispatch_gives_a_worker_only_jobs_within_its_lender_s_limits(env, workers: Workers, r: redis.Redis, tmp_path):
    r.execute_command("ACL", "SETUSER", "alice", "reset", "on", ">alice-pw", "~*", "&*", "+@all")
    try:
        alice = {**env, "GPUMESH_URL": env["GPUMESH_URL"].replace("redis://", "redis://alice:alice-pw@")}
        path = tmp_path / "cores.py"
        path.write_text("import json, os\nprint(json.dumps({'cores': len(os.sched_getaffinity(0)), "
                        "'worker': os.environ['GPUMESH_WORKER_ID']}))\n")  # fmt: skip
        workers.start("--name", "lender", "--accept-from", "alice,carol", "--max-task-hours", "1", "--cpu-cores", "1",
                      "--resource", "vram_gb=24", "--max-vram-gb", "12")  # fmt: skip
        shown = {w["name"]: w for w in workers_json(env)}["lender"]["resources"]
        assert (shown["accept_from"], shown["max_task_hours"], shown["cpu_cores"]) == ("alice,carol", 1, 1)
        assert (shown["vram_gb"], shown["max_vram_gb"]) == (12, 12)
        big, _ = submit_one(alice, path, "--timeout", "60", "--require", "vram_gb>=16")  # more than lent
        by_default, _ = submit_one(env, path, "--timeout", "60")  # submitted as another credential
        too_long, _ = submit_one(alice, path, "--timeout", "7200")  # longer than the lender allows
        fits, fits_task = submit_one(alice, path, "--timeout", "60")
        wait_until(lambda: r.hget(keys.task(fits_task), "status") == "done", what="alice's short job")
        assert r.hget(keys.job(fits), "submitter") == "alice" and r.hget(keys.job(by_default), "submitter") == "default"
        assert json.loads(r.hget(keys.task(fits_task), "result"))["cores"] == 1  # --cpu-cores: affinity
        time.sleep(1.5)
        for job in (by_default, too_long, big):  # never leased to the lender, not even once
            assert r.hget(keys.task(keys.task_id(job, 0)), "attempts") in (None, "0"), job
        workers.start("--name", "anyone")
        for job in (by_default, too_long):
            wait_until(lambda job=job: r.hget(keys.task(keys.task_id(job, 0)), "status") == "done", what=job)
            assert json.loads(r.hget(keys.task(keys.task_id(job, 0)), "result"))["worker"].startswith("anyone-")
    finally:
        r.execute_command("ACL", "DELUSER", "alice")


@pytest.mark.faults
def test_lent_lists_what_ran_here_even_when_the_broker_went_away(env, workers: Workers, tmp_path):
    from ..conftest import RedisServer

    server = RedisServer(tmp_path).start()
    try:
        private = {**env, "GPUMESH_URL": server.url}
        client = server.client()
        out = tmp_path / "out.py"
        out.write_text("import json, os\nopen(os.path.join(os.environ['GPUMESH_OUTPUT_DIR'], 'a.bin'), 'wb')"
                       ".write(b'x' * 1000)\nprint(json.dumps({'ok': 1}))\n")  # fmt: skip
        workers.start(client=client, GPUMESH_URL=server.url)
        done_job, done_task = submit_one(private, out, "--name", "with-files")
        wait_until(lambda: client.hget(keys.task(done_task), "status") == "done", what="the first job")
        cut_job, _ = submit_one(private, counter(tmp_path, steps=50), "--name", "cut-off")
        wait_until(lambda: written(tmp_path / "pid-1"), what="the second job running")
        server.stop()  # the broker goes away while the task runs: the task ends, unreported
        record = Path(env["XDG_STATE_HOME"]) / "gpumesh" / "lent.jsonl"
        rows = wait_until(lambda: [r for r in json.loads(gpumesh("lent", "--json", env=env).stdout or "[]")
                                   if r["job"] == cut_job], timeout=30, what="the cut-off attempt recorded")  # fmt: skip
    finally:
        server.stop()
    every = {r["job"]: r for r in json.loads(gpumesh("lent", "--json", env=env).stdout)}
    first = every[done_job]
    assert (first["name"], first["submitter"], first["outcome"], first["sent_bytes"]) == ("with-files", "default",
                                                                                          "done", 1000)  # fmt: skip
    assert len(first["script"]) == 64 and first["duration"] > 0 and first["start"] > time.time() - 120
    assert rows[0]["outcome"] == "lost" and rows[0]["name"] == "cut-off"
    assert stat.S_IMODE(record.stat().st_mode) == 0o600 and stat.S_IMODE(record.parent.stat().st_mode) == 0o700
    table = gpumesh("lent", "--since", "1h", env=env)
    assert table.returncode == 0 and "with-files" in table.stdout and "cut-off" in table.stdout
    assert json.loads(gpumesh("lent", "--since", "2999-01-01", "--json", env=env).stdout) == []
    bad = gpumesh("lent", "--since", "yesterday", env=env)
    assert bad.returncode == 2 and "--since 'yesterday': expected an age" in bad.stderr


@pytest.mark.processes
def test_a_task_over_the_lender_s_vram_cap_is_killed_as_a_memory_failure(
    env, workers: Workers, r: redis.Redis, tmp_path
):
    gpu = tmp_path / "gpu"
    hog = tmp_path / "hog.py"
    hog.write_text(textwrap.dedent(f"""
        import json, os, time
        assert os.environ["GPUMESH_MAX_VRAM_GB"] == "12"
        open({str(gpu)!r}, "w").write(f"{{os.getpid()}}, 20000\\n")  # what NVML would say: 20000 MiB in use
        time.sleep(60)
        print("{{}}")
    """))  # fmt: skip
    workers.start("--max-vram-gb", "12", GPUMESH_GPU_PROBE=fixture(gpu, ""), **FAST_PROBE)
    job, tid = submit_one(env, hog, "--max-attempts", "1")
    wait_until(lambda: r.hget(keys.task(tid), "status") == "failed", timeout=30, what="the task killed")
    task = r.hgetall(keys.task(tid))
    assert (
        task["error_kind"] == "memory" and "over the lender's VRAM cap (19.5 GB used, at most 12 GB)" in task["error"]
    )


# Counts to 100, a step every 0.1 s, from where its checkpoint says; saves a checkpoint every 10. Started from 0,
# it stops counting at 55, between two checkpoints, until it is stopped: where the pause finds it does not
# depend on how soon a loaded machine runs the lender's probe.
CHECKPOINTED = """
import json, os, time
import gpumesh
tmp, ckpt = {tmp!r}, os.environ["GPUMESH_CHECKPOINT_DIR"]
state = os.path.join(ckpt, "state.json")
start = json.load(open(state))["i"] if os.path.exists(state) else 0
open(os.path.join(tmp, "from-" + os.environ["GPUMESH_WORKER_ID"]), "w").write(str(start))
for i in range(start + 1, 101):
    time.sleep(0.1)
    open(os.path.join(tmp, "at"), "w").write(str(i))
    if start == 0 and i == 55:
        time.sleep(300)
    if i % 10 == 0:
        with open(state + ".tmp", "w") as f:
            json.dump({{"i": i}}, f)
        os.replace(state + ".tmp", state)
        assert gpumesh.checkpoint(timeout=30)
print(json.dumps({{"started_from": start, "count": i}}))
"""


@pytest.mark.faults
def test_a_paused_task_resumes_elsewhere_from_its_last_checkpoint(env, workers: Workers, r: redis.Redis, tmp_path):
    flag = tmp_path / "owner-is-back"
    path = tmp_path / "count100.py"
    path.write_text(textwrap.dedent(CHECKPOINTED.format(tmp=str(tmp_path))))
    workers.start("--name", "lender", "--pause-when", f"test -e {flag}", **FAST_PROBE)
    job, tid = submit_one(env, path, "--max-attempts", "1")
    wait_until(lambda: written(tmp_path / "at") == "55", timeout=60, interval=0.02, what="the count at 55")
    flag.write_text("")  # the owner is back at 55
    t0 = time.monotonic()
    wait_until(lambda: r.hget(keys.task(tid), "status") == "queued", timeout=15, what="the task handed back")
    back = time.monotonic() - t0
    paused_at = int((tmp_path / "at").read_text())
    workers.start("--name", "other")
    wait_until(lambda: r.hget(keys.task(tid), "status") == "done", timeout=60, what="the task done elsewhere")
    result = json.loads(r.hget(keys.task(tid), "result"))
    assert result == {"started_from": 50, "count": 100}  # from the checkpoint at 50, not from 0
    assert [p.read_text() for p in tmp_path.glob("from-other-*")] == ["50"]
    assert len([e for _, e in r.xrange(keys.EVENTS) if e["id"] == tid and e["status"] == "done"]) == 1
    print(f"\npause at {paused_at} -> handed back in {back:.2f} s; resumed from 50: {paused_at - 50} steps lost of "
          f"{paused_at} (without a checkpoint: all {paused_at})")  # fmt: skip
    logs = gpumesh("logs", tid, env=env).stderr
    assert "restored the checkpoint of attempt 1" in logs, logs


@pytest.mark.security
def test_a_checkpoint_takes_no_link_and_restores_no_name_outside_its_directory(tmp_path):
    import io
    import tarfile

    from gpumesh.errors import UsageError
    from gpumesh.store import checkpoints

    secret = tmp_path / "id_ed25519"
    secret.write_text("PRIVATE KEY")
    ckpt = tmp_path / "ckpt"
    (ckpt / "sub").mkdir(parents=True)
    (ckpt / "sub" / "weights.bin").write_bytes(b"w" * 100)
    (ckpt / "key").symlink_to(secret)  # what a task leaves for the worker to read
    (ckpt / "dir").symlink_to(tmp_path)
    fd = os.open(ckpt, os.O_RDONLY | os.O_DIRECTORY)
    try:
        data, size = checkpoints.pack(fd, 0)
    finally:
        os.close(fd)
    with data, tarfile.open(fileobj=data) as tar:
        assert sorted(m.name for m in tar) == ["sub", "sub/weights.bin"]
        data.seek(0)
        into = tmp_path / "restored"
        into.mkdir()
        fd = os.open(into, os.O_RDONLY | os.O_DIRECTORY)
        assert checkpoints.unpack(data, fd) == 1
    try:
        assert (into / "sub" / "weights.bin").read_bytes() == b"w" * 100
        for name in ("../escaped", "/etc/escaped", "a/../../escaped"):
            evil = io.BytesIO()
            with tarfile.open(fileobj=evil, mode="w") as tar:
                info = tarfile.TarInfo(name)
                info.size = 1
                tar.addfile(info, io.BytesIO(b"x"))
            evil.seek(0)
            with pytest.raises(UsageError):
                checkpoints.unpack(evil, fd)
    finally:
        os.close(fd)
    assert not (tmp_path / "escaped").exists() and not Path("/etc/escaped").exists()
    fd = os.open(ckpt, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(checkpoints.TooLarge):
            checkpoints.pack(fd, 50)  # over the cap: not saved
    finally:
        os.close(fd)


@pytest.mark.core
def test_doctor_says_what_the_idle_probe_reads(env, tmp_path):
    p = gpumesh("doctor", "--json", env={**env, "GPUMESH_IDLE_PROBE": fixture(tmp_path / "idle", "42\n")})
    line = next(x for x in json.loads(p.stdout) if x["check"] == "lend idle")
    assert (
        line["status"] == "ok" and line["detail"] == "--lend idle reads GPUMESH_IDLE_PROBE: 42 s since the last input"
    )


# Writes its step into its checkpoint directory as it goes (never calling gpumesh.checkpoint()); on SIGTERM
# it writes what it was doing there too, within its grace.
SAVED_BY_THE_WORKER = """
import json, os, signal, sys, time
ckpt = os.environ["GPUMESH_CHECKPOINT_DIR"]
found = {{n: open(os.path.join(ckpt, n)).read() for n in os.listdir(ckpt)}}
if found or os.environ["GPUMESH_WORKER_ID"].startswith("other-"):
    print(json.dumps(found))
    sys.exit(0)
def term(*_):
    open(os.path.join(ckpt, "on-sigterm"), "w").write("saved in the grace")
    sys.exit(1)
signal.signal(signal.SIGTERM, term)
for i in range(1, 600):
    with open(os.path.join(ckpt, "step.tmp"), "w") as f:
        f.write(str(i))
    os.replace(os.path.join(ckpt, "step.tmp"), os.path.join(ckpt, "step"))
    open(os.path.join({tmp!r}, "at"), "w").write(str(i))
    time.sleep(0.1)
"""


@pytest.mark.faults
def test_checkpoints_saved_every_interval_and_in_the_grace_are_restored_and_go_with_the_job(
    env, workers: Workers, r: redis.Redis, tmp_path
):
    from gpumesh.store.submit import delete_job

    flag = tmp_path / "owner-is-back"
    path = tmp_path / "steps.py"
    path.write_text(textwrap.dedent(SAVED_BY_THE_WORKER.format(tmp=str(tmp_path))))
    workers.start("--name", "lender", "--pause-when", f"test -e {flag}", "--checkpoint-every", "0.5", **FAST_PROBE)
    job, tid = submit_one(env, path, "--max-attempts", "1")
    wait_until(lambda: int(written(tmp_path / "at") or 0) >= 20, timeout=60, what="20 steps")
    wait_until(lambda: r.hget(keys.task(tid), "ckpt"), timeout=10, what="a save every 0.5 s")
    flag.write_text("")
    wait_until(lambda: r.hget(keys.task(tid), "status") == "queued", timeout=15, what="the task handed back")
    workers.start("--name", "other")
    wait_until(lambda: r.hget(keys.task(tid), "status") == "done", timeout=60, what="the task done elsewhere")
    restored = json.loads(r.hget(keys.task(tid), "result"))
    assert restored["on-sigterm"] == "saved in the grace"  # written after SIGTERM, saved as the attempt ended
    assert int(restored["step"]) >= 20  # the last step it took, saved by the worker
    assert r.exists(keys.task_checkpoint(tid))
    delete_job(r, job, keys.JOBS)
    assert not r.exists(keys.task_checkpoint(tid))  # deleted with the job


FAILS_ONCE = """
import json, os, sys
import gpumesh
ckpt = os.path.join(os.environ["GPUMESH_CHECKPOINT_DIR"], "progress")
if os.environ["GPUMESH_ATTEMPT"] == "1":
    open(ckpt, "w").write("half done")
    assert gpumesh.checkpoint(timeout=30)
    sys.exit("a bug after the checkpoint")
print(json.dumps({"found": open(ckpt).read() if os.path.exists(ckpt) else None}))
"""


@pytest.mark.processes
def test_a_retried_failure_starts_from_the_checkpoint_its_first_attempt_saved(env, workers: Workers, r: redis.Redis,
                                                                               tmp_path):  # fmt: skip
    path = tmp_path / "fails_once.py"
    path.write_text(FAILS_ONCE)
    workers.start()
    job, tid = submit_one(env, path, "--max-attempts", "2", "--retry-on", "script")
    wait_until(lambda: r.hget(keys.task(tid), "status") == "done", timeout=60, what="the retry to finish")
    assert json.loads(r.hget(keys.task(tid), "result")) == {"found": "half done"}
    assert r.hget(keys.task(tid), "attempts") == "2"


@pytest.mark.security
def test_on_a_served_broker_jobs_name_their_credential_and_a_worker_credential_keeps_checkpoints(
    env, workers: Workers, tmp_path
):
    import re

    from ..conftest import Serve, free_port

    serve = Serve(env, tmp_path / "broker", free_port())
    try:
        text = "\n".join(serve.lines)
        submit_url = re.search(r"--url '(redis://submitter:[^']+)' --wait", text).group(1)
        admin = json.loads((tmp_path / "broker" / "credentials.json").read_text())["admin"]
        client = redis.Redis.from_url(f"redis://admin:{admin}@{serve.url.rsplit('@', 1)[1]}", decode_responses=True)
        path = tmp_path / "fails_once.py"
        path.write_text(FAILS_ONCE)
        workers.start("--accept-from", "submitter", client=client, GPUMESH_URL=serve.url)
        job, tid = submit_one({**env, "GPUMESH_URL": submit_url}, path, "--max-attempts", "2", "--retry-on", "script")
        assert client.hget(keys.job(job), "submitter") == "submitter"  # CLIENT INFO's user, as serve's rules allow
        wait_until(lambda: client.hget(keys.task(tid), "status") == "done", timeout=60, what="the retry to finish")
        assert json.loads(client.hget(keys.task(tid), "result")) == {"found": "half done"}  # saved and restored
    finally:
        serve.stop()


@pytest.mark.processes
def test_checkpoints_go_to_the_object_store_when_output_files_do(env, workers: Workers, r: redis.Redis, tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    path = tmp_path / "fails_once.py"
    path.write_text(FAILS_ONCE)
    workers.start(GPUMESH_ARTIFACTS=f"file://{store}")
    job, tid = submit_one(env, path, "--max-attempts", "2", "--retry-on", "script")
    wait_until(lambda: r.hget(keys.task(tid), "status") == "done", timeout=60, what="the retry to finish")
    assert json.loads(r.hget(keys.task(tid), "result")) == {"found": "half done"}
    index = json.loads(r.hget(keys.task(tid), "ckpt"))
    assert index["store"] == f"file://{store}" and (store / index["path"]).is_file()
    assert not r.exists(keys.task_checkpoint(tid))  # the broker holds only the index


@pytest.mark.core
def test_checkpoints_are_fenced_like_results_and_one_replaced_while_read_restores_nothing(broker, r, tmp_path):
    from gpumesh.models import JobOptions
    from gpumesh.store import checkpoints, scripts
    from gpumesh.store.reaper import reap_once

    store = checkpoints.Store(broker.rq, broker.r, broker.scripts)
    job = broker.submit("print('{}')", "t.py", [{"i": 0}], JobOptions()).job_id
    tid = broker.task_ids(job)[0]

    def save(lease: scripts.Lease, seq: int, text: str) -> tuple[bool, str]:
        where = tmp_path / f"{text}-{seq}"
        where.mkdir()
        (where / "state").write_text(text)
        fd = os.open(where, os.O_RDONLY | os.O_DIRECTORY)
        try:
            data, size = checkpoints.pack(fd, 0)
        finally:
            os.close(fd)
        with data:
            return store.save(lease, seq, data, size)

    def restored() -> str:
        into = tmp_path / f"into-{time.monotonic_ns()}"
        into.mkdir()
        fd = os.open(into, os.O_RDONLY | os.O_DIRECTORY)
        try:
            store.restore(tid, fd)
        finally:
            os.close(fd)
        return (into / "state").read_text()

    old = scripts.acquire(broker.scripts, r, tid, "old", 50)
    assert save(old, 1, "one") == (True, "saved")
    assert save(old, 1, "again") == (False, "older")  # not newer than what this attempt saved
    time.sleep(0.1)  # its lease lapses; the task is leased again
    assert reap_once(broker, audit_grace_ms=0)["requeued"] == 1
    new = scripts.acquire(broker.scripts, r, tid, "new", 30_000)
    assert save(old, 2, "stale") == (False, "stale")  # the lapsed attempt cannot replace it
    assert r.keys("gpumesh:task:*:files:ckpt-*") == []  # nor leave its upload behind
    assert restored() == "one"
    assert save(new, 1, "two") == (True, "saved")  # the new lease counts its saves from 1
    index, chunks = store.newest(tid)
    assert save(new, 2, "three") == (True, "saved")  # replaced while a backup copy would read it
    with pytest.raises(LookupError):
        list(chunks)
    assert restored() == "three"
