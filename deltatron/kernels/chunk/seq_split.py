"""The forward's walk split along long sequences: more programs where few sequences x heads leave SMs idle.

The chunk state recurrence (state.py: V' = U - W S, S <- S + K^T V') is affine in the state,

    S_{c+1} = M_c S_c + B_c,    M_c = I - K_c^T W_c  (K x K),    B_c = K_c^T U_c  (K x V),

so a sequence cut at chunk boundaries into partitions p = 0..P-1 (whole chunks, only the last may end in a
partial one) has, per partition, S_out = M_p S_in + B_p with M_p the product of its chunks' M_c and B_p its
state from a zero start. The forward (chunk.forward, after wy_fwd; W, U and T~ do not change: the partitions
have the same chunks) then runs:

    pass 1, two walks at once (the second on a side CUDA stream), each the forward's own walk for its final
    states only (walk_final_states: state.state_final_fwd, state_output_fwd's final states bit for bit; where the
    Gluon kernel runs, its walk without the output partition, so no Q loads, output products or O stores; else
    the Triton fused walk, its outputs dropped) on the partitions it needs as packed sequences:
        on U:  partitions 0..P-2, partition 0 from the sequence's initial state, the others from zero: their
               final states are S_1 (the state entering partition 1) and B_1..B_{P-2};
        on W:  partitions 1..P-2 with U := W (a K x K "state"), from zero. With U = W the walk's update is
               I - S_{c+1} = (I - K_c^T W_c)(I - S_c) = M_c (I - S_c), so it ends at G_p = I - M_p;
    combine:   S_{p+1} = S_p + B_p - G_p S_p for p = 1..P-2: P - 2 batched fp32 matrix products in torch (no
               host sync, nothing that grows with T);
    pass 2:    the forward's walk (whichever state.py chooses) on all partitions as packed sequences, from the
               states S_p: every token's output, and each sequence's final state as its last partition's.

Where RESIDUAL_SPLIT (residual_runs), all three walks run the Gluon walk's residual form on Tb = T~ diag(beta)
(wy.tinv_pair_fwd) instead of W, U: on U as the walk on (Tb, V), on W as the walk on (Tb, K), since W = Tb K turns
its V' = W - W S into Tb (K - K S); the forward then makes no W, U.

Sequences shorter than SPLIT_MIN_TOKENS are not split (they run whole in pass 2, and only there). The backward is
unchanged: it recomputes from T~ (the forward's only saved tensor, the same bits split or not) on the original
sequences.

Why W for U on the second walk: the existing walk takes it as it is (no kernel change), with no zero tensor to
write and hold (a [T, H, K] zero U would cost a memset of the whole batch and as much memory) and no identity
start, for any K and V; and it is one launch, where a walk on [U, 0] over a [K, V + K] state would need that
concatenated copy of U and V + K = 256, which the Gluon walk (K = V = 128 only) does not take. Its price: the
walk's rounding errors on G = I - M do not shrink with M as those of a walk on M itself (U = 0 from I) do. In an
emulation of the 16-bit walk's roundings (K = V = 128, unit keys, beta = sigmoid(randn), one head, T = 16384, P =
4), the states entering partitions 2 and 3 were 3.41e-3 and 3.46e-3 off the float64 walk in bf16, against 3.22e-3
and 3.29e-3 unsplit and 3.20e-3 and 3.28e-3 with U = 0 from I; in fp32 3.4e-7 against 2.3e-7. The outputs are
as precise as the unsplit forward's: in the interpreter (the kernels themselves, one sequence of 8192 tokens, same
inputs), o / final state against the float64 chunkwise oracle, unsplit and P = 3, 4: fp32 2.91e-7 / 2.44e-7,
2.94e-7 / 2.44e-7, 2.96e-7 / 2.43e-7; fp16 4.99e-4 / 4.01e-4, 5.00e-4 / 4.02e-4, 5.00e-4 / 4.03e-4; bf16
3.99e-3 / 3.22e-3, 4.00e-3 / 3.22e-3, 4.00e-3 / 3.23e-3; at 32768 tokens bf16 4.004e-3 / 3.246e-3, 4.005e-3 /
3.239e-3, 4.006e-3 / 3.281e-3 (benchmarks/diagnostics/seq_split.py --precision; all rows in benchmarks/NOTES.md):
the walk's own roundings dominate. The combine runs in fp32 (torch.matmul: tf32 if the caller allowed it globally).

Where it pays (split_partitions, the rule of SEQ_SPLIT = None; predicted, then measured below): pass 1 runs
(P - 1) + (P - 2) = 2P - 3 partition-walks per sequence and head at once and pass 2 runs P, each about 1/P of the
sequence deep; the unsplit walk runs one, the whole sequence deep. So the walk's serial depth goes from T to
2T / P at the price of 3 - 2/P times the walk's work, and pays only while the 2P - 3 walks of pass 1 fit in one
wave of the SMs beside each other: P >= 3, and (2P - 3) x heads x V-blocks (the Gluon walk's two a head there)
<= SMs for one sequence (more sequences add fillers, split_partitions). On the H200 (132 SMs) that is one sequence
of 16 to 22 heads, P = 3; b1-t32768-h16 is the benchmark's only such row.

Prediction, written before any GPU run (H200, bf16, K = V = 128, C = 64; inputs from benchmarks/BENCHMARKS.md and
NOTES.md). b1-t32768-h16's forward is 1.057 ms: its Gluon walk 0.721 alone (session 10: 32 programs, 512 chunks,
1.41 us a chunk) and wy_fwd with the host's share about 0.34 (b2-t8192-h32 has as many token-heads: forward 0.543,
its walk 0.205 alone). The walk's chunk at 128 programs: 1.60 us at b2-t8192-h32 (0.205 ms, 128 chunks) and 1.65
at b1-t32768-h64 (2.196 - 4 x 0.338 = 0.84 ms, 512 chunks); so about 1.55 (1.41-1.7) at 96. With P = 3 (the rule):
    pass 1: 96 programs (64 on U, 32 on W, BV = 64), 171 chunks deep: 0.24-0.29 ms;
    combine: one matrix product [16, 128, 128] x [16, 128, 128] in fp32 and 5-6 small kernels (zero fill, copies,
        the sum), then the final state's gather after pass 2: 0.02-0.04 ms of GPU time;
    pass 2: 96 programs (3 x 16 heads, BV = 64), 171 chunks deep: 0.24-0.29 ms;
    host: two more walk launches and about ten torch calls, about 0.1 ms, queued while wy_fwd runs (0.34 ms).
Forward 1.057 -> 0.86-0.96 ms (about 0.90); forward+backward (the backward unchanged) 3.492 -> 3.29-3.39 ms.
b1-t32768-h64: 64 sequences x heads, not split by the rule: unchanged (2.196 / 10.210). Forced at P = 3 (the
probe's True): pass 1 walks 128 heads-partitions on U at BV = 128 (split_v's choice past 66: 128 programs of the
chain that took 2.55 us a chunk at 16 programs) and 64 on W at BV = 64 (128 programs), 256 programs on 132 SMs,
then pass 2 192 programs at BV = 128, two waves: about 0.7 + 0.9 ms of walks against 0.84, so forward about
2.9-3.0 ms and forward+backward about 10.9-11.0 (slower by about 0.7 ms). b2-t8192-h32 forced at P = 3 (two
sequences of 8192: both split, fillers between): 288 programs in pass 1 and 192 in pass 2 at BV = 128, 43 chunks
deep, about 0.45-0.55 ms of walks against 0.205: forward 0.543 -> about 0.8-0.9 ms. varlen20-t32768-h16: no
sequence of 8192 tokens, the same launches either way (a control). Memory: the two dropped outputs of pass 1,
[T, H, V] and [T, H, K] in the input dtype (2 x 128 MiB at b1-t32768-h16), alive during pass 1 only, under the
forward+backward's peak (1.50 GiB, in the backward); the walk on W's output is freed into the side stream's pool
(reserved, not reused by the main stream).
MEASURED (H200, session 13, benchmarks/diagnostics/seq_split.py on the branch's tree, bf16, switch off / on, three
interleaved readings, fastest; gradients bitwise equal, outputs within 2.5e-3 of the unsplit ones): b1-t32768-h16
forward 1.105 / 0.893 ms and forward+backward 3.473 / 3.272 (inside the prediction), but the split forward's
three readings were erratic, 1.099, 1.511 and 0.893 ms (unsplit 1.105-1.113; another GPU's tests ran on the
shared host meanwhile; not investigated), its forward+backward steady at 3.272-3.275; forced where the rule says
no: b1-t32768-h64 2.176 / 3.200 and 10.261 / 11.183 (slower, as predicted), b2-t8192-h32 0.545 / 1.047 and
2.568 / 3.027 (slower); varlen20-t32768-h16 (nothing split) 0.674 / 0.674. The benchmark (run 192239, with the
segmented backward) read 0.854 / 3.083 ms at b1-t32768-h16.

Pass 1 without outputs (session 14, PASS1_OUTPUT_FREE; the prediction above was for the walks with outputs, their
2 x 128 MiB at b1-t32768-h16 written and dropped): on the Gluon walk neither output is written or allocated, and
each program loads 40 KiB a chunk instead of 56 (BV = 64). Predicted pass 1 and forward 0.02-0.05 ms faster;
MEASURED (H200, session 14, benchmarks/diagnostics/seq_split.py --pass1, bf16, b1-t32768-h16, fastest of three
interleaved readings, off / on): pass 1 + combine 0.290 / 0.154 ms, forward 0.887 / 0.734, outputs bitwise
equal. The walk with its output is bound by its output partition, not its chain (gluon_walk.py's probe: the
chain alone takes half the time or less); the benchmark read the forward at 0.693 ms."""
from __future__ import annotations

import functools
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from ..utils import SeqInfo, cdiv, num_sms, packed_info, side_stream, two_streams
from . import state

# Whether the forward splits long sequences: False never; True always (SPLIT_PARTITIONS partitions, or the
# rule's count, at least 3), on every sequence of SPLIT_MIN_TOKENS tokens or more; None where split_partitions says
# so (the Gluon walk's cases only, where it was measured: the module docstring)
SEQ_SPLIT: Optional[bool] = None
SPLIT_PARTITIONS: Optional[int] = None  # the count SEQ_SPLIT = True forces (None: the rule's, at least 3)
SPLIT_MIN_TOKENS = 8192  # a sequence is split only from this many tokens
SPLIT_MIN_STATES, SPLIT_MAX_STATES = 16, 64  # sequences x heads the rule splits at: from 16, below 64
SPLIT_MIN_PARTITION_TOKENS = 2048  # the rule's partitions at least this long on average (32 chunks of 64)
SPLIT_MAX_PARTITIONS = 16
GLUON_V_BLOCKS = 2  # programs a head of the Gluon walk at these counts (gluon_walk.split_v: 2 x states <= SMs)
# Whether pass 1 walks without outputs (state.state_final_fwd: the Gluon walk without its output partition where
# it runs) rather than with the forward's walk, its outputs dropped (state.state_output_fwd): the same final states
# bit for bit; False for benchmarks/diagnostics/seq_split.py's comparison
PASS1_OUTPUT_FREE = True
# Whether the split forward runs its walks in the residual form (state.RESIDUAL_WALK's: Tb = T~ diag(beta) as its
# pair in W's slot and V in U's, so the WY stage makes no W, U) where all of them run the Gluon walk (residual_runs).
# The walk on W becomes the walk on Tb and K: with V := K, V' = Tb (K - K S) = W - W S. On the H200
# (benchmarks/diagnostics/residual_walk.py, bf16, b1-t32768-h16, session 18; False / True, fastest of three
# interleaved readings): WY stage 0.318 / 0.236 ms, forward 0.668 / 0.624, forward+backward 2.764 / 2.754, gradients
# bitwise equal. False: the W, U form (tests).
RESIDUAL_SPLIT = True


def split_partitions(num_seqs: int, heads: int, tokens: int, sms: int, v_blocks: int = GLUON_V_BLOCKS) -> int:
    """Partitions a sequence is split into (1: no split), predicted from the batch's shape and the GPU's SMs: the
    most P (3 to SPLIT_MAX_PARTITIONS) whose pass 1 fits one wave of sms: per head, with v_blocks programs a walk,
    2P - 3 partition-walks of one sequence, and of N sequences N (2P - 3) plus 3 (N - 1) fillers (split_plan: one
    partition deep at most, one in each gap of the walk on U, two of the walk on W), so 2NP - 3 in all. Only at
    SPLIT_MIN_STATES to SPLIT_MAX_STATES - 1 sequences x heads (below 16 the unsplit forward runs Triton stages, not
    the Gluon walk the prediction is for; from 64 the walk fills the SMs alone), on sequences of SPLIT_MIN_TOKENS or
    more on average, with partitions of SPLIT_MIN_PARTITION_TOKENS or more. P = 2 is never chosen: pass 1 would walk
    half the sequence and pass 2 the other half after it, the unsplit walk's depth with more work."""
    states = num_seqs * heads
    if not SPLIT_MIN_STATES <= states < SPLIT_MAX_STATES or tokens < SPLIT_MIN_TOKENS * num_seqs:
        return 1
    fit = (sms // (heads * v_blocks) + 3) // (2 * num_seqs)  # the most P with (2NP - 3) heads v_blocks <= sms
    P = min(fit, SPLIT_MAX_PARTITIONS, tokens // (num_seqs * SPLIT_MIN_PARTITION_TOKENS))
    return P if P >= 3 else 1


def partition_count(k: torch.Tensor, v: torch.Tensor, info: SeqInfo, chunk_size: int) -> int:
    """The partitions this forward splits long sequences into (1: none), by SEQ_SPLIT."""
    if SEQ_SPLIT is False:
        return 1
    if SEQ_SPLIT:
        return forced_partitions(k, info)
    if not state.gluon_walk_applies(k, v, chunk_size):
        return 1
    return split_partitions(info.num_seqs, k.shape[2], info.total_tokens, num_sms(k.device))


def forced_partitions(k: torch.Tensor, info: SeqInfo) -> int:
    """The partitions a forced split runs (SEQ_SPLIT = True, and the backward's backward.REVERSE_SPLIT = True):
    SPLIT_PARTITIONS, else the rule's count, at least 3."""
    return SPLIT_PARTITIONS or max(3, split_partitions(info.num_seqs, k.shape[2], info.total_tokens,
                                                        num_sms(k.device)))


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
    walk_rev's rows rows_rev[j] (j = 1..P-1; None at j = 0), parts' rows rows_parts[j] (j = 0..P-1)."""
    parts: SeqInfo  # pass 2: every partition of a split sequence, the other sequences whole
    walk_u: SeqInfo  # pass 1 on U: partitions 0..P-2 of each split sequence (and fillers between, see _with_fillers)
    walk_w: Optional[SeqInfo]  # pass 1 on W: partitions 1..P-2 (None for P = 2)
    walk_rev: SeqInfo  # the backward's pass 1 (reverse_split.py): partitions 1..P-1
    split_seqs: Rows  # the split sequences (rows of the original initial states)
    seq_of_part: torch.Tensor  # the original sequence of each of parts' sequences (device, int64)
    first_part: torch.Tensor  # the row of parts of each original sequence's first partition (device, int64)
    last_part: torch.Tensor  # the row of parts of each original sequence's last partition (device, int64)
    rows_u: List[Rows]
    rows_w: List[Optional[Rows]]
    rows_rev: List[Optional[Rows]]
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
    walk_rev, rows = _partition_walk(cuts, 1, P, longest, TT, device)
    split = set(split_seqs)
    first_part = [last - (P - 1 if n in split else 0) for n, last in enumerate(last_part)]
    first = [first_part[n] for n in split_seqs]  # each split sequence's partition 0 in parts
    as_index = lambda rows: torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
    return SplitPlan(
        parts=packed_info(parts_bounds, TT, device), walk_u=walk_u, walk_w=walk_w, walk_rev=walk_rev,
        split_seqs=_rows(split_seqs, device), seq_of_part=as_index(seq_of_part), first_part=as_index(first_part),
        last_part=as_index(last_part), rows_u=rows_u, rows_w=rows_w, rows_rev=[None] + rows,
        rows_parts=[_rows([f + j for f in first], device) for j in range(P)],
    )


def plan_for(k: torch.Tensor, v: torch.Tensor, info: SeqInfo, chunk_size: int) -> Optional[SplitPlan]:
    """The split this forward runs (partition_count's count), or None: no split, or no sequence long enough."""
    return plan_of(info, partition_count(k, v, info, chunk_size), chunk_size, k.device)


def plan_of(info: SeqInfo, partitions: int, chunk_size: int, device: torch.device) -> Optional[SplitPlan]:
    """info's sequences of SPLIT_MIN_TOKENS or more split into `partitions` (None: fewer than 2, or no sequence
    long enough)."""
    if partitions < 2:
        return None
    return split_plan(tuple(info.cu_seqlens_cpu.tolist()), partitions, SPLIT_MIN_TOKENS, chunk_size, device)


def residual_runs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: SplitPlan, chunk_size: int) -> bool:
    """Whether the split forward runs the residual form (RESIDUAL_SPLIT): where each of its walks (pass 1's on U and
    on W, pass 2) would run it unsplit (state.residual_walk_runs on its packed sequences; the walk on W takes K for
    V)."""
    walks = (plan.walk_u, plan.parts) + ((plan.walk_w, ) if plan.walk_w is not None else ())
    return RESIDUAL_SPLIT and all(state.residual_walk_runs(q, k, v, walk, chunk_size) for walk in walks)


def walk_final_states(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, u: torch.Tensor,
                      initial_state: Optional[torch.Tensor], walk: SeqInfo, chunk_size: int,
                      residual: bool = False) -> torch.Tensor:
    """One walk of pass 1: the final states of the forward's walk on walk's sequences (its outputs unused), the
    same bits either way of PASS1_OUTPUT_FREE; residual: w is Tb and u is V (or K: the walk on W)."""
    if PASS1_OUTPUT_FREE:
        return state.state_final_fwd(q, k, w, u, initial_state, walk, chunk_size, residual)
    return state.state_output_fwd(q, k, w, u, 1.0, initial_state, True, walk, chunk_size, residual=residual)[1]


def beside_walk_on_w(walk: Callable[[], torch.Tensor], q: torch.Tensor, k: torch.Tensor, w: torch.Tensor,
                     plan: SplitPlan, chunk_size: int, residual: bool = False
                     ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
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
            finals_w = walk_final_states(q, k, w, k if residual else w, None, plan.walk_w, chunk_size, residual)
    if side is not None:
        main.wait_stream(side)
        # made on the side stream, read on main: its memory waits for main's work queued before its release
        finals_w.record_stream(main)
    return result, finals_w


def partition_states(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, u: torch.Tensor,
                     initial_state: Optional[torch.Tensor], plan: SplitPlan, chunk_size: int,
                     residual: bool = False) -> torch.Tensor:
    """Pass 1 and the combine: the state entering each of plan.parts' sequences, [len(parts), H, K, V] fp32 (a
    sequence's first partition, and an unsplit sequence, start from its initial state, or zeros). residual
    (residual_runs): w is Tb and u is V (the residual form's walks)."""
    N, H, K, V = plan.parts.num_seqs, k.shape[2], k.shape[3], u.shape[3]
    h0_u = None
    if initial_state is not None:
        h0_u = k.new_zeros(plan.walk_u.num_seqs, H, K, V, dtype=torch.float32)
        put(h0_u, plan.rows_u[0], take(initial_state, plan.split_seqs).float())

    finals_u, finals_w = beside_walk_on_w(
        lambda: walk_final_states(q, k, w, u, h0_u, plan.walk_u, chunk_size, residual), q, k, w, plan, chunk_size,
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
