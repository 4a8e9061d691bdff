"""The engine's training parts: optimizers and schedules, the ZeRO stages' wrappers, gradient
reduction, fp16 loss scaling, activation checkpointing, torch.compile, DeepSpeed's engine accessors."""
