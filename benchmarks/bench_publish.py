"""Does the publisher (``DeckConfig.publish``) slow the checkpointer or training?

The 2-rank gloo DLRM of ``deck.demo`` (``--tables`` x ``--rows`` x ``--dim`` fp32,
EXACT_ROWWISE_ADAGRAD, Zipf ids, batch ``--batch`` per rank) trains ``--steps`` steps with a
checkpoint (local directory, full first, then a delta every ``--delta-every`` steps), once
without and once with a publisher (another local directory, a delta every ``--publish-every``
steps), alternating ``--rounds`` times to spread the noise of a shared machine. Per run:

- train step: mean time of the training step alone (forward, backward, optimizer);
- step wall: mean time of one whole loop iteration (training + ``ckpt.step``, which takes the
  checkpoint / publish snapshots): what the job's throughput sees;
- checkpoint stall: mean ``stall_s`` of the checkpoint deltas (the full is left out);
- publish stall: mean ``stall_s`` of the publish deltas.

Then ``deck follow --once``-style catch-ups (``deck.serve.follow.Follower``) of the publish chain:
the first materialises it, a later one applies only the deltas since; bytes read are reported
against what a restore of the step reads.

    python benchmarks/bench_publish.py [--rows 100000] [--steps 120] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

import torch.multiprocessing as mp


def _worker(rank: int, world_size: int, port: int, a: dict[str, Any], work: str, out: str) -> None:
    import logging

    import deck
    from deck.demo import ModelSpec, build_model, train_step
    from deck.processes import end_rank, init_process_group

    warnings.filterwarnings("ignore")
    logging.getLogger().setLevel(logging.ERROR)
    init_process_group(rank, world_size, port)
    spec = ModelSpec(num_tables=a["tables"], rows=a["rows"], dim=a["dim"], batch=a["batch"])
    results = []
    for r in range(a["rounds"]):
        for publish in (False, True) if r % 2 == 0 else (True, False):
            model, opt = build_model(spec)
            tag = f"r{r}-{'pub' if publish else 'nopub'}"
            config = deck.DeckConfig(
                uri=os.path.join(work, tag, "ckpt"),
                delta_every_steps=a["delta_every"],
                lease_ttl_s=None,
                publish=deck.PublishConfig(
                    uri=os.path.join(work, tag, "pub"), every_steps=a["publish_every"]
                )
                if publish
                else None,
            )
            train, wall = [], []
            with deck.enable(model, [opt], config) as ck:
                ck.step(0)
                ck.flush()  # the fulls are not what is measured
                for step in range(1, a["steps"] + 1):
                    t0 = time.perf_counter()
                    train_step(model, opt, spec, step)
                    t1 = time.perf_counter()
                    ck.step(step)
                    wall.append(time.perf_counter() - t0)
                    train.append(t1 - t0)
                ck.flush()
                results.append(
                    {
                        "publish": publish,
                        "train_s": statistics.mean(train),
                        "wall_s": statistics.mean(wall),
                        "ckpt_stall_s": statistics.mean(
                            h.stall_s for h in ck.history if h.kind == "delta"
                        ),
                        "ckpt_deltas": sum(h.kind == "delta" for h in ck.history),
                        "pub_stall_s": statistics.mean(
                            [h.stall_s for h in ck.published if h.kind == "delta"] or [0.0]
                        ),
                        "publishes": len(ck.published),
                        "pub_uri": None if config.publish is None else config.publish.uri,
                    }
                )
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    end_rank()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--delta-every", type=int, default=20)
    p.add_argument("--publish-every", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args(argv)
    from deck.processes import free_port
    from deck.serve.follow import Follower
    from deck.storage import open_storage

    with tempfile.TemporaryDirectory() as work:
        out = os.path.join(work, "results.json")
        mp.spawn(_worker, args=(2, free_port(), vars(a), work, out), nprocs=2)
        with open(out) as f:
            res = json.load(f)
        print(f"command: python {' '.join(sys.argv)}")
        print(
            f"{'run':<8} {'train step':>11} {'step wall':>10} {'ckpt stall':>11} {'pub stall':>10}"
        )
        for r in res:
            print(
                f"{'publish' if r['publish'] else 'none':<8} {r['train_s'] * 1e3:>9.1f}ms "
                f"{r['wall_s'] * 1e3:>8.1f}ms {r['ckpt_stall_s'] * 1e3:>9.1f}ms "
                f"{r['pub_stall_s'] * 1e3:>8.1f}ms  ({r['ckpt_deltas']} ckpt deltas, "
                f"{r['publishes']} publishes)"
            )
        agg = {
            pub: {
                k: statistics.mean(r[k] for r in res if r["publish"] == pub)
                for k in ("train_s", "wall_s", "ckpt_stall_s", "pub_stall_s")
            }
            for pub in (False, True)
        }
        for k, what in (
            ("train_s", "train step"),
            ("wall_s", "step wall"),
            ("ckpt_stall_s", "ckpt stall"),
        ):
            print(
                f"ratio with/without publish, {what}: {agg[True][k] / agg[False][k]:.3f} "
                f"({agg[True][k] * 1e3:.1f} / {agg[False][k] * 1e3:.1f} ms)"
            )
        # The loading service on the last publish chain: materialise, then catch up.
        pub_uri = next(r["pub_uri"] for r in reversed(res) if r["publish"])
        serve = os.path.join(work, "serve")
        f0 = Follower(open_storage(pub_uri), serve)
        u = f0.catch_up()
        print(
            f"follow (fresh): step {u.step}, {len(u.applied)} checkpoints, "
            f"{u.bytes_read / 2**20:.1f} MiB read, {u.seconds:.2f} s (writing the output: "
            f"{u.write_s:.2f} s)"
        )
        # The per-delta path: a follower holding the step before the newest one catches up.
        from deck.read.catalog import read_manifests
        from deck.read.lineage import build_graph, chain_bytes, cheapest_chain

        ms = read_manifests(f0.storage)
        chain = cheapest_chain(build_graph(ms, f0.storage.uri), u.step)
        older = os.path.join(work, "serve-old")
        f1 = Follower(open_storage(pub_uri), older)
        prev = chain[-2].step
        f1.materialise(prev)
        u1 = f1.catch_up()
        print(
            f"follow (incremental): step {prev} -> {u1.step} ({u1.how}), {len(u1.applied)} "
            f"checkpoint(s), {u1.bytes_read / 2**20:.2f} MiB read vs "
            f"{chain_bytes(chain) / 2**20:.1f} MiB for a restore of the chain, {u1.seconds:.2f} s "
            f"(writing the output: {u1.write_s:.2f} s)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
