"""portable/grads.py: dV'_local (dv_local) and dQ, the direct dK, dW (dqkw, also on the forward's kept S^T, V'^T
layout) with the reverse pass before it (portable/reverse.py, unfused: dv_local given), against torch.autograd
through float64 models of the same per-chunk quantities."""
import pytest
import torch

from deltatron.kernels.chunk.portable import grads, reverse, wy
from deltatron.kernels.chunk.portable.gate import channel_decay_buffers
from deltatron.kernels.utils import seq_info
from deltatron.reference.gated import _decayed_products, _masked_exp_diff

from ....helpers import BOUNDS, DEVICE, chunk_spans, random_cu_seqlens, rel_rms, transposed_states
from ..helpers import (DTYPES, ONE_ROUNDING_BWD, group_sums, heads_first, needs_triton, packed_growing,
                       state_model, to_dev)

pytestmark = needs_triton


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("C", [16, 64])
def test_dv_local(dtype, C, poison):
    lengths, H, K, V = [C + 1, 1, 2 * C], 2, 40, 24
    inp, info, ref = packed_growing(lengths, H, K, V, dtype, seed=1)
    do = torch.randn(1, sum(lengths), H, V, dtype=dtype, device=DEVICE)
    scale = 0.3
    got = grads.dv_local(inp["q"], inp["k"], do, scale, info, C)
    want = torch.zeros(sum(lengths), H, V, dtype=torch.float64)
    dod = do[0].cpu().double()
    for t0, t1 in chunk_spans(lengths, C):
        qk = (heads_first(ref["q"], t0, t1) @ heads_first(ref["k"], t0, t1).transpose(1, 2)).tril()
        want[t0:t1] = (scale * qk.transpose(1, 2) @ heads_first(dod, t0, t1)).transpose(0, 1)
    assert got.dtype == dtype
    assert rel_rms(got[0], want) <= BOUNDS[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gates", ["soft", "strong"])
def test_dv_local_per_channel_gate_grouped_heads(dtype, gates, poison):
    # KDA's local dV' (its reverse pass reads it): scale P^T dO, P_ij = sum_c q_ic k_jc exp(Γ_i - Γ_j)_c for j <= i,
    # Γ the gate summed from the chunk's start; 2 value heads a key head, a partial K-tile (K = 40)
    C, lengths, HK, H, K, V = 32, [33, 0, 1, 64], 1, 2, 40, 24
    TT = sum(lengths)
    gen = torch.Generator().manual_seed(3)
    q, k = (torch.randn(TT, HK, K, generator=gen).to(dtype) for _ in range(2))
    g = -20 * torch.rand(TT, H, K, generator=gen) if gates == "strong" else -torch.rand(TT, H, K, generator=gen) / 4
    do = torch.randn(TT, H, V, generator=gen).to(dtype)
    cu = random_cu_seqlens(lengths, DEVICE)
    info = seq_info(1, TT, torch.device(DEVICE), cu, cu.cpu())
    scale = 0.3
    got = grads.dv_local(to_dev(q, dtype), to_dev(k, dtype), to_dev(do, dtype), scale, info, C,
                         gk=to_dev(g, torch.float32))
    want = torch.zeros(TT, H, V, dtype=torch.float64)
    qd, kd, gd, dod = (x.double() for x in (q, k, g, do))
    for t0, t1 in chunk_spans(lengths, C):
        decay = _masked_exp_diff(gd[t0:t1].cumsum(0).transpose(0, 1), per_channel=True)  # [H, i, j, K], j <= i
        keys = heads_first(kd, t0, t1).repeat_interleave(H // HK, 0)
        p = _decayed_products(heads_first(qd, t0, t1).repeat_interleave(H // HK, 0), keys, decay)
        want[t0:t1] = (scale * p.transpose(1, 2) @ heads_first(dod, t0, t1)).transpose(0, 1)
    assert got.dtype == dtype
    assert rel_rms(got[0], want) <= BOUNDS[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_dv_local_reads_the_wy_stages_scores(dtype, poison):
    # KDA: the forward's WY stage stores scale P for the output stage, and training keeps it for the backward
    # (wy_fwd(scores=)); dv_local reading them gives the bits it forms itself. Grouped heads, partial chunks, an empty
    # sequence, a partial K-tile, strong gates
    C, lengths, HK, H, K, V = 32, [33, 0, 1, 64], 1, 2, 40, 24
    TT = sum(lengths)
    gen = torch.Generator().manual_seed(5)
    q, k = (torch.nn.functional.normalize(torch.randn(1, TT, HK, K, generator=gen), dim=-1).to(dtype)
            for _ in range(2))
    g = -20 * torch.rand(1, TT, H, K, generator=gen)
    v, do = (torch.randn(1, TT, H, V, generator=gen).to(dtype) for _ in range(2))
    beta = torch.rand(1, TT, H, generator=gen).to(dtype)
    q, k, g, v, do, beta = (x.to(DEVICE) for x in (q, k, g, v, do, beta))
    cu = random_cu_seqlens(lengths, DEVICE)
    info = seq_info(1, TT, torch.device(DEVICE), cu, cu.cpu())
    scale = 0.3
    scores = torch.full((1, TT, H, C), float("nan"), dtype=dtype, device=DEVICE)
    wy.wy_fwd(k, v, beta, info, C, gk=g, decays=channel_decay_buffers(k, g, info, C, with_q=True), q=q,
              scores=scores, scale=scale)
    assert not scores.isnan().any()
    assert torch.equal(grads.dv_local(q, k, do, scale, info, C, gk=g, scores=scores),
                       grads.dv_local(q, k, do, scale, info, C, gk=g))
    with pytest.raises(ValueError, match="scores"):
        grads.dv_local(q, k, do, scale, info, C, gk=g, scores=scores[..., :16])


@pytest.mark.parametrize("dtype, C, lengths, with_dht", [
    (torch.float32, 16, [0, 1, 17, 16, 40], True),
    (torch.float32, 64, [65, 0, 64], False),
    (torch.float16, 32, [63], True),
    (torch.float16, 16, [0, 1, 17, 16, 40], False),
    (torch.bfloat16, 64, [65, 0, 64], True),
    (torch.bfloat16, 32, [63], False),
])
def test_state_and_dqkw(dtype, C, lengths, with_dht, poison):
    """Reverse state pass + dQ/dK/dW against autograd through the float64 state pass given W, U."""
    H, K, V = 2, 24, 40
    inp, info, ref = packed_growing(lengths, H, K, V, dtype, seed=C + len(lengths))
    N, TT = len(lengths), sum(lengths)
    g = torch.Generator().manual_seed(7)
    # W, U of moderate size so that the chunk states stay O(1)
    w, u = (0.3 * torch.randn(TT, H, D, generator=g, dtype=torch.float64) for D in (K, V))
    w, u = (x.to(dtype).double().requires_grad_() for x in (w, u))
    q, k = (ref[n].clone().requires_grad_() for n in ("q", "k"))
    s0 = torch.randn(N, H, K, V, generator=g, dtype=torch.float64, requires_grad=True)
    do = torch.randn(TT, H, V, generator=g, dtype=torch.float64).to(dtype)
    dht = torch.randn(N, H, K, V, generator=g, dtype=torch.float64) if with_dht else None
    scale = 0.4

    o, final, entering, leaving, v_new = state_model(q, k, w, u, s0, scale, lengths, C)
    for s in leaving:
        s.retain_grad()
    loss = (o * do.double()).sum() + (0 if dht is None else (final * dht).sum())
    loss.backward()

    h = torch.stack(entering).detach().to(device=DEVICE, dtype=torch.float32)
    dt_ = lambda x: to_dev(x.detach(), dtype)
    dv_loc = grads.dv_local(inp["q"], inp["k"], dt_(do), scale, info, C)
    dh, dv, dh0 = reverse.state_bwd(inp["q"], inp["k"], dt_(w), dt_(do), dv_loc,
                                      None if dht is None else dht.float().to(DEVICE), scale, True, info, C)
    dq, dk, dw, _ = grads.dqkw(inp["q"], inp["k"], dt_(v_new), h, dh, dt_(do), dv, scale, info, C)
    # the same stage on the forward's saved layout (states_t: S^T, V'^T per chunk): the same products on operands
    # laid out otherwise (the interpreter's fp32 sums then run in another order: 1e-7 apart)
    st, vt = transposed_states(h, dt_(v_new), lengths, C)
    for got, want in zip(grads.dqkw(inp["q"], inp["k"], vt, st, dh, dt_(do), dv, scale, info, C, states_t=True),
                         (dq, dk, dw)):
        assert got.dtype == want.dtype and rel_rms(got, want) <= ONE_ROUNDING_BWD[dtype]

    bound = BOUNDS[dtype]
    want_dh = torch.stack([s.grad if s.grad is not None else torch.zeros_like(s) for s in leaving])
    assert rel_rms(dh, want_dh) <= bound
    assert rel_rms(dh0, s0.grad) <= bound
    assert rel_rms(dv[0], u.grad) <= bound
    assert rel_rms(dq[0], q.grad) <= bound
    assert dq.dtype == dk.dtype == dw.dtype == dtype  # the direct dK too: the WY backward adds it in fp32
    assert rel_rms(dk[0], k.grad) <= bound
    assert rel_rms(dw[0], w.grad) <= bound
    for n, L in enumerate(lengths):
        if L == 0:  # no chunks: the gradient passes through untouched
            assert torch.equal(dh0[n].cpu(), torch.zeros(H, K, V) if dht is None else dht[n].float())


@pytest.mark.parametrize("rule", ["delta", "gated", "kda"])
@pytest.mark.parametrize("key_heads, H", [(1, 2), (2, 6)])
def test_dqkw_grouped_heads(rule, key_heads, H, poison):
    """Grouped value heads: dqkw on q, k of key_heads heads gives the direct dK, dW and the decays' shares of the same
    stage on q, k repeated per value head, bit for bit, and dQ as that stage's dQ summed over each group in head
    order (fp32: the same fp32 sums). Partial chunks, an empty sequence, K and V not powers of two."""
    C, lengths, K, V = 32, [33, 0, 1, 40], 40, 24
    TT = sum(lengths)
    cu = random_cu_seqlens(lengths, DEVICE)
    info = seq_info(1, TT, torch.device(DEVICE), cu, cu.cpu())
    NT = info.chunks(C).num_chunks
    gen = torch.Generator().manual_seed(5 + H)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(DEVICE)
    q, k = rand(1, TT, key_heads, K), rand(1, TT, key_heads, K)
    v_new, do, dv = rand(1, TT, H, V), rand(1, TT, H, V), rand(1, TT, H, V)
    h, dh = rand(NT, H, K, V), rand(NT, H, K, V)
    gates = {"delta": {}, "gated": {"gam": (-torch.rand(1, TT, H, generator=gen)).cumsum(1).to(DEVICE)},
             "kda": {"gk": (-torch.rand(1, TT, H, K, generator=gen) / 4).to(DEVICE)}}[rule]
    G = H // key_heads
    got = grads.dqkw(q, k, v_new, h, dh, do, dv, 0.3, info, C, **gates)
    want = grads.dqkw(q.repeat_interleave(G, 2), k.repeat_interleave(G, 2), v_new, h, dh, do, dv, 0.3, info, C,
                      **gates)
    assert got[0].shape == q.shape and torch.equal(got[0], group_sums(want[0], key_heads))
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    if rule != "delta":
        assert all(torch.equal(a, b) for a, b in zip(got[3], want[3]))
