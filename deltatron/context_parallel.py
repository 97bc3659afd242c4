"""Context parallelism (DESIGN.md §13): one token stream sharded over the ranks of a torch.distributed group.

Every rule of the family updates the state linearly: S <- A_t S + beta_t k_t v_t^T, with A_t = exp(g_t)(I - beta_t
k_t k_t^T) (the delta rule: g = 0; per-channel gates: diag(exp(g_t)) in place of exp(g_t)). So the state after a
rank's part of a sequence is affine in the state entering it, S_out = M S_in + S_loc, with M [K, K] the product of
the part's transitions and S_loc its state from zero; and each token's output is o_t = o_loc,t + (scale q_t^T M_t)
S_in, M_t the product up to t. One call of the chunk op on the shard, with v' = [v | 0] (V + K columns) and initial
state [0 | I], yields all of them: its final state is [S_loc | M] and its output [o_loc | scale q^T M_t].

A call: each rank runs that op on its shard (local pass), one all-gather shares the [S_loc | M] maps of the sequences
that cross a rank boundary (and of every sequence when the final states are asked for), every rank folds the maps
in rank order (the state entering each rank and the final states), and corrects the outputs of the sequence that
continues into its shard (finish). The backward is the op's, the fold's, and the all-gather's mirror: a sum of the
gradients of each rank's maps over the ranks (reduce-scatter). The rule itself is a callable, so any rule whose op
takes v, the initial state and cu_seqlens plugs in."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .validation import check_cu_seqlens

# op(v, initial_state, cu_seqlens, cu_seqlens_cpu) -> (o, final_state): the rule's chunk op on the rank's shard with
# everything else bound (q, k, gates, scale, options); cu_seqlens None for a fixed-length batch.
ShardOp = Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]],
                   Tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class ShardLayout:
    """Where a rank's shard lies in the stream, from the global cu_seqlens (the same on every rank).

    local_cu: the N sequences' offsets clipped to the shard (None: fixed length, each row a sequence); carried: the
    tokens at the shard's start that continue a sequence begun on an earlier rank (every row's, at fixed length);
    carried_seq: that sequence; starts: the sequences whose first token is in this shard (their initial state is
    applied here); shared: the sequences whose maps the all-gather carries (those with tokens on two or more ranks,
    and every sequence with a token when the final states are asked for)."""
    rank: int
    world: int
    num_seqs: int
    local_cu: Optional[Tuple[int, ...]]
    carried: int
    carried_seq: int
    starts: Tuple[int, ...]
    shared: Tuple[int, ...]


def shard_layout(rank: int, world: int, B: int, T: int, cu_seqlens_cpu: Optional[torch.Tensor],
                 output_final_state: bool) -> ShardLayout:
    """The layout of rank's shard of T tokens (per row at fixed length). With cu_seqlens every shard has T tokens,
    rank r holding tokens [r T, (r + 1) T) of the stream: each rank knows every rank's offset without communication."""
    if cu_seqlens_cpu is None:  # B sequences, each sharded along time: all cross every boundary
        crossing = tuple(range(B)) if world > 1 else ()
        return ShardLayout(rank, world, B, None, T if rank > 0 else 0, 0, tuple(range(B)) if rank == 0 else (),
                           tuple(range(B)) if output_final_state else crossing)
    cu = [int(c) for c in cu_seqlens_cpu.tolist()]  # checked to end at world * T (validation.check_inputs)
    lo, hi, N = rank * T, (rank + 1) * T, len(cu) - 1
    spans = list(zip(cu[:-1], cu[1:]))
    boundaries = [r * T for r in range(1, world)]
    crossing = tuple(n for n, (a, b) in enumerate(spans) if any(a < x < b for x in boundaries))
    carried = next(((n, min(b, hi) - lo) for n, (a, b) in enumerate(spans) if a < lo < b), (0, 0))
    return ShardLayout(
        rank, world, N, tuple(min(max(c - lo, 0), T) for c in cu), carried[1], carried[0],
        tuple(n for n, (a, b) in enumerate(spans) if lo <= a < hi and a < b),
        tuple(n for n, (a, b) in enumerate(spans) if a < b) if output_final_state else crossing)


def local_pass(op: ShardOp, v: torch.Tensor, K: int, initial_state: Optional[torch.Tensor], layout: ShardLayout
               ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The rank's op call: (o, the rank's maps [S, Hv, K, V + K] fp32 of the shared sequences). o is [B, T, Hv, V]
    where no sequence is carried in; else [B, T, Hv, V + K], its last K columns scale q_t^T M_t (finish uses
    them). The sequences that start here take their initial state in the op; those carried in start from [0 | I]."""
    Hv, V, N = v.shape[2], v.shape[3], layout.num_seqs
    h0 = v.new_zeros(N, Hv, K, V, dtype=torch.float32)
    if initial_state is not None and layout.starts:
        starts = torch.zeros(N, 1, 1, 1, dtype=torch.float32, device=v.device)
        starts[list(layout.starts)] = 1
        h0 = initial_state.float() * starts
    identity = torch.eye(K, dtype=torch.float32, device=v.device).expand(N, Hv, K, K)
    widen = layout.carried > 0  # M_t is needed only for a sequence that enters the shard with a state
    if widen:
        v = torch.cat([v, v.new_zeros(*v.shape[:3], K)], dim=-1)
        h0 = torch.cat([h0, identity], dim=-1)
    cu = layout.local_cu
    o, maps = op(v, h0, None if cu is None else torch.tensor(cu, device=v.device),
                 None if cu is None else torch.tensor(cu))
    if not widen:  # no state enters this shard: each map's M is irrelevant to the fold's result; I keeps it a map
        maps = torch.cat([maps, identity], dim=-1)
    return o, maps[list(layout.shared)]


def fold(gathered: torch.Tensor, V: int) -> list:
    """The states entering each rank and after the last, [world + 1] x [S, Hv, K, V] fp32: P_0 = 0,
    P_(r+1) = S_loc,r + M_r P_r, from every rank's maps gathered [world, S, Hv, K, V + K]."""
    P = [gathered.new_zeros(gathered.shape[1:-1] + (V,))]
    for maps in gathered:
        P.append(maps[..., :V] + maps[..., V:] @ P[-1])
    return P


def finish(o: torch.Tensor, gathered: Optional[torch.Tensor], K: int, initial_state: Optional[torch.Tensor],
           layout: ShardLayout, output_final_state: bool) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(o [B, T, Hv, V], final_state [N, Hv, K, V] fp32 or None) from the local pass's o and the maps of all ranks:
    the carried tokens' outputs gain (scale q_t^T M_t) S_in, S_in the state entering this rank; a sequence's final
    state is the fold's last state (an empty sequence keeps its initial state)."""
    if gathered is not None and not layout.carried and not output_final_state:
        # no result here reads the maps, yet this rank's backward must join the all-gather's mirror
        return _Tie.apply(o, gathered), None
    V = o.shape[-1] - (K if layout.carried else 0)
    P = fold(gathered, V) if gathered is not None else None
    if layout.carried:
        slot = layout.shared.index(layout.carried_seq) if layout.local_cu is not None else slice(None)
        S_in = P[layout.rank][slot].reshape(-1, *P[0].shape[1:])  # [1 or B, Hv, K, V]
        L = layout.carried
        head = o[:, :L, :, :V].float() + torch.einsum("bthk,bhkv->bthv", o[:, :L, :, V:].float(), S_in)
        o = torch.cat([head.to(o.dtype), o[:, L:, :, :V]], dim=1)
    if not output_final_state:
        return o, None
    final = (initial_state.float() if initial_state is not None else
             o.new_zeros(layout.num_seqs, o.shape[2], K, V, dtype=torch.float32))
    if P is not None:
        final = final.index_copy(0, torch.tensor(layout.shared, device=o.device), P[-1])
    return o, final


class _AllGather(torch.autograd.Function):
    """all-gather of each rank's x into [world, *x.shape]; backward: each rank's slice of the gradient summed over the
    ranks (reduce-scatter), the gradient of a sum of the ranks' losses."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        world = dist.get_world_size(group)
        out = x.new_empty(world * x.shape[0], *x.shape[1:])
        _all_gather_single(out, x.contiguous(), group=group)
        return out.view(world, *x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = grad.new_empty(grad.shape[1:])
        _reduce_scatter_single(out, grad.view(-1, *grad.shape[2:]), group=ctx.group)
        return out, None


class _Tie(torch.autograd.Function):
    """x itself, with a zero gradient to other: a rank whose results do not read the gathered maps still runs the
    all-gather's backward, the collective that every other rank's backward joins."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        ctx.other = (other.shape, other.dtype, other.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shape, dtype, device = ctx.other
        return grad, torch.zeros(shape, dtype=dtype, device=device)


# torch >= 2.13 names the tensor forms *_single (the *_tensor names are deprecated there)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def preceding_tokens(x: torch.Tensor, count: int, cu_seqlens: Optional[torch.Tensor], group
                     ) -> Tuple[Optional[torch.Tensor], torch.Tensor]:
    """(the shard's cu_seqlens, None at fixed length; states [N, count, C]) for x [B, T, C], this rank's shard of the
    stream: per sequence, the count tokens before the shard that belong to it (zeros before its start; all zeros for
    a sequence not carried into the shard). A short convolution of count + 1 taps over the shard from these states
    equals the unsharded one (deltatron/layers/conv.py). One all-gather of every rank's last count tokens, so a short
    shard reads tokens from several ranks before it; its backward is a reduce-scatter."""
    B, T, C = x.shape
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    cu_cpu = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, None, B, T, world)
    layout = shard_layout(rank, world, B, T, cu_cpu, False)
    cu = None if layout.local_cu is None else torch.tensor(layout.local_cu, device=x.device)
    if count == 0:
        return cu, x.new_zeros(layout.num_seqs, 0, C)
    tail = torch.cat([x.new_zeros(B, max(count - T, 0), C), x[:, max(T - count, 0):]], dim=1)  # [B, count, C]
    gathered = _AllGather.apply(tail, group).transpose(0, 1)  # [B, world, count, C]
    # stream position p lies on rank p // T, at row count - ((p // T + 1) T - p) of that rank's tail
    p = torch.arange(rank * T - count, rank * T, device=x.device)
    owner = p.clamp(min=0).div(T, rounding_mode="floor")
    start = 0 if cu is None else int(cu_cpu[layout.carried_seq]) if layout.carried else rank * T
    row = (count - (owner + 1) * T + p).clamp(min=0)  # below 0 only for p < 0, masked out
    before = gathered[:, owner, row] * (p >= start)[None, :, None].to(x.dtype)
    if cu is None:
        return cu, before
    return cu, x.new_zeros(layout.num_seqs, count, C).index_copy(
        0, torch.tensor([layout.carried_seq], device=x.device), before)


def check_group(fn: str, cp_group, refused: dict) -> None:
    """cp_group must be a ProcessGroup of an initialized torch.distributed; options that context parallelism does not
    implement (refused: name -> whether it was asked for) raise."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{fn}: cp_group needs torch.distributed initialized (dist.init_process_group)")
    if not isinstance(cp_group, dist.ProcessGroup):
        raise TypeError(f"{fn}: cp_group must be a torch.distributed ProcessGroup (or None), got "
                        f"{type(cp_group).__name__}")
    asked = [name for name, on in refused.items() if on]
    if asked:
        raise ValueError(f"{fn}: {', '.join(asked)} cannot be combined with cp_group: a context-parallel call "
                         f"returns o and the final states only")
    if torch.compiler.is_compiling():
        raise RuntimeError(f"{fn}: cp_group is not supported under torch.compile; call the op outside the compiled "
                           f"region")


def sharded_chunk(op: ShardOp, v: torch.Tensor, K: int, initial_state: Optional[torch.Tensor],
                  output_final_state: bool, cu_seqlens_cpu: Optional[torch.Tensor], cp_group
                  ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(o of this rank's shard, the final states of the whole stream on every rank) on validated inputs: the local
    pass, one all-gather of the maps (none when no sequence crosses a boundary and no final state is asked for),
    then finish."""
    layout = shard_layout(dist.get_rank(cp_group), dist.get_world_size(cp_group), v.shape[0], v.shape[1],
                          cu_seqlens_cpu, output_final_state)
    o, maps = local_pass(op, v, K, initial_state, layout)
    gathered = _AllGather.apply(maps, cp_group) if layout.shared else None
    return finish(o, gathered, K, initial_state, layout, output_final_state)


def emulate_ranks(op_of_rank: Callable[[int], ShardOp], vs: Sequence[torch.Tensor], K: int,
                  initial_state: Optional[torch.Tensor], output_final_state: bool,
                  cu_seqlens_cpu: Optional[torch.Tensor]) -> list:
    """[(o, final_state)] of every rank of a context-parallel call, the ranks run one after another in this process:
    the same local passes and finish as sharded_chunk, with the all-gather a stack (its backward then sums each rank's
    gradients, as the reduce-scatter does). For checking the per-rank pieces on one device."""
    world = len(vs)
    layouts = [shard_layout(r, world, vs[r].shape[0], vs[r].shape[1], cu_seqlens_cpu, output_final_state)
               for r in range(world)]
    passes = [local_pass(op_of_rank(r), vs[r], K, initial_state, layouts[r]) for r in range(world)]
    gathered = torch.stack([maps for _, maps in passes]) if layouts[0].shared else None
    return [finish(o, gathered, K, initial_state, layouts[r], output_final_state)
            for r, (o, _) in enumerate(passes)]
