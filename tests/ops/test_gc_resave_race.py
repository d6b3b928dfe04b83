"""GC deleting a trainer checkpoint while a rollback saves the same step again."""

from __future__ import annotations

import pytest

import deck.read.indexed
import tests.ops.test_operations_machine as machine
from tests.ops.test_operations_machine import OperationsMachine


def test_a_save_of_the_step_gc_is_deleting_keeps_its_record(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by ``make fuzz-ops OPS_EXAMPLES=300 FUZZ_SEED=4271791481``: after a rollback to
    step 1, GC (grace 0) planned to delete the abandoned timeline's step 2. Between its re-read
    of step 2's record and the delete, the trainer committed step 2 again, and GC deleted the
    new record: a promised step lost. The record now goes only while it holds the bytes GC
    read (an atomic rename aside on a local disk)."""
    monkeypatch.setattr(deck.read.indexed, "CATALOG_EVERY", 3)
    monkeypatch.setattr(machine, "event", lambda *a, **k: None)
    m = OperationsMachine()
    try:
        m.setup(stride=2, every=None, grace=0.0, policy="budget", skews=(0.0, 0.0, 0.0))
        m.gc_while_others_work(n=6, pick=0, what="resave")
        m.gc_while_others_work(n=23, pick=0, what="save")  # the save lands before the delete
        assert 2 in m.promised
        m.promised_and_restorable_steps_restore_bitwise()
        m.reads_through_the_catalog_see_every_record()
    finally:
        m.teardown()
