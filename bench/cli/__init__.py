"""The `bench` command line: one module per command group, gathered in main.py.

run.py      bench run, bench list
train.py    bench train, features, distill, ablate, ship, rounds
machine.py  bench profile, tune
report.py   bench report
records.py  bench check, pack, import, export
"""

from bench.cli.main import main

__all__ = ["main"]
