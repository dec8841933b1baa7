"""The parts of ``scripts/benchmark/benchmark.py``: the cost of SAM, VASSO and eVASSO over
their base optimizer (AdamW), measured side by side. docs/benchmarks.md says how it measures.

* :mod:`vasso_bench.cli`: the command line, which chooses what each mode runs;
* :mod:`vasso_bench.memory`: optimizer state bytes and the peak heap of one fresh process
  per method;
* :mod:`vasso_bench.report`: the targets' verdicts and the markdown report;
* :mod:`vasso_bench.device`: the device benchmark (``--device cuda``): every member, AdamW
  with one and two passes and the anchors, CUDA-event times over interleaved rounds;
* :mod:`vasso_bench.anchors`: the authors' VASSO and davda54's SAM, imported from the
  user's checkouts at run time (never copied here);
* :mod:`vasso_bench.phases`: a step's phases marked from outside the core, read by
  :mod:`vasso_bench.profile` (``--profile``) and :mod:`vasso_bench.host` (``--host-cost``);
* :mod:`vasso_bench.fairseq_runs`: the fairseq-train comparison on the toy corpus.

The models and the interleaved timing are installed (:mod:`plugins.lab.bench`), because
``vasso-selftest`` times a step with them too.
"""

import os

HOME = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the folder that holds vasso_bench


def child_env(env):
    """``env`` for a ``python -m vasso_bench.X`` child: this folder first on PYTHONPATH."""
    rest = env.get("PYTHONPATH")
    return dict(env, PYTHONPATH=HOME + (os.pathsep + rest if rest else ""))
