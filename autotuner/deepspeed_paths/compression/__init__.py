"""`deepspeed.compression`: importable; its use is refused (compression/compress.py, helper.py)."""
