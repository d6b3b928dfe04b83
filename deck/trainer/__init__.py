"""Code that runs inside the training process: the checkpointer, the tracker store, the part writer, staging, coordination, the writer lease."""
