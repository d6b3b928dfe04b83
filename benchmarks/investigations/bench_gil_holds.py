"""Which of deck's background code makes the training thread wait for the GIL? Measured in
CPython itself: the attribution behind "The steps after a delta, tenth pass" in
docs/benchmarks-history.md.

One training rank as in ``bench_interference.py`` (world size 1, the demo's DLRM, its training
thread on core 0, every other thread on core 1) trains with deck (a full, then a delta every
``--delta-every`` steps). An LD_PRELOAD probe (``gil_holds.c``, compiled here with the system C
compiler) records, over the ``--after`` steps after each delta (and, with ``--away``, over as
many steps away from it; with ``--fulls``, after each of that many fulls taken after the
deltas):

- each wait of the training thread for the GIL: how long, and which thread released the GIL
  that ended it, at which Python frames;
- each stretch a background thread held the GIL: its wall and CPU time, the frames where it took
  the GIL (back from a call that had released it) and where it let it go.

Printed per delta (and per full): the training thread's waits and the milliseconds it waited, by the thread
that held the GIL; each background thread's milliseconds holding the GIL (all, in stretches over
30 us, and its CPU time in them); the longest-held stretches by where they began and ended.
CPython 3.11 on Linux only (the probe reads 3.11's frame structs); deck is unchanged by it.

    python benchmarks/investigations/bench_gil_holds.py [--deltas 20] [--rows 1000000] [--after 3] [--away] [--fulls 3] [--mode process]
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from pathlib import Path
from typing import Any

# bench_interference (the pinned training rank) lies one folder up, in benchmarks/
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_interference import _kind, _pin_others, model_args, model_spec, pinned_rank

from deck.demo import ModelSpec, train_step

PROBE = Path(__file__).with_name("gil_holds.c")
LONG_US = 30.0  # a stretch longer than this costs a training thread that finds it held


def _build_probe(out: Path) -> Path:
    """Compile the probe against this interpreter's headers (internal ones included)."""
    if sys.version_info[:2] != (3, 11):
        raise SystemExit("bench_gil_holds: the probe reads CPython 3.11's frame structs")
    so = out / "gil_holds.so"
    include = sysconfig.get_paths()["include"]
    cc = os.environ.get("CC", "cc")
    cmd = [cc, "-O2", "-shared", "-fPIC", "-o", str(so), str(PROBE), f"-I{include}", "-ldl"]
    subprocess.run(cmd, check=True)
    return so


def _steps(model: Any, dense: Any, spec: ModelSpec, steps: range) -> None:
    for s in steps:
        train_step(model, dense, spec, s)


def _measure(a: argparse.Namespace, out: Path) -> tuple[dict[int, str], dict[str, int]]:
    """Train with deck under the probe; the TSV files go to ``out``. Returns tid -> thread kind,
    and per window kind how often background threads waited for the GIL."""
    import deck
    from deck.config import StagingConfig

    probe = ctypes.CDLL(None)  # the preloaded probe's symbols are the process's
    logging.getLogger().setLevel(logging.ERROR)
    spec = model_spec(a)
    model, dense = pinned_rank(spec)
    _steps(model, dense, spec, range(10**6, 10**6 + 5))
    cfg = deck.DeckConfig(
        uri=str(out / "ck"),
        delta_every_steps=a.delta_every,
        staging=StagingConfig(copy_on_write=a.copy_on_write, mode=a.mode),
    )
    ckpt = deck.enable(model, [dense], cfg)
    ckpt.step(0)
    ckpt.flush()  # the deltas' windows measure the deltas, not the full being written
    _pin_others(1)
    names: dict[int, str] = {}
    files = {
        kind: (str(out / f"{kind}.waits"), str(out / f"{kind}.holds"))
        for kind in ("after", "away", "full")
    }

    probe.gil_holds_background_waits.restype = ctypes.c_long
    bg_waits: collections.Counter[str] = collections.Counter()

    def record(kind: str, steps: range) -> None:
        probe.gil_holds_background_waits()
        probe.gil_holds_start()
        _steps(model, dense, spec, steps)
        probe.gil_holds_stop()
        bg_waits[kind] += probe.gil_holds_background_waits()
        w, h = files[kind]
        probe.gil_holds_dump(w.encode(), h.encode())

    for d in range(1, a.deltas + a.fulls + 1):
        at = d * a.delta_every
        full = d > a.deltas
        _steps(model, dense, spec, range(at - a.delta_every + 1, at - a.after))
        if a.away and not full:  # the steps just before the delta: deck's background long idle
            record("away", range(at - a.after, at))
        else:
            _steps(model, dense, spec, range(at - a.after, at))
        ckpt.save("full" if full else "delta", step=at)
        _pin_others(1)
        names.update({t.native_id: _kind(t.name) for t in threading.enumerate() if t.native_id})
        record("full" if full else "after", range(at + 1, at + 1 + a.after))
        names.update({t.native_id: _kind(t.name) for t in threading.enumerate() if t.native_id})
        if full:  # each full's window its own, not the previous full's writes
            ckpt.flush()
    ckpt.flush()
    ckpt.close()
    return names, dict(bg_waits)


def _site(fields: list[str]) -> str:
    return " < ".join(f for f in fields[:2] if f != ":0")


def _report(
    a: argparse.Namespace, out: Path, names: dict[int, str], bg_waits: int, kind: str
) -> None:
    n, what = (a.fulls, "full") if kind == "full" else (a.deltas, "delta")
    per = 1 / n

    def who(t: str) -> str:
        return names.get(int(t), f"tid {t}") if t != "0" else "(unknown)"

    waited: collections.Counter[str] = collections.Counter()
    times: collections.Counter[str] = collections.Counter()
    for line in Path(out / f"{kind}.waits").read_text().splitlines():
        f = line.split("\t")
        waited[who(f[2])] += float(f[1]) / 1e3
        times[who(f[2])] += 1
    n_waits = sum(times.values())
    held: collections.Counter[str] = collections.Counter()
    held_long: collections.Counter[str] = collections.Counter()
    held_cpu: collections.Counter[str] = collections.Counter()
    by_site: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    for line in Path(out / f"{kind}.holds").read_text().splitlines():
        f = line.split("\t")
        us, cpu, thread = float(f[1]), float(f[2]), who(f[3])
        held[thread] += us / 1e3
        held_cpu[thread] += cpu / 1e3
        if us > LONG_US:
            held_long[thread] += us / 1e3
        site = f"{thread}: took at {_site(f[4:7])}; let go at {_site(f[7:10])}"
        by_site[site] += us / 1e3
        count[site] += 1
    title = f"{a.after} steps away" if kind == "away" else f"the {a.after} steps after each {what}"
    print(f"\n== {title} ({n} {what}s; per {what})")
    print(
        f"training thread: {n_waits * per:.1f} waits for the GIL, "
        f"{sum(waited.values()) * per:.2f} ms waited; by the thread that held it (waits, ms):"
    )
    for t, n in times.most_common():
        print(f"  {t:<16} {n * per:5.1f} {waited[t] * per:6.2f}")
    print(
        f"background threads waited for the GIL {bg_waits * per:.0f} times (each woken by the "
        "holder, mostly the training thread: a futex wake-up on its CPU)"
    )
    print(
        f"background GIL held, ms: all / in stretches over {LONG_US:.0f} us / the thread's CPU in them"
    )
    for t, ms in held.most_common():
        print(f"  {t:<16} {ms * per:6.2f} / {held_long[t] * per:6.2f} / {held_cpu[t] * per:6.2f}")
    print(f"the {a.top} stretches held longest in all (ms per {what}, times per {what}, mean us):")
    for site, ms in by_site.most_common(a.top):
        n = count[site]
        print(f"  {ms * per:6.3f} {n * per:5.1f}x {ms * 1e3 / n:7.1f}  {site}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_args(p)
    p.add_argument("--deltas", type=int, default=20)
    p.add_argument("--delta-every", type=int, default=25)
    p.add_argument("--after", type=int, default=3, help="steps recorded after each delta")
    p.add_argument("--away", action="store_true", help="also record as many steps before it")
    p.add_argument(
        "--fulls",
        type=int,
        default=0,
        help="then this many fulls (each flushed before the next), their steps after recorded",
    )
    p.add_argument("--copy-on-write", default="deltas", choices=["deltas", "all", "off"])
    p.add_argument("--mode", default="threads", choices=["threads", "process"], help="staging.mode")
    p.add_argument("--top", type=int, default=15)
    a = p.parse_args()
    if a.after >= a.delta_every // 2:
        raise SystemExit("--after must be below half of --delta-every")
    work = os.environ.get("DECK_GIL_HOLDS_DIR")
    if work is None:  # build the probe, then run again with it preloaded
        tmp = Path(tempfile.mkdtemp(prefix="deck-gil-holds-"))
        try:
            env = {
                **os.environ,
                "LD_PRELOAD": str(_build_probe(tmp)),
                "DECK_GIL_HOLDS_DIR": str(tmp),
            }
            rc = subprocess.run([sys.executable, __file__, *sys.argv[1:]], env=env).returncode
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        sys.exit(rc)
    out = Path(work)
    names, bg_waits = _measure(a, out)
    print(
        f"1 rank, training thread on core 0, deck's threads on core 1: DLRM {a.tables} tables x "
        f"{a.rows} rows x {a.dim} dim, batch {a.batch}, a delta every {a.delta_every} steps, "
        f"copy_on_write={a.copy_on_write}"
    )
    kinds = ["after", *(["away"] if a.away else []), *(["full"] if a.fulls else [])]
    for kind in kinds:
        _report(a, out, names, bg_waits.get(kind, 0), kind)
    print(
        "\nreproduce: python benchmarks/investigations/bench_gil_holds.py " + " ".join(sys.argv[1:])
    )
    from deck.processes import end_rank

    end_rank()  # exits the process


if __name__ == "__main__":
    main()
