"""Which job publishes at a publish URI: ``_job.json``, naming the checkpoint URI of the job
that publishes there.

A job is its checkpoint URI: its restarts and rollbacks write there and publish on from it.
Another job publishing to the same place, even after the first one ended, would start a
timeline there that a follower or live model takes for a restart of the first: it would switch
from one job's model to the other's without a word, and the second job's steps would replace
the first one's commit records at the same steps. So rank 0, holding the publish URI's writer
lease, reads the record at ``enable`` and refuses another job's unless told to take the URI
over (``PublishConfig.take_over``); then writes its own. A publish URI written before these
records (none there) is taken as this job's. A record that cannot be read is never taken for
absent: it refuses the job, naming the file, unless it is taken over.

The other way round, a job whose checkpoint URI holds a ``_job.json`` is refused at ``enable``
too (:func:`refuse_publish_uri`): its commits would start a timeline among another job's
publishes, which followers and live models would serve as that job's model.
"""

from __future__ import annotations

import logging

from pydantic import BaseModel, ConfigDict, Field

import deck.schemes as schemes
from deck.errors import ConfigError, CorruptCheckpointError, NotFoundError
from deck.format.epochs import newest_witness
from deck.format.manifest import load_model
from deck.storage import Storage
from deck.storage.base import get_bounded

logger = logging.getLogger(__name__)

JOB_RECORD = "_job.json"


class PublishJob(BaseModel):
    """``_job.json``: the place of the checkpoint URI of the job that publishes here, as
    :func:`deck.schemes.location` spells it (two spellings of one place compare equal)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    checkpoints: str = Field(min_length=1, max_length=4096)


def refuse_publish_uri(storage: Storage) -> None:
    """Refuse ``storage`` as a checkpoint URI with :class:`ConfigError` when it holds a
    ``_job.json`` (readable or not: only publish URIs hold one), naming the file."""
    where = storage.describe(JOB_RECORD)
    try:
        data = get_bounded(storage, JOB_RECORD)
    except NotFoundError:
        return
    try:
        held = f"the job with checkpoints at {load_model(PublishJob, data, where).checkpoints}"
    except CorruptCheckpointError as e:
        held = f"a job its record does not say ({e})"
    raise ConfigError(
        f"{storage.uri} is a publish URI ({where} names {held}): checkpoints there would "
        "start a timeline among that job's publishes, and followers and live models would "
        "serve it as that job's model. Give DeckConfig.uri a place of its own; to start from "
        "a published step, read it with deck.load(model, optimizers, uri) and enable deck "
        "with another URI"
    )


def claim(
    storage: Storage, checkpoint_uri: str, take_over: bool, lease_epoch: int | None = None
) -> None:
    """Make ``storage`` (a publish URI, or a Kafka publisher's state URI) this job's: refuse
    with :class:`ConfigError` when its record names another job's checkpoints or cannot be
    read, or when it has none but writer leases were taken there before this job's
    (``lease_epoch``, the epoch of the publish lease it holds: above the first, it may be a
    trainer's checkpoint URI), unless ``take_over``; and, ``take_over`` or not, when it has none
    but commits (an epoch witness): a publish URI gets its record before its first commit, so
    that is a trainer's checkpoint URI. Write this job's record when it is not there yet."""
    ours = PublishJob(checkpoints=schemes.location(checkpoint_uri))
    where = storage.describe(JOB_RECORD)
    absent = False
    try:
        held: PublishJob | None = load_model(PublishJob, get_bounded(storage, JOB_RECORD), where)
    except NotFoundError:
        held, absent = None, True
    except CorruptCheckpointError as e:
        if not take_over:
            raise ConfigError(
                f"{where} (which job publishes at {storage.uri}) cannot be read: {e}. If no "
                "other job publishes there, set PublishConfig(take_over=True) to make it this "
                "job's"
            ) from e
        held = None
    if held is not None and schemes.location(held.checkpoints) == ours.checkpoints:
        return
    if held is not None and not take_over:
        raise ConfigError(
            f"{storage.uri} holds the publishes of another job (checkpoints at "
            f"{held.checkpoints}; this job's are at {ours.checkpoints}): a follower or live "
            "model there would switch from that job's model to this one's without a word. Give "
            "PublishConfig.uri a place of its own, or set PublishConfig(take_over=True) if that "
            "job is retired and this one replaces it (or if it is this job, its checkpoint "
            "folder moved or mounted at another path)"
        )
    # (break-it findings: a job's publish.uri set to another job's checkpoint URI replaced that
    # job's commit records with its publishes; with take_over, told to by this very refusal,
    # it did too.) The epoch witnesses a trainer puts before its first commit say it whether
    # leases are on or not; a lease taken before this job's alone may be this job's own, from
    # an enable that failed before it wrote the record.
    if absent and newest_witness(storage) is not None:
        raise ConfigError(
            f"{storage.uri} holds a trainer's commits but no {where}: it is a checkpoint URI "
            "(a publish URI gets that record before its first publish), and publishing there "
            "would replace that job's checkpoints, take_over or not. Give PublishConfig.uri a "
            "place of its own"
        )
    if absent and not take_over and lease_epoch is not None and lease_epoch > 1:
        raise ConfigError(
            f"{storage.uri} has writer lease records of a trainer before this job but no "
            f"{where}: it may be another job's checkpoint URI. A publish URI is a place of its "
            "own: give PublishConfig.uri another one, or set PublishConfig(take_over=True) if "
            "it is this job's publish URI and nothing was published there yet"
        )
    storage.put(JOB_RECORD, ours.model_dump_json().encode())
    if held is not None:
        logger.warning(
            "deck: took over the publish URI %s from the job with checkpoints at %s "
            "(PublishConfig.take_over): followers and live models there move to this job's "
            "model at its first publish",
            storage.uri,
            held.checkpoints,
        )
