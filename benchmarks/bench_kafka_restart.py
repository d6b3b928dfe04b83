"""What a restarted live source (``deck.serve.live_kafka.KafkaSource``) reads of a long topic.

A synthetic 2-rank publisher (``deck.testing.kafka_stream.SynthPublisher``, the real Kafka sink)
publishes ``--steps`` steps, a full every ``--full-every``, to a Tansu broker on loopback (the
test fixture). Then a fresh source serves the topic (from its newest full to its end, every step
applied as the live model applies it) twice:

- ``recorded``: as published, each rank partition opened at the newest full's start record;
- ``no records``: the same topic and state with the start records deleted, i.e. a topic an older
  deck published, read as every restart read it before the records (from the oldest message).

Reported per case: the messages and value bytes the source read on the rank partitions (with no
records: the whole partitions), the markers it read on the control partition to find where to
start (back from the end until the fulls it may start at), the first and last step it served,
and seconds to serve.

    python benchmarks/bench_kafka_restart.py [--steps 200] [--full-every 20] [--rows 12]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any


def _serve(uri: str, state_uri: str) -> dict[str, Any]:
    from deck.format.stream import CONTROL_PARTITION
    from deck.serve.live_kafka import KafkaSource

    source = KafkaSource(uri, state_uri=state_uri, wait_s=60)
    t0 = time.perf_counter()
    served, steps = None, []
    try:
        while plans := source.next_plans(served, frozenset()):
            m = plans[0].chain[-1]
            served = m.state
            steps.append(m.step)
        ranks = [r for p, r in source.readers.items() if p != CONTROL_PARTITION]
        return {
            "messages": sum(r.messages for r in ranks),
            "markers read to find the start": source.scanned,
            "bytes": sum(r.bytes for r in ranks),
            "steps": [steps[0], steps[-1]] if steps else [],
            "seconds": round(time.perf_counter() - t0, 3),
        }
    finally:
        source.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--full-every", type=int, default=20)
    ap.add_argument("--rows", type=int, default=12, help="rows changed per step")
    a = ap.parse_args()

    from deck.testing.kafka_broker import TansuBroker
    from deck.testing.kafka_stream import SynthPublisher

    with TansuBroker() as broker, tempfile.TemporaryDirectory() as work:
        uri = broker.uri(f"restart-{uuid.uuid4().hex[:8]}")
        state = Path(work, "state")
        pub = SynthPublisher(uri, str(state))
        for i in range(a.steps):
            pub.publish("full" if i % a.full_every == 0 else "delta", rows=a.rows)
        pub.close()
        old = Path(work, "old-state")
        shutil.copytree(state, old)
        for record in old.glob("step-*/*/stream-*.json"):
            record.unlink()
        result = {
            "steps": a.steps,
            "full_every": a.full_every,
            "recorded": _serve(uri, str(state)),
            "no records": _serve(uri, str(old)),
        }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
