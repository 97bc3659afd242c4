"""Pure-PyTorch delta rule: the float64 oracles of every kernel (DESIGN.md §10) and the CPU backend of the public
API (§9)."""
from .chunk import chunk_delta_rule_reference, intra_chunk_wy
from .common import L2NORM_EPS, l2norm
from .parallel import parallel_delta_rule_reference
from .recurrent import recurrent_delta_rule

__all__ = [
    "recurrent_delta_rule",
    "chunk_delta_rule_reference",
    "parallel_delta_rule_reference",
    "intra_chunk_wy",
    "l2norm",
    "L2NORM_EPS",
]
