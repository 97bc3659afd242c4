"""The chunk backward's reverse state pass and grad stage (dqkw + wy_bwd) run segment by segment, so that the
grad stage of a later segment fills the SMs the reverse pass of an earlier one leaves idle (backward.py,
SEGMENTED_BACKWARD).

The packed token range is cut into S contiguous segments at chunk boundaries (segment_plan). A sequence that a
cut crosses is split into pieces, one per segment; each segment is then a packed varlen batch of its own (its
own SeqInfo, tokens relative to its start), and since its pieces begin at chunk boundaries of their sequences,
its chunks are the whole batch's chunks c0 .. c1 - 1 in the same order: per-token tensors are sliced [t0, t1),
per-chunk ones (h) [c0, c1), and the kernels run on those views unchanged. The reverse pass walks the segments
from the last: the dht of a piece that a cut ends is the dh0 the next segment's pass returned for the piece
that continues it (the gradient of the same state, fp32 in both places); other pieces take the caller's dht.
The grad stage of a segment needs its own chunks' h, dh, dV' only. On CUDA (never in the interpreter) segment
s + 1's grad stage runs on the side stream while segment s's reverse pass runs on the current one:

    main:  recompute W, U | rev(S)     | rev(S-1)        | ... | rev(1)       | grad(1) | join, outputs
    side:                 | state_fwd  | grad(S)         | ... | grad(2)      |
Elsewhere the same order runs on one stream, so the CPU tests check the segmentation itself.

Gradients are bitwise those of the unsegmented backward where each segment's reverse pass runs the kernel and
launch configuration the whole batch would: the pass keeps its state gradient in fp32 and hands it over as fp32
dh0 -> dht, and every grad-stage program computes one chunk from the same inputs. The kernel choice (Gluon or
Triton) is made once for the whole batch. The Triton pass's V-block (state_block_v) follows the sequences x heads
of a launch: a segment with more pieces than the batch has sequences may run another V-block on the GPU
(columns of dS are independent, the reductions over K and C are the same; not checked bitwise on a GPU). With
one sequence, every segment has one piece and runs the batch's configuration.

PREDICTION (written before any GPU run; measured below). 1 sequence x 16 heads, T = 32768, K = V = 128, bf16 on
the H200, forward+backward 3.492 ms with OVERLAP_STATE_PASSES: recompute, then the reverse pass (Gluon, 32
programs of a whole SM, 1.214 ms) with state_fwd beside it (0.684 ms), then the grad stage (1.11 ms on the whole
GPU). With S = 2: rev(2) 0.607 ms beside state_fwd; grad(2) can start only when state_fwd has finished (h comes
from the forward walk), at 0.684, and runs beside rev(1) (0.607 -> 1.214) on the ~100 SMs rev(1) leaves: 0.530
ms at 100/132 speed does 0.40 ms of grad(2)'s 0.555; then 0.15 + grad(1) 0.555 on the whole GPU. Backward's
serial part from the reverse pass on: 1.214 + 0.71 = 1.92 against 1.214 + 1.11 = 2.32 ms, so 0.40 ms saved (the
segments write their gradients into views of the batch's: no concatenation), less one more Gluon launch (host,
hidden while the GPU is the bottleneck): forward+backward 3.49 -> about 3.10-3.15 ms (3.10-3.20 with the
concatenation of the first version, ~0.05 ms for about 100 MiB read and written). If the grad stage is bandwidth-
rather than SM-bound, 100 SMs do more than 100/132 of it: up to 0.53 ms saved.
MEASURED (H200, session 13, benchmarks/diagnostics/seg_bwd.py on the branch's tree, bf16, forward+backward
through the API, switch off / on, three interleaved readings, fastest; gradients bitwise equal in every case):
1 x 16 heads, T = 32768 (S = 2 by the rule): 3.474 / 3.262 ms, 0.21 ms saved where 0.34-0.39 were predicted;
forced where the rule says no: 1 x 64 heads, T = 32768: 10.224 / 10.185; 2 x 32 heads, T = 8192: 2.552 / 2.664
(slower). With the forward's sequence split as well, the benchmark's b1-t32768-h16 forward+backward read 3.083.
More segments do not help while state_fwd runs beside the reverse pass: the window where a grad stage can run
beside a reverse pass opens when state_fwd ends (0.684 ms) and closes when the reverse pass ends (1.214), whatever
S (S = 3: the same 1.92 ms); they add launches and host time. Hence MAX_SEGMENTS = 2.

Rule (segmented_pays): the shapes where the reverse pass leaves SMs idle and is long: sequences x heads at most
SEGMENT_MAX_STATES (32: the Gluon pass's 2 programs a head take 64 of the 132 SMs) and at least
SEGMENT_MIN_TOKENS tokens a sequence on average (2 x 8192: each segment at least as long as the shortest sequences
the Gluon pass was measured faster on in session 11, gluon_reverse_pays). S = 2 there, 1 (off) elsewhere.

Risks: the grad stage's programs might take SMs before the next reverse pass does (launch order is main's rev
first, but a side kernel already running is not preempted); the grad stage might slow the latency-bound reverse
pass through shared L2 and HBM bandwidth; bitwise equality of the Gluon pass restarted from an fp32 dht (its
state gradient is fp32, as the Triton pass's is: expected equal; the GPU tests found it so).

Memory: session 13's version kept U, W and every segment's dh and dV' until the streams joined, which raised
1 x 16 heads, T = 32768's forward+backward peak from 1.50 GiB to 1.82 (over fla's 1.81). backward.segmented_backward
now releases each after its last reader is queued, so the peak is one segment's grad stage beside the next
reverse pass: 1.564 GiB measured (session 14; benchmarks/NOTES.md), h and v_new held to the end as before."""
from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from ..utils import SeqInfo, packed_info
from . import output_bwd, state_bwd, wy_bwd

MAX_SEGMENTS = 2  # see the module docstring: more segments gain nothing while state_fwd runs beside the pass
SEGMENT_MAX_STATES = 32  # sequences x heads: at most this many (segmented_pays)
SEGMENT_MIN_TOKENS = 16384  # mean tokens a sequence: at least this many (segmented_pays)


def segmented_pays(num_seqs: int, heads: int, total_tokens: int) -> int:
    """Segments of the backward for this shape by the rule of the module docstring: MAX_SEGMENTS where sequences
    x heads are at most SEGMENT_MAX_STATES and sequences SEGMENT_MIN_TOKENS long on average, else 1 (off)."""
    if num_seqs * heads <= SEGMENT_MAX_STATES and total_tokens >= SEGMENT_MIN_TOKENS * max(num_seqs, 1):
        return MAX_SEGMENTS
    return 1


@dataclass(frozen=True)
class Segment:
    """Tokens [t0, t1) and chunks [c0, c1) of the packed batch, as a batch of its own (info: its pieces of
    sequences, tokens relative to t0). seq0: the batch's sequence of piece 0 (piece j is sequence seq0 + j).
    cont_in: piece 0 continues a sequence begun in the previous segment; cont_out: the last piece goes on in the
    next one."""

    t0: int
    t1: int
    c0: int
    c1: int
    info: SeqInfo
    seq0: int
    cont_in: bool
    cont_out: bool


def segment_plan(info: SeqInfo, num_segments: int, chunk_size: int) -> Optional[List[Segment]]:
    """The batch cut into up to num_segments segments of about equal numbers of chunks, at chunk boundaries, in
    time order; None where fewer than two segments result (fewer chunks than that)."""
    cu = tuple(info.cu_seqlens_cpu.tolist())  # host tensor: no device sync
    return _plan(cu, num_segments, chunk_size, info.cu_seqlens.device)


@functools.lru_cache(maxsize=64)
def _plan(cu: Tuple[int, ...], num_segments: int, chunk_size: int, device: torch.device):
    N = len(cu) - 1
    offsets = [0]  # first global chunk of each sequence
    for n in range(N):
        offsets.append(offsets[-1] + -(-(cu[n + 1] - cu[n]) // chunk_size))
    total = offsets[-1]
    cut_chunks = sorted({round(j * total / num_segments) for j in range(1, num_segments)} - {0, total})
    if not cut_chunks:
        return None

    def chunk_start(c):  # token where global chunk c (< total) begins: in the last sequence whose offset <= c
        n = bisect.bisect_right(offsets, c) - 1
        return cu[n] + (c - offsets[n]) * chunk_size

    bounds_c = [0] + cut_chunks + [total]
    bounds_t = [0] + [chunk_start(c) for c in cut_chunks] + [cu[-1]]
    segments = []
    for s in range(len(bounds_c) - 1):
        t0, t1 = bounds_t[s], bounds_t[s + 1]
        last = s == len(bounds_c) - 2
        # a sequence belongs where it begins (an empty one at t1 to the next segment, at the very end to the last)
        # plus the piece of the one a cut at t0 crosses
        seqs = [n for n in range(N) if t0 <= cu[n] < t1 or (last and cu[n] == t1)]
        crossing = bisect.bisect_left(cu, t0) - 1  # the last sequence begun before t0
        cont_in = s > 0 and cu[crossing + 1] > t0
        if cont_in:
            seqs.insert(0, crossing)
        ends = [min(cu[n + 1], t1) - t0 for n in seqs]
        cont_out = cu[seqs[-1] + 1] > t1
        seg_info = packed_info([0] + ends, t1 - t0, device)
        segments.append(Segment(t0, t1, bounds_c[s], bounds_c[s + 1], seg_info, seqs[0], cont_in, cont_out))
    return segments


def packed(x: torch.Tensor) -> torch.Tensor:
    """[B, T, ...] as the packed [1, B*T, ...] (a view of a contiguous tensor)."""
    return x.reshape(1, -1, *x.shape[2:])


def reverse_segment(seg: Segment, q, k, w, do, dht, next_dh0, scale, has_initial_state: bool, gluon: bool,
                    chunk_size: int):
    """The reverse pass over one segment (packed q, k, w, do of the whole batch): (dh, dV', dh0 or None).
    next_dh0: the next segment's dh0 (its piece 0 continues this segment's last piece), None for the last."""
    sl = slice(seg.t0, seg.t1)
    n = seg.info.num_seqs
    seg_dht = None if dht is None else dht[seg.seq0:seg.seq0 + n]
    if seg.cont_out:  # the last piece's dht is the gradient entering the next segment's first piece
        if n == 1:
            seg_dht = next_dh0[:1]
        else:
            head = (seg_dht[:-1].float() if seg_dht is not None
                    else next_dh0.new_zeros(n - 1, *next_dh0.shape[1:]))
            seg_dht = torch.cat([head, next_dh0[:1]])
    return state_bwd.state_bwd(q[:, sl], k[:, sl], w[:, sl], do[:, sl], None, seg_dht, scale,
                               has_initial_state or seg.cont_in, seg.info, chunk_size, gluon=gluon)


def grad_segment(seg: Segment, q, k, v, beta, tinv, v_new, h, do, dh, dv, scale, chunk_size: int, out):
    """dqkw and the WY backward over one segment (packed tensors of the whole batch; dh, dv the segment's own
    from reverse_segment), written into the segment's tokens of out = the batch's (dq, dk, dv, dbeta), packed."""
    sl = slice(seg.t0, seg.t1)
    dq, dk, dv_out, dbeta = (x[:, sl] for x in out)
    _, dk_direct, dw = output_bwd.dqkw(q[:, sl], k[:, sl], v_new[:, sl], h[seg.c0:seg.c1], dh, do[:, sl], dv, scale,
                                       seg.info, chunk_size, dq=dq)
    wy_bwd.wy_bwd(k[:, sl], v[:, sl], beta[:, sl], tinv[:, sl], dw, dv, dk_direct, seg.info, chunk_size,
                  out=(dk, dv_out, dbeta))


def dh0_of(segments: List[Segment], dh0s: List[Optional[torch.Tensor]]) -> torch.Tensor:
    """The batch's dh0 from the segments' (time order): every sequence begins in exactly one segment, as a piece
    that does not continue an earlier one."""
    parts = [d[1:] if seg.cont_in else d for seg, d in zip(segments, dh0s)]
    parts = [p for p in parts if p.shape[0]]
    return parts[0] if len(parts) == 1 else torch.cat(parts)
