"""chunk_delta_rule in Triton: the chunkwise WY pipeline of DESIGN.md §2-§4.

Layout: the batch is packed (see kernels/utils.py): q, k [1, TT, H, K], v [1, TT, H, V], beta [1, TT, H]
with TT = B*T, sequences given by info (SeqInfo) and chunks by info.chunks(chunk_size) (ChunkIndex).
Per-chunk tensors are indexed by the global chunk number (chunk_offsets[seq] + chunk within seq).

Forward stages (each its own module):
    kkt.chunk_kkt(k, beta, info, chunk_size) -> A                 [1, TT, H, C] fp32, strictly lower
    solve_tril.solve_tril(A, info, chunk_size) -> Tinv            [1, TT, H, C] fp32, (I + A)^{-1}
    wy.recompute_w_u(k, v, beta, Tinv, info, chunk_size) -> (w, u)   W = Tinv (beta*K), U = Tinv (beta*V)
    state.state_fwd(k, w, u, initial_state, output_final_state, info, chunk_size)
        -> (h [NT, H, K, V] state entering each chunk, v_new [1, TT, H, V] = U - W S, final_state)
    output.output_fwd(q, k, v_new, h, scale, info, chunk_size) -> o   O = scale (Q S + (Q K^T ⊙ M) V')
Where state.fused_output_pays (many heads x sequences, 16-bit, K <= 128), the forward runs two launches:
wy.wy_fwd and state.state_output_fwd, the state pass with the output fused in (it computes each chunk's O
while S and V' are on chip, so h and v_new never reach HBM; on S^T where state.transposed_walk_pays, as
the warp-specialized Gluon kernel of gluon_walk.py where state.gluon_walk_pays);
elsewhere the three stages above. Where the Gluon walk runs (state.residual_walk_runs; seq_split.residual_runs
for split sequences), the forward makes no W, U at all: wy.tinv_pair_fwd stores Tinv diag(beta) as its 16-bit
pair, and the walks form V' = Tb (V - K S) on chip (U - W S rearranged: gluon_walk.py's residual form). Where
seq_split.SEQ_SPLIT says so (few sequences x heads on long sequences), the walk runs on partitions of the long
sequences, from the states entering them that seq_split.partition_states computes with two more walks and a small
combine (seq_split.py). The backward recomputes h and v_new with the plain walk, and the tests check the fused pass
against the composition.
Backward stages (backward.py composes them):
    recompute w, h, v_new from the saved Tinv: where state.wy_on_chip, in one launch (state.state_wy_fwd:
        the walk computes W, U per chunk on chip and writes W only), else wy.recompute_w_u, then
        state.state_fwd (the tests check the one against the other, bit for bit), which may run on a side
        CUDA stream beside the reverse pass (backward.OVERLAP_STATE_PASSES);
    reverse state pass (dS per chunk, dh0, full dV'), computing the local dV' = scale (Q K^T ⊙ M)^T dO
        itself (state_bwd.state_bwd with dv_local=None; output_bwd.dv_local is the unfused stage);
    dQ, dK, dW; WY backward (dK, dV, dbeta) through Tinv.
forward/backward below follow the contract of deltatron.autograd."""
from __future__ import annotations

from typing import Optional

import torch

from ..utils import SeqInfo
from . import seq_split
from .backward import backward, keeps_forward_states
from .output import output_fwd
from .state import fused_output_pays, residual_walk_runs, state_fwd, state_output_fwd, states_buffers
from .wy import tinv_pair_fwd, wy_fwd

__all__ = ["forward", "backward"]


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, scale: float,
            initial_state: Optional[torch.Tensor], output_final_state: bool, info: SeqInfo,
            needs_backward: bool = True, chunk_size: int = 64, save_states: bool = False):
    """o, final_state, saved = (Tinv,) (or () without needs_backward), extras = (). A, Tinv, W, U in one
    kernel (wy_fwd), then the state pass with the output fused in where that is faster (state.
    fused_output_pays), else the state pass and the output apart; on partitions of the long sequences where
    seq_split says so. Only Tinv is saved (the same split or not): W, U and the per-chunk states are recomputed;
    without needs_backward it is not even written out. With save_states, where backward.keeps_forward_states, the
    Gluon walk also saves its states and saved = (Tinv, W, S^T, V'^T): the backward recomputes nothing. Where the
    residual form runs (state.residual_walk_runs on whole sequences, where no states are kept: they need W;
    seq_split.residual_runs where the split runs), no W, U at all: tinv_pair_fwd makes Tinv diag(beta) as its 16-bit
    pair Tb and the Gluon walks form V' = Tb (V - K S); saved as above."""
    split = seq_split.plan_for(k, v, info, chunk_size)
    kept = needs_backward and save_states and split is None and keeps_forward_states(q, k, v, info, chunk_size)
    if split is not None:
        residual = seq_split.residual_runs(q, k, v, split, chunk_size)
    else:  # (kept states need W)
        residual = not kept and residual_walk_runs(q, k, v, info, chunk_size)
    if residual:  # the walks' W and U slots take Tb and V
        tinv, w = tinv_pair_fwd(k, beta, info, chunk_size, store_tinv=needs_backward)
        u = v
    else:
        tinv, w, u = wy_fwd(k, v, beta, info, chunk_size, store_tinv=needs_backward)
    if split is not None:  # the walk below runs on the partitions, from the states entering them
        initial_state = seq_split.partition_states(q, k, w, u, initial_state, split, chunk_size, residual)
        info = split.parts
    states = states_buffers(k, v, info, chunk_size) if kept else None
    # (the residual form and keeps_forward_states imply the fused Gluon walk)
    if residual or kept or fused_output_pays(k, v, info, chunk_size):
        o, final_state = state_output_fwd(q, k, w, u, scale, initial_state, output_final_state, info, chunk_size,
                                          states, residual)
        if kept:
            return o, final_state, (tinv, w, *states), ()
    else:
        h, v_new, final_state = state_fwd(k, w, u, initial_state, output_final_state, info, chunk_size)
        del w, u  # not needed by the output: its peak is h, v_new and o
        o = output_fwd(q, k, v_new, h, scale, info, chunk_size)
    if split is not None and final_state is not None:  # each sequence's last partition's
        final_state = final_state.index_select(0, split.last_part)
    return o, final_state, (tinv,) if needs_backward else (), ()
