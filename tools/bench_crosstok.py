"""Cross-tokenizer distillation quality in bits per byte (issue #18): the demo's comparison
(``megatron_kd_plugin.demo.student_tokenizer``, ``python -m megatron_kd_plugin demo --student-tokenizer unigram``) with its
output in ``bench_results/crosstok`` unless ``--output`` says otherwise.

    python tools/bench_crosstok.py [--steps 80] [--teacher-steps 120] [--alm 0.5:1 1:1 1:10] [--reuse] ...
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from megatron_kd_plugin.demo import student_tokenizer  # noqa: E402

if __name__ == "__main__":
    sys.exit(student_tokenizer.main(["--student-tokenizer", "unigram", "--output", "bench_results/crosstok", *sys.argv[1:]]))
