"""How every command reports a user's mistake: the message alone on stderr, exit code 2."""

from __future__ import annotations

from typing import IO, Any

import click

from keras_sync.errors import KerasSyncError

#: Every command: -h as --help, defaults shown.
CONTEXT = {"help_option_names": ["-h", "--help"], "show_default": True}
#: A command that runs SCRIPT [ARGS...]: the options after SCRIPT are the script's.
SCRIPT_CONTEXT = {**CONTEXT, "ignore_unknown_options": True, "allow_interspersed_args": False}


class UserError(click.ClickException):
    """A user's mistake on its way to the terminal: printed as is (no 'Error:' prefix), exit 2."""

    exit_code = 2

    def show(self, file: IO[Any] | None = None) -> None:
        click.echo(self.format_message(), err=True, file=file)


class SyncGroup(click.Group):
    """A click group that turns `KerasSyncError` into `UserError` (never a traceback)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KerasSyncError as exc:
            raise UserError(str(exc)) from None
