import json
import os
from pathlib import Path
from typing import Any

import pydantic
import pytest

import deck
from deck import DeckConfig, PublishConfig, StagingConfig
from deck.errors import ConfigError
from deck.serve.live_config import LiveConfig
from deck.storage.fsspec_store import FsspecStorage


def test_defaults() -> None:
    c = DeckConfig(uri="/tmp/x")
    assert c.delta_every_steps == 100 and c.full_every_steps is None
    assert c.consumers == ("checkpoint",)
    assert c.staging.chunk_bytes % 4096 == 0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"uri": ""}, "uri"),
        ({"uri": "x", "delta_every_steps": 0}, "delta_every_steps"),
        ({"uri": "x", "full_every_steps": 0}, "full_every_steps"),
        (
            {"uri": "x", "delta_every_steps": 10, "full_every_steps": 15},
            "multiple of delta_every_steps",
        ),
        ({"uri": "x", "consumers": ("a", "a")}, "consumers"),
        ({"uri": "x", "consumers": ("bad name",)}, "consumers"),
        ({"uri": "x", "unknown": 1}, "unknown"),
        ({"uri": "x", "staging": {"chunk_bytes": 1000}}, "chunk_bytes"),
        # Accepted before, then the lease record refused it on rank 0 alone, inside enable,
        # while the other ranks waited in a collective
        ({"uri": "x", "lease_ttl_s": 2e9}, r"lease_ttl_s: must be <= 1000000000"),
        ({"uri": "x", "lease_ttl_s": float("inf")}, r"lease_ttl_s: must be a finite number"),
        # break-it findings: NaN was "too large"; a 1 TiB chunk failed every checkpoint later
        ({"uri": "x", "lease_ttl_s": float("nan")}, r"lease_ttl_s: must be a finite number"),
        ({"uri": "x", "staging": {"chunk_bytes": 2**40}}, r"chunk_bytes: must be at most"),
        ({"uri": "x", "staging": {"spool_dir": " "}}, r"spool_dir: must name a folder"),
        (  # a checkpoint step() returned was lost: cpu-remote has no place for its record
            {"uri": "x", "staging": {"tiers": "cpu-remote", "release": "first_tier"}},
            r"release: first_tier keeps a checkpoint across a crash by the pending record",
        ),
        (
            {"uri": "x", "staging": {"retry_initial_s": 10.0, "retry_max_s": 1.0}},
            r"retry_max_s: must be at least retry_initial_s \(10\)",
        ),
        # A lease renewed every third of a microsecond: every checkpoint refused, for ever
        ({"uri": "x", "lease_ttl_s": 1e-9}, r"lease_ttl_s: must be >= 1.0"),
        ({"uri": "/tmp/ck\x00x"}, r"uri: holds a NUL character"),
        # Publishing is a tracker tenant too: accepted, then refused at enable (9 of 8 bits)
        (
            {"uri": "x", "consumers": tuple("abcdefg"), "publish": {"uri": "p"}},
            r"publish: publishing takes a tracker consumer .* at most 6 of your own",
        ),
    ],
)
def test_invalid_values_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        DeckConfig(**kwargs)


def test_checkpoint_consumer_always_present() -> None:
    assert DeckConfig(uri="x", consumers=("publish",)).consumers == ("checkpoint", "publish")
    six = DeckConfig(uri="x", consumers=tuple("abcdef"), publish={"uri": "p"})
    assert len(six.tracking_consumers) == 8


def test_staging_page_multiple() -> None:
    assert StagingConfig(chunk_bytes=8192).chunk_bytes == 8192


# --- validated at construction, strictly ---


@pytest.mark.parametrize("uri", ["foo://x", "http://host/ckpt", "sftp://host/ckpt", "a::s3://b"])
def test_unsupported_scheme_refused_at_construction(uri: str) -> None:
    with pytest.raises(ConfigError, match=r"DeckConfig\.uri: scheme .* not supported") as e:
        DeckConfig(uri=uri)
    # the message lists what storage opens, so the user can pick one
    assert "s3://" in str(e.value) and "memory://" in str(e.value)


@pytest.mark.parametrize("uri", ["/tmp/run", "file:///tmp/run", "s3://b/p", "memory://x"])
def test_supported_uris_accepted(uri: str) -> None:
    assert DeckConfig(uri=uri).uri == uri


def test_supported_schemes_are_what_storage_opens(tmp_path: Path) -> None:
    from deck import schemes
    from deck.storage import open_storage

    stores = [s for s in schemes.registered() if s.role == "storage"]
    assert {s.name for s in stores} >= {"file", "s3", "gs", "az", "memory"}
    for scheme in stores:
        uri = (
            f"{scheme.name}://{tmp_path}/x"
            if schemes.is_local(f"{scheme.name}://")
            else (f"{scheme.name}://bucket/x")
        )
        DeckConfig(uri=uri)
        try:
            open_storage(uri)
        except ConfigError as e:  # a missing backend is fine; a refused scheme is not
            assert "not supported" not in str(e), e
    for refused in ("http://host/x", "sftp://h/x", "simplecache::s3://b/x", "kafka://h:1/t"):
        with pytest.raises(ConfigError, match="not supported"):
            open_storage(refused)
        with pytest.raises(ConfigError, match="not supported"):
            DeckConfig(uri=refused)
    with pytest.raises(ConfigError, match="not supported"):
        FsspecStorage("http://host/x")


def test_a_registered_scheme_opens_its_own_backend(tmp_path: Path) -> None:
    from deck import schemes
    from deck.storage import LocalStorage, Storage, open_storage

    def opener(uri: str, options: dict | None) -> Storage:
        return LocalStorage(tmp_path / uri.split("://", 1)[1])

    schemes.register(schemes.Scheme("deck-test", opener, atomic_put=True))
    try:
        config = DeckConfig(uri="deck-test://run1")
        storage = open_storage(config.uri)
        storage.put("a", b"x")
        assert (tmp_path / "run1" / "a").read_bytes() == b"x"
        # Refused by capability, not by name: a scheme whose put is not atomic is never written.
        schemes.register(schemes.Scheme("deck-test", opener, atomic_put=False))
        with pytest.raises(ConfigError, match="not supported"):
            DeckConfig(uri="deck-test://run1")
    finally:
        schemes.unregister("deck-test")
    with pytest.raises(ConfigError, match="scheme name"):
        schemes.register(schemes.Scheme("Bad_Name", opener))


def test_path_accepted_as_uri(tmp_path: Path) -> None:
    c = DeckConfig(uri=tmp_path / "run", staging={"spool_dir": tmp_path / "spool"})
    assert c.uri == str(tmp_path / "run") and c.staging.spool_dir == str(tmp_path / "spool")
    assert PublishConfig(uri=tmp_path / "pub").uri == str(tmp_path / "pub")


@pytest.mark.parametrize(
    ("kwargs", "line"),
    [
        (
            {"delta_every_steps": True},
            "DeckConfig.delta_every_steps: must be an integer, not a bool",
        ),
        ({"delta_every_steps": 2.0}, "DeckConfig.delta_every_steps: "),
        ({"delta_every_steps": "5"}, "DeckConfig.delta_every_steps: "),
        ({"full_every_steps": True}, "DeckConfig.full_every_steps: "),
        ({"track_eval": 1}, "DeckConfig.track_eval: must be True or False (got 1)"),
        ({"staging": {"chunks_in_flight": False}}, "DeckConfig.staging.chunks_in_flight: "),
    ],
)
def test_strict_types(kwargs: dict, line: str) -> None:
    with pytest.raises(ConfigError) as e:
        DeckConfig(uri="x", **kwargs)
    assert line in str(e.value)


@pytest.mark.parametrize(
    ("kwargs", "line"),
    [
        (
            {"delta_every_steps": -1},
            "DeckConfig.delta_every_steps: must be >= 1 (got -1)",
        ),
        (
            {"staging": {"chunk_bytes": 4097}},
            "DeckConfig.staging.chunk_bytes: must be a positive multiple of 4096 bytes (got 4097)",
        ),
        (
            {"delta_every_steps": 10, "full_every_steps": 15},
            "DeckConfig.full_every_steps: must "
            "be a multiple of delta_every_steps (10) so fulls land on checkpoint steps (got 15)",
        ),
        (
            {"staging": {"chunk_bytes": 16384, "bundle_bytes": 8192}},
            "DeckConfig.staging.bundle_bytes: must be 0 (off) or a multiple of 4096 of at least "
            "chunk_bytes (16384) (got 8192)",
        ),
        ({"publish": {"uri": "kafka://h:1/t"}}, "DeckConfig.publish.state_uri: a kafka:// "),
        (
            # (a break-it finding: accepted, then 1 GiB of buffers per rank under a 4 KiB cap)
            {"staging": {"chunk_bytes": 2**28, "snapshot_memory_bytes": 4096}},
            "DeckConfig.staging.snapshot_memory_bytes: must be at least chunks_in_flight x "
            "chunk_bytes (4 x 268435456 = 1073741824): the pool never holds fewer buffers; lower "
            "chunks_in_flight or chunk_bytes, or raise the cap (got 4096)",
        ),
        (
            {"staging": {"bundle_bytes": 2**29}},
            "DeckConfig.staging.bundle_bytes: chunks_in_flight x bundle_bytes (4 x 536870912 = "
            "2147483648) exceeds snapshot_memory_bytes (1073741824): the pool holds at least that "
            "many buffers; lower chunks_in_flight or bundle_bytes, or raise snapshot_memory_bytes "
            "(got 536870912)",
        ),
        (
            # (a break-it finding: accepted, they sent every publish to another broker while
            # the errors named the URI's, and could drop the acknowledgements commits rely on)
            {
                "publish": {
                    "uri": "kafka://h:1/t",
                    "state_uri": "/tmp/s",
                    "kafka": {"bootstrap.servers": "b:1", "acks": "0", "linger.ms": 5},
                }
            },
            "DeckConfig.publish.kafka: bootstrap.servers, acks: deck sets them (bootstrap.servers: "
            "the brokers are the kafka:// URI's; acks: a publish commits only segments every "
            "in-sync replica acknowledged (acks=all)); leave them out",
        ),
    ],
)
def test_messages_name_the_field_once(kwargs: dict, line: str) -> None:
    with pytest.raises(ConfigError) as e:
        DeckConfig(uri="x", **kwargs)
    msg = str(e.value)
    # One line: the field as the user set it, what is allowed, the value given; no doubled
    # value, no blame on "config", none of pydantic's wording
    assert msg == line or (msg.startswith(line) and line.endswith(": a kafka:// ")), msg
    assert "\n" not in msg and "Input should" not in msg, msg
    assert msg.count("(got") <= 1 and msg.count("got ") <= 1, msg
    assert ".config" not in msg, msg


def test_errors_of_several_fields_one_line_each() -> None:
    with pytest.raises(ConfigError) as e:
        DeckConfig(uri="x", delta_every_steps=0, staging={"tiers": "bad", "chunk_bytes": 5})
    assert [r["loc"] for r in e.value.errors()] == [
        ("delta_every_steps",),
        ("staging", "chunk_bytes"),
        ("staging", "tiers"),
    ]
    assert e.value.error_count() == 3
    assert str(e.value) == (
        "3 invalid values: DeckConfig.delta_every_steps: must be >= 1 (got 0); "
        "DeckConfig.staging.chunk_bytes: must be a positive multiple of 4096 bytes (got 5); "
        "DeckConfig.staging.tiers: must be 'auto', 'local', 'cpu-remote' or 'cpu-ssd-remote' "
        "(got 'bad')"
    )


@pytest.mark.parametrize(
    ("build", "said"),
    [
        (
            lambda: DeckConfig(uri="x", staging={"chunk_bytes": 1000}),
            "DeckConfig.staging.chunk_bytes: must be a positive multiple of 4096 bytes (got 1000)",
        ),
        (
            lambda: deck.StagingConfig(chunk_bytes=1000),
            "StagingConfig.chunk_bytes: must be a positive multiple of 4096 bytes (got 1000)",
        ),
        (
            lambda: DeckConfig(uri="x", delta_every_steps="100"),
            "DeckConfig.delta_every_steps: must be an integer, not a string (got '100')",
        ),
        (
            lambda: DeckConfig(uri="x", lease_ttl_s=0),
            "DeckConfig.lease_ttl_s: must be >= 1.0 (got 0)",
        ),
        (lambda: DeckConfig(), "DeckConfig.uri: is required"),
        (  # a break-it finding: accepted, then the applier's thread died on its first wait
            lambda: LiveConfig(poll_s=float("inf")),
            "LiveConfig.poll_s: must be a finite number (got inf)",
        ),
        (
            lambda: DeckConfig(uri="x", staging=5),
            "DeckConfig.staging: must be a StagingConfig or a dict of its fields (got 5)",
        ),
        (
            lambda: DeckConfig(uri="x", staging={"chunk_byte": 8192}),
            "DeckConfig.staging.chunk_byte: is not a field of StagingConfig; did you mean chunk_bytes?",
        ),
        (
            lambda: DeckConfig(uri="x", staging={"tiers": "nope"}),
            "DeckConfig.staging.tiers: must be 'auto', 'local', 'cpu-remote' or 'cpu-ssd-remote' (got 'nope')",
        ),
    ],
)
def test_one_line_naming_the_field_as_written(build: Any, said: str) -> None:
    with pytest.raises(ConfigError) as e:
        build()
    assert str(e.value) == said


def test_a_frozen_config_refuses_assignment_with_a_config_error() -> None:
    c = DeckConfig(uri="x")
    with pytest.raises(ConfigError, match=r"DeckConfig is frozen: .*model_copy\(update="):
        c.delta_every_steps = 5  # type: ignore[misc]
    with pytest.raises(ConfigError, match="frozen"):
        del c.uri
    assert c.delta_every_steps == 100


def test_command_line_errors_name_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from deck.cli import main

    uri = str(tmp_path / "run")  # --follow: the URI need not exist yet; flags are checked first
    for flags, said in (
        (["--stride", "1"], "deck merge: --stride: must be >= 2 (got 1)"),
        (
            ["--chunk-bytes", "1000"],
            "deck merge: --chunk-bytes: must be a positive multiple of 4096 (got 1000)",
        ),
        (["--keep-last-fulls", "0"], "deck merge: --keep-last-fulls: must be >= 1 (got 0)"),
        (["--grace", "-1"], "deck merge: --grace: must be >= 0.0 (got -1.0)"),
    ):
        assert main(["merge", uri, "--follow", *flags]) == 2
        assert capsys.readouterr().err.splitlines()[-1] == said


def test_one_exception_type_whatever_the_entry_point() -> None:
    bad = {"uri": "x", "delta_every_steps": 0}
    for build in (
        lambda: DeckConfig(**bad),
        lambda: DeckConfig.model_validate(bad),
        lambda: DeckConfig.model_validate_json(json.dumps(bad)),
        lambda: DeckConfig(uri="x").model_copy(update={"delta_every_steps": 0}),
    ):
        with pytest.raises(ConfigError, match=r"DeckConfig\.delta_every_steps: .*\(got 0\)") as e:
            build()
        # a DeckError, and a ValueError as pydantic's ValidationError is
        assert isinstance(e.value, deck.DeckError) and isinstance(e.value, ValueError)
        assert not isinstance(e.value, pydantic.ValidationError)


def test_json_round_trip_and_valid_copy() -> None:
    c = DeckConfig(
        uri="s3://b/p", delta_every_steps=10, consumers=["a"], staging={"bundle_bytes": 0}
    )
    assert DeckConfig.model_validate_json(c.model_dump_json()) == c
    d = c.model_copy(update={"full_every_steps": 20, "staging": {"chunk_bytes": 8192}})
    assert d.full_every_steps == 20 and d.staging.chunk_bytes == 8192 and d.uri == c.uri
    with pytest.raises(ConfigError, match=r"DeckConfig\.full_every_steps"):
        c.model_copy(update={"full_every_steps": 15})
    with pytest.raises(ConfigError, match=r"DeckConfig\.unknown"):
        c.model_copy(update={"unknown": 1})


def test_json_schema_has_the_bounds() -> None:
    props = DeckConfig.model_json_schema()["properties"]
    assert props["delta_every_steps"]["minimum"] == 1
    assert {"minimum": 1, "type": "integer"} in props["full_every_steps"]["anyOf"]
    assert props["lease_ttl_s"]["anyOf"][0]["minimum"] == 1.0
    assert props["lease_ttl_s"]["anyOf"][0]["maximum"] == 1e9


def test_validate_strings_is_strict_too() -> None:
    assert DeckConfig.model_validate_strings({"uri": "x"}).uri == "x"
    # strict mode refuses numbers as strings here too: one rule for every entry point
    with pytest.raises(ConfigError, match=r"DeckConfig\.delta_every_steps: .*\(got '5'\)"):
        DeckConfig.model_validate_strings({"uri": "x", "delta_every_steps": "5"})


def test_error_classes_importable_from_deck() -> None:
    from deck import errors

    public = {
        n for n, v in vars(errors).items() if isinstance(v, type) and issubclass(v, Exception)
    }
    assert public and all(getattr(deck, n) is getattr(errors, n) for n in public)
    assert public <= set(deck.__all__)
    assert issubclass(deck.CorruptCheckpointError, deck.DeckError)
    # those defined with the formats they guard, loaded on first use
    for name in ("CorruptStreamError", "StreamGapError", "MessageTooLargeError"):
        assert name in deck.__all__ and issubclass(getattr(deck, name), deck.DeckError)


@pytest.mark.parametrize(
    ("uri", "why"),
    [
        ("S3://bucket/x", "schemes are lowercase"),
        ("s3:/bucket/run1", "mistyped scheme"),  # was a local folder ./s3:/bucket/run1
        ("memory://", "names no place"),
        ("s3://b/x::y", "chained URIs"),
        ("kafka://h:1/t", "a publish sink, not a store"),
    ],
)
def test_uri_mistakes_are_refused_with_the_reason(uri: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        DeckConfig(uri=uri)


def test_a_path_with_a_colon_slash_slash_inside_is_a_path(tmp_path: Path) -> None:
    from deck.storage import open_storage

    uri = str(tmp_path / "a://b")
    assert DeckConfig(uri=uri).uri == uri
    open_storage(uri).put("k", b"v")
    assert (tmp_path / "a:" / "b" / "k").read_bytes() == b"v"


@pytest.mark.parametrize("publish", ["file://{p}", "{p}/.", "local://{p}/", "{p}/../{n}"])
def test_publish_refused_at_the_checkpoints_place_however_spelled(
    tmp_path: Path, publish: str
) -> None:
    p = tmp_path / "run"
    spelled = publish.format(p=p, n=p.name)
    with pytest.raises(ConfigError, match="same place as uri"):
        DeckConfig(uri=str(p), publish={"uri": spelled})
    with pytest.raises(ConfigError, match="same place as uri"):
        DeckConfig(uri=str(p), publish={"uri": "kafka://h:1/t", "state_uri": spelled})


def test_registering_schemes_is_checked() -> None:
    from deck import schemes

    with pytest.raises(ConfigError, match="deck's own"):
        schemes.register(schemes.Scheme("s3", "x.y:Z", atomic_put=False))
    with pytest.raises(ConfigError, match="deck's own"):
        schemes.unregister("file")
    with pytest.raises(ConfigError, match="opener must be"):
        schemes.register(schemes.Scheme("deck-bad", 42))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="role must be"):
        schemes.register(schemes.Scheme("deck-bad", "m:o", role="bogus"))  # type: ignore[arg-type]
    schemes.register(schemes.Scheme("deck-missing", "no_such_module_here:Opener"))
    try:
        with pytest.raises(ConfigError, match="cannot be loaded"):
            from deck.storage import open_storage

            open_storage("deck-missing://x")
    finally:
        schemes.unregister("deck-missing")
    # The DeckConfig and the store still agree after all that
    assert DeckConfig(uri="s3://bucket/x").uri == "s3://bucket/x"


def test_a_scheme_declared_as_an_entry_point_works_in_the_cli(tmp_path: Path) -> None:
    """A backend installed as a package (entry-point group deck.schemes) is found by every
    process: here `deck ls` in a new one, which never called register()."""
    import subprocess
    import sys

    site = tmp_path / "site"
    (site / "myplug-0.1.dist-info").mkdir(parents=True)
    (site / "myplug-0.1.dist-info" / "METADATA").write_text("Name: myplug\nVersion: 0.1\n")
    (site / "myplug-0.1.dist-info" / "entry_points.txt").write_text(
        "[deck.schemes]\nmyfs = myplug:SCHEME\n"
    )
    root = tmp_path / "stores"
    (site / "myplug.py").write_text(
        "from deck.schemes import Scheme\n"
        "from deck.storage import LocalStorage\n"
        f"def _open(uri, options):\n    return LocalStorage({str(root)!r} + '/' + uri.split('://', 1)[1])\n"
        "SCHEME = Scheme('myfs', _open)\n"
    )
    from deck.storage import LocalStorage
    from deck.testing.synth import saved_chain

    saved_chain(LocalStorage(root / "run1"), 1)
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run(
        [sys.executable, "-m", "deck.cli", "ls", "myfs://run1", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    assert [row["kind"] for row in json.loads(r.stdout)] == ["full", "delta"]


def test_the_refusal_and_the_readme_list_the_accepted_schemes() -> None:
    """What a refused scheme's ConfigError lists is what is accepted (file:// and local://
    included), and README's `uri` row names the same built-in schemes."""
    import re

    from deck import schemes

    accepted = {s.name for s in schemes.registered() if s.atomic_put and s.role == "storage"}
    with pytest.raises(ConfigError) as e:
        DeckConfig(uri="sftp://host/run1")
    said = str(e.value).split("not supported here: ", 1)[1].split(" (got ")[0]
    assert set(re.findall(r"\b([a-z0-9]+)://", said)) == accepted, said
    for name in accepted:
        assert DeckConfig(uri=f"{name}://bucket/run1").uri == f"{name}://bucket/run1"
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    row = next(ln for ln in readme.splitlines() if ln.startswith("| `uri` |"))
    listed = set(re.findall(r"`([a-z0-9]+)://`", row.split("; any other")[0]))
    assert listed == accepted & schemes._BUILTIN, row


def test_an_empty_staging_mode_variable_is_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    """Templated environments leave variables empty: that is no choice (it was refused)."""
    from deck.config import STAGING_MODE_ENV

    monkeypatch.setenv(STAGING_MODE_ENV, "")
    assert StagingConfig().mode == "threads"
    monkeypatch.setenv(STAGING_MODE_ENV, "process")
    assert StagingConfig().mode == "process"
    monkeypatch.setenv(STAGING_MODE_ENV, "proc")
    with pytest.raises(ConfigError, match="DECK_STAGING_MODE='proc': use threads or process"):
        StagingConfig()


def test_the_local_tier_with_a_remote_uri_is_refused_at_construction() -> None:
    """(a break-it finding: accepted, then refused only at enable, as a DeckError that said
    nothing of the tiers to use)"""
    with pytest.raises(ConfigError, match=r"^DeckConfig.staging: tiers='local' writes straight "):
        DeckConfig(uri="s3://b/x", staging={"tiers": "local"})
    assert DeckConfig(uri="file:///tmp/x", staging={"tiers": "local"}).staging.tiers == "local"
