"""The backward's reverse state pass split along long sequences: the mirror of the forward's sequence split
(seq_split.py), behind backward.REVERSE_SPLIT (off by default: measured slower than the segmented backward in
session 17, benchmarks/NOTES.md).

The reverse recurrence of the fused pass (state_bwd.py), with dS_c the gradient of the state leaving chunk c,

    dV'_c = dV'_local_c + K_c dS_c,    dS_{c-1} = dS_c + scale Q_c^T dO_c - W_c^T dV'_c
                                                = M_c^T dS_c + (scale Q_c^T dO_c - W_c^T dV'_local_c),

is affine in dS with M_c = I - K_c^T W_c, the forward's per-chunk transition (seq_split.py). For a sequence cut
into the forward's partitions p = 0..P-1 (seq_split.split_plan: whole chunks, only the last may end in a partial
one), with E_p the gradient leaving partition p (E_{P-1} = dht, or 0), the gradient entering it is

    E_{p-1} = M_p^T E_p + D_p,    M_p = the product of its chunks' M_c,  D_p = its reverse pass from zero.

The backward (backward.py, its unsegmented path) then runs:

    pass 1, two walks at once (the second on a side CUDA stream: seq_split.beside_walk_on_w):
        the reverse pass on partitions 1..P-1 as packed sequences (plan.walk_rev), partition P-1 from dht, the
            others from zero, for their dh0 alone (state_bwd's store_outputs=False: no dh, no dV' written): E_{P-2}
            and D_1..D_{P-2};
        the forward's walk on W (the forward's pass 1 on W, plan.walk_w): G_p = I - M_p for p = 1..P-2;
    combine:   E_{p-1} = E_p + D_p - G_p^T E_p for p = P-2..1 (M_p^T E = E - G_p^T E): P - 2 batched fp32 matrix
               products in torch, no host sync;
    pass 2:    the reverse pass (whichever state_bwd chooses) on all partitions as packed sequences (plan.parts),
               each from E_p: dh and dV' of every chunk (the partitions' chunks are the batch's, in its order), and
               each sequence's dh0 as its first partition's.

Sequences shorter than seq_split.SPLIT_MIN_TOKENS are not split (they run whole in pass 2, and only there). The
partitions are those of a forced forward split (seq_split.forced_partitions: SPLIT_PARTITIONS, else the forward's
rule's count, at least 3): pass 1 runs (P - 1) + (P - 2) = 2P - 3 partition-walks per sequence and head, as the
forward's does, so the forward's rule for where they fit one wave (seq_split.split_partitions) holds here too.

Where the split runs, the backward is not segmented (segmented_bwd.py): pass 2's partitions run side by side and
the grad stage after them, on the whole GPU. The two were not combined: the segmented backward overlaps a later
segment's grad stage with an earlier segment's reverse pass, which the split shortens to about 2/P of its depth.

Precision: as in the forward, the walk on W's roundings on G = I - M do not shrink with M, and the combine runs in
fp32 (tf32 if the caller allowed it globally); pass 2 starts each partition from E_p in fp32, as the segmented
backward hands its dh0 over. Checked in the interpreter against the unsplit backward and the float64 recurrence
(tests/kernels/test_reverse_split.py); at the benchmark's sizes on a GPU by tests/gpu/test_reverse_split_gpu.py."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..utils import SeqInfo
from . import seq_split, state_bwd
from .seq_split import SplitPlan, put, take


def plan_for(k: torch.Tensor, info: SeqInfo, chunk_size: int) -> Optional[SplitPlan]:
    """The split of a backward whose reverse pass is split (backward.REVERSE_SPLIT): seq_split's plan of a forced
    split, None where no sequence is long enough."""
    return seq_split.plan_of(info, seq_split.forced_partitions(k, info), chunk_size, k.device)


def partition_gradients(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, do: torch.Tensor,
                        dht: Optional[torch.Tensor], scale: float, plan: SplitPlan, chunk_size: int) -> torch.Tensor:
    """Pass 1 and the combine: the gradient of the state leaving each of plan.parts' sequences,
    [len(parts), H, K, V] fp32 (a sequence's last partition, and an unsplit sequence, take its dht, or zeros)."""
    H, K, V = k.shape[2], k.shape[3], do.shape[3]
    last = len(plan.rows_parts) - 1
    dht_rev = None
    if dht is not None:  # partition P-1 of each split sequence from the sequence's dht, the others from zero
        dht_rev = k.new_zeros(plan.walk_rev.num_seqs, H, K, V, dtype=torch.float32)
        put(dht_rev, plan.rows_rev[last], take(dht, plan.split_seqs).float())

    def reverse_pass():
        return state_bwd.state_bwd(q, k, w, do, None, dht_rev, scale, True, plan.walk_rev, chunk_size,
                                   store_outputs=False)[2]

    entering, finals_w = seq_split.beside_walk_on_w(reverse_pass, q, k, w, plan, chunk_size)

    if dht is None:
        leaving = k.new_zeros(plan.parts.num_seqs, H, K, V, dtype=torch.float32)
    else:
        leaving = dht.float().index_select(0, plan.seq_of_part)
    e = take(entering, plan.rows_rev[last])  # E_{P-2}: partition P-1 started from dht
    put(leaving, plan.rows_parts[last - 1], e)
    for j in range(last - 1, 0, -1):
        # E_{j-1} = M_j^T E_j + D_j with M_j = I - G_j
        e = e + take(entering, plan.rows_rev[j]) - torch.matmul(take(finals_w, plan.rows_w[j]).mT, e)
        put(leaving, plan.rows_parts[j - 1], e)
    return leaving


def split_state_bwd(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, do: torch.Tensor, dht: Optional[torch.Tensor],
                    scale: float, need_dh0: bool, plan: SplitPlan, chunk_size: int
                    ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """state_bwd.state_bwd's contract for the fused pass (dv_local None) on the batch plan was made of, its long
    sequences split: pass 1, the combine, pass 2 (the module docstring)."""
    leaving = partition_gradients(q, k, w, do, dht, scale, plan, chunk_size)
    dh, dv, dh0 = state_bwd.state_bwd(q, k, w, do, None, leaving, scale, need_dh0, plan.parts, chunk_size)
    return dh, dv, dh0.index_select(0, plan.first_part) if need_dh0 else None
