"""Subcommands that take a step's state elsewhere: ``deck export`` (DCP / safetensors / Parquet) and ``deck follow`` (a serving replica)."""

from __future__ import annotations

import argparse
import logging
import math
import os
import shutil
import sys
import time

import deck.schemes as schemes
from deck.cli.common import (
    Subparsers,
    check_out,
    human,
    open_existing,
    poll_seconds,
    progress_bar,
    quiet_catalog,
    say_damaged,
    step_number,
)
from deck.errors import ConfigError
from deck.serve.out_lock import LOCK_NAME, OutLock
from deck.storage import open_storage


def cmd_export(a: argparse.Namespace) -> int:
    """Run ``deck export`` with parsed arguments ``a``; returns its exit code (the table of :mod:`deck.cli`)."""
    from deck.ops.export import StepState, export_dcp, export_safetensors

    check_out(a.out, a.uri)
    with quiet_catalog():  # a damaged commit record is this command's error, said once
        state = StepState(open_existing(a.uri, a.storage_options), a.step)
    total = sum(math.prod(p.sizes) * p.dtype.itemsize for p in state.pieces)
    bar = progress_bar(f"export step {state.step}", total)
    progress = bar.update if bar else None
    t0 = time.perf_counter()
    try:
        if a.format == "dcp":
            rep = export_dcp(state, a.out, progress)
        elif a.format == "parquet":
            from deck.ops.export.parquet import export_parquet

            rep = export_parquet(state, a.out, progress)
        else:
            out = a.out
            if not out.endswith(".safetensors"):
                if os.path.lexists(out) and not os.path.isdir(out):
                    # (a break-it finding: said as "[Errno 17] File exists")
                    raise ConfigError(
                        f"--out {out} is a file: name a folder (the file is written into it) "
                        "or a path ending in .safetensors"
                    )
                out = os.path.join(out, f"deck-step-{state.step:012d}.safetensors")
            rep = export_safetensors(state, out, progress)
    finally:
        if bar:
            bar.close()
    print(
        f"exported step {rep.step} ({len(rep.chain)} checkpoints: {', '.join(rep.chain)}) to "
        f"{rep.path} as {a.format}: {rep.tensors} tensors, {human(rep.bytes_written)} written, "
        f"{human(rep.bytes_read)} read, at most {human(rep.max_held_bytes)} of table state "
        f"held at once, {time.perf_counter() - t0:.1f} s"
    )
    for s in rep.skipped:
        print(f"  not exported: {s}")
    return 0


def cmd_follow(a: argparse.Namespace) -> int:
    """Run ``deck follow`` with parsed arguments ``a``; returns its exit code (0 ok; a failure
    raises). Holds ``--out``'s lock (deck.serve.out_lock) while it runs. An ``--out`` folder
    this call created is removed again when the call fails before writing any file into it."""
    check_out(a.out, a.uri)
    created = not os.path.exists(a.out)
    lock: OutLock | None = None
    try:
        given = [f for f, v in _KAFKA_ONLY.items() if getattr(a, v) not in (None, 0)]
        if given and not schemes.is_publish_sink(a.uri):
            raise ConfigError(
                f"{', '.join(given)}: for kafka:// URIs only ({a.uri} is a directory of "
                "published checkpoints: its follower keeps no loader fulls, runs or groups); "
                "drop them"
            )
        if os.path.exists(a.out) and not os.path.isdir(a.out):
            raise ConfigError(f"--out {a.out} is not a directory: name a folder for the state")
        os.makedirs(a.out, exist_ok=True)
        lock = OutLock(a.out)
        if schemes.is_publish_sink(a.uri):  # kafka://: its own loading service
            return cmd_follow_kafka(a)
        return _follow_uri(a)
    except BaseException:
        if created:
            _remove_empty_tree(a.out)
        raise
    finally:
        if lock is not None:
            lock.release()


# deck follow's flags for a Kafka topic only, by their argparse names
_KAFKA_ONLY = {
    "--state-uri": "state_uri",
    "--group": "group",
    "--full-uri": "full_uri",
    "--full-every": "full_every",
    "--run": "run",
}


def _remove_empty_tree(path: str) -> None:
    """Remove folder ``path`` if it (and every folder below it) holds no file: what a failed
    start left, never anything a follower wrote."""
    if not os.path.isdir(path):
        return
    if any(set(files) - {LOCK_NAME} for _dir, _subdirs, files in os.walk(path)):
        return
    shutil.rmtree(path, ignore_errors=True)


def _follow_uri(a: argparse.Namespace) -> int:
    """``deck follow URI`` for a deck checkpoint chain (deck.serve.follow)."""
    from deck.serve.follow import FollowUpdate, follow

    # Without --once the follower waits for a publisher that has not written yet.
    storage = (
        open_existing(a.uri, a.storage_options)
        if a.once
        else open_storage(a.uri, a.storage_options)
    )

    said_waiting = False

    def show(u: FollowUpdate) -> None:
        nonlocal said_waiting
        if u.how != "unchanged":
            print(
                f"step {u.step} ({u.ckpt_id}): {u.how}, {len(u.applied)} checkpoint(s) read "
                f"({', '.join(u.applied)}), {human(u.bytes_read)} of chunks read (a restore of "
                f"the step reads {human(u.chain_bytes)}), {u.seconds:.2f} s ({u.write_s:.2f} s "
                f"writing) -> {a.out}",
                flush=True,
            )
        if not a.once and not said_waiting:
            # Once, after the first catch-up: a service started on an --out already up to date
            # said nothing at all, and looked hung.
            said_waiting = True
            print(
                f"serving step {u.step} ({u.ckpt_id}) of {a.uri} in {a.out}; waiting for new "
                f"checkpoints (checking every {a.poll:g} s; Ctrl-C stops)",
                flush=True,
            )

    try:
        follower = follow(
            storage,
            a.out,
            once=a.once,
            poll_s=a.poll,
            on_update=show,
            allow_quantized=a.allow_quantized,
            parquet=a.format == "parquet",
        )
    except KeyboardInterrupt:
        return 0
    # Damage on what it serves: the newest step may be newer than the one held
    newer = "the newest step may be newer than the one served"
    code = int(say_damaged("follow", a.uri, follower.damaged_ahead, newer))
    if follower.refused and follower.state is not None:
        sys.stdout.flush()
        step, why = max(follower.refused.items())
        print(
            f"deck follow: passed by damaged checkpoint(s) of step(s) {sorted(follower.refused)} "
            f"of {a.uri} (step {step}: {why}); serving step {follower.state[0]} (`deck verify "
            f"{a.uri} --all`)",
            file=sys.stderr,
        )
        code = 1
    return code


def cmd_follow_kafka(a: argparse.Namespace) -> int:
    """``deck follow kafka://host:port/topic``: the Kafka loading service (deck.serve.kafka_follow)."""
    from deck.serve.follow import FollowUpdate
    from deck.serve.kafka_follow import follow_kafka

    def show(u: FollowUpdate) -> None:
        print(f"step {u.step} ({u.ckpt_id}): {u.how}, {u.seconds:.2f} s -> {a.out}", flush=True)

    # What it started from (a loader full, the run it serves) is worth a line in a service's log
    logging.getLogger("deck.serve.kafka_follow").setLevel(logging.INFO)
    if a.state_uri is not None:
        # A --state-uri that is not there is a typo: said as such (exit 2), not "nothing to
        # serve yet" with a WARNING per marker (an operator's break-it run)
        open_existing(a.state_uri, a.storage_options)
    try:
        kf = follow_kafka(
            a.uri,
            a.out,
            once=a.once,
            on_update=show,
            state_uri=a.state_uri,
            open_store=lambda uri: open_storage(uri, a.storage_options),
            group=a.group,
            full_store=None if a.full_uri is None else open_storage(a.full_uri, a.storage_options),
            full_every=a.full_every,
            run=a.run,
            allow_quantized=a.allow_quantized,
            parquet=a.format == "parquet",
        )
    except KeyboardInterrupt:
        return 0
    held = kf.held()  # --once: say where it stands, even when nothing was new
    print(
        f"up to date at step {held[0]} ({held[1]}) -> {a.out}"
        if held
        else f"nothing to serve yet: no complete step of this run in {a.uri}",
        flush=True,
    )
    return 0


def export_parser(sub: Subparsers) -> None:
    """Add the ``deck export`` subcommand (its flags and handler) to ``sub``."""
    exp = sub.add_parser(
        "export",
        help="write the full state of a step as a DCP checkpoint, one safetensors file or "
        "Parquet files",
        description="Write the full state of a step (its chain applied: tables, fused "
        "optimizer states, dense parameters, dense optimizer) as a torch.distributed.checkpoint "
        "directory that dcp.load restores into a freshly built DMP model (keys: model.<state_dict "
        "key>, optim.state.<param>.<state>, as for {'model': model.state_dict(), 'optim': "
        "CombinedOptimizer([model.fused_optimizer, dense_opt]).state_dict()}), or as one "
        "safetensors file of unsharded tensors for inspection, or as Parquet files of rows "
        "for data pipelines (one per table: row id, weight, optimizer states; see "
        "docs/operations.md). Streams one table shard at a time (safetensors: one table; "
        "parquet: the shards holding the same rows).",
    )
    exp.add_argument("uri")
    exp.add_argument(
        "--step", type=step_number, help="step to export (default: the latest restorable)"
    )
    exp.add_argument(
        "--out",
        required=True,
        help="dcp, parquet: a new or empty directory; safetensors: a directory or a *.safetensors "
        "path",
    )
    exp.add_argument(
        "--format", choices=("dcp", "safetensors", "parquet"), default="dcp", help="(dcp)"
    )
    exp.set_defaults(fn=cmd_export)


def follow_parser(sub: Subparsers) -> None:
    """Add the ``deck follow`` subcommand (its flags and handler) to ``sub``."""
    fol = sub.add_parser(
        "follow",
        help="keep a materialised full state of the newest step up to date (a loading service)",
        description="Keep DIR/state.safetensors (the tensors of 'deck export --format "
        "safetensors') and DIR/state.json (step, checkpoint id) the full state of URI's newest "
        "restorable step. The first catch-up restores its chain; each newer delta is then "
        "applied by reading only its rows. Files are replaced atomically (temp file, fsync, "
        "rename). Restarting on the same DIR resumes from it.",
    )
    fol.add_argument("uri")
    fol.add_argument("--out", required=True, help="output directory (created if missing)")
    fol.add_argument("--once", action="store_true", help="catch up once and exit")
    fol.add_argument(
        "--poll", type=poll_seconds, default=10.0, help="seconds between checks for new steps (10)"
    )
    fol.add_argument(
        "--allow-quantized",
        action="store_true",
        help="accept a publisher's quantised weights (DeckConfig.publish.quantize): the output "
        "holds them dequantised, and state.json / the file metadata say which encodings",
    )
    fol.add_argument(
        "--format",
        choices=("safetensors", "parquet"),
        default="safetensors",
        help="parquet: also write DIR/parquet/<step>-full/ when the state is materialised and "
        "DIR/parquet/<step>-delta/ per applied step (only the rows it changed; one file per "
        "table, see docs/operations.md); the safetensors state is kept either way (safetensors)",
    )
    kafka = fol.add_argument_group(
        "kafka:// URIs (a Kafka publisher: PublishConfig(uri='kafka://host:port/topic'))"
    )
    kafka.add_argument(
        "--state-uri", help="where the publisher's state files are (default: named by markers)"
    )
    kafka.add_argument("--group", help="consumer group id (deck-follow-<topic>)")
    kafka.add_argument(
        "--full-uri",
        help="fsspec URI where loader fulls go: deck full checkpoints of the held state (deck "
        "verify checks them, deck.enable(model, [opt], DeckConfig(uri=URI)).restore() restores them) with the stream offsets "
        "they cover; an empty --out starts from the newest one",
    )
    kafka.add_argument(
        "--full-every",
        type=int,
        default=0,
        help="write a loader full every N applied steps, counted from the state on disk (0: never)",
    )
    kafka.add_argument(
        "--run",
        help="serve only this publishing run (the 'run' of its markers, in the state URI's "
        "_stream_run.json); default: the run of the state held in --out, else of the newest "
        "marker on the topic; other runs' markers are refused and logged (docs/operations.md)",
    )
    fol.set_defaults(fn=cmd_follow)
