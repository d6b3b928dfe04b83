import pytest

from deck import DeckConfig, StagingConfig
from deck.errors import ConfigError


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
    ],
)
def test_invalid_values_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        DeckConfig(**kwargs)


def test_checkpoint_consumer_always_present() -> None:
    assert DeckConfig(uri="x", consumers=("publish",)).consumers == ("checkpoint", "publish")


def test_staging_page_multiple() -> None:
    assert StagingConfig(chunk_bytes=8192).chunk_bytes == 8192
