"""The error types the CLI turns into one line on stderr, each with its exit code."""

from __future__ import annotations


class InputError(ValueError):
    """Bad input from the user: the CLI prints its message as one line and exits with code 2.

    Raised before anything heavy is loaded or anything is written, wherever the check allows.
    """


class OutputError(InputError):
    """An output file could not be written (a full disk, a read-only or special filesystem), found
    only when it was written: exit code 2, as for a bad path. No partial file is left behind."""


class RunError(RuntimeError):
    """A run that could not finish for a reason the user can act on (out of host memory): the CLI
    prints its message as one line and exits with code 1."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its class name if the message is empty)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
