"""`deepspeed.runtime.domino.transformer`: importable, refused when built."""

from autotuner.unsupported import unsupported_class

DominoTransformer = unsupported_class("runtime.domino.transformer.DominoTransformer", "domino")
