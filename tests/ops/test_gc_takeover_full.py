"""GC deleting a merger full whose steps a damaged trainer full would take over."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import tests.ops.test_operations_machine as machine
from deck.read.catalog import read_manifests
from deck.read.lineage import build_graph
from tests.ops.test_operations_machine import OperationsMachine, _Pick


def _with_a_merger_full(m: OperationsMachine) -> None:
    m.setup(stride=2, every=4, grace=0.0, policy="default")
    m.save_deltas(4, rows=4)
    m.merge(workers=1)


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
        _with_a_merger_full(m)
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


_GC_IN_A_FRESH_PROCESS = """
import json, sys
import deck.ops.retention.gc as gc
from deck.ops.retention.plan import RetentionPolicy
from deck.storage import open_storage

checked = []
real = gc.verify_checkpoint
gc.verify_checkpoint = lambda storage, m, **kw: checked.append(m.id) or real(storage, m, **kw)
report = gc.collect_garbage(
    open_storage(sys.argv[1]), RetentionPolicy(grace_s=0.0, max_clock_skew_s=900.0), dry_run=True
)
print(json.dumps({
    "deleted": [folder for folder, _ in report.deleted],
    "checked": checked,
    "loaded": sorted(m for m in ("torch", "numpy") if m in sys.modules),
}))
"""


def test_gc_checks_what_takes_over_without_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """GC reads the trainer checkpoints that take over a deleted merger full's steps with their
    checksums (what storage can damage), not decoded: a `deck gc` run does not load torch
    (whose import was most of a run's time)."""
    monkeypatch.setattr(machine, "event", lambda *a, **k: None)
    m = OperationsMachine()
    try:
        _with_a_merger_full(m)
        m.save_full()
        m.save_full()
        out = subprocess.run(
            [sys.executable, "-c", _GC_IN_A_FRESH_PROCESS, m.store.uri],
            capture_output=True,
            text=True,
            check=True,
        )
        got = json.loads(out.stdout.strip().splitlines()[-1])
        assert any(f.startswith("merged/F-") for f in got["deleted"]), got
        assert got["checked"], got  # what takes over was read with its checksums
        assert got["loaded"] == [], got
    finally:
        m.teardown()
