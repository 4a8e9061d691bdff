"""A rank's virtual stage (PipelineModule.place_virtual_stages) as the module its PipelineStage
runs, and the run of a list of layers that both a chunk and an activation-checkpointed span use."""

from __future__ import annotations

from typing import Any, Callable

import torch.nn as nn


class Chunk(nn.Module):
    """One virtual stage of a rank: its layers' modules (for its PipelineStage's parameters and
    gradient scaling) and forward through the owning module's autocast and checkpointing."""

    def __init__(self, owner: Any, functions: list[Callable], modules: list[nn.Module]):
        super().__init__()
        self._owner = (owner,)  # a tuple: not registered, so the owner stays the one root
        self._functions = functions
        self.layers = nn.ModuleList(modules)

    def forward(self, *inputs: Any) -> Any:
        # (train() and eval() reach the owner and the layers, which both are children of the root)
        return self._owner[0].run_layers(self._functions, *inputs)


def run_chunk(chunk: list[Callable], *args: Any) -> Any:
    x = args[0] if len(args) == 1 else args
    for function in chunk:
        x = function(x)
    return x
