"""The core's lab: what is built around the optimizer family rather than being it.

* :mod:`plugins.lab.bench`: the models and interleaved timing of the self-test and the benchmark
  (``scripts/benchmark/benchmark.py``);
* :mod:`plugins.lab.plot`: ``vasso-plot`` (diagnostics of fairseq logs and DomainBed
  results; each host's package reads its own format) and the paper's sphere figure;
* :mod:`plugins.lab.tables`: the one mean ± std and markdown table writer of every tool.
* :mod:`plugins.lab.pinned_kernels`: the CPU kernels pinned for the numbers the docs state
  exactly (the same bits on every AMD x86-64 CPU with AVX2).

Torch, numpy and (for plots) matplotlib; ``import plugins`` never imports this.
"""
