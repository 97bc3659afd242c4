"""The fused dQ/dK/dW + WY backward (chunk/dqkw_wy_bwd.py) at realistic sizes (H200): against the pair it
replaces on the same inputs (8 x 16 heads at K = V = 128, a 20-sequence varlen batch, K = 64, K = 256, a
non-power-of-two head), and the whole backward with backward.FUSED_DQKW_WY on against the float64 chunkwise
oracle; bitwise determinism."""
import importlib

import pytest
import torch

import deltatron
from deltatron.kernels.chunk import dqkw_wy_bwd, output_bwd, state, state_bwd, wy, wy_bwd
from deltatron.kernels.utils import seq_info

from ..helpers import make_inputs, random_cu_seqlens, rel_rms
from .test_chunk_backward_gpu import check, run

pytestmark = pytest.mark.gpu

# within a rounding or two. fp32: the GPU sums dT~ sequentially (FMA dots), V before K here and K before V in
# the pair; two orders of K + V = 512 fp32 terms already differ by ~5e-7 rel RMS, before dA's products
# and dbeta's sums (tiles of 32 here, 64 in the pair at K = 256) add theirs: 1e-5, still 10x under the
# oracle bound and far below what a wrong term gives
CLOSE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 4e-3}
backward_module = importlib.import_module("deltatron.kernels.chunk.backward")  # the package exports a function


def varlen_20(C):
    g = torch.Generator().manual_seed(C)
    lengths = [0, 1, C - 1, C, C + 1] + torch.randint(1, 1500, (15,), generator=g).tolist()
    return [lengths[i] for i in torch.randperm(20, generator=g).tolist()]


def stage_inputs(x, cu, C):
    """The inputs the backward gives dQ/dK/dW and the WY backward (T~, h, V', dh, dU), packed."""
    q, k, v, beta = (x[n].detach() for n in ("q", "k", "v", "beta"))
    B, T = q.shape[:2]
    q, k, v, beta = (t.reshape(1, B * T, *t.shape[2:]) for t in (q, k, v, beta))
    info = seq_info(1, B * T, q.device, cu, cu.cpu()) if cu is not None else seq_info(B, T, q.device, None, None)
    do = torch.randn(v.shape, generator=torch.Generator(device="cuda").manual_seed(2), device="cuda").to(v.dtype)
    scale = q.shape[-1] ** -0.5
    tinv, w, u = wy.wy_fwd(k, v, beta, info, C)
    h, v_new, _ = state.state_fwd(k, w, u, None, False, info, C)
    dh, du, _ = state_bwd.state_bwd(q, k, w, do, None, None, scale, False, info, C)
    return (q, k, v, beta, tinv, v_new, h, dh, do, du, scale, info, C)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("B, T, H, K, V, C, varlen", [
    (8, 2048, 16, 128, 128, 64, False),  # the benchmark's shape
    (1, None, 16, 128, 128, 64, True),  # 20 sequences, empty and 1-token ones among them
    (16, 2048, 8, 64, 64, 64, False),
    (2, 1000, 8, 256, 256, 64, False),
    (4, 777, 8, 100, 72, 32, False),  # non-power-of-two heads, K != V, a partial last chunk
])
def test_matches_the_pair(poison, dtype, B, T, H, K, V, C, varlen):
    lengths = varlen_20(C) if varlen else None
    cu = random_cu_seqlens(lengths, "cuda") if varlen else None
    x = make_inputs(B, sum(lengths) if varlen else T, H, K, V, dtype, device="cuda", seed=K + V)
    q, k, v, beta, tinv, v_new, h, dh, do, du, scale, info, C = stage_inputs(x, cu, C)
    dq, dk_direct, dw = output_bwd.dqkw(q, k, v_new, h, dh, do, du, scale, info, C)
    want = (dq, *wy_bwd.wy_bwd(k, v, beta, tinv, dw, du, dk_direct, info, C))
    got = dqkw_wy_bwd.dqkw_wy_bwd(q, k, v, beta, tinv, v_new, h, dh, do, du, scale, info, C)
    for name, a, b in zip(("dq", "dk", "dv", "dbeta"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert rel_rms(a, b) <= CLOSE[dtype], f"{name}: rel RMS {rel_rms(a, b):.2e}"


@pytest.fixture
def fused(monkeypatch):
    monkeypatch.setenv("DELTATRON_BACKEND", "triton")
    monkeypatch.setattr(backward_module, "FUSED_DQKW_WY", True)
    launches = []
    kernel = dqkw_wy_bwd.dqkw_wy_bwd
    monkeypatch.setattr(dqkw_wy_bwd, "dqkw_wy_bwd", lambda *a, **kw: launches.append(1) or kernel(*a, **kw))
    return launches


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("B, T, H, D, C", [(8, 2048, 16, 128, 64), (4, 2048, 16, 64, 64), (1, 4096, 8, 256, 64),
                                           (8, 1000, 8, 100, 32)])
def test_backward_matches_oracle(fused, poison, dtype, B, T, H, D, C):
    x = make_inputs(B, T, H, D, D, dtype, device="cuda", initial_state=True, seed=T + D, requires_grad=True)
    check(x, D ** -0.5, C)
    assert fused == [1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_backward_varlen_20_sequences_matches_oracle(fused, poison, dtype):
    lengths = varlen_20(64)
    x = make_inputs(1, sum(lengths), 8, 128, 128, dtype, device="cuda", initial_state=True, N=20, seed=128,
                    requires_grad=True)
    grads, dht = check(x, 0.25, 64, random_cu_seqlens(lengths, "cuda"))
    empty = lengths.index(0)
    assert torch.equal(grads["initial_state"][empty], dht[empty])
    assert fused == [1]


def test_backward_deterministic(fused):
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 3000, (12,), generator=g).tolist() + [0, 1]
    cu = random_cu_seqlens(lengths, "cuda")
    x = make_inputs(1, sum(lengths), 16, 128, 128, torch.bfloat16, device="cuda", initial_state=True,
                    N=len(lengths), seed=1, requires_grad=True)
    do = torch.randn(x["v"].shape, device="cuda", dtype=torch.bfloat16)
    dht = torch.randn(x["initial_state"].shape, device="cuda")
    runs = [run(deltatron.chunk_delta_rule, x, None, do, dht, cu, cu_seqlens_cpu=cu.cpu())[2] for _ in range(2)]
    for n in runs[0]:
        assert torch.equal(runs[0][n], runs[1][n]), n
