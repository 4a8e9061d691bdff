"""DeepSpeed features we do not carry. Importing their modules always works, since real scripts
import far more than they use; *using* one fails with one line saying what to do instead
(UnsupportedError: exit status 2, no traceback without --debug)."""

from __future__ import annotations

from typing import Any, Callable

from autotuner.core.errors import UnsupportedError

DATA_PARALLEL = "every rank is data parallel here"
REASONS = {
    "moe": f"mixture-of-experts layers (expert parallelism) are not supported; {DATA_PARALLEL}",
    "init_inference": "inference engines are not supported; autotuner tunes and runs training",
    "data_pipeline": "DeepSpeed's data efficiency library (curriculum learning, random-LTD, data analysis) is "
                     "not supported; feed your DataLoader's batches to the engine as they are",
    "sparse_attention": "DeepSpeed's sparse attention kernels are not supported; use the model's dense "
                        "attention (torch's scaled_dot_product_attention)",
    "op_builder": "DeepSpeed's compiled ops (op_builder) are not supported; the engine uses torch's own ops",
    "compression": "DeepSpeed's compression library (quantization, pruning) is not supported",
    "module_inject": "kernel injection (module_inject) is an inference feature, which is not supported",
    "transformer_kernel": "DeepSpeed's fused transformer kernel is not supported; use the model's own layers",
    "domino": f"Domino tensor parallelism is not supported; {DATA_PARALLEL}",
}


def refuse(feature: str) -> UnsupportedError:
    return UnsupportedError(f"deepspeed.{feature} is not supported by autotuner: {REASONS[feature]}")


def unsupported_function(name: str, feature: str) -> Callable[..., Any]:
    """A stand-in for deepspeed.<name>: importable, refused when called."""
    def refused(*_args: Any, **_kwargs: Any) -> Any:
        raise refuse(feature)

    refused.__name__ = refused.__qualname__ = name.rsplit(".", 1)[-1]
    refused.__doc__ = f"deepspeed.{name}: not supported ({REASONS[feature]})."
    refused.refused_feature = feature  # whatever its arguments: the signature test reads this
    return refused


def unsupported_class(name: str, feature: str) -> type:
    """A stand-in for the class deepspeed.<name>: importable and subclassable (scripts subclass
    MoE layers), refused when instantiated."""
    def refused_init(self, *_args: Any, **_kwargs: Any) -> None:
        raise refuse(feature)

    short = name.rsplit(".", 1)[-1]
    return type(short, (), {"__init__": refused_init, "__doc__": f"deepspeed.{name}: not supported "
                                                                 f"({REASONS[feature]}).", "__module__": __name__,
                            "refused_feature": feature})
