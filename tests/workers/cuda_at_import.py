"""A module that initialises CUDA when imported (a library doing device work at import): preloading it
in the warm runner's forkserver must make the tuner fall back to cold launches."""

import torch

if torch.cuda.is_available():
    torch.cuda.init()
    torch.zeros(1, device="cuda")
