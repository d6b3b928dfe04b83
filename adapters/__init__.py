"""Model adapters: everything that knows a particular embedding implementation lives here (the
interface they implement is :mod:`deck.model`). Nothing here imports the trainer."""
