"""`deepspeed.compression.compress`: importable, refused when used."""

from autotuner.deepspeed_paths.unsupported import unsupported_function

init_compression = unsupported_function("compression.compress.init_compression", "compression")
redundancy_clean = unsupported_function("compression.compress.redundancy_clean", "compression")
