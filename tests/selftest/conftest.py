import torch

# Tiny tensors: one thread avoids OpenMP spinning against other processes on 2 cores.
torch.set_num_threads(1)
