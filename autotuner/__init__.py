"""autotuner: DeepSpeed-style training API and ZeRO / micro-batch / gas autotuner on native PyTorch."""

__version__ = "0.1.0"

from autotuner.rank_setup import setup_rank as _setup_rank

_setup_rank()  # in ranks: one line per error of ours rather than a traceback per rank; warnings once


def __getattr__(name: str):
    # Lazy, so `launcher` and config checks start without importing torch.
    if name in ("initialize", "add_config_arguments", "Engine"):
        from autotuner import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'autotuner' has no attribute {name!r}")


__all__ = ["Engine", "__version__", "add_config_arguments", "initialize"]
