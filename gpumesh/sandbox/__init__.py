"""The sandbox that runs one attempt of a task.

Outside (the worker's side): ``runner`` (an attempt's life), ``spares`` (fresh mode's interpreters started ahead)
and ``warm`` (the zygote).
Inside: ``launcher``, the only code that runs in the task's process; standard library only.

Kept empty on purpose: ``python -m gpumesh.sandbox.launcher`` imports this package once per task.
"""
