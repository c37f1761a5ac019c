"""``python -m sdpatch.compare DIR``: draw a report's markdown and figures again from its report.json."""

import sys
from pathlib import Path

from sdpatch.compare.figures import redraw
from sdpatch.errors import InputError


def _redraw_main(argv: list[str]) -> int:
    """``python -m sdpatch.compare DIR``, with the exit codes of the ``sdpatch`` command."""
    if len(argv) != 1:
        print("usage: python -m sdpatch.compare DIR   (redraw DIR's report.md and figures)", file=sys.stderr)
        return 2
    try:
        done = redraw(Path(argv[0]))
    except InputError as err:
        print(f"sdpatch: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {done.out_dir}: report.json, report.md, " + ", ".join(f for f in (done.chart, done.grid) if f))
    return 0


if __name__ == "__main__":
    sys.exit(_redraw_main(sys.argv[1:]))
