"""`deepspeed.runtime.data_pipeline.data_sampling` (data efficiency): importable; its use is refused."""
