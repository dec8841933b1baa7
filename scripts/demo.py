#!/usr/bin/env python
"""The main job: AdamW vs SAM vs VASSO on a small translation task with noisy training
targets, 3 seeds each, scored with BLEU, with the sharpness diagnostics and their plots.

    .venv/bin/python scripts/demo.py          # everything under runs/demo/; --help for options

The code is the installed module ``fairseq_vasso.nmt.demo``; docs/translation.md says why
this setting and shows a full run's table.
"""

import sys

from fairseq_vasso.nmt.demo import main

if __name__ == "__main__":
    sys.exit(main())
