"""One progress line for a whole run, on stderr: ``sdpatch generate`` from the model's build
through each image's steps and decode, ``sdpatch compare`` over its cells.

It replaces diffusers' own bar of the denoising loop, which starts only once the model is built
and the prompt encoded. It is drawn only where stderr is a terminal; in a pipe, a log file or a
test it draws nothing, and :meth:`Progress.write` is a plain line on stdout.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

_STEPS = "{desc}: {n_fmt}/{total_fmt} |{bar}| {elapsed}<{remaining}, {rate_fmt}"
_UNTIMED = "{desc}… {elapsed}"
TICK_S = 0.5  # how often the line is redrawn between updates: a phase without steps shows its time


class Progress:
    """A run's progress line: one phase at a time, each with a label and, if it has steps, a bar.

    ``context`` holds labels that precede the phase's (``{"image": "image 2/4"}``), set by the
    code that loops over images or prompts.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled and sys.stderr.isatty()
        self.context: dict[str, str] = {}
        self._bar: Any = None
        self._stop = threading.Event()

    @classmethod
    def of(cls, progress: Progress | bool) -> Progress:
        """``progress`` itself, or a new one for True (drawn on a terminal) or False (never drawn)."""
        return progress if isinstance(progress, Progress) else cls(progress)

    def phase(self, label: str, total: int | None = None) -> None:
        """Begin a phase: ``label`` with a bar of ``total`` steps, or its time alone for None."""
        if not self.enabled:
            return
        fmt, desc = _STEPS if total else _UNTIMED, self._label(label)
        if self._bar is None:
            from tqdm import tqdm  # diffusers and huggingface_hub depend on it

            self._bar = tqdm(desc=desc, total=total, file=sys.stderr, dynamic_ncols=True, leave=False, bar_format=fmt)
            self._stop = threading.Event()
            ticker = threading.Thread(target=self._tick, args=(self._bar, self._stop), name="sdpatch-progress")
            ticker.daemon = True
            ticker.start()
        else:
            self._bar.bar_format = fmt
            self._bar.set_description_str(desc, refresh=False)
            self._bar.reset(total=total)

    def describe(self, label: str) -> None:
        """Relabel the current phase, keeping its count."""
        if self._bar is not None:
            self._bar.set_description_str(self._label(label))

    def _label(self, label: str) -> str:
        return " · ".join([*self.context.values(), label])

    def advance(self, steps: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(steps)

    def write(self, line: str) -> None:
        """Print ``line`` on stdout, above the progress line."""
        if self._bar is not None:
            self._bar.write(line, file=sys.stdout)
        else:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

    def close(self) -> None:
        """Take the progress line off the terminal."""
        if self._bar is not None:
            self._stop.set()
            self._bar.close()
            self._bar = None

    @staticmethod
    def _tick(bar: Any, stop: threading.Event) -> None:
        # A model's build or a VAE decode can take half a minute with no update to draw.
        while not stop.wait(TICK_S):
            bar.refresh()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
