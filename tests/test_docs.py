"""Every code sample in README.md and docs/*.md runs, and the generated docs are current.

Conventions for fenced blocks (the info string after the opening backticks; GitHub renders by
its first word and ignores the rest):

- ```python                 a complete script. Run with this venv's python in a temp directory
                            shared by the blocks of one document (in document order, so a block
                            can read what an earlier one wrote); must exit 0. Use ``assert`` to
                            check results.
- ```python fixture=NAME    a fragment using names the reader supplies (a model, an optimizer, a
                            train function). ``FIXTURES[NAME]`` (below) runs first in the same
                            process and its teardown after; see it for the names it defines.
- ```python file=NAME       a script saved as NAME in the temp directory and not run by itself:
                            a later ``run`` shell block of the same document must invoke it.
- ```python notest          shown, never run. Say why in the text. (Nothing uses it today.)
- ```bash / console / sh / shell
                            every line invoking ``deck`` (after an optional ``$ ``) is checked
                            against the real CLI: the sub-command exists and every ``--flag`` is
                            in its ``--help``. Other lines (``make demo``) are not run.
- ``` (no language)          a ``deck ...`` synopsis line (and its indented ``[--flag ...]``
                            continuation lines; text after 3+ spaces is description) is checked
                            the same way: the sub-command exists, every ``--flag`` is real.
- ```bash run               additionally runs every line for real, in order, in the document's
                            temp directory, each must exit 0: ``deck ...`` through
                            ``deck.cli.main`` in this process, anything else (``python``,
                            ``torchrun``) by bash with this venv first on PATH; ``#`` comments
                            and blank lines skipped.
- anything else (```json, plain ```, ```mermaid): not code, not run.

docs/configuration.md is generated (``python -m deck.docgen``); a test compares it with the
generator's output.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from deck import cli, docgen

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELLS = {"bash", "console", "sh", "shell"}
BIN = Path(sys.executable).parent

# Names a ``fixture=dlrm`` fragment may use: a one-process gloo world with a small TorchRec DLRM.
FIXTURES: dict[str, tuple[str, str]] = {
    "dlrm": (
        """
import os
import torch
import torch.distributed as dist
from deck.demo import ModelSpec, TrainState, build_model, train_step
from deck.processes import init_process_group, rendezvous

os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
init_process_group(0, 1, rendezvous())
_spec = ModelSpec(num_tables=2, rows=1000, dim=8, batch=64)
model, dense_optimizer = build_model(_spec)  # a DistributedModelParallel and its dense optimizer
train_state = TrainState()                   # state_dict()/load_state_dict()
num_steps = 200
batches = iter(range(1, 10**9))              # next(batches) is the step's batch seed


def train_one_step(model, dense_optimizer, batch):
    return train_step(model, dense_optimizer, _spec, batch)


def evaluate(model):
    from deck.demo import make_batch
    model.eval()
    with torch.no_grad():
        dense, kjt, _ = make_batch(_spec, 0, 0)
        model(dense, kjt)
    model.train()
""",
        "\ndist.destroy_process_group()\n",
    ),
    # The same world, the model not yet wrapped: for the wrapper (DeckDistributedModelParallel).
    "dlrm_module": (
        """
import os
import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.models.dlrm import DLRM
from torchrec.optim.keyed import KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from deck.demo import ModelSpec, TrainState, make_batch, train_step
from deck.processes import init_process_group, rendezvous

os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
init_process_group(0, 1, rendezvous())
_spec = ModelSpec(num_tables=2, rows=1000, dim=8, batch=64)
module = DLRM(
    embedding_bag_collection=EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=1000, feature_names=[f"f{i}"])
            for i in range(2)
        ],
        device=torch.device("meta"),
    ),
    dense_in_features=13,
    dense_arch_layer_sizes=[32, 8],
    over_arch_layer_sizes=[32, 1],
    dense_device=torch.device("cpu"),
)
sharders = [EmbeddingBagCollectionSharder(
    fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}
)]
train_state = TrainState()
num_steps = 200
batches = iter(range(1, 10**9))


def make_dense_optimizer(model):
    params = dict(in_backward_optimizer_filter(model.named_parameters()))
    return KeyedOptimizerWrapper(params, lambda p: torch.optim.Adagrad(p, lr=0.02))


def train_one_step(model, dense_optimizer, batch):
    return train_step(model, dense_optimizer, _spec, batch)


def evaluate(model):
    model.eval()
    with torch.no_grad():
        dense, kjt, _ = make_batch(_spec, 0, 0)
        model(dense, kjt)
    model.train()
""",
        "\ndist.destroy_process_group()\n",
    ),
}


@dataclass
class Block:
    doc: Path
    line: int  # 1-based line of the opening fence
    lang: str
    options: list[str]
    code: str

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"

    def option(self, key: str) -> str | None:
        for o in self.options:
            if o.startswith(key + "="):
                return o.split("=", 1)[1]
        return None


def blocks(doc: Path) -> list[Block]:
    """Fenced code blocks of ``doc`` in order (``` and ~~~ fences; nested fences not supported)."""
    out: list[Block] = []
    lines = doc.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^(\s*)(```+|~~~+)\s*(.*)$", lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = m.groups()
        start, body = i, []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        words = info.split()
        out.append(Block(doc, start + 1, words[0] if words else "", words[1:], "\n".join(body)))
        i += 1
    return out


def shell_commands(code: str) -> list[str]:
    """Command lines of a shell block: ``$ `` prompts and comments stripped, ``\\`` joined."""
    out, cur = [], ""
    for raw in code.splitlines():
        line = raw.strip()
        if line.startswith("$ "):
            line = line[2:]
        if line.endswith("\\"):
            cur += line[:-1].rstrip() + " "
            continue
        line = cur + line
        cur = ""
        if line and not line.startswith("#"):
            out.append(line)
    return out


_HELP: dict[str, str] = {}


def _help(sub: str | None) -> str | None:
    """``deck [sub] --help`` text (None if ``sub`` is not a sub-command)."""
    key = sub or ""
    if key not in _HELP:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
            try:
                cli.main([*([sub] if sub else []), "--help"])
            except SystemExit as e:
                if e.code != 0:
                    return None
        _HELP[key] = buf.getvalue()
    return _HELP[key]


def check_deck_command(line: str, where: str) -> None:
    words = shlex.split(line, comments=True)
    if not words or words[0] != "deck":
        return
    # Options before the sub-command are deck's own (`deck --storage-options JSON ls URI`).
    top = _help(None) or ""
    i = 1
    while i < len(words) and words[i].startswith("-"):
        flag = words[i].split("=", 1)[0]
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", top), (
            f"{where}: `{line}`: deck has no option {flag} (see `deck --help`)"
        )
        takes_value = re.search(rf"{re.escape(flag)} [A-Z]", top) and "=" not in words[i]
        i += 2 if takes_value else 1
    sub = words[i] if i < len(words) else None
    text = _help(sub)
    assert text is not None, f"{where}: `{line}`: `deck {sub}` is not a deck sub-command"
    for w in words[i + 1 :]:
        if w.startswith("--"):
            flag = w.split("=", 1)[0]
            assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text), (
                f"{where}: `{line}`: `deck {sub}` has no option {flag} (see `deck {sub} --help`)"
            )


def synopsis_lines(code: str) -> list[str]:
    """``deck ...`` synopsis lines of an untyped block, continuations joined, descriptions cut."""
    out: list[str] = []
    for raw in code.splitlines():
        cmd = re.split(r"\s{3,}", raw.strip(), maxsplit=1)[0]
        if cmd.startswith("deck "):
            out.append(cmd)
        elif out and raw[:1].isspace() and cmd.startswith(("[", "--")):
            out[-1] += " " + cmd
    return out


def check_synopsis(line: str, where: str) -> None:
    sub = line.split()[1]
    text = _help(sub)
    assert text is not None, f"{where}: `{line}`: `deck {sub}` is not a deck sub-command"
    for flag in re.findall(r"(?<![\w-])--[a-z][\w-]*", line):
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text), (
            f"{where}: `{line}`: `deck {sub}` has no option {flag} (see `deck {sub} --help`)"
        )


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONWARNINGS"] = "ignore"
    return env


def _run(args: list[str] | str, cwd: Path, where: str, shell: bool = False) -> None:
    r = subprocess.run(
        args,
        cwd=cwd,
        env=_env(),
        shell=shell,
        executable="/bin/bash" if shell else None,
        capture_output=True,
        text=True,
        timeout=300,
    )
    errors = [ln for ln in r.stderr.splitlines() if re.search(r"\w+(Error|Exception):", ln)]
    assert r.returncode == 0, (
        f"{where}: exit {r.returncode}\n--- errors\n" + "\n".join(errors[:10]) + "\n--- stdout\n"
        f"{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-6000:]}"
    )


def _run_deck(args: list[str], cwd: Path, where: str) -> None:
    # In-process: the console script itself is tested by test_cli.py, and each interpreter
    # start would cost seconds here.
    out, err = io.StringIO(), io.StringIO()
    old = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = cli.main(args)
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else 1
    finally:
        os.chdir(old)
    assert rc == 0, (
        f"{where}: exit {rc}\n--- stdout\n{out.getvalue()}\n--- stderr\n{err.getvalue()}"
    )


def run_doc(doc: Path, tmp: Path) -> int:
    """Run every runnable block of ``doc`` in order in ``tmp``; returns how many ran."""
    saved: dict[str, str] = {}
    invoked: set[str] = set()
    ran = 0
    for n, b in enumerate(blocks(doc)):
        if b.lang == "python" and "notest" not in b.options:
            name = b.option("file")
            if name:
                (tmp / name).write_text(b.code + "\n")
                saved[name] = b.where
                continue
            code = b.code
            fixture = b.option("fixture")
            if fixture:
                assert fixture in FIXTURES, f"{b.where}: unknown fixture {fixture!r}"
                setup, teardown = FIXTURES[fixture]
                code = setup + "\n" + code + "\n" + teardown
            script = tmp / f"_block{n:03d}.py"
            script.write_text(code + "\n")
            _run([sys.executable, str(script)], tmp, b.where)
            ran += 1
        elif b.lang in SHELLS and "run" in b.options:
            for line in shell_commands(b.code):
                words = shlex.split(line, comments=True)
                # `deck doctor FILE.py:function` invokes FILE.py too
                invoked.update(w.split(":")[0] for w in words if w.split(":")[0] in saved)
                if words[0] == "deck":
                    _run_deck(words[1:], tmp, f"{b.where}: `{line}`")
                else:
                    _run(line, tmp, f"{b.where}: `{line}`", shell=True)
                ran += 1
    never = {name: where for name, where in saved.items() if name not in invoked}
    assert not never, f"python file=... blocks no `run` block invokes: {never}"
    return ran


def test_fence_parser_finds_the_samples() -> None:
    """Guards the harness itself: a parser that finds nothing would pass every doc."""
    qs = blocks(ROOT / "docs" / "quickstart.md")
    assert [b.lang for b in qs if b.lang == "python"] and any("run" in b.options for b in qs)
    assert shell_commands("$ deck ls x \\\n  --json  # c\n# only a comment\n") == [
        "deck ls x --json  # c"
    ]
    with pytest.raises(AssertionError, match="no option --nope"):
        check_deck_command("deck ls URI --nope", "here")
    with pytest.raises(AssertionError, match="not a deck sub-command"):
        check_deck_command("deck frobnicate URI", "here")
    assert synopsis_lines(
        "deck merge URI [--once]   merges\n    [--stride S]   more --words\nother"
    ) == ["deck merge URI [--once] [--stride S]"]
    with pytest.raises(AssertionError, match="no option --nope"):
        check_synopsis("deck gc URI [--nope]", "here")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_deck_commands_in_docs_exist(doc: Path) -> None:
    """Every `deck ...` line in a shell block names a real sub-command and real options."""
    for b in blocks(doc):
        if b.lang in SHELLS:
            for line in shell_commands(b.code):
                check_deck_command(line, b.where)
        elif b.lang == "":
            for line in synopsis_lines(b.code):
                check_synopsis(line, b.where)


@pytest.mark.slow
@pytest.mark.parametrize(
    "doc",
    [d for d in DOCS if any(b.lang == "python" or "run" in b.options for b in blocks(d))],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_doc_samples_run(doc: Path, tmp_path: Path) -> None:
    """Every python block and every `run` shell block of the document runs and exits 0."""
    assert run_doc(doc, tmp_path) > 0


def test_configuration_reference_is_current() -> None:
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == docgen.render(), (
        f"docs/configuration.md is out of date with the config models: run "
        f"`{docgen.REGENERATE}` and commit the result"
    )


def test_every_config_field_is_documented() -> None:
    assert docgen.undocumented() == [], (
        "add Field(description=...) / field(metadata={'description': ...}) to these fields"
    )


# ---- every `deck ...` line parses, every `deck.name` exists -----------------------------------

_SHELL_OPERATORS = {"|", "||", "&&", ";", "&", ">", ">>", "2>&1", "<"}


def parse_deck_args(words: list[str], where: str) -> None:
    """Parse ``deck`` argument list ``words`` (after ``deck``) with the real parser; an
    argparse refusal (unknown option, missing argument, a value of the wrong type) fails."""
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            cli.build_parser().parse_args(words)
        except SystemExit as e:
            assert e.code == 0, (
                f"{where}: `deck {shlex.join(words)}` does not parse: {err.getvalue()}"
            )


def command_words(line: str) -> list[str] | None:
    """The arguments after ``deck`` of a shell line invoking it (an environment assignment
    before it allowed; the line cut at the first shell operator), or None."""
    words = shlex.split(line, comments=True)
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        words = words[1:]
    if not words or words[0] != "deck":
        return None
    cut = next((i for i, w in enumerate(words) if w in _SHELL_OPERATORS), len(words))
    return words[1:cut]


def synopsis_words(line: str) -> list[str]:
    """A synopsis line (``deck ls URI [--json] [--step N | --all]``) as one concrete argument
    list: brackets dropped, the first of ``a|b`` alternatives taken, and the value
    placeholders of options (N, S, DIR, JSON, i, ...) given a value of their type."""
    words = line.replace("[", " ").replace("]", " ").split()[1:]
    out: list[str] = []
    skip = False
    for i, w in enumerate(words):
        if skip:  # the option of a later `| --alternative` and its value
            skip = not w.startswith("--") or False
            if w.startswith("--"):
                skip = i + 1 < len(words) and not words[i + 1].startswith(("--", "|"))
            continue
        if w == "|":
            skip = True
            continue
        if w == "...":
            continue
        w = w.split("|")[0]
        if out and out[-1].startswith("--") and re.fullmatch(r"[A-Z][A-Z_]*|[a-z]", w):
            w = "{}" if w == "JSON" else "1"
        out.append(w)
    return out


def inline_deck_spans(doc: Path) -> list[tuple[str, str]]:
    """``deck ...`` command lines quoted in the prose of ``doc`` (single-backtick spans), with
    their place."""
    out = []
    in_block = False
    for n, line in enumerate(doc.read_text().splitlines(), 1):
        if re.match(r"^\s*(```|~~~)", line):
            in_block = not in_block
            continue
        if in_block:
            continue
        for span in re.findall(r"(?<!`)`(deck [^`]+)`(?!`)", line):
            out.append((span, f"{doc.relative_to(ROOT)}:{n}"))
    return out


def test_synopsis_words() -> None:
    assert synopsis_words("deck verify URI [--step N | --all] [--quarantine]") == [
        "verify",
        "URI",
        "--step",
        "1",
        "--quarantine",
    ]
    assert synopsis_words("deck export URI --out DIR [--format dcp|safetensors|parquet]") == [
        "export",
        "URI",
        "--out",
        "1",
        "--format",
        "dcp",
    ]
    with pytest.raises(AssertionError, match="does not parse"):
        parse_deck_args(synopsis_words("deck ls URI --step N"), "here")
    assert command_words("DECK_X=1 deck ls URI --json | head -1") == ["ls", "URI", "--json"]
    # the API-name check finds names, resolves fields, and refuses what is not there
    assert any(n == "deck.DeckConfig" for n, _ in api_names(ROOT / "README.md"))
    assert _resolve("deck.DeckConfig") and _resolve("deck.StagingConfig.chunk_bytes")
    assert _resolve("deck.merge.worker.MergeWorker") and not _resolve("deck.NoSuchName")
    assert not _resolve("deck.DeckConfig.no_such_field")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_deck_lines_in_docs_parse(doc: Path) -> None:
    """Every `deck ...` line of a shell block, and every synopsis line, is accepted by the real
    argument parser (not only its flags: arguments, values and their types too); every `deck
    ...` quoted in the prose names a real sub-command and real options."""
    for b in blocks(doc):
        if b.lang in SHELLS:
            for line in shell_commands(b.code):
                words = command_words(line)
                if words is not None:
                    parse_deck_args(words, b.where)
        elif b.lang == "":
            for line in synopsis_lines(b.code):
                parse_deck_args(synopsis_words(line), b.where)
    for span, where in inline_deck_spans(doc):
        if re.match(r"deck [a-z]+\b", span) and "<" not in span and "..." not in span:
            check_deck_command(span.replace("[", " ").replace("]", " "), where)


def _resolve(dotted: str) -> bool:
    """Whether ``deck.a.b.c`` names something: a module, an attribute, or a field of a
    pydantic model / dataclass."""
    import dataclasses
    import importlib

    parts = dotted.split(".")
    obj: object = None
    for i in range(len(parts), 0, -1):  # the longest importable module prefix
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        rest = parts[i:]
        break
    else:
        return False
    for name in rest:
        fields = getattr(obj, "model_fields", None) or (
            {f.name: f for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else {}
        )
        if not hasattr(obj, name):
            return name in fields  # a field; what it holds is not checked further
        obj = getattr(obj, name)
    return True


# ``deck.``-prefixed names that are not Python names: Parquet and safetensors metadata keys
# (docs/operations.md, docs/format.md).
NOT_API = {"deck.dtype", "deck.tensor", "deck.state", "deck.data_xxh3"}


def api_names(doc: Path) -> list[tuple[str, str]]:
    """Every ``deck.name(.name)*`` a document mentions (prose and code), with its place; file
    paths (``deck/...``, ``*.py``) excluded."""
    out = []
    for n, line in enumerate(doc.read_text().splitlines(), 1):
        for m in re.finditer(r"(?<![\w/.-])deck(?:\.[A-Za-z_]\w*)+", line):
            name = m.group(0)
            if line[m.end() : m.end() + 1] == "/" or name.endswith((".py", ".md")):
                continue
            if name in NOT_API:
                continue
            out.append((name, f"{doc.relative_to(ROOT)}:{n}"))
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_api_names_in_docs_exist(doc: Path) -> None:
    missing = [(name, where) for name, where in api_names(doc) if not _resolve(name)]
    assert not missing, f"names the docs mention that deck does not have: {missing}"


def test_readme_exit_codes_are_the_cli_table() -> None:
    """The README's exit-code table says what deck.cli's docstring (the one table every command
    applies) says."""
    doc = cli.__doc__ or ""
    table = doc[doc.index("Exit codes") : doc.index("Results go to stdout")]
    want = {
        int(code): " ".join(text.split())
        for code, text in re.findall(
            r"^\s+(0|1|2|130)  (.*?)(?=^\s+(?:0|1|2|130)  |\Z)", table, re.S | re.M
        )
    }
    readme = (ROOT / "README.md").read_text()
    rows = re.findall(r"^\| (0|1|2|130) \| (.*) \|$", readme, re.M)
    got = {int(c): t.strip() for c, t in rows}
    assert set(want) == {0, 1, 2, 130} and got == want, (got, want)


def test_readme_command_summary_lists_every_option() -> None:
    """Every option of every sub-command appears in the README's command summary."""
    import argparse

    readme = (ROOT / "README.md").read_text()
    summary = readme[readme.index("## Command line") : readme.index("## Guarantees")]
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = [
        f"deck {name} {flag}"
        for name, p in sub.choices.items()
        for a in p._actions
        for flag in a.option_strings
        if flag.startswith("--")
        and flag != "--help"
        and not re.search(rf"deck {name} [^\n]*(\n    [^\n]*)*{re.escape(flag)}(?![\w-])", summary)
    ]
    assert not missing, f"README's command summary omits: {missing}"


def test_failpoint_count_in_docs() -> None:
    """docs/reliability.md's number of failpoints is the number the code names."""
    names = {
        m
        for f in (ROOT / "deck").rglob("*.py")
        for m in re.findall(r"failpoint\(\s*\"([^\"]+)\"", f.read_text())
    }
    text = (ROOT / "docs" / "reliability.md").read_text()
    assert f"deck names {len(names)} failpoints" in text, len(names)
    assert f"its {len(names)} failpoints" in (ROOT / "README.md").read_text()


# ---- links, anchors and benchmark commands ------------------------------------------------------

BENCH = ROOT / "benchmarks"


def _prose(doc: Path) -> str:
    """``doc`` without its fenced code blocks (their lines blanked, so line numbers hold)."""
    out, fence = [], None
    for line in doc.read_text().splitlines():
        m = re.match(r"^\s*(```+|~~~+)", line)
        if m and (fence is None or m.group(1).startswith(fence)):
            fence = None if fence else m.group(1)
            out.append("")
            continue
        out.append("" if fence else line)
    return "\n".join(out)


def anchors(doc: Path) -> set[str]:
    """The anchors GitHub makes of ``doc``'s headings (lower case, punctuation dropped, spaces
    to hyphens; a repeated heading gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(doc).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def local_links(doc: Path) -> list[tuple[str, str]]:
    """Every relative Markdown link target of ``doc``'s prose (``path``, ``path#anchor`` or
    ``#anchor``), with its place."""
    out = []
    for n, line in enumerate(_prose(doc).splitlines(), 1):
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            if not re.match(r"[a-z]+:", target):
                out.append((target, f"{doc.relative_to(ROOT)}:{n}"))
    return out


def test_anchors_follow_github() -> None:
    assert "limits-in-detail" in anchors(ROOT / "docs" / "benchmarks.md")
    assert {"command-line", "limits-today"} <= anchors(ROOT / "README.md")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_local_links_resolve(doc: Path) -> None:
    """Every relative link names a file that exists, and its #anchor a heading there."""
    bad = []
    for target, where in local_links(doc):
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            bad.append(f"{where}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{where}: {target} (no such heading in {dest.name})")
    assert not bad, "\n".join(bad)


def _bench_script(name: str) -> Path | None:
    """The benchmark a document names: ``benchmarks/...`` as written, a bare ``bench_x.py``
    wherever it lies under benchmarks/."""
    if name.startswith("benchmarks/"):
        path = ROOT / name
        return path if path.is_file() else None
    found = sorted(BENCH.rglob(name))
    return found[0] if found else None


def _bench_options(script: Path) -> str:
    """The script's text and that of the benchmarks/ modules it imports (shared options)."""
    text = script.read_text()
    for mod in re.findall(r"^\s*from (\w+) import", text, re.M):
        if (BENCH / f"{mod}.py").is_file():
            text += (BENCH / f"{mod}.py").read_text()
    return text


_SCRIPT = r"(?<![\w/.-])(benchmarks/[\w/]+\.(?:py|c)|bench_\w+\.py|_workload\.py|gil_holds\.c)"


def bench_mentions(doc: Path) -> list[tuple[str, str, str]]:
    """(script, the rest of its command, place) for each benchmark a document names: in a code
    span (the rest: the span's, over line breaks), or a ``benchmarks/...`` path elsewhere, code
    blocks included (the rest: the line's)."""
    text = doc.read_text()
    prose = _prose(doc)
    out = []

    def place(line: int) -> str:
        return f"{doc.relative_to(ROOT)}:{line}"

    for span in re.finditer(r"`([^`]+)`", prose):
        for m in re.finditer(_SCRIPT + r"([^`]*)", span.group(1)):
            out.append((m.group(1), m.group(2), place(prose.count("\n", 0, span.start()) + 1)))
    # outside the spans: the prose with its spans blanked, and the code blocks' lines
    outside = re.sub(r"`[^`]+`", lambda m: re.sub(r"[^\n]", " ", m.group(0)), prose)
    lines = [
        o if o.strip() or not t.strip() else t
        for o, t in zip(outside.splitlines(), text.splitlines(), strict=False)
    ]
    for n, line in enumerate(lines, 1):
        for m in re.finditer(r"(?<![\w/.-])(benchmarks/[\w/]+\.(?:py|c))(.*)", line):
            out.append((m.group(1), m.group(2), place(n)))
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_benchmark_commands_in_docs_exist(doc: Path) -> None:
    """Every benchmark a document names exists where it says; on the current pages (all but the
    lab notebook, whose commands are as they were run) every ``--option`` after it is one the
    script (or a benchmarks/ module it imports) defines."""
    bad = []
    for name, rest, where in bench_mentions(doc):
        script = _bench_script(name)
        if script is None:
            bad.append(f"{where}: {name} does not exist")
        elif script.suffix == ".py" and doc.name != "benchmarks-history.md":
            options = _bench_options(script)
            for flag in re.findall(r"(?<![\w-])--[a-z][\w-]*", rest.split(";")[0]):
                if f'"{flag}"' not in options:
                    bad.append(f"{where}: {name} has no option {flag}")
    assert not bad, "\n".join(bad)
