"""The click group every gpumesh command runs under: one line and an exit code for every gpumesh error,
130 for Ctrl-C, a traceback only with --debug. Import-light on purpose (no redis, rich or pydantic): ``gpumesh --help``
loads only this, click and the command table in ``main``."""

from __future__ import annotations

import sys
from typing import Any, NoReturn

import click

from gpumesh.errors import GpumeshError


class Group(click.Group):
    """Turns every gpumesh error into one line and its exit code; a traceback only with --debug."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        from gpumesh.cli.argv import hide_password

        hide_password()  # a worker re-executes itself with its broker password off its command line
        return super().main(*args, **kwargs)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except GpumeshError as exc:
            self._die(ctx, exc, exc.exit_code)
        except KeyboardInterrupt:  # click would print "Aborted!" and exit 1, the code of a failed job
            self._interrupted(ctx)
        except click.Abort as exc:
            if not isinstance(exc.__context__, KeyboardInterrupt):  # a prompt that met the end of its input
                raise
            self._interrupted(ctx)  # Ctrl-C at a prompt
        except Exception as exc:
            redis = sys.modules.get("redis")  # a command that talks to Redis has imported it
            if redis is None or not isinstance(exc, redis.RedisError):
                raise
            from gpumesh.store.connection import translate

            self._die(ctx, translate(exc, (ctx.obj or {}).get("url", "")), 3)

    @staticmethod
    def _interrupted(ctx: click.Context) -> NoReturn:
        if (ctx.obj or {}).get("debug"):
            import traceback

            traceback.print_exc()
        click.echo("interrupted", err=True)
        ctx.exit(130)

    @staticmethod
    def _die(ctx: click.Context, exc: Exception, code: int) -> None:
        if (ctx.obj or {}).get("debug"):
            raise exc
        click.echo(f"error: {exc}", err=True)
        ctx.exit(code)
