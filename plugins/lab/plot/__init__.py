"""Plots of what the sharpness-aware optimizers log, and the paper's adversary sphere.

* :mod:`plugins.lab.plot.diagnostics` (``vasso-plot``): the stability of the adversary
  ||eps_t - eps_{t-1}|| and the perturbed-loss gap over updates, from fairseq-train
  logs or DomainBed's ``results.jsonl``;
* :mod:`plugins.lab.plot.sphere` (``python -m plugins.lab.plot.sphere``): the paper's Fig. 3,
  SAM's and VASSO's adversaries on the sphere for a noisy gradient.

The core (``import plugins``) never imports this subpackage; it needs numpy, and
matplotlib only when a plot is drawn (``pip install matplotlib``).
"""
