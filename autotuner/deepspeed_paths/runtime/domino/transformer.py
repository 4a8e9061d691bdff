"""`deepspeed.runtime.domino.transformer`: importable, refused when built."""

from autotuner.deepspeed_paths.unsupported import unsupported_class

DominoTransformer = unsupported_class("runtime.domino.transformer.DominoTransformer", "domino")
