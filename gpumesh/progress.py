"""Progress of a job for the Python API: a widget in a notebook, one self-rewriting line elsewhere.

Never a terminal bar drawn with cursor movements: a notebook shows those as garbage. The CLI has its
own (rich) bar, for terminals only.
"""

from __future__ import annotations

import importlib
import sys
import time
from typing import Any


def in_notebook() -> bool:
    """Whether this runs in a Jupyter kernel (not a terminal IPython, not plain Python)."""
    shell = sys.modules.get("IPython")
    if shell is None:
        return False
    try:
        ip = shell.get_ipython()
    except AttributeError:
        return False
    return ip is not None and "IPKernelApp" in getattr(ip, "config", {})


class Progress:
    """What ``show`` returns: ``update`` with the counts so far, ``close`` at the end."""

    def __init__(self, job_id: str, total: int) -> None:
        self.job_id, self.total = job_id, total
        self.done = self.failed = self.running = 0

    def update(self, done: int | None = None, failed: int | None = None, running: int | None = None) -> None:
        self.done = self.done if done is None else done
        self.failed = self.failed if failed is None else failed
        self.running = self.running if running is None else running
        self.draw()

    def text(self) -> str:
        parts = [f"{self.done}/{self.total} done"]
        if self.failed:
            parts.append(f"{self.failed} failed")
        if self.running:
            parts.append(f"{self.running} running")
        return f"job {self.job_id}: " + ", ".join(parts)

    def draw(self) -> None:
        pass

    def close(self) -> None:
        pass


class _Line(Progress):
    """One line on stderr, rewritten in place with a carriage return (which notebooks and terminals both
    honour); off a terminal, a new line only when the counts change, at most every 5 s."""

    def __init__(self, job_id: str, total: int) -> None:
        super().__init__(job_id, total)
        self.rewrite = sys.stderr.isatty() or in_notebook()
        self.last, self.last_at = "", 0.0

    def draw(self) -> None:
        line = self.text()
        if line == self.last:
            return
        now = time.monotonic()
        if self.rewrite:
            sys.stderr.write("\r" + line.ljust(len(self.last)))
        elif now - self.last_at >= 5 or self.done + self.failed >= self.total:
            sys.stderr.write(line + "\n")
        else:
            return
        sys.stderr.flush()
        self.last, self.last_at = line, now

    def close(self) -> None:
        if self.rewrite and self.last:
            sys.stderr.write("\n")
            sys.stderr.flush()


class _Widget(Progress):
    def __init__(self, job_id: str, total: int, widgets: Any) -> None:
        super().__init__(job_id, total)
        display = importlib.import_module("IPython.display").display
        self.bar = widgets.IntProgress(value=0, min=0, max=max(total, 1), bar_style="info")
        self.label = widgets.Label(self.text())
        display(widgets.HBox([self.bar, self.label]))

    def draw(self) -> None:
        self.bar.value = self.done
        self.label.value = self.text()
        if self.failed:
            self.bar.bar_style = "danger"

    def close(self) -> None:
        if not self.failed and self.done >= self.total:
            self.bar.bar_style = "success"


def show(job_id: str, total: int, wanted: bool | None) -> Progress:
    """A progress display for a job: ``wanted`` True shows one, False none, None one when in a notebook or
    on a terminal. A notebook with ipywidgets gets a widget, anything else one line."""
    if wanted is None:
        wanted = in_notebook() or sys.stderr.isatty()
    if not wanted:
        return Progress(job_id, total)
    if in_notebook():
        try:
            widgets = importlib.import_module("ipywidgets")
        except ImportError:
            pass
        else:
            return _Widget(job_id, total, widgets)
    return _Line(job_id, total)
