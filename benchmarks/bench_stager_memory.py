"""Peak extra CPU memory (RSS) of the stager while it writes a full checkpoint, for a 0.5 GiB and a
4 GiB model: the goal is <= chunks_in_flight x chunk_bytes + 64 MiB, the same for both sizes.

To fit a 2-core, 24 GiB machine the model is synthetic: ``--tables`` plain-tensor
``deck.model.TableShard``s (weight rows x 64 fp32 + momentum1 rows fp32) of the given
total size, driven through ``deck.trainer.staging.Stager`` + ``deck.trainer.writer.RankPartWriter`` exactly as
``DeltaCheckpointer.save`` does (PendingPart, ``stager.begin``, ``RankPartWriter(sink=staged)``,
``write_part``, ``wait_written``, ``enqueue``, ``flush``): a FULL checkpoint (every row), rank 0
of 1, default staging (4 MiB chunks, 4 chunks in flight), to

- ``local``: a directory under /tmp (tier ``local``);
- ``s3``: a SeaweedFS S3 server started by this script (tier ``cpu-ssd-remote``, spool under /tmp).
  ``memory://`` is not used: it keeps every object inside this process, so its RSS grows by the
  checkpoint size by construction (that is the store's memory, not the stager's).

RSS is sampled from /proc/self/statm by a background thread every ``--interval-ms``; the kernel's
own high-water mark (VmHWM, reset through /proc/self/clear_refs right before the save) catches
peaks between samples. Extra = peak - RSS right before the save (model tensors exist, a fresh
Stager is built; a small warm-up checkpoint through another Stager loaded s3fs/botocore and
friends first, so one-time imports are not counted). The time from begin to committed is the
whole checkpoint (fsync, upload and commit included).

    python benchmarks/bench_stager_memory.py [--sizes 0.5,4] [--targets local,s3] [--repeats 3]
    python benchmarks/bench_stager_memory.py --quick     # 0.125 and 0.5 GiB
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import torch
from _workload import save_full

from deck.config import StagingConfig
from deck.model import TableShard
from deck.storage import Storage, open_storage
from deck.trainer.staging import Stager

MIB = 2**20
PAGE = os.sysconf("SC_PAGE_SIZE")


class RssSampler(threading.Thread):
    """Peak RSS of this process: /proc/self/statm every ``interval`` s plus the kernel's VmHWM."""

    def __init__(self, interval: float):
        super().__init__(daemon=True, name="rss-sampler")
        self.interval = interval
        self._fd = os.open("/proc/self/statm", os.O_RDONLY)
        self._done = threading.Event()
        self.peak = 0
        self.samples = 0
        self.hwm_reset = _reset_hwm()

    def rss(self) -> int:
        return int(os.pread(self._fd, 256, 0).split()[1]) * PAGE

    def run(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, self.rss())
            self.samples += 1
            time.sleep(self.interval)

    def stop(self) -> int:
        """Stop sampling; the peak (max of samples and VmHWM when it could be reset)."""
        self._done.set()
        self.join()
        self.peak = max(self.peak, self.rss())
        os.close(self._fd)
        if self.hwm_reset:
            self.peak = max(self.peak, _status_kib("VmHWM") * 1024)
        return self.peak


def _reset_hwm() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: write 5 to clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def make_shards(total_bytes: int, tables: int, dim: int) -> list[TableShard]:
    """``tables`` shards of weight (rows x dim fp32) + momentum1 (rows fp32), ``total_bytes`` in all."""
    rows = total_bytes // tables // (dim * 4 + 4)
    g = torch.Generator().manual_seed(0)
    shards = []
    for i in range(tables):
        shards.append(
            TableShard.whole(
                f"m.embedding_bags.t{i}.weight",
                {
                    "weight": torch.empty(rows, dim).uniform_(-0.1, 0.1, generator=g),
                    "momentum1": torch.empty(rows).uniform_(0, 1, generator=g),
                },
            )
        )
    return shards


def _target(spec: dict[str, Any]) -> tuple[Storage, StagingConfig]:
    if spec["target"] == "local":
        return open_storage(spec["uri"]), StagingConfig(tiers="local")
    storage = open_storage(spec["uri"], spec["storage_options"])
    return storage, StagingConfig(tiers="cpu-ssd-remote", spool_dir=spec["spool"])


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """One measurement, in a fresh process: build the model, warm the storage client up, save."""
    torch.set_num_threads(1)
    shards = make_shards(int(spec["size"] * 2**30), spec["tables"], spec["dim"])
    model_bytes = sum(t.numel() * t.element_size() for s in shards for t in s.states.values())
    storage, cfg = _target(spec)
    # Warm-up without a Stager (its pool must be allocated inside the measurement): imports and,
    # for S3, the client, its event loop and a connection. 64 KiB: too small to leave a freed
    # chunk-size block in the heap that the pool could reuse.
    storage.put("warmup/probe", bytes(64 * 1024))
    storage.get("warmup/probe")
    storage.delete("warmup/probe")
    stager = Stager(storage, cfg, rank=0)
    gc.collect()
    sampler = RssSampler(spec["interval_ms"] / 1000)
    base = sampler.rss()
    sampler.start()
    stats, part = save_full(stager, storage, shards, spec["rep"], cfg)
    chunks = sum(len(r.chunks) for r in part.shards)
    peak = sampler.stop()
    stager.close()
    if spec["target"] == "local":
        shutil.rmtree(spec["uri"], ignore_errors=True)
    else:
        storage.delete_prefix("")
    return {
        **{k: spec[k] for k in ("size", "target", "rep")},
        "model_bytes": model_bytes,
        "tier": stager.tier,
        "base": base,
        "extra": peak - base,
        "hwm": sampler.hwm_reset,
        "pool_peak": stager.pool.peak_in_use,
        "pool_bytes": stager.pool.allocated_bytes,
        "bytes": stats.bytes,
        "chunks": chunks,
        "stall": stats.stall_s,
        "committed": stats.committed_s or float("nan"),
        "samples": sampler.samples,
    }


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="sizes 0.125 and 0.5 GiB")
    p.add_argument("--sizes", default=None, help="model sizes in GiB, comma separated (0.5,4)")
    p.add_argument("--targets", default="local,s3", help="local and/or s3 (SeaweedFS)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--interval-ms", type=float, default=2.0)
    p.add_argument("--workdir", default=None, help="scratch directory (default: a temp dir)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print("RESULT " + json.dumps(measure(json.loads(a.child))), flush=True)
        return 0
    sizes = [float(x) for x in (a.sizes or ("0.125,0.5" if a.quick else "0.5,4")).split(",")]
    targets = [t.strip() for t in a.targets.split(",") if t.strip()]
    if set(targets) - {"local", "s3"}:
        p.error("--targets takes local and/or s3")
    work = a.workdir or tempfile.mkdtemp(prefix="deck-bench-mem-", dir="/tmp")
    os.makedirs(work, exist_ok=True)
    cfg0 = StagingConfig()
    bound = cfg0.chunks_in_flight * cfg0.chunk_bytes + 64 * MIB
    server = None
    rows: list[dict[str, Any]] = []
    try:
        if "s3" in targets:
            from deck.testing.s3_server import SeaweedS3

            server = SeaweedS3(workdir=os.path.join(work, "seaweed"), volume_size_limit_mb=1024)
            server.start()
            print(
                f"SeaweedFS S3 at {server.endpoint_url} (started in {server.startup_seconds:.1f} s)"
            )
        for size in sizes:
            for rep in range(a.repeats):
                for name in targets:
                    spec = {
                        "size": size,
                        "target": name,
                        "rep": rep,
                        "tables": a.tables,
                        "dim": a.dim,
                        "interval_ms": a.interval_ms,
                        "spool": os.path.join(work, "spool"),
                    }
                    if name == "local":
                        spec["uri"] = os.path.join(work, "ck", f"s{size}-r{rep}")
                    else:
                        assert server is not None
                        spec["uri"] = server.uri(f"mem/s{size}-r{rep}")
                        spec["storage_options"] = server.storage_options
                    out = subprocess.run(
                        [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)],
                        capture_output=True,
                        text=True,
                    )
                    line = next(
                        (x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None
                    )
                    if out.returncode or line is None:
                        raise RuntimeError(f"measurement {spec} failed:\n{out.stderr[-3000:]}")
                    row = json.loads(line[len("RESULT ") :])
                    rows.append(row)
                    print(
                        f"  {row['model_bytes'] / 2**30:.2f} GiB {name:<5} rep {rep}: extra RSS "
                        f"{row['extra'] / MIB:6.1f} MiB (base {row['base'] / MIB:.0f} MiB, "
                        f"{row['samples']} samples, VmHWM {'on' if row['hwm'] else 'off'}), "
                        f"{row['chunks']} chunks, {row['bytes'] / 2**30:.3f} GiB, staged "
                        f"{row['stall']:.1f} s, committed {row['committed']:.1f} s",
                        flush=True,
                    )
    finally:
        if server is not None:
            server.stop()
        if a.workdir is None:
            shutil.rmtree(work, ignore_errors=True)

    print()
    print(
        f"bound = chunks_in_flight x chunk_bytes + 64 MiB = {cfg0.chunks_in_flight} x "
        f"{cfg0.chunk_bytes / MIB:.0f} MiB + 64 MiB = {bound / MIB:.0f} MiB; each measurement "
        "in a fresh process"
    )
    print(
        f"{'model':>9} {'target':<6} {'tier':<15} {'extra RSS MiB median / max':>27} "
        f"{'max/bound':>10} {'pool MiB':>9} {'GiB/s to commit':>16} {'goal':>5}"
    )
    verdict = {}
    for size in sizes:
        for name in targets:
            rs = [r for r in rows if r["size"] == size and r["target"] == name]
            if not rs:
                continue
            med = statistics.median(r["extra"] for r in rs)
            mx = max(r["extra"] for r in rs)
            gbs = statistics.median(r["bytes"] / r["committed"] / 2**30 for r in rs)
            ok = mx <= bound
            verdict[(size, name)] = (med, mx)
            print(
                f"{rs[0]['model_bytes'] / 2**30:>5.2f} GiB {name:<6} {rs[0]['tier']:<15} "
                f"{med / MIB:>15.1f} / {mx / MIB:>9.1f} {mx / bound:>10.2f} "
                f"{max(r['pool_bytes'] for r in rs) / MIB:>9.0f} {gbs:>16.3f} "
                f"{'MET' if ok else 'NO':>5}"
            )
    if len(sizes) >= 2:
        for name in targets:
            small, big = verdict.get((sizes[0], name)), verdict.get((sizes[-1], name))
            if small and big:
                print(
                    f"{name}: {sizes[-1]:g} GiB vs {sizes[0]:g} GiB model: max extra "
                    f"{big[1] / MIB:.1f} vs {small[1] / MIB:.1f} MiB "
                    f"(difference {(big[1] - small[1]) / MIB:+.1f} MiB)"
                )
    print()
    print("reproduce: " + " ".join([os.path.relpath(sys.executable), *sys.argv]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
