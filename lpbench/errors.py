"""User-facing errors: the CLI prints them as one line and exits 2."""


class UsageError(ValueError):
    """Bad input from the user (unknown name, sizes that do not divide, missing file...)."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (kill, scancel, a timeout): ends a command as Ctrl-C does; the CLI says which it was."""


def raise_terminated(signum, frame):
    """A SIGTERM handler."""
    raise Terminated
