"""``deck.enable`` with a Kafka publisher whose brokers do not answer, on 2 real gloo ranks: rank
0 says what it is doing (an INFO line naming the brokers), and every rank fails with a
StorageError naming the brokers and what to fix, instead of starting a publisher whose every
publish would fail. Two ways of not answering: nobody listens at the port (refused at once), and
a listener that accepts connections but never speaks Kafka (librdkafka's metadata lookup gives
up after ``METADATA_TIMEOUT_S``, lowered here to keep the test short)."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

import deck
from deck.at_exit import still_open
from deck.demo import ModelSpec, build_model
from deck.testing.dist_harness import run_ranks
from deck.trainer import kafka_sink

pytestmark = pytest.mark.slow


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _enable_fails(rank: int, world_size: int, root: str, bootstrap: str) -> None:
    kafka_sink.METADATA_TIMEOUT_S = 2.0  # the real 10 s, shortened: same code path
    records = _Records()
    log = logging.getLogger("deck.trainer.kafka_sink")
    log.setLevel(logging.INFO)
    log.addHandler(records)
    model, opt = build_model(ModelSpec(num_tables=2, rows=100, dim=8, batch=8))
    config = deck.DeckConfig(
        uri=f"{root}/ck",
        lease_ttl_s=None,
        publish=deck.PublishConfig(uri=f"kafka://{bootstrap}/updates", state_uri=f"{root}/pub"),
    )
    with pytest.raises(deck.StorageError) as raised:
        deck.enable(model, [opt], config)
    text = str(raised.value)
    assert f"Start a broker at {bootstrap}" in text and "PublishConfig.uri" in text, text
    assert "kafka publisher" in text.lower(), text
    if rank == 0:
        assert any(f"connecting to {bootstrap} for topic updates" in ln for ln in records.lines)
    assert not still_open()  # the failed construction gave back what it took
    dist.barrier()  # every rank got here: none waits in a collective the others left


def test_enable_with_nobody_at_the_port_fails_on_every_rank(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_ranks(_enable_fails, str(tmp_path), f"127.0.0.1:{port}")


@pytest.fixture
def silent_listener() -> Iterator[str]:
    """A port that accepts TCP connections (the kernel's backlog) and never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield f"127.0.0.1:{s.getsockname()[1]}"


def test_enable_with_a_broker_that_never_answers_fails_on_every_rank(
    tmp_path: Path, silent_listener: str
) -> None:
    run_ranks(_enable_fails, str(tmp_path), silent_listener)


def test_unreachable_names_each_address() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    why = kafka_sink.unreachable(f"127.0.0.1:{port},no-such-host.invalid:9092")
    assert why is not None and f"127.0.0.1:{port}: " in why and "no-such-host.invalid:9092: " in why
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        assert kafka_sink.unreachable(f"127.0.0.1:{port},127.0.0.1:{s.getsockname()[1]}") is None
