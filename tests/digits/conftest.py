import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
for p in (ROOT, os.path.join(ROOT, "scripts")):
    if p not in sys.path:
        sys.path.insert(0, p)

import torch

# The models here are tiny: one thread avoids spinning threads on a shared 2-core machine.
torch.set_num_threads(1)
