"""How every `bench` command ends on bad input or Ctrl-C (shared by bench, bench.report.summary, bench.grid)."""

from __future__ import annotations

import sys

import click

from bench.core.errors import BenchError


def one_line_errors(invoke, ctx: click.Context):
    """Run a click command's invoke with BenchError (bad input) as one line on stderr and exit
    code 2, and Ctrl-C as the shell's 130 (not click's "Aborted!" and 1)."""
    try:
        return invoke(ctx)
    except BenchError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        click.echo("interrupted: finished work is kept; the same command resumes it", err=True)
        sys.exit(130)


class OneLineCommand(click.Command):
    """A click command that ends bad input with one line and exit 2."""

    def invoke(self, ctx: click.Context):
        return one_line_errors(super().invoke, ctx)


class OneLineGroup(click.Group):
    """A click group that ends bad input with one line and exit 2."""

    def invoke(self, ctx: click.Context):
        return one_line_errors(super().invoke, ctx)
