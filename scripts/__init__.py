"""Scripts outside the harness: GPU checks, comparisons with other implementations, experiments."""
