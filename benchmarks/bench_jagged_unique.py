#!/usr/bin/env python
"""Compaction of tracked ids: deck.kernels.jagged_unique vs per-table cat+unique vs TorchRec.

Workload: T tables of ``--rows`` shard-local rows each; N ids in all, split over the tables with
uneven weights and over ``--batches`` training batches per table. Ids follow a Zipf law over row
ranks (exponent ``--zipf-a``, truncated to the table's rows), mapped to rows by a random
permutation, so hot rows are scattered over the table as in real traffic.

Every contender starts from the same per-table lists of per-batch id tensors (what a tracker holds
after ``--batches`` steps) and ends with each table's sorted distinct ids:

- ``cat+unique``: per table, ``torch.cat(batches).unique()`` (TorchRec's DeltaStore compaction).
- ``DeltaStoreTrec``: TorchRec's own store: ``append`` per batch per table (untimed, done while
  training), then the timed ``compact(0, B)`` + ``get_unique()`` that
  ``ModelDeltaTracker.get_unique`` runs.
- ``ours ...``: ``concat_jagged`` (one copy into the jagged layout) + ``jagged_unique``, with
  ``num_rows`` (bitmap path), without (auto: the bitmap sized from the largest ids when that is
  dense enough, else sort), and forced to the sort path; ``per-table lists`` is
  ``unique_per_table(per_table, num_rows)``, the same unique marked straight from the per-batch
  tensors (no concatenation); ``kernel only`` times ``jagged_unique(num_rows)`` alone, for a
  tracker that writes ids straight into a jagged buffer.

Each config runs one warm-up round and ``--repeats`` timed rounds; in every round each contender
runs once, in the order of a row of a Williams square (each contender follows each other equally
often), so allocator and thread-pool state is shared fairly. Medians
(or, with ``--stat min``, minima) are reported, with the ratio ``cat+unique / contender``
(higher is better). A warning names the rows measured while other processes used the CPUs.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from _workload import williams_order
from deck.kernels import concat_jagged, jagged_unique, unique_per_table

BASELINE = "cat+unique"


@dataclass
class Workload:
    num_tables: int
    total_ids: int
    rows: int
    per_table: list[list[torch.Tensor]]  # [table][batch] -> 1-D int64 ids

    @property
    def num_rows(self) -> list[int]:
        return [self.rows] * self.num_tables


def zipf_ranks(rng: np.random.Generator, count: int, rows: int, a: float) -> np.ndarray:
    """``count`` Zipf(a) ranks in ``[0, rows)``: numpy's unbounded Zipf, resampled past ``rows``."""
    ranks = rng.zipf(a, size=count)
    out_of_range = np.flatnonzero(ranks > rows)
    while out_of_range.size:
        ranks[out_of_range] = rng.zipf(a, size=out_of_range.size)
        out_of_range = out_of_range[ranks[out_of_range] > rows]
    ranks -= 1
    return ranks


def make_workload(
    num_tables: int, total_ids: int, rows: int, batches: int, a: float, seed: int
) -> Workload:
    rng = np.random.default_rng(seed)
    weights = rng.uniform(0.5, 1.5, size=num_tables)
    counts = np.floor(total_ids * weights / weights.sum()).astype(np.int64)
    counts[: total_ids - int(counts.sum())] += 1  # hand out the rounding remainder
    permutation = rng.permutation(rows)
    per_table: list[list[torch.Tensor]] = []
    for t in range(num_tables):
        ranks = zipf_ranks(rng, int(counts[t]), rows, a)
        # A per-table rotation of one shared permutation: each table has its own hot rows.
        ids = (permutation[ranks] + int(rng.integers(rows))) % rows
        per_table.append([torch.from_numpy(chunk) for chunk in np.array_split(ids, batches)])
    return Workload(num_tables, total_ids, rows, per_table)


def contenders(
    w: Workload,
) -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
    """name -> (setup, timed call); setup's result is passed nowhere, state lives in closures."""
    from torchrec.distributed.model_tracker.delta_store import DeltaStoreTrec

    batches = len(w.per_table[0]) if w.per_table else 0
    store: list[DeltaStoreTrec] = []

    def trec_setup() -> None:
        s = DeltaStoreTrec()
        for b in range(batches):
            for t in range(w.num_tables):
                s.append(batch_idx=b, fqn=f"table_{t}", ids=w.per_table[t][b])
        store[:] = [s]

    def trec_run() -> object:
        s = store[0]
        s.compact(start_idx=0, end_idx=batches)
        return s.get_unique(from_idx=0)

    jagged: list[torch.Tensor] = []

    def kernel_setup() -> None:
        jagged[:] = list(concat_jagged(w.per_table))

    def nothing() -> None:
        return None

    return {
        BASELINE: (nothing, lambda: [torch.cat(batches_t).unique() for batches_t in w.per_table]),
        "DeltaStoreTrec": (trec_setup, trec_run),
        "ours bitmap(num_rows)": (
            nothing,
            lambda: jagged_unique(*concat_jagged(w.per_table), w.num_rows),
        ),
        "ours auto(no bound)": (nothing, lambda: jagged_unique(*concat_jagged(w.per_table))),
        "ours sort": (
            nothing,
            lambda: jagged_unique(*concat_jagged(w.per_table), method="sort"),
        ),
        "ours per-table lists": (
            nothing,
            lambda: unique_per_table(w.per_table, w.num_rows),
        ),
        "ours kernel only": (
            kernel_setup,
            lambda: jagged_unique(jagged[0], jagged[1], w.num_rows),
        ),
    }


def check_agreement(w: Workload) -> int:
    """All contenders must return the same ids; returns the number of distinct (table, id)."""
    expected = [torch.cat(b).unique() for b in w.per_table]
    want_values = torch.cat(expected) if expected else torch.empty(0, dtype=torch.int64)
    want_lengths = [e.numel() for e in expected]
    values, lengths = concat_jagged(w.per_table)
    for kwargs in ({"num_rows": w.num_rows}, {}, {"method": "sort"}):
        got_values, got_lengths = jagged_unique(values, lengths, **kwargs)  # type: ignore[arg-type]
        if not torch.equal(got_values, want_values) or got_lengths.tolist() != want_lengths:
            raise SystemExit(f"jagged_unique({kwargs}) disagrees with cat+unique")
    got_values, got_lengths = unique_per_table(w.per_table, w.num_rows)
    if not torch.equal(got_values, want_values) or got_lengths.tolist() != want_lengths:
        raise SystemExit("unique_per_table disagrees with cat+unique")
    return int(want_values.numel())


def measure(w: Workload, repeats: int, stat: str) -> dict[str, float]:
    """Seconds per contender (median or min) over ``repeats`` rounds after one warm-up round."""
    calls = contenders(w)
    names = list(calls)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(repeats + 1):
        # A Williams order: each contender follows each other equally often, so none always
        # pays for the memory its predecessor freed (fresh pages fault on first touch).
        for name in (names[i] for i in williams_order(len(names), round_index)):
            setup, run = calls[name]
            setup()
            gc.collect()
            start = time.perf_counter()
            result = run()
            elapsed = time.perf_counter() - start
            del result
            if round_index > 0:
                times[name].append(elapsed)
    reduce = min if stat == "min" else statistics.median
    return {name: reduce(ts) for name, ts in times.items()}


def busy_seconds_of_others() -> float | None:
    """CPU seconds all processes but this one have used since boot (Linux), else None."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return None
    ticks = [int(x) for x in fields]
    idle = ticks[3] + ticks[4]  # idle + iowait
    busy = (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")
    own = os.times()
    return busy - (own.user + own.system + own.children_user + own.children_system)


def human(n: int) -> str:
    return f"{n / 1e6:g}M" if n >= 1_000_000 else f"{n / 1e3:g}K"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="1M and 10M ids only, 3 repeats")
    parser.add_argument("--tables", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument(
        "--ids", type=float, nargs="+", default=None, help="total ids (default 1e6 1e7 4e7)"
    )
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows per table")
    parser.add_argument("--batches", type=int, default=50, help="batches per compaction")
    parser.add_argument("--zipf-a", type=float, default=1.15)
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (default 5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--stat",
        choices=["median", "min"],
        default="median",
        help="how to summarise the repeats (min resists noise from other processes)",
    )
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="torch threads (default: all)"
    )
    args = parser.parse_args(argv)
    ids = args.ids or ([1e6, 1e7] if args.quick else [1e6, 1e7, 4e7])
    repeats = args.repeats or (3 if args.quick else 5)
    torch.set_num_threads(args.threads)

    print(f"# command: {shlex.join([sys.executable, *sys.argv])}")
    print(
        f"# torch {torch.__version__}, numpy {np.__version__}, threads {torch.get_num_threads()}, "
        f"{os.cpu_count()} CPUs, {platform.processor() or platform.machine()}"
    )
    print(
        f"# rows/table {args.rows}, batches {args.batches}, zipf a={args.zipf_a}, "
        f"{args.stat} of {repeats} (after 1 warm-up), ratio = {BASELINE} time / contender time"
    )
    header: list[str] | None = None
    noisy: list[str] = []
    for total in ids:
        for num_tables in args.tables:
            w = make_workload(
                num_tables, int(total), args.rows, args.batches, args.zipf_a, args.seed
            )
            distinct = check_agreement(w)
            others_before = busy_seconds_of_others()
            wall_before = time.perf_counter()
            medians = measure(w, repeats, args.stat)
            others_after = busy_seconds_of_others()
            wall = time.perf_counter() - wall_before
            base = medians[BASELINE]
            if header is None:
                header = ["tables", "ids", "distinct", *medians]
                print("| " + " | ".join(header) + " |")
                print("|" + "|".join("---" for _ in header) + "|")
            cells = [str(num_tables), human(int(total)), human(distinct)]
            for name, seconds in medians.items():
                cell = f"{seconds * 1e3:.1f} ms"
                if name != BASELINE:
                    cell += f" ({base / seconds:.1f}x)"
                cells.append(cell)
            print("| " + " | ".join(cells) + " |", flush=True)
            if others_before is not None and others_after is not None:
                # Timings on a shared machine are only comparable while nothing else runs.
                share = (others_after - others_before) / (wall * (os.cpu_count() or 1))
                if share > 0.05:
                    noisy.append(f"{num_tables} tables / {human(int(total))} ids: {share:.0%}")
            del w
            gc.collect()
    if noisy:
        print(
            "# WARNING: other processes used this share of the CPUs while these rows were "
            "measured; rerun on an idle machine: " + "; ".join(noisy)
        )


if __name__ == "__main__":
    main()
