"""`deepspeed.ops.op_builder`: importable; building a compiled op is refused."""

from autotuner.deepspeed_paths.unsupported import unsupported_class

AsyncIOBuilder = unsupported_class("ops.op_builder.AsyncIOBuilder", "op_builder")
GDSBuilder = unsupported_class("ops.op_builder.GDSBuilder", "op_builder")
CPUAdamBuilder = unsupported_class("ops.op_builder.CPUAdamBuilder", "op_builder")
FusedAdamBuilder = unsupported_class("ops.op_builder.FusedAdamBuilder", "op_builder")
