"""The serving wing: what keeps a serving job's copy of a model up to date from a publisher.

Sources: a deck checkpoint chain at any URI (:mod:`.follow`, ``deck follow URI``: the
:class:`~deck.serve.follow.Follower` applies each new delta onto the held state) and a Kafka
topic (:mod:`.kafka_follow`, ``deck follow kafka://``: the same follower reading its rows from
the stream; :mod:`.kafka_guard` the quarantine and run checks, :mod:`.kafka_full` the loader
fulls). Outputs (:mod:`.output`): the held state (``state.safetensors`` + ``state.json``, always)
and, asked for, Parquet row files (:mod:`.parquet_output`). A second message queue is one source
module here and one sink in deck/trainer (docs/architecture.md).
"""
