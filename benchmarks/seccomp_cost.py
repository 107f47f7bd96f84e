"""What the task's seccomp filter costs: forked children that set no_new_privs, make N getppid calls and exit,
with the filter and without, side by side (medians of 200, two rounds).

    python benchmarks/seccomp_cost.py 20000
"""

from __future__ import annotations

import os
import statistics
import sys
import time

from gpumesh.sandbox import launcher


def child(install: bool, calls: int) -> float:
    libc = launcher._syscall()[1]
    t = time.perf_counter_ns()
    pid = os.fork()
    if pid == 0:
        libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
        if install:
            launcher.install_seccomp(libc)
        for _ in range(calls):
            os.getppid()
        os._exit(0)
    os.waitpid(pid, 0)
    return (time.perf_counter_ns() - t) / 1e6


def main() -> None:
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
    launcher.prepare_seccomp()
    for _ in range(2):
        for install in (False, True):
            median = statistics.median(child(install, calls) for _ in range(200))
            print(f"filter={install}: median {median:.3f} ms (fork, {calls} getppid, exit)")


if __name__ == "__main__":
    main()
