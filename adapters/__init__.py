"""Model adapters: everything that knows a particular embedding implementation lives here."""

from deck.adapters.base import ModelAdapter, RemovableHandle, TableShard

__all__ = ["ModelAdapter", "RemovableHandle", "TableShard"]
