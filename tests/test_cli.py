"""The deck console script, run as a subprocess on ONE checkpoint written by a 2-rank job (a
module fixture: full 0, deltas 5 and 10, and a merged delta of 5..10); commands that change the
checkpoint work on a copy."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import deck
from deck.cli import main
from deck.demo import ModelSpec, build_model, train_step
from deck.read.catalog import read_manifests, read_rank_manifests
from deck.storage import open_storage
from deck.testing.cli_runs import run_at_once
from deck.testing.dist_harness import run_ranks

pytestmark = pytest.mark.slow
SPEC = ModelSpec(num_tables=2, rows=400, dim=8, batch=32)
COMMANDS = ("ls", "show", "verify", "lineage", "export", "report", "merge", "gc")


def _write(rank: int, world_size: int, uri: str) -> None:
    model, opt = build_model(SPEC)
    with deck.enable(model, [opt], deck.DeckConfig(uri=uri, delta_every_steps=5)) as ck:
        for step in range(0, 11):
            if step:
                train_step(model, opt, SPEC, step)
            ck.step(step)


EXE = shutil.which("deck", path=str(Path(sys.executable).parent)) or "deck"


def _deck(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([EXE, *args], capture_output=True, text=True, timeout=120)


def _decks(*calls: tuple[str, ...]) -> list[subprocess.CompletedProcess[str]]:
    """Several independent console-script runs at once (each spends seconds importing torch)."""
    done = run_at_once({i: (EXE, *c) for i, c in enumerate(calls)}, timeout=120)
    return [done[i] for i in range(len(calls))]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cli") / "ck"
    run_ranks(_write, str(root))
    r = _deck("merge", str(root), "--once", "--stride", "2", "--full-live-fraction", "0")
    assert r.returncode == 0, r.stdout + r.stderr
    return root


def test_ls_table_tree_json_and_pending(ckpt: Path, tmp_path: Path) -> None:
    uri = str(ckpt)
    r, text_r, tree_r, empty, usage = _decks(
        ("ls", uri, "--json"),
        ("ls", uri),
        ("ls", uri, "--tree"),
        ("ls", str(tmp_path / "no")),
        ("ls",),
    )
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [
        (x["kind"], x["step"], x["layer"], x["covers"], x["ranks"], x["state"]) for x in rows
    ] == [
        ("full", 0, 0, [0, 0], 2, "committed"),
        ("delta", 5, 0, [5, 5], 2, "committed"),
        ("delta", 10, 0, [10, 10], 2, "committed"),
        ("merged", 10, 1, [5, 10], 2, "committed"),
    ]
    assert all(x["bytes"] > 0 and 0 <= x["age_s"] < 3600 for x in rows)

    text = text_r.stdout
    assert re.search(r"merged\s+10\s+1\s+5\.\.10\s+2/2", text), text
    tree = tree_r.stdout.splitlines()
    # The full is the root; delta 5 hangs under it, delta 10 under delta 5; the merged delta
    # applies on the full's state, so it hangs under the full too.
    assert tree[0].startswith("full 0") and "step-000000000000" in tree[0], tree
    depth = {ln.split()[-1]: len(ln) - len(ln.lstrip("|`- ")) for ln in tree}
    assert depth["step-000000000005"] == 3 and depth["step-000000000010"] == 6, tree
    assert next(ln for ln in tree if "merged/L01" in ln).startswith("|- merged L1 5..10"), tree

    # A step whose rank parts are there but whose manifest.json is not: pending.
    copy = tmp_path / "ck"
    shutil.copytree(ckpt, copy)
    (copy / "step-000000000010" / "manifest.json").unlink()
    rows = json.loads(_deck("ls", str(copy), "--json").stdout)
    pending = [x for x in rows if x["state"] == "pending"]
    assert [(x["step"], x["kind"], x["ranks"], x["world_size"]) for x in pending] == [
        (10, "delta", 2, 2)
    ]
    # One whose files are still being written in a local destination (its pending records
    # there, no rank part up yet): pending too, with what its record says (a break-it finding:
    # not listed at all, though a restart commits it)
    from deck.format.manifest import dump_model
    from deck.testing.staging import full_part_info

    info = full_part_info(str(copy), 11, "b" * 16, rank=1, world_size=2)
    storage = open_storage(str(copy))
    storage.put(f"step-000000000011/{'b' * 16}/rank-00001.pending.json", dump_model(info))
    rows = json.loads(_deck("ls", str(copy), "--json").stdout)
    pending = [x for x in rows if x["state"] == "pending"]
    assert [(x["step"], x["kind"], x["ranks"], x["world_size"]) for x in pending] == [
        (10, "delta", 2, 2),
        (11, "full", 0, 2),
    ], pending

    # A URI that is not there is said so (exit 2, like every "nothing there").
    assert empty.returncode == 2 and "does not exist" in empty.stderr, empty.stderr
    assert usage.returncode == 2 and "usage: deck" in usage.stderr


def test_show_names_every_shard_and_chunk(ckpt: Path) -> None:
    name = next(p.name for p in (ckpt / "merged").iterdir() if p.name.startswith("L01"))
    r, text_r, merged, missing = _decks(
        ("show", str(ckpt), "5", "--json"),
        ("show", str(ckpt), "5"),
        ("show", str(ckpt), name, "--json", "--no-chunks"),
        ("show", str(ckpt), "99"),
    )
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert (d["kind"], d["step"], d["parent"], d["world_size"]) == ("delta", 5, 0, 2)
    storage = open_storage(str(ckpt))
    parts = read_rank_manifests(storage, read_manifests(storage)[5])
    want = {
        (p.rank, rec.table, rec.col_offset, c.path, c.checksum)
        for p in parts
        for rec in p.shards
        for c in rec.chunks
    }
    got = {
        (rk["rank"], s["table"], s["col_offset"], c["path"], c["checksum"])
        for rk in d["ranks"]
        for s in rk["shards"]
        for c in s["chunks"]
    }
    assert got == want and want
    for t in d["tables"].values():
        assert t["shape"] == [400, 8] and 0 < t["saved_rows"] < 400

    assert "rank 1:" in text_r.stdout and next(iter(want))[4] in text_r.stdout
    # A merger checkpoint by its folder name, and a step that does not exist.
    m = json.loads(merged.stdout)
    assert (m["kind"], m["layer"], m["covers"]) == ("merged", 1, [5, 10])
    assert not any("chunks" in s for rk in m["ranks"] for s in rk["shards"])
    assert missing.returncode == 2 and "99" in missing.stderr and "[0, 5, 10]" in missing.stderr


def test_verify_names_a_damaged_file(ckpt: Path, tmp_path: Path) -> None:
    copy = tmp_path / "ck"
    shutil.copytree(ckpt, copy)
    r = _deck("verify", str(copy), "--all")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 with problems" in r.stdout
    # Flip one byte of one chunk of step 5: verify fails and names that file.
    chunk = sorted((copy / "step-000000000005").rglob("*.chunk"))[0]
    data = bytearray(chunk.read_bytes())
    data[10] ^= 0xFF
    chunk.write_bytes(bytes(data))
    r, nothing, export = _decks(
        ("verify", str(copy), "--step", "5"),
        ("verify", str(tmp_path / "no")),
        ("export", str(copy), "--step", "5", "--out", str(tmp_path / "out"), "--format", "dcp"),
    )
    assert r.returncode == 1
    assert chunk.name in r.stdout and "checksum" in r.stdout
    assert nothing.returncode == 2 and nothing.stderr.startswith("deck verify: URI ")
    # A command that meets the damage names the file and says what to do next, on its one line
    assert export.returncode == 1 and len(export.stderr.splitlines()) == 1, export.stderr
    assert chunk.name in export.stderr, export.stderr
    assert f"next: `deck verify {copy} --all --quarantine`" in export.stderr, export.stderr


def test_verify_beside_a_gc_skips_what_it_deleted(
    ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A break-it finding: ``verify --all --quarantine`` beside a GC (``merge --follow --gc``)
    read the records, then found the files of a checkpoint GC deleted since missing, called it
    damage, exited 1 and quarantined it. A checkpoint whose record went meanwhile is skipped.
    The interleaving is fixed: GC's deletion (the record, then the folder) happens right
    before verify checks step 5."""
    import deck.read.verify as verify

    copy = tmp_path / "ck"
    shutil.copytree(ckpt, copy)
    check = verify.verify_checkpoint

    def gc_first(storage, m, **kw):  # type: ignore[no-untyped-def]
        if m.step == 5 and not m.is_merged and (copy / "step-000000000005").exists():
            (copy / "step-000000000005" / "manifest.json").unlink()
            shutil.rmtree(copy / "step-000000000005")
        return check(storage, m, **kw)

    monkeypatch.setattr(verify, "verify_checkpoint", gc_first)
    assert main(["verify", str(copy), "--all", "--quarantine"]) == 0
    out = capsys.readouterr().out
    assert "step 5: deleted or replaced while it was verified" in out, out
    assert "0 with problems" in out and not (copy / "quarantine").exists(), out


def test_verify_finds_a_step_whose_chain_lost_a_checkpoint(ckpt: Path, tmp_path: Path) -> None:
    """Every file of every committed checkpoint intact, but a step's chain lacks one (its
    record deleted under a trainer that went on building on it): that step, and each after it
    on the chain, is damage for ``verify --all`` and ``--step``."""
    copy = tmp_path / "ck"
    shutil.copytree(ckpt, copy)
    steps = sorted(read_manifests(open_storage(str(copy))))
    gone, after = steps[-3], steps[-2:]
    shutil.rmtree(copy / f"step-{gone:012d}")
    shutil.rmtree(copy / "merged", ignore_errors=True)  # nothing bridges the gap
    r, one = _decks(("verify", str(copy), "--all"), ("verify", str(copy), "--step", str(after[0])))
    assert r.returncode == 1, r.stdout + r.stderr
    assert [f"step {s}: not restorable" in r.stdout for s in after] == [True, True], r.stdout
    assert f"step {gone}" in r.stdout and "2 with problems" in r.stdout, r.stdout
    assert one.returncode == 1 and f"step {after[0]}: not restorable" in one.stdout, one.stdout
    # Plain verify checks the newest restorable step, and says the newer ones are not
    plain = _deck("verify", str(copy))
    assert plain.returncode == 1 and f"step {after[-1]}: not restorable" in plain.stdout


def test_gc_with_nothing_restorable_says_so_and_deletes_nothing(ckpt: Path, tmp_path: Path) -> None:
    """Committed checkpoints but no complete chain (every full gone): damage to look at (exit
    1, naming verify), not 'no checkpoints' (exit 2, what a wrong URI gives)."""
    copy = tmp_path / "ck"
    shutil.copytree(ckpt, copy)
    for m in read_manifests(open_storage(str(copy))).values():
        if m.kind.value == "full":
            shutil.rmtree(copy / m.folder)
    shutil.rmtree(copy / "merged", ignore_errors=True)
    before = sorted(p for p in copy.rglob("*"))
    r = _deck("gc", str(copy), "--grace", "0")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "but none restorable" in r.stderr and "deck verify" in r.stderr, r.stderr
    assert sorted(p for p in copy.rglob("*")) == before


def test_an_interrupted_gc_says_how_far_it_got_and_the_next_run_finishes(tmp_path: Path) -> None:
    """An operator's Ctrl-C during a long `deck gc` printed only "interrupted": how far it got
    and what to do is said now (what a stopped run leaves restores; the next run finishes)."""
    import os

    from deck.testing.synth import SynthTrainer

    uri = tmp_path / "ck"
    tr = SynthTrainer(open_storage(str(uri)))
    for step in range(12):
        if step:
            tr.train()
        tr.save("full" if step % 4 == 0 else None)
    argv = [EXE, "gc", str(uri), "--grace", "0", "--no-keep-all-steps", "--keep-last-fulls", "1"]
    env = {**os.environ, "DECK_FAILPOINTS": "gc.checkpoint.after_delete:2:interrupt"}
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 130, r.stdout + r.stderr
    # Each checkpoint said as it goes (stderr is no terminal), then one line, no traceback
    *going, last = r.stderr.splitlines()
    said = re.fullmatch(
        r"deck gc: interrupted at (\S+) \(checkpoint 2 it deleted or retired\): .*", last
    )
    assert said and "run it again to finish" in last, r.stderr
    assert len(going) == 2 and going[-1] == f"deck gc: deleting {said.group(1)}", r.stderr
    assert not (uri / said.group(1) / "manifest.json").exists()
    r = _deck("gc", *argv[2:])
    assert r.returncode == 0 and "deleted" in r.stdout, r.stdout + r.stderr
    assert sorted(read_manifests(open_storage(str(uri)))) == [8, 9, 10, 11]


def test_gc_and_merge_touch_nothing_in_a_folder_without_checkpoints(tmp_path: Path) -> None:
    """A mistyped URI (a parent folder of runs, another tool's folder): exit 2 and nothing
    written or deleted there -- not another writer's old temp file, nor a clock marker."""
    import os
    import time

    root = tmp_path / "runs"
    (root / "other-tool" / "sub").mkdir(parents=True)
    for temp in (root / ".tmp-a", root / "other-tool" / "sub" / ".tmp-b"):
        temp.write_bytes(b"x")
        old = time.time() - 7200
        os.utime(temp, (old, old))
    before = sorted(root.rglob("*"))
    runs = _decks(
        ("gc", str(root)),
        ("gc", str(root), "--grace", "0"),
        ("gc", str(root), "--dry-run"),
        ("merge", str(root), "--once"),
    )
    for r in runs:
        assert r.returncode == 2 and "no checkpoints at" in r.stderr, r.args
    assert sorted(root.rglob("*")) == before


def test_lineage_history_and_follow_exit_1_on_a_damaged_record_they_depend_on(
    ckpt: Path, tmp_path: Path
) -> None:
    """A break-it finding: with step 10's commit record truncated, `deck lineage` showed step
    5's chain as the latest, `deck history` left steps out and `deck follow --once` served step
    5, all exit 0. Now exit 1 and a line naming the record; a step below the damage is not
    affected (exit 0)."""
    copy = tmp_path / "ck"
    shutil.copytree(ckpt, copy)
    record = copy / "step-000000000010" / "manifest.json"
    record.write_bytes(record.read_bytes()[:20])
    lin, below, hist, fol = _decks(
        ("lineage", str(copy)),
        ("lineage", str(copy), "--step", "5"),
        ("history", str(copy), "--table", "t0", "--row", "3", "--json"),
        ("follow", str(copy), "--out", str(tmp_path / "served"), "--once"),
    )
    assert fol.returncode == 1 and "deck follow: the commit record(s) of step(s) [10]" in fol.stderr
    assert json.loads((tmp_path / "served" / "state.json").read_text())["step"] == 5
    assert lin.returncode == 1 and "cheapest chain of step 5" in lin.stdout, lin.stderr
    assert "deck lineage: the commit record(s) of step(s) [10] cannot be read" in lin.stderr
    assert below.returncode == 0, below.stderr
    assert hist.returncode == 1 and "deck history: " in hist.stderr, hist.stderr
    assert [s["step"] for s in json.loads(hist.stdout)["steps"]] == [0, 5]


def test_report_images_decode(ckpt: Path, tmp_path: Path) -> None:
    import matplotlib.image

    out = tmp_path / "rep" / "report.html"
    r = _deck("report", str(ckpt), "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    page = out.read_text()
    images = re.findall(r'<img src="([^"]+)"', page)
    assert sorted(images) == ["report-bytes.png", "report-lineage.png", "report-restore-cost.png"]
    for name in images:
        img = matplotlib.image.imread(str(out.parent / name))
        assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100, (name, img.shape)
        assert img.std() > 0  # not a blank canvas
    assert "merged/L01-000000000005-000000000010-" in page  # the checkpoint table


def test_report_of_a_damaged_record_and_images_that_are_links(ckpt: Path, tmp_path: Path) -> None:
    """Break-it findings: a damaged commit record made `deck report` fail with a traceback
    (its kind, "?", has no marker), and links named like the report's images made matplotlib
    write the PNGs through them, into a commit record of the URI. Now the page lists the damaged
    step (exit 1, one line naming it), and each image replaces whatever is at its name."""
    copy = tmp_path / "ck"
    shutil.copytree(ckpt, copy)
    (copy / "step-000000000010" / "manifest.json").write_bytes(b"{")
    victim = copy / "step-000000000005" / "manifest.json"
    before = victim.read_bytes()
    out = tmp_path / "rep"
    out.mkdir()
    for name in ("r-lineage.png", "r-bytes.png", "r-restore-cost.png"):
        (out / name).symlink_to(victim)
    r = _deck("report", str(copy), "--out", str(out / "r.html"))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert "deck report: the commit record(s) of step(s) [10] cannot be read" in r.stderr
    assert victim.read_bytes() == before
    for name in ("r-lineage.png", "r-bytes.png", "r-restore-cost.png"):
        assert not (out / name).is_symlink() and (out / name).read_bytes()[:4] == b"\x89PNG"
    assert "damaged" in (out / "r.html").read_text()


def test_help_on_every_command_and_export_usage_errors(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for cmd in COMMANDS:
        with pytest.raises(SystemExit) as exc:
            main([cmd, "--help"])
        assert exc.value.code == 0
        assert f"usage: deck {cmd}" in capsys.readouterr().out
    # The console script's own --help, and its exit codes for scripts.
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    h, r, f, u, sf = _decks(
        ("export", "--help"),
        ("export", str(ckpt), "--out", str(busy)),
        ("export", str(ckpt), "--out", str(busy / "x")),
        ("export", str(ckpt), "--out", str(busy / "x" / "sub")),
        ("export", str(ckpt), "--out", str(busy / "x"), "--format", "safetensors"),
    )
    assert h.returncode == 0 and "--format {dcp,safetensors,parquet}" in h.stdout
    assert r.returncode == 2 and "is a non-empty directory, not an empty directory" in r.stderr
    assert f.returncode == 2 and "is a file, not an empty directory" in f.stderr
    # (a break-it finding: said as "[Errno 17] File exists")
    assert sf.returncode == 2 and "is a file: name a folder" in sf.stderr, sf.stderr
    # An --out this host cannot write (a break-it finding: a traceback, exit 1): one line
    assert u.returncode == 2 and "Traceback" not in u.stderr, u.stderr
    assert u.stderr.startswith("deck export: ") and str(busy / "x" / "sub") in u.stderr
    assert main(["export", str(ckpt), "--step", "7", "--out", str(tmp_path / "e")]) == 2
    assert "step 7" in capsys.readouterr().err
    # A step below 0 was a traceback (exit 1, as damage); not an integer: argparse's words
    for argv in (
        ["export", str(ckpt), "--step", "-1", "--out", str(tmp_path / "e")],
        ["verify", str(ckpt), "--step", "x"],
        ["lineage", str(ckpt), "--step", "-3"],
        # above what a step folder's name holds: was a traceback (exit 1), a break-it finding
        ["export", str(ckpt), "--step", str(10**12), "--out", str(tmp_path / "e")],
    ):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and "argument --step: " in err, (argv, err)
        assert any(w in err for w in ("must be >= 0", "not an integer: 'x'", "must be <= 9")), err
    # 0 is off, as --help says: the message said "must be > 0.0"
    with pytest.raises(SystemExit) as exc:
        main(["gc", str(ckpt), "--chain-delta-budget", "-1", "--dry-run"])
    assert exc.value.code == 2 and "must be a number >= 0 (0: off)" in capsys.readouterr().err
    # An --out that is a URI (it became a local folder named "s3:") or inside the checkpoint
    # URI (deck wrote its export and its follower's state into the store): refused, nothing
    # written (break-it findings)
    before = sorted(ckpt.rglob("*"))
    for argv in (
        ["export", str(ckpt), "--out", "s3://bucket/x", "--format", "safetensors"],
        ["report", str(ckpt), "--out", "gs://bucket/r.html"],
        ["follow", str(ckpt), "--out", "s3://bucket/f", "--once"],
        ["export", str(ckpt), "--out", str(ckpt / "exp")],
        ["follow", f"file://{ckpt}", "--out", str(ckpt), "--once"],
        ["report", str(ckpt), "--out", str(ckpt / "merged" / "r.html")],
    ):
        assert main(argv) == 2, argv
        assert "--out" in capsys.readouterr().err, argv
    assert sorted(ckpt.rglob("*")) == before and not Path("s3:").exists()
    # A poll of 0 s would list the store in a tight loop
    for cmd in (
        ["follow", str(ckpt), "--out", str(tmp_path / "f")],
        ["merge", str(ckpt), "--follow"],
    ):
        with pytest.raises(SystemExit) as exc:
            main([*cmd, "--poll", "0"])
        assert exc.value.code == 2 and "--poll" in capsys.readouterr().err


def test_version_and_a_closed_pipe(ckpt: Path) -> None:
    v = _deck("--version")
    assert v.returncode == 0 and v.stdout.strip() == f"deck {deck.__version__}"
    # The reader is gone before deck writes a byte (as `deck ls --json | head -1` once head has
    # its line): a quiet exit, as a process killed by SIGPIPE, with no traceback.
    p = subprocess.Popen(
        [EXE, "ls", str(ckpt), "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None and p.stderr is not None
    p.stdout.close()
    err = p.stderr.read()
    assert p.wait(timeout=120) == 141, err
    assert err == "", err


def test_exit_codes_one_table(ckpt: Path, tmp_path: Path) -> None:
    """Every command: 2 (with its ``deck <command>:`` line) for a URI that is not there, an
    empty one, an unknown step, table or row; nothing printed to stdout before the error."""
    uri, missing, empty = str(ckpt), str(tmp_path / "typo"), tmp_path / "empty"
    empty.mkdir()
    out = tmp_path / "out"
    calls = {
        ("ls", missing): "does not exist",
        ("ls", str(empty)): "no checkpoints",
        ("show", missing, "5"): "does not exist",
        ("show", uri, "99"): "99",
        ("verify", uri, "--step", "999"): "step 999",
        ("verify", str(empty)): "no committed checkpoints",
        ("lineage", uri, "--step", "999"): "step 999",
        ("lineage", missing): "does not exist",
        ("history", uri, "--table", "nope", "--row", "0"): "no table 'nope'",
        ("history", uri, "--table", "t0", "--row", "400"): "outside table",
        ("export", uri, "--step", "7", "--out", str(out / "e")): "step 7",
        ("export", missing, "--out", str(out / "m")): "does not exist",
        ("follow", str(empty), "--out", str(out / "f"), "--once"): "no committed checkpoints",
        # (a break-it run: taken and ignored on a directory, exit 0 with no loader full)
        ("follow", uri, "--out", str(out / "k"), "--full-uri", str(out / "u"), "--run", "r"): (
            "--full-uri, --run: for kafka:// URIs only"
        ),
        ("report", str(empty), "--out", str(out / "r.html")): "no checkpoints",
        ("gc", missing): "does not exist",
        ("gc", str(empty)): "no checkpoints",
        ("merge", missing, "--once"): "does not exist",
        # (a break-it run: taken, the negative fraction acting as "off")
        ("merge", uri, "--once", "--full-live-fraction", "-0.5"): "--full-live-fraction must be",
    }
    for (cmd, *_), r in zip(calls, _decks(*calls), strict=True):
        what = calls[(cmd, *_)]
        assert r.returncode == 2, (cmd, _, r.returncode, r.stdout, r.stderr)
        assert r.stderr.startswith(f"deck {cmd}: "), (cmd, _, r.stderr)
        assert what in r.stderr and "Traceback" not in r.stderr, (cmd, _, r.stderr)
        assert r.stdout == "", (cmd, _, r.stdout)
    # deck follow made no --out folder for a start that failed, report wrote no empty page
    assert not (out / "f").exists() and not (out / "r.html").exists()
    assert not (out / "k").exists()
    # A negative poll is a usage error, not a traceback after the first catch-up.
    polls = _decks(
        ("follow", uri, "--out", str(out / "p"), "--poll", "-1"),
        ("merge", uri, "--follow", "--poll", "-1"),
        ("merge", uri, "--once", "--wait", "-5"),
    )
    # (--poll says its own range: a negative poll and 0 alike, a break-it finding)
    wants = ("must be seconds > 0 and <= 86400 (got -1)",) * 2 + (
        "must be a number of seconds >= 0",
    )
    for r, want in zip(polls, wants, strict=True):
        assert r.returncode == 2 and want in r.stderr, r
    # An empty URI or --out is said as such (a break-it finding: "--out X is inside the
    # checkpoint URI ", and a bare errno)
    empty = _decks(
        ("follow", "", "--out", str(out / "e"), "--once"),
        ("follow", uri, "--out", "", "--once"),
        ("export", uri, "--out", ""),
    )
    said = ("storage URI must be a non-empty string", "--out is empty", "--out is empty")
    for r, want in zip(empty, said, strict=True):
        assert r.returncode == 2 and want in r.stderr and "Traceback" not in r.stderr, r


def test_history_takes_the_torchrec_table_name(ckpt: Path) -> None:
    fqn = "sparse_arch.embedding_bag_collection.embedding_bags.t0.weight"
    short, full, ambiguous = _decks(
        ("history", str(ckpt), "--table", "t0", "--row", "3", "--json"),
        ("history", str(ckpt), "--table", fqn, "--row", "3", "--json"),
        ("history", str(ckpt), "--table", "weight", "--row", "3"),
    )
    assert short.returncode == 0 and full.returncode == 0, short.stderr + full.stderr
    assert json.loads(short.stdout) == json.loads(full.stdout)
    assert json.loads(short.stdout)["table"] == fqn
    # a name that fits several tables is refused, listing them
    assert ambiguous.returncode == 2 and "matches 2 tables" in ambiguous.stderr


def test_ls_and_verify_agree_on_sizes(ckpt: Path) -> None:
    from deck.cli.common import human

    ls, ver = _decks(("ls", str(ckpt), "--json"), ("verify", str(ckpt), "--all"))
    assert ls.returncode == 0 and ver.returncode == 0, ls.stderr + ver.stderr
    for row in json.loads(ls.stdout):
        label = f"step {row['step']}" if row["kind"] in ("full", "delta") else row["folder"]
        line = next(ln for ln in ver.stdout.splitlines() if label in ln)
        assert f", {human(row['bytes'])}: ok" in line, (row, line)


def test_merge_and_gc_say_what_they_do(ckpt: Path, tmp_path: Path) -> None:
    copy = tmp_path / "ck"
    shutil.copytree(ckpt, copy)
    m = _deck("merge", str(copy), "--once", "--stride", "2", "--full-every", "1")
    assert m.returncode == 0, m.stdout + m.stderr
    # the launch line (which worker, from where) once; the summary says who did what
    assert (m.stdout + m.stderr).count("worker 0 of 1 (from") == 1, m.stdout + m.stderr
    assert "committed by worker 0 of 1," in m.stdout, m.stdout
    full = next(p for p in (copy / "merged").iterdir() if p.name.startswith("F-"))
    before = sorted(p for p in copy.rglob("*") if p.is_file())
    # Everything is minutes old: the default grace period holds it all back, and says so.
    g = _deck("gc", str(copy), "--dry-run")
    assert g.returncode == 0 and "would delete 0 checkpoint(s)" in g.stdout, g.stdout + g.stderr
    held = re.search(
        r"held back by the grace period \(--grace 3600 s\): \d+ checkpoint\(s\), (\d+) orphan",
        g.stdout,
    )
    assert held and int(held.group(1)) > 0, g.stdout
    g = _deck("gc", str(copy), "--dry-run", "--grace", "0")
    assert g.returncode == 0, g.stdout + g.stderr
    # what goes from a merged full's folder is its stray files, not the checkpoint
    line = next(ln for ln in g.stdout.splitlines() if full.name in ln)
    assert "would delete" in line and "stray file(s) inside" in line, g.stdout
    assert "the checkpoint itself stays" in line, g.stdout
    assert sorted(p for p in copy.rglob("*") if p.is_file()) == before  # a dry run
    # ... and the real run deletes files but keeps the merged full restorable
    assert _deck("gc", str(copy), "--grace", "0").returncode == 0
    ls = json.loads(_deck("ls", str(copy), "--json").stdout)
    assert any(r["folder"].startswith(f"merged/{full.name}") for r in ls), ls


def test_a_damaged_commit_record_is_damage_not_absence(ckpt: Path, tmp_path: Path) -> None:
    """ls, export and show meet a step whose manifest.json is truncated (and a merger folder whose
    record is garbage): exit 1 (damage), one ``deck <command>:`` line naming the file; ls still
    lists the rest, and the damaged folders as state ``damaged``."""
    copy = tmp_path / "ck"
    shutil.copytree(ckpt, copy)
    record = copy / "step-000000000010" / "manifest.json"
    record.write_bytes(record.read_bytes()[:100])
    merged = next((copy / "merged").iterdir()) / "manifest.json"
    merged.write_text("garbage")
    uri, out = str(copy), tmp_path / "out"
    ls, ls_json, latest, at10, at5, show = _decks(
        ("ls", uri),
        ("ls", uri, "--json"),
        ("export", uri, "--out", str(out / "latest")),
        ("export", uri, "--step", "10", "--out", str(out / "10")),
        ("export", uri, "--step", "5", "--out", str(out / "5"), "--format", "safetensors"),
        ("show", uri, "10"),
    )
    for r in (ls, ls_json, latest, at10, show):
        assert r.returncode == 1, (r.args, r.returncode, r.stdout, r.stderr)
        # (the catalog holds the record as it was: that it no longer agrees is said once)
        err = [ln for ln in r.stderr.splitlines() if not ln.startswith("the catalog at ")]
        assert len(err) == 1 and err[0].startswith(f"deck {r.args[1]}: "), r.stderr
        assert str(record) in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert str(merged) in ls.stderr
    rows = json.loads(ls_json.stdout)
    bad = [(x["step"], x["folder"], x["state"]) for x in rows if x["state"] == "damaged"]
    assert bad == [
        (10, "step-000000000010", "damaged"),
        (10, str(merged.parent.relative_to(copy)), "damaged"),
    ]
    assert all(str(record) in x["problem"] for x in rows if x["folder"] == "step-000000000010")
    assert [x["step"] for x in rows if x["state"] == "committed"] == [0, 5]
    assert re.search(r"\s10\s.*damaged\s+\S+ step-000000000010", ls.stdout), ls.stdout
    assert "export it by number (`deck export --step 5`)" in latest.stderr
    assert not (out / "latest").exists() and not (out / "10").exists()
    assert at5.returncode == 0, at5.stderr


def _forge_a_table_shape(uri: Path, step: int, num_rows: int) -> Path:
    """Give the first shard record of step ``step``'s first rank manifest another table height
    (its shard still inside it), every checksum made to match: a record written by someone
    else. Returns the rank manifest's path."""
    from deck.format.checksum import checksum
    from deck.format.manifest import CheckpointManifest, dump_model

    storage = open_storage(str(uri))
    m = read_manifests(storage)[step]
    part = read_rank_manifests(storage, m)[0]
    shards = list(part.shards)
    shards[0] = shards[0].model_copy(update={"num_rows": num_rows})
    data = dump_model(part.model_copy(update={"shards": tuple(shards)}))
    ref = next(r for r in m.ranks if r.rank == part.rank)
    (uri / m.folder / ref.path).write_bytes(data)
    ranks = tuple(
        r.model_copy(update={"nbytes": len(data), "checksum": checksum(data)}) if r is ref else r
        for r in m.ranks
    )
    record = dump_model(CheckpointManifest.model_validate(m.model_copy(update={"ranks": ranks})))
    (uri / m.folder / "manifest.json").write_bytes(record)
    return uri / m.folder / ref.path


def test_a_table_shape_its_full_does_not_have_is_damage_to_verify_and_export(
    ckpt: Path, tmp_path: Path
) -> None:
    """A break-it finding: a rank manifest of a delta naming a table of another shape than its
    full's (every checksum made to match) passed `deck verify --all` (exit 0, so neither a
    quarantine nor a restore's fallback could go around it) while restore refused it as
    damaged, and export called it a usage error (exit 2) without naming the file. Now verify
    reports it and quarantines it, export exits 1 naming the file. A full whose records do not
    cover the shape they claim is itself the damaged one (its deltas are not blamed)."""
    delta, full = tmp_path / "delta", tmp_path / "full"
    shutil.copytree(ckpt, delta)
    shutil.copytree(ckpt, full)
    forged = _forge_a_table_shape(delta, 10, 10**15)
    _forge_a_table_shape(full, 0, SPEC.rows + 1)
    r, export, of_full = _decks(
        ("verify", str(delta), "--all"),
        (
            "export",
            str(delta),
            "--step",
            "10",
            "--out",
            str(tmp_path / "o"),
            "--format",
            "safetensors",
        ),
        ("verify", str(full), "--all"),
    )
    # After the export: a step whose chain is quarantined is one no valid chain reaches (exit 2).
    (quarantined,) = _decks(("verify", str(delta), "--step", "10", "--quarantine"))
    assert r.returncode == 1 and "1 with problems" in r.stdout, r.stdout + r.stderr
    assert re.search(
        rf"step 10: .*\n  BAD {re.escape(str(forged))} .*not one of the tables its chain restores",
        r.stdout,
    ), r.stdout
    assert export.returncode == 1 and str(forged) in export.stderr, export.stderr
    assert "not one of the tables its chain restores" in export.stderr, export.stderr
    assert quarantined.returncode == 1 and "quarantined: restores" in quarantined.stdout
    assert of_full.returncode == 1, of_full.stdout + of_full.stderr
    bad = re.findall(r"^(step \d+|\S+ merged/\S+): .*problem", of_full.stdout, re.M)
    assert bad == ["step 0"], of_full.stdout
    assert f"of its {SPEC.rows + 1} x" in of_full.stdout, of_full.stdout


def test_every_printing_command_ends_quietly_on_a_closed_pipe(ckpt: Path, tmp_path: Path) -> None:
    """Each command's reader goes away before it prints (`deck ... | head -1` once head has its
    line), with Python's usual buffered stdout (no PYTHONUNBUFFERED: the write then comes at
    exit, where a closed pipe used to print "Exception ignored ... BrokenPipeError" and exit
    120): exit 141, as a process killed by SIGPIPE, and nothing on stderr. A follower that is
    not --once ends too, instead of retrying its print at every poll."""
    import os

    copy = tmp_path / "ck"
    shutil.copytree(ckpt, copy)
    uri = str(ckpt)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    calls = [
        ("ls", uri, "--json"),
        ("ls", uri),
        ("ls", uri, "--tree"),
        ("show", uri, "10", "--json"),
        ("show", uri, "10"),
        ("lineage", uri),
        ("verify", uri, "--all"),
        ("history", uri, "--table", "t0", "--row", "3"),
        ("gc", str(copy), "--dry-run"),
        ("export", uri, "--out", str(tmp_path / "e"), "--format", "safetensors"),
        ("follow", uri, "--out", str(tmp_path / "f"), "--poll", "0.2"),
        ("--help",),
        ("ls", "--help"),
        ("--version",),
    ]
    procs = []
    for c in calls:
        p = subprocess.Popen(
            [EXE, *c], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        assert p.stdout is not None
        p.stdout.close()
        procs.append(p)
    for c, p in zip(calls, procs, strict=True):
        _, err = p.communicate(timeout=120)
        assert p.returncode == 141, (c, p.returncode, err)
        assert "Broken" not in err and "Traceback" not in err and "Exception" not in err, (c, err)
    # A reader that takes the first line and goes (head -1): 0 when deck had written it all
    # by then, 141 when not; never a traceback.
    for _ in range(3):
        p = subprocess.Popen(
            [EXE, "ls", uri, "--json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert p.stdout is not None and p.stderr is not None
        assert p.stdout.readline() == "[\n"
        p.stdout.close()
        err = p.stderr.read()
        assert p.wait(timeout=120) in (0, 141) and err == "", err


def test_ls_shows_the_recent_steps_and_the_fulls_by_default(tmp_path: Path) -> None:
    """A long history: ``deck ls`` shows the newest 20 steps' checkpoints and every full, and
    says how many it left out; ``--all``, ``--since`` and ``--last`` choose others, and
    ``--json`` stays complete unless narrowed."""
    from deck.testing.synth import SynthTrainer

    uri = tmp_path / "long"
    tr = SynthTrainer(open_storage(str(uri)))
    tr.save("full")
    for step in range(1, 31):
        tr.train()
        tr.save("full" if step % 10 == 0 else "delta")
    default, every, since, last, js, js_last, tree, tree_last = _decks(
        ("ls", str(uri)),
        ("ls", str(uri), "--all"),
        ("ls", str(uri), "--since", "25"),
        ("ls", str(uri), "--last", "3"),
        ("ls", str(uri), "--json"),
        ("ls", str(uri), "--json", "--last", "3"),
        ("ls", str(uri), "--tree"),
        ("ls", str(uri), "--tree", "--last", "3"),
    )
    # The tree of a narrowed view: what is shown, under the nearest shown checkpoint
    assert tree.returncode == 0 and tree_last.returncode == 0, tree.stderr + tree_last.stderr
    assert len(tree.stdout.splitlines()) == 22 + 1, tree.stdout  # rows and the line left out
    tree_steps = [
        re.search(r"(?:full|delta) (\d+)", line) for line in tree_last.stdout.splitlines()
    ]
    assert [int(m.group(1)) for m in tree_steps if m] == [28, 29, 30], tree_last.stdout

    def steps(r: subprocess.CompletedProcess[str]) -> list[int]:
        lines = r.stdout.splitlines()[1:]
        return [int(line.split()[1]) for line in lines if not line.startswith("(")]

    assert all(r.returncode == 0 for r in (default, every, since, last, js, js_last))
    assert steps(default) == [0, 10, *range(11, 31)], default.stdout
    assert "9 more checkpoint(s) not shown" in default.stdout
    assert steps(every) == list(range(31)) and "not shown" not in every.stdout
    assert steps(since) == list(range(25, 31))
    assert steps(last) == [28, 29, 30]
    assert [r["step"] for r in json.loads(js.stdout)] == list(range(31))
    assert [r["step"] for r in json.loads(js_last.stdout)] == [28, 29, 30]


def test_ls_says_which_steps_a_rollback_left_and_which_are_broken(tmp_path: Path) -> None:
    """After a rollback the old timeline's later steps are ``abandoned`` (no restore reaches
    them, by design); a step of the newest timeline whose chain lost a checkpoint is
    ``broken``: damage, exit 1."""
    from deck.testing.synth import SynthTrainer

    uri = tmp_path / "rb"
    tr = SynthTrainer(open_storage(str(uri)))
    tr.save("full")
    for _ in range(5):
        tr.train()
        tr.save()
    tr.rollback(2)
    for _ in range(2):  # steps 3 and 4 again: old 5 is left on the abandoned timeline
        tr.train()
        tr.save()
    r = _deck("ls", str(uri), "--json")
    assert r.returncode == 0, r.stderr
    states = {row["step"]: row["state"] for row in json.loads(r.stdout)}
    assert states == {
        0: "committed",
        1: "committed",
        2: "committed",
        3: "committed",
        4: "committed",
        5: "abandoned",
    }, states
    shutil.rmtree(uri / "step-000000000003")
    r = _deck("ls", str(uri), "--json")
    states = {row["step"]: row["state"] for row in json.loads(r.stdout)}
    assert states[4] == "broken" and states[5] == "abandoned", states
    assert r.returncode == 1 and "step(s) [4]" in r.stderr, r.stderr


def test_ls_names_the_lost_record_a_broken_step_needs(tmp_path: Path) -> None:
    """A break-it finding: the attempt whose commit record was lost was listed as ``pending``,
    like a save in progress, with nothing to say that the broken steps after it need its
    record back. Its row says so (in every view), and ``ls`` exits 1."""
    from deck.testing.synth import SynthTrainer

    uri = tmp_path / "lost"
    tr = SynthTrainer(open_storage(str(uri)))
    tr.save("full")
    for _ in range(4):
        tr.train()
        tr.save()
    newest = uri / "step-000000000004" / "manifest.json"
    kept = newest.read_bytes()
    newest.unlink()  # the newest step's: nothing builds on it, the commit log announced it
    for view in ([], ["--all"]):
        r = _deck("ls", str(uri), "--json", *view)
        assert r.returncode == 1, r.stderr
        row = {row["step"]: row for row in json.loads(r.stdout)}[4]
        assert row["state"] == "pending" and "commit log announced" in row["problem"], row
        assert "step-000000000004/manifest.json is lost" in r.stderr, r.stderr
    newest.write_bytes(kept)
    (uri / "step-000000000002" / "manifest.json").unlink()
    for view in ([], ["--all"]):
        r = _deck("ls", str(uri), "--json", *view)
        assert r.returncode == 1, r.stderr
        rows = {row["step"]: row for row in json.loads(r.stdout)}
        assert rows[2]["state"] == "pending", rows[2]
        assert "step-000000000002/manifest.json is lost" in rows[2]["problem"], rows[2]
        assert "step(s) [3] build on it" in rows[2]["problem"], rows[2]
        assert rows[3]["state"] == rows[4]["state"] == "broken", rows
        assert rows[1].get("problem") is None, rows[1]
    r = _deck("ls", str(uri))
    assert "manifest.json is lost" in r.stdout and "without its commit record" in r.stderr, r


def test_ls_notes_the_restorable_steps_of_a_timeline_a_rollback_left(tmp_path: Path) -> None:
    """A break-it finding: after a rollback, a full of the old timeline after the rollback's
    step (and the deltas on it) still restore as themselves and were listed as committed
    beside the newest timeline's steps, with nothing to say that `restore()` and `deck lineage`
    take the newest timeline's latest step. A note names them."""
    from deck.testing.synth import SynthTrainer

    uri = tmp_path / "rb"
    tr = SynthTrainer(open_storage(str(uri)))
    tr.save("full")
    for kind in ("delta", "delta", "delta", "delta", "full", "delta"):  # steps 1..6, full at 5
        tr.train()
        tr.save(kind)
    tr.rollback(2)
    tr.train()
    tr.save("full")  # step 3 of the new timeline
    r = _deck("ls", str(uri))
    assert r.returncode == 0, r.stderr
    assert "step(s) [5, 6] are of an older timeline that a rollback left" in r.stdout, r.stdout
    assert "the newest timeline (epoch 1) starts at step 3" in r.stdout, r.stdout
    h = _deck("history", str(uri), "--table", "t0", "--row", "0")
    assert h.returncode == 0, h.stderr
    marked = [ln.split()[1] for ln in h.stdout.splitlines() if "an older timeline" in ln]
    assert marked == ["5", "6"], h.stdout
    tr.train(3)
    tr.save()  # step 6 of the new timeline replaces the old one's; 5 stays
    r = _deck("ls", str(uri))
    assert "step(s) [5] are of an older timeline" in r.stdout, r.stdout
    # No rollback, no note
    plain = tmp_path / "plain"
    tr = SynthTrainer(open_storage(str(plain)))
    tr.save("full")
    tr.train()
    tr.save()
    assert "older timeline" not in _deck("ls", str(plain)).stdout


def test_ls_says_which_merger_checkpoints_a_rollback_left(tmp_path: Path) -> None:
    """A merger checkpoint of the old timeline is ``abandoned`` once no step's chain can use it
    (the rollback re-saved its step and every step that builds on it); before, two committed
    merger fulls of one step, of two timelines, were listed alike. One that an old step not
    saved again still builds on stays ``committed`` (it restores that step)."""
    from deck.merge.policy import FullPolicy, MergeConfig
    from deck.merge.worker import MergeWorker
    from deck.testing.synth import SynthTrainer

    uri = tmp_path / "rb"
    store = open_storage(str(uri))
    merge = MergeConfig(stride=2, full=FullPolicy(every=4, max_live_fraction=None))
    tr = SynthTrainer(store)
    tr.save("full")
    for _ in range(6):
        tr.train()
        tr.save()
    MergeWorker(store, merge).run_once(wait_s=0)

    def merged() -> dict[str, tuple[str, list[int], str]]:
        r = _deck("ls", str(uri), "--json")
        assert r.returncode == 0, r.stderr
        rows = json.loads(r.stdout)
        return {
            row["id"]: (row["kind"], row["covers"], row["state"]) for row in rows if row["merged"]
        }

    def full_of_4(rows: dict[str, tuple[str, list[int], str]]) -> bool:
        return any(k == "full" and c[1] == 4 for k, c, _ in rows.values())

    old = merged()
    assert full_of_4(old), old
    assert {s for _, _, s in old.values()} == {"committed"}, old
    tr.rollback(2)
    tr.train()
    tr.save()  # step 3 again: old 4 builds on old 3, old 5 on old 4: all still restorable
    assert merged() == old
    for _ in range(4):  # steps 4..7: no old step builds on what the merger made after step 2
        tr.train()
        tr.save()
    MergeWorker(store, merge).run_once(wait_s=0)
    now = merged()
    for i, (_, covers, _) in old.items():
        want = "abandoned" if covers[1] >= 3 else "committed"
        assert now[i][2] == want, (i, covers, now)
    new = {i: v for i, v in now.items() if i not in old}
    assert full_of_4(new), now  # the new timeline's full of step 4, beside the old one
    assert {s for _, _, s in new.values()} == {"committed"}, now


def test_ctrl_c_is_one_line_and_exit_130(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A break-it finding: Ctrl-C in gc, export or follow --once printed a traceback."""
    import deck.cli.maintain

    def interrupted(_a: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(deck.cli.maintain, "cmd_gc", interrupted)
    assert main(["gc", str(ckpt), "--dry-run"]) == 130
    assert capsys.readouterr().err == "deck gc: interrupted\n"


def test_follow_kafka_with_a_state_uri_that_is_not_there_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An operator's break-it run: `deck follow kafka://... --state-uri <typo>` exited 0 with
    "nothing to serve yet" and a WARNING per marker. A state URI that does not exist is an
    error naming it (exit 2), before any broker is asked."""
    missing = tmp_path / "does-not-exist"
    argv = ["follow", "kafka://127.0.0.1:9/t", "--out", str(tmp_path / "out"), "--once"]
    assert main([*argv, "--state-uri", str(missing)]) == 2
    assert str(missing) in capsys.readouterr().err


def test_verify_stops_once_the_store_stops_answering(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A break-it finding: during an outage `deck verify --all` spent every checkpoint's retries
    (~11 s each on S3), days for a long job's history, to report each one unreadable. Once a
    checkpoint's files cannot be read and the store does not answer for its commit record
    either, it stops: exit 2, naming where, nothing quarantined. A file that cannot be read
    while the store answers is still a finding of that checkpoint, and the run goes on."""
    from deck.cli import inspect
    from deck.errors import StorageError
    from deck.testing.faulty_storage import FaultyStorage

    down = {"at": None}

    class Store(FaultyStorage):
        def exists(self, path: str) -> bool:
            if down["at"] == "everything":
                raise StorageError(f"injected: {self.describe(path)} cannot be reached")
            return super().exists(path)

    def data_files(key: str, n: int) -> bool:  # every rank manifest / chunk of a checkpoint
        files = key.startswith(("step-", "merged/")) and not key.endswith("manifest.json")
        return down["at"] is not None and files

    store = Store(open_storage(str(ckpt)), fail_get=data_files)
    monkeypatch.setattr(inspect, "open_existing", lambda uri, options: store)
    total = len(read_manifests(open_storage(str(ckpt))).values())

    down["at"] = "files"  # the store answers: every checkpoint is reported, kept
    assert main(["verify", str(ckpt), "--all", "--quarantine"]) == 1
    out = capsys.readouterr().out
    assert out.count("a read error is not damage") >= total - 1, out
    down["at"] = "everything"
    assert main(["verify", str(ckpt), "--all", "--quarantine"]) == 2
    out, err = capsys.readouterr()
    assert out.count("a read error is not damage") == 1, out
    assert f"{ckpt} stopped answering at " in err and "checkpoints checked" in err, err
    assert "quarantined: " not in out and not (ckpt / "quarantine").exists()
