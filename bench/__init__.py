"""Speculative decoding benchmark harness."""

import os

# OpenMP workers spin between parallel regions instead of sleeping: a CPU decode step enters
# several regions per layer, and waking a sleeping worker at each one is a measurable part of
# a multi-threaded step (its A/B is under results/<target>/profile/; the script: results/ARCHIVE.md).
# llama.cpp's thread pool spins for the same reason. It acts only where torch has not loaded
# libgomp yet (the CLI and `python -m bench...`); a policy already set wins.
os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")
