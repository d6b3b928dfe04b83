"""The Kafka publisher (``PublishConfig(uri="kafka://...")``) against the file publisher.

The 2-rank gloo DLRM of ``deck.demo`` trains ``--steps`` steps publishing a delta every
``--publish-every`` steps, alternating ``--rounds`` times between a file publisher (a local
directory) and the Kafka sink (a Tansu broker on loopback, the test fixture), with a loader
(``deck follow kafka://... `` as a subprocess) following the topic. Reported:

- publish stall: median ``stall_s`` of the publish deltas, Kafka vs file (the ratio);
- freshness: seconds from the start of ``ckpt.step(s)`` to the loader's output holding step
  ``s`` (the loader prints each applied step; its line is timestamped as it arrives);
- sink throughput: ``--files`` files of 4 MiB through ``KafkaSinkStorage.put`` from the stager's
  ``upload_concurrency`` threads vs a plain confluent-kafka producer (same settings: acks=all,
  idempotent, same message size) sending the same bytes to the same broker and waiting once at
  the end; both warm (topic made, connected) before the clock; medians of ``--repeats``.
  ``--throughput-only`` measures just this.

    python benchmarks/bench_kafka.py [--rows 50000] [--steps 60] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
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
        for kind in ("file", "kafka") if r % 2 == 0 else ("kafka", "file"):
            model, opt = build_model(spec)
            tag = f"r{r}-{kind}"
            pub = (
                deck.PublishConfig(
                    uri=f"kafka://{a['bootstrap']}/{tag}",
                    state_uri=os.path.join(work, tag, "state"),
                    every_steps=a["publish_every"],
                )
                if kind == "kafka"
                else deck.PublishConfig(
                    uri=os.path.join(work, tag, "pub"), every_steps=a["publish_every"]
                )
            )
            config = deck.DeckConfig(
                uri=os.path.join(work, tag, "ckpt"),
                delta_every_steps=10**9,  # publishes only: the stall measured is theirs
                lease_ttl_s=None,
                # Both publishers spool and upload in the background (the Kafka sink is not a
                # local path, so it gets this tier anyway): the same staging path, compared.
                staging=deck.StagingConfig(
                    tiers="cpu-ssd-remote", spool_dir=os.path.join(work, tag, "spool")
                ),
                publish=pub,
            )
            started: dict[int, float] = {}
            with deck.enable(model, [opt], config) as ck:
                ck.step(0)
                ck.flush()
                for step in range(1, a["steps"] + 1):
                    train_step(model, opt, spec, step)
                    started[step] = time.time()
                    ck.step(step)
                ck.flush()
                stalls = [h.stall_s for h in ck.published if h.kind == "delta"]
            results.append({"kind": kind, "tag": tag, "stalls": stalls, "started": started})
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    end_rank()


def _loader(uri: str, out: str, arrived: dict[int, float]) -> subprocess.Popen[str]:
    exe = shutil.which("deck", path=os.path.dirname(sys.executable)) or "deck"
    proc = subprocess.Popen(
        [exe, "follow", uri, "--out", out], stdout=subprocess.PIPE, text=True, bufsize=1
    )

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("step "):
                arrived[int(line.split()[1])] = time.time()

    threading.Thread(target=read, daemon=True).start()
    return proc


def _throughput(
    bootstrap: str, files: int, size: int, repeats: int, threads: int
) -> tuple[float, float]:
    """(sink MB/s, plain producer MB/s), medians of ``repeats``, taken in alternating order.

    The sink is driven as the stager drives it: ``threads`` upload threads (the default
    ``upload_concurrency``) each putting whole files, a put returning once the broker
    acknowledged the file. The plain producer sends the same bytes in the same 1 MB messages
    and waits for them once, at the end (the most a producer can do without per-file acks).
    Both start warm: their topic created and one message acknowledged before the clock starts
    (a topic's creation and a producer's first connection are not throughput)."""
    from concurrent.futures import ThreadPoolExecutor

    from confluent_kafka import Producer

    from deck.format.stream import KafkaTarget, split
    from deck.storage import LocalStorage
    from deck.trainer.kafka_sink import KafkaSinkStorage

    payload = os.urandom(size)
    rates: dict[str, list[float]] = {"sink": [], "plain": []}

    def chunk(n: int) -> str:
        return f"step-{n:012d}/0123456789abcdef/rank-00000/t/c0-r0-000000.chunk"

    def run_sink(d: str, topic: str) -> float:
        sink = KafkaSinkStorage(LocalStorage(d), KafkaTarget(bootstrap, topic), 1)
        sink.put(chunk(files), b"warm")
        with ThreadPoolExecutor(threads) as pool:
            t0 = time.perf_counter()
            list(pool.map(lambda n: sink.put(chunk(n), payload), range(files)))
            return time.perf_counter() - t0

    def run_plain(d: str, topic: str) -> float:
        KafkaSinkStorage(LocalStorage(d), KafkaTarget(bootstrap, topic), 1).ensure_topic()
        plain = Producer(
            {
                "bootstrap.servers": bootstrap,
                "enable.idempotence": True,
                "acks": "all",
                "linger.ms": 2,
                "message.max.bytes": 1_000_000 + 4096,  # the sink's setting
            }
        )
        plain.produce(topic, b"warm", partition=1)
        plain.flush()
        t0 = time.perf_counter()
        for _ in range(files):
            for piece in split(payload, 1_000_000):
                plain.produce(topic, bytes(piece), partition=1)
        plain.flush()
        return time.perf_counter() - t0

    with tempfile.TemporaryDirectory() as d:
        for i in range(repeats):
            order = [("sink", run_sink), ("plain", run_plain)]
            for name, run in order if i % 2 == 0 else order[::-1]:
                rates[name].append(files * size / run(d, f"tp-{name}-{i}") / 1e6)
    return statistics.median(rates["sink"]), statistics.median(rates["plain"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=50_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--publish-every", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--files", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--throughput-only", action="store_true", help="only the sink's throughput")
    a = p.parse_args(argv)
    from deck.config import StagingConfig
    from deck.processes import free_port
    from deck.testing.kafka_broker import TansuBroker

    with TansuBroker() as broker, tempfile.TemporaryDirectory() as work:
        print(f"command: python {' '.join(sys.argv)}  (broker: Tansu on loopback)")
        threads = StagingConfig().upload_concurrency
        if a.throughput_only:
            _print_throughput(broker.bootstrap, a.files, a.repeats, threads)
            return 0
        args = {**vars(a), "bootstrap": broker.bootstrap}
        arrived: dict[str, dict[int, float]] = {}
        loaders = []
        for r in range(a.rounds):
            tag = f"r{r}-kafka"
            arrived[tag] = {}
            loaders.append(
                _loader(broker.uri(tag), os.path.join(work, f"serve-{tag}"), arrived[tag])
            )
        out = os.path.join(work, "results.json")
        try:
            mp.spawn(_worker, args=(2, free_port(), args, work, out), nprocs=2)
            time.sleep(3)  # the loaders' last lines (not part of any measurement)
        finally:
            for proc in loaders:
                proc.terminate()
                proc.wait(timeout=30)
        with open(out) as f:
            res = json.load(f)
        stall = {
            k: statistics.median(s for r in res if r["kind"] == k for s in r["stalls"])
            for k in ("file", "kafka")
        }
        print(
            f"publish stall, median: file {stall['file'] * 1e3:.1f} ms, kafka "
            f"{stall['kafka'] * 1e3:.1f} ms, ratio kafka/file {stall['kafka'] / stall['file']:.2f}"
        )
        fresh = [
            arrived[r["tag"]][s] - r["started"][str(s)]
            for r in res
            if r["kind"] == "kafka"
            for s in arrived[r["tag"]]
            if str(s) in r["started"]
        ]
        if fresh:
            print(
                f"freshness step() -> loader output: median {statistics.median(fresh):.2f} s, "
                f"max {max(fresh):.2f} s over {len(fresh)} publishes"
            )
        _print_throughput(broker.bootstrap, a.files, a.repeats, threads)
    return 0


def _print_throughput(bootstrap: str, files: int, repeats: int, threads: int) -> None:
    sink, plain = _throughput(bootstrap, files, 4 * 2**20, repeats, threads)
    print(
        f"throughput, {files} x 4 MiB files: sink ({threads} upload threads) {sink:.0f} MB/s, "
        f"plain producer {plain:.0f} MB/s, ratio {sink / plain:.2f}"
    )


if __name__ == "__main__":
    sys.exit(main())
