"""How long does the tracker's claim (inside every checkpoint's stall) take, and how does it grow
with the rows per rank? The native kernels against the torch baseline.

A byte map of ``--rows`` rows (one rank's tracked rows: bench_stall's 8 x 1M tables on 2 ranks
is 4M) with ``--dirty`` of them marked for two consumers, as between two checkpoints. Timed:
``deck.kernels.claim.claim_rows`` (the C kernel: a count pass and one take pass) and the torch
code it replaced (``nonzero`` over the masked map, then ``index_put`` clearing the bit), each on a
fresh copy of the same map, ``--repeats`` times; medians and the ratio are printed.

    python benchmarks/bench_claim.py [--rows 4000000] [--dirty 0.02] [--repeats 15]

``--sweep``: the claims the tracker can run, at a fixed ``--dirty-rows`` (80k) for each of
``--sweep-rows`` rows per rank (1M..256M), interleaved, medians of ``--repeats``: the whole-map
kernel (``claim_rows``, the baseline), the block summary (``claim_marked_rows``: the summary, then
only the marked blocks; what a consumer without a journal runs) and the claim from the journal
(``TrackerStore.begin_read``: sort the journaled rows, clear them; what runs normally). Also the
compaction that fills the journal (``TrackerStore.compact`` of the same ids, once per training
step in the real job) with and without journaling. Prints the table, the ratios and the
tracker's memory.

    python benchmarks/bench_claim.py --sweep [--dirty-rows 80000] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from _workload import journal_claim_times
from deck.kernels import native
from deck.kernels.claim import block_count, block_of, claim_marked_rows, claim_rows

from deck.trainer.tracker import TrackerStore


def torch_claim(dirty: torch.Tensor, bit: int) -> torch.Tensor:
    """The baseline: what TrackerStore.begin_read did before the kernel."""
    rows = torch.nonzero(dirty & bit).view(-1)
    dirty.index_put_((rows,), dirty[rows] & (~bit & 0xFF))
    return rows


def _marked(rows: int, dirty: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A map with ``dirty`` random rows marked for two consumers, and its block summary."""
    g = torch.Generator().manual_seed(rows)
    base = torch.zeros(rows, dtype=torch.uint8)
    ids = torch.randint(0, rows, (dirty,), generator=g)
    base[ids] = 3
    blocks = torch.zeros(block_count(rows), dtype=torch.uint8)
    blocks[block_of(ids)] = 3
    return base, blocks


def _compactions(rows: int, dirty: int, repeats: int) -> tuple[float, float]:
    """Median seconds of compacting ``dirty`` random ids into a fresh tracker with journaling
    (``mark_rows``) and without (torch ``index_fill_``, no native kernel)."""
    ids = torch.randint(0, rows, (dirty,), generator=torch.Generator().manual_seed(rows))
    times: dict[bool, list[float]] = {True: [], False: []}
    saved = native._native
    for journaling in (True, False) * repeats:
        native._native = saved if journaling else None
        fresh = TrackerStore(rows, ("a", "b"))
        native._native = saved
        fresh.record(ids)
        t0 = time.perf_counter()
        fresh.compact()
        times[journaling].append(time.perf_counter() - t0)
        del fresh
    return statistics.median(times[True]), statistics.median(times[False])


def sweep(sizes: list[int], dirty: int, repeats: int) -> int:
    """Journal claim vs summary claim vs whole-map claim at a fixed delta, for each map size."""
    print(f"{dirty} rows marked, median of {repeats} (ms):")
    print(
        "| rows per rank | rows claimed | whole-map claim_rows | summary claim_marked_rows |"
        " journal claim (begin_read) | journal vs whole-map | compact with / without journal"
        " | tracker bytes/row |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for rows in sizes:
        base, blocks = _marked(rows, min(dirty, rows))
        whole: list[float] = []
        summary: list[float] = []
        for _ in range(repeats):  # interleaved: both see the same machine state
            m, b = base.clone(), blocks.clone()
            t0 = time.perf_counter()
            got = claim_marked_rows(m, b, 1)
            summary.append(time.perf_counter() - t0)
            m2 = base.clone()
            t0 = time.perf_counter()
            want = claim_rows(m2, 1)
            whole.append(time.perf_counter() - t0)
            assert torch.equal(got, want) and torch.equal(m, m2) and not bool((b & 1).any())
        w, s = statistics.median(whole), statistics.median(summary)
        claims, n, held = journal_claim_times(rows, min(dirty, rows), repeats)
        j = statistics.median(claims)
        cj, cp = _compactions(rows, min(dirty, rows), min(3, repeats))
        per_row = held / rows  # map + summary + journals (two consumers) with the delta pending
        print(
            f"| {rows:,} | {got.numel():,} ({n:,}) | {w * 1e3:.3f} | {s * 1e3:.3f} | {j * 1e3:.3f}"
            f" | {w / j:.1f}x | {cj * 1e3:.2f} / {cp * 1e3:.2f} | {per_row:.4f} |"
        )
        del base, blocks, m, b, m2
    print("reproduce: " + " ".join([sys.executable, *sys.argv]))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=4_000_000)
    p.add_argument("--dirty", type=float, default=0.02, help="fraction of rows marked")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--sweep", action="store_true", help="summary claim vs whole-map, per size")
    p.add_argument("--dirty-rows", type=int, default=80_000, help="rows marked (--sweep)")
    p.add_argument(
        "--sweep-rows", type=int, nargs="+", default=[1 << 20, 1 << 22, 1 << 24, 1 << 26, 1 << 28]
    )
    a = p.parse_args(argv)
    if not native.native_available():
        print("the C kernel is not built: nothing to compare")
        return 1
    torch.set_num_threads(1)
    if a.sweep:
        return sweep(a.sweep_rows, a.dirty_rows, a.repeats)
    g = torch.Generator().manual_seed(0)
    base = torch.zeros(a.rows, dtype=torch.uint8)
    base[torch.randint(0, a.rows, (int(a.rows * a.dirty),), generator=g)] = 3
    times: dict[str, list[float]] = {"deck claim_rows": [], "torch nonzero + index_put": []}
    fns = {"deck claim_rows": claim_rows, "torch nonzero + index_put": torch_claim}
    for _ in range(a.repeats):
        for name, fn in fns.items():  # interleaved: both see the same machine state
            m = base.clone()
            t0 = time.perf_counter()
            rows = fn(m, 1)
            times[name].append(time.perf_counter() - t0)
    check_a, check_b = base.clone(), base.clone()
    assert torch.equal(claim_rows(check_a, 1), torch_claim(check_b, 1))
    assert torch.equal(check_a, check_b)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{a.rows} rows, {rows.numel()} claimed, median of {a.repeats}:")
    for name, s in med.items():
        print(f"  {name:<28} {s * 1e3:7.2f} ms")
    ratio = med["torch nonzero + index_put"] / med["deck claim_rows"]
    print(f"deck is {ratio:.1f}x faster (same rows, same map after)")
    print("reproduce: " + " ".join([sys.executable, *sys.argv]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
