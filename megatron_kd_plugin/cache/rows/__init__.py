"""A student's training rows read from stores: the typed row and the dataset (``kd_rows.py``), one module per kind of
row, the lookup (``row_kinds.py``), blends, ensembles, and the epoch order."""
