"""Model loading: megatron-core models for teachers and students, below the cache and the bridge layers.

- ``gpt``: the project's own GPT checkpoints (a JSON spec + a TP-resharding full-state file) — the demo's and the
  GPU check's models; needs megatron-core only.
- ``hf``: a Hugging Face folder as a checked, finalized megatron-core provider through Megatron-Bridge's
  ``AutoBridge`` — any architecture Bridge converts, as teacher or student.
- ``student``: students from and back to Hugging Face checkpoints (weights in, a HF folder out).

Without CUDA every model gets ``cpu_compat.cpu_model_settings()``.
"""
