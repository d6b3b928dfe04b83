"""The package version, in one place every process role can import without the rest of deck."""

__version__ = "0.1.0"
