"""The user-facing checkpointer: track, snapshot, commit, restore."""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, Literal, Protocol, runtime_checkable

import torch

import deck.schemes as schemes
from deck.at_exit import forget, keep_open
from deck.config import CHECKPOINT_CONSUMER, PUBLISH_CONSUMER, DeckConfig
from deck.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ConfigError,
    LeaseHeldError,
)
from deck.format.manifest import as_step
from deck.format.statefile import scalar_key
from deck.model import (
    ModelAdapter,
    RemovableHandle,
    TableShard,
    optimizer_record,
)
from deck.read.catalog import (
    ManifestSet,
    OutsideWindow,
    read_manifests,
)
from deck.read.lineage import build_graph
from deck.read.restore import (
    RestoreStats,
)
from deck.read.window import read_window
from deck.stack import require_torchrec
from deck.storage import PROBE_PREFIX, Storage, check_writable, open_storage
from deck.trainer.chain import ChainWriter, lineage_changed
from deck.trainer.coordination import Coordinator
from deck.trainer.events import CheckpointEvent, EventQueue, OnCheckpoint
from deck.trainer.lease import Lease, Leases
from deck.trainer.loader import StateLoader, next_epoch
from deck.trainer.publish_owner import claim, refuse_publish_uri
from deck.trainer.rng import capture_rng
from deck.trainer.staging import (
    CheckpointStats,
    ProcessStager,
    Reopen,
    Stager,
    process_unsupported,
    resolve_tier,
)
from deck.trainer.staging.stager import spool_root
from deck.trainer.tracker import TrackerStore

logger = logging.getLogger(__name__)


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> Any: ...
    def load_state_dict(self, state: Any) -> Any: ...


UserState = Stateful | tuple[Callable[[], Any], Callable[[Any], None]]


class DeltaCheckpointer:
    """Delta checkpoints of a TorchRec ``DistributedModelParallel`` model.

    Construction checks the URI is writable (on every rank) and installs tracking hooks.
    ``step(step)`` after each optimizer step takes a checkpoint when one is due; ``restore()``
    loads the latest (or a given) committed step bitwise. Every rank must call ``step``,
    ``save`` and ``restore`` together (they use collectives).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizers: Any,
        config: DeckConfig,
        state: UserState | None = None,
        *,
        adapter: ModelAdapter | None = None,
        storage: Storage | None = None,
        publish_storage: Storage | None = None,
        on_checkpoint: OnCheckpoint | None = None,
    ):
        # What close() gives back is recorded as it is taken (the stagers by _chain), so that a
        # construction that fails gives back exactly what it took: no tracking hook, stager
        # thread or writer lease outlives it.
        self._lease: Lease | None = None
        self._pub_lease: Lease | None = None  # the publish URI's, when publishing
        self._hooks: RemovableHandle | None = None
        self._gradients: RemovableHandle | None = None  # the watch of unapplied gradients
        self._read_newest: int | None = None  # rank 0: the latest restorable step _next_epoch read
        self._stagers: list[Stager | ProcessStager] = []
        self._writers: list[ChainWriter] = []  # their lineage checks stop after the stagers
        # Each checkpoint's and publish's CheckpointEvent, once it is done, on every rank: to
        # on_checkpoint (set at any time), on the events' own thread (deck.trainer.events).
        self.on_checkpoint = on_checkpoint
        self._events = EventQueue(lambda: self._on_checkpoint)
        try:
            self.config = config
            self.coord = Coordinator()
            # Everything that can refuse this setup is checked locally first, then the ranks
            # agree: a rank that refused while the others went on into the lease's or DDP's
            # collectives would leave them waiting for it forever.
            refused: Exception | None = None
            try:
                shards = self._check_locally(model, optimizers, config, state, adapter, storage)
            except Exception as e:
                refused = e
            self.coord.agree_on_failure(refused, "deck.enable")
            self.coord.agree_on_values(self._what_ranks_share(config), "deck.enable")
            self._check_same_store(self.storage, "DeckConfig.uri")
            self._lease = self._take_lease(
                self.storage, then=lambda _epoch: refuse_publish_uri(self.storage)
            )
            # Collective, before any training step: both the run that saves and the one that
            # restores sum gradients across ranks in the same order.
            self.adapter.pin_reduction_order()
            self._last_step: int | None = None
            self._stepped = False  # (step() was called: close() says when nothing was saved)
            on_gpu = any(t.is_cuda for s in shards for t in s.states.values())
            self._ckpt = self._chain(
                CHECKPOINT_CONSUMER,
                CHECKPOINT_CONSUMER,
                self.storage,
                on_gpu,
                self._reopen,
                self._lease,
            )
            self._pub: ChainWriter | None = self._open_publisher(on_gpu, publish_storage)
            self._closed = False
            # Collective: ranks agree on parts; those of an older epoch than this process's
            # previous one (a newer timeline was written since) are dropped
            self.recovered = self.stager.recover(self.coord, self._ckpt.epoch - 1)
            self._ckpt.stored_newest = self._stored_newest()
            if self._pub is not None:
                # Parts of an earlier process's publishes are finished (or dropped); the first
                # publish of this process is a full all the same.
                self._pub.stager.recover(self.coord, self._pub.epoch - 1)
            self.last_restore: RestoreStats | None = None  # what the last restore() read here
        except BaseException:
            self._release()
            raise
        keep_open(self)  # until close(): what it stages is finished even without one

    def _check_locally(
        self,
        model: torch.nn.Module,
        optimizers: Any,
        config: DeckConfig,
        state: UserState | None,
        adapter: ModelAdapter | None,
        storage: Storage | None,
    ) -> list[TableShard]:
        """The local part of construction (no collective): the adapter, the storage, the
        optimizers and user state, the tracker and its hooks. Raises what this rank refuses."""
        if not isinstance(config, DeckConfig):  # (a break-it finding: an AttributeError)
            raise ConfigError(
                f"config must be a deck.DeckConfig, not {type(config).__name__} (from a dict: "
                "deck.DeckConfig(**values) or deck.DeckConfig.model_validate(values))"
            )
        self.adapter = adapter or default_adapter(model)
        # ``storage`` replaces the store opened from ``config.uri`` (a custom backend, or a
        # fault-injecting wrapper in tests); everything goes through this one interface.
        self.storage: Storage = storage or open_storage(config.uri, config.storage_options)
        # How a staging process opens the same store (None: it cannot, the store was given)
        self._reopen = None if storage is not None else Reopen(config.uri, config.storage_options)
        _require_shared(config.uri, "DeckConfig.uri", self.coord.world_size)
        check_writable(self.storage)
        # (the spool folder made here: a rank that cannot is refused with the others)
        spool_root(resolve_tier(config.staging, self.storage), config.staging, self.storage)
        self._state: tuple[Callable[[], Any], Callable[[Any], None]] | None = None
        self._use(optimizers, state)
        shards = self.adapter.table_shards()
        self.tracker = TrackerStore(
            sum(s.rows for s in shards),
            config.tracking_consumers,
            starts=[s.track_base for s in shards],
        )
        self._paused = 0
        self._table_shapes: dict[str, tuple[int, int]] | None = None  # (for mark_rows)
        self._hooks = self.adapter.install_tracking(self.tracker, shards, self._active)
        return shards

    def _what_ranks_share(self, config: DeckConfig) -> dict[str, str]:
        """What must be the same on every rank: the configuration (but what may name a host's
        own paths or credentials: storage options, the spool folder, Kafka client settings),
        and which optimizers and state are saved (a rank given none would save none)."""
        shared = config.model_dump(
            mode="json",
            exclude={
                "storage_options": True,
                "staging": {"spool_dir"},
                "publish": {"storage_options", "kafka"},
            },
        )
        # (each field of a nested config named apart: a break-it finding read "disagree on
        # DeckConfig.staging" without which of its fields)
        out = {
            f"DeckConfig.{k}{f'.{f}' if f else ''}": json.dumps(x, sort_keys=True)
            for k, v in shared.items()
            for f, x in (v.items() if isinstance(v, dict) else [("", v)])
        }
        out["dense optimizers"] = json.dumps(len(self._optimizers.dense))
        out["optimizer wrappers"] = json.dumps(sorted(self._optimizers.wrappers))
        out["state"] = json.dumps(self._state is not None)
        return out

    def _use(self, optimizers: Any, state: UserState | None) -> None:
        """Checkpoint ``optimizers`` (the dense ones, through the adapter) and, when given,
        ``state`` from now on: at construction, or later for a subclass whose optimizers are
        built after it (:meth:`deck.trainer.wrapper.ModelCheckpointer.attach`). Local, not
        collective."""
        self._optimizers = self.adapter.optimizers(optimizers)
        self._gradients = self.adapter.watch_gradients(self._optimizers)
        if state is not None:
            self._state = user_state_pair(state)

    @property
    def on_checkpoint(self) -> OnCheckpoint | None:
        """Called with each checkpoint's :class:`~deck.trainer.events.CheckpointEvent` (and each
        publish's), on every rank, in order, on deck's events thread; None: only logged."""
        return self._on_checkpoint

    @on_checkpoint.setter
    def on_checkpoint(self, callback: OnCheckpoint | None) -> None:
        if callback is not None and not callable(callback):
            raise ConfigError(
                f"on_checkpoint must be a callable taking a deck.CheckpointEvent, or None; got "
                f"{type(callback).__name__}"
            )
        self._on_checkpoint = callback

    @property
    def tracking(self) -> bool:
        """Whether the tracking hooks are installed (until :meth:`close`)."""
        return self._hooks is not None

    def _hooks_replaced(self) -> bool:
        """Whether something replaced the tracking hooks since they were installed (e.g. a
        tracker whose setter does not chain), so lookups since then went untracked; False once
        closed."""
        return self._hooks is not None and not self._hooks.intact()

    def _reinstall_tracking(self) -> None:
        """Install the tracking hooks again, chained after whatever callbacks the model holds
        now (for a subclass that sees something replace them); nothing once closed."""
        if self._hooks is None:
            return
        self._hooks.remove()
        self._hooks = self.adapter.install_tracking(
            self.tracker, self.adapter.table_shards(), self._active
        )

    @property
    def stager(self) -> Stager | ProcessStager:
        """The checkpoint chain's stager (its tier, spool and background threads)."""
        return self._ckpt.stager

    @property
    def _chains(self) -> list[ChainWriter]:
        return [c for c in (self._ckpt, self._pub) if c is not None]

    @property
    def history(self) -> list[CheckpointStats]:
        """Stats of this process's checkpoints, oldest first (they fill in as they commit)."""
        return self._ckpt.history

    def break_chains(self) -> None:
        """The next checkpoint and publish are fulls (e.g. rows went untracked)."""
        for chain in self._chains:
            chain.parent = None

    def _chain(
        self,
        label: str,
        consumer: str,
        storage: Storage,
        on_gpu: bool,
        reopen: Reopen | None,
        lease: Lease | Leases | None,
        quantize: str | None = None,
    ) -> ChainWriter:
        epoch = self._next_epoch(storage)  # collective: before the stager starts its thread
        staging = self.config.staging
        fence = None if lease is None else lease.check
        gone = None if lease is None else lease.gone
        stager: Stager | ProcessStager
        why = None
        if staging.mode == "process":
            why = process_unsupported(staging, storage, reopen, on_gpu)
        if staging.mode == "process" and why is None:
            assert reopen is not None
            stager = ProcessStager(
                storage, staging, self.coord.rank, reopen, fence=fence, gone=gone, label=label
            )
        else:
            stager = Stager(
                storage,
                staging,
                self.coord.rank,
                pinned=on_gpu,
                fence=fence,
                gone=gone,
                label=label,
            )
        logger.log(
            # (asked for and not used: a break-it finding, said at INFO it went unseen)
            (logging.WARNING if why else logging.INFO) if self.coord.rank == 0 else logging.DEBUG,
            "deck: %s staging runs in %s%s",
            label,
            "a staging process per rank" if isinstance(stager, ProcessStager) else "threads",
            f" (staging.mode='process' is not used: {why})" if why else "",
        )
        self._stagers.append(stager)  # close() (or a failed construction) stops it
        chain = ChainWriter(
            label=label,
            consumer=consumer,
            storage=storage,
            stager=stager,
            epoch=epoch,
            coord=self.coord,
            tracker=self.tracker,
            adapter=self.adapter,
            staging=self.config.staging,
            extra_state=self._extra_state,
            lease=lease,
            quantize=quantize,
        )
        chain.notify = self._events.put
        self._writers.append(chain)
        return chain

    @property
    def _loader(self) -> StateLoader:
        # Built per restore: dense optimizers and user state may be attached after construction.
        return StateLoader(
            self.storage,
            self.coord,
            self.adapter,
            self._optimizers,
            None if self._state is None else self._state[1],
            restore_rng=self.config.save_rng,
        )

    @property
    def published(self) -> list[CheckpointStats]:
        """Stats of this process's publishes (empty without ``DeckConfig.publish``)."""
        return [] if self._pub is None else self._pub.history

    def _open_publisher(self, on_gpu: bool, storage: Storage | None) -> ChainWriter | None:
        cfg = self.config.publish
        if cfg is None:
            return None
        # ``publish_storage`` replaces the store of ``publish.uri``, as ``storage`` does for
        # ``uri`` (a custom backend, or a fault-injecting wrapper in tests).
        sink = schemes.lookup(cfg.uri, "publish")
        sink_only = sink.role == "publish"
        place = cfg.state_uri if sink_only and cfg.state_uri else cfg.uri
        publish_storage_given = storage is not None
        store = storage or open_storage(place, cfg.storage_options)
        _require_shared(place, "DeckConfig.publish", self.coord.world_size)
        self._check_same_store(store, "DeckConfig.publish")
        timeout_s = self.config.staging.upload_timeout_s
        # One job per publish URI, as per checkpoint URI: two jobs publishing to one place
        # (at once, or one after the other: deck.trainer.publish_owner) would each start a
        # timeline there in turn, and a follower or live model would switch from one job's
        # model to the other's without a word. The publish chain's commits are fenced by both
        # leases: a job taken over at either URI publishes nothing more.
        self._pub_lease = self._take_lease(
            store, then=lambda epoch: claim(store, self.config.uri, cfg.take_over, epoch)
        )
        storage = store
        lease: Lease | Leases | None = self._lease
        if self._lease is not None and self._pub_lease is not None:
            lease = Leases(self._lease, self._pub_lease)
        if sink_only:
            # Table rows go through the sink (kafka: deck.trainer.kafka_sink), the rest to
            # state_uri.
            storage = sink.open(cfg, storage, self.coord.world_size, timeout_s)
        check_writable(storage)
        quantize = None if cfg.quantize == "none" else cfg.quantize
        # A staging process opens the same destination again: the store, and the sink over it
        reopen = None
        if not publish_storage_given:
            publish = cfg if sink_only else None
            reopen = Reopen(place, cfg.storage_options, publish, self.coord.world_size, timeout_s)
        return self._chain("publish", PUBLISH_CONSUMER, storage, on_gpu, reopen, lease, quantize)

    def _check_same_store(self, storage: Storage, field: str) -> None:
        """Collective: every rank sees what rank 0 writes at ``storage`` (a probe object, then
        deleted), or every rank raises. A break-it finding: a relative path (each process's
        working directory), or a local folder on hosts that share no disk, was taken; each rank
        wrote its parts where the others never looked, nothing was committed and close() waited
        an hour for the missing parts."""
        if self.coord.world_size == 1:
            return
        key = ""
        refused: Exception | None = None
        if self.coord.rank == 0:
            key = f"{PROBE_PREFIX}{uuid.uuid4().hex}"
            try:
                storage.put(key, b"deck: every rank must see this\n")
            except OSError as e:
                key, refused = "", e
        key = self.coord.gather_bytes(key.encode())[0].decode()  # rank 0's
        try:
            if self.coord.rank != 0 and key and not storage.exists(key):
                refused = ConfigError(
                    f"{field}: rank {self.coord.rank} does not see at {storage.uri} what rank 0 "
                    "wrote at its URI: every rank must reach the same store (a shared file "
                    "system or an object store); a relative path resolves against each "
                    "process's working directory, and a local folder is not shared between "
                    "hosts"
                )
        except OSError as e:
            refused = e
        try:
            self.coord.agree_on_failure(refused, "deck.enable")
        finally:
            if key and self.coord.rank == 0:
                with contextlib.suppress(OSError):
                    storage.delete(key)

    def _take_lease(
        self, storage: Storage, then: Callable[[int | None], None] | None = None
    ) -> Lease | None:
        """Rank 0 takes the writer lease of ``storage``, then runs ``then`` holding it (given
        the lease's epoch; collective: every rank raises if either failed, and the lease is
        given back); None on other ranks, or without ``lease_ttl_s`` (``then`` still runs,
        given None)."""
        lease, error, claiming = None, None, False
        if self.coord.rank == 0:
            try:
                if self.config.lease_ttl_s is not None:
                    ttl = self.config.lease_ttl_s
                    lease = Lease(storage, ttl, wait_s=ttl)
                    lease.acquire()
                if then is not None:
                    claiming = True
                    then(None if lease is None else lease.epoch)
            except Exception as e:  # whatever it is, the other ranks must not wait in the broadcast
                error = e
                if lease is not None:
                    lease.release()
                lease = None
        # (1: taken; 2: ``then`` refused or failed; 0: the lease could not be taken)
        code = 1 if error is None else 2 if claiming else 0
        try:
            code = self.coord.broadcast_int(code)
        except BaseException:
            if lease is not None:
                lease.release()  # not returned, so construction could not give it back
            raise
        if error is not None:
            raise error
        if code == 2:
            raise ConfigError(
                f"rank 0 refused or could not claim {storage.uri}; see rank 0's error"
            )
        if code == 0:
            raise LeaseHeldError(
                f"rank 0 could not take the writer lease of {storage.uri}; see rank 0's error"
            )
        return lease

    # ---- tracking control --------------------------------------------------------------------
    def _active(self, module: torch.nn.Module) -> bool:
        return self._paused == 0 and (module.training or self.config.track_eval)

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Inside this block, lookups are not tracked (e.g. evaluation forwards), but for those
        whose output requires grad: a backward would update their rows, so they are tracked
        anyway (run evaluation under ``torch.no_grad()``)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    # ---- saving ------------------------------------------------------------------------------
    def step(self, step: int) -> CheckpointStats | None:
        """Call after the optimizer step of ``step``; saves when ``step % delta_every_steps == 0``.

        The checkpoint is full when there is no committed parent in this process (the first one,
        or after an unrecoverable error) or ``step`` is a multiple of ``full_every_steps``. A
        ``step`` that is not an int >= 0 (numpy and 0-d tensor integers count) is a
        :class:`ConfigError`.
        """
        self._check_open("step")
        step = as_step(step, "step")
        # (A step not due is refused too: the save() that may follow would take it)
        self._ckpt.refuse_going_back(step, again=False)
        self._last_step, self._stepped = step, True
        stats = None
        if step % self.config.delta_every_steps == 0:
            full_every = self.config.full_every_steps
            full = self._ckpt.parent is None or (full_every is not None and step % full_every == 0)
            stats = self.save("full" if full else "delta", step=step)
        if self.config.publish is not None and step % self.config.publish.every_steps == 0:
            self.publish(step)
        return stats

    def publish(self, step: int | None = None) -> CheckpointStats | None:
        """Publish the rows touched since the last publish as a delta of the publish chain
        (``DeckConfig.publish``; a full when it has no committed parent or ``step`` is a
        multiple of ``publish.full_every_steps``), staged in the background
        like a checkpoint. ``step()`` calls it every ``publish.every_steps``. Collective.

        A failed publish is logged, never raised, and leaves the checkpoint chain alone; the next
        publish is then a full. Returns None when nothing was published.
        """
        chain = self._pub
        if chain is None:
            raise ConfigError("publish() needs DeckConfig(publish=PublishConfig(uri=...))")
        self._check_open("publish")
        if step is None:
            step = self._last_step
        if step is None:
            raise ConfigError("publish() needs step=... before the first call to step()")
        step = as_step(step, "publish")
        full_every = self.config.publish.full_every_steps if self.config.publish else None
        try:
            return chain.save("full" if full_every and step % full_every == 0 else "delta", step)
        except CheckpointError as e:
            chain.parent = None
            logger.error("deck: publish of step %d failed; the next publish is a full: %s", step, e)
            return None

    def save(
        self, kind: Literal["delta", "full"] = "delta", *, step: int | None = None
    ) -> CheckpointStats | None:
        """Take a checkpoint of ``kind`` at ``step`` (default: the last step given to ``step``).

        Returns once every rank's part is in the first staging tier, so training may go on; the
        upload and commit finish in the background (``flush()`` waits for them, and the returned
        stats fill in as they go). Returns None when the spool is full and the policy is ``skip``.
        On failure nothing is committed, the tracked rows stay pending for the next checkpoint,
        and :class:`CheckpointError` names the step and the cause. A ``kind`` other than those
        two, a ``step`` that is not an int >= 0, or no ``step`` before the first call to
        ``step()``, is a :class:`ConfigError`.
        """
        self._check_open("save")
        if kind not in ("delta", "full"):
            raise ConfigError(f"kind must be 'delta' or 'full', got {kind!r}")
        if step is None:
            step = self._last_step
        if step is None:
            raise ConfigError("save() needs step=... before the first call to step()")
        return self._ckpt.save(kind, as_step(step, "save"))

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise ConfigError(
                f"{what}() after close(): this checkpointer of {self.config.uri} is closed "
                "(the end of its `with deck.enable(...)` block, or close()); enable deck again "
                "to go on checkpointing"
            )

    def mark_rows(self, table: str, rows: torch.Tensor | list[int]) -> int:
        """Record that rows ``rows`` (global row ids) of embedding table ``table`` (its
        weight's ``model.state_dict()`` key) are changed outside a step's lookup -- a max-norm
        clamp, re-initialised rows --, so that the next checkpoints of each chain hold them:
        deltas hold only what lookups touched. Call it *before* writing them: a checkpoint just
        taken whose copy-on-write copy is still pending copies those rows first, so it keeps
        its step's values (called after the write, that checkpoint may hold the new values
        unless it was copied already: ``flush()`` or ``wait_for(step)``). Local, not
        collective: each rank records the rows its shards of the table hold and returns how
        many (call it on every rank with the ids it changes, or on all with the same ids; a
        data_parallel table is saved whole at every checkpoint: 0). An unknown table or an id
        outside it is a :class:`ConfigError`."""
        self._check_open("mark_rows")
        if self._table_shapes is None:  # (a state_dict of the model: once, not per call)
            self._table_shapes = self.adapter.table_shapes()
        shapes = self._table_shapes
        if table not in shapes:
            if table in self.adapter.replicated_tables():
                return 0  # (data_parallel: saved whole with the dense state, nothing to mark)
            near = [k for k in shapes if k.endswith(f".{table}.weight")]
            hint = f"did you mean {near[0]!r}?" if near else f"tables: {sorted(shapes)}"
            raise ConfigError(
                f"mark_rows: no embedding table {table!r} (its weight's state_dict key); {hint}"
            )
        ids = torch.as_tensor(rows, dtype=torch.int64).reshape(-1).cpu()
        size = shapes[table][0]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= size):
            raise ConfigError(f"mark_rows: row ids of {table!r} are 0..{size - 1}")
        marked = 0
        # (every shard of it here: row ranges, and column shards holding the same rows)
        for s in (s for s in self.adapter.table_shards() if s.table == table):
            mine = ids[(ids >= s.row_offset) & (ids < s.row_offset + s.rows)]
            if mine.numel():
                positions = mine - s.row_offset + s.track_base
                if self.tracker.guarding:  # (a break-it finding: the write reached that copy)
                    self.tracker.guard(positions)
                self.tracker.record(positions)
                marked += int(mine.numel())
        return marked

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every staged checkpoint is committed (or failed), on every rank: when it
        returns, ``list_checkpoints`` shows them from any rank. Collective: call it on all ranks.
        Returns True only if every checkpoint taken since the last flush committed: False if
        any rank timed out or any of them failed (``history`` says which and why; a failed
        publish is logged, it does not count), and always False once this job lost its writer
        lease. A checkpoint whose ``step()``/``save()`` raised was never taken and does not
        count either: True after calls that all raised means nothing is in flight, not that
        anything was saved."""
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        chains = self._chains
        for chain in chains:
            chain.exchange_failures(left())
        done = all([chain.stager.flush(left()) for chain in chains])
        # And the lineage checks those commits started: the next checkpoint knows what they found
        done = all([chain.lineage_settled(left()) for chain in chains]) and done
        # Every flushed checkpoint's event delivered (a callback's metrics are complete)
        done = self._events.drain(left()) and done
        # Publishes are best effort (a failed one is logged and the next is a full): only a
        # checkpoint that did not commit makes the flush report failure.
        done = not self._ckpt.failed_since_last_report(done) and done
        # A job whose writer lease was taken over commits nothing more, nor one whose lease
        # lapsed until it is taken again: never a success, attempted checkpoint or not.
        done = done and not (self._lease is not None and self._lease.lost.is_set())
        # Rank 0's flush includes the commits; the gather holds the other ranks until it is done.
        return bool(self.coord.gather([float(done)]).min() > 0)

    def wait_for(
        self, step: int, timeout: float | None = None, *, chain: str = "checkpoint"
    ) -> CheckpointEvent:
        """Wait until this process's checkpoint (or, ``chain="publish"``, publish) of ``step``
        is done on this rank and return its event: on rank 0 the checkpoint is then committed
        (a restore of ``step`` from any process finds it), on other ranks this rank's part is
        at the destination. Local, not collective; call it after the ``step``/``save`` that took
        the checkpoint (it does not wait for a step to be taken). Raises
        :class:`CheckpointError` when it failed, ``TimeoutError`` after ``timeout`` seconds,
        and :class:`CheckpointNotFoundError` when this process took no checkpoint of ``step``
        (the newest attempt counts)."""
        if timeout is not None and timeout < 0:
            raise ConfigError(f"wait_for(timeout={timeout}): give seconds >= 0, or None")
        found = self._ckpt if chain == "checkpoint" else self._pub if chain == "publish" else None
        if found is None:
            raise ConfigError(
                f"wait_for(chain={chain!r}): the chains are 'checkpoint' and 'publish' "
                "(the latter with DeckConfig.publish)"
            )
        stats = next((s for s in reversed(found.history) if s.step == step), None)
        if stats is None:
            taken = sorted({s.step for s in found.history})
            when = (
                "step() is called with a multiple of delta_every_steps, or by save()"
                if chain == "checkpoint"
                else "step() is called with a multiple of publish.every_steps, or by publish()"
            )
            other = (
                " (a publish step? wait_for(step, chain='publish'))"
                if chain == "checkpoint" and self._pub is not None
                else ""
            )
            raise CheckpointNotFoundError(
                f"wait_for({step}): this process took no {chain} of step {step} at "
                f"{found.storage.uri} (it took {_steps(taken)}){other}; a {chain} is taken when "
                f"{when}"
            )
        if not stats.progress.wait(timeout):
            raise TimeoutError(
                f"{chain} of step {step} at {found.storage.uri} not done after {timeout} s "
                f"(state: {stats.state})"
            )
        event = CheckpointEvent.of(stats, chain, found.storage.uri, self.coord.rank)
        if not event.ok:
            raise CheckpointError(
                f"{chain} of step {step} at {found.storage.uri} failed: {event.error}"
            )
        return event

    def _extra_state(self, shards: list[TableShard]) -> dict[str, Any]:
        extra: dict[str, Any] = {
            "optimizers": {
                name: optimizer_record(
                    opt, self._optimizers.classes[name], self._optimizers.param_names.get(name)
                )
                for name, opt in self._optimizers.dense.items()
            },
            "wrappers": {name: w.get() for name, w in self._optimizers.wrappers.items()},
            "fused_hyperparameters": self.adapter.fused_hyperparameters(),
            "user": self._state[0]() if self._state else None,
            "scalars": {
                scalar_key(s.table, s.row_offset, s.col_offset): dict(s.scalars)
                for s in shards
                if s.scalars
            },
        }
        modules = self.adapter.module_state()
        if modules:
            extra["modules"] = modules
        if self.config.save_rng:
            extra["rng"] = capture_rng()
        return extra

    # ---- restoring ---------------------------------------------------------------------------
    def restore(self, step: int | None = None, *, allow_fallback: bool = False) -> int | None:
        """Load committed ``step`` (the latest restorable one when None) into the live model,
        optimizers and user state, bitwise. Returns the step restored, or None when the URI
        holds no checkpoint. Later checkpoints are deltas relative to the restored one when it
        is the newest committed step; after a rollback (an older step) the next checkpoint is
        a full, so the new timeline never depends on a chain GC may be deleting.
        Collective: call it on all ranks; they load the same step or all raise.

        A damaged or missing file raises :class:`CorruptCheckpointError` naming it. With
        ``allow_fallback`` rank 0 instead re-verifies the lineage (reading every byte once more),
        quarantines what is damaged, and restores the cheapest valid chain of that step -- or, if
        it has none, of the newest older step that has one; ``last_restore.fallback`` and a
        warning say what was skipped and why.
        """
        if step is not None:
            step = as_step(step, "restore")
        # Every rank's pending parts first (rank 0's flush is the commit), then rank 0 alone picks
        # the target so that all ranks load the same step even while other writers commit.
        self.flush()
        try:
            done = self._loader.restore(step, allow_fallback)
        except BaseException as e:
            # The model may be partly overwritten: a delta of the last checkpoint would not
            # hold what changed, so whatever training does next, the next checkpoint is a full.
            self.break_chains()
            if allow_fallback and isinstance(e, Exception):
                lineage_changed(self.storage.uri)  # as below
            raise
        if done is None:
            return None
        self.tracker.reset()  # the model equals a checkpoint: nothing is dirty
        if self._pub is not None:
            # The model jumped to the restored step: a delta of the last publish would be wrong.
            self._pub.parent = None
            self._pub.epoch += 1
        self._ckpt.parent, self._ckpt.base, self._ckpt.epoch = done.parent, done.base, done.epoch
        self._ckpt.newest = self._ckpt.restored = done.step
        self._ckpt.newest_saved = True
        if self._pub is not None:
            # A new epoch of the publish stream starts at the restored step, which may be older
            # than its last publish, and may publish that step itself, never an older one.
            self._pub.newest = self._pub.restored = done.step
            self._pub.newest_saved = False
        for chain in self._chains:
            chain.unsettle()  # the first checkpoint after a restore agrees before its snapshot
        if allow_fallback:
            # Rank 0 may have quarantined checkpoints: every other chain of this URI in this
            # process learns now whether that broke it, never in a checkpoint's stall.
            lineage_changed(self.storage.uri)
        self._last_step = done.step
        self.last_restore = done.stats
        return done.step

    def _next_epoch(self, storage: Storage) -> int:
        """Collective: the epoch after every checkpoint committed at ``storage`` and every
        epoch witnessed there (rank 0 reads: the newest part of the history where that
        answers: no trainer checkpoint left unread is newer than the latest one read, nor of
        an epoch newer than the newest witness, which it lists). Rank 0 keeps the latest
        restorable step of that read of the checkpoint URI (:meth:`_stored_newest`)."""
        epoch = 0
        if self.coord.rank == 0:
            read = read_window(storage) or read_manifests(storage)
            epoch = next_epoch(read, storage)
            if storage is self.storage:  # (not the publish chain's)
                self._read_newest = _newest_restorable(read)
        return self.coord.broadcast_int(epoch)

    def _stored_newest(self) -> int | None:
        """Collective: the latest restorable step at the URI before this process, or the
        newest being committed by the recovery of a crashed one's parts (rank 0's read, for
        every rank); None for none."""
        newest = -1
        if self.coord.rank == 0:
            steps = [s.step for s in self.recovered]
            if self._read_newest is not None:
                steps.append(self._read_newest)
            newest = max(steps, default=-1)
        newest = self.coord.broadcast_int(newest)
        return None if newest < 0 else newest

    # ---- lifetime ----------------------------------------------------------------------------
    def close(self, collective: bool = True) -> None:
        """Finish pending work (uploads, commits), remove the tracking hooks, stop the background
        threads and release the writer lease; idempotent. Whatever raises (the flush, a stager),
        everything is still released, then the error propagates.
        Collective unless ``collective=False``: then this rank only finishes its own background
        work (rank 0 still commits what every rank uploaded), so a rank leaving on an exception
        never waits for ranks that went on."""
        if self._closed:
            return
        self._closed = True
        forget(self)
        if self._stepped and not self.history:
            # (a break-it finding: a job shorter than delta_every_steps ended with nothing
            # saved and nothing said)
            logger.warning(
                "deck: closing %s without a checkpoint: step() was called up to step %s and "
                "saves at multiples of delta_every_steps (%d); call save() before close() to "
                "keep this state",
                self.storage.uri,
                self._last_step,
                self.config.delta_every_steps,
            )
        try:
            if collective:
                self.flush()
        finally:
            self._release()

    def watches(self, model: torch.nn.Module) -> bool:
        """Whether this open checkpointer tracks ``model``."""
        return self.tracking and getattr(self.adapter, "model", None) is model

    def close_at_exit(self) -> None:
        """``close(collective=False)``, for a process exiting without ``close()``
        (:mod:`deck.at_exit`): what this rank staged is finished, not lost, and a
        warning names the checkpoints it waited for and how they ended."""
        waiting = [(c, [s for s in c.history if not s.progress.wait(0)]) for c in self._chains]
        waiting = [(c, parts) for c, parts in waiting if parts]
        logger.warning(
            "deck: the process is exiting without close() on %s: closing it on this rank%s "
            "(call close(), or use the checkpointer in a `with` block, to end a job)",
            self.storage.uri,
            f", finishing {_parts(waiting)} first" if waiting else "",
        )
        self.close(collective=False)
        if waiting:
            logger.warning("deck: finished at exit: %s", _parts(waiting, with_state=True))

    def _release(self) -> None:
        """Remove the tracking hooks, stop every stager (waiting for its own background work)
        and release the writer lease: each is done whatever the ones before raise (an error
        propagates once all ran), only what was taken, and nothing twice."""
        hooks, stagers, self._hooks, self._stagers = self._hooks, self._stagers, None, []
        gradients, self._gradients = self._gradients, None
        writers, self._writers = self._writers, []
        with contextlib.ExitStack() as stack:  # runs its callbacks last-in first-out
            stack.callback(self._events.close)  # after the stagers: their last events too
            if self._lease is not None:
                stack.callback(self._lease.release)
            if self._pub_lease is not None:
                stack.callback(self._pub_lease.release)
            for writer in writers:  # after the stagers: their last commits start checks
                stack.callback(writer.close)
            for stager in stagers:
                stack.callback(stager.close)
            if hooks is not None:
                stack.callback(hooks.remove)
            if gradients is not None:
                stack.callback(gradients.remove)

    def __enter__(self) -> DeltaCheckpointer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        # Leaving on an exception: the other ranks may not be leaving with us.
        self.close(collective=exc_type is None)


def default_adapter(model: torch.nn.Module) -> ModelAdapter:
    """TorchRec's adapter, for a model given without one; imported here, on first use, so that
    a checkpointer with its own adapter never loads TorchRec."""
    require_torchrec("deck.DeltaCheckpointer")
    from deck.adapters.torchrec import TorchRecAdapter

    return TorchRecAdapter(model)  # type: ignore[arg-type]


def user_state_pair(
    state: UserState | None,
) -> tuple[Callable[[], Any], Callable[[Any], None]] | None:
    """The ``(get, set)`` functions of user state given as an object with
    ``state_dict()``/``load_state_dict()`` or as such a pair (None: no user state);
    :class:`ConfigError` for anything else (a DeckError, so every rank of a refusing ``enable``
    raises the same class)."""
    if state is None:
        return None
    if isinstance(state, tuple) and len(state) == 2 and all(callable(f) for f in state):
        return state
    if isinstance(state, Stateful):
        return state.state_dict, state.load_state_dict
    raise ConfigError(
        "state must be an object with state_dict()/load_state_dict() or a (get_state, set_state) pair, "
        f"got {type(state).__name__}"
    )


def enable(
    model: torch.nn.Module,
    optimizers: Any,
    config: DeckConfig,
    state: UserState | None = None,
    *,
    on_checkpoint: OnCheckpoint | None = None,
) -> DeltaCheckpointer:
    """The one-line way in: returns a :class:`DeltaCheckpointer` tracking ``model``.
    ``on_checkpoint`` gets each checkpoint's :class:`~deck.trainer.events.CheckpointEvent`."""
    return DeltaCheckpointer(model, optimizers, config, state, on_checkpoint=on_checkpoint)


def _require_shared(uri: str, field: str, world_size: int) -> None:
    """Refuse a store that other processes cannot see (``memory://``) for a multi-rank job."""
    if world_size > 1 and not schemes.lookup(uri, "publish").shared:
        raise ConfigError(
            f"{field} {uri!r}: {schemes.scheme_name(uri)}:// exists inside one process only, so "
            "the ranks of a multi-process job cannot see each other's parts; use a shared "
            "path or object store"
        )


def _parts(
    waiting: list[tuple[ChainWriter, list[CheckpointStats]]], with_state: bool = False
) -> str:
    """``<chain> steps <steps> at <uri>`` per chain, and with ``with_state`` how each ended."""
    out = []
    for chain, parts in waiting:
        if not with_state:
            out.append(f"{chain.label} {_steps([s.step for s in parts])} at {chain.storage.uri}")
            continue
        ended: dict[str, list[str]] = {}
        for s in parts:
            ended.setdefault(s.state, []).append(f"{s.step}" + (f" ({s.error})" if s.error else ""))
        how = "; ".join(f"{state} {', '.join(steps)}" for state, steps in ended.items())
        out.append(f"{chain.label} steps at {chain.storage.uri}: {how}")
    return "; ".join(out)


def _steps(steps: list[int]) -> str:
    if not steps:
        return "none"
    shown = ", ".join(map(str, steps[-5:]))
    return f"steps {'..., ' if len(steps) > 5 else ''}{shown}"


def _newest_restorable(read: ManifestSet) -> int | None:
    """The latest restorable step of ``read`` (what ``restore()`` would load), or a newer step
    that a lost commit record's return makes restorable (a break-it finding: with the record
    of the chains' full lost, a run that skipped restore() saved over every step, which putting
    the record back would have restored); or its newest step where the part of the history
    read cannot tell. Checkpoints no chain reaches otherwise (a quarantine, a rollback) are not
    history a new run could lose."""
    try:
        graph = build_graph(read)
        latest = graph.latest(log=False)
        lost = graph.lost_records(-1 if latest is None else latest)
    except OutsideWindow:
        return max(read, default=None)
    return max(lost, default=latest)
