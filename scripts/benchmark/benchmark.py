#!/usr/bin/env python
"""What SAM, VASSO and eVASSO cost over their base optimizer (AdamW), measured side by side.

    .venv/bin/python scripts/benchmark/benchmark.py --help

The parts are the package beside this file (:mod:`vasso_bench`); docs/benchmarks.md says
how it measures.
"""

import sys

from vasso_bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
