"""`tensor_parallel`: DeepSpeed's AutoTP training section (its `TPTrainingConfig`, 0.19.8), with
DeepSpeed's keys, nesting and defaults, so a DeepSpeed AutoTP config loads as it is.

`autotp_size` above 1 splits the model's Linear layers over that many ranks of a node (torch's
DTensor on our engine, runtime/training/tensor_parallel.py) and divides the data-parallel size
by it. What the section holds beyond that is either honoured here or refused in one line by
`refuse_unsupported` (config/engine_math.py calls it), never taken and left unused.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Optional

from pydantic import AliasChoices, Field

from autotuner.config.base import NonNegativeInt, PositiveInt, Section
from autotuner.core.errors import ConfigError


class TPGroupConfig(Section):
    """DeepSpeed's `TPConfig`, nested under `tensor_parallel.tp` (its field `tensor_parallel`, alias `tp`)."""

    tp_size: PositiveInt = Field(1, description="1, or the same as autotp_size (DeepSpeed refuses another value)")
    tp_grain_size: PositiveInt = Field(1, description="DeepSpeed's split granularity for uneven widths; only 1 "
                                                      "here, where every split is even")


class TensorParallelConfig(Section):
    autotp_size: NonNegativeInt | Literal["auto"] | list[PositiveInt] = Field(
        0, description="ranks each Linear layer is split over (DeepSpeed's AutoTP training); 0 or 1: no tensor "
                       "parallelism. Divides the data-parallel size: dp = world / autotp_size. In a tune, \"auto\" "
                       "searches the divisors of the ranks per node, and a list those degrees")
    tp_overlap_comm: bool = Field(False, description="DeepSpeed overlaps a column layer's input-gradient all-reduce "
                                                     "with its weight gradient; a speed knob, no effect here")
    dtype: Any = Field(None, description="the dtype tp_model_init was given (DeepSpeed checks it against bf16/fp16)")
    vocab_parallel_lm_head: Optional[bool] = Field(None, description="not carried: refused when true")
    vocab_parallel_ce_backend: Literal["torch", "liger"] = "torch"
    tp: TPGroupConfig = Field(default_factory=TPGroupConfig,
                              validation_alias=AliasChoices("tp", "tensor_parallel"))
    partition_config: Optional[dict[str, Any]] = Field(None, description="DeepSpeed's custom layer specs: not "
                                                                         "carried yet, refused")
    preset_model: Optional[str] = Field(None, description="DeepSpeed's per-family presets: not carried yet, refused")
    keep_module_on_host: bool = Field(False, description="keep the shards in host memory; on a CPU-only machine "
                                                         "they are there anyway, on CUDA refused")
    replace_with_kernel_inject: bool = Field(False, validation_alias=AliasChoices("replace_with_kernel_inject",
                                                                                  "kernel_inject"),
                                             description="DeepSpeed's inference kernels: refused in training")
    injection_policy_tuple: Any = Field(None, description="DeepSpeed-internal; refused when set")

    @property
    def searched(self) -> bool:
        """Whether a tune settles the degree ("auto" or a list): outside one it is refused
        (config/sections.py's tuned keys), so an engine never reads it unsettled."""
        return not isinstance(self.autotp_size, int)

    @property
    def size(self) -> int:
        """The tensor-parallel degree: 1 when the section is off (DeepSpeed's 0 and 1 both mean off)."""
        if self.searched:
            raise ConfigError(f"tensor_parallel.autotp_size: got {json.dumps(self.autotp_size)}; it is settled by "
                              "--autotuning tune|run; give an integer to train")
        return max(1, self.autotp_size)


def refuse_unsupported(section: TensorParallelConfig, source: str) -> None:
    """What of the section our engine does not carry, refused in one line (DeepSpeed would act on it)."""
    if section.searched:  # a tune tries degrees above 1: what none of them carries is refused now
        if section.tp.tp_size != 1:
            raise ConfigError(f"{source}: tensor_parallel.tp.tp_size {section.tp.tp_size}: with autotp_size "
                              f"{json.dumps(section.autotp_size)} the tune settles the degree; leave tp.tp_size at 1")
    else:
        tp = section.size
        if tp == 1:
            return
        if section.tp.tp_size not in (1, tp):
            raise ConfigError(f"{source}: tensor_parallel.tp.tp_size {section.tp.tp_size}: must be 1 or autotp_size "
                              f"({tp}), as DeepSpeed requires")
    refused = {
        "partition_config": (section.partition_config is not None,
                             "DeepSpeed's custom layer specs are not carried; the model's Hugging Face plan or "
                             "AutoTP's rule splits it here"),
        "preset_model": (section.preset_model is not None,
                         "DeepSpeed's per-family presets are not carried; the model's Hugging Face plan or "
                         "AutoTP's rule splits it here"),
        "vocab_parallel_lm_head": (bool(section.vocab_parallel_lm_head),
                                   "the vocabulary-parallel head and loss are not carried; the head stays whole"),
        "replace_with_kernel_inject": (section.replace_with_kernel_inject,
                                       "DeepSpeed's inference kernels do not train"),
        "injection_policy_tuple": (section.injection_policy_tuple is not None, "DeepSpeed-internal"),
        "tp.tp_grain_size": (section.tp.tp_grain_size != 1,
                             "DeepSpeed's uneven splits in multiples of the grain are not carried; every split is "
                             "even here"),
    }
    for key, (given, why) in refused.items():
        if given:
            raise ConfigError(f"{source}: tensor_parallel.{key}: {why}; remove it, or train on DeepSpeed's engine")
