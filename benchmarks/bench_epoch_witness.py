"""What the epoch witnesses (deck.format.epochs) cost, after ``--epochs`` epochs, on a local
store: a writer's per epoch (create-if-absent, a listing, a delete of the oldest kept, in the
commit thread), and the listing a restore adds (``newest_witness``), with the newest 4 kept as
writers keep them and, for comparison, with every witness kept.

    python benchmarks/bench_epoch_witness.py [--epochs 1000] [--repeats 200]
"""

from __future__ import annotations

import argparse
import tempfile
import time

from _timing import median_s

from deck.format.epochs import EpochWitnesses, newest_witness, witness_body, witness_key
from deck.storage import LocalStorage


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=200)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as work:
        kept = LocalStorage(f"{work}/kept")
        writer = EpochWitnesses(kept)
        t0 = time.perf_counter()
        for e in range(a.epochs):
            writer.before_commit(e, 10 * e)
        per_epoch = (time.perf_counter() - t0) / a.epochs
        every = LocalStorage(f"{work}/every")
        for e in range(a.epochs):
            every.put(witness_key(e), witness_body(e, 10 * e))
        assert newest_witness(kept) == newest_witness(every) == a.epochs - 1
        print(f"{a.epochs} epochs")
        print(f"  writer, per epoch (commit thread): {per_epoch * 1e3:.2f} ms")
        for name, store in (("as writers keep them", kept), ("every one kept", every)):
            names = len(store.list("_epochs/"))
            took = median_s(lambda s=store: newest_witness(s), a.repeats)  # type: ignore[misc]
            print(f"  newest_witness, {name} ({names} names): {took * 1e6:.0f} us")


if __name__ == "__main__":
    main()
