"""Helpers for tests and docs; not used by the library at run time.

- :class:`deck.testing.storage.StorageTests`: the conformance tests every
  :class:`deck.storage.Storage` backend must pass; a backend's test module subclasses it with a
  ``store`` fixture (needs pytest).
"""
