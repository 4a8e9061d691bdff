"""`deepspeed.compression.helper`: the dotted-name module helpers scripts import from here (DeepSpeed
0.19 keeps them here for those scripts, defined in deepspeed.utils.module_utils). The compression
library's own surgery is refused when used."""

from autotuner.deepspeed_paths.unsupported import unsupported_function
from autotuner.deepspeed_paths.utils.module_utils import recursive_getattr, recursive_setattr

convert_conv1d_to_linear = unsupported_function("compression.helper.convert_conv1d_to_linear", "compression")

__all__ = ["convert_conv1d_to_linear", "recursive_getattr", "recursive_setattr"]
