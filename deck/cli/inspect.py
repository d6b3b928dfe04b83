"""Read-only subcommands: ``deck ls``, ``show``, ``verify``, ``lineage``, ``history``, ``report``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING, Any

# Command modules are imported inside each cmd_*: `deck ls` must not pay for (or need) torch.
from deck.cli.common import (
    Subparsers,
    age_text,
    at_least,
    check_out,
    human,
    json_list,
    open_existing,
    progress_bar,
    quiet_catalog,
    say_damaged,
    step_number,
)
from deck.errors import CheckpointNotFoundError, CorruptCheckpointError
from deck.format.jsonio import paused_gc

if TYPE_CHECKING:
    from deck.format.manifest import CheckpointManifest
    from deck.read.catalog import ManifestSet
    from deck.storage import Storage


def _ls_line(r: Any, now: float) -> str:
    if r.state == "damaged":
        unknown = f"{'?':>21} {'?':>5} {'?':>11} {'?':>5}"  # covers, ranks, bytes, age
        return f"{r.kind:>6} {r.step:>10} {r.layer:>5} {unknown}  {r.state:<11} {r.id or '?'} {r.folder}"
    covers = str(r.step) if r.first_step == r.step else f"{r.first_step}..{r.step}"
    ranks = r.ranks_text
    age = age_text(None if r.created_unix is None else now - r.created_unix)
    why = f"  ({r.problem})" if r.state == "pending" and r.problem else ""
    return (
        f"{r.kind:>6} {r.step:>10} {r.layer:>5} {covers:>21} {ranks:>5} {human(r.bytes):>11} "
        f"{age:>5}  {r.state:<11} {r.id} {r.folder}{why}"
    )


def _tree_line(r: Any, now: float) -> str:
    if r.state == "damaged":
        return f"step {r.step}  {r.folder}: {r.problem}"
    covers = str(r.step) if r.first_step == r.step else f"{r.first_step}..{r.step}"
    layer = f" L{r.layer}" if r.layer else ""
    age = age_text(None if r.created_unix is None else now - r.created_unix)
    return (
        f"{r.kind}{layer} {covers}  {r.ranks_text} ranks  {human(r.bytes)}  {age}  "
        f"{r.state}  {r.folder}"
    )


LS_RECENT_STEPS = 20  # the default view: every checkpoint of the newest steps, and the fulls


_positive = at_least(1)  # an argparse type


def _ls_view(rows: list[Any], a: argparse.Namespace) -> list[Any]:
    """The rows ``deck ls`` shows: ``--all`` (and ``--json`` unless narrowed) every one;
    ``--since STEP`` those of STEP and later; ``--last N`` those of the newest N steps; by
    default those of the newest :data:`LS_RECENT_STEPS` steps and every full (the points a
    restore starts from) among ``rows``. Pending and damaged folders are always shown."""
    if a.all or (a.json and a.since is None and a.last is None):
        return rows
    steps = sorted({r.step for r in rows})
    newest = steps[-min(len(steps), a.last or LS_RECENT_STEPS)]
    first = a.since if a.since is not None else newest
    fulls = a.since is None and a.last is None
    return [
        r
        for r in rows
        if r.step >= first or r.state in ("pending", "damaged") or (fulls and r.kind == "full")
    ]


def cmd_ls(a: argparse.Namespace) -> int:
    """Run ``deck ls`` with parsed arguments ``a``; returns its exit code (the table of :mod:`deck.cli`)."""
    # One pause for the records, the rows and their text (each pause's end costs a collection
    # of what was made in it: see paused_gc)
    with paused_gc():
        return _ls(a)


def _ls(a: argparse.Namespace) -> int:
    from deck.ops.listing import LOST_RECORD, list_recent_rows, list_rows, tree_lines

    storage = open_existing(a.uri, a.storage_options)
    default = not (a.all or a.json or a.since is not None or a.last is not None)
    with quiet_catalog():  # a damaged record is reported below, once
        # The default view from the newest part of the history (a long one is not read whole)
        recent = list_recent_rows(storage, LS_RECENT_STEPS) if default else None
        graph, rows = (recent.graph, recent.rows) if recent else list_rows(storage)
    hidden = recent.older if recent else 0
    if not rows:
        raise CheckpointNotFoundError(f"no checkpoints at {a.uri} (it exists, but holds none)")
    now = time.time()
    shown = _ls_view(rows, a)
    if a.json:
        print(json_list([r.to_dict(now) for r in shown]))
    elif a.tree:
        print("\n".join(tree_lines(graph, shown, lambda r: _tree_line(r, now))))
    else:
        print(
            f"{'kind':>6} {'step':>10} {'layer':>5} {'covers':>21} {'ranks':>5} {'bytes':>11} "
            f"{'age':>5}  {'state':<11} id / folder"
        )
        for r in shown:
            print(_ls_line(r, now))
    if len(shown) < len(rows) + hidden and not a.json:
        print(
            f"({len(rows) - len(shown) + hidden} more checkpoint(s) not shown: --all lists "
            "every one, --since STEP or --last N others)"
        )
    left = _left_by_a_rollback(rows)
    if left and not a.json:
        print(left)
    broken = sorted({r.step for r in rows if r.state == "broken"})
    if broken:
        sys.stdout.flush()
        print(
            f"deck ls: step(s) {broken} cannot be restored: a "
            f"checkpoint their chain needs is gone, quarantined or without its commit record "
            f"(`deck verify {a.uri} --all` names it)",
            file=sys.stderr,
        )
    lost = [r for r in rows if r.state == "pending" and (r.problem or "").startswith(LOST_RECORD)]
    if lost and not broken:  # (with broken steps, said above)
        sys.stdout.flush()
        print(f"deck ls: {'; '.join(f'step {r.step}: {r.problem}' for r in lost)}", file=sys.stderr)
    damaged = [r for r in rows if r.state == "damaged"]
    if damaged:
        sys.stdout.flush()  # the table first, then the finding about it
        print(
            f"deck ls: {len(damaged)} damaged commit record(s), listed as damaged, not as "
            "checkpoints: "
            + "; ".join(str(r.problem) for r in damaged)
            + ". Repair each, or delete it to give its checkpoint up; "
            f"`deck verify {a.uri} --all` checks the rest",
            file=sys.stderr,
        )
        return 1
    return 1 if broken or lost else 0


def _left_by_a_rollback(rows: list[Any]) -> str | None:
    """A note on the committed trainer checkpoints of older timelines at or after the step
    where the newest timeline starts (a break-it finding: listed as committed beside a newer
    timeline's, with nothing to say that `restore()` and `deck lineage` take the newest
    timeline's latest step): what a rollback left, restorable by step, off the newest line."""
    from deck.format.manifest import steps_text
    from deck.read.lineage import left_by_a_rollback

    trainer = [(r.step, r.epoch) for r in rows if not r.merged and r.state == "committed"]
    left, newest, start = left_by_a_rollback(trainer)
    if not left:
        return None
    old = sorted(left)
    return (
        f"(step(s) {steps_text(old)} are of an older timeline that a rollback left: each "
        f"restores as itself, but the newest timeline (epoch {newest}) starts at step {start}, "
        "restore() and `deck lineage` take its latest step, and its checkpoints replace "
        "those as it reaches their steps)"
    )


def cmd_show(a: argparse.Namespace) -> int:
    """Run ``deck show`` with parsed arguments ``a``; returns its exit code (the table of :mod:`deck.cli`)."""
    from deck.ops.listing import describe_checkpoint, find_checkpoint

    storage = open_existing(a.uri, a.storage_options)
    with quiet_catalog():  # a damaged record of the step asked for is this command's error
        d = describe_checkpoint(storage, find_checkpoint(storage, a.checkpoint))
    if a.no_chunks:
        for r in d["ranks"]:
            for s in r["shards"]:
                del s["chunks"]
    if a.json:
        print(json.dumps(d, indent=1))
        return 0
    print(_show_headline(d))
    print("tables:")
    for name, t in d["tables"].items():
        print(
            f"  {name}: {t['shape'][0]} x {t['shape'][1]}, {t['shards']} shard(s), "
            f"{t['saved_rows']} rows saved, {human(t['bytes'])}"
        )
    for r in d["ranks"]:
        _show_rank(r)
    return 0


def _show_headline(d: dict[str, Any]) -> str:
    """``deck show``'s first line: what the checkpoint is, where it sits, when it was made."""
    lineage_txt = "" if d["parent"] is None else f", parent step {d['parent']} ({d['parent_id']})"
    if d["merged"]:
        lineage_txt += f", layer {d['layer']}, covers {d['covers'][0]}..{d['covers'][1]}"
        lineage_txt += f", {len(d['inputs'])} inputs"
    return (
        f"{d['kind']} checkpoint of step {d['step']}: id {d['id']}, folder {d['folder']}{lineage_txt}, "
        f"base {d['base']}, epoch {d['epoch']}, {d['world_size']} rank(s), {human(d['bytes'])}, "
        f"committed {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(d['created_unix']))} "
        f"({age_text(time.time() - d['created_unix'])} ago) by deck {d['deck_version']}"
    )


def _show_rank(r: dict[str, Any]) -> None:
    """Print one rank of ``deck show``: its manifest, shards (and their chunk files) and files."""
    m = r["manifest"]
    print(
        f"rank {r['rank']}: {m['path']} ({m['bytes']} B, xxh3 {m['checksum']}), data {human(r['data_bytes'])}"
    )
    for s in r["shards"]:
        print(
            f"  {s['table']} rows {s['row_offset']}..{s['row_offset'] + s['rows']} cols "
            f"{s['col_offset']}..{s['col_offset'] + s['cols']}: {s['saved_rows']} rows"
            f"{' (full)' if s['full'] else ''}, states {','.join(s['states'])}, "
            f"{s['num_chunks']} chunk(s), {human(s['bytes'])}"
        )
        for c in s.get("chunks", ()):
            print(f"    {c['path']}  {c['rows']} rows  {c['bytes']} B  xxh3 {c['checksum']}")
    for what in ("dense", "extra"):
        f = r[what]
        if f is not None:
            print(f"  {what}: {f['path']}  {f['nbytes']} B  xxh3 {f['checksum']}")


def cmd_report(a: argparse.Namespace) -> int:
    """Run ``deck report`` with parsed arguments ``a``; returns its exit code (the table of :mod:`deck.cli`)."""
    from deck.ops.report import write_report
    from deck.read.catalog import list_checkpoints

    check_out(a.out, a.uri)
    storage = open_existing(a.uri, a.storage_options)
    if not list_checkpoints(storage):  # nothing to draw: no empty page
        raise CheckpointNotFoundError(f"no checkpoints at {a.uri}: no report written")
    rep = write_report(storage, a.out)
    print(f"wrote {rep.html} ({len(rep.images)} images: {', '.join(rep.images)})")
    return int(say_damaged("report", a.uri, rep.damaged, "the report lists them as damaged"))


def _verify_targets(
    a: argparse.Namespace, manifests: ManifestSet, damaged: dict[int, str]
) -> list[CheckpointManifest]:
    """What ``deck verify`` checks: every committed checkpoint (``--all``), ``--step``, or the
    latest restorable step; none when the step asked for has a damaged commit record, or when
    no committed step is restorable (those are the findings). Raises
    :class:`CheckpointNotFoundError` when there is nothing to check."""
    from deck.format.manifest import steps_text
    from deck.read.lineage import latest_restorable

    if not manifests and not damaged:
        raise CheckpointNotFoundError(f"no committed checkpoints at {a.uri}")
    if a.all:
        return [manifests[s] for s in sorted(manifests)] + sorted(
            manifests.merged.values(), key=lambda m: (m.step, m.layer, m.id)
        )
    if a.step in damaged:
        return []
    step = a.step if a.step is not None else latest_restorable(manifests)
    if step is None and a.step is None and manifests:
        return []  # committed steps, none restorable: the chain check says why (damage)
    if step is None or step not in manifests:
        which = (
            "no restorable step" if a.step is None else f"no committed checkpoint at step {a.step}"
        )
        raise CheckpointNotFoundError(
            f"{which} in {a.uri}; committed steps: {steps_text(manifests, a.step)}"
        )
    return [manifests[step]]


def _stop_if_unreachable(
    storage: Storage, m: CheckpointManifest, label: str, done: int, total: int
) -> None:
    """After a checkpoint with files that could not be read: whether the store answers at all
    (its commit record, read before). A store that is down ends the run here, exit 2, instead
    of costing every other checkpoint its retries (a break-it finding: ~11 s per checkpoint
    during an outage, 12 days for 100,000)."""
    from deck.errors import StorageError
    from deck.format.manifest import MANIFEST

    try:
        storage.exists(f"{m.folder}/{MANIFEST}")
    except StorageError as e:
        raise StorageError(
            f"{storage.uri} stopped answering at {label} ({e}): {done} of {total} "
            "checkpoints checked, nothing quarantined for it; verify again once the store "
            "answers"
        ) from None


def cmd_verify(a: argparse.Namespace) -> int:
    """``deck verify``: re-read every file of the chosen checkpoints and check its size and
    checksum; exit 1 when any has a problem, a damaged commit record or a file that could not
    be read. ``--quarantine`` also records each damaged checkpoint, so restores and the merger
    avoid it: only damage that reads back a second time, never a read error."""
    from deck.read.catalog import manifest_keys, quarantine, read_manifests
    from deck.read.lineage import build_graph, latest_checked
    from deck.read.verify import (
        confirmed_damage,
        full_tables,
        uncommitted_meanwhile,
        verify_checkpoint,
    )

    storage = open_existing(a.uri, a.storage_options)
    # Every record read (not through the catalog): verify is where damage to them is found.
    manifests = read_manifests(storage, manifest_keys(storage))
    # Unreadable commit records are problems of the steps they name (the rest is still checked).
    damaged = {s: why for s, why in manifests.damaged.items() if a.all or a.step in (None, s)}
    for s, why in sorted(damaged.items()):
        print(f"step {s}: commit record damaged\n  BAD {why}")
    targets = _verify_targets(a, manifests, damaged)
    bad = len(damaged)
    graph = build_graph(manifests)
    fulls: dict[str, dict[str, tuple[int, int]] | None] = {}  # full id -> its tables
    t0 = time.perf_counter()
    for done, m in enumerate(targets, 1):
        label = f"step {m.step}" if not m.is_merged else f"{m.kind.value} {m.folder}"
        bar = progress_bar(f"verify {label}")
        # What a restore checks besides the files: the tables of the full its chains start from
        full = graph.full_below(m.id)
        if full is not None and full.id != m.id and full.id not in fulls:
            fulls[full.id] = full_tables(storage, full)
        tables = None if full is None or full.id == m.id else fulls[full.id]
        report = verify_checkpoint(storage, m, progress=bar.update if bar else None, tables=tables)
        if bar:
            bar.close()
        if report.problems and uncommitted_meanwhile(storage, m):
            # (a break-it finding: a GC beside verify deleted it, and verify called its missing
            # files damage, and quarantined it)
            print(f"{label}: deleted or replaced while it was verified (GC, a rollback): skipped")
            continue
        status = "ok" if report.ok else f"{len(report.problems)} problem(s)"
        if report.unreadable:
            status += f", {len(report.unreadable)} file(s) unreadable"
        print(f"{label}: {report.files} files, {human(report.bytes)}: {status}")
        for p in report.problems:
            print(f"  BAD {p}")
        for p in report.unreadable:
            print(f"  UNREADABLE {p}")
        if report.unreadable:
            print("  a read error is not damage: this checkpoint is kept; verify it again")
            _stop_if_unreachable(storage, m, label, done, len(targets))
        if report.problems and a.quarantine:
            proven = confirmed_damage(storage, m, report, tables)
            if proven.problems:
                quarantine(storage, m, proven.problems[0])
                print("  quarantined: restores and the merger will not use it")
            else:
                print("  not quarantined: the damage did not read back a second time")
        bad += not report.ok
    # Files intact is not restorable: a step whose chain lacks a checkpoint (deleted under a
    # trainer that went on building on it) restores nothing.
    # Checked: every step (--all), the one asked for, or by default the newest restorable
    # one and every newer step (which a restore of "the latest" passes by).
    checked = {m.step for m in targets if not m.is_merged}
    broken = {
        s: why
        for s, why in graph.unrestorable().items()
        if s not in damaged
        and (a.all or s in checked or (a.step is None and s > max(checked, default=-1)))
    }
    for s, why in broken.items():
        print(f"step {s}: not restorable\n  BAD {why}")
    bad += len(broken)
    if a.all or a.step is None:
        # A latest step a plain restore refuses though every record checks out: a rollback's
        # epoch witnessed with no record (a break-it finding: verify passed while restore
        # refused, after a record from before the rollback was put back)
        latest = graph.latest(log=False)
        check = latest_checked(storage, manifests, latest)
        if check.gives_up is not None and not check.lost:  # (a lost record: said above)
            print(f"latest step {latest}: a plain restore refuses it\n  BAD {check.gives_up}")
            bad += 1
    print(
        f"verified {len(targets) + len(damaged)} checkpoint(s) in {time.perf_counter() - t0:.1f} s; "
        f"{bad} with problems"
    )
    return 1 if bad else 0


def cmd_history(a: argparse.Namespace) -> int:
    """Run ``deck history`` with parsed arguments ``a``; returns its exit code (the table of :mod:`deck.cli`)."""
    from deck.ops.history import row_history
    from deck.read.lineage import left_by_a_rollback

    h = row_history(open_existing(a.uri, a.storage_options), a.table, a.row)
    missing = "they and the steps that build on them are not listed"
    if a.json:
        print(json.dumps(h.to_dict(), indent=1))
        return int(say_damaged("history", a.uri, h.damaged, missing))
    print(
        f"table {h.table} row {h.row}: {len(h.steps)} steps; read {h.chunks_read} of "
        f"{h.chunks_present} chunks (skipped {h.skipped_range} by id range, {h.skipped_bloom} "
        f"by bloom filter; {h.false_positives} false positives)"
    )
    left = left_by_a_rollback([(s.step, s.epoch) for s in h.steps])[0]
    for s in h.steps:
        vals = "  ".join(
            f"{k}=[{', '.join(f'{x:.6g}' for x in v[:8])}{', ...' if len(v) > 8 else ''}]"
            for k, v in s.values.items()
        )
        # (a break-it finding: steps of two timelines listed as one history)
        old = f"  (epoch {s.epoch}: an older timeline a rollback left)" if s.step in left else ""
        print(f"step {s.step:>8}  {vals}  from {', '.join(s.sources)}{old}")
    return int(say_damaged("history", a.uri, h.damaged, missing))


def cmd_lineage(a: argparse.Namespace) -> int:
    """Run ``deck lineage`` with parsed arguments ``a``; returns its exit code (the table of :mod:`deck.cli`)."""
    from deck.read.lineage import chain_bytes, cheapest_chain, lineage_graph

    graph = lineage_graph(open_existing(a.uri, a.storage_options))
    if not graph.nodes:
        raise CheckpointNotFoundError(f"no committed checkpoints at {a.uri}")
    step = a.step if a.step is not None else graph.latest()
    # Damage on what it shows: an unreadable record newer than the latest step shown (the
    # latest may be that one or later), or at or below the step asked for (its chain may need it)
    if a.step is None:
        what = "the latest step may be newer than the one shown"
        damaged = {s: why for s, why in graph.damaged.items() if step is None or s > step}
    else:
        what = f"step {step}'s chain may need them"
        damaged = {s: why for s, why in graph.damaged.items() if s <= a.step}
    # The chain is looked up before anything is printed: an unknown step is an error alone,
    # not a table followed by one.
    if step in graph.damaged:  # damage, not absence (exit 1, naming the file)
        raise CorruptCheckpointError(f"step {step}: {graph.damaged[step]}")
    chain = None if step is None else cheapest_chain(graph, step)
    if a.json:
        print(json.dumps(graph.to_dict(), indent=1))
        return int(say_damaged("lineage", a.uri, damaged, what))
    print(f"{'kind':>6} {'layer':>5} {'covers':>21} {'epoch':>5} {'bytes':>11}  id / folder")
    for n in sorted(graph.nodes.values(), key=lambda n: (n.step, n.first_step, n.layer, n.id)):
        covers = f"{n.covers[0]}..{n.covers[1]}" if n.covers[0] != n.covers[1] else str(n.step)
        flag = f"  QUARANTINED: {n.quarantined}" if n.quarantined else ""
        print(
            f"{n.kind.value:>6} {n.layer:>5} {covers:>21} {n.epoch:>5} {human(n.bytes):>11}  "
            f"{n.id} {n.folder}{flag}"
        )
    if step is None or chain is None:
        raise CheckpointNotFoundError(f"no restorable step at {a.uri} (see the table above)")
    total = chain_bytes(chain)
    print(f"cheapest chain of step {step} ({len(chain)} checkpoints, {human(total)}):")
    prev = None
    for m in chain:
        # The trainer's checkpoint of a step a merged full covers holds the same rows: a
        # restore reads only its dense and extra state (uncounted in the total above).
        same = prev is not None and m.state == prev.state
        note = "  (same rows as above: its dense and extra state only)" if same else ""
        print(f"  {m.kind.value:>6} {m.covers[0]}..{m.covers[1]}  {m.folder}{note}")
        prev = m
    return int(say_damaged("lineage", a.uri, damaged, what))


def ls_parser(sub: Subparsers) -> None:
    """Add the ``deck ls`` subcommand (its flags and handler) to ``sub``."""
    ls = sub.add_parser(
        "ls",
        help="the lineage as a table: committed and pending checkpoints",
        description="Every checkpoint at URI: trainer fulls and deltas, the merger's merged deltas "
        "and fulls, and pending trainer steps (rank parts written, manifest.json not yet). "
        "Columns: kind, step, layer, covered steps, rank parts present / world size, bytes, age, "
        "state (committed | pending | quarantined | damaged | abandoned: a timeline a rollback left "
        "| broken: the newest timeline lacks a checkpoint), id and folder (`deck show` gives a checkpoint's "
        "parent and base, `--tree` draws the parent links). Exit 2 when the URI does not exist "
        "or holds no checkpoint; exit 1 (the rest listed, state damaged) when a commit record "
        "(manifest.json) cannot be read. By default the checkpoints of the newest "
        f"{LS_RECENT_STEPS} steps and every full; of a long history (a catalog of several "
        "segments) the fulls of its newest segments only, read without reading every record "
        "(--all and --json: every checkpoint).",
    )
    ls.add_argument("uri")
    ls.add_argument("--json", action="store_true", help="machine-readable output (a list)")
    ls.add_argument("--tree", action="store_true", help="as a tree of parent links")
    view = ls.add_mutually_exclusive_group()
    view.add_argument("--all", action="store_true", help="every checkpoint")
    view.add_argument(
        "--since",
        type=step_number,
        metavar="STEP",
        help="the checkpoints of STEP and later steps",
    )
    view.add_argument(
        "--last", type=_positive, metavar="N", help="the checkpoints of the newest N steps"
    )
    ls.set_defaults(fn=cmd_ls)


def show_parser(sub: Subparsers) -> None:
    """Add the ``deck show`` subcommand (its flags and handler) to ``sub``."""
    show = sub.add_parser(
        "show",
        help="one checkpoint: ranks, tables, shards, rows, bytes, chunk files and checksums",
        description="Describe one committed checkpoint from its manifests (the data is not read; "
        "`deck verify` checks it).",
    )
    show.add_argument("uri")
    show.add_argument(
        "checkpoint", metavar="STEP", help="trainer step, or a checkpoint id / merger folder"
    )
    show.add_argument("--json", action="store_true", help="machine-readable output")
    show.add_argument("--no-chunks", action="store_true", help="leave out the chunk files")
    show.set_defaults(fn=cmd_show)


def verify_parser(sub: Subparsers) -> None:
    """Add the ``deck verify`` subcommand (its flags and handler) to ``sub``."""
    ver = sub.add_parser("verify", help="re-read files and check checksums")
    ver.add_argument("uri")
    g = ver.add_mutually_exclusive_group()
    g.add_argument("--step", type=step_number, help="one step (default: the latest restorable)")
    g.add_argument("--all", action="store_true", help="every committed checkpoint")
    ver.add_argument(
        "--quarantine",
        action="store_true",
        help="record damaged checkpoints so restores and the merger avoid them",
    )
    ver.set_defaults(fn=cmd_verify)


def lineage_parser(sub: Subparsers) -> None:
    """Add the ``deck lineage`` subcommand (its flags and handler) to ``sub``."""
    lin = sub.add_parser("lineage", help="the lineage graph and the cheapest chain of a step")
    lin.add_argument("uri")
    lin.add_argument("--json", action="store_true", help="machine-readable graph")
    lin.add_argument("--step", type=step_number, help="chain of this step (default: the latest)")
    lin.set_defaults(fn=cmd_lineage)


def history_parser(sub: Subparsers) -> None:
    """Add the ``deck history`` subcommand (its flags and handler) to ``sub``."""
    his = sub.add_parser("history", help="one row's value at every restorable step")
    his.add_argument("uri")
    his.add_argument(
        "--table",
        required=True,
        help="the table's name in your EmbeddingBagConfig / EmbeddingConfig (e.g. t0), or its "
        "full key as `deck show` lists it",
    )
    his.add_argument("--row", required=True, type=int, help="global row id")
    his.add_argument("--json", action="store_true", help="machine-readable, full precision")
    his.set_defaults(fn=cmd_history)


def report_parser(sub: Subparsers) -> None:
    """Add the ``deck report`` subcommand (its flags and handler) to ``sub``."""
    rep = sub.add_parser(
        "report",
        help="an HTML page: the lineage graph, bytes per checkpoint, restore cost per step",
        description="Write an HTML page with a picture of the lineage graph and plots of bytes "
        "per checkpoint and restore cost (bytes the cheapest chain reads) per step; the PNG "
        "images go next to it (<out stem>-*.png). Needs matplotlib (pip install matplotlib).",
    )
    rep.add_argument("uri")
    rep.add_argument("--out", required=True, help="path of the HTML file to write")
    rep.set_defaults(fn=cmd_report)
