"""Random sequences of Storage calls on each backend, every answer compared with a memory store's
(:mod:`deck.testing.stateful`, like zarr's stateful store tests). The S3 case runs against a real
SeaweedFS server and is marked slow."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from deck.storage import FsspecStorage, LocalStorage
from deck.storage.wrapper import StorageWrapper
from deck.testing.faulty_storage import FaultyStorage
from deck.testing.stateful import check_against_memory


def test_local_store_answers_like_the_memory_store(tmp_path: Path) -> None:
    check_against_memory(lambda: LocalStorage(tmp_path / uuid.uuid4().hex))


def test_memory_store_answers_like_another_and_holds_what_was_put() -> None:
    check_against_memory(lambda: FsspecStorage(f"memory://deck-sm-{uuid.uuid4().hex}"))


def test_wrappers_answer_like_the_memory_store(tmp_path: Path) -> None:
    """The forwarding wrapper and the fault injector without faults (generic reads)."""
    check_against_memory(
        lambda: StorageWrapper(LocalStorage(tmp_path / uuid.uuid4().hex)), max_examples=10
    )
    check_against_memory(
        lambda: FaultyStorage(LocalStorage(tmp_path / uuid.uuid4().hex)), max_examples=10
    )


@pytest.mark.slow
def test_s3_store_answers_like_the_memory_store(s3_server: Any) -> None:
    check_against_memory(
        lambda: FsspecStorage(
            s3_server.uri(f"sm-{uuid.uuid4().hex[:12]}"), s3_server.storage_options
        )
    )
