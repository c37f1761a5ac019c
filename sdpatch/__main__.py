"""``python -m sdpatch``: the same as the ``sdpatch`` command."""

from sdpatch.cli import main

main()
