"""GC deleting a merger full whose steps a damaged trainer full would take over."""

from __future__ import annotations

import pytest

import tests.ops.test_operations_machine as machine
from deck.read.catalog import read_manifests
from deck.read.lineage import build_graph
from tests.ops.test_operations_machine import OperationsMachine, _Pick


def test_a_damaged_trainer_full_never_takes_over_from_a_deleted_merger_full(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by ``make fuzz-ops OPS_EXAMPLES=300 FUZZ_SEED=4271791481``: a merger full at a
    step whose only intact chain it was; once two newer fulls pushed it out of the kept fulls,
    GC deleted it and let the trainer full at step 0 take over, whose flipped byte it never
    read (its check of what takes over read trainer deltas whole, not fulls)."""
    monkeypatch.setattr(machine, "event", lambda *a, **k: None)
    m = OperationsMachine()
    try:
        m.setup(stride=2, every=4, grace=0.0, policy="default")
        m.save_deltas(4, rows=4)
        m.merge(workers=1)
        graph = build_graph(read_manifests(m.store))
        assert any(n.merged and n.kind.value == "full" for n in graph.nodes.values())
        m.damage_a_file(_Pick(lambda c: c[0].startswith("step-000000000000/")), how="flip")
        promised = set(m.promised)
        assert promised  # through the merger full only
        m.save_full()
        m.save_full()
        m.gc()
        m.promised_and_restorable_steps_restore_bitwise()
        assert promised <= set(m.promised)
    finally:
        m.teardown()
