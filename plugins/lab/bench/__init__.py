"""The parts of ``scripts/benchmark.py``: the cost of SAM, VASSO and eVASSO over their
base optimizer (AdamW), measured side by side.

* :mod:`plugins.lab.bench.cli`: the command line, which chooses what each mode runs;
* :mod:`plugins.lab.bench.models`: the methods and the two models timed (a small
  transformer LM and a deep stack of tiny blocks), built identically per method;
* :mod:`plugins.lab.bench.timing`: interleaved blocks of updates, timed in parts, and their
  paired ratios;
* :mod:`plugins.lab.bench.memory`: optimizer state bytes and the peak heap of one fresh
  process per method (``python -m plugins.lab.bench.memory``);
* :mod:`plugins.lab.bench.report`: the targets' verdicts and the markdown report;
* :mod:`plugins.lab.bench.device`: the device benchmark (``--device cuda``): every member,
  AdamW with one and two passes and the anchors on ResNet-50 and an IWSLT-sized transformer,
  CUDA-event times over interleaved rounds, peak memory alone, and their verdicts;
* :mod:`plugins.lab.bench.anchors`: the authors' VASSO and davda54's SAM, imported from the
  user's checkouts at run time (never copied here);
* :mod:`plugins.lab.bench.phases`: a step's phases marked from outside the core, read by
  :mod:`plugins.lab.bench.profile` (a torch.profiler trace by phase,
  ``python -m plugins.lab.bench.profile``) and :mod:`plugins.lab.bench.host` (the optimizer's
  own ops, host syncs and host time per step: ``--host-cost``).

The fairseq-train comparison is :mod:`fairseq_vasso.nmt.bench`. The core (``import plugins``)
never imports this subpackage.
"""
