#!/usr/bin/env python
"""What SAM, VASSO and eVASSO cost over their base optimizer (AdamW), measured side by side.

    .venv/bin/python scripts/benchmark.py --help

The command is :mod:`plugins.lab.bench.cli`; this recipe hands it the fairseq-train
comparison (:mod:`fairseq_vasso.nmt.bench`). docs/benchmarks.md says how it measures.
"""

import sys

from fairseq_vasso.nmt.bench import run_fairseq
from plugins.lab.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(run_fairseq=run_fairseq))
