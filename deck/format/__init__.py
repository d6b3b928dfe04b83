"""The on-disk format: manifest records, layout names, chunks, row index, quantization, nested-state codec. Pure data; no process-specific code."""
