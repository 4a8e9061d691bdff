"""`deepspeed.ops.sparse_attention`: importable; every class is refused when built."""

from autotuner.deepspeed_paths.unsupported import unsupported_class

_NAMES = ("SparsityConfig", "DenseSparsityConfig", "FixedSparsityConfig", "VariableSparsityConfig",
          "BigBirdSparsityConfig", "BSLongformerSparsityConfig", "LocalSlidingWindowSparsityConfig",
          "SparseSelfAttention", "BertSparseSelfAttention", "SparseAttentionUtils")
globals().update({name: unsupported_class(f"ops.sparse_attention.{name}", "sparse_attention") for name in _NAMES})
__all__ = list(_NAMES)
