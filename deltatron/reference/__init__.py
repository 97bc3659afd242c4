"""Pure-PyTorch delta rule: the float64 oracles of every kernel (DESIGN.md §10) and the CPU backend of the public
API (§9); the gated delta rule's oracles (§11), which also
take KDA's per-channel gate (§12)."""
from .chunk import chunk_delta_rule_reference, intra_chunk_wy
from .common import L2NORM_EPS, l2norm
from .gated import (
    chunk_gated_delta_rule_backward_reference,
    chunk_gated_delta_rule_reference,
    recurrent_gated_delta_rule,
)
from .parallel import parallel_delta_rule_reference
from .recurrent import recurrent_delta_rule

__all__ = [
    "recurrent_delta_rule",
    "chunk_delta_rule_reference",
    "parallel_delta_rule_reference",
    "intra_chunk_wy",
    "l2norm",
    "L2NORM_EPS",
    "recurrent_gated_delta_rule",
    "chunk_gated_delta_rule_reference",
    "chunk_gated_delta_rule_backward_reference",
]
