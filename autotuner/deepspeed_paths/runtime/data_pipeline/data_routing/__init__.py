"""`deepspeed.runtime.data_pipeline.data_routing` (data efficiency): importable; its use is refused."""
