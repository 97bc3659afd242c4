"""The warp-specialized Gluon chunk-gradient kernel (kernels/chunk/gluon_grad.py) against the pair it replaces
(output_bwd.dqkw + wy_bwd.wy_bwd) on the same recomputed h, v_new, dh and dV': sm_90 only, 16-bit, K = V = 128,
C = 64; and the whole backward with backward.GLUON_GRAD on against the float64 oracle (test_chunk_backward_gpu's
check). The kernel recomputes V' = T~ diag(beta) (V - K S) instead of reading v_new, so the two differ by
roundings of the input dtype, not only by the order of fp32 sums: the bound is the dtype's oracle bound.

The kernel's partitions wait on each other through mbarriers: a hang would take the whole GPU suite with it, so
the first use of the fixture runs one small call in a child process under a time limit (gluon_smoke)."""
import importlib

import pytest
import torch

from deltatron.kernels.chunk import output_bwd, state, state_bwd, wy, wy_bwd
from deltatron.kernels.utils import seq_info

from ..helpers import BOUNDS, make_inputs, nearly_parallel_keys, random_cu_seqlens, rel_rms
from . import gluon_smoke

pytestmark = pytest.mark.gpu

D, C = 128, 64
backward = importlib.import_module("deltatron.kernels.chunk.backward")  # the module: the package exports its function
SMOKE = """
import torch
from deltatron.kernels.chunk import gluon_grad
from tests.gpu.test_gluon_grad_gpu import grad_inputs
x, info = grad_inputs(2, 200, 2, torch.bfloat16, "cuda")
out = gluon_grad.gluon_grad(*(x[n] for n in gluon_grad.INPUTS), 128 ** -0.5, info, 64)
torch.cuda.synchronize()
print("gluon grad smoke call done, finite:", all(bool(torch.isfinite(t).all()) for t in out))
"""


@pytest.fixture(scope="module")
def smoke_failure():
    return gluon_smoke(SMOKE)


@pytest.fixture
def gluon_grad(smoke_failure):
    if smoke_failure:
        pytest.fail(f"the Gluon grad kernel's smoke call {smoke_failure}", pytrace=False)
    from deltatron.kernels.chunk import gluon_grad

    return gluon_grad


def grad_inputs(B, T, H, dtype, device, N=None, seed=0, cu_seqlens=None, parallel_keys=False):
    """The grad stage's inputs as the backward makes them, packed [1, B * T, H, ...]: q, k, v, beta, tinv (from
    wy.wy_fwd), h and v_new (state.state_fwd from a random fp32 initial state), dh and dv_prime (the reverse pass
    from a random dht and dO), do; and the batch's SeqInfo. parallel_keys: nearly parallel keys with beta near 2
    (helpers.nearly_parallel_keys), where dA's products cancel."""
    x = make_inputs(B, T, H, D, D, dtype, device=device, initial_state=True, N=N, seed=seed)
    q, k, v = (x[n].reshape(1, B * T, H, D) for n in ("q", "k", "v"))
    beta = x["beta"].reshape(1, B * T, H)
    if parallel_keys:
        k, beta = nearly_parallel_keys((1, B * T, H, D), dtype=dtype, device=device, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    do = torch.randn(v.shape, generator=g).to(device=device, dtype=dtype)
    dht = torch.randn(x["initial_state"].shape, generator=g).to(device)
    info = (seq_info(B, T, torch.device(device), None, None) if cu_seqlens is None
            else seq_info(1, B * T, torch.device(device), cu_seqlens, cu_seqlens.cpu()))
    tinv, w, u = wy.wy_fwd(k, v, beta, info, C)
    h, v_new, _ = state.state_fwd(k, w, u, x["initial_state"], False, info, C)
    dh, dv_prime, _ = state_bwd.state_bwd(q, k, w, do, None, dht, D ** -0.5, False, info, C)
    return dict(q=q, k=k, v=v, beta=beta, tinv=tinv, h=h, dh=dh, dv_prime=dv_prime, do=do, v_new=v_new), info


def pair(x, scale, info):
    """(dq, dk, dv, dbeta) of output_bwd.dqkw + wy_bwd.wy_bwd, the stages the kernel replaces."""
    dq, dk_direct, dw = output_bwd.dqkw(x["q"], x["k"], x["v_new"], x["h"], x["dh"], x["do"], x["dv_prime"], scale,
                                        info, C)
    dk, dv, dbeta = wy_bwd.wy_bwd(x["k"], x["v"], x["beta"], x["tinv"], dw, x["dv_prime"], dk_direct, info, C)
    return dq, dk, dv, dbeta


def check(gluon_grad, x, info, bound=None):
    """The kernel (or a model with its interface) against the pair: dtypes, shapes, finite, within bound (the
    dtype's oracle bound unless given) of the pair, and bitwise equal on a second run (no atomics: a race
    between the partitions would show here). Returns the kernel's outputs."""
    scale = D ** -0.5
    ref = pair(x, scale, info)
    args = [x[n] for n in ("q", "k", "v", "beta", "tinv", "h", "dh", "dv_prime", "do")]
    got = gluon_grad.gluon_grad(*args, scale, info, C)
    bound = BOUNDS[x["q"].dtype] if bound is None else bound
    for name, g, r in zip(("dq", "dk", "dv", "dbeta"), got, ref):
        assert g.shape == r.shape and g.dtype == r.dtype, name
        assert torch.isfinite(g).all(), name
        assert rel_rms(g, r) < bound, f"{name}: rel RMS {rel_rms(g, r):.2e} against the pair, above {bound}"
    again = gluon_grad.gluon_grad(*args, scale, info, C)
    assert all(torch.equal(a, b) for a, b in zip(got, again)), "a second run differs"
    return got


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B, T, H", [(8, 2048, 16), (2, 1000, 4), (3, 64, 2), (1, 1, 3)])
def test_gluon_grad_matches_the_pair(poison, gluon_grad, dtype, B, T, H):
    # T = 1000: a partial last chunk whose TMA tiles read the next sequence's rows; T = 1: every chunk partial
    x, info = grad_inputs(B, T, H, dtype, "cuda", seed=T + H)
    check(gluon_grad, x, info)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gluon_grad_varlen(poison, gluon_grad, dtype):
    g = torch.Generator().manual_seed(7)
    lengths = [0, 1, C - 1, C, C + 1] + torch.randint(1, 1500, (11,), generator=g).tolist()
    lengths = [lengths[i] for i in torch.randperm(len(lengths), generator=g).tolist()]
    cu = random_cu_seqlens(lengths, "cuda")
    x, info = grad_inputs(1, sum(lengths), 8, dtype, "cuda", N=len(lengths), seed=3, cu_seqlens=cu)
    check(gluon_grad, x, info)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gluon_grad_nearly_parallel_keys(poison, gluon_grad, dtype):
    # beta near 2 on nearly parallel keys: dA = -T~^T dT~ T~^T and dA K cancel; the kernel keeps them on
    # 16-bit hi + lo pairs (about tf32's precision or better), wy_bwd in tf32
    x, info = grad_inputs(2, 256, 4, dtype, "cuda", seed=5, parallel_keys=True)
    check(gluon_grad, x, info)


def test_gluon_grad_no_tokens(poison, gluon_grad):
    x, info = grad_inputs(1, 0, 2, torch.bfloat16, "cuda", N=2, cu_seqlens=random_cu_seqlens([0, 0], "cuda"))
    dq, dk, dv, dbeta = gluon_grad.gluon_grad(*(x[n] for n in gluon_grad.INPUTS), 0.1, info, C)
    assert dq.shape == x["q"].shape and dbeta.shape == x["beta"].shape and dbeta.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("varlen", [False, True])
def test_backward_with_gluon_grad_against_the_oracle(poison, gluon_grad, monkeypatch, dtype, varlen):
    from .test_chunk_backward_gpu import check as oracle_check

    monkeypatch.setenv("DELTATRON_BACKEND", "triton")
    monkeypatch.setattr(backward, "GLUON_GRAD", True)
    calls = []
    monkeypatch.setattr(gluon_grad, "gluon_grad", lambda *a, _f=gluon_grad.gluon_grad: calls.append(1) or _f(*a))
    if varlen:
        g = torch.Generator().manual_seed(11)
        lengths = [0, 1, C - 1, C, C + 1] + torch.randint(1, 1500, (15,), generator=g).tolist()
        x = make_inputs(1, sum(lengths), 8, D, D, dtype, device="cuda", initial_state=True, N=20, seed=D,
                        requires_grad=True)
        oracle_check(x, 0.25, C, random_cu_seqlens(lengths, "cuda"))
    else:
        x = make_inputs(4, 2048, 8, D, D, dtype, device="cuda", initial_state=True, seed=1, requires_grad=True)
        oracle_check(x, D ** -0.5, C)
    assert calls, "the backward did not run the Gluon grad kernel"
