"""What the pipeline engine reads from a data iterator's items and hands back per micro-batch:
(inputs, labels) as DeepSpeed's pipeline reads them, refused in one line when they are not
tensors a schedule can send between stages."""

from __future__ import annotations

from typing import Any

import torch

from autotuner.core.errors import ConfigError


def as_tuple(value: Any, what: str) -> tuple[torch.Tensor, ...]:
    parts = tuple(value) if isinstance(value, (tuple, list)) else (value,)
    if not parts or not all(isinstance(part, torch.Tensor) for part in parts):
        raise ConfigError(f"train_batch(): the {what} must be a tensor or a tuple of tensors, as a pipeline sends "
                          "them between stages")
    return parts


def join_labels(labels: list[Any], device: torch.device) -> Any:
    if all(isinstance(label, torch.Tensor) for label in labels):
        return torch.cat(labels).to(device)
    raise ConfigError("train_batch(): the labels must be a tensor per micro-batch (the loss_fn's second argument)")


def split_micro_batches(value: Any, count: int) -> list[Any]:
    if isinstance(value, torch.Tensor):
        return list(torch.tensor_split(value, count))
    return [value]
