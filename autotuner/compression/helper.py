"""`deepspeed.compression.helper`: the model-surgery helpers, refused when used."""

from autotuner.unsupported import unsupported_function

convert_conv1d_to_linear = unsupported_function("compression.helper.convert_conv1d_to_linear", "compression")
recursive_getattr = unsupported_function("compression.helper.recursive_getattr", "compression")
recursive_setattr = unsupported_function("compression.helper.recursive_setattr", "compression")
