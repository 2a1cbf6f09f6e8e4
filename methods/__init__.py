"""Drafting methods: one module or package each, holding only what is unique to the method.

A method builds a Drafter (it proposes a Draft each round and learns from the verified
round) for bench.core.decode's one loop; the harness finds it through bench.registry.
"""

from pathlib import Path

from bench.core.drafters import add_shipped_root
from bench.training import distill

add_shipped_root(Path(__file__).parent / "checkpoints")  # the drafters shipped for the default target
distill.add_shipped_root(Path(__file__).parent / "distilled")  # their self-distilled training data
