"""The sandbox that runs one attempt of a task.

Outside (the worker's side): ``runner`` (fresh interpreters and spares) and ``warm`` (the zygote).
Inside: ``launcher``, the only code that runs in the task's process; standard library only.

Kept empty on purpose: ``python -m gpumesh.sandbox.launcher`` imports this package once per task.
"""
