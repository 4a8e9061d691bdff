"""`deepspeed.inference.v2`: importable; inference engines are refused when configured."""
