"""A stateful model-based test of the Kafka loader (`deck follow kafka://`): Hypothesis draws
sequences of publishes, faults and loader runs against a real broker (Tansu) and real files.

Rules (each example has its own topic and directories):

- ``publish``: the real publisher path (:class:`deck.testing.kafka_stream.SynthPublisher`: the
  Kafka sink, commit records at the state URI, then the marker) publishes a full or a delta;
- ``publish_damaged``: the same, with one byte of its first message on a partition flipped on
  the way (the checksum header is the original's);
- ``inject``: garbage, a forged marker or a forged segment on any partition;
- ``foreign_publish``: another run (its own state URI) publishes to the same topic;
- ``restart_broker``: the broker restarts on the same port with its memory storage empty (the
  topic is gone; publishers reconnect);
- ``run_loader``: the loader catches up (in this process, a new one each time: a restart);
- ``kill_loader``: a loader in a forked child SIGKILLed at a drawn failpoint of its apply, its
  state switch or its loader full (:data:`POINTS`), on its 1st..3rd hit;
- ``lose_out``: the loader's --out is wiped (a new machine): it starts from its loader full;
- ``catalog`` / ``damage``: a catalog of the commit log is written at the loader fulls' URI
  or the publisher's state URI (as ``deck gc`` there does), or the newest one or a segment of
  it damaged: the loader reads its newest full through it.

Invariants, after every loader run: the output is a committed step of the served run, bitwise
(:func:`_check_served`); a loader holding state never raises. At the end a clean full is
published and a loader run must serve exactly the latest step.

Bounded and deterministic: ``DECK_KAFKA_EXAMPLES`` examples (default 4) of at most
``DECK_KAFKA_STEPS`` rules (default 12), derandomized unless ``DECK_KAFKA_RANDOM=1`` (``make
fuzz-kafka``); no sleeps pick moments (the kills are failpoints).
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    rule,
    run_state_machine_as_test,
)

from deck.format.commit_log import (
    CATALOG_ROOT,
    catalog_key,
    listed_segments,
    listed_seqs,
    segment_key,
)
from deck.format.stream import marker_value
from deck.read.catalog import manifest_keys, read_manifests
from deck.read.indexed import compact
from deck.serve.kafka_follow import KafkaFollower
from deck.storage import LocalStorage
from deck.testing.kafka_broker import TansuBroker
from deck.testing.kafka_child import LoaderChildren, loader_from
from deck.testing.kafka_stream import SynthPublisher, differences, inject, read_output

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("DECK_KAFKA_EXAMPLES", "5"))
STEPS = int(os.environ.get("DECK_KAFKA_STEPS", "12"))
RANDOM = os.environ.get("DECK_KAFKA_RANDOM") == "1"
FULL_EVERY = 2
POINTS = (
    "kafka_follow.fetched",
    "kafka_follow.written",
    "follow.state.before_switch",
    "follow.state.switched",
    "follow.state.written",
    "kafka_follow.full.before_commit",
)
_HEADERS_MARKER = [("deck", b"1"), ("type", b"marker")]


def _forged(partition: int, form: str, run: str) -> tuple[bytes, list[Any]]:
    """A message that is not one of the publisher's (see :func:`inject`)."""
    if form == "bytes":
        return b"\x00\xffnot deck\x13" * 7, []
    if form == "bad-checksum":
        kind = b"marker" if partition == 0 else b"seg"
        return b"{}", [("deck", b"1"), ("type", kind), ("xxh3", b"0123456789abcdef")]
    # A well-formed message whose content lies: a marker of a step nobody committed, or a
    # segment of a file no marker names.
    import xxhash

    if partition == 0:
        value = marker_value(10**6, "feedfacefeedface", "/nonexistent", 2, run)
        h = [*_HEADERS_MARKER, ("xxh3", xxhash.xxh3_64_hexdigest(value).encode())]
        return value, h
    value = b"\x01" * 64
    key = f"step-{10**6:012d}/feedfacefeedface/rank-{partition - 1:05d}/t0.weight/c0.chunk"
    h = [
        ("deck", b"1"),
        ("type", b"seg"),
        ("key", key.encode()),
        ("seg", b"0/1"),
        ("size", b"64"),
        ("xxh3", xxhash.xxh3_64_hexdigest(value).encode()),
    ]
    return value, h


def event(what: str) -> None:
    """Count what the drawn sequences did (printed and checked by the test: the run must have
    exercised kills, restarts and skips, or it proved little)."""
    LoaderMachine.counts[what] += 1


_PUBLISH = st.tuples(
    st.just("publish"),
    st.sampled_from(["delta", "delta", "full"]),
    st.sampled_from([None] * 6 + [0, 1, 2]),  # a partition damaged on the way
)
_WORLD = st.one_of(
    _PUBLISH,
    _PUBLISH,  # publishes twice as often as faults: the loader has steps to apply
    st.tuples(
        st.just("fault"),
        st.sampled_from(
            ["inject", "foreign publish", "restart broker", "wipe --out", "catalog", "damage"]
        ),
        st.integers(0, 2),
        st.sampled_from(["bytes", "bad-checksum", "forged"]),
        st.booleans(),
    ),
)
_LOADER = st.one_of(
    st.just(("run",)),
    st.tuples(st.just("kill"), st.sampled_from(POINTS), st.sampled_from([1, 1, 2])),
)


class LoaderMachine(RuleBasedStateMachine):
    broker: TansuBroker
    children: LoaderChildren
    root: Path
    counts: Counter[str]

    def __init__(self) -> None:
        super().__init__()
        self.dir = self.root / uuid.uuid4().hex[:10]
        self.name = f"m-{self.dir.name}"
        self.topic = self.broker.uri(self.name)
        self.pub = SynthPublisher(self.topic, str(self.dir / "state"))
        self.run = self.pub.run  # the operator pins the run it serves (--run)
        self.other: SynthPublisher | None = None
        self.out = str(self.dir / "out")
        self.fulls = str(self.dir / "fulls")
        self.restarts = 0

    # ---- publishers and faults ----------------------------------------------------------
    @initialize()
    def first_full(self) -> None:
        self.pub.publish("full")

    # One rule: 0-3 things happen to the world, then the loader runs or is killed. (Separate
    # rules would let Hypothesis's swarm testing switch the loader's off for whole examples.)
    @rule(world=st.lists(_WORLD, min_size=1, max_size=3), loader=_LOADER)
    def act(self, world: list[tuple[Any, ...]], loader: tuple[Any, ...]) -> None:
        for what, *args in world:
            getattr(self, what)(*args)
        if loader[0] == "run":
            self.run_loader()
        else:
            self.kill_loader(*loader[1:])

    def publish(self, kind: str, damage: int | None) -> None:
        """The real publisher path; with ``damage``, its first message on that partition gets
        a byte flipped on the way."""
        if damage is not None:
            self.pub.damage_next(damage)
            event("damaged publish")
        self.pub.publish(kind)
        self.pub.sink.damage.clear()  # a partition this publish did not write to stays clean

    def fault(self, fault: str, partition: int, form: str, foreign: bool) -> None:
        """One fault of the world around the loader (``partition``, ``form``, ``foreign``: of
        an injected message; ``foreign`` also makes a publish another run's full)."""
        event(fault)
        if fault == "inject":
            value, headers = _forged(partition, form, "f0reign" if foreign else self.run)
            inject(self.broker.bootstrap, self.name, partition, value, headers)
        elif fault == "foreign publish":
            if self.other is None:
                self.other = SynthPublisher(self.topic, str(self.dir / "other-state"), seed=7)
            self.other.publish("full" if foreign else "delta")
        elif fault == "restart broker" and self.restarts < 2:
            self.broker.restart()  # memory storage: the topic is gone
            self.restarts += 1
            for p in (self.pub, self.other):
                if p is not None:
                    p.reconnect()
        elif fault == "wipe --out":
            shutil.rmtree(self.out, ignore_errors=True)  # a new machine: from the loader full
        elif fault == "catalog":
            # A writer of history (``deck gc`` there) compacts the commit log at the loader
            # fulls' URI or at the publisher's state URI: the loader (which reads its newest
            # full through it) must see every record.
            store = LocalStorage(self.fulls if partition else str(self.dir / "state"))
            index = read_manifests(store).index
            if index is not None and compact(store, index, force=True) is not None:
                event("catalog written")
        elif fault == "damage":
            # Real damage to the newest catalog or one of its segments there: it costs reads.
            store = LocalStorage(self.fulls if partition else str(self.dir / "state"))
            seqs = listed_seqs(store, CATALOG_ROOT)
            names = sorted(listed_segments(store))
            if form == "bytes" and seqs:
                store.put(catalog_key(seqs[-1]), b"damaged")
                event("catalog damaged")
            elif names:
                key = segment_key(names[0])
                store.put(key, store.get(key)[:-7] if foreign else b"\x00")
                event("catalog segment damaged")

    # ---- the loader -------------------------------------------------------------------------
    def _loader_args(self) -> dict[str, Any]:
        return {
            "uri": self.topic,
            "out_dir": self.out,
            "run": self.run,
            "full_uri": self.fulls,
            "full_every": FULL_EVERY,
            # Only a step with missing files and no quarantined message waits this long; none
            # of the drawn faults makes one (a finding if one shows up: the run is slow).
            "wait_s": 1,
        }

    def _loader(self) -> KafkaFollower:
        return loader_from(self._loader_args())  # type: ignore[no-any-return]

    def run_loader(self) -> None:
        kf = self._loader()
        try:
            kf.catch_up()
        finally:
            kf.close()
        for what in ("applied", "unproven", "foreign"):
            if getattr(kf.stats, what):
                event(f"loader run: steps {what}")
        self._check_served()

    def kill_loader(self, point: str, nth: int) -> None:
        what, detail = self.children.run(self._loader_args(), f"{point}:{nth}")
        assert what in ("killed", "finished"), f"loader child {what}: {detail}"
        event(f"loader child {what}")
        if what == "killed":
            event(f"killed at {point}")
        self._check_served()

    # ---- invariants -------------------------------------------------------------------------
    def _check_served(self) -> None:
        """What the output serves is a committed step of the served run, bitwise; reads
        through a catalog (written or damaged by the rules) see every record."""
        for where in (self.fulls, str(self.dir / "state")):
            store = LocalStorage(where)
            got, truth = read_manifests(store), read_manifests(store, manifest_keys(store))
            assert dict(got) == dict(truth) and got.merged == truth.merged, where
        got = read_output(self.out)
        if got is None:
            return
        step, ckpt_id, tensors = got
        assert step in self.pub.trainer.saved, (step, sorted(self.pub.trainer.saved))
        want_id, want = self.pub.expected(step)
        assert ckpt_id == want_id, (step, ckpt_id, want_id)
        bad = differences(tensors, want)
        assert not bad, (step, bad)

    def teardown(self) -> None:
        try:
            # The final catch-up: after a clean full, the loader serves the latest step.
            self.pub.sink.damage.clear()
            last = self.pub.publish("full")
            kf = self._loader()
            try:
                kf.catch_up()
            finally:
                kf.close()
            got = read_output(self.out)
            assert got is not None and got[0] == last, (got and got[:2], last, kf.stats)
            self._check_served()
        finally:
            for p in (self.pub, self.other):
                if p is not None:
                    p.close()


def test_loader_state_machine(tmp_path: Path) -> None:
    """The loader against drawn sequences of publishes, damage, foreign runs, broker restarts and
    kills (see the module doc)."""
    with TansuBroker() as broker, LoaderChildren() as children:
        LoaderMachine.broker = broker
        LoaderMachine.children = children
        LoaderMachine.root = tmp_path
        LoaderMachine.counts = Counter()
        run_state_machine_as_test(
            LoaderMachine,
            settings=settings(
                max_examples=EXAMPLES,
                stateful_step_count=STEPS,
                derandomize=not RANDOM,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
                print_blob=True,
            ),
        )
    counts = LoaderMachine.counts
    print("kafka loader machine:", dict(sorted(counts.items())))
    # The run must have done what it claims to test (the CI run's draws are fixed).
    assert counts["loader child killed"] and counts["loader run: steps unproven"], counts
    assert counts["loader run: steps applied"], counts
