"""Reading committed checkpoints: the catalog of manifests, the lineage graph, verification, applying a chain to live shards."""
