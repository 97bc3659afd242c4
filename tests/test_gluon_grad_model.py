"""A PyTorch model of gluon_grad_kernel's per-(chunk, head) algebra (kernels/chunk/gluon_grad.py, its docstring's
steps), the proof of that algebra on the CPU:

- in float64 (every rounding of the model is then the identity), on float64 h, dh, dV' and T~ made here from
  DESIGN.md §2-§3, its dq, dk, dv, dbeta equal autograd's through the float64 chunkwise oracle to 1e-10:
  the algebra (V' = T~ diag(beta) (V - K S) recomputed, dv = beta T~^T dV', dT = dV' X^T, dbeta from dT ⊙ T~
  and dA ⊙ K K^T, dK's four terms) is DESIGN.md §3's;
- at fp16 and bf16 with the kernel's rounding points and masks (tiles read from the packed rows: a partial
  chunk's tiles hold the next sequence's rows, zeros past TT), through the GPU test's check() against the pair
  it replaces (output_bwd.dqkw + wy_bwd.wy_bwd in the interpreter; on nearly parallel keys both against the
  exact stage, as the GPU test does), on awkward shapes: varlen with empty and 1-token sequences, partial
  chunks, T = 1, nearly parallel keys with beta near 2; and check() fails on the wrong kernels nearest to it
  (T~ or dP not masked past the chunk's end, T diag(beta) rounded without its low half, dA's products on
  rounded operands), through the pair and through the GPU test's tighter comparison with this model;
- the whole backward with the model in the grad stage's place (backward.GLUON_GRAD on) against the float64
  oracle at the dtype's bound.
It checks orientation, masks and rounding points, not synchronization (that only the GPU can)."""
import importlib

import pytest
import torch

from deltatron.kernels import chunk
from deltatron.kernels.utils import seq_info
from deltatron.reference import chunk_delta_rule_reference

from .gpu import test_gluon_grad_gpu as gpu_test
from .helpers import BOUNDS, INTERPRET, make_inputs, random_cu_seqlens, rel_rms

C = 64
backward = importlib.import_module("deltatron.kernels.chunk.backward")  # the module: the package exports its function


def split(x, dt):
    """x (fp32) as a pair hi + lo of dtype dt, as the kernel's 16-bit operands (lo is zero in float64)."""
    hi = x.to(dt)
    return hi, (x - hi.to(x.dtype)).to(dt)


def pair_mm(a, b, dt, exact_b=False):
    """a @ b on hi + lo pairs (hi hi + hi lo + lo hi; a alone split where b is exact in dt)."""
    (ah, al), f = split(a, dt), a.dtype
    if exact_b:
        return ah.to(f) @ b.to(f) + al.to(f) @ b.to(f)
    bh, bl = split(b, dt)
    return ah.to(f) @ bh.to(f) + ah.to(f) @ bl.to(f) + al.to(f) @ bh.to(f)


def grad_tile(q, k, v, do, dvp, s, dsn, tinv, beta, n, scale, dt, bug=None):
    """One (chunk, head) tile as gluon_grad_kernel computes it: [C, 128] tiles (rows from n on as read), the
    state S entering the chunk and dS' leaving it [128, 128], T~ [C, C] and beta [C] as read (rows from n on
    hold the next sequence's). Products accumulate in f (fp32, float64 in the exact run) on dt operands."""
    f = tinv.dtype
    r = torch.arange(C)
    valid = r < n
    live = valid[:, None] & valid[None, :]
    keep_t = torch.ones(C, C, dtype=torch.bool) if bug == "T~ not masked" else live & (r[None, :] <= r[:, None])
    tt = torch.where(keep_t, tinv, 0.0)
    b = torch.where(valid, beta.to(f), 0.0)
    q, k, v, do, dvp, s, dsn = (x.to(f) for x in (q, k, v, do, dvp, s, dsn))
    # WY chain: X = V - K S (rows from n on zeroed), V' = T X with T = T~ diag(beta) and X as 16-bit pairs;
    # X's high half alone in dT
    xf = torch.where(valid[:, None], v - k @ s, 0.0)
    x = xf.to(dt).to(f)
    t = tt * b[None, :]
    vn = (t.to(dt).to(f) @ x if bug == "T rounded" else pair_mm(t, x, dt, exact_b=True) if bug == "X rounded"
          else pair_mm(t, xf, dt)).to(dt).to(f)
    # dv = dX = beta T~^T dV' (T~ rounded, as wy_bwd)
    dx = ((tt.T.to(dt).to(f) @ dvp) * b[:, None]).to(dt).to(f)
    # dT = dV' X^T; dbeta_j = sum_i dT_ij T~_ij; dT~ = dT diag(beta)
    dtt = torch.where(live, dvp @ x.T, 0.0)
    dbeta = (dtt * tt).sum(0)
    dtt = dtt * b[None, :]
    # dA^T = -T~ (T~^T dT~)^T on pairs, strictly upper (dA strictly lower); dbeta_i += sum_j dA_ij (K K^T)_ij
    mm = (lambda a, c: a.to(dt).to(f) @ c.to(dt).to(f)) if bug == "dA rounded" else (lambda a, c: pair_mm(a, c, dt))
    m1 = mm(tt.T, dtt)
    g = torch.where(r[:, None] < r[None, :], -mm(tt, m1.T), 0.0)
    dbeta = dbeta + (g * (k @ k.T)).sum(0)
    rr = g * b[None, :]  # R = (diag(beta) dA)^T, so dAs = R + R^T
    # dQ, dK
    keep_p = (r[:, None] >= r[None, :]) & (r[:, None] < n if bug != "dP not masked" else True)
    dpm = torch.where(keep_p, do @ vn.T * scale, 0.0).to(dt).to(f)
    dq = (do @ s.T) * scale + dpm @ k
    dk = dpm.T @ q + vn @ dsn.T - dx @ s.T + pair_mm(rr.T, k, dt, exact_b=True) + pair_mm(rr, k, dt, exact_b=True)
    return dq, dk, dx, dbeta


def kernel_model(q, k, v, beta, tinv, h, dh, dv_prime, do, scale, info, chunk_size=C, bug=None):
    """gluon_grad's contract, tile by tile as the kernel's grid: (dq, dk, dv in the input dtype, dbeta fp32
    (float64 for float64 inputs)). Tiles are read as TMA reads them: from the packed rows at the chunk's start,
    past the sequence's end the next sequence's rows, past TT zeros."""
    TT, H, D, dt = info.total_tokens, k.shape[2], k.shape[3], k.dtype
    f = tinv.dtype
    rows = [torch.cat([x.reshape(TT, H, -1), x.new_zeros(C, H, x.shape[-1])])
            for x in (q, k, v, do, dv_prime, tinv)]
    betas = torch.cat([beta.reshape(TT, H), beta.new_zeros(C, H)])
    out = [torch.full((TT, H, D), float("nan"), dtype=dt) for _ in range(3)]
    dbeta = torch.full((TT, H), float("nan"), dtype=f)
    cu = info.cu_seqlens_cpu.tolist()
    for i_t, (i_n, i_c) in enumerate(info.chunks(C).chunk_indices.tolist()):
        start = cu[i_n] + i_c * C
        n = min(C, cu[i_n + 1] - start)
        for i_h in range(H):
            bq, bk, bv, bdo, bdv, bt = (x[start:start + C, i_h] for x in rows)
            tile = grad_tile(bq, bk, bv, bdo, bdv, h[i_t, i_h], dh[i_t, i_h], bt, betas[start:start + C, i_h], n,
                             scale, dt, bug)
            for o, x in zip(out, tile):
                o[start:start + n, i_h] = x[:n].to(dt)
            dbeta[start:start + n, i_h] = tile[3][:n]
    return (*(o.reshape(x.shape) for o, x in zip(out, (q, k, v))), dbeta.reshape(beta.shape))


def exact_inputs(q, k, v, beta, h0, do, dht, scale, info):
    """T~ [1, TT, H, C], h, dh [NT, H, K, V], dV' of a float64 batch by DESIGN.md §2-§3 (q unscaled)."""
    TT, H, K = q.shape[1], q.shape[2], q.shape[3]
    tinv = torch.zeros(1, TT, H, C, dtype=torch.float64)
    NT = info.chunks(C).num_chunks
    h = torch.zeros(NT, H, K, v.shape[-1], dtype=torch.float64)
    dh, dvp = torch.zeros_like(h), torch.zeros_like(v)
    cu, first = info.cu_seqlens_cpu.tolist(), info.chunks(C).chunk_offsets.tolist()
    for i_n in range(info.num_seqs):
        spans = [(s, min(s + C, cu[i_n + 1])) for s in range(cu[i_n], cu[i_n + 1], C)]
        for i_h in range(H):
            s, ws = h0[i_n, i_h].clone(), []
            for c, (a, e) in enumerate(spans):
                kc, vc, bc = k[0, a:e, i_h], v[0, a:e, i_h], beta[0, a:e, i_h]
                t = torch.linalg.inv(torch.eye(e - a, dtype=torch.float64) + torch.tril(bc[:, None] * kc @ kc.T, -1))
                tinv[0, a:e, i_h, :e - a] = t
                w = t @ (bc[:, None] * kc)
                h[first[i_n] + c, i_h] = s
                s = s + kc.T @ (t @ (bc[:, None] * vc) - w @ s)
                ws.append(w)
            ds = dht[i_n, i_h].clone()
            for c in reversed(range(len(spans))):
                a, e = spans[c]
                qc, kc, doc = q[0, a:e, i_h], k[0, a:e, i_h], do[0, a:e, i_h]
                dh[first[i_n] + c, i_h] = ds
                dvc = torch.tril(qc @ kc.T * scale).T @ doc + kc @ ds
                dvp[0, a:e, i_h] = dvc
                ds = ds + scale * qc.T @ doc - ws[c].T @ dvc
    return tinv, h, dh, dvp


def varlen(lengths):
    cu = random_cu_seqlens(lengths)
    return seq_info(1, sum(lengths), torch.device("cpu"), cu, cu), cu


@pytest.mark.parametrize("lengths", [[200, 200], [0, 1, 63, 64, 65, 130, 7], [1]])
def test_float64_model_equals_the_oracle(lengths):
    H, K, scale = 2, 32, 32 ** -0.5  # the algebra does not depend on the head size: small heads run fast
    info, cu = varlen(lengths)
    N, TT = len(lengths), sum(lengths)
    x = make_inputs(1, TT, H, K, K, torch.float64, initial_state=True, N=N, seed=len(lengths), requires_grad=True)
    g = torch.Generator().manual_seed(1)
    do = torch.randn(1, TT, H, K, generator=g, dtype=torch.float64)
    dht = torch.randn(N, H, K, K, generator=g, dtype=torch.float64)
    o, final = chunk_delta_rule_reference(x["q"], x["k"], x["v"], x["beta"], scale, x["initial_state"], True,
                                          cu_seqlens=cu, chunk_size=C)
    ref = torch.autograd.grad((o * do).sum() + (final * dht).sum(), [x[n] for n in ("q", "k", "v", "beta")])
    q, k, v, beta, h0 = (x[n].detach() for n in ("q", "k", "v", "beta", "initial_state"))
    tinv, h, dh, dvp = exact_inputs(q, k, v, beta, h0, do, dht, scale, info)
    got = kernel_model(q, k, v, beta, tinv, h, dh, dvp, do, scale, info)
    for name, a, b in zip(("dq", "dk", "dv", "dbeta"), got, ref):
        assert rel_rms(a, b) < 1e-10, f"{name}: rel RMS {rel_rms(a, b):.2e}"


def model_namespace(bug=None):
    return type("Model", (), dict(gluon_grad=staticmethod(lambda *a: kernel_model(*a, bug=bug))))


def fp16_case(case, dtype=torch.float16):
    if case == "dense":  # 200 = 3 chunks + 8 rows: each partial chunk reads the next sequence's rows or zeros
        return gpu_test.grad_inputs(2, 200, 2, dtype, "cpu", seed=3)
    if case == "T=1":
        return gpu_test.grad_inputs(3, 1, 2, dtype, "cpu", seed=4)
    if case == "parallel keys":
        return gpu_test.grad_inputs(1, 130, 2, dtype, "cpu", seed=5, parallel_keys=True)
    lengths = [0, 1, 63, 64, 65, 130, 7]
    return gpu_test.grad_inputs(1, sum(lengths), 2, dtype, "cpu", N=len(lengths), seed=3,
                                cu_seqlens=random_cu_seqlens(lengths))


needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="the Triton pair on CPU tensors needs the interpreter")


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", ["dense", "varlen", "T=1", "parallel keys"])
def test_fp16_model_against_the_pair(case, dtype):
    # the GPU test's check() and bounds (nearly parallel keys against the exact stage, as there); the model
    # against itself would tell nothing
    x, info = fp16_case(case, dtype)
    gpu_test.check(model_namespace(), x, info, exact=case == "parallel keys", model=False)


@needs_interpreter
@pytest.mark.parametrize("bug, case", [("T~ not masked", "varlen"), ("dP not masked", "varlen"),
                                       ("T rounded", "parallel keys"), ("dA rounded", "parallel keys")])
def test_check_fails_on_wrong_kernels(bug, case):
    x, info = fp16_case(case)
    with pytest.raises(AssertionError):
        gpu_test.check(model_namespace(bug), x, info, exact=case == "parallel keys", model=False)
    # and on the model's side (the GPU test's tighter check): the bug's kernel against the model
    with pytest.raises(AssertionError, match="against the model"):
        gpu_test.check(model_namespace(bug), x, info, exact=case == "parallel keys")


@needs_interpreter
@pytest.mark.parametrize("case", ["dense", "varlen"])
def test_backward_with_the_model_against_the_oracle(monkeypatch, case):
    lengths = [200, 200] if case == "dense" else [0, 1, 63, 64, 65, 130, 7]
    info, cu = varlen(lengths)
    N, TT, H, D, scale = len(lengths), sum(lengths), 2, 128, 128 ** -0.5
    x = make_inputs(1, TT, H, D, D, torch.float16, initial_state=True, N=N, seed=9)
    g = torch.Generator().manual_seed(2)
    do = torch.randn(1, TT, H, D, generator=g).half()
    dht = torch.randn(N, H, D, D, generator=g)
    monkeypatch.setattr(backward, "GLUON_GRAD", True)
    monkeypatch.setattr(backward, "gluon_grad_applies", lambda *a: True)
    monkeypatch.setattr(backward, "gluon_grad_kernel", lambda: kernel_model)
    q, k, v, beta, h0 = (x[n] for n in ("q", "k", "v", "beta", "initial_state"))
    _, _, saved, _ = chunk.forward(q, k, v, beta, scale, h0, True, info)
    got = chunk.backward(q, k, v, beta, scale, h0, saved, do, dht, info, C)
    ref_x = {n: t.double().requires_grad_() for n, t in x.items()}
    o, final = chunk_delta_rule_reference(*(ref_x[n] for n in ("q", "k", "v", "beta")), scale,
                                          ref_x["initial_state"], True, cu_seqlens=cu, chunk_size=C)
    ref = torch.autograd.grad((o * do.double()).sum() + (final * dht.double()).sum(),
                              [ref_x[n] for n in ("q", "k", "v", "beta", "initial_state")])
    for name, a, b in zip(("dq", "dk", "dv", "dbeta", "dh0"), got, ref):
        assert rel_rms(a, b) <= BOUNDS[torch.float16], f"{name}: rel RMS {rel_rms(a, b):.2e}"
