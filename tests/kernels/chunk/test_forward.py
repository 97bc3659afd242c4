"""Forward of the Triton chunk pipeline (deltatron/kernels/chunk: kkt, solve_tril, wy, state, output).

Each stage is checked against a float64 torch computation of the same per-chunk quantity on the same
(dtype-rounded) inputs; the whole forward against the float64 recurrence (DESIGN.md §1). Shapes are tiny
for the interpreter; tests/gpu/test_chunk_forward_gpu.py runs realistic sizes."""
import pytest
import torch

import deltatron
from deltatron.kernels import chunk
from deltatron.kernels.chunk import kkt, output, solve_tril, state, wy
from deltatron.kernels.utils import seq_info
from deltatron.reference import recurrent_delta_rule
from deltatron.reference.chunk import from_chunks, intra_chunk_wy, to_chunks

from ..helpers import BOUNDS, DEVICE, INTERPRET, make_inputs, nearly_parallel_keys, random_cu_seqlens, rel_rms

pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not INTERPRET, reason="needs a GPU or TRITON_INTERPRET=1")

# float64 references of fp32 stages agree to ~1e-6; the end-to-end bounds are BOUNDS
STAGE_BOUNDS = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1e-2}
# one rounding to the dtype (its unit roundoff, about): two computations that round alike differ by this
ONE_ROUNDING = {torch.float32: 1e-6, torch.float16: 5e-4, torch.bfloat16: 4e-3}


def packed(lengths, H, K, V, dtype, seed, initial_state=False, **kw):
    """Random packed inputs [1, TT, H, *], their SeqInfo, and float64 copies of the dtype-rounded tensors."""
    inp = make_inputs(1, sum(lengths), H, K, V, dtype, device=DEVICE, seed=seed, initial_state=initial_state,
                      N=len(lengths), **kw)
    cu = random_cu_seqlens(lengths, DEVICE)
    info = seq_info(1, sum(lengths), torch.device(DEVICE), cu, cu.cpu())
    ref = {n: x.detach().cpu().double() for n, x in inp.items()}
    return inp, info, ref


def per_sequence_chunks(lengths, C, fn, *xs):
    """fn applied to each sequence's chunks (to_chunks of float64 [1, L, H, *] slices); its results, each
    [1, H, NC, C, *], are put back on token rows and concatenated: [1, TT, H, *]."""
    outs, bos = None, 0
    for L in lengths:
        if L:
            parts = fn(*(to_chunks(x[:, bos:bos + L], C) for x in xs))
            parts = [from_chunks(p, L) for p in parts]
            outs = [[p] for p in parts] if outs is None else [o + [p] for o, p in zip(outs, parts)]
        bos += L
    return [torch.cat(o, dim=1) for o in outs]


def chunk_rows(lengths, C):
    """(first token, end token, sequence) of every chunk, in global chunk order."""
    out, bos = [], 0
    for n, L in enumerate(lengths):
        out += [(t0, min(t0 + C, bos + L), n) for t0 in range(bos, bos + L, C)]
        bos += L
    return out


# ---------------------------------------------------------------- stages 1-3: A, Tinv, W, U

@pytest.mark.parametrize("dtype, C, lengths, K", [
    (torch.float32, 16, [5, 16, 17], 24),
    (torch.float32, 64, [70, 1], 40),
    (torch.bfloat16, 32, [33, 0, 9], 32),
])
def test_kkt_and_solve_tril(poison, dtype, C, lengths, K):
    inp, info, ref = packed(lengths, 2, K, 16, dtype, seed=1, normalized_keys=False, beta_max=2.0)
    A_ref, T_ref, _, _ = per_sequence_chunks(lengths, C, intra_chunk_wy, ref["k"], ref["v"], ref["beta"])
    A = kkt.chunk_kkt(inp["k"], inp["beta"], info, C)
    assert A.dtype == torch.float32
    assert rel_rms(A, A_ref) < 1e-6  # fp32 dot of the rounded inputs
    # solve_tril reads only the strict lower triangle: garbage on and above the diagonal must not matter
    upper = torch.ones(C, C, dtype=torch.bool, device=A.device).triu()
    rows = torch.cat([torch.arange(L) % C for L in lengths]).to(A.device)
    junk = torch.where(upper[rows][None, :, None, :], torch.randn_like(A), A)
    T = solve_tril.solve_tril(junk, info, C)
    assert rel_rms(T, T_ref) < 1e-5


@pytest.mark.parametrize("C", [32, 64])
def test_solve_tril_nearly_parallel_keys(poison, C):
    # repeated tokens: keys almost equal and beta near 2 make A almost 2 * (strictly lower ones), whose
    # powers grow like binomial coefficients while the inverse stays bounded (1, -2, 2, -2, ... down each
    # diagonal): an inverse built from series or powers of A would cancel catastrophically here
    lengths, K = [C, C - 3], 32
    k, beta = nearly_parallel_keys((1, sum(lengths), 2, K), 1.95, torch.float32, DEVICE, seed=5)
    cu = random_cu_seqlens(lengths, DEVICE)
    info = seq_info(1, sum(lengths), torch.device(DEVICE), cu, cu.cpu())
    _, T_ref, _, _ = per_sequence_chunks(lengths, C, intra_chunk_wy, *(x.cpu().double() for x in (k, k, beta)))
    assert T_ref.abs().max() <= 2.5  # bounded, as the comment says
    T = solve_tril.solve_tril(kkt.chunk_kkt(k, beta, info, C), info, C)
    assert rel_rms(T, T_ref) < 1e-5
    tinv, _, _ = wy.wy_fwd(k, k, beta, info, C)
    assert rel_rms(tinv, T_ref) < 1e-5


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


@pytest.mark.parametrize("precision", ["tf32_newton", "tf32x3"])
def test_solve_tril_precision_switch(poison, monkeypatch, precision):
    # the switch reaches the inverse's products (the interpreter computes tf32 dots in full fp32, so the GPU
    # suite checks the precision levels themselves; here: both variants build and are right)
    monkeypatch.setenv("DELTATRON_TRIL_PRECISION", precision)
    lengths, C = [64, 40], 64
    inp, info, ref = packed(lengths, 1, 32, 16, torch.float32, seed=2)
    _, T_ref, _, _ = per_sequence_chunks(lengths, C, intra_chunk_wy, ref["k"], ref["v"], ref["beta"])
    T = solve_tril.solve_tril(kkt.chunk_kkt(inp["k"], inp["beta"], info, C), info, C)
    assert rel_rms(T, T_ref) < 1e-5


def test_tril_precision_rejects_unknown(monkeypatch):
    monkeypatch.setenv("DELTATRON_TRIL_PRECISION", "fp64")
    lengths = [16]
    inp, info, _ = packed(lengths, 1, 16, 16, torch.float32, seed=3)
    A = kkt.chunk_kkt(inp["k"], inp["beta"], info, 16)
    with pytest.raises(ValueError, match="DELTATRON_TRIL_PRECISION"):
        solve_tril.solve_tril(A, info, 16)


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
    # fused_chunk's path: Tinv alone (no W, U), the same bits
    assert torch.equal(wy.tinv_fwd(inp["k"], inp["beta"], info, C), tinv)


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
    beta_cols = torch.zeros_like(tinv)  # [1, TT, H, C]: the beta of each column's token in the row's chunk
    for t0, t1, _ in chunk_rows(lengths, C):
        beta_cols[0, t0:t1, :, :t1 - t0] = inp["beta"][0, t0:t1].float().T[None]
    tb_fp32 = tinv * beta_cols
    hi = tb_fp32.to(dtype)
    assert torch.equal(tb[..., :C], hi)
    assert torch.equal(tb[..., C:], (tb_fp32 - hi.float()).to(dtype))
    pair = tb[..., :C].double() + tb[..., C:].double()
    assert rel_rms(pair, T_ref * beta_cols.double()) < 1e-5


def test_tinv_pair_refuses_fp32():
    inp, info, _ = packed([16], 1, 16, 16, torch.float32, seed=3)
    with pytest.raises(ValueError, match="16-bit k only"):
        wy.tinv_pair_fwd(inp["k"], inp["beta"], info, 16)


def test_residual_form_refused_off_the_gluon_walk(poison):
    # the residual form (w = Tb, u = V) exists only in the Gluon walk: the Triton walks refuse it by name rather
    # than read Tb as W
    inp, info, _ = packed([64], 2, 16, 16, torch.bfloat16, seed=3)
    _, tb = wy.tinv_pair_fwd(inp["k"], inp["beta"], info, 16)
    for walk in (lambda: state.state_output_fwd(inp["q"], inp["k"], tb, inp["v"], 0.1, None, False, info, 16,
                                                residual=True),
                 lambda: state.state_final_fwd(inp["q"], inp["k"], tb, inp["v"], None, info, 16, True)):
        with pytest.raises(ValueError, match="residual form"):
            walk()


# ---------------------------------------------------------------- stage 4: the state pass

def state_reference(k, w, u, h0, lengths, C):
    """Float64 h [NT, H, K, V] (state entering each chunk), v_new [1, TT, H, V], final [N, H, K, V]."""
    H, K, V = k.shape[2], k.shape[3], u.shape[3]
    S = {n: (h0[n] if h0 is not None else torch.zeros(H, K, V, dtype=torch.float64)) for n in range(len(lengths))}
    hs, v_new = [], torch.zeros_like(u)
    for t0, t1, n in chunk_rows(lengths, C):
        hs.append(S[n])
        k_c, w_c, u_c = (x[0, t0:t1].transpose(0, 1) for x in (k, w, u))  # [H, t, *]
        vn = u_c - w_c @ S[n]
        v_new[0, t0:t1] = vn.transpose(0, 1)
        S[n] = S[n] + k_c.transpose(1, 2) @ vn
    h = torch.stack(hs) if hs else torch.zeros(0, H, K, V, dtype=torch.float64)
    return h, v_new, torch.stack([S[n] for n in range(len(lengths))])


@pytest.mark.parametrize("dtype, C, lengths, K, V, has_h0", [
    (torch.float32, 16, [0, 1, 17, 16], 24, 40, True),
    (torch.float16, 32, [40, 0], 32, 24, False),
    (torch.bfloat16, 64, [65, 7], 40, 32, True),
])
def test_state_fwd(poison, dtype, C, lengths, K, V, has_h0):
    inp, info, ref = packed(lengths, 2, K, V, dtype, seed=5, initial_state=has_h0)
    _, _, W, U = per_sequence_chunks(lengths, C, intra_chunk_wy, ref["k"], ref["v"], ref["beta"])
    w, u = W.to(dtype).to(DEVICE), U.to(dtype).to(DEVICE)
    h0 = inp.get("initial_state")
    h, v_new, final = state.state_fwd(inp["k"], w, u, h0, True, info, C)
    h_ref, vn_ref, final_ref = state_reference(ref["k"], w.cpu().double(), u.cpu().double(), ref.get("initial_state"),
                                               lengths, C)
    assert h.dtype == dtype and v_new.dtype == dtype and final.dtype == torch.float32
    assert rel_rms(h, h_ref) < STAGE_BOUNDS[dtype]
    assert rel_rms(v_new, vn_ref) < STAGE_BOUNDS[dtype]
    assert rel_rms(final, final_ref) < STAGE_BOUNDS[dtype]
    if 0 in lengths:  # an empty sequence passes its initial state (or zeros) through exactly
        n = lengths.index(0)
        assert torch.equal(final[n], h0[n] if has_h0 else torch.zeros_like(final[n]))
    _, _, no_final = state.state_fwd(inp["k"], w, u, h0, False, info, C)
    assert no_final is None


# ---------------------------------------------------------------- stage 5: the output

def output_reference(q, k, h, v_new, scale, lengths, C):
    """Float64 o [1, TT, H, V] = scale (Q S + (Q K^T ⊙ M) V') per chunk, S = h[chunk] [NT, H, K, V]."""
    o = torch.zeros_like(v_new)
    for i, (t0, t1, _) in enumerate(chunk_rows(lengths, C)):
        q_c, k_c, vn_c = (x[0, t0:t1].transpose(0, 1) for x in (q, k, v_new))
        qk = (q_c @ k_c.transpose(1, 2)).tril()
        o[0, t0:t1] = (scale * (q_c @ h[i] + qk @ vn_c)).transpose(0, 1)
    return o


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


# ---------------------------------------------------------------- stages 4 and 5 fused: the forward's walk

@pytest.mark.parametrize("dtype, C, lengths, K, V, has_h0", [
    (torch.float32, 16, [0, 1, 17, 16], 24, 40, True),
    (torch.float32, 32, [1], 40, 24, False),
    (torch.float16, 32, [40, 0, 1, 31], 32, 24, False),
    (torch.float16, 16, [33], 24, 24, True),
    (torch.bfloat16, 64, [65, 7], 40, 32, True),
    (torch.bfloat16, 16, [0, 1, 15, 16, 17], 24, 40, False),
])
@pytest.mark.parametrize("transposed", [False, True])
def test_state_output_fwd(poison, monkeypatch, dtype, C, lengths, K, V, has_h0, transposed):
    # the fused walk (on S, or on S^T) against the float64 composition of the two stages it replaces (state
    # pass, output)
    if transposed and dtype == torch.float32:
        pytest.skip("the walk on S^T is 16-bit only")
    monkeypatch.setattr(state, "TRANSPOSED_WALK", transposed)
    H, scale = 2, 0.37
    inp, info, ref = packed(lengths, H, K, V, dtype, seed=7, initial_state=has_h0)
    _, _, W, U = per_sequence_chunks(lengths, C, intra_chunk_wy, ref["k"], ref["v"], ref["beta"])
    w, u = W.to(dtype).to(DEVICE), U.to(dtype).to(DEVICE)
    h0 = inp.get("initial_state")
    o, final = state.state_output_fwd(inp["q"], inp["k"], w, u, scale, h0, True, info, C)
    h_ref, vn_ref, final_ref = state_reference(ref["k"], w.cpu().double(), u.cpu().double(), ref.get("initial_state"),
                                               lengths, C)
    o_ref = output_reference(ref["q"], ref["k"], h_ref, vn_ref, scale, lengths, C)
    assert o.dtype == dtype and final.dtype == torch.float32
    assert rel_rms(o, o_ref) < STAGE_BOUNDS[dtype]
    assert rel_rms(final, final_ref) < STAGE_BOUNDS[dtype]
    if 0 in lengths:  # an empty sequence passes its initial state (or zeros) through exactly
        n = lengths.index(0)
        assert torch.equal(final[n], h0[n] if has_h0 else torch.zeros_like(final[n]))
    o2, no_final = state.state_output_fwd(inp["q"], inp["k"], w, u, scale, h0, False, info, C)
    assert no_final is None and torch.equal(o2, o)


@pytest.mark.parametrize("dtype, C, K, V", [
    (torch.float32, 32, 40, 24),
    (torch.float16, 16, 24, 40),
    (torch.bfloat16, 64, 32, 16),
])
@pytest.mark.parametrize("transposed", [False, True])
def test_state_output_fwd_matches_unfused(poison, monkeypatch, dtype, C, K, V, transposed):
    # same W, U: the fused walk rounds S and V' as the unfused pair does (h and v_new in the input dtype),
    # so only the order of fp32 sums may differ: on a GPU the two kernels' dots may sum in another order
    # (about one rounding apart). In the interpreter the walk on S computes the same products as the unfused
    # pair (the output stage does not tile K at these sizes), so the same bits; the walk on S^T computes the
    # transposed products (V'^T K for K^T V'), whose fp32 sums numpy's BLAS orders by CPU (equal bits on the
    # Intel hosts of earlier sessions, not on AMD EPYC): for it only the bound holds
    if transposed and dtype == torch.float32:
        pytest.skip("the walk on S^T is 16-bit only")
    monkeypatch.setattr(state, "TRANSPOSED_WALK", transposed)
    lengths, H, scale = [C + 1, 0, 1, C], 2, 0.3
    inp, info, _ = packed(lengths, H, K, V, dtype, seed=8, initial_state=True)
    _, w, u = wy.wy_fwd(inp["k"], inp["v"], inp["beta"], info, C)
    h0 = inp["initial_state"]
    h, v_new, final_unfused = state.state_fwd(inp["k"], w, u, h0, True, info, C)
    o_unfused = output.output_fwd(inp["q"], inp["k"], v_new, h, scale, info, C)
    o, final = state.state_output_fwd(inp["q"], inp["k"], w, u, scale, h0, True, info, C)
    assert rel_rms(o, o_unfused) < ONE_ROUNDING[dtype]
    assert rel_rms(final, final_unfused) < ONE_ROUNDING[dtype]
    if INTERPRET and not transposed:
        assert torch.equal(o, o_unfused) and torch.equal(final, final_unfused)


# ---------------------------------------------------------------- the whole forward

def check_forward(dtype, C, lengths, K, V, has_h0, seed, H=1, scale=None, **kw):
    inp, info, ref = packed(lengths, H, K, V, dtype, seed=seed, initial_state=has_h0, **kw)
    scale = K ** -0.5 if scale is None else scale
    o, final, saved, extras = chunk.forward(inp["q"], inp["k"], inp["v"], inp["beta"], scale,
                                            inp.get("initial_state"), True, info, chunk_size=C)
    o_ref, final_ref = recurrent_delta_rule(ref["q"], ref["k"], ref["v"], ref["beta"], scale,
                                            ref.get("initial_state"), True, cu_seqlens=info.cu_seqlens_cpu)
    assert o.dtype == dtype and o.shape == inp["v"].shape
    assert final.dtype == torch.float32 and final.shape == (len(lengths), H, K, V)
    assert extras == () and len(saved) == 1 and saved[0].shape == (1, sum(lengths), H, C)
    assert rel_rms(o, o_ref) < BOUNDS[dtype]
    assert rel_rms(final, final_ref) < BOUNDS[dtype]
    o2, no_final, _, _ = chunk.forward(inp["q"], inp["k"], inp["v"], inp["beta"], scale,
                                       inp.get("initial_state"), False, info, chunk_size=C)
    assert no_final is None and torch.equal(o2, o)
    # inference: Tinv is neither written nor saved, the results are the same
    o3, final3, nothing, _ = chunk.forward(inp["q"], inp["k"], inp["v"], inp["beta"], scale,
                                           inp.get("initial_state"), True, info, needs_backward=False, chunk_size=C)
    assert nothing == () and torch.equal(o3, o) and torch.equal(final3, final)


@pytest.mark.parametrize("dtype, C, T, K, V, has_h0", [
    (torch.float32, 16, 130, 24, 40, True),
    (torch.float32, 32, 65, 32, 16, False),
    (torch.float32, 64, 64, 40, 24, True),
    (torch.float16, 16, 63, 32, 32, True),
    (torch.float16, 64, 130, 24, 32, False),
    (torch.float16, 32, 1, 16, 24, True),
    (torch.bfloat16, 64, 65, 32, 40, True),
    (torch.bfloat16, 32, 130, 24, 16, False),
    (torch.bfloat16, 16, 64, 40, 32, True),
])
def test_forward_single_sequence(poison, dtype, C, T, K, V, has_h0):
    check_forward(dtype, C, [T], K, V, has_h0, seed=T + C)


@pytest.mark.parametrize("dtype, C, has_h0", [
    (torch.float32, 16, True),
    (torch.float16, 32, False),
    (torch.bfloat16, 64, True),
])
def test_forward_varlen(poison, dtype, C, has_h0):
    check_forward(dtype, C, [0, 1, C + 1, C, C - 1, 3], 24, 40, has_h0, seed=C, scale=0.3)


def test_forward_growing_transition(poison):
    # unnormalized keys and beta up to 2: the transition is not a contraction; the same function all the same
    check_forward(torch.float32, 32, [50, 20], 32, 24, True, seed=9, H=2, normalized_keys=False, beta_max=2.0)


def test_public_api_uses_the_kernels(poison, monkeypatch):
    monkeypatch.setenv("DELTATRON_BACKEND", "triton")
    x = make_inputs(2, 40, 2, 24, 32, torch.bfloat16, device=DEVICE, seed=11, initial_state=True)
    o, final = deltatron.chunk_delta_rule(x["q"], x["k"], x["v"], x["beta"], initial_state=x["initial_state"],
                                          output_final_state=True, chunk_size=32)
    ref = {n: t.cpu().double() for n, t in x.items()}
    o_ref, final_ref = recurrent_delta_rule(ref["q"], ref["k"], ref["v"], ref["beta"], 24 ** -0.5,
                                            ref["initial_state"], True)
    assert rel_rms(o, o_ref) < BOUNDS[torch.bfloat16]
    assert rel_rms(final, final_ref) < BOUNDS[torch.bfloat16]


@pytest.mark.parametrize("N, H, forced, expected", [(1, 16, None, True), (4, 16, None, True), (1, 8, None, False),
                                                     (3, 5, None, False), (1, 8, True, True), (8, 16, False, False)])
def test_gluon_walk_pays_from_16_sequences_x_heads(monkeypatch, N, H, forced, expected):
    # where the Gluon walk applies (a Hopper GPU; faked here), the forward takes it from 16 sequences x heads
    # (the fewest it was measured faster at) unless state.GLUON_WALK forces it either way
    monkeypatch.setattr(state, "gluon_walk_applies", lambda k, v, chunk_size: True)
    monkeypatch.setattr(state, "GLUON_WALK", forced)
    k = torch.empty(N, 1, H, 128, dtype=torch.bfloat16)
    assert state.gluon_walk_pays(k, k, seq_info(N, 1, torch.device("cpu"), None, None), 64) == expected
