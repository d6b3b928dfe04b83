"""Helpers for tests and docs; not used by the library at run time.

- :class:`deck.testing.storage.StorageTests`: the conformance tests every
  :class:`deck.storage.Storage` backend must pass; a backend's test module subclasses it with a
  ``store`` fixture and a ``raw`` one (:class:`deck.testing.storage.RawObjects`: the backend's
  objects reached without the store under test) (needs pytest).
- :func:`deck.testing.stateful.check_against_memory`: random sequences of calls on a store,
  every answer compared with a memory store's (needs hypothesis).
"""
