"""Projects: what shipping a folder costs a submit, a task and the broker.

    python benchmarks/project.py [--files 2000] [--mib 50] [--tasks 300] [--rounds 3] [--queued 100000]

1. Submit (``Mesh.submit(..., project=DIR)``, in-process) of a project of ``--files`` files, ``--mib`` MiB in
   all (random bytes, 40 folders): the first submit, an unchanged resubmit, and one after a file changed,
   each with the file bytes it sent.
2. Per task, warm mode: one ``gpumesh worker --warm`` runs ``--tasks`` no-op tasks of a job without a
   project, then of a job whose script lies in that project, alternately for ``--rounds`` rounds; the job's
   wall time over its tasks (the project materialised on the machine before timing).
3. Broker memory per queued task: a job of ``--queued`` tasks submitted with no worker, with a project (its
   tree held already by an earlier job) and without, Redis ``used_memory`` before and after each.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from common import PrivateRedis, med, publish, rounds, start_worker, stop, table

import gpumesh
from gpumesh.settings import Settings
from gpumesh.store.broker import Broker

NOOP = "import json, sys\nprint(json.dumps(json.load(sys.stdin)))\n"
MIB = 1 << 20


def make_project(root: Path, files: int, mib: int) -> Path:
    root.mkdir(parents=True)
    (root / "noop.py").write_text(NOOP)
    size = mib * MIB // files
    for i in range(files - 1):
        folder = root / f"pkg{i % 40:02d}"
        folder.mkdir(exist_ok=True)
        (folder / f"m{i:04d}.py").write_bytes(os.urandom(size))
    return root


def timed_submit(mesh: gpumesh.Mesh, proj: Path) -> tuple[float, int, int]:
    t0 = time.perf_counter()
    job = mesh.submit(proj / "noop.py", [{}], project=proj, max_attempts=1)
    took = time.perf_counter() - t0
    sent = job.submitted.project  # type: ignore[union-attr]
    assert sent is not None
    return took, sent.sent_files, sent.sent_bytes


def per_task_ms(mesh: gpumesh.Mesh, proj: Path | None, tasks: int) -> float:
    script = (proj / "noop.py") if proj is not None else NOOP
    t0 = time.perf_counter()
    job = mesh.submit(script, [{"i": i} for i in range(tasks)], project=proj)
    st = job.wait(timeout=600)
    assert st.status == "done", job.results()[0].error
    return (time.perf_counter() - t0) / tasks * 1000


def used(broker: Broker) -> int:
    return int(broker.r.info("memory")["used_memory"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--mib", type=int, default=50)
    ap.add_argument("--tasks", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--queued", type=int, default=100_000)
    args = ap.parse_args()
    server = PrivateRedis()
    tmp = Path(tempfile.mkdtemp(prefix="gpumesh-bench-project-"))
    cache = Path(tempfile.mkdtemp(prefix="gpumesh-bench-projects-"))
    os.environ.update(GPUMESH_URL=server.url, XDG_CACHE_HOME=str(tmp / "cache"), GPUMESH_CONFIG=str(tmp / "c.toml"))
    procs = []
    try:
        proj = make_project(tmp / "proj", args.files, args.mib)
        mesh = gpumesh.connect()
        first = timed_submit(mesh, proj)
        again = timed_submit(mesh, proj)
        changed_file = next((proj / "pkg00").iterdir())
        changed_file.write_bytes(os.urandom(changed_file.stat().st_size))
        changed = timed_submit(mesh, proj)
        submit_rows = [
            ["first submit", f"{first[0]:.2f}", first[1], f"{first[2] / MIB:.1f} MiB"],
            ["unchanged resubmit", f"{again[0]:.2f}", again[1], f"{again[2]} B"],
            ["one file changed", f"{changed[0]:.2f}", changed[1], f"{changed[2] / 1024:.1f} KiB"],
        ]
        mesh.broker.r.flushall()

        # Per task, warm mode: the project materialised before timing (one warm-up job of each kind).
        env = {"GPUMESH_PROJECT_CACHE": str(cache), "XDG_CACHE_HOME": str(tmp / "cache")}
        procs.append(start_worker(server.url, 10, "--warm", env=env))
        while not mesh.workers():
            time.sleep(0.05)
        per_task_ms(mesh, None, 20)
        per_task_ms(mesh, proj, 20)
        plain, inside = [], []
        for _ in range(args.rounds):
            plain.append(per_task_ms(mesh, None, args.tasks))
            inside.append(per_task_ms(mesh, proj, args.tasks))
        stop(procs)
        procs.clear()
        mesh.broker.r.flushall()

        # Broker memory per queued task, the project's tree already held by an earlier job.
        small = tmp / "small"
        small.mkdir()
        (small / "noop.py").write_text(NOOP)
        (small / "lib.py").write_text("X = 1\n")
        mesh.submit(small / "noop.py", [{}], project=small)
        items = [{"i": i} for i in range(args.queued)]
        broker = Broker(Settings.load())
        b0 = used(broker)
        mesh.submit(NOOP, items)
        b1 = used(broker)
        mesh.submit(small / "noop.py", items, project=small)
        b2 = used(broker)
        without, with_project = (b1 - b0) / args.queued, (b2 - b1) / args.queued
        broker.close()
        mesh.close()
    finally:
        stop(procs)
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
        for dirpath, dirnames, _ in os.walk(cache):
            os.chmod(dirpath, 0o755)
            for d in dirnames:
                if not os.path.islink(os.path.join(dirpath, d)):
                    os.chmod(os.path.join(dirpath, d), 0o755)
        shutil.rmtree(cache, ignore_errors=True)
    ratio = med(inside) / med(plain)
    body = "\n\n".join(
        [
            f"A project of {args.files:,} files, {args.mib} MiB (random bytes, in 40 folders), submitted through the "
            "API in-process (the CLI adds its interpreter's start):",
            table(["submit", "seconds", "files sent", "bytes sent"], submit_rows),
            f"Per task, warm mode, one worker, {args.tasks} no-op tasks a job, {args.rounds} rounds alternating:",
            table(
                ["job", "ms per task (median)", "rounds"],
                [
                    ["no project", f"{med(plain):.2f}", rounds(plain)],
                    [f"script inside the {args.files:,}-file project", f"{med(inside):.2f}", rounds(inside)],
                ],
            ),
            f"Inside the project / without: **{ratio:.2f}×**. An attempt sees the project through links to its "
            "top-level entries (41 here) in its own directory, whatever the number of files below them; a worker "
            "resets an ended attempt's directory for a later one instead of making the links again.",
            "Measured on a machine shared with other work: a round can move by a fifth either way; compare the "
            "medians of one run, where the two kinds alternate.",
            f"Broker memory per queued task, a job of {args.queued:,} tasks: {without:.1f} B without a project, "
            f"{with_project:.1f} B with one (its tree held already: a project adds fields to the job's hash, "
            "nothing to a task).",
        ]
    )
    command = (
        f"python benchmarks/project.py --files {args.files} --mib {args.mib} --tasks {args.tasks} "
        f"--rounds {args.rounds} --queued {args.queued}"
    )
    publish("project", "Projects: submit, per-task cost, broker memory", body, command)
    json.dump(
        {"submit": submit_rows, "plain_ms": plain, "inside_ms": inside, "ratio": ratio,
         "bytes_per_task": [without, with_project]},
        sys.stderr,
    )  # fmt: skip


if __name__ == "__main__":
    main()
