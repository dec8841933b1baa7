import torch

# The models here are tiny: one thread avoids spinning threads on a shared 2-core machine.
torch.set_num_threads(1)
