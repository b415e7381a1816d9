"""User-facing errors: the CLI prints them as one line and exits 2."""


class UsageError(ValueError):
    """Bad input from the user (unknown name, sizes that do not divide, missing file...)."""
