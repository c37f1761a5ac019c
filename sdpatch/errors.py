"""The one error type for bad user input."""

from __future__ import annotations


class InputError(ValueError):
    """Bad input from the user: the CLI prints its message as one line and exits with code 2.

    Raised before anything heavy is loaded or anything is written, wherever the check allows.
    """


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its class name if the message is empty)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
