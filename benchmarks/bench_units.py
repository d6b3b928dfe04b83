"""The per-unit constants of deck's checkpoint path, re-measured on this machine (docs/scaling.md).

One process, no TorchRec: plain tensors and deck's own kernels, writer, format, merger and
restore. Every measured constant is the median of ``--repeats`` runs; printed as a markdown table
(constant, value, unit, how measured), then one JSON line (``{"bench": "units", ...}``) with the
same numbers, their min/max and the machine, then the command line that reproduces it.

- **gather**: ``torch.index_select`` of ``--gather-rows`` random rows (ascending, as a claim
  returns them) of a ``--table-rows`` x 64 fp32 table into a preallocated, warm buffer; and the
  same copy by ``deck.kernels.gather.gather_rows`` (the snapshot's prefetching kernel).
- **claim**: the model ``t = a x claimed rows + b x map rows``, on fresh copies of a map:
  ``b_whole`` from ``claim_rows`` (the whole-map pass) with ``--sparse-rows`` marked in
  ``--map-rows``; ``a`` from ``claim_marked_rows`` (the tracker's claim) with ``--gather-rows``
  marked in ``--table-rows`` (most 64-row blocks marked: it reads the whole map) less that map
  term; ``b_summary`` from ``claim_marked_rows`` with ``--sparse-rows`` in ``--map-rows`` (few
  blocks marked: the summary pass) less the claimed rows' term; ``a_j`` from
  ``TrackerStore.begin_read`` of ``--gather-rows`` journaled rows in ``--table-rows`` and the
  sort of its rows (the claim where rows are copied in the stall; with copy-on-write the sort
  runs after it); the rows' bits are cleared out of the stall; no map term).
- **checksum**: ``deck.format.checksum.checksum`` (xxh3-64) over a 64 MiB buffer.
- **state file encode**: ``CapturedTree.encode`` (the dense / extra state file, on the spool
  writer beside training) against ``safetensors.torch.save`` of the same tensors, per tensor, on
  an Adam-like state of 200 parameters (quick 50).
- **manifest encode / decode**: ``dump_model`` / ``load_model`` of a delta's rank manifest (8
  chunks of 11k rows, each with its row-index filter, ~190 KiB) against encoding it in place (one
  ``json.dumps`` of the whole record) and checking it through its re-encoded canonical form.
- **spool write**: ``deck.storage.local.write_new_file(..., fsync=True)`` of ``--files`` x 4 MiB
  page-aligned chunk files (O_DIRECT where the filesystem allows, as the stager's chunks) into a
  temp dir under ``$TMPDIR`` (or /tmp).
- **upload / download** (``--s3`` only): ``FsspecStorage.put`` (then ``get``) of ``--objects``
  x 4 MiB objects to a SeaweedFS started here (``deck.testing.s3_server``) on loopback, 4 threads
  (the default ``upload_concurrency``). The server shares this machine's CPU: a lower bound for
  a remote one.
- **merge**: ``MergeWorker.run_once`` turning the trainer's full + 3 deltas of the demo workload
  (benchmarks/_workload.py, ``--merge-rows`` rows per table) into a new full, inputs evicted from
  the page cache first (as benchmarks/bench_merge_velocity.py): (bytes read + written) / s.
- **restore**: ``deck.read.restore.apply_chain`` of that full + 3 deltas into freshly allocated
  tables, files in the page cache (warm): bytes of the chain's data / s.
- **delta stall (model check)**: one rank's real save path (``ChainWriter`` + ``Stager`` +
  ``TrackerStore``, default ``StagingConfig``, local tier, as benchmarks/bench_stall_sweep.py) for a
  delta of ``--gather-rows`` and of ``--gather-rows // 8`` rows of the same table + rowwise
  momentum, alternating; the stall beyond claim + gather fitted as fixed + per chunk.
- **protocol constants** (not timed): collectives per checkpoint (deck/trainer/chain.py), the
  tracker's bytes per row (``TrackerStore.nbytes``), the default chunk size and buffer pool cap.

    python benchmarks/bench_units.py [--repeats 5] [--quick] [--s3]
"""

from __future__ import annotations

import argparse
import json
import logging
import mmap
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from _workload import (
    Workload,
    ZipfTrainer,
    drop_cache,
    journal_claim_times,
    one_table_chain,
    restore_into_fresh,
    warm_cache,
)
from deck.kernels.claim import block_count, block_of, claim_marked_rows, claim_rows
from deck.kernels.gather import gather_rows

from deck.format.checksum import checksum
from deck.storage import LocalStorage
from deck.storage.local import write_new_file

DIM = 64
CHUNK = 4 * 1024 * 1024


class Results:
    """The constants measured so far: name -> (median, unit, how, samples)."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, float | str, str, str]] = []
        self.json: dict[str, Any] = {}

    def add(self, key: str, name: str, samples: list[float], unit: str, how: str) -> float:
        med = statistics.median(samples)
        self.rows.append((name, med, unit, how))
        self.json[key] = {
            "value": med,
            "unit": unit,
            "min": min(samples),
            "max": max(samples),
            "n": len(samples),
        }
        print(f"  {name}: {_fmt(med)} {unit}", file=sys.stderr, flush=True)
        return med

    def const(self, key: str, name: str, value: float | str, unit: str, how: str) -> None:
        self.rows.append((name, value, unit, how))
        self.json[key] = {"value": value, "unit": unit}


def _fmt(v: float | str) -> str:
    if isinstance(v, str):
        return v
    if v >= 100:
        return f"{v:,.0f}"
    if v >= 10:
        return f"{v:.1f}"
    return f"{v:.3g}"


def _timed(fn: Callable[[], object], repeats: int, setup: Callable[[], object] | None = None):
    out = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _aligned(nbytes: int) -> tuple[mmap.mmap, memoryview]:
    """A page-aligned writable buffer of random bytes (as the stager's chunk buffers)."""
    buf = mmap.mmap(-1, nbytes)
    view = memoryview(buf)
    view[:] = os.urandom(1 << 20) * (nbytes >> 20)
    return buf, view


# ---- the constants ---------------------------------------------------------------------------


def gather(r: Results, table: torch.Tensor, rows: torch.Tensor, repeats: int) -> None:
    out = torch.empty((rows.numel(), table.shape[1]), dtype=table.dtype)
    torch.index_select(table, 0, rows, out=out)  # warm: the buffer's pages and the caches
    nbytes = out.numel() * out.element_size()
    ts = _timed(lambda: torch.index_select(table, 0, rows, out=out), repeats)
    r.add(
        "gather_gbps",
        "gather",
        [nbytes / t / 1e9 for t in ts],
        "GB/s",
        f"index_select of {rows.numel():,} random rows of a {table.shape[0]:,} x {DIM} fp32 "
        "table into a preallocated warm buffer (bytes of the rows / s)",
    )
    ts = _timed(lambda: gather_rows(rows, [(table, out)]), repeats)
    r.add(
        "gather_native_gbps",
        "gather, deck's snapshot kernel",
        [nbytes / t / 1e9 for t in ts],
        "GB/s",
        "deck.kernels.gather.gather_rows (prefetches 16 rows ahead) of the same rows into the "
        "same buffer: what the snapshot runs on CPU tables",
    )


def _marked(rows: int, marked: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A tracker map with ``marked`` distinct random rows set for 2 consumers, and its summary."""
    g = torch.Generator().manual_seed(rows)
    ids = (
        torch.randperm(rows, generator=g)[:marked]
        if rows <= 1 << 24
        else torch.unique(torch.randint(0, rows, (marked,), generator=g))
    )
    base = torch.zeros(rows, dtype=torch.uint8)
    base[ids] = 3
    blocks = torch.zeros(block_count(rows), dtype=torch.uint8)
    blocks[block_of(ids)] = 3
    return base, blocks


def _claim_times(
    rows: int, marked: int, repeats: int, whole: bool = False
) -> tuple[list[float], int]:
    """Times of the tracker's claim (or, ``whole``, the whole-map pass) on fresh map copies."""
    base, blocks = _marked(rows, marked)
    ts, n = [], 0
    for _ in range(repeats):
        m, b = base.clone(), blocks.clone()
        t0 = time.perf_counter()
        got = claim_rows(m, 1) if whole else claim_marked_rows(m, b, 1)
        ts.append(time.perf_counter() - t0)
        n = got.numel()
    return ts, n


def claim(r: Results, table_rows: int, delta: int, map_rows: int, sparse: int, repeats: int):
    """``t = a x claimed + b x map rows``; ``b`` is the summary's rate while at most a quarter of
    the 64-row blocks are marked, the whole-map pass's rate above (claim_marked_rows switches)."""
    dense_t, n1 = _claim_times(table_rows, delta, repeats)
    sparse_t, n2 = _claim_times(map_rows, sparse, repeats)
    whole_t, n3 = _claim_times(map_rows, sparse, repeats, whole=True)
    journal_t, n4, _ = journal_claim_times(table_rows, delta, repeats)
    t1, t2, t3 = (statistics.median(t) for t in (dense_t, sparse_t, whole_t))
    b_whole = t3 / map_rows  # the few claimed rows are well under 1% of it
    a = (t1 - b_whole * table_rows) / n1  # n1 in table_rows marks most blocks: a whole pass
    b_summary = max(t2 - a * n2, 0.0) / map_rows
    marked = 1 - (1 - n1 / table_rows) ** 64
    r.add(
        "claim_ns_per_row",
        "claim, per claimed row",
        [a * 1e9],
        "ns/row",
        f"claim_marked_rows of {n1:,} random rows marked in {table_rows:,} ({t1 * 1e3:.2f} ms; "
        f"{marked:.0%} of the 64-row blocks marked: one whole-map pass) less the whole-map term",
    )
    r.add(
        "claim_ns_per_row_journal",
        "claim from the journal, per claimed row",
        [statistics.median(journal_t) / n4 * 1e9],
        "ns/row",
        f"TrackerStore.begin_read of {n4:,} rows journaled in {table_rows:,} (take and sort the journal; "
        "the next compaction clears the rows; no map term): the usual claim while a delta is "
        "<= 1/8 of the rows",
    )
    r.add(
        "claim_ns_per_map_row_summary",
        "claim, per map row (summary)",
        [b_summary * 1e9],
        "ns/row",
        f"claim_marked_rows of {n2:,} rows marked in {map_rows:,} ({t2 * 1e3:.2f} ms) less "
        f"the claimed rows' term: the summary pass (applies while <= 1/4 of blocks are marked)",
    )
    r.add(
        "claim_ns_per_map_row_whole",
        "claim, per map row (whole-map pass)",
        [b_whole * 1e9],
        "ns/row",
        f"claim_rows (whole map) of {n3:,} rows marked in {map_rows:,} ({t3 * 1e3:.2f} ms): "
        "the map term once > 1/4 of the blocks are marked",
    )
    r.json["claim_points_ms"] = {
        f"marked_{n1}_in_{table_rows}": [x * 1e3 for x in dense_t],
        f"marked_{n2}_in_{map_rows}": [x * 1e3 for x in sparse_t],
        f"whole_{n3}_in_{map_rows}": [x * 1e3 for x in whole_t],
        f"journal_{n4}_in_{table_rows}": [x * 1e3 for x in journal_t],
    }


def checksum_rate(r: Results, repeats: int) -> None:
    data = os.urandom(64 << 20)
    checksum(data)
    ts = _timed(lambda: checksum(data), repeats)
    r.add(
        "checksum_gbps",
        "checksum",
        [len(data) / t / 1e9 for t in ts],
        "GB/s",
        "deck.format.checksum.checksum (xxh3-64) over a 64 MiB buffer",
    )


def state_encode(r: Results, params: int, repeats: int) -> None:
    """The spool writer's Python per dense tensor (it holds the GIL the training thread waits
    for): deck's state-file encoder against ``safetensors.torch.save`` of the same tensors, on
    an Adam-like dense state (per parameter: the weight, two moments, a step scalar)."""
    from safetensors.torch import save

    from deck.format import treecodec

    g = torch.Generator().manual_seed(0)
    state = {
        f"p{i}": {
            "w": torch.randn(64, 32, generator=g),
            "exp_avg": torch.randn(64, 32, generator=g),
            "exp_avg_sq": torch.rand(64, 32, generator=g),
            "step": torch.tensor(float(i)),
        }
        for i in range(params)
    }
    captured = treecodec.capture(state, "dense state")
    n = len(captured.tensors)
    meta = {"deck_tree": json.dumps(captured.tree)}
    assert captured.encode() == save(captured.tensors, metadata=meta)  # the same file
    ours = _timed(captured.encode, repeats)
    theirs = _timed(lambda: save(captured.tensors, metadata=meta), repeats)
    how = f"a state of {n} tensors ({params} parameters x weight, 2 moments, step), encoded"
    a = r.add("state_encode_us", "state file encode", [t / n * 1e6 for t in ours], "us/tensor", how)
    b = r.add(
        "safetensors_save_us",
        "safetensors.torch.save",
        [t / n * 1e6 for t in theirs],
        "us/tensor",
        how,
    )
    r.const("state_encode_ratio", "state file encode / safetensors.save", a / b, "x", how)


def manifest_codec(r: Results, chunks: int, repeats: int) -> None:
    """The rank manifest of a delta (each chunk with its row-index filter; written twice per
    delta by the spool writer and the commit thread, read by rank 0, the merger and restores):
    ``dump_model`` / ``load_model`` against the record encoded in place (one ``json.dumps`` of
    the whole, filters and all) and checked through its canonical form (encoded again)."""
    import xxhash
    from deck.kernels.bloom import bloom_fill

    from deck.format.manifest import RankManifest, _canonical, dump_model, load_model
    from deck.format.rowindex import build_index

    g = torch.Generator().manual_seed(0)
    records = []
    for n in range(chunks):
        ids = torch.randperm(1 << 20, generator=g)[:11_000].sort().values
        records.append(
            {
                "path": f"r/t{n}/c0-r0-000000.chunk",
                "rows": 11_000,
                "nbytes": 11_000 * 272,
                "checksum": "0" * 16,
                "segments": [
                    {
                        "name": "ids",
                        "dtype": "int64",
                        "shape": [11_000],
                        "offset": 0,
                        "nbytes": 88_000,
                    },
                ],
                "index": build_index(ids, fill=bloom_fill).model_dump(),  # type: ignore[union-attr]
            }
        )
    shards = [
        {
            "table": f"t{n}",
            "num_rows": 1 << 20,
            "num_cols": 64,
            "row_offset": 0,
            "rows": 1 << 20,
            "col_offset": 0,
            "cols": 64,
            "full": False,
            "states": ["weight"],
            "chunks": [rec],
        }
        for n, rec in enumerate(records)
    ]
    part = RankManifest.model_validate(
        {
            "format_version": 1,
            "step": 25,
            "ckpt_id": "0" * 16,
            "rank": 0,
            "world_size": 1,
            "shards": shards,
            "dense": None,
            "extra": {"path": "r/extra.safetensors", "nbytes": 1, "checksum": "ab"},
        }
    )

    def in_place() -> bytes:
        d = part.model_dump(mode="json")
        body = _canonical(d)
        return body[:-1] + f',"self_checksum":"{xxhash.xxh3_64_hexdigest(body)}"}}'.encode()

    data = dump_model(part)
    assert data == in_place()  # the same bytes

    def canonical_load() -> RankManifest:
        d = json.loads(data)
        d.pop("self_checksum")
        body = _canonical(d)
        assert xxhash.xxh3_64_hexdigest(body)
        return RankManifest.model_validate_json(body)

    how = f"a delta's rank manifest: {chunks} chunks of 11k rows with their filters, {len(data) >> 10} KiB"
    ms = [t * 1e3 for t in _timed(lambda: dump_model(part), repeats * 20)]
    base = [t * 1e3 for t in _timed(in_place, repeats * 20)]
    a = r.add("manifest_dump_ms", "rank manifest encode (dump_model)", ms, "ms", how)
    b = r.add("manifest_dump_in_place_ms", "rank manifest encoded in place", base, "ms", how)
    r.const("manifest_dump_ratio", "manifest encode / in place", a / b, "x", how)
    ms = [t * 1e3 for t in _timed(lambda: load_model(RankManifest, data, "p"), repeats * 20)]
    base = [t * 1e3 for t in _timed(canonical_load, repeats * 20)]
    a = r.add("manifest_load_ms", "rank manifest decode (load_model)", ms, "ms", how)
    b = r.add("manifest_load_canonical_ms", "rank manifest checked re-encoded", base, "ms", how)
    r.const("manifest_load_ratio", "manifest decode / re-encoded", a / b, "x", how)


def spool_write(r: Results, files: int, repeats: int) -> None:
    buf, view = _aligned(CHUNK)
    base = tempfile.mkdtemp(prefix="deck-units-spool-")
    rates = []
    try:
        for i in range(repeats):
            d = os.path.join(base, str(i))
            os.makedirs(d)
            t0 = time.perf_counter()
            for k in range(files):
                write_new_file(os.path.join(d, f"{k:06d}.chunk"), view, exclusive=True, fsync=True)
            rates.append(files * CHUNK / (time.perf_counter() - t0) / 1e9)
            shutil.rmtree(d)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        view.release()
        buf.close()
    r.add(
        "spool_gbps",
        "spool write",
        rates,
        "GB/s",
        f"write_new_file(fsync=True) of {files} x 4 MiB page-aligned chunk files, one after the "
        f"other, into {tempfile.gettempdir()}",
    )


def upload(r: Results, objects: int, repeats: int, work: str) -> None:
    from deck.storage import FsspecStorage
    from deck.testing.s3_server import SeaweedS3

    server = SeaweedS3(workdir=os.path.join(work, "seaweed"), volume_size_limit_mb=256)
    server.start()
    print(f"  SeaweedFS up in {server.startup_seconds:.1f} s", file=sys.stderr)
    try:
        store = FsspecStorage(server.uri("bench-units"), server.storage_options)
        payload = os.urandom(CHUNK)
        store.put("warm/0", payload)
        up, down = [], []
        with ThreadPoolExecutor(4) as pool:
            for i in range(repeats):
                t0 = time.perf_counter()
                list(pool.map(lambda k, i=i: store.put(f"r{i}/{k:06d}", payload), range(objects)))
                up.append(objects * CHUNK / (time.perf_counter() - t0) / 1e9)
            for i in range(repeats):
                t0 = time.perf_counter()
                got = list(pool.map(lambda k, i=i: store.get(f"r{i}/{k:06d}"), range(objects)))
                down.append(objects * CHUNK / (time.perf_counter() - t0) / 1e9)
                if any(len(x) != CHUNK for x in got):
                    raise SystemExit("download: short object")
    finally:
        server.stop()
    how = f"{objects} x 4 MiB objects, 4 threads (upload_concurrency), SeaweedFS on loopback "
    r.add("upload_gbps", "upload", up, "GB/s", f"FsspecStorage.put of {how}sharing this CPU")
    r.add(
        "download_gbps",
        "download",
        down,
        "GB/s",
        f"FsspecStorage.get of the same {how}(what a cold restore from S3 reads at)",
    )


def merge_and_restore(r: Results, rows: int, repeats: int, work: str) -> None:
    from deck.merge.policy import FullPolicy, MergeConfig
    from deck.merge.worker import MergeWorker
    from deck.read.catalog import read_manifests

    w = Workload(tables=8, rows=rows, dim=DIM)
    root = os.path.join(work, "merge")
    storage = LocalStorage(root)
    tr = ZipfTrainer(w, storage)
    tr.save("full")
    for _ in range(3):
        tr.interval()
        tr.save()
    chain = [m for _, m in sorted(read_manifests(storage).items())]
    files = sorted(
        os.path.join(folder, name)
        for m in chain
        for folder, _, names in os.walk(storage.local_path(m.folder))
        for name in names
        if name.endswith(".chunk")
    )
    chain_bytes = sum(m.data_bytes for m in chain)
    desc = (
        f"full + 3 deltas of the demo workload (8 x {rows:,} x {DIM} fp32 + momentum, "
        f"{chain[0].data_bytes / 2**20:.0f} + "
        + " + ".join(f"{m.data_bytes / 2**20:.0f}" for m in chain[1:])
        + " MiB)"
    )
    # restore first: the chain's files as the trainer wrote them, warm.
    rates = []
    for _ in range(repeats):
        warm_cache(files)
        dt, state, _ = restore_into_fresh(storage, chain, w)
        del state
        rates.append(chain_bytes / dt / 1e9)
    r.add(
        "restore_gbps",
        "restore",
        rates,
        "GB/s",
        f"apply_chain of the {desc} into fresh tables, warm page cache (chain bytes / s)",
    )
    cfg = MergeConfig(stride=4, full=FullPolicy(every=3, max_live_fraction=None))
    rates = []
    for _ in range(repeats):
        shutil.rmtree(os.path.join(root, "merged"), ignore_errors=True)
        drop_cache(files)
        t0 = time.perf_counter()
        stats, _ = MergeWorker(storage, cfg).run_once()
        dt = time.perf_counter() - t0
        if stats.items_committed != 1:
            raise SystemExit(f"merge: expected one item, built {stats.items_committed}")
        rates.append((stats.bytes_read + stats.bytes_written) / dt / 1e9)
    r.add(
        "merge_gbps",
        "merge",
        rates,
        "GB/s",
        f"MergeWorker.run_once: {desc} -> a new full, inputs evicted from the page cache "
        "((bytes read + written) / s)",
    )
    shutil.rmtree(root, ignore_errors=True)


def delta_stall(r: Results, table: torch.Tensor, delta: int, repeats: int, work: str) -> None:
    """One rank's real save path, deltas of ``delta`` and ``delta // 8`` rows alternating; the
    stall beyond claim + gather fitted as a fixed term + a term per chunk."""

    rows = table.shape[0]
    chain, stager, tracker, shard = one_table_chain(
        table, torch.zeros(rows), os.path.join(work, "stall")
    )
    g = torch.Generator().manual_seed(7)
    sizes = (delta, max(delta // 8, 1))
    got: dict[int, dict[str, list[float]]] = {
        n: {"stall": [], "over": [], "chunks": [], "bytes": []} for n in sizes
    }
    try:
        for i in range(2 * (repeats + 1)):
            n = sizes[i % 2]
            ids = torch.randperm(rows, generator=g)[:n]
            shard.states["weight"][ids] = float(i)
            shard.states["momentum1"][ids] = float(i)
            tracker.record(ids)
            peek = tracker.begin_read("checkpoint")
            outs = [torch.empty((n, *t.shape[1:])) for t in shard.states.values()]
            for o in outs:
                o.zero_()
            t0 = time.perf_counter()
            for t, o in zip(shard.states.values(), outs, strict=True):
                torch.index_select(t, 0, peek.rows, out=o)
            gathered = time.perf_counter() - t0
            tracker.abort(peek)
            stats = chain.save("delta", step=i + 1)
            assert stats is not None and stats.kind == "delta", stats
            stager.flush()
            stager.take_failure()
            stager.take_failed()
            if i < 2:
                continue  # sized the buffer pool
            d = got[n]
            d["stall"].append(stats.stall_s * 1e3)
            d["over"].append((stats.stall_s - stats.claim_s - gathered) * 1e3)
            d["chunks"].append(stats.chunks)
            d["bytes"].append(stats.bytes)
    finally:
        stager.close()
    big, small = (got[n] for n in sizes)
    cb, cs = statistics.median(big["chunks"]), statistics.median(small["chunks"])
    ob, os_ = statistics.median(big["over"]), statistics.median(small["over"])
    per_chunk = (ob - os_) / (cb - cs) if cb > cs else ob / max(cb, 1)
    fixed = os_ - per_chunk * cs
    if fixed < 0 or per_chunk < 0:  # noise beat the two-point fit: all of it per chunk
        per_chunk, fixed = ob / max(cb, 1), 0.0
    r.add(
        "delta_stall_ms",
        "delta stall (model check)",
        big["stall"],
        "ms",
        f"ChainWriter.save of a {delta:,}-row delta ({statistics.median(big['bytes']) / 2**20:.1f}"
        f" MiB, {cb:g} chunks) of a {rows:,} x {DIM} fp32 + momentum1 shard, 1 rank, no "
        "collective, default StagingConfig",
    )
    r.add(
        "stall_overhead_ms_per_chunk",
        "stall overhead per chunk",
        [per_chunk],
        "ms/chunk",
        f"stall - claim - index_select of the same rows' states, medians at {sizes[0]:,} rows "
        f"({ob:.2f} ms, {cb:g} chunks) and {sizes[1]:,} rows ({os_:.2f} ms, {cs:g} chunk"
        f"{'s' if cs != 1 else ''}), fitted fixed + per chunk",
    )
    r.add(
        "stall_overhead_fixed_ms",
        "stall overhead fixed",
        [fixed],
        "ms",
        "the fixed term of the same fit (records, vote without a collective, hand-off)",
    )
    r.json["delta_stall_small_ms"] = small["stall"]


def protocol(r: Results) -> None:
    from deck.trainer.tracker import TrackerStore

    t = TrackerStore(1 << 20, ("checkpoint", "publish"))
    per_row = t.nbytes() / t.num_rows
    r.const(
        "tracker_bytes_per_row",
        "tracker memory",
        round(per_row, 4),
        "B/row",
        "1 + 1/64 bytes per row for 1..8 tenants: byte map + block summary of a TrackerStore "
        "(deck/trainer/tracker.py)",
    )
    r.const(
        "collectives_steady",
        "collectives per checkpoint (steady)",
        1,
        "all-gather",
        "protocol (deck/trainer/chain.py docstring): one vote of a few float64 per rank",
    )
    r.const(
        "collectives_first",
        "collectives per checkpoint (first / after a failure)",
        2,
        "all-gather",
        "protocol: the first checkpoint of a process or the one after a failed/skipped one "
        "votes before the claim too",
    )
    from deck.config import StagingConfig

    cfg = StagingConfig()
    r.const(
        "chunk_bytes",
        "chunk size",
        cfg.chunk_bytes / 2**20,
        "MiB",
        "StagingConfig.chunk_bytes default (one chunk file; the stall's per-chunk unit)",
    )
    r.const(
        "snapshot_memory_bytes",
        "buffer pool cap",
        cfg.snapshot_memory_bytes / 2**20,
        "MiB",
        "StagingConfig.snapshot_memory_bytes default: a part above it waits in the stall for "
        "buffers the spool writer frees",
    )
    r.const(
        "row_bytes",
        "bytes per saved row (dim 64 fp32 + rowwise state + id)",
        DIM * 4 + 4 + 8,
        "B",
        "format: fp32 weight row + one fp32 momentum1 + int64 id",
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="smaller sizes (about 4x less)")
    p.add_argument(
        "--s3", action="store_true", help="also upload/download rates to a local SeaweedFS"
    )
    p.add_argument("--table-rows", type=int, default=None, help="default 4M (quick 1M)")
    p.add_argument("--gather-rows", type=int, default=None, help="default 80k (quick 20k)")
    p.add_argument("--map-rows", type=int, default=None, help="default 256M (quick 64M)")
    p.add_argument("--sparse-rows", type=int, default=8000)
    p.add_argument("--files", type=int, default=None, help="spool files, default 64 (quick 16)")
    p.add_argument("--objects", type=int, default=None, help="S3 objects, default 32 (quick 8)")
    p.add_argument("--merge-rows", type=int, default=None, help="default 250k (quick 50k)")
    p.add_argument("--no-stall", action="store_true", help="skip the ChainWriter model check")
    a = p.parse_args(argv)
    q = a.quick
    table_rows = a.table_rows or (1_000_000 if q else 4_000_000)
    delta = a.gather_rows or (20_000 if q else 80_000)
    map_rows = a.map_rows or ((64 if q else 256) * 1_000_000)
    files = a.files or (16 if q else 64)
    objects = a.objects or (8 if q else 32)
    merge_rows = a.merge_rows or (50_000 if q else 250_000)
    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("deck").setLevel(logging.CRITICAL)  # the stall check's on-purpose failures
    torch.set_num_threads(1)  # one compute thread, like each demo rank
    t_start = time.perf_counter()
    r = Results()
    work = tempfile.mkdtemp(prefix="deck-units-")
    try:
        print(f"measuring (medians of {a.repeats})...", file=sys.stderr)
        table = torch.ones(table_rows, DIM)  # allocated and faulted in
        g = torch.Generator().manual_seed(0)
        rows = torch.randperm(table_rows, generator=g)[:delta].sort().values
        gather(r, table, rows, a.repeats)
        claim(r, table_rows, delta, map_rows, a.sparse_rows, a.repeats)
        checksum_rate(r, a.repeats)
        state_encode(r, 50 if q else 200, a.repeats)
        manifest_codec(r, 8, a.repeats)
        spool_write(r, files, a.repeats)
        if a.s3:
            upload(r, objects, a.repeats, work)
        merge_and_restore(r, merge_rows, a.repeats, work)
        if not a.no_stall:
            delta_stall(r, table, delta, a.repeats, work)
        del table
        protocol(r)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    cmd = " ".join([os.path.relpath(sys.executable), *sys.argv])
    machine = {
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "tmpdir": tempfile.gettempdir(),
        "compute_threads": 1,
    }
    print(
        f"\ndeck per-unit constants: medians of {a.repeats}, {os.cpu_count()} CPUs, "
        f"torch {torch.__version__}, 1 compute thread, took {time.perf_counter() - t_start:.0f} s\n"
    )
    print("| constant | value | unit | how measured |\n|---|---|---|---|")
    for name, value, unit, how in r.rows:
        print(f"| {name} | {_fmt(value)} | {unit} | {how} |")
    print()
    print(json.dumps({"bench": "units", "machine": machine, "constants": r.json, "command": cmd}))
    print(f"\nreproduce: {cmd}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
