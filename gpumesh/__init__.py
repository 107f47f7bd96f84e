"""gpumesh: a compute mesh for data-parallel Python work on machines of uneven strength.

Kept import-light on purpose: the sandbox launcher imports this package once per task.
"""

__version__ = "0.2.0"
