"""``gpumesh run --local N``: a private broker and N workers on this machine, for one job.

Everything it starts is stopped on the way out, Ctrl-C included; the workers also stop by themselves
if this process dies (they watch their parent).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

from gpumesh.capability import load
from gpumesh.errors import GpumeshError
from gpumesh.server.broker_server import BrokerServer, free_port
from gpumesh.settings import Settings
from gpumesh.store.broker import Broker


class LocalMesh:
    def __init__(self, workers: int, settings: Settings) -> None:
        self.n = workers
        self.settings = settings
        self.tmp = Path(tempfile.mkdtemp(prefix="gpumesh-local-"))
        self.server = BrokerServer(self.tmp / "broker", port=free_port(), persist=False)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.broker: Broker | None = None

    def __enter__(self) -> LocalMesh:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()

    def _start(self) -> None:
        self.server.start()
        settings = self.settings.model_copy(update={"url": self.server.url})
        self.broker = Broker(settings)
        # The local workers share one machine, so one score, which ranks nothing among them: the cached one,
        # else an assumed 1 rather than a benchmark of about 3 s before the first result (`gpumesh worker`
        # measures the machine when it first starts).
        cached = load(settings.cache_dir)
        score = cached.score_gflops if cached is not None else 1.0
        env = {**os.environ, "GPUMESH_URL": self.server.url}
        for i in range(self.n):
            with open(self.tmp / f"worker-{i}.log", "wb") as log:
                self.procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-P",  # the working directory's modules (a csv.py) are not gpumesh's
                            "-m",
                            "gpumesh",
                            "worker",
                            "--name",
                            f"local-{i}",
                            "--score",
                            str(score),
                            "--exit-with-parent",
                            str(os.getpid()),
                        ],
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )  # fmt: skip
                )
        deadline = time.monotonic() + 60
        while len(self.broker.live_scores()) < self.n:
            for i, p in enumerate(self.procs):
                if p.poll() is not None:
                    tail = (self.tmp / f"worker-{i}.log").read_text().strip().splitlines()[-1:] or ["no output"]
                    raise GpumeshError(f"local worker {i} exited at start: {tail[0]}")
            if time.monotonic() > deadline:
                raise GpumeshError("the local workers did not register within 60 s")
            time.sleep(0.05)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        if self.broker is not None:
            self.broker.close()
        self.server.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)
