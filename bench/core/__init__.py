"""The core: target engine, drafts, verification, the decode loop, drafter I/O, the cost model.
Training, which builds on it, is its own room beside it (bench/training/)."""
