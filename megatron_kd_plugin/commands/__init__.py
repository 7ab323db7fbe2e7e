"""The ``python -m megatron_kd_plugin`` commands, one module each (``__main__.COMMANDS`` maps the names):
``cache`` (run a teacher once, write its store), ``inspect`` (what a store holds; ``--verify``), ``train`` (a KD
recipe: Bridge's ``pretrain()`` on GPU, the CPU loop without), ``plan`` (per-GPU memory of a run). The ``demo``
command is its own package, ``megatron_kd_plugin.demo``. Commands sit above every other layer: nothing in the
package imports them except other commands and the demo.
"""
