"""Offline operations on a checkpoint URI: retention and GC, listing, history, export, follow, report."""
