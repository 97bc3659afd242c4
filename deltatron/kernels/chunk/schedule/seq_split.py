"""The sequence split: the forward's walk on partitions of long sequences, where few sequences x heads leave SMs
idle (docs/DESIGN.md §7; the plan decides where and into how many partitions).

The chunk recurrence V' = U - W S, S <- S + K^T V' is affine in the state: S_{c+1} = M_c S_c + B_c with
M_c = I - K_c^T W_c and B_c = K_c^T U_c. A sequence cut at chunk boundaries into partitions p = 0..P-1 has, per
partition, S_out = M_p S_in + B_p. The forward then runs
    pass 1, two walks at once (the second on a side CUDA stream), each for its final states only:
        on U: partitions 0..P-2, partition 0 from the sequence's initial state, the others from zero: S_1 and B_p;
        on W: partitions 1..P-2 with U := W from zero, which ends at G_p = I - M_p (the walk's update on U = W is
              I - S_{c+1} = M_c (I - S_c));
    combine: S_{p+1} = S_p + B_p - G_p S_p for p = 1..P-2, batched fp32 products in torch (no host sync);
    pass 2: the forward's walk on all partitions as packed sequences, from the states S_p.
In the residual form (the walks take Tb and V for W and U) the walk on W is the walk on (Tb, K), since
W - W S = Tb (K - K S) (DESIGN.md §3). The WY stage and what the backward reads (T~) are the same split or not; the
backward recomputes on the whole sequences, so its gradients are bitwise the unsplit ones."""
from __future__ import annotations

import functools
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from ...utils import SeqInfo, cdiv, packed_info, side_stream, two_streams

Rows = Union[slice, torch.Tensor]  # rows of a [N, H, K, V] state tensor: a slice (a view) or an index on the device


def take(x: torch.Tensor, rows: Rows) -> torch.Tensor:
    return x[rows] if isinstance(rows, slice) else x.index_select(0, rows)


def put(x: torch.Tensor, rows: Rows, value: torch.Tensor) -> None:
    if isinstance(rows, slice):
        x[rows] = value
    else:
        x.index_copy_(0, rows, value)


class SplitPlan(NamedTuple):
    """The packed sequences of each pass and where each partition's state is. Per split sequence i (in order) and
    partition j: walk_u's final state rows rows_u[j] (j = 0..P-2), walk_w's rows_w[j] (j = 1..P-2; None at j = 0),
    parts' rows rows_parts[j] (j = 0..P-1)."""
    parts: SeqInfo  # pass 2: every partition of a split sequence, the other sequences whole
    walk_u: SeqInfo  # pass 1 on U: partitions 0..P-2 of each split sequence (and fillers between, see _with_fillers)
    walk_w: Optional[SeqInfo]  # pass 1 on W: partitions 1..P-2 (None for P = 2)
    split_seqs: Rows  # the split sequences (rows of the original initial states)
    seq_of_part: torch.Tensor  # the original sequence of each of parts' sequences (device, int64)
    last_part: torch.Tensor  # the row of parts of each original sequence's last partition (device, int64)
    rows_u: List[Rows]
    rows_w: List[Optional[Rows]]
    rows_parts: List[Rows]


def _rows(positions: Sequence[int], device: torch.device) -> Rows:
    """A slice where the rows are evenly spaced (a view: no gather), else an index tensor on the device."""
    step = positions[1] - positions[0] if len(positions) > 1 else 1
    if step > 0 and all(b - a == step for a, b in zip(positions, positions[1:])):
        return slice(positions[0], positions[-1] + 1, step)
    return torch.tensor(positions, dtype=torch.int64).to(device, non_blocking=True)


def _with_fillers(ranges: Sequence[Tuple[int, int]], longest: int) -> Tuple[List[int], List[int]]:
    """Bounds of packed sequences covering the given token ranges (in order, disjoint) one sequence each, and the
    sequence number of each range. A gap between two ranges becomes filler sequences of at most `longest` tokens
    (cu_seqlens describes adjacent sequences): walked for nothing, as deep as a partition at most, their outputs
    dropped with the pass's."""
    bounds, index = [ranges[0][0]], []
    for start, end in ranges:
        while bounds[-1] < start:
            bounds.append(min(start, bounds[-1] + longest))
        index.append(len(bounds) - 1)
        bounds.append(end)
    return bounds, index


def _partition_walk(cuts: Sequence[Sequence[int]], first: int, end: int, longest: int, total_tokens: int,
                    device: torch.device) -> Tuple[SeqInfo, List[Rows]]:
    """A pass-1 walk: the packed sequences of partitions first..end-1 of every split sequence (cuts: each one's
    bounds), fillers between, and per partition j the rows of its sequences in it (list index j - first)."""
    bounds, index = _with_fillers([(b[j], b[j + 1]) for b in cuts for j in range(first, end)], longest)
    n = end - first
    return packed_info(bounds, total_tokens, device), [_rows(index[j::n], device) for j in range(n)]


@functools.lru_cache(maxsize=64)
def split_plan(cu: Tuple[int, ...], partitions: int, min_tokens: int, chunk_size: int,
               device: torch.device) -> Optional[SplitPlan]:
    """The plan of a batch of packed sequences cu (cu_seqlens) whose sequences of min_tokens or more, and at
    least `partitions` chunks, are split into `partitions` partitions of as equal a number of chunks as can be (the
    first ones one chunk longer); None if there is none. Cached: a plan is host work over the sequences and a few
    small host-to-device copies."""
    P, C = partitions, chunk_size
    cuts, seq_of_part, last_part, split_seqs = [], [], [], []  # cuts[i]: split sequence i's P + 1 bounds
    parts_bounds = [cu[0]]
    for n, (bos, eos) in enumerate(zip(cu[:-1], cu[1:])):
        chunks = cdiv(eos - bos, C) if eos > bos else 0
        if eos - bos >= min_tokens and chunks >= P:
            q, r = divmod(chunks, P)
            b = [bos]
            for j in range(P):
                b.append(min(eos, b[-1] + C * (q + (j < r))))
            cuts.append(b)
            split_seqs.append(n)
            parts_bounds += b[1:]
            seq_of_part += [n] * P
        else:
            parts_bounds.append(eos)
            seq_of_part.append(n)
        last_part.append(len(parts_bounds) - 2)
    if not cuts:
        return None
    TT = cu[-1]
    longest = max(b[j + 1] - b[j] for b in cuts for j in range(P))
    walk_u, rows_u = _partition_walk(cuts, 0, P - 1, longest, TT, device)
    walk_w, rows_w = None, [None]
    if P > 2:
        walk_w, rows = _partition_walk(cuts, 1, P - 1, longest, TT, device)
        rows_w += rows
    split = set(split_seqs)
    first_part = [last - (P - 1 if n in split else 0) for n, last in enumerate(last_part)]
    first = [first_part[n] for n in split_seqs]  # each split sequence's partition 0 in parts
    as_index = lambda rows: torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
    return SplitPlan(
        parts=packed_info(parts_bounds, TT, device), walk_u=walk_u, walk_w=walk_w,
        split_seqs=_rows(split_seqs, device), seq_of_part=as_index(seq_of_part),
        last_part=as_index(last_part), rows_u=rows_u, rows_w=rows_w,
        rows_parts=[_rows([f + j for f in first], device) for j in range(P)],
    )


def split_plan_for(info: SeqInfo, partitions: int, min_tokens: int, chunk_size: int,
                   device: torch.device) -> Optional[SplitPlan]:
    """info's sequences of min_tokens or more split into `partitions` (None: fewer than 2, or no sequence long
    enough)."""
    if partitions < 2:
        return None
    return split_plan(tuple(info.cu_seqlens_cpu.tolist()), partitions, min_tokens, chunk_size, device)


FinalStates = Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor], SeqInfo], torch.Tensor]


def beside_walk_on_w(walk: Callable[[], torch.Tensor], final_states: FinalStates, k: torch.Tensor, w: torch.Tensor,
                     plan: SplitPlan, residual: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Pass 1: walk() on the current stream and the walk on W beside it on the side stream (where there is one):
    (walk()'s result, the walk on W's final states G_p = I - M_p of partitions 1..P-2, None for P = 2). residual:
    w is Tb, and the walk on W is the residual walk on Tb and K (W = Tb K)."""
    side = side_stream(k.device.index) if plan.walk_w is not None and two_streams(k) else None
    if side is not None:
        main = torch.cuda.current_stream(k.device)
        side.wait_stream(main)  # W (or Tb) is written
    result = walk()
    finals_w = None
    if plan.walk_w is not None:
        with torch.cuda.stream(side):  # (None: the current stream)
            finals_w = final_states(w, k if residual else w, None, plan.walk_w)
    if side is not None:
        main.wait_stream(side)
        # made on the side stream, read on main: its memory waits for main's work queued before its release
        finals_w.record_stream(main)
    return result, finals_w


def partition_states(final_states: FinalStates, k: torch.Tensor, w: torch.Tensor, u: torch.Tensor,
                     initial_state: Optional[torch.Tensor], plan: SplitPlan, residual: bool = False) -> torch.Tensor:
    """Pass 1 and the combine: the state entering each of plan.parts' sequences, [len(parts), H, K, V] fp32 (a
    sequence's first partition, and an unsplit sequence, start from its initial state, or zeros). residual
    (plan.residual): w is Tb and u is V (the residual form's walks)."""
    N, H, K, V = plan.parts.num_seqs, k.shape[2], k.shape[3], u.shape[3]
    h0_u = None
    if initial_state is not None:
        h0_u = k.new_zeros(plan.walk_u.num_seqs, H, K, V, dtype=torch.float32)
        put(h0_u, plan.rows_u[0], take(initial_state, plan.split_seqs).float())

    finals_u, finals_w = beside_walk_on_w(lambda: final_states(w, u, h0_u, plan.walk_u), final_states, k, w, plan,
                                          residual)

    if initial_state is None:
        h0 = k.new_zeros(N, H, K, V, dtype=torch.float32)
    else:
        h0 = initial_state.float().index_select(0, plan.seq_of_part)
    s = take(finals_u, plan.rows_u[0])  # S_1
    put(h0, plan.rows_parts[1], s)
    for j in range(1, len(plan.rows_parts) - 1):
        # S_{j+1} = M_j S_j + B_j with M_j = I - G_j
        s = s + take(finals_u, plan.rows_u[j]) - torch.matmul(take(finals_w, plan.rows_w[j]), s)
        put(h0, plan.rows_parts[j + 1], s)
    return h0
