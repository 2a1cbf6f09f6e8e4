"""One error type for bad input: the CLI prints its message on one line and exits 2."""


class BenchError(Exception):
    """A user-facing error: bad input, missing data, mismatched files. Never a bug."""
