"""``vasso-selftest``: what this project's CPU-only tests cannot check, checked in minutes
on the user's own hardware, torch build, NCCL, fairseq and DomainBed (docs/benchmarks.md,
"Self-test").

* :mod:`plugins.lab.selftest.cli`: the command (``python -m plugins.lab.selftest``), the
  environment, the order of the checks, the table and the JSON report;
* :mod:`plugins.lab.selftest.checks`: the core's checks (math, mixed precision, host
  syncs, cost), one function each, which the tests run on mutants of the core;
* :mod:`plugins.lab.selftest.ranks`: DDP ranks (gloo or NCCL) against one process;
* :mod:`plugins.lab.selftest.reference`: the family's step from the paper's equations in
  float64, the reference of ``tests/core`` too;
* :mod:`plugins.lab.selftest.syncs`: the host-sync counters of ``tests/core`` too.

The hosts' checks live with the hosts and are imported only when the command runs:
:mod:`fairseq_vasso.nmt.selftest` (fairseq-train as a subprocess) and
:mod:`domainbed_vasso.selftest` (DomainBed, found at run time).  ``import plugins``
never imports this.
"""
