"""`deepspeed.module_inject`: importable; kernel injection is refused when used. `set_autotp_mode`
is DeepSpeed's (also at the top level), noted only: our engine trains, and splits at initialize."""

from autotuner.deepspeed_paths.module_inject import replace_policy  # noqa: F401 - reachable as an attribute
from autotuner.deepspeed_paths.unsupported import unsupported_function

replace_transformer_layer = unsupported_function("module_inject.replace_transformer_layer", "module_inject")


def __getattr__(name: str):
    if name == "set_autotp_mode":  # lazily: the engine's modules import torch
        from autotuner.runtime.tp_init import set_autotp_mode

        return set_autotp_mode
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
