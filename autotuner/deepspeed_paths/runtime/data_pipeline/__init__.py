"""`deepspeed.runtime.data_pipeline` (data efficiency): importable; its use is refused."""
