"""portable/output.py: o = scale (Q S + (Q K^T ⊙ M) V') per chunk, the output stage of the unfused walk, against
float64; with the gated rule's γ and grouped value heads; with KDA's scores."""
import pytest
import torch

from deltatron.kernels.chunk.portable import output

from ....helpers import DEVICE, rel_rms
from ..helpers import STAGE_BOUNDS, chunk_rows, needs_triton, output_reference, packed, packed_info

pytestmark = needs_triton


@pytest.mark.parametrize("dtype, C, lengths, K, V", [
    (torch.float32, 32, [33, 1], 40, 24),
    (torch.bfloat16, 16, [18, 0, 16], 24, 40),
    (torch.float16, 64, [64, 5], 32, 32),
])
def test_output_fwd(poison, dtype, C, lengths, K, V):
    H, scale = 2, 0.37
    inp, info, ref = packed(lengths, H, K, V, dtype, seed=6)
    spans = chunk_rows(lengths, C)
    h = torch.randn(len(spans), H, K, V, device=DEVICE).to(dtype)
    v_new = inp["v"]
    o = output.output_fwd(inp["q"], inp["k"], v_new, h, scale, info, C)
    o_ref = output_reference(ref["q"], ref["k"], h.cpu().double(), ref["v"], scale, lengths, C)
    assert o.dtype == dtype
    assert rel_rms(o, o_ref) < STAGE_BOUNDS[dtype]


@pytest.mark.parametrize("dtype, C, lengths, HK, H, K, V", [
    (torch.float16, 64, [129], 2, 4, 64, 32),
    (torch.bfloat16, 64, [129], 2, 4, 64, 32),
    (torch.float32, 32, [33, 0, 1], 1, 3, 40, 24),
    (torch.bfloat16, 16, [18, 16], 2, 2, 24, 40),
])
def test_output_fwd_gated(poison, dtype, C, lengths, HK, H, K, V):
    # the gated rule: o_i = scale (exp(γ_i) q_i S + sum_{j <= i} exp(γ_i - γ_j) (q_i . k_j) v'_j), γ the chunk's
    # cumulative log decay; value head h reads key head h // (H / HK)
    scale, TT = 0.37, sum(lengths)
    gen = torch.Generator().manual_seed(8)
    q, k = (torch.nn.functional.normalize(torch.randn(1, TT, HK, K, generator=gen), dim=-1).to(dtype)
            for _ in range(2))
    v_new = torch.randn(1, TT, H, V, generator=gen).to(dtype)
    spans = chunk_rows(lengths, C)
    h = torch.randn(len(spans), H, K, V, generator=gen).to(dtype)
    g = -torch.rand(1, TT, H, generator=gen)
    gam = torch.zeros_like(g)
    for t0, t1, _ in spans:
        gam[0, t0:t1] = g[0, t0:t1].cumsum(0)
    o = output.output_fwd(*(x.to(DEVICE) for x in (q, k, v_new, h)), scale, packed_info(lengths), C,
                          gam=gam.to(DEVICE))
    want = output_reference(*(x.double() for x in (q, k, h, v_new)), scale, lengths, C, gam=gam.double())
    assert o.dtype == dtype
    assert rel_rms(o, want) < STAGE_BOUNDS[dtype]


@pytest.mark.parametrize("dtype, C, lengths, H, K, V", [
    (torch.float32, 32, [33, 0, 1], 2, 40, 24),
    (torch.bfloat16, 64, [65, 64], 3, 32, 48),
    (torch.float16, 16, [18, 16], 2, 24, 40),
])
def test_output_fwd_reads_the_wy_stages_scores(poison, dtype, C, lengths, H, K, V):
    # KDA: o = scale (exp(Γ) ⊙ Q) S + (scale P) V', with exp(Γ) ⊙ Q (per value head) and (scale P)^T as the WY stage
    # stores them (row j, column i, zero above the diagonal and past the chunk's end)
    scale, TT = 0.37, sum(lengths)
    inp, info, ref = packed(lengths, H, K, V, dtype, seed=7)
    spans = chunk_rows(lengths, C)
    h = torch.randn(len(spans), H, K, V, device=DEVICE).to(dtype)
    scores = torch.zeros(1, TT, H, C, dtype=dtype, device=DEVICE)
    for t0, t1, _ in spans:
        n = t1 - t0
        scores[0, t0:t1, :, :n] = (torch.randn(H, n, n, device=DEVICE).tril() / 4).permute(2, 0, 1).to(dtype)
    o = output.output_fwd(inp["q"], None, inp["v"], h, scale, info, C, scores=scores)
    want = torch.zeros(TT, H, V, dtype=torch.float64)
    hd, sd = h.cpu().double(), scores[0].cpu().double()
    for i, (t0, t1, _) in enumerate(spans):
        q_c, v_c = (x[0, t0:t1].transpose(0, 1) for x in (ref["q"], ref["v"]))
        p = sd[t0:t1, :, :t1 - t0].permute(1, 2, 0)  # [H, i, j]
        want[t0:t1] = (scale * q_c @ hd[i] + p @ v_c).transpose(0, 1)
    assert o.dtype == dtype
    assert rel_rms(o[0], want) < STAGE_BOUNDS[dtype]
    with pytest.raises(ValueError, match="decayed Q"):
        output.output_fwd(inp["q"], inp["k"], inp["v"], h, scale, info, C, scores=scores)
