"""The one undo mechanism: each change sdpatch makes to a pipeline or a model is recorded on it,
under the name of what made it, with how to take it back.

tomesd's ``apply``/``remove`` is the model: applying again takes the earlier change out first, and
removing runs the recorded steps, last first, so that the object is as it was. The patcher
(:func:`sdpatch.patch_unet`), the planner's levers (:func:`sdpatch.planner.apply_plan`), CUDA-graph
capture (:func:`sdpatch.graphs.capture`) and the comparison report's backend switches record theirs
here. A step is any callable; where the changed object must stay picklable and copyable (a patched
model), make it a ``functools.partial`` of a module-level function: pickle and ``copy.deepcopy``
carry it, and a copy's undo then acts on the copy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_UNDO = "_sdpatch_undo"  # on the changed object: {what changed it: [steps, in the order made]}
_CLASS = object()  # marks an attribute that came from the class (a module's ``forward``)


def record(target: Any, kind: str, step: Callable[[], None]) -> None:
    """Remember ``step`` as what takes one of ``kind``'s changes to ``target`` back."""
    steps = target.__dict__.setdefault(_UNDO, {})
    steps.setdefault(kind, []).append(step)


def applied(target: Any, kind: str) -> bool:
    """Whether ``kind`` has changes recorded on ``target``."""
    return bool(target.__dict__.get(_UNDO, {}).get(kind))


def undo(target: Any, kind: str) -> bool:
    """Take ``kind``'s changes to ``target`` back, last first; whether there were any."""
    steps = target.__dict__.get(_UNDO, {}).pop(kind, [])
    for step in reversed(steps):
        step()
    if not target.__dict__.get(_UNDO, True):
        del target.__dict__[_UNDO]
    return bool(steps)


def attributes(pairs: list[tuple[Any, str]]) -> Callable[[], None]:
    """A step that puts each (object, attribute) back as it is now: its value, or, for an attribute
    only the class defines, no instance attribute at all."""
    saved = [(obj, name, obj.__dict__.get(name, _CLASS)) for obj, name in pairs]

    def restore() -> None:
        for obj, name, value in saved:
            if value is _CLASS:
                obj.__dict__.pop(name, None)
            else:
                setattr(obj, name, value)

    return restore
