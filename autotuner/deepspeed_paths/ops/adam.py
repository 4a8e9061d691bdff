"""`FusedAdam` and `DeepSpeedCPUAdam` (from `deepspeed.ops.adam`) as torch's Adam/AdamW.

DeepSpeed's kernels compute the same update as torch's fused/foreach implementations; their
defaults are kept (decoupled weight decay on). `bias_correction=False` changes the update and
has no torch equivalent, so it is refused.
"""

from __future__ import annotations

from typing import Iterable

import torch

from autotuner.core.errors import UnsupportedError


def _adam(name: str, params: Iterable, lr: float, bias_correction: bool, betas: tuple[float, float], eps: float,
          weight_decay: float, amsgrad: bool, decoupled: bool) -> torch.optim.Optimizer:
    if not bias_correction:
        raise UnsupportedError(f"{name}(bias_correction=False): torch's Adam always corrects the bias; "
                               "drop the argument")
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    return cls(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)


def FusedAdam(params: Iterable, lr: float = 1e-3, bias_correction: bool = True,  # noqa: N802 (DeepSpeed's name)
              betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
              weight_decay: float = 0.0, amsgrad: bool = False,
              set_grad_none: bool = True) -> torch.optim.Optimizer:
    return _adam("FusedAdam", params, lr, bias_correction, betas, eps, weight_decay, amsgrad, adam_w_mode)


def DeepSpeedCPUAdam(model_params: Iterable, lr: float = 1e-3, bias_correction: bool = True,  # noqa: N802
                     betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0,
                     amsgrad: bool = False, adamw_mode: bool = True,
                     fp32_optimizer_states: bool = True) -> torch.optim.Optimizer:
    return _adam("DeepSpeedCPUAdam", model_params, lr, bias_correction, betas, eps, weight_decay, amsgrad,
                 adamw_mode)
