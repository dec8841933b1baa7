"""The parts of ``scripts/benchmark.py``: the cost of SAM, VASSO and eVASSO over their
base optimizer (AdamW), measured side by side.

* :mod:`plugins.lab.bench.models`: the methods and the two models timed (a small
  transformer LM and a deep stack of tiny blocks), built identically per method;
* :mod:`plugins.lab.bench.timing`: interleaved blocks of updates, timed in parts, and their
  paired ratios;
* :mod:`plugins.lab.bench.memory`: optimizer state bytes and the peak heap of one fresh
  process per method (``python -m plugins.lab.bench.memory``);
* :mod:`plugins.lab.bench.report`: the targets' verdicts and the markdown report.

The fairseq-train comparison is :mod:`fairseq_vasso.nmt.bench`. The core (``import plugins``)
never imports this subpackage.
"""
