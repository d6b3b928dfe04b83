"""Code that runs in merger worker processes (never imports :mod:`deck.trainer`).

- :mod:`deck.merge.policy`: ``MergeConfig`` / ``FullPolicy`` and DECK's sizing formulas;
- :mod:`deck.merge.plan`: what to build next, from the committed lineage alone;
- :mod:`deck.merge.stream`: the newest-wins streaming merge of one partition's rows;
- :mod:`deck.merge.build`: one planned item's partitions and its commit;
- :mod:`deck.merge.worker`: the worker loop (``MergeWorker``);
- :mod:`deck.merge.launch`: which worker a process is (flags, torchrun, Kubernetes, SLURM).
"""
