"""The store itself, on a local disk or object storage: its schema (``format.py``, ``array_names.py``), checked chunk
reads and records, the writers' lock or lease, the reader, and moving a store (the log-prob codec stays at
``cache/logprob_grid.py``, the path its entry points name)."""
