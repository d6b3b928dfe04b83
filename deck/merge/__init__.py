"""Code that runs in merger worker processes: the merge plan, the streaming merge, the worker loop and its launcher environment."""
