"""`deepspeed.runtime.data_pipeline.data_routing.helper` (random-LTD).

Scripts call `save_without_random_ltd` at the end of every run, random-LTD or not, so it and
`remove_random_ltd_state_dict` behave as DeepSpeed's: the model's state dict with each
`.random_ltd_layer` part of a key dropped (on a model without random-LTD layers, the state dict
itself). Converting layers to random-LTD ones would train differently: refused, before training.

On our engine's FSDP2 stages (2 and 3) the parameters are DTensor shards, where DeepSpeed's ZeRO 2
keeps whole ones on every rank; scripts call this on rank 0 only. There the other ranks serve their
shards (runtime/saving/rank_zero_gather.py, whole_weights.py), so the state dict holds whole tensors (on
the host) as under DeepSpeed.
"""

from __future__ import annotations

from collections import OrderedDict

from autotuner.deepspeed_paths.unsupported import unsupported_function

_RANDOM_LTD_PART = ".random_ltd_layer"

convert_to_random_ltd = unsupported_function("runtime.data_pipeline.data_routing.helper.convert_to_random_ltd",
                                             "data_pipeline")


def remove_random_ltd_state_dict(state_dict):
    """The state dict with `.random_ltd_layer` removed from every key, in the same order."""
    renamed = OrderedDict()
    for key, value in state_dict.items():
        renamed["".join(key.split(_RANDOM_LTD_PART)) if _RANDOM_LTD_PART in key else key] = value
    return renamed


def save_without_random_ltd(model):
    """The state dict of `model.module` (or `model`), without random-LTD's key parts."""
    from autotuner.runtime.saving.rank_zero_gather import service_for
    from autotuner.runtime.saving.whole_weights import whole_tensors

    inner = model.module if hasattr(model, "module") else model
    return remove_random_ltd_state_dict(whole_tensors(inner.state_dict(), service_for(inner)))
