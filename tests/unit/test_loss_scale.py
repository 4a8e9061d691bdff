"""fp16 loss scaling with DeepSpeed's rule on torch's GradScaler (autotuner/runtime/training/loss_scale.py),
stepped on CPU: a gradient made infinite is an overflow. No processes."""

from __future__ import annotations

import torch

from autotuner.config.models import FP16Config
from autotuner.runtime.training.loss_scale import LossScaler


def run(fp16: dict, overflows: list[bool]) -> tuple[list[float], list[bool], LossScaler]:
    """The scale after each step, whether each step was applied, and the scaler."""
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    scaler = LossScaler(FP16Config(enabled=True, **fp16), torch.device("cpu"), sharded=False)
    scales, applied = [], []
    for overflow in overflows:
        loss = (weight * (float("inf") if overflow else 1.0)).sum()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        applied.append(scaler.step(optimizer))
        optimizer.zero_grad(set_to_none=True)
        scales.append(scaler.get_scale())
    return scales, applied, scaler


def test_a_static_scale_skips_overflowing_steps_and_stays():
    # torch's scaler alone halved it: 64, 32, 16.
    scales, applied, _ = run({"loss_scale": 128.0}, [True, True, True, False])
    assert scales == [128.0] * 4 and applied == [False, False, False, True]


def test_the_dynamic_scale_uses_its_hysteresis_first_and_never_goes_below_the_floor():
    # DeepSpeed: the first overflow uses up hysteresis 2 (the scale stays), then each halves, down to min_loss_scale.
    scales, applied, _ = run({"initial_scale_power": 4, "hysteresis": 2, "min_loss_scale": 4.0}, [True] * 4)
    assert scales == [16.0, 8.0, 4.0, 4.0] and applied == [False] * 4


def test_the_dynamic_scale_doubles_after_its_window_and_refills_the_hysteresis():
    # Window 2: after an overflow (hysteresis 2 -> 1), two clean steps double the scale and refill it,
    # so the next overflow leaves the scale where it is again.
    scales, applied, _ = run({"initial_scale_power": 4, "loss_scale_window": 2, "hysteresis": 2},
                             [True, False, False, False, True])
    assert scales == [16.0, 16.0, 16.0, 32.0, 32.0] and applied == [False, True, True, True, False]


def test_consecutive_hysteresis_refills_on_any_clean_step():
    scales, _, _ = run({"initial_scale_power": 4, "hysteresis": 2, "consecutive_hysteresis": True},
                       [True, False, True, True])
    assert scales == [16.0, 16.0, 16.0, 8.0]
    scales, _, _ = run({"initial_scale_power": 4, "hysteresis": 2}, [True, False, True, True])
    assert scales == [16.0, 16.0, 8.0, 4.0]


def test_a_checkpoint_keeps_the_scale_and_the_hysteresis_left():
    _, _, before = run({"initial_scale_power": 4, "hysteresis": 3}, [True])
    _, _, after = run({"initial_scale_power": 4, "hysteresis": 3}, [])
    after.load_state_dict(before.state_dict())
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    for _ in range(2):  # hysteresis 3, one used before the checkpoint: the second overflow here halves
        after.scale((weight * float("inf")).sum()).backward()
        after.unscale_(optimizer)
        after.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
    assert after.get_scale() == 8.0
