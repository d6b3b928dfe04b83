"""Live apply (``deck.serve.live.LiveModel``): rows/s written into a serving model, request
latency with and without applies, and staleness (publish commit -> visible to requests).

The 2-rank gloo DLRM of ``deck.demo`` (``--tables`` x ``--rows`` x ``--dim`` fp32, Zipf ids,
batch ``--batch`` per rank) trains ``--steps`` steps publishing a delta every
``--publish-every`` steps to a local directory. Meanwhile this process serves a float copy and
TorchRec's int8 quantisation of its tables (an unsharded DLRM), applies every publish with a
background applier (``LiveModel.start``, polling every ``--poll`` s, LiveConfig's by default),
and ``--readers`` threads send requests (``--request-batch`` samples, Zipf ids) alternately to
the float and int8 copies under ``live.serving(kjt)`` (the whole DLRM's forward: the dense part
is applied with each version too), timing each. The trainer waits after its
first publish (a full) until the serving model serves it: the deltas' staleness is the steady
state's. Then, training over, ``--repeats`` rounds of: the applies repeated without training
(rollback to the oldest kept step, resume, apply forward: the same deltas), then as long idle.

    python benchmarks/bench_serve_apply.py [--rows 100000] [--steps 60] [--repeats 3]
        [--rows-per-s N|none|default] [--threads N] [--phase S] [--source files|kafka]

``--source kafka`` publishes to a topic of a local Tansu broker (the tests' broker) and serves
from it with ``KafkaSource``: staleness and rows/s while training only (a topic is not
replayed). ``--threads``: torch's intra-op threads in the serving process (0: torch's default).

Prints: rows/s per switch (median, and the total rows over the total apply time), staleness of
the deltas (the commit record's file time -> visible; median / max, and the part until the poll
found it), latency p50/p99 of requests while training + applying, and of each round applying
and idle, the median of the rounds' p99s and their ratio, the requests that waited for their
rows, the load average around the rounds and each round's ratio. The machine is shared (2
vCPUs for training ranks, applier and readers together): compare within one run.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
import warnings
from typing import Any

import torch
import torch.multiprocessing as mp


def _trainer(
    rank: int, world_size: int, port: int, a: dict[str, Any], ckpt: str, pub: str, ready: str
) -> None:
    import deck
    from deck.demo import ModelSpec, build_model, train_step
    from deck.processes import end_rank, init_process_group

    warnings.filterwarnings("ignore")
    logging.getLogger().setLevel(logging.ERROR)
    init_process_group(rank, world_size, port)
    spec = ModelSpec(num_tables=a["tables"], rows=a["rows"], dim=a["dim"], batch=a["batch"])
    model, opt = build_model(spec)
    config = deck.DeckConfig(
        uri=ckpt,
        delta_every_steps=10_000,
        publish=deck.PublishConfig(
            uri=pub,
            every_steps=a["publish_every"],
            # a Kafka topic: the commit records go to a state URI beside the checkpoints
            state_uri=f"{ckpt}-state" if pub.startswith("kafka://") else None,
        ),
    )
    with deck.enable(model, [opt], config) as ck:
        for step in range(a["steps"] + 1):
            if step:
                train_step(model, opt, spec, step)
            ck.step(step)
            if step == 0:
                # The serving model loads the first full before the deltas are timed: staleness
                # is the steady state's, not a catch-up's (a delta committed while the first
                # full of 400k rows is read and written waits for it).
                ck.flush()
                while not os.path.exists(ready):
                    time.sleep(0.05)
        ck.flush()
    end_rank()


def _serving(a: argparse.Namespace) -> dict[str, torch.nn.Module]:
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.inference.modules import quantize_embeddings
    from torchrec.models.dlrm import DLRM

    tables = [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=a.dim, num_embeddings=a.rows, feature_names=[f"f{i}"]
        )
        for i in range(a.tables)
    ]
    dlrm = DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=tables),
        dense_in_features=13,
        dense_arch_layer_sizes=[32, a.dim],
        over_arch_layer_sizes=[32, 1],
    )
    q8 = quantize_embeddings(copy.deepcopy(dlrm), dtype=torch.qint8, inplace=False)
    return {"float": dlrm, "int8": q8}


class Readers:
    """Request threads; each latency goes to the list of the current phase."""

    def __init__(
        self,
        live: Any,
        models: dict[str, torch.nn.Module],
        reqs: list[tuple[torch.Tensor, Any]],
        n: int,
    ):
        self.live, self.reqs = live, reqs
        self.models = list(models.values())
        self.phase: list[float] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        k = i
        while not self.stop.is_set():
            dense, kjt = self.reqs[k % len(self.reqs)]
            model = self.models[k % len(self.models)]
            t0 = time.perf_counter()
            with self.live.serving(kjt), torch.no_grad():
                model(dense, kjt)
            self.phase.append(time.perf_counter() - t0)
            k += 1

    def measure(self) -> list[float]:
        out, self.phase = self.phase, []
        return out

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))] if xs else float("nan")


def _line(what: str, lat: list[float]) -> str:
    return (
        f"{what:<28} {len(lat):>7} requests  p50 {_pct(lat, 50) * 1e3:7.3f} ms  "
        f"p99 {_pct(lat, 99) * 1e3:7.3f} ms  max {max(lat, default=0) * 1e3:7.2f} ms"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tables", type=int, default=4)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--publish-every", type=int, default=5)
    p.add_argument("--poll", type=float, default=None, help="default: LiveConfig's poll_s")
    p.add_argument("--readers", type=int, default=2)
    p.add_argument("--request-batch", type=int, default=64)
    p.add_argument("--slice-rows", type=int, default=4096)
    p.add_argument("--rows-per-s", default="default", help="a number, none, or default")
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="rounds of (applies only, idle) after training; latency: the median of their p99s",
    )
    p.add_argument(
        "--source",
        choices=("files", "kafka"),
        default="files",
        help="publish to a local directory (files) or to a Kafka topic on a local Tansu broker "
        "(kafka: staleness and rows/s while training only; a topic is not replayed)",
    )
    p.add_argument("--phase", type=float, default=None, help="seconds per phase of a round")
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch intra-op threads of the serving process (0: torch's default, one per core)",
    )
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    warnings.filterwarnings("ignore")
    logging.getLogger().setLevel(logging.ERROR)
    from deck.demo import ModelSpec, make_batch
    from deck.processes import free_port
    from deck.serve.live import LiveConfig, LiveModel, VersionSwitch
    from deck.storage import LocalStorage

    small = ModelSpec(num_tables=a.tables, rows=a.rows, dim=a.dim, batch=a.request_batch)
    reqs = [make_batch(small, 10_000 + i, 0)[:2] for i in range(64)]
    with tempfile.TemporaryDirectory() as work:
        ckpt, pub = os.path.join(work, "ckpt"), os.path.join(work, "pub")
        os.makedirs(pub)
        broker = source = None
        if a.source == "kafka":
            from deck.serve.live_kafka import KafkaSource
            from deck.testing.kafka_broker import TansuBroker

            broker = TansuBroker().start()
            pub = broker.uri("bench-serve-apply")
            source = KafkaSource(pub, wait_s=30)
            a.repeats = 0
        models = _serving(a)
        switches: list[VersionSwitch] = []
        ready = os.path.join(work, "serving")
        if a.poll is None:
            a.poll = LiveConfig().poll_s
        cap = {"default": LiveConfig().rows_per_s, "none": None}.get(a.rows_per_s)
        rows_per_s = cap if a.rows_per_s in ("default", "none") else float(a.rows_per_s)

        def switched(s: VersionSwitch) -> None:
            switches.append(s)
            if not os.path.exists(ready):
                open(ready, "w").close()

        live = LiveModel(
            list(models.values()),
            LocalStorage(pub) if source is None else source,
            LiveConfig(
                poll_s=a.poll,
                slice_rows=a.slice_rows,
                rows_per_s=rows_per_s,
                keep_versions=a.steps // a.publish_every + 1,
            ),
            on_switch=switched,
        )
        ctx = mp.spawn(
            _trainer,
            args=(2, free_port(), vars(a), ckpt, pub, ready),
            nprocs=2,
            join=False,
        )
        readers = Readers(live, models, reqs, a.readers)
        t0 = time.perf_counter()
        live.start()
        while not ctx.join(timeout=0.5):
            pass
        live.stop()
        live.poll()  # the last publishes
        train_s = time.perf_counter() - t0
        with_training = readers.measure()
        live_switches = list(switches)
        # Applies alone: back to the oldest kept step, forward again (the same deltas), then
        # as long idle (no applies), ``--repeats`` times.
        kept = live.kept_steps()
        switches.clear()
        rounds, applying, idle, apply_only_s = 0, [], [], 0.0
        phase_s = a.phase if a.phase is not None else max(5.0, train_s / 3)
        load = [os.getloadavg()[0]]
        for _ in range(a.repeats):
            t1 = time.perf_counter()
            while time.perf_counter() - t1 < phase_s and kept:
                live.rollback(kept[-1])
                live.resume()
                live.poll()
                rounds += 1
            applying.append(readers.measure())
            apply_only_s += time.perf_counter() - t1
            time.sleep(phase_s)  # idle: no applies
            idle.append(readers.measure())
        load.append(os.getloadavg()[0])
        replay = [s for s in switches if s.kind == "delta"]
        readers.close()
        if source is not None:
            source.close()
        if broker is not None:
            broker.stop()
    print(f"command: python {' '.join(sys.argv)}")
    print(
        f"torch intra-op threads {torch.get_num_threads()}; load average (1 min) at the "
        f"rounds' start and end: {load[0]:.2f}, {load[-1]:.2f} on {os.cpu_count()} cores"
    )
    deltas = [s for s in live_switches if s.kind == "delta"]
    rates = [s.rows / s.apply_s for s in replay if s.apply_s > 0]
    total = sum(s.rows for s in replay) / max(sum(s.apply_s for s in replay), 1e-9)
    print(
        f"switches while training: {len(live_switches)} ({len(deltas)} deltas, "
        f"median {statistics.median(s.rows for s in deltas) if deltas else 0:.0f} rows, "
        f"{statistics.median(s.slices for s in deltas) if deltas else 0:.0f} slices); "
        f"replayed without training: {len(replay)} deltas in {rounds} rounds (with rollbacks)"
    )
    if not rates:  # no replay (a Kafka source): the deltas applied while training
        rates = [s.rows / s.apply_s for s in live_switches if s.kind == "delta" and s.apply_s > 0]
        total = sum(s.rows for s in live_switches if s.kind == "delta") / max(
            sum(s.apply_s for s in live_switches if s.kind == "delta"), 1e-9
        )
    print(
        f"rows/s written (2 served copies, float + int8): median {statistics.median(rates):,.0f} "
        f"per switch, {total:,.0f} overall"
        if rates
        else "rows/s: no deltas replayed"
    )
    if deltas:
        print(
            f"per delta while training: prepare (read, check, encode) median "
            f"{statistics.median(s.prepare_s for s in deltas):.3f} s, write (first slice to "
            f"switch) median {statistics.median(s.apply_s for s in deltas):.3f} s"
        )
    stale = [s.staleness_s for s in deltas if s.staleness_s is not None]
    if stale:
        found = [s.found_s for s in deltas if s.found_s is not None]
        print(
            f"staleness ({a.source} source; the commit record's file time -> visible to "
            f"requests) of the deltas while training, poll {a.poll} s, cap {rows_per_s} rows/s: median "
            f"{statistics.median(stale):.3f} s, max {max(stale):.3f} s; of which found by the "
            f"poll: median {statistics.median(found) if found else float('nan'):.3f} s"
        )
    print(_line("latency, training + applies", with_training))
    if not applying:
        return 0
    for i, (ap, no) in enumerate(zip(applying, idle, strict=True)):
        print(_line(f"latency, applies only #{i + 1}", ap))
        print(_line(f"latency, idle #{i + 1}", no))
    p99_ap = statistics.median(_pct(x, 99) for x in applying)
    p99_no = statistics.median(_pct(x, 99) for x in idle)
    ratios = [_pct(x, 99) / _pct(y, 99) for x, y in zip(applying, idle, strict=True)]
    print(
        f"p99, median of {a.repeats} rounds: {p99_ap * 1e3:.3f} ms applying, "
        f"{p99_no * 1e3:.3f} ms idle: {p99_ap / p99_no:.2f}x ({apply_only_s:.1f} s of applies); "
        f"per round {', '.join(f'{r:.2f}' for r in ratios)}x (median "
        f"{statistics.median(ratios):.2f}x)"
    )
    print(f"requests that waited for their rows: {live.gate.waits}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
