"""The parts of ``scripts/benchmark.py``: the cost of SAM, VASSO and eVASSO over their
base optimizer (AdamW), measured side by side.

* :mod:`plugins.bench.models`: the methods and the two models timed (a small
  transformer LM and a deep stack of tiny blocks), built identically per method;
* :mod:`plugins.bench.timing`: interleaved blocks of updates, timed in parts, and their
  paired ratios;
* :mod:`plugins.bench.memory`: optimizer state bytes and the peak heap of one fresh
  process per method (``python -m plugins.bench.memory``);
* :mod:`plugins.bench.report`: the targets' verdicts and the markdown report.

The fairseq-train comparison is :mod:`fairseq_vasso.bench`. The core (``import plugins``)
never imports this subpackage.
"""
