"""Helpers every ``deck`` subcommand shares: sizes, ages, progress bars, JSON options."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from deck.format.manifest import MAX_STEP
from deck.units import human_bytes

if TYPE_CHECKING:
    from deck.storage import Storage


def human(n: float) -> str:
    """``n`` bytes as B / KiB / MiB / GiB / TiB with one decimal: :func:`deck.units.human_bytes`,
    what the log lines use too."""
    return human_bytes(n)


def age_text(seconds: float | None) -> str:
    """A duration as its largest whole unit (``42s``, ``3m``, ``5h``, ``2d``); ``?`` if unknown."""
    if seconds is None:
        return "?"
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= n:
            return f"{seconds / n:.0f}{unit}"
    return f"{max(0.0, seconds):.0f}s"


def progress_bar(
    desc: str, total: int | None = None, unit: str = "B", unit_scale: bool = True
) -> Any:
    """A tqdm progress bar on stderr when it is a terminal, else None (quiet for scripts)."""
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(desc=desc, total=total, unit=unit, unit_scale=unit_scale, leave=False)


def seconds(text: str) -> float:
    """An argparse type: a finite number of seconds, not negative."""
    return _finite_at_least_0(text, "a number of seconds")


def budget(text: str) -> float:
    """An argparse type: a finite number, not negative (0: off)."""
    return _finite_at_least_0(text, "a number", " (0: off)")


def _finite_at_least_0(text: str, what: str, note: str = "") -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be {what} >= 0{note} (got {text})")
    return value


def check_out(out: str, uri: str) -> None:
    """Refuse an ``--out`` that is not a local path (a URI: it would become a folder named
    ``s3:``) or that lies inside the checkpoint folder ``uri`` (deck would write into the
    store it reads, where GC takes the files for strays)."""
    from deck import schemes
    from deck.errors import ConfigError

    if not uri:  # (the store's own words, as every command without --out says them)
        raise ConfigError(f"storage URI must be a non-empty string, got {uri!r}")
    if not out:
        raise ConfigError("--out is empty: name the local folder to write")
    if schemes.path_of(out) != out:  # (a scheme: file:// too, which would be a folder "file:")
        raise ConfigError(
            f"--out {out}: a local path is needed (written with local file calls, not to an "
            "object store); write to a local folder and copy it there"
        )
    if not schemes.is_local(uri):
        return
    root = os.path.realpath(os.path.expanduser(schemes.path_of(uri)))
    target = os.path.realpath(out)
    if target == root or target.startswith(root + os.sep):
        raise ConfigError(
            f"--out {out} is inside the checkpoint URI {uri}: choose a folder outside it "
            "(deck writes only its own files there)"
        )


def say_damaged(command: str, uri: str, damaged: dict[int, str], what: str) -> bool:
    """One stderr line after the output when commit records a command depends on cannot be
    read (``damaged``: step -> problem), saying ``what`` that means; returns whether it said
    one (the command then exits 1: damage on what it reads)."""
    if not damaged:
        return False
    sys.stdout.flush()
    print(
        f"deck {command}: the commit record(s) of step(s) {sorted(damaged)} cannot be read "
        f"({next(iter(damaged.values()))}); {what} (`deck verify {uri} --all`)",
        file=sys.stderr,
    )
    return True


def at_least(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an int >= ``low`` (and <= ``high``)."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if n < low:
            raise argparse.ArgumentTypeError(f"must be >= {low} (got {n})")
        if high is not None and n > high:
            raise argparse.ArgumentTypeError(f"must be <= {high} (got {n})")
        return n

    return parse


# An argparse type: a training step (numbered from 0; a step folder's name holds 12 digits)
step_number = at_least(0, MAX_STEP)


def poll_seconds(text: str) -> float:
    """An argparse type: seconds between polls, more than 0 (0 would poll the store in a
    tight loop) and at most a day."""
    try:
        value = seconds(text)
    except argparse.ArgumentTypeError:
        value = float("nan")  # (one message for every value out of range: this one's)
    if not 0 < value <= 86400:
        raise argparse.ArgumentTypeError(f"must be seconds > 0 and <= 86400 (got {text})")
    return value


def json_options(text: str | None) -> dict[str, Any] | None:
    """Parse ``--storage-options`` JSON into a dict (None for no text); a usage error names what is wrong."""
    if not text:
        return None
    # argparse passes the default through this too: say where a bad value came from
    source = (
        "$DECK_STORAGE_OPTIONS"
        if text == os.environ.get("DECK_STORAGE_OPTIONS")
        else "--storage-options"
    )
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{source} is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{source} must be a JSON object")
    return value


def open_existing(uri: str, storage_options: dict[str, Any] | None) -> Storage:
    """The storage at ``uri``, which must exist: a local directory, or a remote prefix with at
    least one object. Raises :class:`deck.errors.NotFoundError` saying the URI does not exist
    (exit 2), so a typo is not reported like an empty run ("no checkpoints")."""
    from deck.errors import NotFoundError
    from deck.read.catalog import missing_uri
    from deck.storage import open_storage

    storage = open_storage(uri, storage_options)
    why = missing_uri(storage, uri, "--storage-options")
    if why is not None:
        raise NotFoundError(why)
    return storage


@contextlib.contextmanager
def flags_of(title: str, *models: Any) -> Iterator[None]:
    """Build configuration ``models`` from flags: a :class:`deck.ConfigError` inside names the
    flag the user gave (``--chunk-bytes: must be ...``), not the model's field, taken from each
    field's ``json_schema_extra["cli"]`` (what docs/configuration.md lists); ``title`` names a
    rule across fields."""
    from deck.config import describe_errors
    from deck.errors import ConfigError

    try:
        yield
    except ConfigError as e:
        if not e.errors():
            raise
        flags: dict[str, str] = {}
        for model in models:
            for name, field in model.model_fields.items():
                extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
                flag = next(
                    (w for w in str(extra.get("cli", "")).split() if w.startswith("--")), None
                )
                if flag is not None:
                    flags[name] = flag
        raise describe_errors(e.errors(), title, names=flags) from None


@contextlib.contextmanager
def quiet_catalog() -> Iterator[None]:
    """Silence the catalog's own warnings about damaged commit records while a command that
    reports them itself (one ``deck <command>:`` line naming the files) reads them."""
    log = logging.getLogger("deck.read.catalog")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


Subparsers = argparse._SubParsersAction  # what add_subparsers returns


# json.dumps with an indent runs json's pure-Python encoder (~15 us a row of `deck ls --json`:
# seconds over a long history); without one, its C encoder. Given the indented form's
# separators, the C encoder writes the members of flat dicts as the indented form does; the
# lines of the list's and the dicts' brackets, and the lists of ints inside (a row's
# "covers"), are put in here.
_MEMBERS = json.JSONEncoder(separators=(",\n  ", ": "))
_SCALARS = frozenset((str, int, float, bool, type(None)))
_SIMPLE_KEY = re.compile(r"[A-Za-z0-9_]+")
# A member whose value is a list of ints, as _MEMBERS writes it after the line break before
# each member: a raw line break is only ever a separator (strings escape theirs), and in flat
# dicts one followed by a quote starts a member's key.
_INTS_MEMBER = re.compile(r'\n  ("[A-Za-z0-9_]+": )\[(-?[0-9]+(?:,\n  -?[0-9]+)*)\]')


def json_list(items: list[Any]) -> str:
    """``json.dumps(items, indent=1)``, the same text, written at C speed when every item is a
    non-empty dict with string keys whose values are numbers, strings, bools, None or lists of
    ints (under simple keys); else the usual way (tests/test_cli_json.py compares the two)."""
    if not items or not all(_flat(x) for x in items):
        return json.dumps(items, indent=1)
    text = _MEMBERS.encode(items)  # '[{"a": 1,\n  "b": 2},\n  {"a": ...}]'
    # A member's value is never a dict: '},\n  {' is where an item ends and the next begins.
    text = "[\n {\n  " + text[2:-2].replace("},\n  {", "\n },\n {\n  ") + "\n }\n]"
    return _INTS_MEMBER.sub(_ints_indented, text)


def _flat(x: Any) -> bool:
    """Whether ``x`` is a dict :func:`json_list` writes at C speed."""
    if type(x) is not dict or not x:
        return False
    for k, v in x.items():
        if type(k) is not str:
            return False
        if type(v) is list:
            if not _SIMPLE_KEY.fullmatch(k) or not all(type(e) is int for e in v):
                return False
        elif type(v) not in _SCALARS:
            return False
    return True


def _ints_indented(m: re.Match[str]) -> str:
    return f"\n  {m.group(1)}[\n   " + m.group(2).replace(",\n  ", ",\n   ") + "\n  ]"
