"""The ``deck`` command line: ``deck [--storage-options JSON] CMD ...`` (every command has ``--help``).

    deck ls URI [--json] [--tree]        the lineage as a table: kind, step, layer, covered steps,
                                         ranks, bytes, age, committed / pending / quarantined
    deck show URI STEP [--json]          one checkpoint: ranks, tables, shards, rows, bytes,
                                         chunk files and their checksums
    deck verify URI [--step N | --all]   re-read every file, check every checksum
    deck lineage URI [--json] [--step N] the lineage graph and the cheapest chain of a step
    deck export URI [--step N] --out DIR --format dcp|safetensors
                                         the full state of a step as a torch.distributed.checkpoint
                                         directory (dcp.load into a fresh DMP) or one safetensors
                                         file of unsharded tables
    deck follow URI --out DIR [--once] [--poll S] [--allow-quantized]
                                         keep DIR/state.safetensors the full state of URI's newest
                                         step, applying only each new delta's rows
    deck report URI --out report.html    lineage graph, bytes per checkpoint, restore cost per step
    deck merge URI [--once | --follow]   merger worker(s): hierarchical merging and new fulls
    deck gc URI [--dry-run]              retention: delete what no retained step needs
    deck history URI --table T --row R [--json]
                                         one row's value at every restorable step, reading only
                                         the chunks whose row index may hold it

Exit codes (for scripts): 0 ok; 1 a check failed or there was nothing to act on (corruption
found, no checkpoints at the URI, merge work left waiting or failed, GC errors); 2 usage or
access error (bad arguments, unknown step, unreadable URI, damaged manifest, export target not
empty). Results go to stdout (``--json`` where offered), errors to stderr as one line
``deck <command>: <what happened and what to do>``; progress bars only when stderr is a
terminal.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import multiprocessing
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

# Command modules are imported inside each cmd_*: `deck ls` must not pay for (or need) torch.
from deck.errors import ConfigError, DeckError
from deck.storage import open_storage

if TYPE_CHECKING:
    from deck.format.manifest import CheckpointManifest
    from deck.read.catalog import ManifestSet


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= n:
            return f"{seconds / n:.0f}{unit}"
    return f"{max(0.0, seconds):.0f}s"


def _ls_line(r: Any, now: float) -> str:
    covers = str(r.step) if r.first_step == r.step else f"{r.first_step}..{r.step}"
    ranks = f"{r.ranks}/{r.world_size}"
    age = _age(None if r.created_unix is None else now - r.created_unix)
    return (
        f"{r.kind:>6} {r.step:>10} {r.layer:>5} {covers:>21} {ranks:>5} {_human(r.bytes):>11} "
        f"{age:>5}  {r.state:<11} {r.id} {r.folder}"
    )


def _tree_line(r: Any, now: float) -> str:
    covers = str(r.step) if r.first_step == r.step else f"{r.first_step}..{r.step}"
    layer = f" L{r.layer}" if r.layer else ""
    age = _age(None if r.created_unix is None else now - r.created_unix)
    return (
        f"{r.kind}{layer} {covers}  {r.ranks}/{r.world_size} ranks  {_human(r.bytes)}  {age}  "
        f"{r.state}  {r.folder}"
    )


def cmd_ls(a: argparse.Namespace) -> int:
    from deck.ops.listing import list_rows, tree_lines

    graph, rows = list_rows(open_storage(a.uri, a.storage_options))
    now = time.time()
    if a.json:
        print(json.dumps([r.to_dict(now) for r in rows], indent=1))
    elif rows and a.tree:
        print("\n".join(tree_lines(graph, rows, lambda r: _tree_line(r, now))))
    elif rows:
        print(
            f"{'kind':>6} {'step':>10} {'layer':>5} {'covers':>21} {'ranks':>5} {'bytes':>11} "
            f"{'age':>5}  {'state':<11} id / folder"
        )
        for r in rows:
            print(_ls_line(r, now))
    if not rows:
        print(f"no checkpoints at {a.uri}", file=sys.stderr)
        return 1
    return 0


def cmd_show(a: argparse.Namespace) -> int:
    from deck.ops.listing import describe_checkpoint, find_checkpoint

    storage = open_storage(a.uri, a.storage_options)
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
            f"{t['saved_rows']} rows saved, {_human(t['bytes'])}"
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
        f"base {d['base']}, epoch {d['epoch']}, {d['world_size']} ranks, {_human(d['bytes'])}, "
        f"committed {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(d['created_unix']))} "
        f"({_age(time.time() - d['created_unix'])} ago) by deck {d['deck_version']}"
    )


def _show_rank(r: dict[str, Any]) -> None:
    """Print one rank of ``deck show``: its manifest, shards (and their chunk files) and files."""
    m = r["manifest"]
    print(
        f"rank {r['rank']}: {m['path']} ({m['bytes']} B, xxh3 {m['checksum']}), data {_human(r['data_bytes'])}"
    )
    for s in r["shards"]:
        print(
            f"  {s['table']} rows {s['row_offset']}..{s['row_offset'] + s['rows']} cols "
            f"{s['col_offset']}..{s['col_offset'] + s['cols']}: {s['saved_rows']} rows"
            f"{' (full)' if s['full'] else ''}, states {','.join(s['states'])}, "
            f"{s['num_chunks']} chunk(s), {_human(s['bytes'])}"
        )
        for c in s.get("chunks", ()):
            print(f"    {c['path']}  {c['rows']} rows  {c['bytes']} B  xxh3 {c['checksum']}")
    for what in ("dense", "extra"):
        f = r[what]
        if f is not None:
            print(f"  {what}: {f['path']}  {f['nbytes']} B  xxh3 {f['checksum']}")


def cmd_report(a: argparse.Namespace) -> int:
    from deck.ops.report import write_report

    rep = write_report(a.uri, a.out, a.storage_options)
    print(f"wrote {rep.html} ({len(rep.images)} images: {', '.join(rep.images)})")
    return 0 if rep.checkpoints else 1


def _verify_targets(
    a: argparse.Namespace, manifests: ManifestSet, damaged: dict[int, str]
) -> list[CheckpointManifest] | None:
    """What ``deck verify`` checks: every committed checkpoint (``--all``), ``--step``, or the
    latest restorable step; None (after saying why on stderr) when there is nothing to check."""
    from deck.read.lineage import latest_restorable

    if not manifests:
        print(f"no committed checkpoints at {a.uri}", file=sys.stderr)
        return None
    if a.all:
        return [manifests[s] for s in sorted(manifests)] + sorted(
            manifests.merged.values(), key=lambda m: (m.step, m.layer, m.id)
        )
    if a.step in damaged:
        return None
    step = a.step if a.step is not None else latest_restorable(manifests)
    if step is None or step not in manifests:
        print(
            f"no committed checkpoint at step {a.step} in {a.uri}; have {sorted(manifests)}",
            file=sys.stderr,
        )
        return None
    return [manifests[step]]


def cmd_verify(a: argparse.Namespace) -> int:
    """``deck verify``: re-read every file of the chosen checkpoints and check its size and
    checksum; exit 1 when any has a problem or a damaged commit record. ``--quarantine`` also
    records each damaged checkpoint, so restores and the merger avoid it."""
    from deck.read.catalog import quarantine, read_manifests
    from deck.read.verify import verify_checkpoint

    storage = open_storage(a.uri, a.storage_options)
    manifests = read_manifests(storage)
    # Unreadable commit records are problems of the steps they name (the rest is still checked).
    damaged = {s: why for s, why in manifests.damaged.items() if a.all or a.step in (None, s)}
    for s, why in sorted(damaged.items()):
        print(f"step {s}: commit record damaged\n  BAD {why}")
    targets = _verify_targets(a, manifests, damaged)
    if targets is None:
        return 1
    bad = len(damaged)
    t0 = time.perf_counter()
    for m in targets:
        label = f"step {m.step}" if not m.is_merged else f"{m.kind.value} {m.folder}"
        bar = _bar(f"verify {label}")
        report = verify_checkpoint(storage, m, progress=bar.update if bar else None)
        if bar:
            bar.close()
        status = "ok" if not report.problems else f"{len(report.problems)} problem(s)"
        print(f"{label}: {report.files} files, {_human(report.bytes)}: {status}")
        for p in report.problems:
            print(f"  BAD {p}")
        if report.problems and a.quarantine:
            quarantine(storage, m, report.problems[0])
            print("  quarantined: restores and the merger will not use it")
        bad += bool(report.problems)
    print(
        f"verified {len(targets) + len(damaged)} checkpoint(s) in {time.perf_counter() - t0:.1f} s; "
        f"{bad} with problems"
    )
    return 1 if bad else 0


def cmd_history(a: argparse.Namespace) -> int:
    from deck.ops.history import row_history

    h = row_history(a.uri, a.table, a.row, a.storage_options)
    if a.json:
        print(json.dumps(h.to_dict(), indent=1))
        return 0
    print(
        f"table {h.table} row {h.row}: {len(h.steps)} steps; read {h.chunks_read} of "
        f"{h.chunks_present} chunks (skipped {h.skipped_range} by id range, {h.skipped_bloom} "
        f"by bloom filter; {h.false_positives} false positives)"
    )
    for s in h.steps:
        vals = "  ".join(
            f"{k}=[{', '.join(f'{x:.6g}' for x in v[:8])}{', ...' if len(v) > 8 else ''}]"
            for k, v in s.values.items()
        )
        print(f"step {s.step:>8}  {vals}  from {', '.join(s.sources)}")
    return 0


def cmd_lineage(a: argparse.Namespace) -> int:
    from deck.read.lineage import chain_bytes, cheapest_chain, lineage_graph

    graph = lineage_graph(a.uri, a.storage_options)
    if not graph.nodes:
        print(f"no committed checkpoints at {a.uri}", file=sys.stderr)
        return 1
    if a.json:
        print(json.dumps(graph.to_dict(), indent=1))
        return 0
    print(f"{'kind':>6} {'layer':>5} {'covers':>21} {'epoch':>5} {'bytes':>11}  id / folder")
    for n in sorted(graph.nodes.values(), key=lambda n: (n.step, n.first_step, n.layer, n.id)):
        covers = f"{n.covers[0]}..{n.covers[1]}" if n.covers[0] != n.covers[1] else str(n.step)
        flag = f"  QUARANTINED: {n.quarantined}" if n.quarantined else ""
        print(
            f"{n.kind.value:>6} {n.layer:>5} {covers:>21} {n.epoch:>5} {_human(n.bytes):>11}  "
            f"{n.id} {n.folder}{flag}"
        )
    step = a.step if a.step is not None else graph.latest()
    if step is None:
        print("no restorable step")
        return 1
    chain = cheapest_chain(graph, step)
    total = chain_bytes(chain)
    print(f"cheapest chain of step {step} ({len(chain)} checkpoints, {_human(total)}):")
    for m in chain:
        print(f"  {m.kind.value:>6} {m.covers[0]}..{m.covers[1]}  {m.folder}")
    return 0


def _merge_config(a: argparse.Namespace, worker_index: int, num_workers: int) -> Any:
    """The flags of :func:`_add_merge_config_args` as a MergeConfig (--full-live-fraction 0:
    off)."""
    from deck.merge.policy import FullPolicy, MergeConfig

    return MergeConfig(
        stride=a.stride,
        full=FullPolicy(
            every=a.full_every,
            max_live_fraction=None if a.full_live_fraction <= 0 else a.full_live_fraction,
            cost_ratio=a.full_cost_ratio,
        ),
        chunk_bytes=a.chunk_bytes,
        worker_index=worker_index,
        num_workers=num_workers,
    )


def _retention(a: argparse.Namespace) -> Any:
    from deck.ops.retention import RetentionPolicy

    return RetentionPolicy(
        keep_last_fulls=a.keep_last_fulls,
        keep_fulls_every=a.keep_fulls_every,
        keep_all_steps=a.keep_all_steps,
        chain_delta_budget=a.chain_delta_budget or None,
        grace_s=a.grace,
    )


def _run_worker(
    a: argparse.Namespace,
    worker_index: int,
    num_workers: int,
    report: Any = None,
) -> int:
    """One merger worker in this process; returns its exit code. ``report(kind, stats)`` gets
    progress events."""
    from deck.merge.worker import MergeWorker
    from deck.ops.retention import collect_garbage

    storage = open_storage(a.uri, a.storage_options)
    config = _merge_config(a, worker_index, num_workers)
    after_pass = None
    if a.gc and worker_index == 0:
        policy = _retention(a)

        def after_pass(_manifests: Any) -> None:
            collect_garbage(storage, policy)

    worker = MergeWorker(storage, config, after_pass=after_pass, progress=report)
    if a.follow:
        stop = threading.Event()

        def on_signal(signum: int, _frame: Any) -> None:
            stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)
        worker.follow(stop, poll_s=a.poll)
        return 0
    stats, waiting = worker.run_once(wait_s=a.wait)
    return 1 if waiting or stats.failed or worker.failures else 0


def _child(a: argparse.Namespace, index: int, num: int, queue: Any) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        code = _run_worker(
            a, index, num, lambda kind, st: queue.put((kind, st.bytes_written, st.items_committed))
        )
    except DeckError as e:
        print(f"deck merge (worker {index} of {num}): {e}", file=sys.stderr)
        code = 2
    queue.put(("exit", index, code))


def cmd_merge(a: argparse.Namespace) -> int:
    from deck.merge.launch import resolve_worker

    # Flags, else torchrun / Kubernetes Indexed Job / SLURM variables (deck.merge.launch).
    slot = resolve_worker(a.worker_index, a.num_workers)
    first, hosts = slot.index, slot.count
    k = a.workers
    if k < 1:
        raise ConfigError(f"--workers must be >= 1, got {k}")
    _merge_config(a, 0, 1)  # validate the options before starting anything
    indices = [first * k + j for j in range(k)]
    total = hosts * k
    t0 = time.perf_counter()
    tally = _MergeTally()
    if k == 1:
        code = _run_worker(a, indices[0], total, lambda kind, _stats: tally.event(kind))
    else:
        code = _run_workers(a, indices, total, tally)
    tally.close()
    mine = f"{indices[0]}" if k == 1 else f"{indices[0]}..{indices[-1]}"
    print(
        f"deck merge: {tally.committed} checkpoint(s) committed by {k} worker(s) "
        f"(index {mine} of {total}, from {slot.source}), {tally.partitions} partition(s) built, "
        f"in {time.perf_counter() - t0:.1f} s"
        + ("; some work is left (see the warnings above)" if code == 1 else "")
    )
    return code


class _MergeTally:
    """What the merger workers of ``deck merge`` did so far, from their progress events:
    partitions built, checkpoints committed (also a progress bar, on a terminal)."""

    def __init__(self) -> None:
        self.committed = 0
        self.partitions = 0
        self.bar = _bar("deck merge", unit=" ckpt", unit_scale=False)

    def event(self, kind: str) -> None:
        if kind == "partition":
            self.partitions += 1
        elif kind == "commit":
            self.committed += 1
            if self.bar:
                self.bar.update(1)

    def close(self) -> None:
        if self.bar:
            self.bar.close()


def _run_workers(a: argparse.Namespace, indices: list[int], total: int, tally: _MergeTally) -> int:
    """Merger workers ``indices`` (of ``total``), one process each, until all have exited;
    returns the highest exit code (2 for a worker that died without saying)."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(a, i, total, queue)) for i in indices]
    for p in procs:
        p.start()
    codes: dict[int, int] = {}
    try:
        _collect_workers(queue, dict(zip(indices, procs, strict=True)), codes, tally)
    except KeyboardInterrupt:
        for p in procs:
            p.terminate()
    for p in procs:
        p.join()
    return max(codes.values(), default=2)


def _collect_workers(
    queue: Any, procs: dict[int, Any], codes: dict[int, int], tally: _MergeTally
) -> None:
    """Pass the events of worker processes ``procs`` (by index) to ``tally`` and record each
    one's exit code in ``codes`` (filled as they come: an interrupt keeps what has come)."""
    while len(codes) < len(procs):
        try:
            kind, x, y = queue.get(timeout=0.5)
        except Exception:  # queue.Empty: check for workers that died without a word
            for i, p in procs.items():
                if not p.is_alive() and i not in codes and p.exitcode not in (0, None):
                    codes[i] = 2
            continue
        if kind == "exit":
            codes[x] = y
        else:
            tally.event(kind)


def cmd_gc(a: argparse.Namespace) -> int:
    from deck.ops.retention import collect_garbage

    storage = open_storage(a.uri, a.storage_options)
    rep = collect_garbage(storage, _retention(a), dry_run=a.dry_run)
    verb = "would delete" if a.dry_run else "deleted"
    if rep.latest is None:
        print(f"no restorable checkpoint at {a.uri}: nothing deleted but orphans")
    else:
        steps = rep.retained_steps
        shown = ", ".join(map(str, steps[:12])) + (", ..." if len(steps) > 12 else "")
        print(f"latest step {rep.latest}; {len(steps)} step(s) stay restorable: {shown}")
    for folder, why in rep.deleted:
        print(f"  {verb} {folder}: {why}")
    for prefix, why in rep.orphans:
        print(f"  {verb} {prefix}: {why}")
    for e in rep.errors:
        print(f"  ERROR {e}", file=sys.stderr)
    print(
        f"{verb} {len(rep.deleted)} checkpoint(s) and {len(rep.orphans)} orphan(s): "
        f"{rep.files} files, {_human(rep.bytes)}"
    )
    return 1 if rep.errors else 0


def _bar(desc: str, total: int | None = None, unit: str = "B", unit_scale: bool = True) -> Any:
    """A tqdm progress bar on stderr when it is a terminal, else None (quiet for scripts)."""
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(desc=desc, total=total, unit=unit, unit_scale=unit_scale, leave=False)


def cmd_export(a: argparse.Namespace) -> int:
    from deck.ops.export import StepState, export_dcp, export_safetensors

    state = StepState(a.uri, a.step, a.storage_options)
    total = sum(math.prod(p.sizes) * p.dtype.itemsize for p in state.pieces)
    bar = _bar(f"export step {state.step}", total)
    progress = bar.update if bar else None
    t0 = time.perf_counter()
    try:
        if a.format == "dcp":
            rep = export_dcp(state, a.out, progress)
        else:
            out = a.out
            if not out.endswith(".safetensors"):
                out = os.path.join(out, f"deck-step-{state.step:012d}.safetensors")
            rep = export_safetensors(state, out, progress)
    finally:
        if bar:
            bar.close()
    print(
        f"exported step {rep.step} ({len(rep.chain)} checkpoints: {', '.join(rep.chain)}) to "
        f"{rep.path} as {a.format}: {rep.tensors} tensors, {_human(rep.bytes_written)} written, "
        f"{_human(rep.bytes_read)} read, at most {_human(rep.max_held_bytes)} of table state "
        f"held at once, {time.perf_counter() - t0:.1f} s"
    )
    for s in rep.skipped:
        print(f"  not exported: {s}")
    return 0


def _add_retention_args(p: argparse.ArgumentParser) -> None:
    """The retention flags of ``deck gc`` and ``deck merge --gc``; their defaults are
    :class:`RetentionPolicy`'s (see :func:`_retention` for the mapping back)."""
    from deck.ops.retention import RetentionPolicy

    default = {name: f.default for name, f in RetentionPolicy.model_fields.items()}
    p.add_argument(
        "--keep-last-fulls",
        type=int,
        default=default["keep_last_fulls"],
        help=f"newest fulls kept for rollback ({default['keep_last_fulls']})",
    )
    p.add_argument(
        "--keep-fulls-every",
        type=int,
        default=default["keep_fulls_every"],
        metavar="N",
        help="also keep the oldest full of every N-step period (rollback past bad data)",
    )
    p.add_argument(
        "--keep-all-steps",
        action=argparse.BooleanOptionalAction,
        default=default["keep_all_steps"],
        help="keep every currently restorable step restorable (default); --no-keep-all-steps: "
        "only the active window and the rollback fulls (DECK fig. 9)",
    )
    p.add_argument(
        "--chain-delta-budget",
        type=float,
        default=default["chain_delta_budget"],
        metavar="F",
        help="with every step kept: keep a full wherever the deltas since the last kept one add "
        f"up to F fulls' bytes, bounding old steps' restores ({default['chain_delta_budget']:g}; "
        "0: off)",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=default["grace_s"],
        metavar="S",
        help="never delete what the lineage needed S seconds ago, nor files younger "
        f"({default['grace_s']:g})",
    )


def _json_options(text: str | None) -> dict[str, Any] | None:
    if not text:
        return None
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--storage-options is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("--storage-options must be a JSON object")
    return value


def cmd_follow(a: argparse.Namespace) -> int:
    from deck.ops.follow import FollowUpdate, follow

    def show(u: FollowUpdate) -> None:
        if u.how == "unchanged":
            return
        print(
            f"step {u.step} ({u.ckpt_id}): {u.how}, {len(u.applied)} checkpoint(s) read "
            f"({', '.join(u.applied)}), {_human(u.bytes_read)} of chunks read (a restore of the "
            f"step reads {_human(u.chain_bytes)}), {u.seconds:.2f} s ({u.write_s:.2f} s "
            f"writing) -> {a.out}",
            flush=True,
        )

    try:
        follow(
            a.uri,
            a.out,
            once=a.once,
            poll_s=a.poll,
            storage_options=a.storage_options,
            on_update=show,
            allow_quantized=a.allow_quantized,
        )
    except KeyboardInterrupt:
        return 0
    return 0


_Subparsers = argparse._SubParsersAction  # what add_subparsers returns


def _ls_parser(sub: _Subparsers) -> None:
    ls = sub.add_parser(
        "ls",
        help="the lineage as a table: committed and pending checkpoints",
        description="Every checkpoint at URI: trainer fulls and deltas, the merger's merged deltas "
        "and fulls, and pending trainer steps (rank parts written, manifest.json not yet). "
        "Columns: kind, step, layer, covered steps, rank parts present / world size, bytes, age, "
        "state (committed | pending | quarantined), id and folder. Exit 1 when there is nothing.",
    )
    ls.add_argument("uri")
    ls.add_argument("--json", action="store_true", help="machine-readable output (a list)")
    ls.add_argument("--tree", action="store_true", help="as a tree of parent links")
    ls.set_defaults(fn=cmd_ls)


def _show_parser(sub: _Subparsers) -> None:
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


def _verify_parser(sub: _Subparsers) -> None:
    ver = sub.add_parser("verify", help="re-read files and check checksums")
    ver.add_argument("uri")
    g = ver.add_mutually_exclusive_group()
    g.add_argument("--step", type=int, help="one step (default: the latest restorable)")
    g.add_argument("--all", action="store_true", help="every committed checkpoint")
    ver.add_argument(
        "--quarantine",
        action="store_true",
        help="record damaged checkpoints so restores and the merger avoid them",
    )
    ver.set_defaults(fn=cmd_verify)


def _lineage_parser(sub: _Subparsers) -> None:
    lin = sub.add_parser("lineage", help="the lineage graph and the cheapest chain of a step")
    lin.add_argument("uri")
    lin.add_argument("--json", action="store_true", help="machine-readable graph")
    lin.add_argument("--step", type=int, help="chain of this step (default: the latest)")
    lin.set_defaults(fn=cmd_lineage)


def _history_parser(sub: _Subparsers) -> None:
    his = sub.add_parser("history", help="one row's value at every restorable step")
    his.add_argument("uri")
    his.add_argument("--table", required=True, help="table key, as `deck show` lists it")
    his.add_argument("--row", required=True, type=int, help="global row id")
    his.add_argument("--json", action="store_true", help="machine-readable, full precision")
    his.set_defaults(fn=cmd_history)


def _add_merge_config_args(p: argparse.ArgumentParser) -> None:
    """The flags of ``deck merge`` that make its :class:`MergeConfig` / :class:`FullPolicy`;
    their defaults are the models' (see :func:`_merge_config` for the mapping back)."""
    from deck.merge.policy import FullPolicy, MergeConfig

    merge = {name: f.default for name, f in MergeConfig.model_fields.items()}
    full = {name: f.default for name, f in FullPolicy.model_fields.items()}
    p.add_argument(
        "--stride",
        type=int,
        default=merge["stride"],
        help=f"items per merge, s ({merge['stride']})",
    )
    p.add_argument(
        "--full-every", type=int, default=full["every"], metavar="N", help="new full every N deltas"
    )
    p.add_argument(
        "--full-live-fraction",
        type=float,
        default=full["max_live_fraction"] or 0.0,
        metavar="F",
        help="new full when a restore reads more than F x a full on top of it "
        f"({full['max_live_fraction'] or 0.0}; 0: off)",
    )
    p.add_argument(
        "--full-cost-ratio",
        type=float,
        default=full["cost_ratio"],
        metavar="R",
        help="IncrCP-style rule: new full when live x R >= 2 x full + live",
    )
    p.add_argument(
        "--chunk-bytes",
        type=int,
        default=merge["chunk_bytes"],
        help="chunk size of merged files",
    )


def _merge_parser(sub: _Subparsers) -> None:
    mer = sub.add_parser("merge", help="run merger worker(s): merged deltas and new fulls")
    mer.add_argument("uri")
    mode = mer.add_mutually_exclusive_group()
    mode.add_argument("--once", action="store_true", help="catch up and exit (default)")
    mode.add_argument("--follow", action="store_true", help="keep merging until interrupted")
    _add_merge_config_args(mer)
    mer.add_argument("--workers", type=int, default=1, help="worker processes to run here (1)")
    mer.add_argument(
        "--worker-index",
        type=int,
        default=None,
        help="this host's index (default: $RANK, $JOB_COMPLETION_INDEX or $SLURM_PROCID)",
    )
    mer.add_argument(
        "--num-workers",
        type=int,
        default=None,
        help="hosts running workers (default: $WORLD_SIZE, $DECK_NUM_WORKERS or $SLURM_NTASKS)",
    )
    mer.add_argument("--gc", action="store_true", help="worker 0 also runs GC after each pass")
    mer.add_argument("--poll", type=float, default=5.0, help="--follow: seconds between scans")
    mer.add_argument(
        "--wait",
        type=float,
        default=60.0,
        help="--once: seconds to wait for other workers' partitions (60)",
    )
    _add_retention_args(mer)
    mer.set_defaults(fn=cmd_merge)


def _gc_parser(sub: _Subparsers) -> None:
    gc = sub.add_parser("gc", help="delete what no retained step needs (retention)")
    gc.add_argument("uri")
    gc.add_argument("--dry-run", action="store_true", help="only report what would go")
    _add_retention_args(gc)
    gc.set_defaults(fn=cmd_gc)


def _export_parser(sub: _Subparsers) -> None:
    exp = sub.add_parser(
        "export",
        help="write the full state of a step as a DCP checkpoint or one safetensors file",
        description="Write the full state of a step (its chain applied: tables, fused "
        "optimizer states, dense parameters, dense optimizer) as a torch.distributed.checkpoint "
        "directory that dcp.load restores into a freshly built DMP model (keys: model.<state_dict "
        "key>, optim.state.<param>.<state>, as for {'model': model.state_dict(), 'optim': "
        "CombinedOptimizer([model.fused_optimizer, dense_opt]).state_dict()}), or as one "
        "safetensors file of unsharded tensors for inspection. Streams one table shard at a "
        "time (safetensors: one table).",
    )
    exp.add_argument("uri")
    exp.add_argument("--step", type=int, help="step to export (default: the latest restorable)")
    exp.add_argument(
        "--out",
        required=True,
        help="dcp: a new or empty directory; safetensors: a directory or a *.safetensors path",
    )
    exp.add_argument("--format", choices=("dcp", "safetensors"), default="dcp", help="(dcp)")
    exp.set_defaults(fn=cmd_export)


def _follow_parser(sub: _Subparsers) -> None:
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
        "--poll", type=float, default=10.0, help="seconds between checks for new steps (10)"
    )
    fol.add_argument(
        "--allow-quantized",
        action="store_true",
        help="accept a publisher's quantised weights (DeckConfig.publish.quantize): the output "
        "holds them dequantised, and state.json / the file metadata say which encodings",
    )
    fol.set_defaults(fn=cmd_follow)


def _report_parser(sub: _Subparsers) -> None:
    rep = sub.add_parser(
        "report",
        help="an HTML page: the lineage graph, bytes per checkpoint, restore cost per step",
        description="Write an HTML page with a picture of the lineage graph and plots of bytes "
        "per checkpoint and restore cost (bytes the cheapest chain reads) per step; the PNG "
        "images go next to it (<out stem>-*.png). Needs matplotlib (pip install 'deck[report]').",
    )
    rep.add_argument("uri")
    rep.add_argument("--out", required=True, help="path of the HTML file to write")
    rep.set_defaults(fn=cmd_report)


# One entry per subcommand, in the order --help lists them.
_SUBCOMMANDS = (
    _ls_parser,
    _show_parser,
    _verify_parser,
    _lineage_parser,
    _history_parser,
    _merge_parser,
    _gc_parser,
    _export_parser,
    _follow_parser,
    _report_parser,
)


def build_parser() -> argparse.ArgumentParser:
    """The ``deck`` argument parser: the global ``--storage-options`` and every subcommand, each
    with its handler as ``fn``. Building it imports no torch."""
    p = argparse.ArgumentParser(
        prog="deck", description="Inspect, check, merge and collect deck checkpoints."
    )
    p.add_argument(
        "--storage-options",
        type=_json_options,
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
    """Run one ``deck`` command on ``argv`` (default: ``sys.argv[1:]``) and return its exit code:
    0 ok, 1 a check failed or nothing to act on, 2 a usage or access error (a :class:`DeckError`,
    printed to stderr as one ``deck <command>: ...`` line). Only the command's own modules are
    imported: ``deck ls`` never imports torch."""
    a = build_parser().parse_args(argv)
    if a.cmd in ("merge", "gc", "follow"):
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        # Which worker a merger is, and where that came from (flags or launcher variables).
        logging.getLogger("deck.merge.launch").setLevel(logging.INFO)
    try:
        return int(a.fn(a))
    except DeckError as e:
        print(f"deck {a.cmd}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
