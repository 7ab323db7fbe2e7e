"""The end-to-end demo (``python -m megatron_kd_plugin demo``): corpus, teacher, top-K cache, students, eval.

``data`` builds the corpus (the stdlib sources, or the user's text with ``--corpus``), ``train`` trains the
teacher, ``metrics`` evaluates densely, ``pipeline`` runs it all.
"""
