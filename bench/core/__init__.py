"""The core: target engine, drafts, verification, the decode loop, drafter I/O, training, the cost model."""
