"""`deepspeed.runtime.domino`: importable; Domino tensor parallelism is refused when used."""
