"""Multi-layer staging: CPU chunk buffers -> local SSD spool -> destination, in the background.

The training thread fills at most ``chunks_in_flight`` reusable buffers; a spool writer thread
writes each to the spool and hands the buffer back, so CPU memory stays bounded whatever the
model size. Training resumes once every chunk of a rank's part is in a buffer
(``release="in_memory"``) or written to the spool with the part's pending record beside it
(``"first_tier"``). Background threads then, per checkpoint: wait for the part's writes and
pending record, fsync the spool files (durable-local), upload them with retries (remote tiers),
put the rank part manifest at the destination, and -- on rank 0, once every rank's part
manifest is there -- write the commit record. The parts of consecutive checkpoints go up at
once; commit records go out one at a time, in step order, each after the one before returned
(:mod:`.committer`). A part of another rank that fails
(its writes after training was released, or its upload) puts a failure record where its manifest
would go, so rank 0 stops waiting for it at once; the next collective checkpoint or flush also
tells rank 0 (the record may not be writable). The background thread never calls collectives.

A process that restarts finds pending records in the spool and finishes them, or discards them
when the destination already has them or a later full made them useless.

Modules: :mod:`.stager` (:class:`Stager`, the training thread's side), :mod:`.part`
(:class:`StagedPart`, the writer's sink), :mod:`.pool` (:class:`BufferPool`), :mod:`.spool`
(the spool folder's files, pending records and space), :mod:`.destination` (patient,
one-attempt and best-effort calls at the destination), :mod:`.committer` (the commit threads),
:mod:`.recovery` (restart), :mod:`.records` (:class:`CheckpointStats`, the public view of a
part's progress). The pending record itself is on-disk format:
:class:`~deck.format.pending.PendingPart` (re-exported here).
"""

from deck.format.pending import PENDING_SUFFIX, PendingPart
from deck.trainer.staging.part import StagedPart
from deck.trainer.staging.pool import BufferPool
from deck.trainer.staging.records import CheckpointStats
from deck.trainer.staging.remote import ProcessStager, RemotePart, Reopen, process_unsupported
from deck.trainer.staging.stager import Stager, resolve_tier

__all__ = [
    "PENDING_SUFFIX",
    "BufferPool",
    "CheckpointStats",
    "PendingPart",
    "ProcessStager",
    "RemotePart",
    "Reopen",
    "StagedPart",
    "Stager",
    "process_unsupported",
    "resolve_tier",
]
