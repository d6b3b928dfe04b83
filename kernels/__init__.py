"""deck's CPU kernels on the training path, each with a fallback for when the C extension is not
built.

Importable as ``deck.kernels`` (``pyproject.toml`` maps this folder with ``package-dir``). This
package imports nothing itself: a caller imports the module it uses, and loads only that module
and :mod:`.native`.

- :mod:`.claim`: the tracker's byte map (:class:`deck.trainer.tracker.TrackerStore`): the
  claim of a consumer's rows, the compaction that marks them, the journal's clear.
- :mod:`.gather`: the snapshot's copies of touched rows into chunk buffers
  (:class:`deck.trainer.writer.RankPartWriter`).
- :mod:`.bloom`: a chunk's row index (:mod:`deck.format.rowindex`, built by the writer).
- :mod:`.native`: loads the C extension (``kernels/_native.c``); without it the modules above
  fall back to torch (claim, copies) and numpy (the row index), with the same results.

Every module here is imported by product code (checked by ``tests/test_architecture.py``).
"""
