"""The ``deck`` command line.

    deck ls URI [--json]                 committed checkpoints and their lineage
    deck verify URI [--step N | --all]   re-read every file, check every checksum

Exit codes: 0 ok, 1 a check failed (corruption found, nothing to list), 2 usage or access error.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict

from deck.catalog import latest_restorable, list_checkpoints, read_manifests
from deck.errors import DeckError
from deck.storage import open_storage
from deck.verify import verify_checkpoint


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


def cmd_ls(a: argparse.Namespace) -> int:
    infos = list_checkpoints(a.uri)
    if a.json:
        print(json.dumps([asdict(i) for i in infos], indent=1))
        return 0
    if not infos:
        print(f"no committed checkpoints at {a.uri}")
        return 0
    print(
        f"{'step':>10} {'kind':>6} {'parent':>8} {'base':>8} {'epoch':>5} {'ranks':>5} {'bytes':>11}  id"
    )
    for i in infos:
        parent = "-" if i.parent is None else str(i.parent)
        print(
            f"{i.step:>10} {i.kind:>6} {parent:>8} {i.base:>8} {i.epoch:>5} {i.ranks:>5} {_human(i.bytes):>11}  {i.id}"
        )
    return 0


def cmd_verify(a: argparse.Namespace) -> int:
    storage = open_storage(a.uri)
    manifests = read_manifests(storage)
    if not manifests:
        print(f"no committed checkpoints at {a.uri}", file=sys.stderr)
        return 1
    if a.all:
        steps = sorted(manifests)
    else:
        step = a.step if a.step is not None else latest_restorable(manifests)
        if step is None or step not in manifests:
            print(
                f"no committed checkpoint at step {a.step} in {a.uri}; have {sorted(manifests)}",
                file=sys.stderr,
            )
            return 1
        steps = [step]
    bad = 0
    t0 = time.perf_counter()
    for step in steps:
        total = 0
        bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            bar = tqdm(desc=f"verify step {step}", unit="B", unit_scale=True, leave=False)
        report = verify_checkpoint(storage, manifests[step], progress=bar.update if bar else None)
        if bar:
            bar.close()
        total += report.bytes
        status = "ok" if not report.problems else f"{len(report.problems)} problem(s)"
        print(f"step {step}: {report.files} files, {_human(report.bytes)}: {status}")
        for p in report.problems:
            print(f"  BAD {p}")
        bad += bool(report.problems)
    print(
        f"verified {len(steps)} checkpoint(s) in {time.perf_counter() - t0:.1f} s; {bad} with problems"
    )
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="deck", description="Inspect and check deck checkpoints.")
    sub = p.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("ls", help="list committed checkpoints")
    ls.add_argument("uri")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.set_defaults(fn=cmd_ls)
    ver = sub.add_parser("verify", help="re-read files and check checksums")
    ver.add_argument("uri")
    g = ver.add_mutually_exclusive_group()
    g.add_argument("--step", type=int, help="one step (default: the latest restorable)")
    g.add_argument("--all", action="store_true", help="every committed checkpoint")
    ver.set_defaults(fn=cmd_verify)
    a = p.parse_args(argv)
    try:
        return int(a.fn(a))
    except DeckError as e:
        print(f"deck {a.cmd}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
