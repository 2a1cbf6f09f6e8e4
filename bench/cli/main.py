"""The `bench` group: every command, from its group's module."""

from __future__ import annotations

import click

from bench.cli import machine, records, report, run, train
from bench.cli_errors import OneLineGroup


@click.group(cls=OneLineGroup)
def main() -> None:
    """Speculative decoding benchmark harness."""


for command in (run.run, run.list_cmd, train.train, train.features, train.distill, train.ablate, train.ship,
                train.rounds, machine.profile, machine.tune, report.report, records.export, records.check_cmd,
                records.pack_cmd, records.import_cmd):
    main.add_command(command)
