"""chunk_delta_rule in Triton: the chunkwise WY algorithm (docs/DESIGN.md §2-§7).

    plan.py      one frozen plan per call: every rule, threshold and launch configuration, with reasons
    forward.py   executes the plan's forward; backward.py its backward
    portable/    Triton stages that run on every GPU and in the interpreter: wy (with kkt, solve_tril), walk, output,
                 reverse, grads, wy_bwd
    hopper/      Gluon stages for sm_90 with the same names: walk, reverse
    schedule/    the sequence split and the segmented backward

The batch is packed (kernels/utils.py): q, k [1, TT, H, K], v [1, TT, H, V], beta [1, TT, H] with TT = B*T, the
sequences given by a SeqInfo and the chunks by its ChunkIndex; per-chunk tensors are indexed by the global chunk."""
from .backward import backward
from .forward import forward, plan_call

__all__ = ["forward", "backward", "plan_call"]
