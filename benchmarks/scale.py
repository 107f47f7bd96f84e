"""Scale: 1,000 simulated workers against one Redis, each with a real worker's broker traffic.

    python benchmarks/scale.py [--workers 1000] [--tasks 30000] [--jobs 1] [--heartbeat 5]
                               [--variants delivery,bare] [--against REV] [--repeat N] [--groups 3]

The workers are plain state machines in one process, not processes. Each registers as a real worker
does (worker hash with its `resources`, ZADD gpumesh:scores and gpumesh:workers, the fleet marked
dirty), heartbeats (heartbeat.lua, lease renewal included) every --heartbeat seconds, and for every
task does what `gpumesh worker` does around it:
  1. dispatch.lua: pick a task against the live fleet and lease it, in one step (the KEYS and ARGV
     scripts.dispatch sends);
  2. the delivery through an RQ queue (Broker.deliver; a tier's queue `gpumesh-tier-<k>` in this checkout, a queue
     per worker in earlier ones), replayed on one list per simulated worker for every version (an LPUSH or
     LPOP costs Redis the same on a shared list, and the harness pops each worker's own): RQ's own commands (SADD
     rq:queues, HSET of the RQ job hash, RPUSH), recorded once from a real `Queue.enqueue_many`
     and replayed with each task's id, after the two LREMs with which this checkout's deliver clears
     what a resent transaction would have left (for an --against revision, only if its deliver had them);
  3. RQ's pop: the LMOVE of its queue, which the worker sends in the delivery's transaction and so never
     reads back the RQ job it has just written (replayed as an LPOP in the next round); an --against
     revision from before that change read it back with HGETALL (Job.fetch), replayed for it;
  4. complete.lua with the lease token, and (delivery variant) the DEL of the RQ job: a real worker's
     record of the run's end deletes the delivery's RQ job (Broker.deliver keeps no RQ result).
Variant `delivery` does all four (what a real worker asks of Redis); variant `bare` leaves out 2
and 3 (the gpumesh scripts alone). Left out of both: the task itself and RQ's per-job execution
bookkeeping (status, started registry, the worker's counters), which every RQ worker pays whatever
the scheduler is; this measures what the broker carries. With ``logs`` (benchmarks/finished.py), the
completion carries the attempt's two log lines in its round trip, as a real worker's does.

The harness advances all workers one step per round and sends each round's commands as a stream,
as if 1,000 clients' commands arrived interleaved: a Python client sending one command at a time
cannot produce this load on a 2-core machine, and redis-py's pipeline costs the client more per
command than Redis spends on most of them, so commands are packed and replies parsed by hiredis
on bare sockets. The fleet is split in --groups groups (3), each on its own connection: while one
group's round runs in Redis and the next waits in its socket, the harness parses another's replies
and packs its next round. With two, Redis waited for the harness in the delivery variant (93 % of a
core against 99 % bare, on a 2-core Intel Xeon): a third in flight took it from 9,980 to 10,553/s at the same
89-93 µs of Redis a task, and a fourth added nothing (10,525/s). Dispatch
latency is measured apart, by one real worker client in its own process (registered in the same
fleet, taking tasks from the same jobs): scripts.dispatch, then Broker.deliver and LPOP (delivery
variant), then scripts.complete, one call at a time while the fleet runs; under a loaded Redis it
includes the wait behind the fleet's commands. At the end of each run every task must be done
exactly once (status done, one attempt, one RQ delivery when delivered) and the jobs' counters exact.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path
from urllib.parse import urlparse

import hiredis
import redis
from common import PrivateRedis, publish, revision_tree, table
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer

from gpumesh.models import JobOptions
from gpumesh.settings import Settings
from gpumesh.store import keys, scripts, tasklog
from gpumesh.store.broker import EXECUTOR, FAILURE_TTL, RESULT_TTL, Broker

LEASE_MS = 30_000
WORKER_TTL_MS = 60_000
SCORES = (1.0, 2.0, 4.0, 8.0)  # an uneven fleet, so dispatch's horizon pick has work to do
RESOURCES = {"device": "cpu", "gpu": "simulated", "cpu_cores": 2, "ram_gb": 8.0}
PROBE = r"""
import json, os, sys, time
from gpumesh.store import keys
from gpumesh.store import scripts
from gpumesh.store.broker import Broker
from gpumesh.settings import Settings
url, go, ready, deliver, lib = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1", sys.argv[5]
read_back = sys.argv[6] == "1"  # that revision's worker read each delivery back
b = Broker(Settings(url=url))
if lib:
    b.scripts = scripts.Scripts(b.redis, lib)
from rq import Queue
from rq.serializers import JSONSerializer
q = Queue(keys.queue_name("probe"), connection=b.rq, serializer=JSONSerializer)  # a list of its own, as the fleet's
open(ready, "w").close()
while not os.path.exists(go):
    time.sleep(0.001)
lat = []
while True:
    t0 = time.perf_counter()
    lease = scripts.dispatch(b.scripts, b.r, "probe", 30000, 1.0)
    lat.append((time.perf_counter() - t0) * 1000)
    if not isinstance(lease, scripts.Lease):
        break
    if deliver:
        b.deliver(q, lease)
        rq_id = b.rq.lpop(q.key).decode()
        if read_back:
            b.rq.hgetall("rq:job:" + rq_id)
    assert scripts.complete(b.scripts, b.r, lease, "probe", "{}", 0.001, 1.0).accepted
    if deliver:
        b.rq.delete("rq:job:" + rq_id)  # as a real worker's record of the run's end does
    time.sleep(0.002)
print(json.dumps(lat[:-1]))  # the last call found nothing left
"""


class Delivery:
    """Broker.deliver's Redis commands for any (worker, task), recorded from one real RQ enqueue_many."""

    WORKER, TASK = b"wTPL", b"tTPL-0"

    def __init__(self, broker: Broker, guarded: bool = True) -> None:
        task = self.TASK.decode()
        # one list per simulated worker, whichever version: a tier's shared list costs Redis the same O(1) LPUSH and
        # LPOP as a worker's own, and the harness pops each worker's own delivery
        queue = Queue(keys.queue_name(self.WORKER.decode()), connection=broker.rq, serializer=JSONSerializer)
        with broker.rq.pipeline() as p:
            if guarded:  # this checkout's deliver first removes any copy a resent transaction left
                p.lrem(queue.key, 0, keys.rq_job_id(task, 1))
                p.lrem(queue.intermediate_queue_key, 0, keys.rq_job_id(task, 1))
            data = Queue.prepare_data(
                EXECUTOR,
                args=(task,),
                job_id=keys.rq_job_id(task, 1),
                timeout=int(3600 + broker.settings.lease_ttl + 60),
                result_ttl=RESULT_TTL,
                failure_ttl=FAILURE_TTL,
                description=f"gpumesh task {task}",
            )  # fmt: skip  (the fields Broker.deliver sets)
            queue.enqueue_many([data], pipeline=p)
            encode = broker.rq.get_encoder().encode
            stack = [[encode(x) for x in args] for args, _opts in p.command_stack]
            p.reset()
        self.names = [args[0].decode() for args in stack]
        self.commands: list[tuple[list[bytes], list[int], int]] = []  # args, positions naming ids, data position
        for args in stack:
            data_at = next((i for i in range(1, len(args)) if args[i - 1] == b"data"), -1)
            if data_at >= 0:
                self.plain_data = zlib.decompress(args[data_at])
            subs = [i for i, x in enumerate(args) if i != data_at and (self.WORKER in x or self.TASK in x)]
            self.commands.append((args, subs, data_at))

    def commands_for(self, worker: str, task: str) -> list[tuple[bytes, ...]]:
        w, t = worker.encode(), task.encode()
        out = []
        for args, subs, data_at in self.commands:
            cmd = list(args)
            for i in subs:
                cmd[i] = args[i].replace(self.WORKER, w).replace(self.TASK, t)
            if data_at >= 0:
                cmd[data_at] = zlib.compress(self.plain_data.replace(self.TASK, t))
            out.append(tuple(cmd))
        return out


def register(r: redis.Redis, ids: list[str]) -> None:
    """As worker._register and a first heartbeat: what the dispatcher reads about a worker."""
    now_ms = int(r.time()[0]) * 1000
    with r.pipeline(transaction=False) as p:
        for i, wid in enumerate(ids):
            score = SCORES[i % len(SCORES)] if wid != "probe" else 1.0
            p.hset(keys.worker(wid), mapping={
                "resources": json.dumps(RESOURCES), "name": wid, "hostname": "sim", "pid": 0, "device": "cpu",
                "device_name": "simulated", "memory": 0, "score": score, "version": "sim", "current_task": "",
            })  # fmt: skip
            p.pexpire(keys.worker(wid), WORKER_TTL_MS)
            p.zadd(keys.SCORES, {wid: score})
            p.zadd(keys.WORKERS, {wid: now_ms})
        p.hset(keys.FLEET, "dirty", 1)
        p.hincrby(keys.FLEET, "v", 1)
        p.execute()


class Raw:
    """A bare RESP connection: commands packed by hiredis and sent as soon as a chunk is ready (Redis works
    while the next chunk is packed), replies parsed by hiredis. redis-py's pipeline costs the client
    about 25 µs a command, more than Redis spends on most of them; this harness would measure itself."""

    def __init__(self, url: str) -> None:
        u = urlparse(url)
        self.sock = socket.create_connection((u.hostname or "127.0.0.1", u.port or 6379))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.reader = hiredis.Reader()

    def send(self, commands: list[tuple]) -> None:
        self.sock.sendall(b"".join(hiredis.pack_command(c) for c in commands))

    def read(self, n: int) -> list:
        out: list = []
        while len(out) < n:
            reply = self.reader.gets()
            if reply is False:
                self.reader.feed(self.sock.recv(1 << 20))
            elif isinstance(reply, hiredis.ReplyError):
                raise RuntimeError(f"Redis refused a command: {reply}")
            else:
                out.append(reply)
        return out

    def close(self) -> None:
        self.sock.close()


class Group:
    """Some of the simulated workers, with a connection of their own: while one group's round runs in
    Redis, the harness parses the other's replies and packs its next round, so Redis never waits for it."""

    def __init__(self, url: str, ids: list[str], score: dict[str, float], fn: dict[str, str], epoch: str,
                 heartbeat: float, dl: Delivery | None, offset: int, n: int, read_back: bool,
                 logs: bool = False) -> None:  # fmt: skip
        self.raw, self.active, self.score, self.fn, self.epoch, self.dl = Raw(url), list(ids), score, fn, epoch, dl
        self.logs = logs  # the completion carries the attempt's log lines (the worker's note, the result line)
        self.read_back = read_back  # the pop reads the RQ job back (HGETALL), as workers before the fused pop did
        self.heartbeat = heartbeat
        # phase: ("dispatch",) | ("deliver"|"pop"|"complete", tid, token) | ("idle",)
        self.phase: dict[str, tuple] = {wid: ("dispatch",) for wid in ids}
        now = time.monotonic()
        self.next_beat = {wid: now + heartbeat * (offset + i) / n for i, wid in enumerate(ids)}  # spread, as in life
        self.done = self.beats = self.rounds = self.bad_pops = 0
        self.round_ms: list[float] = []
        self.steps: list[tuple[str, str, int]] = []  # the round in flight: (worker, step, replies it takes)
        self.sent, self.t0 = 0, 0.0
        self.tokens: dict[str, str] = {}  # the token each worker sent with its last dispatch

    def send_round(self) -> None:
        """Each active worker's next step (and its heartbeat when due), sent in chunks as they are packed."""
        now, fn, steps, chunk, self.sent = time.monotonic(), self.fn, [], [], 0
        self.t0 = time.perf_counter()
        for wid in self.active:
            ph = self.phase[wid]
            if now >= self.next_beat[wid]:
                tid, token = (ph[1], ph[2]) if len(ph) == 3 else ("", "")
                chunk.append(
                    (
                        "FCALL",
                        fn["heartbeat"],
                        6,
                        keys.worker(wid),
                        keys.WORKERS,
                        keys.lease(tid),
                        keys.LEASES,
                        keys.task(tid),
                        keys.EPOCH,
                        wid,
                        WORKER_TTL_MS,
                        token,
                        LEASE_MS,
                        tid,
                        self.epoch,
                    )
                )  # fmt: skip  (the KEYS and ARGV of scripts.heartbeat)
                steps.append((wid, "beat", 1))
                self.next_beat[wid] = now + self.heartbeat
            step = ph[0]
            if step == "dispatch":
                token = scripts.new_token()  # the worker makes its lease's token (Redis keeps its digest)
                self.tokens[wid] = token
                chunk.append(("FCALL", fn["dispatch"], 7, keys.READY, keys.SCORES, keys.FLEET, keys.worker(wid),
                              keys.LEASES, keys.EVENTS, keys.IDLE, wid, LEASE_MS, self.score[wid], token))  # fmt: skip
                steps.append((wid, step, 1))
            elif step == "deliver":
                assert self.dl is not None
                cmds = self.dl.commands_for(wid, ph[1])
                chunk += cmds
                steps.append((wid, step, len(cmds)))
            elif step == "pop":
                chunk.append(("LPOP", f"rq:queue:{keys.queue_name(wid)}"))
                if self.read_back:
                    chunk.append(("HGETALL", f"rq:job:{keys.rq_job_id(ph[1], 1)}"))
                steps.append((wid, step, 1 + self.read_back))
            else:
                tid = ph[1]
                n0 = len(chunk)
                if self.logs:  # tasklog.append's XADDs, which ride in the completion's round trip
                    for stream, line in (("gpumesh", f"attempt 1 on {wid}"), ("stdout", "{}")):
                        chunk.append(tasklog.command(tid, stream, line))
                files = keys.task_files(tid)  # no output files: the staging and kept names are the same
                chunk.append(("FCALL", fn["complete"], 11, keys.task(tid), keys.lease(tid), keys.LEASES,
                              keys.job(keys.job_of_task(tid)), keys.EVENTS, keys.worker(wid), keys.STATS,
                              keys.STATS_DURATION, files, files, keys.spent(keys.job_of_task(tid)),
                              tid, ph[2], "{}", "0.001", self.score[wid], "", 0, "", 0, ""))  # fmt: skip
                # (the KEYS and ARGV of scripts.complete for an unsigned task without files)
                if self.dl:  # the worker's record of the run's end deletes the delivery's RQ job
                    chunk.append(("DEL", f"rq:job:{keys.rq_job_id(tid, 1)}"))
                steps.append((wid, step, len(chunk) - n0))
            if len(chunk) >= 256:
                self.raw.send(chunk)
                self.sent += len(chunk)
                chunk = []
        if chunk:
            self.raw.send(chunk)
            self.sent += len(chunk)
        self.steps = steps

    def finish_round(self) -> None:
        replies = self.raw.read(self.sent)
        self.round_ms.append((time.perf_counter() - self.t0) * 1000)
        self.rounds += 1
        at = 0
        for wid, step, k in self.steps:
            reply = replies[at] if k == 1 else replies[at : at + k]
            at += k
            ph = self.phase[wid]
            if step == "beat":
                self.beats += 1
            elif step == "dispatch":
                if int(reply[0]) != 1:
                    self.phase[wid] = ("idle",)  # nothing left it may run: a real worker blocks on its wake list
                else:
                    lease = dict(zip(reply[2::2], reply[3::2]))  # the lease's field/value pairs
                    self.phase[wid] = (
                        "deliver" if self.dl else "complete",
                        lease[b"task_id"].decode(),
                        self.tokens[wid],
                    )
            elif step == "deliver":
                self.phase[wid] = ("pop", ph[1], ph[2])
            elif step == "pop":
                popped, job = (reply[0], reply[1]) if self.read_back else (reply, True)
                self.bad_pops += popped != keys.rq_job_id(ph[1], 1).encode() or not job
                self.phase[wid] = ("complete", ph[1], ph[2])
            else:
                done = reply if k == 1 else reply[2 * self.logs]  # complete's reply, after the log lines'
                self.done += int(done[0]) == 1
                self.phase[wid] = ("dispatch",)
        self.active = [wid for wid in self.active if self.phase[wid][0] != "idle"]


def simulate(
    url: str,
    s: scripts.Scripts,
    ids: list[str],
    heartbeat: float,
    epoch: str,
    dl: Delivery | None,
    read_back: bool = False,
    groups: int = 3,
    logs: bool = False,
) -> dict:
    """Run the fleet until every worker finds nothing left; ``dl`` None leaves the RQ delivery out; ``logs``:
    each completion carries its attempt's two log lines."""
    score = {wid: SCORES[i % len(SCORES)] for i, wid in enumerate(ids)}
    fn = {name: s[name].name for name in ("dispatch", "complete", "heartbeat")}  # FCALL names of the library
    size = -(-len(ids) // groups)
    parts = [ids[i : i + size] for i in range(0, len(ids), size)]
    gs = [
        Group(url, part, score, fn, epoch, heartbeat, dl, i * size, len(ids), read_back, logs)
        for i, part in enumerate(parts)
    ]
    started = time.monotonic()
    for g in gs:
        g.send_round()
    while any(g.active for g in gs):
        for g in gs:
            if g.active:
                g.finish_round()
                if g.active:
                    g.send_round()
    wall = time.monotonic() - started
    for g in gs:
        g.raw.close()
    return {
        "done": sum(g.done for g in gs), "wall": wall, "beats": sum(g.beats for g in gs),
        "rounds": max(g.rounds for g in gs), "round_ms": [x for g in gs for x in g.round_ms],
        "bad_pops": sum(g.bad_pops for g in gs),
    }  # fmt: skip


def check(r: redis.Redis, jobs: list[str], total: int, delivered: bool) -> list[str]:
    """Every task done exactly once, with one RQ delivery; the counters exact. Returns the problems."""
    problems = []
    for job in jobs:
        h = r.hgetall(keys.job(job))
        tids = r.lrange(keys.job_tasks(job), 0, -1)
        with r.pipeline(transaction=False) as p:
            for tid in tids:
                p.hmget(keys.task(tid), "status", "attempts")
            rows = p.execute()
        bad = [tid for tid, (st, att) in zip(tids, rows) if st != "done" or att != "1"]
        if bad:
            problems.append(f"job {job}: {len(bad)} tasks not done exactly once, e.g. {bad[0]}")
        want = {"status": "done", "total": str(len(tids)), "done": str(len(tids)), "queued": "0", "running": "0",
                "failed": "0", "cancelled": "0"}  # fmt: skip
        got = {k: h.get(k) for k in want}
        if got != want:
            problems.append(f"job {job}: counters {got}")
        if r.exists(keys.pending(job, 0)):
            problems.append(f"job {job}: pending zset left")
    stats_done = int(r.hget(keys.STATS, "done") or 0)
    if stats_done != total:
        problems.append(f"stats done {stats_done} != {total}")
    if r.zcard(keys.LEASES) or r.zcard(keys.READY):
        problems.append(f"leases {r.zcard(keys.LEASES)}, ready {r.zcard(keys.READY)} left")
    rq_jobs = sum(1 for _ in r.scan_iter("rq:job:*", count=10_000))
    if rq_jobs:  # each delivery's went as its run ended
        problems.append(f"{rq_jobs} RQ job hashes left for {total} tasks")
    queued = sum(r.llen(q) for q in r.scan_iter("rq:queue:*", count=10_000))
    if queued:
        problems.append(f"{queued} deliveries left in RQ queues")
    return problems


def _redis_cpu(r: redis.Redis) -> float:
    info = r.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def library_of(rev: str, tmp: Path) -> tuple[str, str, bool, bool]:
    """(name, code) of the Lua library as git revision ``rev`` builds it, by its own scripts.library(), and
    how its worker delivered: whether it read each delivery back (HGETALL; before its pop rode in the
    delivery's transaction) and whether its delivery first cleared a resent transaction's copy (two LREMs)."""
    root = revision_tree(rev, tmp / f"rev-{rev}")
    broker_py = next((root / p for p in ("gpumesh/store/broker.py", "gpumesh/broker.py") if (root / p).exists()), None)
    source = broker_py.read_text() if broker_py else ""
    read_back = "take: bool" not in source
    guarded = "p.lrem(queue.intermediate_queue_key" in source
    code = (
        "import json, sys\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f)]\n"  # not this checkout's
        "sys.path.insert(0, sys.argv[1])\n"
        "from gpumesh.store import scripts\n"
        "assert scripts.__file__.startswith(sys.argv[1]), scripts.__file__\n"
        "print(json.dumps(scripts.library()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(root)], capture_output=True, text=True, check=True)
    name, lua = json.loads(out.stdout)
    return name, lua, read_back, guarded


def measure(
    server: PrivateRedis, args: argparse.Namespace, delivered: bool, lib: tuple[str, str, bool, bool] | None
) -> dict:
    """One run on an emptied Redis: the fleet registered, the jobs submitted, then the clock runs. ``lib``:
    another version's library (name, code) to run the transitions with instead of this checkout's, and how
    its worker delivered (see library_of)."""
    read_back, guarded = (lib[2], lib[3]) if lib else (False, True)
    tmp = server.tmp
    broker = Broker(Settings(url=server.url))
    broker.r.flushall()
    ids = [f"sim-{i}" for i in range(args.workers)]
    register(broker.r, [*ids, "probe"])
    dl = Delivery(broker, guarded=guarded) if delivered else None
    # The simulation sends FCALL only: the library this run calls is loaded over what the last run loaded (two
    # revisions of one protocol name their libraries alike, gpumesh_p<N>; FLUSHALL keeps functions).
    broker.redis.function_load(scripts.library()[1], replace=True)
    run_with = broker.scripts
    if lib:
        broker.redis.function_load(lib[1], replace=True)
        run_with = scripts.Scripts(broker.redis, lib[0])
    per = [args.tasks // args.jobs + (j < args.tasks % args.jobs) for j in range(args.jobs)]
    jobs, at = [], 0
    for n in per:
        payloads = [{"i": at + i, "cost": 1 + (at + i) % 5} for i in range(n)]
        jobs.append(broker.submit("print('{}')", "noop.py", payloads, JobOptions()).job_id)
        at += n
    epoch = broker.r.get(keys.EPOCH) or ""
    go, ready = tmp / f"go-{delivered}", tmp / f"ready-{delivered}"
    probe = subprocess.Popen(
        [sys.executable, "-c", PROBE, server.url, str(go), str(ready), str(int(delivered)), lib[0] if lib else "",
         str(int(read_back))],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    while not ready.exists():
        time.sleep(0.01)
    cpu0 = _redis_cpu(broker.r)
    go.touch()
    sim = simulate(server.url, run_with, ids, args.heartbeat, epoch, dl, read_back=read_back, groups=args.groups)
    cpu = (_redis_cpu(broker.r) - cpu0) / sim["wall"]
    probe_ms = sorted(json.loads(probe.communicate(timeout=60)[0]))
    problems = check(broker.r, jobs, args.tasks, delivered)
    if delivered:  # what the replay writes is a delivery RQ reads as the real one
        tid = keys.task_id(jobs[0], 0)
        with broker.rq.pipeline(transaction=False) as p:
            for cmd in dl.commands_for("probe-check", tid) if dl else []:
                p.execute_command(*cmd)
            p.execute()
        sample = Job.fetch(keys.rq_job_id(tid, 1), connection=broker.rq, serializer=JSONSerializer)
        if sample.func_name != EXECUTOR or list(sample.args) != [tid]:
            problems.append(f"a replayed RQ delivery reads back as {sample.func_name}{sample.args}")
    if sim["bad_pops"]:
        problems.append(f"{sim['bad_pops']} pops found another delivery than the one dispatched")
    if sim["done"] + len(probe_ms) != args.tasks:
        problems.append(f"{sim['done']} + {len(probe_ms)} (probe) completions for {args.tasks} tasks")
    assert not problems, problems
    broker.close()
    return {**sim, "cpu": cpu, "probe_ms": probe_ms, "names": dl.names if dl else []}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=1000)
    ap.add_argument("--tasks", type=int, default=30_000)
    ap.add_argument("--jobs", type=int, default=1, help="the tasks split over this many jobs of equal priority")
    ap.add_argument("--heartbeat", type=float, default=5.0, help="seconds between one worker's heartbeats")
    ap.add_argument(
        "--variants", default="delivery,bare",
        help="delivery: with the RQ enqueue + pop a real worker adds per task; bare: the gpumesh scripts alone",
    )  # fmt: skip
    ap.add_argument(
        "--against", metavar="REV",
        help="also run git revision REV's Lua library (built by its own scripts.library()), alternating with "
        "this checkout's, each --repeat times: medians side by side",
    )  # fmt: skip
    ap.add_argument("--repeat", type=int, default=1, help="runs per variant (and per version with --against)")
    ap.add_argument(
        "--groups",
        type=lambda v: max(1, int(v)),  # at least one group
        default=3,
        help="groups of workers in flight at once, each on its own connection (see above)",
    )
    args = ap.parse_args()
    server = PrivateRedis()
    versions: dict[str, tuple[str, str, bool, bool] | None] = {"this checkout": None}
    results: dict[tuple[str, str], list[dict]] = {}
    try:
        if args.against:
            versions[args.against] = library_of(args.against, server.tmp)
        for v in args.variants.split(","):
            for _ in range(args.repeat):
                for version, lib in versions.items():  # alternating: drift on the machine hits both alike
                    sim = measure(server, args, {"delivery": True, "bare": False}[v], lib)
                    results.setdefault((v, version), []).append(sim)
    finally:
        server.stop()
    rows = []
    for (v, version), sims in results.items():
        sim = sorted(sims, key=lambda x: x["wall"])[(len(sims) - 1) // 2]  # the median run (of two, the faster)
        lat = sim["probe_ms"]
        p50, p99 = statistics.median(lat), lat[min(len(lat) - 1, int(len(lat) * 0.99))]
        what = "dispatch + RQ delivery + complete" if v == "delivery" else "dispatch + complete (no RQ delivery)"
        runs = ", ".join(f"{args.tasks / x['wall']:,.0f}" for x in sims)
        # Redis CPU per task: the median over the runs (each run's own), the steadier figure on a shared machine
        cpu_us = [1e6 * x["cpu"] * x["wall"] / args.tasks for x in sims]
        cpu_cell = f"{statistics.median(cpu_us):.0f}" + (
            f" ({', '.join(f'{c:.0f}' for c in cpu_us)})" if args.repeat > 1 else ""
        )
        rows.append((
            what, *([version] if args.against else []), f"{args.workers:,}", f"{args.jobs}",
            f"{args.tasks:,} in {sim['wall']:.2f} s", f"**{args.tasks / sim['wall']:,.0f}**",
            *([runs] if args.repeat > 1 else []), "≥ 10,000", f"{p50:.2f}", f"{p99:.2f}",
            f"{sim['beats'] / sim['wall']:,.0f}", f"{100 * sim['cpu']:.0f} %",
            cpu_cell,
        ))  # fmt: skip
    body = table(
        ["per task", *(["code"] if args.against else []), "simulated workers", "jobs", "completions (median run)",
         "completions/s", *(["runs, /s"] if args.repeat > 1 else []), "target", "dispatch p50, ms",
         "dispatch p99, ms", "heartbeats/s", "Redis CPU (share of one core)",
         "Redis CPU per task, µs (median of the runs; each run)" if args.repeat > 1 else "Redis CPU per task, µs"],
        rows,
    )  # fmt: skip
    all_sims = [sim for sims in results.values() for sim in sims]
    any_sim = all_sims[0]
    calls = " and ".join(f"{len(sims[0]['probe_ms']):,}" for sims in results.values())
    names = next((sim["names"] for sim in all_sims if sim["names"]), [])
    body += (
        f"\n\nRounds of up to {args.workers:,} workers' next step each ({any_sim['rounds']:,} rounds), {args.groups} groups "
        "of workers in flight at once so that Redis waits as little as may be for the harness: dispatch.lua; "
        + (f"the delivery through an RQ queue, replayed on a list per worker for every version ({', '.join(names)}: "
           "RQ's enqueue, replayed) and RQ's pop "
           "(an LMOVE the worker sends in the delivery's transaction; replayed here as an LPOP in the next round, "
           "without the intermediate list or the LREM of the run's start)"
           + (f"; for {args.against}, whose worker read the RQ job back, HGETALL as well"
              if args.against and (versions[args.against] or ("", "", False))[2] else "")
           + (f"; {args.against}'s delivery without the two LREMs"
              if args.against and not (versions[args.against] or ("", "", False, True))[3] else "")
           + "; " if names else "")
        + "complete.lua; heartbeat.lua when due. The *delivery* row includes the RQ enqueue + pop a "
        "real worker adds per task (Broker.deliver); the *bare* row leaves it out. Neither includes the task itself "
        "or RQ's per-job execution bookkeeping (status, registries, result). Checked at the end of each run: every "
        "task done exactly once (one attempt, one RQ delivery when delivered), the jobs' counters exact, no lease, "
        "pending entry or delivery left. Dispatch latency: the calls of scripts.dispatch made by one real client in "
        "its own process, registered in the same fleet, one call at a time while the fleet ran "
        f"({calls} calls)."
    )  # fmt: skip
    publish(
        "scale", "1,000 simulated workers", body,
        f"python benchmarks/scale.py --workers {args.workers} --tasks {args.tasks} --jobs {args.jobs}"
        f" --heartbeat {args.heartbeat:g} --variants {args.variants}"
        + (f" --groups {args.groups}" if args.groups != 3 else "")
        + (f" --against {args.against}" if args.against else "") + (f" --repeat {args.repeat}" if args.repeat > 1 else ""),
    )  # fmt: skip


if __name__ == "__main__":
    main()
