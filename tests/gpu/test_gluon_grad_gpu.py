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


NAMES = ("dq", "dk", "dv", "dbeta")
# the kernel against the model of its arithmetic (tests/test_gluon_grad_model.py, on the CPU): the same
# roundings at the same points, so they differ by the order of fp32 sums and, through it, a rounding of the
# dtype here and there. Measured on the CPU (the model with fp32 products against float64 ones): 1e-4 at bf16,
# 5e-5 at fp16 on random inputs; on nearly parallel keys dq's sums cancel and take it to 1.8e-3 (bf16) and
# 3.6e-4 (fp16). So the dtype's bound / MODEL_SHARE there, the bound itself on nearly parallel keys
MODEL_SHARE = 4


def stage_model(x, scale, info, dtype=None):
    """tests/test_gluon_grad_model's model of the kernel on CPU copies of the stage's inputs: the kernel's
    roundings, or with dtype=torch.float64 the exact stage (every rounding the identity) on the same inputs."""
    from ..test_gluon_grad_model import kernel_model  # it imports this module: here, not at the top

    args = [x[n].detach().cpu() for n in ("q", "k", "v", "beta", "tinv", "h", "dh", "dv_prime", "do")]
    return kernel_model(*(a if dtype is None else a.to(dtype) for a in args), scale, info, C)


def worst_tiles(got, ref, info, count=3):
    """Where got departs from ref (a [.., TT, H(, D)] output): the count (chunk, head) tiles of the largest
    error, as "chunk i_t (sequence, chunk in it, n rows) head h: error / the tile's reference norm, worst row",
    and the non-finite elements' first (token, head); for a first run's failure report."""
    g, r = (t.detach().double().cpu().reshape(info.total_tokens, t.shape[2] if t.dim() > 3 else t.shape[-1], -1)
            for t in (got, ref))
    bad = ~torch.isfinite(g)
    out = [f"{int(bad.sum())} not finite, first at (token, head) {bad.any(-1).nonzero()[:3].tolist()}"
           ] if bad.any() else []
    err = torch.where(bad, 0.0, g - r).pow(2).sum(-1)  # [TT, H]
    cu, tiles = info.cu_seqlens_cpu.tolist(), []
    for i_t, (i_n, i_c) in enumerate(info.chunks(C).chunk_indices.tolist()):
        start = cu[i_n] + i_c * C
        n = min(C, cu[i_n + 1] - start)
        e, nr = err[start:start + n], r[start:start + n].pow(2).sum(-1)
        for h in range(e.shape[1]):
            tiles.append((float(e[:, h].sum() / nr[:, h].sum().clamp_min(1e-30)) ** 0.5, i_t, i_n, i_c, n, h,
                          int(e[:, h].argmax())))
    return out + [f"chunk {i_t} (sequence {i_n}, chunk {i_c}, {n} rows) head {h}: {e:.1e}, worst row {row}"
                  for e, i_t, i_n, i_c, n, h, row in sorted(tiles, reverse=True)[:count]]


def check(gluon_grad, x, info, bound=None, exact=False, model=True):
    """The kernel (or a model with its interface) against
    - the pair (output_bwd.dqkw + wy_bwd.wy_bwd): within bound (the dtype's oracle bound unless given); with
      exact (nearly parallel keys, where the two differ by more than that on roundings both make: dq and dbeta
      cancel, and the pair's v_new comes from the fp32 state where the kernel has h), both against the exact
      stage (stage_model in float64) instead, the kernel within max(bound, 1.5 x the pair's error);
    - with model, the model of its arithmetic (stage_model): within bound / MODEL_SHARE (bound with exact),
      where a wrong term, mask, tile or race shows far above the roundings;
    dtypes, shapes, finite, and bitwise equal on a second run (no atomics: a race between the partitions would
    show here). Every error is printed before any assert fails. Returns the kernel's outputs."""
    scale = D ** -0.5
    ref = pair(x, scale, info)
    args = [x[n] for n in ("q", "k", "v", "beta", "tinv", "h", "dh", "dv_prime", "do")]
    got = gluon_grad.gluon_grad(*args, scale, info, C)
    again = gluon_grad.gluon_grad(*args, scale, info, C)
    bound = BOUNDS[x["q"].dtype] if bound is None else bound
    failed = []
    for name, g, r in zip(NAMES, got, ref):
        if g.shape != r.shape or g.dtype != r.dtype:
            failed.append(f"{name}: {tuple(g.shape)} {g.dtype}, the pair's {tuple(r.shape)} {r.dtype}")
        elif not torch.isfinite(g).all():
            failed.append(f"{name}: {int((~torch.isfinite(g)).sum())} of {g.numel()} not finite")
            print(f"gluon grad {name} against the pair, worst tiles: " + "; ".join(worst_tiles(g, r, info)))
    if not failed:
        rows = {name: {"pair": rel_rms(g, r)} for name, g, r in zip(NAMES, got, ref)}
        limits = {name: {"pair": bound} for name in NAMES}
        if exact:
            ex = stage_model(x, scale, info, torch.float64)
            for name, g, r, e in zip(NAMES, got, ref, ex):
                rows[name].update(exact=rel_rms(g, e), pair_exact=rel_rms(r, e))
                limits[name] = {"exact": max(bound, 1.5 * rows[name]["pair_exact"])}
        if model:
            mod = stage_model(x, scale, info)
            for name, g, m in zip(NAMES, got, mod):
                rows[name]["model"] = rel_rms(g, m)
                limits[name]["model"] = bound if exact else bound / MODEL_SHARE
        for i, name in enumerate(NAMES):
            line = ", ".join(f"{k} {v:.2e}" + (f" (< {limits[name][k]:.1e})" if k in limits[name] else "")
                             for k, v in rows[name].items())
            print(f"gluon grad {name}: rel RMS against {line}")
            over = [f"{name}: rel RMS {rows[name][k]:.2e} against the {k}, above {lim:.1e}"
                    for k, lim in limits[name].items() if not rows[name][k] < lim]
            if over:
                against = ("model", mod) if model else ("pair", ref)
                print(f"  worst tiles against the {against[0]}: " + "; ".join(worst_tiles(got[i], against[1][i], info)))
            failed += over
    differ = {n: int(((a != b) & ~(a.isnan() & b.isnan())).sum()) for n, a, b in zip(NAMES, got, again)}
    if any(differ.values()):  # NaN where both runs have NaN counts as the same (non-finite is reported above)
        failed.append("a second run differs: " + ", ".join(f"{n} {c} elements" for n, c in differ.items() if c))
    assert not failed, "; ".join(failed)
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
    check(gluon_grad, x, info, exact=True)


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
