"""``deck follow``: keep a materialised full state of the newest step of a URI up to date.

The output directory holds ``state.safetensors`` (the same tensors, names and layout as
``deck export --format safetensors`` of that step) and ``state.json`` (which step and checkpoint
it is). Both are replaced atomically (written under a temporary name, fsynced, renamed), so a
reader sees either the previous state or the new one, never a mix; the safetensors metadata
names the step too, so the data file is self-describing without the sidecar.

The first catch-up restores the cheapest chain of the newest step (every chunk of it). After
that, a newly committed delta is applied by reading only that delta's rows into the tables held
in memory (``apply_chain(..., onto=True)``), plus its small dense/extra files; the chain is not
read again. A new full, a changed set of tables, or a newest step whose chain does not pass
through the materialised one (e.g. the publisher restarted) is materialised from scratch.

Memory: the whole unsharded state of one step (what a serving job loads anyway).

With ``parquet`` (``deck follow --format parquet``) the follower also writes Parquet row files
beside these (:class:`deck.serve.parquet_output.ParquetOutput`): a full folder when it materialises a
step, and for every checkpoint it applies after that (one at a time) a delta folder of the rows
that checkpoint changed, before the safetensors state is replaced.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import xxhash
from safetensors import safe_open

import deck.schemes as schemes
from deck.errors import CheckpointNotFoundError, ConfigError, CorruptCheckpointError
from deck.failpoints import failpoint
from deck.format.jsonio import load_json
from deck.format.manifest import CheckpointManifest
from deck.format.safetensors import preamble, write_tensor
from deck.model import TableShard
from deck.ops.export import (
    ShardGeometry,
    StepState,
    eager_state,
    flatten,
    geometry_of,
)
from deck.read.catalog import ManifestSet, read_rank_manifests
from deck.read.lineage import (
    LineageGraph,
    build_graph,
    chain_bytes,
    cheapest_chain,
    latest_checked,
    latest_confirmed,
)
from deck.read.restore import apply_chain
from deck.read.verify import uncommitted_meanwhile, verify_checkpoint
from deck.read.window import ask_newest
from deck.serve.damaged import DamagedCheckpoints
from deck.serve.output import Output, parquet_outputs
from deck.storage import Storage
from deck.storage.atomic import atomic_file, atomic_write
from deck.storage.outage import Waiting

logger = logging.getLogger(__name__)

STATE_FILE = "state.safetensors"
SIDECAR = "state.json"
RECORD_KEY = "deck.state"  # the state record in the data file's safetensors metadata
# xxh3-64 of the tensors' bytes (by name, in name order), in the same metadata: a flipped byte
# of the data is damage, and the output is rebuilt (a break-it finding served it)
DATA_KEY = "deck.data_xxh3"


@dataclass
class FollowUpdate:
    """What one catch-up did."""

    step: int
    ckpt_id: str
    how: str  # "full" (materialised from a chain), "delta" (applied new deltas), "unchanged"
    applied: list[str] = field(default_factory=list)  # folders of the checkpoints read
    bytes_read: int = 0  # table chunk bytes read by this catch-up
    chain_bytes: int = 0  # what a restore of the step from scratch reads
    seconds: float = 0.0
    write_s: float = 0.0  # of ``seconds``: writing and fsyncing the output files


@dataclass(frozen=True)
class _Piece:
    """One state of one table shard inside an output tensor (fqn), at offsets / sizes."""

    fqn: str
    state: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class _Shard(ShardGeometry):
    pieces: tuple[_Piece, ...]


class Follower:
    """The materialised state of ``uri``'s newest step in ``out_dir`` (see the module doc).

    Reopening a directory a previous follower wrote resumes from its files: only the deltas
    committed since are read.
    """

    def __init__(
        self,
        storage: Storage,
        out_dir: str,
        allow_quantized: bool = False,
        outputs: Sequence[Output] = (),
        clock: Callable[[], float] = time.monotonic,
    ):
        # ``storage``: the publish URI's store, or a view to read the chain through (the Kafka
        # loader's: rows from the stream, the rest from the state URI)
        self.storage = storage
        self.uri = storage.uri
        self._last: ManifestSet | None = None  # the last read (maybe of the newest records)
        self._whole: ManifestSet | None = None  # the last read of every record: the next one
        # goes on from it
        self._said_gives_up: set[str] = set()  # what the latest check gave up, said once
        # A publisher with DeckConfig.publish.quantize writes quantised weights: materialising
        # them (dequantised) must be asked for, and the output then says so (state.json).
        self.allow_quantized = allow_quantized
        self.encodings: set[str] = set()
        self.out_dir = out_dir
        self.tensors: dict[str, torch.Tensor] = {}  # tables first, then dense, as written
        self.table_fqns: list[str] = []
        self.shards: list[_Shard] = []
        self.state: tuple[int, str] | None = None  # (step, trainer checkpoint id) held
        # The held checkpoint's timeline (None: an output of a deck that did not record it):
        # a newest step of the same timeline below the held one, or of an older timeline, is
        # not followed back (a store restored from an older copy, a held record deleted)
        self.epoch: int | None = None
        self._said_behind: tuple[int, str] | None = None
        # Checkpoints whose files were found damaged (step -> the problem): no chain through
        # them is served until a later try reads them whole (a copy still landing, a repair)
        self.damaged = DamagedCheckpoints(clock)
        self.refused: dict[int, str] = {}
        self._intact: set[str] = set()  # checkpoints verified whole after such an error
        self.chain: list[str] = []
        self.resumed: dict[str, Any] = {}  # state.json of the output resumed from
        if os.path.exists(out_dir) and not os.path.isdir(out_dir):
            raise ConfigError(f"out_dir {out_dir} is not a directory")
        os.makedirs(out_dir, exist_ok=True)
        self.outputs = list(outputs)  # told of every step before the held state is replaced
        self._resume()
        # Whether each output was checked to hold the resumed state (see _outputs_level)
        self._outputs_checked = self.state is None

    @property
    def damaged_ahead(self) -> dict[int, str]:
        """The commit records newer than the held step that the last catch-up could not read
        (step -> problem): the newest step may be one of them or later."""
        damaged = self._last.damaged if self._last is not None else {}
        held = -1 if self.state is None else self.state[0]
        return {step: why for step, why in damaged.items() if step > held}

    @property
    def tables(self) -> dict[str, tuple[int, int]]:
        """The held tables' shapes (what a chain applied onto them must match)."""
        return {s.table: (s.num_rows, s.num_cols) for s in self.shards}

    # ---- catching up -------------------------------------------------------------------------
    def catch_up(self) -> FollowUpdate:
        """Bring the output to the newest restorable step of the URI (at most one write)."""
        t0 = time.perf_counter()
        # From the newest part of a long history, as a restore of the latest plans: a poll
        # costs what is new, not every record the job wrote (1.9 s a poll at 100,000)
        return ask_newest(self.storage, lambda ms: self._catch_up(ms, t0), self._whole)

    def _catch_up(self, manifests: ManifestSet, t0: float) -> FollowUpdate:
        self._last = manifests
        if manifests.window is None:
            self._whole = manifests
        if not manifests:
            raise CheckpointNotFoundError(f"no committed checkpoints at {self.storage.uri}")
        # The records, not a catalog's copy, and every step folder above the step it would
        # serve, as a restore of the latest does (a log whose newest entries are lost must not
        # hide the newest steps: a break-it finding)
        checked, latest = latest_confirmed(self.storage, manifests)
        # What a plain restore refuses to take for the latest, a follower serves around, saying
        # so once (a break-it finding: the newest step's lost record, not a word)
        check = latest_checked(self.storage, checked, latest)
        if check.gives_up is not None and check.gives_up not in self._said_gives_up:
            self._said_gives_up.add(check.gives_up)
            logger.warning("deck follow: %s; serving step %s meanwhile", check.gives_up, check.step)
        checked, latest = check.manifests, check.step
        if latest is None:
            raise CheckpointNotFoundError(f"no restorable step at {self.storage.uri}")
        graph = build_graph(checked, self.storage.uri)
        # Around each checkpoint found damaged (one more per pass: it ends)
        while (chain := self._chain_to_serve(graph, latest)) is not None:
            try:
                update = self._serve(chain, t0)
            except CorruptCheckpointError:
                if not self._found_damaged(chain):
                    raise
                continue
            self._repaired(chain)
            return update
        if self.state is not None:
            return FollowUpdate(self.state[0], self.state[1], "unchanged")
        raise CorruptCheckpointError(
            f"every restorable step at {self.storage.uri} needs a damaged checkpoint "
            f"({_said(self.refused)}): nothing to serve until a newer full is published "
            f"(`deck verify {self.storage.uri} --all`)"
        )

    def _chain_to_serve(self, graph: LineageGraph, latest: int) -> list[CheckpointManifest] | None:
        """The cheapest chain of ``latest``; with checkpoints found damaged, of the newest
        restorable step (by timeline, then step) whose chain needs none of them."""
        exclude = self.damaged.waiting()
        if not exclude:
            return cheapest_chain(graph, latest)
        for step in sorted(
            graph.restorable_steps(), key=lambda s: (graph.trainer[s].epoch, s), reverse=True
        ):
            with contextlib.suppress(CheckpointNotFoundError):
                return cheapest_chain(graph, step, exclude=exclude)
        return None

    def _found_damaged(self, chain: list[CheckpointManifest]) -> bool:
        """After a chunk or file of ``chain`` failed its check: verify its checkpoints, newest
        first, up to the first damaged one, which is then left out for a while (said once per
        problem, as a live model refuses a damaged update; :mod:`deck.serve.damaged`); False
        when none is (the error is raised)."""
        for m in reversed(chain):
            if m.id in self._intact:
                continue
            report = verify_checkpoint(self.storage, m)
            problems = report.problems
            if report.ok:
                # (committed files do not change: an error that is not theirs, raised again
                # at every poll, does not read the chain again each time)
                self._intact.add(m.id)
            elif problems and not uncommitted_meanwhile(self.storage, m):
                # (what could not be read is not damage, nor what GC deleted under it: the
                # error is raised, and the next poll plans again)
                self.refused[m.step] = problems[0]
                if self.damaged.found(m.id, problems[0]):
                    logger.error(
                        "deck follow: %s of %s is damaged (%s): the steps whose chains need it "
                        "are not served (it is read again later); %s",
                        m.folder,
                        self.storage.uri,
                        problems[0],
                        "looking for the newest step without it"
                        if self.state is None
                        else f"{self.out_dir} keeps step {self.state[0]} or moves to a newer one",
                    )
                return True
        return False

    def _repaired(self, chain: list[CheckpointManifest]) -> None:
        """``chain`` was served: those of its checkpoints found damaged before read whole."""
        for m in chain:
            if self.damaged.repaired(m.id):
                self.refused.pop(m.step, None)
                logger.info(
                    "deck follow: %s of %s, found damaged before, reads whole now",
                    m.folder,
                    self.storage.uri,
                )

    def _serve(self, chain: list[CheckpointManifest], t0: float) -> FollowUpdate:
        """Bring the output to the state of ``chain`` (its last checkpoint's)."""
        last = chain[-1]
        latest = last.step
        if self._behind(last):
            assert self.state is not None
            return FollowUpdate(self.state[0], self.state[1], "unchanged")
        if self.state == last.state:
            self._outputs_level()
            return FollowUpdate(latest, last.state[1], "unchanged")
        held = [i for i, m in enumerate(chain) if m.state == self.state]
        newer = chain[held[-1] + 1 :] if held else []
        parts = read_rank_manifests(self.storage, last) if newer else []
        same_tables = {r.table: (r.num_rows, r.num_cols) for p in parts for r in p.shards}
        if newer and same_tables == self.tables:
            update = self.apply(newer, parts)
        else:
            held_tables = self.tables
            update = self.materialise(latest, chain)
            if held_tables and self.tables != held_tables:
                # (a break-it finding: another model's tables replaced the held ones unsaid)
                now = self.tables
                changed = [
                    f"{t} {_shape(held_tables.get(t))} -> {_shape(now.get(t))}"
                    for t in sorted(held_tables.keys() | now.keys())
                    if held_tables.get(t) != now.get(t)
                ]
                logger.warning(
                    "deck follow: the tables at %s changed at step %d: %s (another model "
                    "publishes there now, e.g. a job that took the publish URI over); %s holds "
                    "the new ones",
                    self.storage.uri,
                    latest,
                    ", ".join(changed[:6]) + (", ..." if len(changed) > 6 else ""),
                    self.out_dir,
                )
        update.chain_bytes = chain_bytes(chain)
        update.seconds = time.perf_counter() - t0
        return update

    def _behind(self, last: CheckpointManifest) -> bool:
        """Whether the newest restorable checkpoint, ``last``, is not after the held one (an
        older timeline, or a lower step of the held one's): it is left alone, said once, as a
        live model does (a break-it finding: the follower went back to an older step without a
        word when the held step's folder was deleted)."""
        if self.state is None or self.epoch is None:
            return False
        if (last.epoch, last.step) >= (self.epoch, self.state[0]):
            return False
        if self._said_behind != last.state:
            self._said_behind = last.state
            logger.warning(
                "deck follow: out of order: the newest step at %s is %d (checkpoint %s, epoch "
                "%d), not after the held step %d (checkpoint %s, epoch %d); %s keeps step %d "
                "until a newer step is published (a store restored from an older copy, or the "
                "held checkpoint deleted?)",
                self.storage.uri,
                last.step,
                last.state[1],
                last.epoch,
                self.state[0],
                self.state[1],
                self.epoch,
                self.out_dir,
                self.state[0],
            )
        return True

    def apply(self, newer: list[CheckpointManifest], parts: list[Any]) -> FollowUpdate:
        """Apply ``newer`` (the checkpoints after the held state, oldest first, of the same
        tables; ``parts``: the last one's rank manifests) onto the held tables, then write the
        output once."""
        last = newer[-1]
        self._outputs_level()
        try:
            bytes_read = self._apply_rows(newer, self.targets())
            self.encodings |= {m.encoding for m in newer if m.encoding is not None}
            dense = flatten(eager_state(self.storage, last, parts))
            self._set_dense(dense)
            self.chain = self.chain + [m.folder for m in newer]
            self.state, self.epoch = last.state, last.epoch
            write_s = self._write()
        except BaseException:
            # The held tables are half-written (a damaged chunk, a read error, a kill part-way)
            # and this chain starts with a delta: another one applied onto them would carry
            # the rows written so far (a checkpoint quarantined meanwhile, a step below it
            # then applied, served with rows of the refused one). Back to the output's files,
            # which hold the held state exactly.
            self.tensors, self.shards, self.state = {}, [], None
            self._resume()
            raise
        return FollowUpdate(
            last.step,
            last.state[1],
            "delta",
            [m.folder for m in newer],
            bytes_read=bytes_read,
            write_s=write_s,
        )

    def _apply_rows(self, newer: list[CheckpointManifest], targets: list[TableShard]) -> int:
        """Apply ``newer`` onto the held tables; returns the chunk bytes read. With outputs, one
        checkpoint at a time, each output told of each."""
        if not self.outputs:
            stats, _ = apply_chain(
                self.storage,
                newer,
                targets,
                self.tables,
                onto=True,
                allow_quantized=self.allow_quantized,
            )
            return stats.bytes
        total, parent = 0, self.state
        for m in newer:
            if m.state == parent:
                continue  # the same training state again (reached through a merger): no rows
            stats, parts = apply_chain(
                self.storage,
                [m],
                targets,
                self.tables,
                onto=True,
                allow_quantized=self.allow_quantized,
            )
            total += stats.bytes
            for out in self.outputs:
                out.delta(self, m, parent, parts)
            parent = m.state
        return total

    def materialise(self, step: int, chain: list[CheckpointManifest] | None = None) -> FollowUpdate:
        """Rebuild the held state from committed ``step`` (its cheapest chain: ``chain`` when
        the caller just chose it from the records), then write the output once (a full
        update)."""
        try:
            return self._materialise(step, chain)
        except BaseException:
            # (part of the held state replaced, a damaged dense file, a kill: back to the
            # output's files, as apply does)
            self.tensors, self.shards, self.state = {}, [], None
            self._resume()
            raise

    def _materialise(self, step: int, chain: list[CheckpointManifest] | None) -> FollowUpdate:
        st = StepState(self.storage, step, self.allow_quantized, chain)
        self.encodings = {m.encoding for m in st.chain if m.encoding is not None}
        tensors: dict[str, torch.Tensor] = {}
        shards: list[_Shard] = []
        by_shard: dict[int, list[_Piece]] = {}
        for p in st.pieces:
            tensors.setdefault(p.fqn, torch.empty(p.size, dtype=p.dtype))
            by_shard.setdefault(p.shard, []).append(_Piece(p.fqn, p.state, p.offsets, p.sizes))
        for i, s in enumerate(st.shards):
            data = st.read_shard(i)
            for q in by_shard[i]:
                _block(tensors[q.fqn], q).copy_(data[q.state])
            shards.append(_Shard(**geometry_of(s), pieces=tuple(by_shard[i])))
        self.tensors, self.shards = tensors, shards
        self.table_fqns = list(tensors)
        self._set_dense(flatten(st.eager_state()))
        self.state, self.epoch = st.last.state, st.last.epoch
        self.chain = [m.folder for m in st.chain]
        for out in self.outputs:
            out.full(self)
        self._outputs_checked = True
        write_s = self._write()
        return FollowUpdate(
            st.step,
            st.last.state[1],
            "full",
            list(self.chain),
            bytes_read=st.read_bytes,
            write_s=write_s,
        )

    def _outputs_level(self) -> None:
        """Before the first delta (or the first "unchanged") of a resumed follower: an output
        that does not hold the resumed state (its ``holds(state)`` says no: an earlier run
        without it wrote the held state, e.g. ``deck follow`` without ``--format parquet``) is
        given that state in full first, so what it holds stays a base and its deltas, never
        deltas on a base it lacks. Outputs without ``holds`` are not checked."""
        if self._outputs_checked or self.state is None:
            return
        for out in self.outputs:
            holds = getattr(out, "holds", None)
            if holds is None or holds(self.state):
                continue
            where = out.full(self)
            logger.warning(
                "deck follow: %s held nothing of step %d, which %s serves (an earlier run "
                "without this output, e.g. without --format parquet): wrote its full state to "
                "%s, which later deltas apply on",
                type(out).__name__,
                self.state[0],
                self.out_dir,
                where,
            )
        self._outputs_checked = True

    def _set_dense(self, dense: dict[str, Any]) -> None:
        tables = {k: self.tensors[k] for k in self.table_fqns}
        self.tensors = {**tables, **{k: v for k, v in dense.items() if isinstance(v, torch.Tensor)}}

    def targets(self) -> list[TableShard]:
        """Table shards whose states are views of the held tensors: apply_chain writes into
        the materialised tables in place."""
        return [
            s.table_shard({p.state: _block(self.tensors[p.fqn], p) for p in s.pieces})
            for s in self.shards
        ]

    # ---- files -------------------------------------------------------------------------------
    def _write(self) -> float:
        """Replace the output files; returns the seconds it took."""
        t0 = time.perf_counter()
        assert self.state is not None
        step, ckpt_id = self.state
        metadata = {
            "format": "deck-export",
            "uri": self.storage.uri,
            "step": str(step),
            "checkpoint": ckpt_id,
            "chain": json.dumps(self.chain),
            # Weights dequantised from these encodings (empty: the exact state).
            "quantized": json.dumps(sorted(self.encodings)),
        }
        sidecar = {
            "uri": self.storage.uri,
            "step": step,
            "checkpoint": ckpt_id,
            "epoch": self.epoch,
            "chain": self.chain,
            "tables": self.table_fqns,
            "shards": [asdict(s) for s in self.shards],
            "quantized": sorted(self.encodings),
            **self.sidecar_extra(),
        }
        body = json.dumps(sidecar, indent=1).encode()
        # The state record rides in the data file's own metadata: renaming state.safetensors is
        # the one atomic switch (data, step and a subclass's resume point together);
        # state.json is a copy of that record for readers, rewritten on resume when a crash
        # came between the two renames.
        metadata[RECORD_KEY] = json.dumps(sidecar, separators=(",", ":"))
        metadata[DATA_KEY] = tensors_digest(self.tensors)
        layout = [(name, tuple(t.shape), t.dtype) for name, t in self.tensors.items()]
        head = preamble(metadata, layout)
        with atomic_file(os.path.join(self.out_dir, STATE_FILE)) as f:
            f.write(head)
            for t in self.tensors.values():
                write_tensor(f, t)
            f.flush()
            failpoint("follow.state.before_switch")
        failpoint("follow.state.switched")
        atomic_write(os.path.join(self.out_dir, SIDECAR), body)
        failpoint("follow.state.written")
        return time.perf_counter() - t0

    def sidecar_extra(self) -> dict[str, Any]:
        """More keys for state.json, written atomically with the state (a subclass's resume
        point, e.g. the Kafka loader's stream offsets); :attr:`resumed` holds them on reopen."""
        return {}

    def _resume(self) -> None:
        try:
            found = read_state(self.out_dir)
        except (OSError, ValueError, KeyError, TypeError, CorruptCheckpointError) as e:
            # A damaged output is rebuilt from the chain, not trusted.
            logger.warning(
                "deck follow: cannot resume from %s (%s): rebuilding it", self.out_dir, e
            )
            return
        if found is None:
            return
        meta, tensors = found
        # (compared as places: a break-it finding, the same publish folder through a link was
        # refused as another URI's output)
        if schemes.location(meta["uri"]) != schemes.location(self.storage.uri):
            raise ConfigError(
                f"--out {self.out_dir} follows {meta['uri']}, not {self.storage.uri}; use "
                "another directory"
            )
        self.shards = [
            _Shard(
                **{k: v for k, v in s.items() if k != "pieces"},
                pieces=tuple(
                    _Piece(p["fqn"], p["state"], tuple(p["offsets"]), tuple(p["sizes"]))
                    for p in s["pieces"]
                ),
            )
            for s in meta["shards"]
        ]
        self.table_fqns = list(meta["tables"])
        self.tensors = tensors
        self.state = (int(meta["step"]), str(meta["checkpoint"]))
        epoch = meta.get("epoch")
        self.epoch = epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None
        self.chain = list(meta["chain"])
        self.encodings = set(meta.get("quantized", ()))
        self.resumed = meta


def state_record(out_dir: str) -> dict[str, Any] | None:
    """The state record of the output in ``out_dir`` (what ``state.json`` says), read from the
    data file itself: None when there is none. Raises (OSError, ValueError,
    CorruptCheckpointError) when the files are damaged."""
    found = read_state(out_dir, tensors=False)
    return None if found is None else found[0]


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    """xxh3-64 of ``tensors``' bytes, name by name in name order (names included)."""
    h = xxhash.xxh3_64()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def read_state(
    out_dir: str, tensors: bool = True
) -> tuple[dict[str, Any], dict[str, torch.Tensor]] | None:
    """The state record and (with ``tensors``) the tensors of the output in ``out_dir``.

    Guarantee: the record is the one written with these tensors. It is read from the data
    file's metadata (written by the same atomic rename); a ``state.json`` that names another
    step (a crash between the two renames) is rewritten from it. An output of an older deck,
    whose data file carries no record, is accepted only when its ``state.json`` names the
    same step. None when ``out_dir`` holds no output."""
    side = os.path.join(out_dir, SIDECAR)
    path = os.path.join(out_dir, STATE_FILE)
    if not os.path.exists(path):
        return None
    out: dict[str, torch.Tensor] = {}
    try:
        with safe_open(path, framework="pt") as f:
            md = f.metadata() or {}
            if tensors:
                for k in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    out[k] = f.get_tensor(k)
    except Exception as e:  # safetensors' own error types: a damaged or truncated file
        raise CorruptCheckpointError(f"{path}: unreadable: {e}") from e
    if tensors and DATA_KEY in md and md[DATA_KEY] != tensors_digest(out):
        raise CorruptCheckpointError(f"{path}: its tensors do not match their checksum")
    raw = md.get(RECORD_KEY)
    if raw is not None:
        meta = load_json(raw.encode(), path, "deck follow state record")
        if not isinstance(meta, dict) or md.get("step") != str(meta.get("step")):
            raise CorruptCheckpointError(f"{path}: its state record names another step")
        body = json.dumps(meta, indent=1).encode()
        try:
            with open(side, "rb") as g:
                same = g.read() == body
        except FileNotFoundError:
            same = False
        if not same:
            logger.warning(
                "deck follow: %s did not match %s (step %s; a crash between the two renames): "
                "rewritten from it",
                side,
                path,
                meta.get("step"),
            )
            atomic_write(side, body)
        return meta, out
    if not os.path.exists(side):
        return None
    with open(side, "rb") as g:
        meta = load_json(g.read(), side, "deck follow state record")
    if md.get("step") != str(meta["step"]):
        raise CorruptCheckpointError(f"{path} and {side} name different steps")
    return meta, out


def _block(t: torch.Tensor, p: _Piece) -> torch.Tensor:
    return t[tuple(slice(o, o + n) for o, n in zip(p.offsets, p.sizes, strict=True))]


def follow(
    storage: Storage,
    out_dir: str,
    *,
    once: bool = False,
    poll_s: float = 10.0,
    on_update: Any = None,
    allow_quantized: bool = False,
    parquet: bool = False,
) -> Follower:
    """Run the loading service: catch up, then (unless ``once``) poll every ``poll_s`` seconds.
    ``on_update(FollowUpdate)`` is called after each catch-up (an error it raises ends the
    service). With ``once``, errors of a catch-up are raised; otherwise they are logged and
    retried at the next poll."""
    outputs = parquet_outputs(parquet, out_dir, storage.uri)
    follower = Follower(storage, out_dir, allow_quantized, outputs)
    # (--poll is the promise: no back-off)
    waiting = Waiting(f"deck follow {storage.uri}", poll_s, logger, max_s=poll_s)
    while True:
        try:
            update = follower.catch_up()
            waiting.ok()
        except Exception as e:
            if once:
                raise
            time.sleep(waiting.failed(e))
            continue
        # The caller's own errors (a closed stdout pipe of `deck follow | head`) are not the
        # store's: they end the service instead of being retried at every poll.
        if on_update is not None:
            on_update(update)
        if once:
            return follower
        time.sleep(poll_s)


def _said(refused: dict[int, str]) -> str:
    return "; ".join(f"step {s}: {why}" for s, why in sorted(refused.items())[:3])


def _shape(rows_cols: tuple[int, int] | None) -> str:
    return "none" if rows_cols is None else f"{rows_cols[0]}x{rows_cols[1]}"
