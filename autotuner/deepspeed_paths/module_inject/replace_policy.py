"""`deepspeed.module_inject.replace_policy`: importable; every policy is refused when built."""

from autotuner.deepspeed_paths.unsupported import unsupported_class

HFGPT2LayerPolicy = unsupported_class("module_inject.replace_policy.HFGPT2LayerPolicy", "module_inject")
HFBertLayerPolicy = unsupported_class("module_inject.replace_policy.HFBertLayerPolicy", "module_inject")
