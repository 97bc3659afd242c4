"""deltatron: delta-rule (DeltaNet) linear attention, chunkwise WY kernels in Triton with fla's API."""
from .api import (chunk_delta_rule, chunk_gated_delta_rule, chunk_kda, fused_chunk_delta_rule,
                  fused_recurrent_delta_rule, fused_recurrent_gated_delta_rule, fused_recurrent_kda,
                  fused_sigmoid_gating_delta_rule_update, parallel_delta_rule)
from .varlen import VarlenMetadata, prepare_varlen

__version__ = "0.1.0"

__all__ = ["chunk_delta_rule", "fused_chunk_delta_rule", "fused_recurrent_delta_rule", "parallel_delta_rule",
           "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "fused_sigmoid_gating_delta_rule_update",
           "chunk_kda", "fused_recurrent_kda", "prepare_varlen", "VarlenMetadata"]
