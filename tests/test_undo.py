"""sdpatch's one undo mechanism (sdpatch.undo): steps recorded per kind, taken back last first."""

from __future__ import annotations

import torch

from sdpatch import undo


def test_steps_are_taken_back_last_first_and_per_kind():
    target = torch.nn.Linear(2, 2)
    done = []
    undo.record(target, "a", lambda: done.append("a1"))
    undo.record(target, "a", lambda: done.append("a2"))
    undo.record(target, "b", lambda: done.append("b1"))
    assert undo.applied(target, "a") and undo.applied(target, "b")
    assert undo.undo(target, "a") and done == ["a2", "a1"]
    assert not undo.applied(target, "a") and undo.applied(target, "b")
    assert not undo.undo(target, "a")  # twice: nothing left
    undo.undo(target, "b")
    assert done == ["a2", "a1", "b1"] and "_sdpatch_undo" not in vars(target)


def test_attributes_restore_values_and_leave_class_attributes_to_the_class():
    target = torch.nn.Linear(2, 2)
    step = undo.attributes([(target, "forward"), (target, "in_features")])
    target.forward = lambda x: x
    target.in_features = 7
    step()
    assert "forward" not in vars(target) and target.in_features == 2
    x = torch.ones(1, 2)
    assert torch.equal(target(x), torch.nn.functional.linear(x, target.weight, target.bias))
