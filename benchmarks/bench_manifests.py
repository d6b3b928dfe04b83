"""Finding and reading the commit records of a store with many retained steps: what every restore,
merger pass and ``deck ls`` does first.

The trainer writes a full, then ``--steps`` deltas of a small Zipf workload (benchmarks/_workload.py,
real writer and format; every step stays, as under the default retention), to a local directory or
(``--s3``) to SeaweedFS on loopback. Then, in rounds (median of ``--repeats``):

- finding the records: a listing of every object (``storage.list("")``, how deck found them before)
  vs :func:`deck.read.catalog.manifest_keys` (one-level listings of the step and merger folders);
- reading them: :func:`deck.read.catalog.read_manifests` with the backend's ``get_many`` (parallel on
  fsspec stores) vs one request after the other (the base class's ``get_many``).

    python benchmarks/bench_manifests.py [--steps 300] [--s3] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _timing import median_s
from _workload import Workload, ZipfTrainer, in_workdir

from deck.read.catalog import manifest_keys, read_manifests
from deck.storage import FsspecStorage, LocalStorage, Storage, StorageWrapper


class _OneByOne(StorageWrapper):
    """A store whose ``get_many`` issues one request after the other (the base class's)."""

    get_many = Storage.get_many


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--s3", action="store_true", help="SeaweedFS on loopback instead of a local dir")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None, help="work directory (default: a temp dir, removed)")
    a = p.parse_args(argv)
    return in_workdir(a.out, "deck-bench-manifests-", lambda work: _run(a, work))


def _run(a: argparse.Namespace, work: str) -> int:
    server = None
    if a.s3:
        from deck.testing.s3_server import SeaweedS3

        server = SeaweedS3(workdir=os.path.join(work, "seaweed")).start()
    try:
        storage: Storage = (
            FsspecStorage(server.uri("run"), server.storage_options)
            if server is not None
            else LocalStorage(os.path.join(work, "run"))
        )
        w = Workload(tables=4, rows=2000, dim=8, batch=64, steps_per_delta=1)
        tr = ZipfTrainer(w, storage)
        tr.save("full")
        t0 = time.perf_counter()
        for _ in range(a.steps):
            tr.interval()
            tr.save()
        print(
            f"{a.steps + 1} checkpoints ({w.describe()}) written to {storage.uri} in "
            f"{time.perf_counter() - t0:.1f} s",
            flush=True,
        )
        objects = len(storage.list(""))
        found = len(manifest_keys(storage))
        one_by_one = _OneByOne(storage)
        results = {
            f"find: list everything ({objects} objects)": median_s(
                lambda: storage.list(""), a.repeats
            ),
            f"find: manifest_keys ({found} keys)": median_s(
                lambda: manifest_keys(storage), a.repeats
            ),
            "read: one request after the other": median_s(
                lambda: read_manifests(one_by_one), a.repeats
            ),
            "read: read_manifests (get_many)": median_s(lambda: read_manifests(storage), a.repeats),
        }
        assert len(read_manifests(storage)) == a.steps + 1
    finally:
        if server is not None:
            server.stop()
    names = list(results)
    print()
    for name, t in results.items():
        print(f"{name:<48} {t:>8.4f} s")
    print(
        f"finding: {results[names[0]] / results[names[1]]:.0f}x faster; reading: "
        f"{results[names[2]] / results[names[3]]:.2f}x faster"
    )
    print("reproduce: python " + " ".join(sys.argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
