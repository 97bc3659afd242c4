"""The chunk forward: executes the call's plan (plan.py), which has made every choice (docs/DESIGN.md §5-§7).

    WY stage:  portable.wy: T~ per chunk, and W, U (or, in the residual form, T~ diag(beta) as its 16-bit pair Tb)
    split:     where the plan splits long sequences, pass 1 and the combine give the state entering each partition
               (schedule/seq_split.py), and the walk below runs on the partitions
    walk:      hopper.walk or portable.walk with the output fused in, or portable.walk then portable.output
The gated rule (g given, DESIGN.md §11) first sums g along each chunk into γ (portable.gate), which every stage takes
under its USE_G constexpr. KDA's per-channel gate (g [.., TT, H, K], DESIGN.md §12): portable.gate first sums g within
sub-chunks of 16 tokens (channel_sums_stage), and the stages form their exponents from those sums under USE_GK; the
WY stage forms the output's scores P and exp(Γ) ⊙ Q beside A, so the output stage multiplies only.
Grouped value heads (v's heads a multiple of q's and k's) run per value head.
Saved for the backward: T~ (the backward recomputes the rest), with KDA's the scores P (grads.dv_local reads them), or, where the plan keeps states, T~, W and the walk's per-chunk S^T and V'^T."""
from __future__ import annotations

from typing import Optional

import torch

from ..utils import SeqInfo
from .plan import ChunkPlan, call_plan
from .portable.gate import channel_decay_buffers, stage_gates
from .portable.output import output_fwd
from .portable.walk import state_fwd, state_output_fwd
from .portable.wy import tinv_pair_fwd, wy_fwd
from .schedule.seq_split import partition_states, split_plan_for


def plan_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, info: SeqInfo, needs_backward: bool,
              chunk_size: int = 64, save_states: bool = False, g: Optional[torch.Tensor] = None,
              output_chunk_states: bool = False) -> ChunkPlan:
    """The plan of a call on these (contiguous) tensors, under the calling context's overrides; g: the gated rule's
    log decays."""
    aligned = q.data_ptr() % 16 == 0 and k.data_ptr() % 16 == 0 and v.data_ptr() % 16 == 0
    return call_plan(q.dtype, v.shape[2], k.shape[3], v.shape[3], info.num_seqs, info.total_tokens, chunk_size,
                     needs_backward, save_states, aligned, q.device, g is not None, k.shape[2], output_chunk_states,
                     info.prepared, g is not None and g.dim() == 4)


def walk_with_output(plan: ChunkPlan, q, k, w, u, scale, initial_state, output_final_state, info, states=None,
                     gam=None, gk=None):
    """The plan's fused walk: (o, final_state or None). states: the buffers the Hopper walk stores S^T, V'^T in;
    gam: the gated rule's γ; gk: KDA's g (the portable walk only: the plan says so)."""
    if plan.walk == "hopper":
        from .hopper.walk import gluon_state_output_fwd
        return gluon_state_output_fwd(q, k, w, u, scale, initial_state, output_final_state, info,
                                      plan.problem.chunk_size, block_v=plan.walk_launch.block_v, checked=True,
                                      states=states, residual=plan.residual, gam=gam)
    return state_output_fwd(q, k, w, u, scale, initial_state, output_final_state, info, plan.problem.chunk_size,
                            cfg=plan.walk_launch, gam=gam, gk=gk)


def walk_final_states(plan: ChunkPlan, q, k, w, u, initial_state, info) -> torch.Tensor:
    """The final states [N, H, K, V] fp32 of the plan's fused walk, bit for bit, without its output where the walk
    has such a variant (the Hopper walk without its output partition); the split's pass 1."""
    if plan.walk == "hopper":
        from .hopper.walk import gluon_state_final_fwd
        return gluon_state_final_fwd(k, w, u, initial_state, info, plan.problem.chunk_size,
                                     block_v=plan.walk_launch.block_v, checked=True, residual=plan.residual)
    return state_output_fwd(q, k, w, u, 1.0, initial_state, True, info, plan.problem.chunk_size)[1]


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, scale: float,
            initial_state: Optional[torch.Tensor], output_final_state: bool, info: SeqInfo,
            needs_backward: bool = True, chunk_size: int = 64, save_states: bool = False,
            plan: Optional[ChunkPlan] = None, g: Optional[torch.Tensor] = None, output_chunk_states: bool = False):
    """(o, final_state, saved, extras) by deltatron.autograd's contract; plan: the call's (made here if None);
    g: the gated rule's log decays [.., TT, H] (the backward sums them again rather than keep γ), or KDA's
    [.., TT, H, K]. extras: () or, with
    output_chunk_states, (the state entering every chunk [NT, H, K, V] fp32,), from the walk that stores them."""
    if plan is None:
        plan = plan_call(q, k, v, info, needs_backward, chunk_size, save_states, g, output_chunk_states)
    gam, gk = stage_gates(g, info, chunk_size)
    decays = None  # KDA: the serial passes' decays, which the WY stage writes beside W from the sums it forms anyway
    if plan.residual:  # the walks' W and U slots take Tb and V
        tinv, w = tinv_pair_fwd(k, beta, info, chunk_size, store_tinv=needs_backward, cfg=plan.wy_launch, gam=gam)
        u = v
    else:
        # KDA's output stage: exp(Γ) ⊙ Q and the scores P, formed beside A (the fused walk forms its own)
        separate_output = gk is not None and plan.walk == "portable"
        decays = None if gk is None else channel_decay_buffers(k, gk, info, chunk_size, with_q=separate_output)
        scores = v.new_empty(*v.shape[:-1], chunk_size) if separate_output else None
        tinv, w, u = wy_fwd(k, v, beta, info, chunk_size, store_tinv=needs_backward, cfg=plan.wy_launch, gam=gam,
                             gk=gk, decays=decays, q=q if separate_output else None, scores=scores, scale=scale)
    split = (split_plan_for(info, plan.split_partitions, plan.split_min_tokens, chunk_size, k.device)
             if plan.split else None)
    if split is not None:
        initial_state = partition_states(
            lambda w_, u_, h0, walk: walk_final_states(plan, q, k, w_, u_, h0, walk),
            k, w, u, initial_state, split, plan.residual)
        info = split.parts
    saved = (tinv,) if needs_backward else ()
    if plan.keep_states:
        from .hopper.walk import states_buffers
        states = states_buffers(k, v, info, chunk_size)
        o, final_state = walk_with_output(plan, q, k, w, u, scale, initial_state, output_final_state, info, states)
        return o, final_state, (tinv, w, *states), ()
    if plan.walk == "portable":
        h, v_new, final_state = state_fwd(k, w, u, initial_state, output_final_state, info, chunk_size,
                                          cfg=plan.walk_launch, gam=gam, states_dtype=torch.float32 if
                                          plan.problem.chunk_states else None, gk=decays)
        del w, u  # not needed by the output: its peak is h, v_new and o
        if scores is None:
            o = output_fwd(q, k, v_new, h, scale, info, chunk_size, gam=gam)
        else:
            o = output_fwd(decays.q, None, v_new, h, scale, info, chunk_size, scores=scores)
            if needs_backward and plan.keep_scores:  # for the backward's local dV' (grads.dv_local)
                saved += (scores,)
        if plan.problem.chunk_states:
            return o, final_state, saved, (h,)
    else:
        o, final_state = walk_with_output(plan, q, k, w, u, scale, initial_state, output_final_state, info, gam=gam,
                                          gk=decays)
    if split is not None and final_state is not None:  # each sequence's last partition's
        final_state = final_state.index_select(0, split.last_part)
    return o, final_state, saved, ()
