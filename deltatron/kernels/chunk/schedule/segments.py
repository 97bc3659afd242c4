"""The segmented backward: the reverse state pass and the gradient stage (grads + wy_bwd) run segment by segment, so
that a later segment's gradient stage fills the SMs an earlier segment's reverse pass leaves idle (docs/DESIGN.md §7;
the plan decides where).

The packed token range is cut into S contiguous segments at chunk boundaries (segment_plan). A sequence a cut
crosses is split into pieces, one per segment; each segment is a packed batch of its own whose chunks are the whole
batch's chunks c0 .. c1 - 1 in order, so per-token tensors are sliced [t0, t1), per-chunk ones [c0, c1), and the
kernels run on those views unchanged. The reverse pass walks the segments from the last: the dht of a piece a cut
ends is the dh0 (fp32) the next segment's pass returned for the piece that continues it. On CUDA:

    main:  recompute W, U | rev(S)     | rev(S-1)  | ... | rev(1)  | grad(1) | join
    side:                 | walk       | grad(S)   | ... | grad(2) |

elsewhere the same order on one stream. Every segment runs the batch's reverse-pass kernel and launch, so the
gradients are bitwise those of the unsegmented backward."""
from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch

from ...utils import SeqInfo, packed_info
from ..portable.grads import dqkw
from ..portable.wy_bwd import wy_bwd

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


def reverse_segment(seg: Segment, reverse: Callable, q, k, w, do, dht, next_dh0, has_initial_state: bool):
    """The reverse pass over one segment (packed q, k, w, do of the whole batch): (dh, dV', dh0 or None).
    reverse(q, k, w, do, dht, need_dh0, info): the batch's reverse pass. next_dh0: the next segment's dh0 (its
    piece 0 continues this segment's last piece), None for the last."""
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
    return reverse(q[:, sl], k[:, sl], w[:, sl], do[:, sl], seg_dht, has_initial_state or seg.cont_in, seg.info)


def grad_segment(seg: Segment, q, k, v, beta, tinv, v_new, h, do, dh, dv, scale, chunk_size: int, out):
    """dqkw and the WY backward over one segment (packed tensors of the whole batch; dh, dv the segment's own
    from reverse_segment), written into the segment's tokens of out = the batch's (dq, dk, dv, dbeta), packed."""
    sl = slice(seg.t0, seg.t1)
    dq, dk, dv_out, dbeta = (x[:, sl] for x in out)
    _, dk_direct, dw, _ = dqkw(q[:, sl], k[:, sl], v_new[:, sl], h[seg.c0:seg.c1], dh, do[:, sl], dv, scale,
                               seg.info, chunk_size, dq=dq)
    wy_bwd(k[:, sl], v[:, sl], beta[:, sl], tinv[:, sl], dw, dv, dk_direct, seg.info, chunk_size,
                  out=(dk, dv_out, dbeta))


def dh0_of(segments: List[Segment], dh0s: List[Optional[torch.Tensor]]) -> torch.Tensor:
    """The batch's dh0 from the segments' (time order): every sequence begins in exactly one segment, as a piece
    that does not continue an earlier one."""
    parts = [d[1:] if seg.cont_in else d for seg, d in zip(segments, dh0s)]
    parts = [p for p in parts if p.shape[0]]
    return parts[0] if len(parts) == 1 else torch.cat(parts)
