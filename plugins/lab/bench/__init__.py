"""The models and the interleaved timing of a step, shared by ``vasso-selftest`` (its cost
check) and the benchmark (``scripts/benchmark/benchmark.py``, whose other parts sit beside it).

* :mod:`plugins.lab.bench.models`: the methods and the models timed (a small transformer LM
  and a deep stack of tiny blocks), built identically per method;
* :mod:`plugins.lab.bench.timing`: interleaved blocks of updates, timed in parts, and their
  paired ratios.

The core (``import plugins``) never imports this subpackage.
"""
