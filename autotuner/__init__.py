"""autotuner: DeepSpeed-style training API and ZeRO / micro-batch / gas autotuner on native PyTorch.

`import autotuner as deepspeed` gives a training script the parts of DeepSpeed's API it uses:
initialize, init_distributed, add_config_arguments, get_accelerator, tp_model_init,
set_autotp_mode, PipelineModule, and the comm, utils (utils.groups too), accelerator, runtime.utils,
pipe and ops.adam modules, and deepspeed.checkpointing. Every module path DeepSpeedExamples' scripts import imports
here too (autotuner/deepspeed_paths/, at their DeepSpeed paths through its aliases.py); using a
feature we do not carry (an MoE layer, init_inference, ...) fails with one line
saying what to do instead.
"""

__version__ = "0.1.0"

import importlib

from autotuner.deepspeed_paths import aliases as _aliases
from autotuner.core.rank_setup import setup_rank as _setup_rank

_aliases.install()  # autotuner.moe.layer, autotuner.runtime.zero, ...: DeepSpeed's paths, the same modules
_setup_rank()  # in ranks: one line per error of ours rather than a traceback per rank; config warnings once

_RUNTIME = ("initialize", "add_config_arguments", "Engine")
_SUBMODULES = ("runtime", *_aliases.TOP_LEVEL)
_REFUSED = {"init_inference": "init_inference",
            "DeepSpeedTransformerLayer": "transformer_kernel", "DeepSpeedTransformerConfig": "transformer_kernel",
            "replace_transformer_layer": "module_inject"}


def __getattr__(name: str):
    # Lazy, so `launcher` and config checks start without importing torch.
    if name in _RUNTIME:
        from autotuner import runtime

        return getattr(runtime, name)
    if name == "init_distributed":
        from autotuner.runtime.comm import init_distributed

        return init_distributed
    if name in ("tp_model_init", "set_autotp_mode"):
        from autotuner.runtime import tp_init

        return getattr(tp_init, name)
    if name == "PipelineModule":
        from autotuner.runtime.pipeline.module import PipelineModule

        return PipelineModule
    if name == "get_accelerator":
        from autotuner.runtime.accelerator import get_accelerator

        return get_accelerator
    if name in _SUBMODULES:
        return importlib.import_module(f"autotuner.{name}")
    if name in _REFUSED:  # importable; refused when used
        from autotuner.deepspeed_paths.unsupported import unsupported_class, unsupported_function

        make = unsupported_function if name[0].islower() else unsupported_class
        return make(name, _REFUSED[name])
    raise AttributeError(f"module 'autotuner' has no attribute {name!r}")


__all__ = ["Engine", "__version__", "add_config_arguments", "get_accelerator", "init_distributed", "initialize",
           "set_autotp_mode", "tp_model_init"]
