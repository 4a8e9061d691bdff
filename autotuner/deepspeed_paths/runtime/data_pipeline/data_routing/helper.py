"""`deepspeed.runtime.data_pipeline.data_routing.helper` (random-LTD).

Scripts call `save_without_random_ltd` at the end of every run, random-LTD or not, so it and
`remove_random_ltd_state_dict` behave as DeepSpeed's: the model's state dict with each
`.random_ltd_layer` part of a key dropped (on a model without random-LTD layers, the state dict
itself). Converting layers to random-LTD ones would train differently: refused, before training.

On our engine's FSDP2 stages (2 and 3) the parameters are DTensor shards, where DeepSpeed's ZeRO 2
keeps whole ones on every rank; scripts call this on rank 0 only. A script that imported this
module before initialize has its shards served to rank 0 (runtime/rank_zero_gather.py), so the
state dict holds whole tensors (on the host) as under DeepSpeed.
"""

from __future__ import annotations

from collections import OrderedDict

from autotuner.core.errors import UnsupportedError
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
    inner = model.module if hasattr(model, "module") else model
    return remove_random_ltd_state_dict(_whole_tensors(inner, inner.state_dict()))


def _whole_tensors(module, state: dict) -> dict:
    """FSDP2's shards as whole tensors: local on one rank, served by the others on several."""
    from autotuner.runtime.rank_zero_gather import service_for
    from autotuner.runtime.sharding import is_dtensor

    sharded = [key for key, value in state.items() if is_dtensor(value)]
    if not sharded:
        return state
    if all(state[key].device_mesh.size() == 1 for key in sharded):
        return OrderedDict((key, value.to_local() if is_dtensor(value) else value) for key, value in state.items())
    service = service_for(module)
    if service is None:
        raise UnsupportedError(f"save_without_random_ltd: {sharded[0]} is sharded over "
                               f"{state[sharded[0]].device_mesh.size()} ranks (ZeRO stage 2/3 here is FSDP2) and this "
                               "module was imported after initialize, when one rank's gather is set up; import it "
                               "before initialize, or save with engine.save_16bit_model(dir) on every rank")
    return service.whole_state_dict(state)
