"""Backward of the Triton chunk pipeline (deltatron/kernels/chunk/*_bwd.py, backward.py).

Stages are checked against torch.autograd through float64 models of the same per-chunk quantities; the
whole backward against torch.autograd through the float64 recurrence (DESIGN.md §1), via the public API."""
import importlib

import pytest
import torch

import deltatron
from deltatron.kernels.chunk import output_bwd, state, state_bwd, wy, wy_bwd
from deltatron.kernels.utils import seq_info
from deltatron.reference import intra_chunk_wy, recurrent_delta_rule

from ..helpers import (BOUNDS, DEVICE, INTERPRET, chunk_spans, make_inputs, nearly_parallel_keys, random_cu_seqlens,
                       rel_rms, transposed_states)

pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not INTERPRET, reason="needs a GPU or TRITON_INTERPRET=1")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# two computations of one quantity whose fp32 sums run in another order, rounded to the dtype at the end: about
# one rounding of the dtype apart where a sum lands near a rounding boundary (fp32: the sums' order alone)
ONE_ROUNDING = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def packed(lengths, H, K, V, dtype, seed):
    """Random packed inputs [1, TT, H, *] (keys unnormalized, beta in (0, 2): the transition may grow) with
    their SeqInfo and a float64 copy of each tensor as it is after rounding to dtype."""
    inp = make_inputs(1, sum(lengths), H, K, V, dtype, device=DEVICE, normalized_keys=False, beta_max=2.0,
                      seed=seed)
    cu = random_cu_seqlens(lengths, DEVICE)
    info = seq_info(1, sum(lengths), torch.device(DEVICE), cu, cu.cpu())
    ref = {n: x[0].detach().cpu().double() for n, x in inp.items()}
    return inp, info, ref


def heads_first(x, t0, t1):
    return x[t0:t1].transpose(0, 1)  # [t, H, D] -> [H, t, D]


def wy_model(k, v, beta, lengths, C):
    """Float64 W, U [TT, H, *] and T~ [TT, H, C] of every chunk (intra_chunk_wy). T~ is NaN off its
    support (above the diagonal, past the chunk's end): a kernel must not read it there."""
    TT, H = beta.shape
    ws, us, tinv = [], [], k.new_full((TT, H, C), float("nan"))
    for t0, t1 in chunk_spans(lengths, C):
        _, t, w, u = intra_chunk_wy(heads_first(k, t0, t1), heads_first(v, t0, t1), beta[t0:t1].T)
        lower = torch.ones(t1 - t0, t1 - t0, dtype=torch.bool).tril()
        tinv[t0:t1, :, : t1 - t0] = t.transpose(0, 1).where(lower[:, None], float("nan"))
        ws.append(w.transpose(0, 1))
        us.append(u.transpose(0, 1))
    cat = lambda xs, D: torch.cat(xs) if xs else k.new_zeros(0, H, D)
    return cat(ws, k.shape[-1]), cat(us, v.shape[-1]), tinv


def state_model(q, k, w, u, s0, scale, lengths, C):
    """Float64 state pass and output of DESIGN.md §2 given W and U, chunk by chunk. Returns o [TT, H, V],
    final states [N, H, K, V], the state entering and the state leaving every chunk, V' [TT, H, V]."""
    outs, finals, entering, leaving, v_new = [], [], [], [], []
    bos = 0
    for n, L in enumerate(lengths):
        S = s0[n]
        for t0, t1 in chunk_spans([L], C):
            qc, kc, wc, uc = (heads_first(x, bos + t0, bos + t1) for x in (q, k, w, u))
            vn = uc - wc @ S
            outs.append((scale * (qc @ S + (qc @ kc.transpose(1, 2)).tril() @ vn)).transpose(0, 1))
            v_new.append(vn.transpose(0, 1))
            entering.append(S)
            S = S + kc.transpose(1, 2) @ vn
            leaving.append(S)
        finals.append(S)
        bos += L
    cat = lambda xs: torch.cat(xs) if xs else u.new_zeros(0, *u.shape[1:])
    return cat(outs), torch.stack(finals), entering, leaving, cat(v_new)


def to_dev(x, dtype):
    return x.to(device=DEVICE, dtype=dtype)[None].contiguous()


# ---------------------------------------------------------------------------------------------------
# stages


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("C", [16, 64])
def test_dv_local(dtype, C, poison):
    lengths, H, K, V = [C + 1, 1, 2 * C], 2, 40, 24
    inp, info, ref = packed(lengths, H, K, V, dtype, seed=1)
    do = torch.randn(1, sum(lengths), H, V, dtype=dtype, device=DEVICE)
    scale = 0.3
    got = output_bwd.dv_local(inp["q"], inp["k"], do, scale, info, C)
    want = torch.zeros(sum(lengths), H, V, dtype=torch.float64)
    dod = do[0].cpu().double()
    for t0, t1 in chunk_spans(lengths, C):
        qk = (heads_first(ref["q"], t0, t1) @ heads_first(ref["k"], t0, t1).transpose(1, 2)).tril()
        want[t0:t1] = (scale * qk.transpose(1, 2) @ heads_first(dod, t0, t1)).transpose(0, 1)
    assert got.dtype == dtype
    assert rel_rms(got[0], want) <= BOUNDS[dtype]


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
    inp, info, ref = packed(lengths, H, K, V, dtype, seed=C + len(lengths))
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
    dv_loc = output_bwd.dv_local(inp["q"], inp["k"], dt_(do), scale, info, C)
    dh, dv, dh0 = state_bwd.state_bwd(inp["q"], inp["k"], dt_(w), dt_(do), dv_loc,
                                      None if dht is None else dht.float().to(DEVICE), scale, True, info, C)
    dq, dk, dw = output_bwd.dqkw(inp["q"], inp["k"], dt_(v_new), h, dh, dt_(do), dv, scale, info, C)
    # the same stage on the forward's saved layout (states_t: S^T, V'^T per chunk): the same products on operands
    # laid out otherwise (the interpreter's fp32 sums then run in another order: 1e-7 apart)
    st, vt = transposed_states(h, dt_(v_new), lengths, C)
    for got, want in zip(output_bwd.dqkw(inp["q"], inp["k"], vt, st, dh, dt_(do), dv, scale, info, C, states_t=True),
                         (dq, dk, dw)):
        assert got.dtype == want.dtype and rel_rms(got, want) <= ONE_ROUNDING[dtype]

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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("C, lengths, K, V, with_dht", [
    (16, [0, 1, 17, 33, 0], 24, 40, True),  # empty sequences, a 1-token one, partial last chunks
    (32, [1], 40, 24, True),  # T = 1
    (16, [20, 40], 24, 72, False),  # two V-blocks, the second partial
])
def test_state_bwd_fused_matches_unfused(dtype, C, lengths, K, V, with_dht, poison):
    """The reverse state pass computing dV'_local itself (dv_local=None, the backward's path) against the
    unfused pair output_bwd.dv_local + state_bwd on the same inputs. They round A^T alike; the fused pass
    keeps dV'_local in fp32 where the unfused store rounds it, so they differ by about one rounding of the
    dtype (none in fp32) and the order of fp32 sums."""
    H = 2
    inp, info, _ = packed(lengths, H, K, V, dtype, seed=C + K + V)
    N, TT = len(lengths), sum(lengths)
    g = torch.Generator().manual_seed(5)
    w = (0.3 * torch.randn(1, TT, H, K, generator=g)).to(device=DEVICE, dtype=dtype)
    do = torch.randn(1, TT, H, V, generator=g).to(device=DEVICE, dtype=dtype)
    dht = torch.randn(N, H, K, V, generator=g).to(DEVICE) if with_dht else None
    scale = 0.4
    dv_loc = output_bwd.dv_local(inp["q"], inp["k"], do, scale, info, C)
    unfused = state_bwd.state_bwd(inp["q"], inp["k"], w, do, dv_loc, dht, scale, True, info, C)
    fused = state_bwd.state_bwd(inp["q"], inp["k"], w, do, None, dht, scale, True, info, C)
    close = ONE_ROUNDING[dtype]
    for name, got, want in zip(("dh", "dv", "dh0"), fused, unfused):
        assert got.dtype == want.dtype, name
        assert rel_rms(got, want) <= close, f"{name}: rel RMS {rel_rms(got, want):.2e}"


@pytest.mark.parametrize("dtype, C, lengths, K, V, has_h0", [
    (torch.float32, 16, [0, 1, 17, 33, 0], 24, 40, True),  # empty sequences, a 1-token one, partial chunks
    (torch.float32, 32, [20, 40], 40, 72, False),  # two V-blocks, the second partial
    (torch.float16, 32, [1], 40, 24, True),  # T = 1
    (torch.float16, 16, [0, 15, 16, 17], 24, 40, False),
    (torch.bfloat16, 64, [65, 0, 3], 40, 32, True),
    (torch.bfloat16, 16, [20, 40], 24, 72, False),
])
def test_state_wy_fwd_matches_composition(dtype, C, lengths, K, V, has_h0, poison):
    """The walk computing W, U on chip from the stored Tinv (the backward's recompute) against
    wy.recompute_w_u + state.state_fwd: the same products in the same order (wy.wy_product), so the same
    bits: W (written by the first V-block's programs only), h, v_new and the final state."""
    H = 2
    inp, info, _ = packed(lengths, H, K, V, dtype, seed=C + K + V)
    h0 = torch.randn(len(lengths), H, K, V, device=DEVICE) if has_h0 else None
    k, v, beta = inp["k"], inp["v"], inp["beta"]
    tinv = wy.tinv_fwd(k, beta, info, C)
    w, u = wy.recompute_w_u(k, v, beta, tinv, info, C)
    want = (w, *state.state_fwd(k, w, u, h0, True, info, C))
    got = state.state_wy_fwd(k, v, beta, tinv, h0, True, info, C)
    for name, x, ref in zip(("w", "h", "v_new", "final_state"), got, want):
        assert x.dtype == ref.dtype and x.shape == ref.shape, name
        assert torch.equal(x, ref), f"{name}: rel RMS {rel_rms(x, ref):.2e}"
    assert state.state_wy_fwd(k, v, beta, tinv, h0, False, info, C)[3] is None


@pytest.mark.parametrize("dtype, C, lengths, K, V, has_h0, with_dht", [
    (torch.float32, 16, [0, 1, 17, 33, 0], 24, 40, True, True),  # empty sequences, a 1-token one, partial chunks
    (torch.float16, 32, [1], 40, 24, False, True),  # T = 1
    (torch.bfloat16, 64, [65, 0, 3], 40, 72, True, False),  # two V-blocks, the second partial
])
def test_backward_on_forward_states_matches_recompute(dtype, C, lengths, K, V, has_h0, with_dht, poison):
    """The backward from saved (T~, W, S^T, V'^T) (chunk_delta_rule's save_states: the forward's Gluon walk saves
    them; here laid out from the recompute's own W, h, v_new) against the one from T~ alone, which recomputes them:
    the same stages on the same values, dQ/dK/dW's operands laid out otherwise (about one rounding apart)."""
    H = 2
    inp, info, _ = packed(lengths, H, K, V, dtype, seed=C + K + 1)
    N, TT = len(lengths), sum(lengths)
    g = torch.Generator().manual_seed(13)
    h0 = torch.randn(N, H, K, V, generator=g).to(DEVICE) if has_h0 else None
    do = torch.randn(1, TT, H, V, generator=g).to(device=DEVICE, dtype=dtype)
    dht = torch.randn(N, H, K, V, generator=g).to(DEVICE) if with_dht else None
    q, k, v, beta = inp["q"], inp["k"], inp["v"], inp["beta"]
    tinv = wy.tinv_fwd(k, beta, info, C)
    w, h, v_new, _ = state.state_wy_fwd(k, v, beta, tinv, h0, False, info, C)
    kept = (tinv, w, *transposed_states(h, v_new, lengths, C))
    chunk_backward = importlib.import_module("deltatron.kernels.chunk.backward")
    want = chunk_backward.backward(q, k, v, beta, 0.4, h0, (tinv,), do, dht, info, C)
    got = chunk_backward.backward(q, k, v, beta, 0.4, h0, kept, do, dht, info, C)
    for name, x, ref in zip(("dq", "dk", "dv", "dbeta", "dh0"), got, want):
        assert (x is None) == (ref is None) == (name == "dh0" and not has_h0), name
        assert x is None or (x.dtype == ref.dtype and rel_rms(x, ref) <= ONE_ROUNDING[dtype]), name


@pytest.mark.parametrize("walk, segments, split, expected", [
    (True, 1, False, True), (False, 1, False, False), (True, 2, False, False), (True, 1, True, False)])
def test_keeps_forward_states_only_where_its_backward_reads_them(monkeypatch, walk, segments, split, expected):
    # where the forward's walk is the Gluon one (the only one that saves them) and the backward runs neither segmented
    # nor split (those recompute on their own terms)
    chunk_backward = importlib.import_module("deltatron.kernels.chunk.backward")
    monkeypatch.setattr(chunk_backward, "REVERSE_SPLIT", split)
    monkeypatch.setattr(chunk_backward.state, "gluon_walk_pays", lambda *a: walk)
    monkeypatch.setattr(chunk_backward, "num_segments", lambda k, info: segments)
    x = make_inputs(1, 64, 2, 16, 16, torch.bfloat16)
    info = seq_info(1, 64, torch.device("cpu"), None, None)
    assert chunk_backward.keeps_forward_states(x["q"], x["k"], x["v"], info, 64) is expected


def test_state_output_fwd_refuses_states_off_the_gluon_walk():
    x = make_inputs(1, 64, 2, 16, 16, torch.bfloat16, device=DEVICE)
    info = seq_info(1, 64, torch.device(DEVICE), None, None)
    states = state.states_buffers(x["k"], x["v"], info, 64)
    with pytest.raises(ValueError, match="Gluon walk only"):
        state.state_output_fwd(x["q"], x["k"], x["k"], x["v"], 0.1, None, False, info, 64, states)


def stand_in_for_the_saving_walk(monkeypatch, lengths) -> list:
    """Off the GPU, the forward's states kept as the Gluon walk keeps them: keeps_forward_states true, and the walk
    stood in for by the Triton walk and output, its h and V' laid out as the Gluon walk stores them
    (transposed_states). Returns the list each backward_on_forward_states call appends its kept (W, S^T, V'^T) to."""
    chunk = importlib.import_module("deltatron.kernels.chunk")
    chunk_backward = importlib.import_module("deltatron.kernels.chunk.backward")
    from deltatron.kernels.chunk import output

    def walk_saving_states(q, k, w, u, scale, h0, output_final_state, info, chunk_size, states=None, residual=False):
        assert not residual  # (the residual form does not run off the Gluon walk; kept states need W, U)
        h, v_new, final = state.state_fwd(k, w, u, h0, output_final_state, info, chunk_size)
        for buf, x in zip(states or (), transposed_states(h, v_new, lengths, chunk_size)):
            buf.copy_(x)
        return output.output_fwd(q, k, v_new, h, scale, info, chunk_size), final

    ran = []
    on_states = chunk_backward.backward_on_forward_states
    monkeypatch.setattr(chunk, "keeps_forward_states", lambda *a: True)
    monkeypatch.setattr(chunk, "state_output_fwd", walk_saving_states)
    monkeypatch.setattr(chunk_backward, "backward_on_forward_states", lambda *a: ran.append(a[7]) or on_states(*a))
    return ran


@pytest.mark.parametrize("dtype, lengths, save_states", [(torch.bfloat16, [0, 1, 33, 16], True),
                                                       (torch.float16, [40], True), (torch.float16, [40], False)])
def test_api_gradients_from_kept_states(monkeypatch, dtype, lengths, save_states, poison):
    """Through the API and autograd: with save_states, the forward keeps (T~, W, S^T, V'^T) where
    keeps_forward_states says so, and the backward runs on them (backward_on_forward_states) instead of
    recomputing; the gradients match the float64 recurrence as the recomputing backward's do; without it nothing is
    kept."""
    C = 16
    ran = stand_in_for_the_saving_walk(monkeypatch, lengths)
    check_against_recurrence(monkeypatch, 1, lengths, 2, 24, 32, dtype, C, True, True, seed=len(lengths),
                             save_states=save_states)
    if not save_states:
        assert ran == []
        return
    ((w, st, vt), ) = ran
    NT = sum((L + C - 1) // C for L in lengths)
    assert (w.shape, st.shape, vt.shape) == ((1, sum(lengths), 2, 24), (NT, 2, 32, 24), (NT, 2, 32, C))


def test_kept_states_serve_a_retained_graph_twice(monkeypatch, poison):
    # backward twice through one forward (retain_graph=True): the kept states are still there the second time, and
    # give the same gradients
    ran = stand_in_for_the_saving_walk(monkeypatch, [30, 0, 17])
    monkeypatch.setenv("DELTATRON_BACKEND", "triton")
    x = make_inputs(1, 47, 2, 16, 16, torch.bfloat16, device=DEVICE, initial_state=True, N=3, seed=8,
                    requires_grad=True)
    cu = random_cu_seqlens([30, 0, 17], DEVICE)
    o, _ = deltatron.chunk_delta_rule(x["q"], x["k"], x["v"], x["beta"], initial_state=x["initial_state"],
                                      cu_seqlens=cu, chunk_size=16, save_states=True)
    inputs = list(x.values())
    first = torch.autograd.grad(o.float().sum(), inputs, retain_graph=True)
    second = torch.autograd.grad(o.float().sum(), inputs)
    assert len(ran) == 2 and all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_kept_states_under_activation_checkpointing(monkeypatch, use_reentrant, poison):
    # torch.utils.checkpoint around the op: the kept states (saved for backward like T~, through save_for_backward)
    # are not held after the checkpointed forward; the backward's recomputed forward keeps them again and the
    # backward runs on those, with the gradients of the plain call
    import gc
    import weakref

    chunk = importlib.import_module("deltatron.kernels.chunk")
    ran = stand_in_for_the_saving_walk(monkeypatch, [30, 17])
    kept_refs = []
    buffers = chunk.states_buffers
    monkeypatch.setattr(chunk, "states_buffers",
                        lambda *a: (lambda out: kept_refs.extend(weakref.ref(t) for t in out) or out)(buffers(*a)))
    monkeypatch.setenv("DELTATRON_BACKEND", "triton")
    x = make_inputs(1, 47, 2, 16, 16, torch.bfloat16, device=DEVICE, N=2, seed=9, requires_grad=True)
    cu = random_cu_seqlens([30, 17], DEVICE)
    inputs = [x[n] for n in ("q", "k", "v", "beta")]

    def op(q, k, v, beta):
        return deltatron.chunk_delta_rule(q, k, v, beta, cu_seqlens=cu, chunk_size=16, save_states=True)[0]

    want = torch.autograd.grad(op(*inputs).float().sum(), inputs)
    assert len(ran) == 1
    kept_refs.clear()
    o = torch.utils.checkpoint.checkpoint(op, *inputs, use_reentrant=use_reentrant)
    gc.collect()
    assert all(ref() is None for ref in kept_refs), "the checkpointed forward's states outlived it"
    o.float().sum().backward()  # (reentrant checkpointing takes .backward(), not autograd.grad)
    assert len(ran) == 2 and all(torch.equal(t.grad, g) for t, g in zip(inputs, want))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("C, lengths, K, V, parallel_keys", [
    (16, [0, 1, 17, 33], 24, 40, False), (64, [64, 65], 40, 24, False), (32, [31], 16, 16, False),
    (64, [128, 40], 32, 32, True),
])
def test_wy_bwd(dtype, C, lengths, K, V, parallel_keys, poison):
    """dK, dV, dbeta through W = T~ (beta K), U = T~ (beta V) against autograd of intra_chunk_wy."""
    H = 2
    inp, info, ref = packed(lengths, H, K, V, dtype, seed=3 * C + K)
    if parallel_keys:
        inp["k"], inp["beta"] = nearly_parallel_keys(inp["k"].shape, 1.95, dtype, DEVICE, seed=C + K)
        ref["k"], ref["beta"] = (inp[n][0].cpu().double() for n in ("k", "beta"))
    k, v, beta = (ref[n].clone().requires_grad_() for n in ("k", "v", "beta"))
    w, u, tinv = wy_model(k, v, beta, lengths, C)
    g = torch.Generator().manual_seed(11)
    dw, du = (torch.randn(x.shape, generator=g, dtype=torch.float64).to(dtype).double() for x in (w, u))
    dk_direct = torch.randn(k.shape, generator=g, dtype=torch.float64).to(dtype).double()  # as dqkw stores it
    ((w * dw).sum() + (u * du).sum() + (k * dk_direct).sum()).backward()

    dk, dv, dbeta = wy_bwd.wy_bwd(inp["k"], inp["v"], inp["beta"], to_dev(tinv.detach(), torch.float32),
                                  to_dev(dw, dtype), to_dev(du, dtype), to_dev(dk_direct, dtype), info, C)
    bound = BOUNDS[dtype]
    assert dk.dtype == dtype and dv.dtype == dtype and dbeta.dtype == inp["beta"].dtype
    assert rel_rms(dk[0], k.grad) <= bound
    assert rel_rms(dv[0], v.grad) <= bound
    assert rel_rms(dbeta[0], beta.grad) <= bound


# ---------------------------------------------------------------------------------------------------
# the whole backward, through the public API, against autograd through the float64 recurrence


def gradients(fn, inp, scale, do, dht, cu_seqlens=None, **opts):
    """(dq, dk, dv, dbeta, dh0 or None) of sum(o * do) + sum(final_state * dht) (dht may be None)."""
    o, final = fn(inp["q"], inp["k"], inp["v"], inp["beta"], scale, inp.get("initial_state"), dht is not None,
                  cu_seqlens=cu_seqlens, **opts)[:2]
    loss = (o.double() * do.double()).sum() + (0 if dht is None else (final.double() * dht.double()).sum())
    names = [n for n in ("q", "k", "v", "beta", "initial_state") if n in inp]
    grads = dict(zip(names, torch.autograd.grad(loss, [inp[n] for n in names])))
    return [grads.get(n) for n in ("q", "k", "v", "beta", "initial_state")]


def check_against_recurrence(monkeypatch, B, lengths_or_T, H, K, V, dtype, C, with_state, with_dht,
                             growing=False, l2norm=False, seed=0, **opts):
    """Triton chunk backward (chunk_delta_rule with opts) vs the float64 recurrence; lengths_or_T: T (fixed
    length) or a list of sequence lengths (packed, B = 1); growing: unnormalized keys and beta in (0, 2), so the
    transition is not a contraction. Returns the Triton gradients and dht."""
    monkeypatch.setenv("DELTATRON_BACKEND", "triton")
    varlen = isinstance(lengths_or_T, list)
    T = sum(lengths_or_T) if varlen else lengths_or_T
    N = len(lengths_or_T) if varlen else B
    inp = make_inputs(B, T, H, K, V, dtype, device=DEVICE, normalized_keys=not growing,
                      beta_max=2.0 if growing else 1.0, initial_state=with_state, N=N, seed=seed, requires_grad=True)
    ref_inp = {n: x.detach().cpu().double().requires_grad_() for n, x in inp.items()}
    cu = random_cu_seqlens(lengths_or_T, DEVICE) if varlen else None
    g = torch.Generator().manual_seed(seed + 1)
    do = torch.randn(B, T, H, V, generator=g).to(dtype)
    dht = torch.randn(N, H, K, V, generator=g) if with_dht else None
    scale = K ** -0.5
    want = gradients(recurrent_delta_rule, ref_inp, scale, do, dht, None if cu is None else cu.cpu(),
                     use_qk_l2norm=l2norm)
    got = gradients(deltatron.chunk_delta_rule, inp, scale, do.to(DEVICE), None if dht is None else dht.to(DEVICE),
                    cu, use_qk_l2norm_in_kernel=l2norm, chunk_size=C, **opts)
    for name, x, ref in zip(("dq", "dk", "dv", "dbeta", "dh0"), got, want):
        if ref is None:
            assert x is None, name
            continue
        assert x.dtype == (torch.float32 if name == "dh0" else dtype), name
        err = rel_rms(x, ref)
        assert err <= BOUNDS[dtype], f"{name}: rel RMS {err:.2e} > {BOUNDS[dtype]:.0e}"
    return got, dht


# C = 64 sparingly: the forward's 64 x 64 inverse is slow in the interpreter
@pytest.mark.parametrize("dtype, C, T, with_state, with_dht, growing", [
    (torch.float32, 16, 1, True, True, False),
    (torch.float32, 64, 130, True, False, True),
    (torch.float32, 32, 65, False, True, False),
    (torch.float16, 32, 63, True, True, True),
    (torch.float16, 16, 64, False, False, False),
    (torch.bfloat16, 16, 65, True, True, True),
    (torch.bfloat16, 32, 130, False, True, False),
    (torch.bfloat16, 32, 1, False, False, False),
])
def test_gradients_match_recurrence(monkeypatch, dtype, C, T, with_state, with_dht, growing, poison):
    check_against_recurrence(monkeypatch, 2, T, 1, 40, 24, dtype, C, with_state, with_dht, growing, seed=T + C)


def test_gradients_head_size_over_128_fp32(monkeypatch, poison):
    # K = 130 takes 256-row state tiles; in fp32 the reverse state pass then uses 16-column V-blocks (the
    # 32 of other dtypes do not fit sm_90's shared memory), so V = 40 spans three of them, the last partial
    check_against_recurrence(monkeypatch, 1, 70, 1, 130, 40, torch.float32, 16, True, True, False, seed=130)


@pytest.mark.parametrize("dtype, C", [(torch.float32, 16), (torch.bfloat16, 32)])
def test_gradients_varlen(monkeypatch, dtype, C, poison):
    lengths = [0, 1, C + 1, C - 1, 2 * C, 0]
    (*_, dh0), dht = check_against_recurrence(monkeypatch, 1, lengths, 2, 24, 32, dtype, C, True, True, seed=C)
    for n in (0, len(lengths) - 1):  # a sequence without tokens passes dht to dh0 untouched
        assert torch.equal(dh0[n].cpu(), dht[n])


def test_gradients_with_qk_l2norm(monkeypatch, poison):
    check_against_recurrence(monkeypatch, 1, 65, 2, 24, 16, torch.float16, 32, True, True, growing=True,
                             l2norm=True, seed=4)


@pytest.mark.parametrize("dtype, watched", [
    (torch.float32, {"w", "u", "h", "v_new", "dh"}),  # W, U from recompute_w_u, then the plain walk
    (torch.bfloat16, {"w", "h", "v_new", "dh"}),  # the walk computing W, U on chip (state.wy_on_chip)
])
def test_backward_releases_intermediates_before_the_wy_stage(monkeypatch, dtype, watched):
    """Memory: W, U, the chunk states h, V' and dS are dead when the WY backward allocates its outputs, so
    they do not add to the peak of forward+backward (benchmarks/NOTES.md, peak memory)."""
    import importlib
    import types
    import weakref

    from deltatron.kernels.chunk import state, wy

    # the module: the package exports a function of the same name
    chunk_backward = importlib.import_module("deltatron.kernels.chunk.backward")

    refs = {}

    def recording(fn, labels):
        """fn, keeping a weak reference to each output named in labels (None: not watched)."""
        def wrapped(*args, **kwargs):
            result = fn(*args, **kwargs)
            refs.update({label: weakref.ref(x) for label, x in zip(labels, result) if label})
            return result
        return wrapped

    def wy_bwd_checking(*args, **kwargs):
        alive = sorted(name for name, ref in refs.items() if ref() is not None)
        assert alive == [], f"still alive when the WY backward runs: {alive}"
        return wy_bwd.wy_bwd(*args, **kwargs)

    stages = dict(
        wy=types.SimpleNamespace(recompute_w_u=recording(wy.recompute_w_u, ("w", "u"))),
        state=types.SimpleNamespace(state_fwd=recording(state.state_fwd, ("h", "v_new", None)),
                                    state_wy_fwd=recording(state.state_wy_fwd, ("w", "h", "v_new", None)),
                                    wy_on_chip=state.wy_on_chip),
        state_bwd=types.SimpleNamespace(state_bwd=recording(state_bwd.state_bwd, ("dh", None, None))),
        wy_bwd=types.SimpleNamespace(wy_bwd=wy_bwd_checking),
    )
    for name, stage in stages.items():
        monkeypatch.setattr(chunk_backward, name, stage)
    monkeypatch.setenv("DELTATRON_BACKEND", "triton")
    inp = make_inputs(1, 100, 2, 32, 32, dtype, device=DEVICE, seed=0, requires_grad=True)
    o, _ = deltatron.chunk_delta_rule(inp["q"], inp["k"], inp["v"], inp["beta"])
    torch.autograd.grad(o.sum(), (inp["q"], inp["k"], inp["v"], inp["beta"]))
    assert set(refs) == watched


@pytest.mark.parametrize("N, T, H, forced, expected", [
    (2, 8192, 32, None, True), (1, 32768, 16, None, True), (1, 8192, 132, None, True), (16, 8192, 1, None, True),
    (1, 8192, 15, None, False), (1, 8192, 133, None, False), (20, 8192, 16, None, False),
    (4, 4096, 16, None, True), (8, 2048, 16, None, True), (16, 2047, 8, None, False), (8, 1024, 16, None, False),
    (4, 4096, 16, True, True), (2, 8192, 32, False, False)])
def test_gluon_reverse_pays_from_16_to_one_wave_on_long_sequences(monkeypatch, N, T, H, forced, expected):
    # where the Gluon reverse pass applies (a Hopper GPU; faked here as the H200's 132 SMs), the backward takes
    # it from 16 sequences x heads (the fewest measured) while one program a sequence and head fits one wave
    # (past it, the Triton pass was measured faster), on sequences of 2,048 tokens or more on average (the shortest
    # the whole backward was measured faster with it), unless state_bwd.GLUON_REVERSE forces it either way
    monkeypatch.setattr(state_bwd, "gluon_reverse_applies", lambda *args: True)
    monkeypatch.setattr(state_bwd, "num_sms", lambda device: 132)
    monkeypatch.setattr(state_bwd, "GLUON_REVERSE", forced)
    k = torch.empty(1, 1, H, 128, dtype=torch.bfloat16)
    info = seq_info(N, T, torch.device("cpu"), None, None)
    assert state_bwd.gluon_reverse_pays(k, k, k, k, None, info, 64) == expected


@pytest.mark.parametrize("N, T, H, forced, asked", [
    (2, 8192, 32, None, True), (8, 1024, 16, None, False), (1, 8192, 133, None, False), (8, 1024, 16, True, True),
    (2, 8192, 32, False, False)])
def test_gluon_reverse_pays_only_where_it_applies_and_asks_last(monkeypatch, N, T, H, forced, asked):
    # never where the Gluon reverse pass does not apply, even forced; and its applies check (four tensors' dtype,
    # shape, layout and alignment) is made only once the rule (or GLUON_REVERSE=True) says yes: at 8 x 16 heads
    # of 1,024 tokens the rule says no and the check is not made
    calls = []
    monkeypatch.setattr(state_bwd, "gluon_reverse_applies", lambda *args: calls.append(args) and False)
    monkeypatch.setattr(state_bwd, "num_sms", lambda device: 132)
    monkeypatch.setattr(state_bwd, "GLUON_REVERSE", forced)
    k = torch.empty(1, 1, H, 128, dtype=torch.bfloat16)
    info = seq_info(N, T, torch.device("cpu"), None, None)
    assert not state_bwd.gluon_reverse_pays(k, k, k, k, None, info, 64)
    assert len(calls) == asked


@pytest.mark.parametrize("N, T, H, expected", [
    (1, 32768, 16, True), (2, 8192, 16, True), (1, 8192, 32, True), (32, 8192, 1, True),
    (1, 32768, 33, False), (1, 32768, 64, False), (2, 8192, 32, False),  # too many sequences x heads
    (1, 8191, 16, False), (4, 4096, 8, False), (8, 2048, 2, False)])  # sequences too short
def test_overlap_pays_on_few_long_sequences_x_heads(N, T, H, expected):
    # the rule of OVERLAP_STATE_PASSES = None (the default): at most 32 sequences x heads, 8,192 tokens or more a
    # sequence on average
    chunk_backward = importlib.import_module("deltatron.kernels.chunk.backward")
    assert chunk_backward.overlap_pays(N, H, N * T) == expected


@pytest.mark.parametrize("switch", [True, None])
def test_overlap_never_off_cuda(monkeypatch, switch, poison):
    # forced (True) or chosen by its rule (None, the rule made to say yes), the overlap of the two-launch
    # recompute's state pass with the reverse pass needs CUDA streams: on CPU tensors (the interpreter) the
    # backward never asks for the side stream, takes the one-stream path and matches the recurrence
    chunk_backward = importlib.import_module("deltatron.kernels.chunk.backward")
    monkeypatch.setattr(chunk_backward, "OVERLAP_STATE_PASSES", switch)
    monkeypatch.setattr(chunk_backward, "overlap_pays", lambda *args: True)
    monkeypatch.setattr(chunk_backward, "side_stream", lambda *args: pytest.fail("asked for a side stream"))
    recomputes, recompute_w_u = [], wy.recompute_w_u
    monkeypatch.setattr(wy, "recompute_w_u", lambda *a: recomputes.append(1) or recompute_w_u(*a))
    # fp32: the two-launch recompute (state.wy_on_chip is 16-bit only)
    check_against_recurrence(monkeypatch, 1, 65, 1, 40, 24, torch.float32, 32, True, True, seed=6)
    assert recomputes == [1]
