"""The Python API: what a program or a notebook uses, and what the CLI is a thin layer over.

    >>> import gpumesh
    >>> def square(payload):
    ...     return payload["x"] ** 2
    >>> with gpumesh.connect() as mesh:                                   # doctest: +SKIP
    ...     print(mesh.map(square, [{"x": 1}, {"x": 2}, {"x": 3}]))        # a function, shipped as source
    ...     job = mesh.submit("examples/grid_search.py", [{"lr": 0.1, "epochs": 50}])   # or a script
    ...     for res in job.as_completed():                                  # results as tasks end
    ...         print(res.index, res.result)
    [1, 4, 9]
    0 {'lr': 0.1, 'epochs': 50, 'loss': 0.0102, 'w': 2.98, 'b': -1.99}

Every input is checked before anything is written (the same checks as the CLI) and every error is a
:class:`gpumesh.GpumeshError` subclass. Payloads and results are JSON, never pickles.
"""

from __future__ import annotations

import functools
import math
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import redis
from pydantic import ValidationError

from gpumesh import progress as _progress
from gpumesh.errors import BrokerUnreachable, TaskFailed, UsageError
from gpumesh.models import (
    DEFAULT_RETRY_ON,
    TERMINAL,
    Attempt,
    JobOptions,
    JobStatus,
    ProjectSent,
    SubmitResult,
    TaskResult,
    TierLoad,
    WorkerInfo,
    check_payloads,
    check_script,
    failure_kind,
)  # fmt: skip
from gpumesh.settings import Settings
from gpumesh.store.broker import Broker

if TYPE_CHECKING:
    from gpumesh.envs.lock import Lock
    from gpumesh.project import Packed

T = TypeVar("T")
Script = str | Path | Callable[..., Any]
FAILURE_SCAN = 10_000  # tasks read to find failed ones when the job's list of failures cannot tell
SIGNED_FOR = 7 * 86400.0  # s a signed job stays valid unless ``expires`` says otherwise
SIGNED_AT_MOST = 365 * 86400.0  # the longest ``expires``, a year, as the longest --timeout


def check_expires(expires: float, name: str = "expires") -> float:
    """``expires`` if it is a finite number of seconds from 1 to a year; a UsageError naming ``name`` otherwise."""
    if not isinstance(expires, (int, float)) or not math.isfinite(expires) or not 1 <= expires <= SIGNED_AT_MOST:
        raise UsageError(f"{name}: must be a finite number of seconds from 1 to a year (31536000), got {expires}")
    return float(expires)


def connect(url: str | None = None) -> Mesh:
    """Connect to a mesh's broker, with the CLI's settings layering: ``url``, then ``$GPUMESH_URL``,
    then the config file (``gpumesh config init``), then ``redis://127.0.0.1:6379/0``.

    Raises :class:`gpumesh.BrokerError` when the broker cannot be reached or refuses the password, and
    :class:`gpumesh.UsageError` for a malformed URL. Use it as a context manager to close the connection.

    >>> url = "redis://submitter:PASSWORD@10.0.0.5:6390/0"    # the submitter URL `gpumesh serve` printed
    >>> with gpumesh.connect(url) as mesh:                      # doctest: +SKIP
    ...     print(len(mesh.workers()), "workers")
    3 workers
    """
    return Mesh(Broker(Settings.load(url=url), retries=1, health_check=False).ping(say=_say))


def job_options(
    *,
    name: str | None = None,
    timeout: float | None = None,
    max_attempts: int = 3,
    priority: int = 0,
    requires: Iterable[str] = (),
    speculate: bool | None = None,
    retry_on: str | Iterable[str] | None = None,
    reuse_process: bool = False,
    outputs: Iterable[str] = (),
    preload: str | Iterable[str] = (),
    flag: Callable[[str], str] = lambda field: field,
) -> JobOptions:
    """Checked :class:`JobOptions`; a UsageError names the bad option as ``flag(field)`` says (the CLI
    names its --flags, the API its keyword arguments)."""
    if isinstance(requires, str):
        requires = [requires]
    try:
        return JobOptions(
            name=name or "",
            timeout=3600 if timeout is None else timeout,
            max_attempts=max_attempts,
            priority=priority,
            requires=tuple(requires),
            speculate=True if speculate is None else speculate,
            retry_on=DEFAULT_RETRY_ON if retry_on is None else _kinds(retry_on),
            reuse_process=reuse_process,
            outputs=(outputs,) if isinstance(outputs, str) else tuple(outputs),
            preload=tuple(preload.split(",")) if isinstance(preload, str) else tuple(preload),
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        raise UsageError(f"{flag(str(first['loc'][0]))}: {first['msg'].removeprefix('Value error, ')}") from None


def pack_project(
    script: Script, script_name: str, project: str | Path, include: Iterable[str], settings: Settings
) -> tuple[Packed, str]:
    """(the packed folder, the script's name as the worker runs it): a script file's path inside the folder;
    a function's entry script keeps its own name, and the function's module file must lie in the folder.
    UsageError for a script (or function) outside the folder."""
    from gpumesh.project import check_inside, pack

    include = [include] if isinstance(include, str) else list(include)
    if callable(script) and not isinstance(script, (str, Path)):
        module_file = getattr(getattr(script, "__code__", None), "co_filename", "")
        if not module_file or not Path(module_file).is_file():
            raise UsageError(
                f"project={project}: function {getattr(script, '__name__', script)}() is not defined in a file of the "
                "folder (a notebook cell's function ships alone: leave project out)"
            )
        check_inside(Path(project).expanduser().resolve(), module_file)
        return pack(project, None, include, settings.project_max_mb, settings.project_max_files), script_name
    if isinstance(script, str) and "\n" in script:
        raise UsageError(f"project={project}: give the script as a path inside the folder, not as source text")
    packed = pack(project, script, include, settings.project_max_mb, settings.project_max_files)
    return packed, packed.script


MAX_SIBLINGS = 200


def siblings_of(script: Script) -> tuple[str, ...]:
    """The modules and packages beside a script file (or a function's module file), which a lone script
    cannot import on a worker: the worker names them when a task fails for want of one."""
    if callable(script) and not isinstance(script, (str, Path)):
        script = getattr(getattr(script, "__code__", None), "co_filename", "") or ""
    if not isinstance(script, Path) and (not isinstance(script, str) or "\n" in script or not script):
        return ()
    path = Path(script)
    try:
        entries = list(path.resolve().parent.iterdir())[:2000]
    except OSError:
        return ()
    names = set()
    for entry in entries:
        if entry.suffix == ".py" and entry.name != path.name and entry.stem.isidentifier():
            names.add(entry.stem)
        elif entry.is_dir() and entry.name.isidentifier() and any(entry.glob("*.py")):
            names.add(entry.name)
    return tuple(sorted(names)[:MAX_SIBLINGS])


def _kinds(retry_on: str | Iterable[str]) -> tuple[str, ...]:
    """``retry_on`` as JobOptions checks it: a comma-separated string or an iterable of kinds."""
    return tuple(retry_on.split(",")) if isinstance(retry_on, str) else tuple(retry_on)


def script_source(script: Script) -> tuple[str, str]:
    """(source, name) of a script given as a path, as Python source text, or as a function (shipped as its
    module's or notebook cell's source, see :mod:`gpumesh.functions`). Checked: it compiles."""
    if callable(script) and not isinstance(script, (str, Path)):
        from gpumesh.functions import package

        return package(script)
    if not isinstance(script, (str, Path)):
        raise UsageError(f"script must be a path, Python source text or a function, got {type(script).__name__}")
    if isinstance(script, Path) or ("\n" not in script and script.endswith(".py")):
        path = Path(script)
        if not path.is_file():
            raise UsageError(f"script {path} does not exist or is not a file")
        try:
            return check_script(path.read_text(), str(path)), path.name
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"cannot read script {path}: {exc}") from None
    return check_script(script, "script.py"), "script.py"


def patient(call: Callable[[], T], settings: Settings, say: Callable[[str], None]) -> Callable[[], T]:
    """``call`` that rides out a broker outage of up to ``settings.outage_patience`` seconds
    (GPUMESH_OUTAGE_PATIENCE): ``say`` tells once when it starts and once when it ends; past the
    patience the outage is the caller's error (BrokerUnreachable). For what follows a job over time."""
    patience = settings.outage_patience

    def wrapped() -> T:
        lost_at: float | None = None
        while True:
            try:
                value = call()
            except (BrokerUnreachable, redis.ConnectionError, redis.TimeoutError) as exc:
                now = time.monotonic()
                if lost_at is None:
                    lost_at = now
                    say(f"broker unreachable ({exc}); waiting up to {patience:g} s for it (Ctrl-C stops)")
                if now - lost_at >= patience:
                    raise
                time.sleep(min(1.0, max(0.0, patience - (now - lost_at))))
                continue
            if lost_at is not None:
                say(f"broker reachable again after {time.monotonic() - lost_at:.0f} s")
            return value

    return wrapped


def _say(line: str) -> None:
    print(f"gpumesh: {line}", file=sys.stderr, flush=True)


class Mesh:
    """A connection to one mesh (made by :func:`gpumesh.connect`). Close it, or use it as a context
    manager, to release its connections.

    >>> with gpumesh.connect() as mesh:                                # doctest: +SKIP
    ...     print([w.name for w in mesh.workers()])
    ['lab-a100', 'gaming-pc']
    """

    def __init__(self, broker: Broker) -> None:
        self.broker = broker

    def __enter__(self) -> Mesh:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<gpumesh.Mesh {self.broker.url_masked}>"

    def close(self) -> None:
        """Close the connections to the broker (what leaving a ``with`` block does).

        >>> mesh = gpumesh.connect(); mesh.close()                   # doctest: +SKIP
        """
        self.broker.close()

    def submit(
        self,
        script: Script,
        payloads: Iterable[dict[str, Any]],
        *,
        name: str | None = None,
        timeout: float | None = None,
        max_attempts: int = 3,
        priority: int = 0,
        requires: Iterable[str] = (),
        speculate: bool | None = None,
        retry_on: str | Iterable[str] | None = None,
        reuse_process: bool = False,
        idempotency_key: str | None = None,
        sign_key: str | Path | None = None,
        expires: float = SIGNED_FOR,
        project: str | Path | None = None,
        include: Iterable[str] = (),
        outputs: Iterable[str] = (),
        dependencies: Iterable[str] = (),
        requirements: str | Path | None = None,
        python: str = "",
        allow_builds: bool = False,
        preload: Iterable[str] = (),
    ) -> Job:
        """Submit a job with one task per payload (a JSON object); returns at once with its :class:`Job`.

        ``script`` is a path to a ``.py`` file, Python source text, or a function defined with ``def`` at
        the top level of a module or a notebook cell (it is called with each payload and its JSON return
        value is the result; see :mod:`gpumesh.functions`). ``timeout`` is seconds per attempt (default
        3600); ``requires`` lists requirements every task has (``"vram_gb>=40"``, ``"device=cuda"``);
        ``retry_on`` the failure kinds retried while attempts remain (:data:`gpumesh.models.RETRY_KINDS`;
        default timeout, memory and lost: a script that fails is not run again unless it names ``"script"``;
        ``"all"`` or ``"none"`` too); ``idempotency_key`` makes a retried submit return the first one's job. ``sign_key`` (default:
        the ``GPUMESH_SIGNING_KEY`` setting) signs every task, valid for ``expires`` seconds.

        ``project`` ships a folder with the job (the script, or the function's module file, lies inside it):
        each task runs in a working directory where the folder's files sit at their paths, the folder first
        on ``sys.path`` (docs/projects.md). ``include`` sends secret-looking files its globs name;
        ``outputs`` globs bring back files the task writes in its working directory, as artifacts.
        ``reuse_process``: load once, run many. On each worker the job's tasks run one after another in one process
        that stays loaded, so what the function's module (or the script) loads at module level, a model or a CUDA
        context, is loaded once per worker; a script must then define ``main(payload)``, called for each task
        (a function is called as always). Tasks of the job see each other's leftovers; other jobs and the host
        stay isolated (docs/reuse.md).

        >>> _MODEL = {}
        >>> def infer(payload):                        # module-level cache: filled by the first task on a worker
        ...     if "net" not in _MODEL:
        ...         _MODEL["net"] = load_model()       # doctest: +SKIP
        ...     return _MODEL["net"](payload["x"])     # doctest: +SKIP
        >>> mesh.map(infer, payloads, reuse_process=True)          # doctest: +SKIP

        ``dependencies`` (requirement strings), ``requirements`` (a requirements.txt or pylock.toml) and
        ``python`` (a requires-python) declare the job's environment, as a script's PEP 723 block does: locked
        here with uv and built once on each worker's machine (docs/environments.md). ``allow_builds`` lets it
        build sdists on workers that allow that too. ``preload``: modules of that environment which a warm worker
        imports once for the job, in a zygote of the job's own confined as its tasks are, so that each task
        starts with them imported (``preload=["numpy", "mylib.model"]``).

        >>> job = mesh.map(fit, [{"c": 1.0}], dependencies=["scikit-learn"])  # doctest: +SKIP
        >>> job = mesh.submit("train.py", [{"lr": 0.1, "cost": 4}], requires=["vram_gb>=40"])  # doctest: +SKIP
        >>> job.id                                                                            # doctest: +SKIP
        'j8f3c2a1b9d0'
        >>> job = mesh.submit("train.py", [{"lr": 0.1}], project=".", outputs=["outputs/*.json"])  # doctest: +SKIP
        """
        source, script_name = script_source(script)
        checked = check_payloads(payloads if isinstance(payloads, list) else list(payloads))
        options = job_options(
            name=name, timeout=timeout, max_attempts=max_attempts, priority=priority, requires=requires,
            speculate=speculate, retry_on=retry_on, reuse_process=reuse_process, outputs=outputs, preload=preload,
        )  # fmt: skip
        packed = None
        from gpumesh.envs import declare, lock

        if isinstance(dependencies, str):
            raise UsageError(f"dependencies must be a list of requirements, such as [{dependencies!r}]")
        env = lock(
            declare(
                source, script_name, dependencies=list(dependencies), requirements=requirements, python=python,
                project=Path(project).expanduser() if project is not None else None, allow_builds=allow_builds,
            ),
            Path(project).expanduser() if project is not None else None,
        )  # fmt: skip
        if project is not None:
            packed, script_name = pack_project(script, script_name, project, include, self.broker.settings)
        return self.submit_checked(
            source, script_name, checked, options, idempotency_key, sign_key, expires, project=packed,
            siblings=siblings_of(script) if packed is None else (), env=env,
        )  # fmt: skip

    def submit_checked(
        self,
        source: str,
        script_name: str,
        payloads: list[dict[str, Any]],
        options: JobOptions,
        idempotency_key: str | None = None,
        sign_key: str | Path | None = None,
        expires: float = SIGNED_FOR,
        project: Packed | None = None,
        siblings: tuple[str, ...] = (),
        env: Lock | None = None,
    ) -> Job:
        """:meth:`submit` for a caller that read the script and built the :class:`JobOptions` itself (the
        CLI does, to name its flags in errors). The rest is checked here, once, into the one request the
        broker sends (gpumesh.store.submit.SubmitRequest); payloads that ``check_payloads`` returned are not
        checked again. ``project``: the folder as :func:`pack_project` packed it.

        >>> job = mesh.submit_checked(source, "train.py", payloads, gpumesh.JobOptions(timeout=60))  # doctest: +SKIP
        """
        from gpumesh.store.submit import SubmitRequest

        expires = check_expires(expires)
        signer = None
        key = sign_key or self.broker.settings.signing_key
        if key:
            from gpumesh.signing import Signer

            signer = Signer(Path(key))
        request = SubmitRequest.checked(
            source, script_name, payloads, options, idempotency_key=idempotency_key, signer=signer, expires_in=expires,
            project=project, siblings=siblings, env=env,
        )  # fmt: skip
        res = self.broker.send(request)
        if env is not None:
            res.env = env.digest
        if project is not None:
            res.project = ProjectSent(
                digest=project.digest, files=len(project.files), bytes=project.total_bytes,
                sent_files=project.sent_files, sent_bytes=project.sent_bytes, summary=project.summary(),
            )  # fmt: skip
        return Job(self, res.job_id, res)

    def submit_file(self, path: str | Path = "gpumesh.toml", **overrides: Any) -> Job:
        """Submit the job a job file describes (``gpumesh.toml``, docs/projects.md); ``overrides`` are
        :meth:`submit`'s keywords and win over the file's.

        >>> job = mesh.submit_file("gpumesh.toml", priority=5)                # doctest: +SKIP
        """
        from gpumesh.jobfile import load

        spec = load(Path(path))
        kwargs = {**spec.submit_kwargs(), **overrides}
        script = kwargs.pop("script")
        payloads = kwargs.pop("payloads")
        return self.submit(script, payloads, **kwargs)

    def map(
        self,
        fn: Script,
        payloads: Iterable[dict[str, Any]],
        *,
        progress: bool | None = None,
        wait_timeout: float | None = None,
        **submit_options: Any,
    ) -> list[Any]:
        """Run ``fn`` on every payload on the mesh and return the results in payload order.

        ``fn`` is usually a function (see :meth:`submit` for what may be shipped); each payload is a JSON
        object passed to it as a dict. ``submit_options`` are :meth:`submit`'s. If a task fails for good,
        the job is cancelled (its other tasks stop) and :class:`gpumesh.TaskFailed` is raised with the
        task's index and the remote exception; Ctrl-C cancels the job too. ``progress`` as in :meth:`Job.wait`.

        >>> def square(p):
        ...     return p["x"] ** 2
        >>> mesh.map(square, [{"x": i} for i in range(4)])       # doctest: +SKIP
        [0, 1, 4, 9]
        """
        job = self.submit(fn, payloads, **submit_options)
        total = job.submitted.tasks if job.submitted else job.status().tasks.total
        out: list[Any] = [None] * total
        bar = _progress.show(job.id, total, progress)
        try:
            for res in job.as_completed(timeout=wait_timeout):
                if res.status != "done":
                    job.cancel(keep_files=True)  # stop the work; what finished stays for job.pull
                    raise job._failure(res)
                out[res.index] = res.result
                bar.update(done=bar.done + 1)
        except (KeyboardInterrupt, TimeoutError):
            job.cancel(keep_files=True)
            raise
        finally:
            bar.close()
        return out

    def job(self, job_id: str) -> Job:
        """A job submitted earlier (by anyone), by id. Raises :class:`gpumesh.NotFound` when the broker has
        no such job (or it has expired).

        >>> mesh.job("j8f3c2a1b9d0").status().status               # doctest: +SKIP
        'done'
        """
        self.broker.job_status(job_id)
        return Job(self, job_id)

    def workers(self) -> list[WorkerInfo]:
        """The live workers, with device, score, tier and what each runs now.

        >>> [(w.name, w.device, w.tier) for w in mesh.workers()]   # doctest: +SKIP
        [('lab-a100', 'cuda', 0), ('laptop', 'cpu', 2)]
        """
        return self.broker.workers()

    def tiers(self) -> list[TierLoad]:
        """Each tier (score band, 0 the weakest): its RQ queue, the workers in it now, how many tasks wait in its
        queue (the next ones, 20 at most) and how many of all the queued tasks the fleet as it is gives it.

        >>> [(t.queue, t.workers, t.waiting, t.queued) for t in mesh.tiers()]   # doctest: +SKIP
        [('gpumesh-tier-0', ['laptop'], 20, 95), ('gpumesh-tier-1', [], 0, 0), ('gpumesh-tier-2', ['lab-a100'], 20, 45)]
        """
        return self.broker.tiers()

    def jobs(self, limit: int = 50) -> list[JobStatus]:
        """Recent jobs, newest first.

        >>> [(j.job_id, j.status) for j in mesh.jobs(limit=2)]     # doctest: +SKIP
        [('j8f3c2a1b9d0', 'running'), ('j0a9b8c7d6e5', 'done')]
        """
        return self.broker.jobs(limit)


class Job:
    """One submitted job. ``job.id`` names it for the CLI too (``gpumesh status ID``).

    >>> job = mesh.submit("train.py", payloads)                 # doctest: +SKIP
    >>> job.wait(progress=True).status                          # doctest: +SKIP
    'done'
    """

    def __init__(self, mesh: Mesh, job_id: str, submitted: SubmitResult | None = None) -> None:
        self.mesh = mesh
        self.id = job_id
        self.submitted = submitted  # what submit answered (tasks, tiers), when this object made the job

    def __repr__(self) -> str:
        return f"<gpumesh.Job {self.id}>"

    def status(self) -> JobStatus:
        """Counts per state, and which queued tasks no live worker may run (``waiting_for``).

        >>> job.status().tasks.done                                  # doctest: +SKIP
        7
        """
        return self.mesh.broker.job_status(self.id, waiting=True)

    def wait(self, timeout: float | None = None, progress: bool | None = None, interval: float = 0.25) -> JobStatus:
        """Block until the job ends (done, failed or cancelled) and return its status; TimeoutError after
        ``timeout`` seconds. Does not raise when the job failed: look at ``status`` (or use ``map``). Woken by
        the end of each task (the job's stream of ends), so it returns as the last task ends; ``interval`` only
        bounds how long the progress shown waits for a task to start (it reads again after 4 × ``interval``).

        ``progress``: True shows it (a widget in a notebook with ipywidgets, else one line on stderr
        that rewrites itself), False never, None (default) when in a notebook or on a terminal. A broker
        outage is ridden out for up to GPUMESH_OUTAGE_PATIENCE seconds.

        >>> job.wait(timeout=600).tasks                             # doctest: +SKIP
        TaskCounts(total=10, queued=0, running=0, done=10, failed=0, cancelled=0)
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        follow = self.mesh.broker.follow(self.id, idle_s=max(interval, 0.05) * 4)
        st = patient(follow, self.mesh.broker.settings, _say)()
        bar = _progress.show(self.id, st.tasks.total, progress)
        try:
            while True:
                bar.update(done=st.tasks.done, failed=st.tasks.failed + st.tasks.cancelled, running=st.tasks.running)
                if st.finished:
                    return st
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"job {self.id} is still {st.status} after {timeout} s")
                # Woken by the end of one of its tasks (the job's stream of ends), not a poll: returns within a
                # round trip of the job's end.
                st = patient(functools.partial(follow, left), self.mesh.broker.settings, _say)()
        finally:
            bar.close()

    def results(self) -> list[TaskResult]:
        """Every task's result in payload order (``result`` is the JSON the script printed last, or the
        function returned; ``error`` says why a failed task failed).

        >>> [r.result for r in job.results()]                       # doctest: +SKIP
        [0.0102, 0.2211]

        Each row says whether its result verifies (``verified``) with the registered result key of the
        worker credential that signed it (``signed_by``); see :func:`gpumesh.signing.verify_result`.
        """
        return list(self.iter_results())

    def iter_results(self) -> Iterator[TaskResult]:
        """The rows of :meth:`results`, read a page at a time as they are consumed: what a job of a million
        tasks is read with (``gpumesh results`` streams them so).

        >>> for row in job.iter_results():                         # doctest: +SKIP
        ...     out.write(json.dumps(row.result) + "\n")
        """
        registry = self._result_keys()
        for row in self.mesh.broker.iter_results(self.id):
            yield row.verify_with(registry)

    def _result_keys(self) -> dict[str, str]:
        """The broker's registry of worker result keys (ACL user -> public key), written by the admin."""
        broker = self.mesh.broker
        try:
            return broker.result_keys()
        except redis.RedisError as exc:
            from gpumesh.store.connection import translate

            raise translate(exc, broker.url) from None

    def as_completed(self, timeout: float | None = None) -> Iterator[TaskResult]:
        """Yield each task's :class:`TaskResult` as it ends (done, failed or cancelled), in the order they
        end, until every task has; the tasks that ended already come first. Reads the job's stream of
        ends (one blocking read waits for the next), not every task. TimeoutError after ``timeout`` s.

        >>> for res in job.as_completed():                          # doctest: +SKIP
        ...     plot(res.index, res.result)
        """
        broker = self.mesh.broker
        deadline = None if timeout is None else time.monotonic() + timeout

        def ride(call: Callable[[], T]) -> T:
            return patient(call, broker.settings, _say)()

        total = ride(lambda: broker.job_status(self.id)).tasks.total
        registry = ride(self._result_keys)
        seen = _Seen(total)  # a bit per task: a job of 1,000,000 tasks holds 125 KB here, not a million ids
        after = "0"  # the last entry read from the stream of ends
        while seen.n < total:
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"job {self.id}: {seen.n} of {total} tasks ended within {timeout} s")
            after, ended = ride(functools.partial(broker.task_ends, self.id, after, block_ms=1000))
            pages: Iterable[list[str]] = [list(dict.fromkeys(ended))]
            finished = False
            if not ended:  # nothing ended for a second: still going? (also what survives a lost stream)
                finished = ride(lambda: broker.job_status(self.id)).finished
                if finished:
                    pages = broker.iter_task_ids(self.id)  # every task not seen yet, a page at a time
            for page in pages:
                fresh = [t for t in page if t not in seen]
                for res in ride(functools.partial(broker.task_results, fresh)):
                    if res.status in TERMINAL:  # a task re-queued since (retry) ends again later
                        seen.add(res.task_id)
                        yield res.verify_with(registry)
            if finished:
                return  # every task that still exists was read once the job had ended

    def logs(self, follow: bool = False, interval: float = 0.5) -> Iterator[tuple[str, str, str]]:
        """The output of every task as (task id, stream, line), stream being stdout, stderr or gpumesh
        (the worker's notes: attempt started, failed). With ``follow``, keeps yielding new lines until
        the job ends.

        >>> for task_id, stream, line in job.logs():                 # doctest: +SKIP
        ...     print(task_id, line)
        """
        return follow_logs(self.mesh.broker, self.id, follow, interval, _say)

    def cancel(self, keep_files: bool = False) -> JobStatus:
        """Cancel: queued tasks never run, running ones are killed within a heartbeat, and the output files
        its done tasks stored are deleted (their memory freed) unless ``keep_files``. Returns the status.

        >>> job.cancel().status                                       # doctest: +SKIP
        'cancelled'
        """
        st = self.mesh.broker.cancel(self.id)
        if not keep_files:
            self.mesh.broker.drop_files(self.id)
        return st

    def retry(self, cancelled: bool = False) -> int:
        """Re-queue the failed tasks (and the cancelled ones with ``cancelled``), each with a fresh set of
        attempts; returns how many were re-queued.

        >>> job.retry()                                              # doctest: +SKIP
        2
        """
        n, _st = self.mesh.broker.retry(self.id, cancelled)
        return n

    def attempts(self) -> list[Attempt]:
        """Every run of the job's tasks, by start: which worker ran which task when, primary or backup copy,
        and how it ended (``done``, ``retried``, ``lost``, ... or ``running``). What the dashboard's timeline
        draws; a job keeps the record of its last 50,000 attempts.

        >>> [(a.index, a.attempt, a.worker, a.outcome) for a in job.attempts()]   # doctest: +SKIP
        [(0, 1, 'w-a100', 'done'), (1, 1, 'w-laptop', 'retried'), (1, 2, 'w-a100', 'done')]
        """
        try:
            return self.mesh.broker.attempts(self.id)
        except redis.RedisError as exc:
            from gpumesh.store.connection import translate

            raise translate(exc, self.mesh.broker.url) from None

    def failures(self, limit: int = 5) -> tuple[list[TaskResult], int]:
        """(the first ``limit`` tasks that failed for good, how many failed in all): what ``status`` and
        ``submit --wait`` print, with ``error_summary`` for each.

        >>> rows, n = job.failures()                                 # doctest: +SKIP
        >>> [gpumesh.models.error_summary(r.status, r.error) for r in rows], n   # doctest: +SKIP
        (['script_error: ZeroDivisionError: division by zero'], 1)
        """
        broker = self.mesh.broker
        ids = broker.failed_task_ids(self.id)
        failed = [res for res in broker.task_results(ids) if res.status == "failed"]
        total = broker.job_status(self.id).tasks.failed
        if len(failed) < min(limit, total):  # failed before its worker kept the list (or re-failed after a retry)
            ids = broker.task_ids(self.id)[:FAILURE_SCAN]
            failed = [res for res in broker.task_results(ids) if res.status == "failed"]
        return failed[:limit], max(total, len(failed))

    def pull(
        self, dest: str | Path, task: str | int | None = None, *, glob: str | None = None, force: bool = False
    ) -> list[Path]:
        """Fetch the files the job's tasks wrote to ``GPUMESH_OUTPUT_DIR`` into ``dest/<task index>/<path>``
        (one task's with ``task``: its index or id; ``glob`` picks paths, e.g. ``"*.pt"``). Checksums are
        verified; a file already there and whole is not fetched again unless ``force``. Returns the paths
        present; a task that did not complete has none (see ``status()``).

        >>> job.pull("runs/sweep")                                   # doctest: +SKIP
        [PosixPath('runs/sweep/0/model.pt'), PosixPath('runs/sweep/1/model.pt')]
        """
        return self.mesh.broker.pull(self.id, Path(dest), task, pattern=glob, force=force).paths

    def _failure(self, res: TaskResult) -> TaskFailed:
        from gpumesh.functions import remote_exception

        kind = res.error_kind or failure_kind(res.status, res.error)
        remote = remote_exception(res.error)
        first = (res.error or res.status).partition("\n")[0]
        exc_type: str | None = None
        message: str | None = None
        tb: str | None = None
        if remote:
            exc_type, message, tb = remote
            summary = f"task {res.index} of job {self.id} raised {exc_type}: {message}"
        elif res.status == "cancelled":
            summary = f"task {res.index} of job {self.id} was cancelled (someone cancelled the job)"
        else:
            summary = f"task {res.index} of job {self.id} failed ({kind}): {first}"
        if res.status == "failed":
            summary += f"; the job was cancelled. Its log: gpumesh logs {res.task_id}"
        return TaskFailed(
            summary, job_id=self.id, index=res.index, task_id=res.task_id, kind=kind, error=res.error or "",
            exc_type=exc_type, message=message, traceback=tb,
        )  # fmt: skip


class _Seen:
    """Which of a job's tasks were yielded already: a bit per task index (its id is ``<job>-<index>``)."""

    def __init__(self, total: int) -> None:
        self.bits = bytearray((total + 7) // 8)
        self.other: set[str] = set()  # an id that is not ``<job>-<index>`` within the total
        self.n = 0

    def _bit(self, task_id: str) -> int | None:
        index = task_id.rpartition("-")[2]
        return int(index) if index.isdigit() and int(index) < len(self.bits) * 8 else None

    def __contains__(self, task_id: object) -> bool:
        if not isinstance(task_id, str):
            return False
        i = self._bit(task_id)
        return task_id in self.other if i is None else bool(self.bits[i >> 3] & (1 << (i & 7)))

    def add(self, task_id: str) -> None:
        if task_id in self:
            return
        i = self._bit(task_id)
        if i is None:
            self.other.add(task_id)
        else:
            self.bits[i >> 3] |= 1 << (i & 7)
        self.n += 1


def follow_logs(
    broker: Broker, target: str, follow: bool, interval: float, say: Callable[[str], None]
) -> Iterator[tuple[str, str, str]]:
    """(task id, stream, line) of a job or a task; with ``follow``, until it ends (riding outages)."""
    cursors: dict[str, str] = {}
    read = patient(lambda: (not follow or broker.target_ended(target), list(broker.logs(target, cursors))),
                   broker.settings, say)  # fmt: skip
    while True:
        ended, lines = read()  # whether it ended is read before the lines: none is missed
        yield from lines
        if ended:
            return
        time.sleep(interval)
