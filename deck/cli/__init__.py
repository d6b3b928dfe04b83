"""The ``deck`` command line: ``deck [--storage-options JSON] CMD ...`` (every command has ``--help``;
``deck --version`` prints the version).

    deck ls URI [--json] [--tree]        every checkpoint: kind, step, layer, covered steps,
                                         ranks, bytes, age, committed / pending / quarantined /
                                         damaged (a manifest.json that cannot be read: exit 1)
    deck show URI STEP [--json] [--no-chunks]
                                         one checkpoint: ranks, tables, shards, rows, bytes,
                                         chunk files and their checksums, parent and base
    deck verify URI [--step N | --all] [--quarantine]
                                         re-read every file, check every checksum
    deck lineage URI [--json] [--step N] the lineage graph and the cheapest chain of a step
    deck export URI [--step N] --out DIR [--format dcp|safetensors|parquet]
                                         the full state of a step as a torch.distributed.checkpoint
                                         directory (dcp.load into a fresh DMP), one safetensors
                                         file of unsharded tables, or Parquet rows (one file per
                                         table)
    deck follow URI --out DIR [--once] [--poll S] [--allow-quantized] [--format safetensors|parquet]
                                         keep DIR/state.safetensors the full state of URI's newest
                                         step, applying only each new delta's rows (parquet: also
                                         the changed rows per step); URI may be kafka://HOST:PORT/TOPIC
    deck report URI --out report.html    lineage graph, bytes per checkpoint, restore cost per step
    deck merge URI [--once | --follow]   merger worker(s): hierarchical merging and new fulls
    deck gc URI [--dry-run]              retention: delete what no retained step needs
    deck history URI --table T --row R [--json]
                                         one row's value at every restorable step, reading only
                                         the chunks whose row index may hold it (T: the table
                                         name of your EmbeddingBagConfig, or its full key)
    deck doctor ENTRY [--ranks N] [--steps K] [--every E] [--more M] [--uri DIR] [--json]
                                         train YOUR setup (ENTRY returns a deck.DoctorSetup) on
                                         gloo ranks, checkpoint, restore into a fresh build and
                                         report bitwise what differs (exit 1 on any difference)

Exit codes (for scripts), the same for every command:

    0  ok
    1  a finding that needs a look: damage (verify; ls, show, gc and report on any damaged
       commit record; export, lineage, follow, history and merge when the damage is on what
       they read -- elsewhere they warn and go on), differences (doctor), work left undone (merge work waiting or failed, gc errors or
       things gc kept because of damage or read errors)
    2  a usage error (bad arguments, an export target that is not empty: for safetensors, a
       file of that name that exists), nothing there (a URI that does not exist, no checkpoints, an unknown step, table or row, a step no valid
       chain reaches: e.g. through a quarantined checkpoint, which the message names) or an
       error that stopped the command (storage unreachable, an --out that cannot be written, ...)
  130  interrupted (Ctrl-C): one line, no traceback; what it left is as after a kill (run it
       again). `deck merge --follow`, whose way to stop is SIGINT or SIGTERM, finishes its
       pass and exits 0 (stopped while it is still starting, before its workers run, it exits
       130 like any interrupted command)

Results go to stdout (``--json`` where offered), errors to stderr as one line
``deck <command>: <what happened and what to do>``; progress bars only when stderr is a
terminal. A reader that closes the pipe early (``deck ls --json | head -1``) ends any command
quietly, nothing on stderr: exit 141, as a process killed by SIGPIPE, or 0 when everything was
written before the reader left (``deck follow`` without ``--once`` ends too).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from deck.cli.common import json_options
from deck.cli.doctor import doctor_parser
from deck.cli.inspect import (
    history_parser,
    lineage_parser,
    ls_parser,
    report_parser,
    show_parser,
    verify_parser,
)
from deck.cli.maintain import gc_parser, merge_parser
from deck.cli.transfer import export_parser, follow_parser

# Each subcommand's handler imports its modules when it runs: `deck ls` must not pay for (or
# need) torch.
from deck.errors import CorruptCheckpointError, DeckError
from deck.version import __version__

EXIT_OK = 0
EXIT_FINDING = 1  # damage, differences, work left undone
EXIT_USAGE = 2  # usage error, nothing there, an error that stopped the command

# One entry per subcommand, in the order --help lists them.
_SUBCOMMANDS = (
    ls_parser,
    show_parser,
    verify_parser,
    lineage_parser,
    history_parser,
    merge_parser,
    gc_parser,
    export_parser,
    follow_parser,
    report_parser,
    doctor_parser,
)


def build_parser() -> argparse.ArgumentParser:
    """The ``deck`` argument parser: the global ``--storage-options`` and every subcommand, each
    with its handler as ``fn``. Building it imports no torch."""
    p = argparse.ArgumentParser(
        prog="deck", description="Inspect, check, merge and collect deck checkpoints."
    )
    p.add_argument("--version", action="version", version=f"deck {__version__}")
    p.add_argument(
        "--storage-options",
        type=json_options,
        default=os.environ.get("DECK_STORAGE_OPTIONS"),
        metavar="JSON",
        help="fsspec storage options for the URI, e.g. "
        '\'{"client_kwargs": {"endpoint_url": "http://minio:9000"}}\' for an S3-compatible store '
        "(default: $DECK_STORAGE_OPTIONS; s3fs also reads the usual AWS_* variables)",
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    for add in _SUBCOMMANDS:
        add(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one ``deck`` command on ``argv`` (default: ``sys.argv[1:]``) and return its exit code
    (the module docstring's table): 0 ok, 1 a finding (damage: a
    :class:`CorruptCheckpointError` included; differences; work left undone), 2 a usage error,
    nothing there, or another :class:`DeckError` (printed to stderr as one
    ``deck <command>: ...`` line). A closed stdout pipe ends it quietly. Only the command's own
    modules are imported: ``deck ls`` never imports torch."""
    try:
        try:
            a = build_parser().parse_args(argv)
        except SystemExit:
            sys.stdout.flush()  # --help / --version: into the pipe now, not at exit
            raise
        except KeyboardInterrupt:  # (while the parser imports: a traceback, a break-it finding)
            print("deck: interrupted", file=sys.stderr)
            return 130
        if a.cmd in ("merge", "gc", "follow"):
            logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
            # Which worker a merger is, and where that came from (flags or launcher variables).
            logging.getLogger("deck.merge.launch").setLevel(logging.INFO)
        try:
            code = int(a.fn(a))
        except DeckError as e:
            code = EXIT_FINDING if isinstance(e, CorruptCheckpointError) else EXIT_USAGE
            sys.stdout.flush()  # what the command printed before it goes first
            print(f"deck {a.cmd}: {e}{_next_step(a, e)}", file=sys.stderr)
        except BrokenPipeError:
            raise
        except OSError as e:  # this host's own files (an --out that cannot be written, ...)
            code = EXIT_USAGE
            sys.stdout.flush()
            print(
                f"deck {a.cmd}: {e} (a file of this host: check the path, that its folder "
                "exists and that it can be written)",
                file=sys.stderr,
            )
        except KeyboardInterrupt as e:
            # (What a command leaves when interrupted is as after a kill: safe to run again;
            # a command may say how far it got, as the interrupt's message)
            sys.stdout.flush()
            print(f"deck {a.cmd}: {e.args[0] if e.args else 'interrupted'}", file=sys.stderr)
            return 130
        # What is still buffered is written here, where a closed pipe is caught, not by the
        # interpreter at exit (which would print "Exception ignored ... BrokenPipeError" and
        # exit 120).
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        return _closed_pipe()


# The commands whose URI is a checkpoint store `deck verify` can check (follow's may be a
# publish URI or a topic; verify's own damage is its answer).
_VERIFIABLE = frozenset({"ls", "show", "lineage", "history", "report", "export", "merge", "gc"})


def _next_step(a: argparse.Namespace, e: DeckError) -> str:
    """What to do about damage a command met, appended to its one line: the error names the
    file; this says how to see the rest of the damage and read around it."""
    if not isinstance(e, CorruptCheckpointError) or a.cmd not in _VERIFIABLE:
        return ""
    if "deck verify" in str(e):
        return ""
    return (
        f"; next: `deck verify {a.uri} --all --quarantine` names every damaged file and sets"
        " its checkpoint aside, so restores, exports and mergers go around it (an older"
        " `--step` where nothing else reaches it; docs/operations.md, Disaster recovery)"
    )


def _closed_pipe() -> int:
    """The reader of stdout went away (``deck ls | head -1``): point stdout at /dev/null so the
    interpreter's final flush does not fail again, and exit as a process killed by SIGPIPE
    would (128 + 13), without a traceback."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 141
