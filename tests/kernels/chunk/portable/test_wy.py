"""portable/wy.py: T~, W, U per chunk (wy_fwd, recompute_w_u, tinv_fwd) and the residual form's pair Tb (tinv_pair_fwd,
ungated and gated)
against float64 intra_chunk_wy on the same (dtype-rounded) inputs; KDA's decays written beside W against the decay
stage's."""
import pytest
import torch

from deltatron.kernels.chunk.portable import wy
from deltatron.kernels.chunk.portable.gate import channel_decay_buffers, channel_decay_stage, chunk_gamma
from deltatron.kernels.utils import seq_info
from deltatron.reference.chunk import intra_chunk_wy
from deltatron.reference.gated import _decayed_products, _masked_exp_diff, gated_intra_chunk

from ....helpers import DEVICE, make_gated_inputs, nearly_parallel_keys, random_cu_seqlens, rel_rms
from ..helpers import STAGE_BOUNDS, chunk_rows, needs_triton, packed, per_sequence_chunks

pytestmark = needs_triton


@pytest.mark.parametrize("dtype, C, lengths, K, V", [
    (torch.float32, 32, [1, 33, 32], 24, 40),
    (torch.float16, 64, [65, 3], 32, 16),
    (torch.bfloat16, 16, [0, 15, 17], 40, 24),
])
def test_wy(poison, dtype, C, lengths, K, V):
    inp, info, ref = packed(lengths, 2, K, V, dtype, seed=4)
    _, T_ref, W_ref, U_ref = per_sequence_chunks(lengths, C, intra_chunk_wy, ref["k"], ref["v"], ref["beta"])
    tinv, w, u = wy.wy_fwd(inp["k"], inp["v"], inp["beta"], info, C)
    assert tinv.dtype == torch.float32 and w.dtype == dtype and u.dtype == dtype
    assert rel_rms(tinv, T_ref) < 1e-5
    assert rel_rms(w, W_ref) < STAGE_BOUNDS[dtype]
    assert rel_rms(u, U_ref) < STAGE_BOUNDS[dtype]
    # the backward's path: the same W, U from the stored Tinv
    w2, u2 = wy.recompute_w_u(inp["k"], inp["v"], inp["beta"], tinv, info, C)
    assert torch.equal(w2, w) and torch.equal(u2, u)
    # fused_chunk's path: Tinv alone (no W, U), a kernel of its own, as accurate (the same bits in the interpreter;
    # on the H200 its tf32 products at C = 16 round apart from wy_fwd's)
    assert rel_rms(wy.tinv_fwd(inp["k"], inp["beta"], info, C), T_ref) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_wy_nearly_parallel_keys(poison, dtype):
    # W's rows sum terms T~_ij beta_j k_j of size ~4 to a result of size ~1 when keys are almost equal and
    # beta is near 2: with T~ diag(beta) rounded to 16 bits alone, W here is 4.0e-3 (fp16) and 2.9e-2
    # (bf16) off, over the bounds; it goes into the products as a 16-bit hi + lo pair
    lengths, C, K = [128, 61], 64, 64
    inp, info, ref = packed(lengths, 2, K, 32, dtype, seed=8)
    inp["k"], inp["beta"] = nearly_parallel_keys(inp["k"].shape, 1.95, dtype, DEVICE, seed=8)
    ref = {n: x.detach().cpu().double() for n, x in inp.items()}
    _, _, w_ref, u_ref = per_sequence_chunks(lengths, C, intra_chunk_wy, ref["k"], ref["v"], ref["beta"])
    _, w, u = wy.wy_fwd(inp["k"], inp["v"], inp["beta"], info, C)
    assert rel_rms(w, w_ref) < STAGE_BOUNDS[dtype]
    assert rel_rms(u, u_ref) < STAGE_BOUNDS[dtype]


def assert_low_half(lo, tinv, beta_cols, hi, atol=0.0):
    """lo, the pair's low half, is the rounding of T~ diag(beta) - hi to hi's dtype, that difference taken either
    after rounding the product to fp32 (the interpreter) or exactly (compiled kernels contract the product and the
    difference into one FMA), element by element; atol: a tolerance for fp32's subnormals."""
    rounded = (tinv * beta_cols - hi.float()).to(hi.dtype).float()
    fused = (tinv.double() * beta_cols.double() - hi.double()).float().to(hi.dtype).float()  # the product is exact
    lo = lo.float()
    assert bool((((lo - rounded).abs() <= atol) | ((lo - fused).abs() <= atol)).all())


def beta_columns(beta, tinv, lengths, C):
    """[1, TT, H, C] fp32 like tinv: the beta of each column's token in the row's chunk (0 past a chunk's end), so
    that tinv * beta_columns is T~ diag(beta) on T~'s token rows."""
    cols = torch.zeros_like(tinv)
    for t0, t1, _ in chunk_rows(lengths, C):
        cols[0, t0:t1, :, :t1 - t0] = beta[0, t0:t1].float().T[None]
    return cols


@pytest.mark.parametrize("dtype, lengths, K", [(torch.float16, [65, 3, 0, 64], 32), (torch.bfloat16, [1, 130], 48)])
def test_tinv_pair(poison, dtype, lengths, K):
    # the residual form's input: Tinv (the backward's, bit for bit wy_fwd's) and Tb = Tinv diag(beta) as the
    # pair hi + lo of the input dtype that wy_fwd applies (hi the rounding of the fp32 product, lo the rounding of
    # what is left), hi in columns [0, C), lo in [C, 2C); beta of tokens past a short chunk's end reads as 0
    C = 64
    inp, info, ref = packed(lengths, 2, K, 16, dtype, seed=12)
    _, T_ref, _, _ = per_sequence_chunks(lengths, C, intra_chunk_wy, ref["k"], ref["v"], ref["beta"])
    tinv, tb = wy.tinv_pair_fwd(inp["k"], inp["beta"], info, C)
    assert tinv.dtype == torch.float32 and tb.dtype == dtype and tb.shape == (*inp["k"].shape[:3], 2 * C)
    assert torch.equal(tinv, wy.tinv_fwd(inp["k"], inp["beta"], info, C))
    assert wy.tinv_pair_fwd(inp["k"], inp["beta"], info, C, store_tinv=False)[0] is None
    beta_cols = beta_columns(inp["beta"], tinv, lengths, C)
    tb_fp32 = tinv * beta_cols
    hi = tb_fp32.to(dtype)
    assert torch.equal(tb[..., :C], hi)
    assert_low_half(tb[..., C:], tinv, beta_cols, hi)
    pair = tb[..., :C].double() + tb[..., C:].double()
    assert rel_rms(pair, T_ref * beta_cols.double().cpu()) < 1e-5


@pytest.mark.parametrize("dtype, lengths, gates", [(torch.float16, [65, 3, 0, 64], "soft"),
                                                   (torch.bfloat16, [1, 130], "strong")])
def test_tinv_pair_gated(poison, dtype, lengths, gates):
    # the gated residual form's input: T~ with A's decays exp(γ_i - γ_j), bit for bit the gated wy_fwd's, and Tb =
    # T~ diag(beta) without exp(γ) (the walk puts it on K S); in float64, Tb (V - diag(exp(γ)) K S) is U - W S
    C, K, V, H, HK = 64, 32, 16, 2, 1
    TT = sum(lengths)
    x = make_gated_inputs(1, TT, HK, H, K, V, dtype, N=len(lengths), gates=gates, seed=14)
    x = {n: t.to(DEVICE) for n, t in x.items()}
    cu = random_cu_seqlens(lengths, DEVICE)
    info = seq_info(1, TT, torch.device(DEVICE), cu, cu.cpu())
    gam = chunk_gamma(x["g"], info, C)
    tinv_w, _, _ = wy.wy_fwd(x["k"], x["v"], x["beta"], info, C, gam=gam)
    tinv, tb = wy.tinv_pair_fwd(x["k"], x["beta"], info, C, gam=gam)
    assert torch.equal(tinv, tinv_w)
    beta_cols = beta_columns(x["beta"], tinv, lengths, C)
    hi = (tinv * beta_cols).to(dtype)
    assert torch.equal(tb[..., :C], hi)
    # lo to within fp32's subnormals, whose arithmetic differs between the kernel's backends and torch (strong gates
    # leave entries of T~ near 1e-39)
    assert_low_half(tb[..., C:], tinv, beta_cols, hi, atol=torch.finfo(torch.float32).tiny)
    gen = torch.Generator().manual_seed(3)
    for t0, t1, _ in chunk_rows(lengths, C):
        k_c = x["k"][0, t0:t1, 0].double().cpu()
        for h in range(H):
            gam_c, _, _, T_ref, W_ref, U_ref = gated_intra_chunk(
                k_c, x["v"][0, t0:t1, h].double().cpu(), x["g"][0, t0:t1, h].double().cpu(),
                x["beta"][0, t0:t1, h].double().cpu())
            S = torch.randn(K, V, generator=gen, dtype=torch.float64)
            tb_c = tb[0, t0:t1, h, :t1 - t0].double().cpu() + tb[0, t0:t1, h, C:C + t1 - t0].double().cpu()
            residual = tb_c @ (x["v"][0, t0:t1, h].double().cpu() - torch.exp(gam_c)[:, None] * (k_c @ S))
            assert rel_rms(residual, U_ref - W_ref @ S) < 1e-5


def test_tinv_pair_refuses_fp32():
    inp, info, _ = packed([16], 1, 16, 16, torch.float32, seed=3)
    with pytest.raises(ValueError, match="16-bit k only"):
        wy.tinv_pair_fwd(inp["k"], inp["beta"], info, 16)


def test_tinv_pair_grouped_heads(poison):
    # grouped value heads (k with 1 head, beta with 3): Tinv and Tb per value head, the same bits as with k repeated
    # for each value head
    inp, info, _ = packed([70, 0, 5], 3, 32, 16, torch.float16, seed=13)
    k1 = inp["k"][:, :, :1].contiguous()
    tinv, tb = wy.tinv_pair_fwd(k1, inp["beta"], info, 64)
    assert tinv.shape == (*inp["beta"].shape, 64) and tb.shape == (*inp["beta"].shape, 128)
    want_tinv, want_tb = wy.tinv_pair_fwd(k1.expand(inp["k"].shape).contiguous(), inp["beta"], info, 64)
    assert torch.equal(tinv, want_tinv) and torch.equal(tb, want_tb)
    assert torch.equal(wy.tinv_fwd(k1, inp["beta"], info, 64), want_tinv)


@pytest.mark.parametrize("dtype, C, lengths, HK, H, K", [
    (torch.float32, 16, [0, 17, 33], 1, 2, 40),
    (torch.bfloat16, 64, [65, 1], 2, 2, 64),
    (torch.float16, 32, [31, 0, 64], 1, 3, 24),
])
@pytest.mark.parametrize("gates", ["soft", "strong"])
def test_wy_writes_kda_decays_as_the_decay_stage(poison, dtype, C, lengths, HK, H, K, gates):
    # KDA: the WY stage writes the serial passes' decays beside W (exp(Γ_C - Γ) ⊙ K per value head, exp(Γ_C) per
    # chunk, and for the backward exp(Γ) ⊙ Q), the same bits as gate.channel_decay_stage makes in a launch of its own;
    # W and U as without them; grouped value heads, partial K-tiles, empty sequences
    TT = sum(lengths)
    gen = torch.Generator().manual_seed(6)
    q, k = (torch.nn.functional.normalize(torch.randn(1, TT, HK, K, generator=gen), dim=-1).to(dtype)
            for _ in range(2))
    v = torch.randn(1, TT, H, 16, generator=gen).to(dtype)
    beta = torch.rand(1, TT, H, generator=gen).to(dtype)
    g = -20 * torch.rand(1, TT, H, K, generator=gen) if gates == "strong" else -torch.rand(1, TT, H, K, generator=gen)
    q, k, v, beta, g = (x.to(DEVICE) for x in (q, k, v, beta, g))
    cu = random_cu_seqlens(lengths, DEVICE)
    info = seq_info(1, TT, torch.device(DEVICE), cu, cu.cpu())
    want = channel_decay_stage(k, g, info, C, q)
    fwd = channel_decay_buffers(k, g, info, C)
    tinv, w, u = wy.wy_fwd(k, v, beta, info, C, gk=g, decays=fwd)
    assert torch.equal(fwd.k, want.k) and torch.equal(fwd.chunk, want.chunk) and fwd.q is None
    assert all(torch.equal(x, y) for x, y in zip((tinv, w, u), wy.wy_fwd(k, v, beta, info, C, gk=g)))
    bwd = channel_decay_buffers(k, g, info, C, with_q=True)
    w2, u2 = wy.recompute_w_u(k, v, beta, tinv, info, C, gk=g, decays=bwd, q=q)
    assert torch.equal(w2, w) and torch.equal(u2, u)
    assert torch.equal(bwd.k, want.k) and torch.equal(bwd.q, want.q) and torch.equal(bwd.chunk, want.chunk)
    with pytest.raises(ValueError, match="decayed q"):
        wy.recompute_w_u(k, v, beta, tinv, info, C, gk=g, decays=bwd)
    # the forward's output stage operands: scale P beside A and exp(Γ) ⊙ Q beside W, T~, W and U unchanged
    out = channel_decay_buffers(k, g, info, C, with_q=True)
    scores = torch.full((1, TT, H, C), float("nan"), dtype=dtype, device=DEVICE)
    got = wy.wy_fwd(k, v, beta, info, C, gk=g, decays=out, q=q, scores=scores, scale=0.3)
    assert all(torch.equal(x, y) for x, y in zip(got, (tinv, w, u)))
    assert torch.equal(out.k, want.k) and torch.equal(out.q, want.q) and torch.equal(out.chunk, want.chunk)
    assert scores.dtype == dtype
    assert rel_rms(scores, kda_scores_reference(q, k, g, 0.3, lengths, C)) < STAGE_BOUNDS[dtype]
    with pytest.raises(ValueError, match="scores"):
        wy.wy_fwd(k, v, beta, info, C, gk=g, decays=fwd, scores=scores)


def kda_scores_reference(q, k, g, scale, lengths, C):
    """Float64 (scale P)^T of every chunk as the WY stage lays it out, [1, TT, H, C]: row j, column i, P_ij = sum_c
    q_ic k_jc exp(Γ_i - Γ_j)[c] for j <= i (0 above and past the chunk's end), q and k of each value head's key head."""
    TT, HK, H = q.shape[1], q.shape[2], g.shape[2]
    qd, kd, gd = (x[0].cpu().double() for x in (q, k, g))
    want = torch.zeros(1, TT, H, C, dtype=torch.float64)
    for t0, t1, _ in chunk_rows(lengths, C):
        decay = _masked_exp_diff(gd[t0:t1].cumsum(0).transpose(0, 1), per_channel=True)  # [H, i, j, K]
        q_h, k_h = (x[t0:t1].transpose(0, 1).repeat_interleave(H // HK, 0) for x in (qd, kd))
        p = _decayed_products(q_h, k_h, decay)  # [H, i, j]
        want[0, t0:t1, :, :t1 - t0] = (scale * p).permute(2, 0, 1)
    return want
