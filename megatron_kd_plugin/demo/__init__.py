"""The end-to-end demo (``python -m megatron_kd_plugin demo``): stdlib corpus, teacher, top-K cache, students, eval.

``data`` builds the corpus, ``train`` trains the teacher, ``metrics`` evaluates densely, ``pipeline`` runs it all.
"""
