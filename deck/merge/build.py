"""Building one planned item: its partitions, then its commit.

A merged checkpoint is built per partition = (rank, table shard); partition ``p`` belongs to
worker ``xxh3(p) % num_workers``. A worker writes a partition's chunks under a fresh attempt
folder, then its partition record ``merged/<name>/parts/<p>.json`` (atomic). Whichever worker
finds every partition record present writes the rank manifests (under a fresh folder), lists the
folder again to check every file they name is there with its size, and then writes
``merged/<name>/manifest.json``: the commit, last, exactly as the trainer's. Two workers doing
the same partition or the same commit each write complete, self-consistent files, and the last
record written wins; kill -9 at any point leaves either no manifest (the item does not exist
yet; its files are orphans that GC removes) or a complete one.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field

import xxhash

from deck.errors import CorruptCheckpointError, MergeError, NotFoundError
from deck.failpoints import failpoint
from deck.format.checksum import checksum
from deck.format.commit import commit_record, first_missing_file, rank_ref
from deck.format.commit_log import put_record
from deck.format.manifest import (
    FORMAT_VERSION,
    MANIFEST,
    PARTS_DIR,
    CheckpointManifest,
    FileRecord,
    Kind,
    MergePartRecord,
    RankManifest,
    RankRef,
    ShardRecord,
    dump_model,
    load_model,
    rank_dir,
    rank_manifest_name,
    table_dir,
)
from deck.merge.plan import PlannedItem
from deck.merge.policy import MergeConfig
from deck.merge.stream import ChunkOut, InputDamaged, ShardStream, merge_rows, row_bytes
from deck.read.catalog import overlapped, read_rank_manifests
from deck.storage import Storage
from deck.storage.base import get_bounded
from deck.units import human_bytes

logger = logging.getLogger(__name__)

DENSE_FILE = "dense.safetensors"
EXTRA_FILE = "extra.safetensors"


class FilesGoneError(MergeError):
    """A file of a merged checkpoint was gone (or changed size) right before its commit: it was
    not committed, and is built again."""


@dataclass(frozen=True)
class Partition:
    """One rank's table shard of a merged checkpoint: the unit of work of a worker."""

    rank: int
    index: int  # position of the shard in the rank's part manifest
    key: str  # stable name: rank, table, row and column offset

    def owner(self, num_workers: int) -> int:
        """The worker index that builds this partition (stable hash, no coordinator)."""
        return xxhash.xxh3_64_intdigest(self.key.encode()) % num_workers


def shard_layout(rec: ShardRecord) -> tuple[object, ...]:
    """What must match for shards of different checkpoints to be merged: table, place, states."""
    return (
        rec.table,
        rec.num_rows,
        rec.num_cols,
        rec.row_offset,
        rec.rows,
        rec.col_offset,
        rec.cols,
        rec.states,
    )


@dataclass
class WorkStats:
    """What a worker did (summed over a run)."""

    items_committed: int = 0
    partitions: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    committed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)

    def add(self, other: WorkStats) -> None:
        self.items_committed += other.items_committed
        self.partitions += other.partitions
        self.bytes_read += other.bytes_read
        self.bytes_written += other.bytes_written
        self.seconds += other.seconds
        self.committed += other.committed
        self.failed.update(other.failed)


class ItemBuilder:
    """Builds one planned item: this worker's partitions, then the commit if all are done.

    Made and used by :meth:`deck.merge.worker.MergeWorker.run_pass`, in the worker's thread, once
    per ready item and pass; every call runs in that one thread, in this order:

    1. ``ItemBuilder(storage, item, inputs, config)`` reads every input's rank manifests and
       lists the partitions (raises :class:`InputDamaged` for an unreadable input,
       :class:`MergeError` for inputs that cannot be merged: other world sizes, resharded).
    2. :meth:`committed`: True if any worker has committed the item already; then stop.
    3. :meth:`build_partition` for each of :meth:`mine` (this worker's partitions): merges the
       partition's rows into fresh chunks, then writes its partition record; a partition whose
       record exists is skipped.
    4. :meth:`try_commit`: once every worker's partition records are there (checked, a bad one
       is deleted to be built again), writes the rank manifests, lists the folder again to
       check every file they name (raises :class:`FilesGoneError` if one went), then the item's
       manifest (the commit). False while some are missing; a later pass makes a new builder
       and tries again.

    Other worker processes (on this host or others) run builders of the same item at the same
    time, each for its own partitions; they meet only through the files above. The chunk buffer
    is per thread (:class:`deck.merge.stream.ChunkOut`), so builders in different threads are
    independent, but one builder must not be shared between threads.
    """

    def __init__(
        self,
        storage: Storage,
        item: PlannedItem,
        inputs: list[CheckpointManifest],
        config: MergeConfig,
    ):
        self.storage = storage
        self.item = item
        self.inputs = inputs
        self.config = config
        self.folder = item.folder
        self.parts: list[list[RankManifest]] = []
        for m in inputs:
            try:
                self.parts.append(read_rank_manifests(storage, m))
            except CorruptCheckpointError as e:
                raise InputDamaged(m, e) from e
        ws = {m.world_size for m in inputs}
        if len(ws) != 1:
            raise MergeError(f"{item.describe()}: inputs have world sizes {sorted(ws)}")
        self.world_size = ws.pop()
        self.partitions = self._partitions()

    def _partitions(self) -> list[Partition]:
        out: list[Partition] = []
        for r in range(self.world_size):
            layouts = [[shard_layout(rec) for rec in p[r].shards] for p in self.parts]
            if any(lay != layouts[-1] for lay in layouts):
                raise MergeError(
                    f"{self.item.describe()}: rank {r}'s table shards differ between the inputs "
                    "(resharded); this stretch is not merged"
                )
            for i, rec in enumerate(self.parts[-1][r].shards):
                key = f"{r:05d}-{table_dir(rec.table)}-c{rec.col_offset}-r{rec.row_offset}"
                out.append(Partition(r, i, key))
        return out

    def part_path(self, p: Partition) -> str:
        return f"{self.folder}/{PARTS_DIR}/{p.key}.json"

    def mine(self) -> list[Partition]:
        return [
            p
            for p in self.partitions
            if p.owner(self.config.num_workers) == self.config.worker_index
        ]

    def committed(self) -> bool:
        return self.storage.exists(f"{self.folder}/{MANIFEST}")

    # ---- one partition ----

    def build_partition(self, p: Partition, stats: WorkStats) -> None:
        """Merge one partition and write its partition record (skipped if already there)."""
        if self.storage.exists(self.part_path(p)):
            return
        recs = [parts[p.rank].shards[p.index] for parts in self.parts]
        # Rows of an input that saved the whole shard (a full, or a shard saved in full every
        # time) replace everything older: start from the newest such input.
        first = max((i for i, r in enumerate(recs) if r.full), default=0)
        if self.item.kind is Kind.FULL and not recs[first].full:
            raise MergeError(
                f"{self.item.describe()}: the first input does not hold every row of "
                f"{recs[0].table} (rank {p.rank})"
            )
        attempt = secrets.token_hex(8)
        rec = recs[-1]
        out = ChunkOut(
            self.storage,
            self.folder,
            f"{attempt}/{rank_dir(p.rank)}/{table_dir(rec.table)}",
            rec,
            max((row_bytes(r) for r in recs), default=0),
            self.config.chunk_bytes,
        )
        # Each stream reads its first chunk when opened: overlapped on a remote store (one
        # round trip per input otherwise); the first failure is raised, as a loop would.
        streams = []
        for _, got in overlapped(
            self.storage,
            lambda i: ShardStream(self.storage, self.inputs[i], recs[i], i),
            range(first, len(recs)),
        ):
            if isinstance(got, Exception):
                raise got
            streams.append(got)
        failpoint("merger.partition.before_read")
        merge_rows(streams, out.add)
        failpoint("merger.partition.after_read")
        out.close()
        failpoint("merger.partition.after_chunks")
        full = any(r.full for r in recs[first:])
        if full and out.rows != rec.rows:
            raise InputDamaged(
                self.inputs[first],
                CorruptCheckpointError(
                    f"{self.storage.describe(self.inputs[first].folder)}: table {rec.table} "
                    f"(rank {p.rank}) should hold all {rec.rows} rows, has {out.rows}"
                ),
            )
        shard = rec.model_copy(update={"full": full, "chunks": tuple(out.chunks)})
        record = MergePartRecord(
            format_version=FORMAT_VERSION, item_id=self.item.id, rank=p.rank, shard=shard
        )
        self.storage.put(self.part_path(p), dump_model(record))
        failpoint("merger.partition.after_record")
        stats.partitions += 1
        stats.bytes_read += sum(st.bytes_read for st in streams)
        stats.bytes_written += out.bytes_written

    def missing_parts(self) -> list[Partition]:
        have = set(self.storage.list(f"{self.folder}/{PARTS_DIR}/"))
        return [p for p in self.partitions if self.part_path(p) not in have]

    # ---- the commit ----

    def try_commit(self, stats: WorkStats) -> bool:
        """Write the rank manifests and the commit record if every partition is done, after
        checking that every file they name is still there (:meth:`_check_files`).

        Returns whether the item is committed (by this call or earlier)."""
        if self.committed():
            return True
        if self.missing_parts():
            return False
        records = self._part_records()
        if records is None:
            return False
        failpoint("merger.commit.before_rank_manifests")
        asm = secrets.token_hex(8)
        written = [
            self._write_rank_manifest(r, asm, records, stats) for r in range(self.world_size)
        ]
        manifest = self._manifest([ref for ref, _ in written])
        if self.committed():  # another worker was faster: its record stands
            return True
        failpoint("merger.commit.before_manifest")
        self._check_files(written)
        key = f"{self.folder}/{MANIFEST}"
        if not put_record(self.storage, key, manifest.id, dump_model(manifest), exclusive=True):
            return True  # another worker's record landed since the check above: it stands
        failpoint("merger.commit.after_manifest")
        stats.items_committed += 1
        stats.committed.append(self.item.id)
        logger.debug(
            "deck merge: committed %s (%s, %s)",
            self.item.describe(),
            self.folder,
            human_bytes(manifest.data_bytes),
        )
        return True

    def _check_files(self, written: list[tuple[RankRef, RankManifest]]) -> None:
        """Right before the commit: every file the rank manifests name, and the rank manifests
        themselves, are in the folder with the sizes the records say. Something else deleting
        in an uncommitted folder (a GC whose clock was wrong took it for an abandoned one) must
        not end in a committed checkpoint with missing files. Else the partition records are
        deleted (the item is built again from scratch next pass, what is left of its files
        being orphans) and :class:`FilesGoneError` names the folder and the file."""
        problem = first_missing_file(self.storage, self.folder, written, sizes=True)
        if problem is None and self.missing_parts():
            # GC deletes an abandoned-looking folder's partition records first: one gone means
            # it is deleting here, the chunks they name next (committed, they would be lost).
            problem = "a partition record is gone"
        if problem is None:
            return
        for p in self.partitions:
            self.storage.delete(self.part_path(p))
        raise FilesGoneError(
            f"{self.storage.describe(self.folder)}: not committed: {problem} (its files changed "
            "before the commit; something deleted in this uncommitted folder); its partition "
            "records are deleted, the next pass builds it again"
        )

    def _part_records(self) -> dict[tuple[int, int], ShardRecord] | None:
        """Every partition's merged shard by (rank, index), or None if a record is gone or bad
        (a bad one is deleted, so that its partition is merged again)."""
        records: dict[tuple[int, int], ShardRecord] = {}
        for p in self.partitions:
            shard = self._part_record(p)
            if shard is None:
                return None
            records[(p.rank, p.index)] = shard
        return records

    def _part_record(self, p: Partition) -> ShardRecord | None:
        path = self.part_path(p)
        try:
            data = get_bounded(self.storage, path)
            rec = load_model(MergePartRecord, data, self.storage.describe(path))
        except NotFoundError:
            return None
        except CorruptCheckpointError as e:
            logger.warning("%s; deleting it so the partition is merged again", e)
            self.storage.delete(path)
            return None
        expected = self.parts[-1][p.rank].shards[p.index]
        if (
            rec.item_id != self.item.id
            or rec.rank != p.rank
            or shard_layout(rec.shard) != shard_layout(expected)
        ):
            logger.warning("%s does not match its item; merging it again", path)
            self.storage.delete(path)
            return None
        # A record may outlive its chunks (GC of an earlier build of this id): check they are
        # all there before committing a record that names them.
        for c in rec.shard.chunks:
            try:
                ok = self.storage.size(f"{self.folder}/{c.path}") == c.nbytes
            except NotFoundError:
                ok = False
            if not ok:
                logger.warning("%s names a missing chunk %s; merging it again", path, c.path)
                self.storage.delete(path)
                return None
        return rec.shard

    def _write_rank_manifest(
        self, r: int, asm: str, records: dict[tuple[int, int], ShardRecord], stats: WorkStats
    ) -> tuple[RankRef, RankManifest]:
        """Rank ``r``'s manifest under the assembly folder ``asm`` (its merged shards, the dense
        and extra files of the newest input, copied); returns its reference and itself."""
        last = self.parts[-1][r]
        src = self.inputs[-1]
        dense = self._copy(src, last.dense, f"{asm}/{rank_dir(r)}/{DENSE_FILE}", stats)
        extra = self._copy(src, last.extra, f"{asm}/{rank_dir(r)}/{EXTRA_FILE}", stats)
        assert extra is not None
        shards = tuple(records[(r, i)] for i in range(len(last.shards)))
        part = RankManifest(
            format_version=FORMAT_VERSION,
            step=self.item.step,
            ckpt_id=self.item.id,
            rank=r,
            world_size=self.world_size,
            shards=shards,
            dense=dense,
            extra=extra,
        )
        data = dump_model(part)
        rel = f"{asm}/{rank_manifest_name(r)}"
        self.storage.put(f"{self.folder}/{rel}", data)
        return rank_ref(r, part, rel, data), part

    def _manifest(self, refs: list[RankRef]) -> CheckpointManifest:
        """The item's commit record over the rank manifests ``refs``."""
        it = self.item
        return commit_record(
            refs,
            id=it.id,
            step=it.step,
            kind=it.kind,
            parent=it.start[0] if it.start else None,
            parent_id=it.start[1] if it.start else None,
            base=it.base,
            epoch=self.inputs[-1].epoch,
            world_size=self.world_size,
            first_step=it.first_step if it.kind is Kind.MERGED else None,
            layer=it.layer,
            inputs=it.inputs,
            state_id=it.state[1],
        )

    def _copy(
        self, src: CheckpointManifest, rec: FileRecord | None, rel: str, stats: WorkStats
    ) -> FileRecord | None:
        """Copy a dense / extra file of the newest input (verified) into this item's folder."""
        if rec is None:
            return None
        key = f"{src.folder}/{rec.path}"
        try:
            data = get_bounded(self.storage, key, rec.nbytes)
        except NotFoundError as e:
            raise InputDamaged(
                src, CorruptCheckpointError(f"{self.storage.describe(key)}: missing")
            ) from e
        if len(data) != rec.nbytes or checksum(data) != rec.checksum:
            raise InputDamaged(
                src,
                CorruptCheckpointError(f"{self.storage.describe(key)}: size or checksum mismatch"),
            )
        self.storage.put(f"{self.folder}/{rel}", data)
        stats.bytes_read += len(data)
        stats.bytes_written += len(data)
        return FileRecord(path=rel, nbytes=rec.nbytes, checksum=rec.checksum)
