"""A tensor-parallel degree predicted from the profile at degree 1 (issue 80, part 1): the activation
probe's split regions (runtime/measure/profile.py), and the profile moved to a degree
(tuning/memory/degree_prediction.py). Pure: no launches."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from autotuner.runtime.measure.profile import ActivationProbe
from autotuner.runtime.training.tp_plan import plan_styles
from autotuner.tuning.memory.degree_prediction import profile_at_degree
from autotuner.tuning.memory.estimate import ModelProfile, StageSettings, estimate

B, D = 8, 16


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.up_proj, self.down_proj = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        return x + self.down_proj(torch.relu(self.up_proj(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Mlp(), Mlp()])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_the_probe_counts_what_the_plan_would_split_from_a_column_layers_output_to_the_next_row_layers_input():
    model = Net()
    styles = plan_styles(model)
    assert dict(styles) == {f"blocks.{i}.{n}": s for i in (0, 1) for n, s in (("up_proj", "colwise"),
                                                                               ("down_proj", "rowwise"))}
    probe = ActivationProbe(list(model.parameters()), list(model.blocks), model=model)
    probe.watch_split_regions(model, styles)
    probe.start()
    model(torch.randn(B, D, requires_grad=True)).sum().backward()
    probe.stop()
    # Each block: up_proj saves its input x (whole), relu its output (split), which down_proj saves
    # again as its input (the same storage, counted once).
    assert probe.split_bytes == 2 * B * 4 * D * 4
    assert probe.bytes_saved - probe.split_bytes == 2 * B * D * 4
    # A column layer splits its weight and bias; a row layer its weight (its bias is added whole).
    assert probe.splittable_params == 2 * (4 * D * D + 4 * D + D * 4 * D)


def test_a_profile_moved_to_a_degree_splits_what_the_probe_said_and_keeps_the_rest_whole():
    one = ModelProfile(num_params=10_000, activation_bytes_per_sample=1_000, baseline_bytes=5_000,
                       splittable_num_params=8_000, split_activation_bytes_per_sample=600)
    two = profile_at_degree(one, 2)
    assert (two.tensor_parallel, two.split_num_params, two.activation_bytes_per_sample) == (2, 8_000, 700)
    assert two.params_per_tp_rank == 2_000 + 4_000 and two.baseline_bytes == 5_000
    settings = StageSettings(0, "fp32", 2)
    assert estimate(two, settings, 4).total < estimate(one, settings, 4).total
    assert profile_at_degree(one, 1) is None  # nothing to move
    assert profile_at_degree(dataclasses.replace(one, splittable_num_params=0), 2) is None  # nothing splits
    assert profile_at_degree(two, 4) is None  # a profile at degree 2 is its own degree's
