"""``deck doctor``: train the user's own setup on gloo ranks, checkpoint, restore into a fresh
build and report bitwise what differs (deck.doctor does the work; imported when it runs)."""

from __future__ import annotations

import argparse
import json
import logging

from deck.cli.common import Subparsers


def cmd_doctor(a: argparse.Namespace) -> int:
    """Run ``deck doctor`` with parsed arguments ``a``; returns 0 when nothing differs, 1 on any
    difference (a :class:`DoctorError`, a usage error, reaches ``main``: exit 2)."""
    from deck.stack import require_torchrec

    require_torchrec("deck doctor")  # before the doctor's modules, which import TorchRec
    from deck.doctor import run_doctor
    from deck.doctor.run import check_numbers

    # Checked here first so that a usage error names the flags, not the library's parameters.
    check_numbers(a.ranks, a.steps, a.every, a.more, ("--ranks", "--steps", "--every", "--more"))
    # torch's "Terminating process ... via SIGTERM" when a rank fails: the report says why.
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    report = run_doctor(
        a.entry,
        ranks=a.ranks,
        steps=a.steps,
        every=a.every,
        more=a.more,
        uri=a.uri,
        storage_options=a.storage_options,
    )
    print(json.dumps(report.to_json(), indent=2) if a.json else report.text())
    return 0 if report.passed else 1


def doctor_parser(sub: Subparsers) -> None:
    """Add the ``deck doctor`` subcommand (its flags and handler) to ``sub``."""
    p = sub.add_parser(
        "doctor",
        help="check that deck restores YOUR model exactly (train, checkpoint, restore, compare)",
        description="Run your training setup on N gloo CPU ranks: train K steps with deck (a "
        "checkpoint every E), capture the live state at step K with torch's and TorchRec's own "
        "APIs, train M steps on; then build a fresh setup, restore step K with deck, compare "
        "bitwise (tensors, buffers, optimizer states and hyperparameters, RNG, user state, per "
        "rank) and train the same M steps, comparing the losses. Ends with one verdict line. "
        "Exit 0: nothing differs; 1: a difference; 2: usage or import error.",
    )
    p.add_argument(
        "entry",
        metavar="ENTRY",
        help="package.module:function or path/to/file.py:function returning a "
        "deck.DoctorSetup; called on every rank once the gloo process group is up",
    )
    p.add_argument("--ranks", type=int, default=2, metavar="N", help="gloo ranks (default 2)")
    p.add_argument(
        "--steps", type=int, default=6, metavar="K", help="steps before the restore (default 6)"
    )
    p.add_argument(
        "--every", type=int, default=2, metavar="E", help="checkpoint every E steps (default 2)"
    )
    p.add_argument(
        "--more", type=int, default=4, metavar="M", help="steps after the restore (default 4)"
    )
    p.add_argument(
        "--uri",
        metavar="DIR",
        help="an empty checkpoint URI, kept afterwards (default: a temporary folder)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(fn=cmd_doctor)
