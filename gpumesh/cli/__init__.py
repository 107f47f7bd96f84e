"""The ``gpumesh`` command (Click): one module per command group, the shared options in ``helpers``.

``main`` assembles the commands; the modules that define them do not import it, so nothing here
depends on import order.
"""

from gpumesh.cli.main import main

__all__ = ["main"]
