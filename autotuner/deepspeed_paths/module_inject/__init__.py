"""`deepspeed.module_inject`: importable; kernel injection is refused when used."""

from autotuner.deepspeed_paths.module_inject import replace_policy  # noqa: F401 - reachable as an attribute
from autotuner.deepspeed_paths.unsupported import unsupported_function

replace_transformer_layer = unsupported_function("module_inject.replace_transformer_layer", "module_inject")
