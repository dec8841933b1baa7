import os
import sys

import torch

# The core tests import their shared helpers as a top-level module.
sys.path.insert(0, os.path.dirname(__file__))
# Tiny tensors: one thread avoids OpenMP spinning against other processes on 2 cores.
torch.set_num_threads(1)
