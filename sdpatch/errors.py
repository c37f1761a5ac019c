"""The one error type for bad user input."""

from __future__ import annotations


class InputError(ValueError):
    """Bad input from the user: the CLI prints its message as one line and exits with code 2.

    Raised before anything heavy is loaded or anything is written, wherever the check allows.
    """
