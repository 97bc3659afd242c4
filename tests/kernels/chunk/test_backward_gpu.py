"""Backward of the Triton chunk pipeline at realistic sizes (H200): all five gradients against autograd
through the float64 chunkwise oracle (deltatron.reference, itself checked against the recurrence),
fixed-length and 20-sequence varlen batches, all dtypes, K = V in {64, 128, 256} and a non-power-of-two
head size; bitwise determinism; the recompute's state pass overlapped with the reverse pass on two streams; a
65536-token bf16 sequence against an fp32 reference."""
import importlib
import weakref

import pytest
import torch

import deltatron
from deltatron.kernels import chunk
from deltatron.kernels.chunk import plan
from deltatron.kernels.chunk.portable import grads, reverse, walk, wy
from deltatron.kernels.utils import seq_info
from deltatron.reference import chunk_delta_rule_reference

from ...helpers import CHUNK_SHAPES, BOUNDS, make_inputs, random_cu_seqlens, rel_rms, smoke_both_widths
from .helpers import hopper_fits

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
NAMES = ("q", "k", "v", "beta", "initial_state")


@pytest.fixture
def triton_backend(monkeypatch):
    monkeypatch.setenv("DELTATRON_BACKEND", "triton")


def run(fn, x, scale, do, dht, cu_seqlens=None, **opts):
    """(o, final_state, {name: gradient}) of the loss sum(o * do) + sum(final_state * dht)."""
    o, final = fn(x["q"], x["k"], x["v"], x["beta"], scale, x.get("initial_state"), True, cu_seqlens=cu_seqlens,
                  **opts)[:2]
    loss = (o.to(do.dtype) * do).sum() + (final.to(dht.dtype) * dht).sum()
    names = [n for n in NAMES if n in x]
    return o, final, dict(zip(names, torch.autograd.grad(loss, [x[n] for n in names])))


def check(x, scale, C, cu_seqlens=None, ref_dtype=torch.float64, outputs=False, **opts):
    """Triton gradients (public API, with opts) against those of the chunkwise reference in ref_dtype on the
    dtype-rounded inputs; with outputs, o and the final state too (the forward's GPU tests check those
    elsewhere). Returns the Triton gradients and the gradient dht given to the final state."""
    dtype = x["q"].dtype
    N = x["initial_state"].shape[0]
    H, K, V = x["q"].shape[2], x["q"].shape[3], x["v"].shape[3]
    g = torch.Generator(device="cuda").manual_seed(1)
    do = torch.randn(x["v"].shape, generator=g, device="cuda").to(dtype)
    dht = torch.randn(N, H, K, V, generator=g, device="cuda")
    ref_x = {n: t.detach().to(ref_dtype).requires_grad_() for n, t in x.items()}
    o_ref, final_ref, grads_ref = run(chunk_delta_rule_reference, ref_x, scale, do.to(ref_dtype), dht.to(ref_dtype),
                                      cu_seqlens, chunk_size=C)
    o, final, grads = run(deltatron.chunk_delta_rule, x, scale, do.double(), dht.double(), cu_seqlens,
                          cu_seqlens_cpu=None if cu_seqlens is None else cu_seqlens.cpu(), chunk_size=C, **opts)
    checks = [(f"d{n}", grads[n], grads_ref[n]) for n in grads_ref]
    if outputs:
        checks += [("o", o, o_ref), ("final_state", final, final_ref)]
    errors = {name: rel_rms(got, ref) for name, got, ref in checks}
    print("rel RMS against the reference: " + ", ".join(f"{name} {err:.2e}" for name, err in errors.items()))
    bad = [f"{name}: rel RMS {err:.2e} > {BOUNDS[dtype]:.0e}" for name, err in errors.items()
           if not err <= BOUNDS[dtype]]
    assert not bad, "; ".join(bad)
    return grads, dht


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B, T, H, D, C", CHUNK_SHAPES)
def test_backward_fixed_length(triton_backend, poison, dtype, B, T, H, D, C):
    x = make_inputs(B, T, H, D, D, dtype, device="cuda", initial_state=True, seed=T + D, requires_grad=True)
    check(x, D ** -0.5, C)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D, C", [(128, 64), (64, 32), (256, 16)])
def test_backward_varlen_20_sequences(triton_backend, poison, dtype, D, C):
    g = torch.Generator().manual_seed(D + C)
    lengths = [0, 1, C - 1, C, C + 1] + torch.randint(1, 1500, (15,), generator=g).tolist()
    lengths = [lengths[i] for i in torch.randperm(20, generator=g).tolist()]
    x = make_inputs(1, sum(lengths), 8, D, D, dtype, device="cuda", initial_state=True, N=20, seed=D,
                    requires_grad=True)
    grads, dht = check(x, 0.25, C, random_cu_seqlens(lengths, "cuda"))
    # no tokens: the gradient of the final state passes to the initial state untouched
    empty = lengths.index(0)
    assert torch.equal(grads["initial_state"][empty], dht[empty])


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_growing_transition(triton_backend, poison, dtype):
    # unnormalized keys, beta up to 2: the transition is not a contraction. The error of 16-bit
    # intermediates grows with the sequence (bf16: ~6e-3 at T = 100, ~1e-2 at 256): keep it short
    x = make_inputs(2, 100, 8, 64, 96, dtype, device="cuda", normalized_keys=False, beta_max=2.0,
                    initial_state=True, seed=3, requires_grad=True)
    check(x, 0.125, 64)


@pytest.fixture(scope="module")
def gluon_reverse_runs():
    # the Hopper reverse pass's smoke call (hopper/test_reverse_gpu.py's) in a child process before this process
    # launches it: a hang there must not take the suite with it. Both V-block widths: the plan runs 128 at 8 x 16
    # heads, 64 at 4 x 16 (plan.hopper_block_v)
    from .hopper.test_reverse_gpu import SMOKE

    smoke_both_widths(SMOKE, "the Gluon reverse pass")


def force_reverse_pass(reverse: str, x: dict, monkeypatch, request) -> list:
    """Forces the backward's reverse pass to be the portable Triton one or ("gluon") the Hopper kernel (skipped off
    sm_90, after its smoke calls) for the rest of the test (plan.overrides(hopper_reverse=...), left at teardown);
    returns the list the Hopper kernel's launches are counted in."""
    launches = []
    if reverse == "gluon":
        if not hopper_fits(x["k"], x["v"]):
            pytest.skip("the Hopper reverse pass runs on sm_90 only")
        request.getfixturevalue("gluon_reverse_runs")
        from deltatron.kernels.chunk.hopper import reverse as gluon_reverse

        state_bwd_gluon = gluon_reverse.gluon_state_bwd
        monkeypatch.setattr(gluon_reverse, "gluon_state_bwd",
                            lambda *a, **kw: launches.append(1) or state_bwd_gluon(*a, **kw))
    forced = plan.overrides(hopper_reverse=reverse == "gluon")
    forced.__enter__()
    request.addfinalizer(lambda: forced.__exit__(None, None, None))
    return launches


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reverse, B", [("triton", 8), ("gluon", 8), ("gluon", 4)])
def test_backward_one_wave_of_wide_reverse_programs(triton_backend, poison, monkeypatch, request, dtype, reverse,
                                                    B):
    # 8 x 16 heads at K = V = 128: the reverse pass runs one program per head, either Triton's of 128 columns
    # (where the GPU has at least 128 SMs; plan.reverse_launch) or the Hopper kernel on sm_90 (forced: by the
    # plan's rule only on long sequences; its launches counted); at 4 x 16 heads the
    # Gluon kernel splits V (two programs a head, block_v 64); T = 300 ends in a partial chunk
    x = make_inputs(B, 300, 16, 128, 128, dtype, device="cuda", initial_state=True, seed=5, requires_grad=True)
    launches = force_reverse_pass(reverse, x, monkeypatch, request)
    check(x, 128 ** -0.5, 64)
    assert len(launches) == (reverse == "gluon")


@pytest.mark.parametrize("dtype, T_or_lengths, H, reverse", [
    (torch.bfloat16, 4096, 16, "triton"),
    (torch.bfloat16, 4096, 16, "gluon"),
    (torch.bfloat16, [0, 1, 63, 64, 65, 700, 1500, 333], 4, "gluon"),  # varlen with empty sequences
    (torch.float32, [0, 1, 63, 64, 65, 700, 1500, 333], 4, "triton"),
])
def test_backward_overlapping_state_passes(triton_backend, poison, monkeypatch, request, dtype, T_or_lengths, H,
                                           reverse):
    # plan.overrides(overlap=True): where the recompute takes two launches (here 16-bit with few
    # sequences x heads, whose narrow V-blocks keep W, U off chip; fp32 always), state_fwd runs on the side stream
    # while the reverse pass runs on the backward's. Against the float64 oracle, and bitwise equal to the
    # backward on one stream (the same kernels on the same inputs, only the streams differ); the stream each
    # state_fwd call ran on is recorded, to show that the overlap was taken, and W, U, h, v_new must be released
    # before the WY backward, as on one stream. The Gluon reverse pass forced where named (by default it runs only
    # from 2,048 tokens a sequence), its launches counted
    chunk_backward = importlib.import_module("deltatron.kernels.chunk.backward")  # the package exports a function
    varlen = isinstance(T_or_lengths, list)
    T, N = (sum(T_or_lengths), len(T_or_lengths)) if varlen else (T_or_lengths, 1)
    x = make_inputs(1, T, H, 128, 128, dtype, device="cuda", initial_state=True, N=N, seed=7, requires_grad=True)
    cu = random_cu_seqlens(T_or_lengths, "cuda") if varlen else None
    launches = force_reverse_pass(reverse, x, monkeypatch, request)
    info = seq_info(1, T, torch.device("cuda"), cu, None if cu is None else cu.cpu())
    call_plan = chunk.plan_call(x["q"], x["k"], x["v"], info, True, 64)
    assert call_plan.recompute == "two_launch" and call_plan.segments == 1, "not the two-launch recompute"
    streams, watched, released = [], [], []
    recompute_w_u, state_fwd, wy_backward = (chunk_backward.recompute_w_u, chunk_backward.state_fwd,
                                             chunk_backward.wy_bwd)

    def watching(fn, *a, **kw):
        out = fn(*a, **kw)
        watched.extend(weakref.ref(t) for t in out[:2])  # W, U or h, v_new
        return out

    # the backward's stages, where backward.py calls them (the forward's are its own module's: not seen)
    monkeypatch.setattr(chunk_backward, "recompute_w_u", lambda *a, **kw: watching(recompute_w_u, *a, **kw))
    monkeypatch.setattr(chunk_backward, "state_fwd",
                        lambda *a, **kw: streams.append(torch.cuda.current_stream()) or watching(state_fwd, *a, **kw))
    monkeypatch.setattr(chunk_backward, "wy_bwd", lambda *a, **kw: released.append(all(ref() is None for ref in watched))
                        or wy_backward(*a, **kw))
    grads = {}
    for overlap in (False, True):
        with plan.overrides(overlap=overlap):
            grads[overlap], _ = check(x, 128 ** -0.5, 64, cu)
    assert streams == [torch.cuda.current_stream(), chunk_backward.side_stream(torch.cuda.current_device())]
    assert streams[1] != streams[0]
    assert len(watched) == 8 and released == [True, True]
    assert len(launches) == (2 if reverse == "gluon" else 0)
    for n, got in grads[True].items():
        want = grads[False][n]
        assert torch.equal(got, want), f"d{n}: not bitwise equal, rel RMS {rel_rms(got, want):.2e}"


@pytest.fixture(scope="module")
def gluon_walk_runs():
    # the Hopper walk's smoke calls (hopper/test_walk_gpu.py's, saving the states among them) in a child process first
    from .hopper.test_walk_gpu import SMOKE

    smoke_both_widths(SMOKE, "the Gluon walk")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B, T_or_lengths, H", [(8, 300, 16), (1, [0, 1, 63, 64, 65, 700, 1500, 333, 2100, 20, 900,
                                                                   64, 128, 5, 1000, 77], 4)])
def test_backward_on_forward_states(triton_backend, poison, monkeypatch, request, dtype, B, T_or_lengths, H):
    # chunk_delta_rule's save_states: the forward's Hopper walk keeps W and each chunk's S^T and V'^T (the plan's
    # keep_states), and the backward runs on them without a recompute walk (seen to run once on 4 saved tensors). Against the fp64 oracle,
    # and within half the bound of the recomputing backward (the Gluon walk's states and the Triton recompute's
    # differ by the order of fp32 sums); 8 x 16 heads at T = 300 (a partial chunk; one program a head, block_v
    # 128) and 16 sequences with empty and one-token ones x 4 heads (block_v 64)
    varlen = isinstance(T_or_lengths, list)
    T, N = (sum(T_or_lengths), len(T_or_lengths)) if varlen else (T_or_lengths, B)
    x = make_inputs(B, T, H, 128, 128, dtype, device="cuda", initial_state=True, N=N, seed=9, requires_grad=True)
    if not hopper_fits(x["k"], x["v"]):
        pytest.skip("the Hopper walk, which saves the states, runs on sm_90 only")
    request.getfixturevalue("gluon_walk_runs")
    cu = random_cu_seqlens(T_or_lengths, "cuda") if varlen else None
    ran = []
    backward = chunk.backward  # the form's backward (autograd calls the package's)
    monkeypatch.setattr(chunk, "backward", lambda *a, **kw: (len(a[6]) == 4 and ran.append(1)) or backward(*a, **kw))
    grads = {}
    for keep in (False, True):
        grads[keep], _ = check(x, 128 ** -0.5, 64, cu, save_states=keep)
    assert ran == [1]
    for n, got in grads[True].items():
        err = rel_rms(got, grads[False][n])
        assert err <= BOUNDS[dtype] / 2, f"d{n}: rel RMS {err:.2e} off the recomputing backward's"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_backward_deterministic(triton_backend, dtype):
    """Two runs give bitwise-identical gradients (no atomics whose order varies)."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 3000, (12,), generator=g).tolist() + [0, 1]
    cu = random_cu_seqlens(lengths, "cuda")
    x = make_inputs(1, sum(lengths), 16, 128, 128, dtype, device="cuda", initial_state=True, N=len(lengths),
                    seed=1, requires_grad=True)
    do = torch.randn(x["v"].shape, device="cuda", dtype=dtype)
    dht = torch.randn(x["initial_state"].shape, device="cuda")
    runs = [run(deltatron.chunk_delta_rule, x, None, do, dht, cu, cu_seqlens_cpu=cu.cpu(),
                use_qk_l2norm_in_kernel=True)[2] for _ in range(2)]
    for n in NAMES:
        assert torch.equal(runs[0][n], runs[1][n]), n


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B, T_or_lengths, H, D", [
    (8, 512, 16, 128),  # the fused pass on 8 warps: 128 programs of 128 columns in one wave (16-bit), else 256
    (1, 4096, 4, 128),  # few heads: 16-column V-blocks, A^T recomputed by 8 programs per head
    (1, [0, 1, 63, 64, 65, 700, 1500, 333, 0, 2047], 8, 256),  # varlen, K = 256 (fp32: 16-column V-blocks)
])
def test_fused_dv_local_matches_unfused(poison, dtype, B, T_or_lengths, H, D):
    # the backward's Triton reverse state pass computing dV'_local itself against grads.dv_local + the
    # unfused pass, on the real W of the inputs: they round A^T alike, the fused pass keeps dV'_local in
    # fp32 (the unfused store rounds it), so they differ by about one rounding of the dtype (the Hopper
    # reverse pass, the plan's at 8 x 16 heads on sm_90, is checked in hopper/test_reverse_gpu.py)
    varlen = isinstance(T_or_lengths, list)
    T = sum(T_or_lengths) if varlen else T_or_lengths
    N = len(T_or_lengths) if varlen else B
    x = make_inputs(B, T, H, D, D, dtype, device="cuda", seed=D + H)
    cu = random_cu_seqlens(T_or_lengths, "cuda") if varlen else None
    info = seq_info(B, T, torch.device("cuda"), cu, None if cu is None else cu.cpu())
    q, k, v, beta = (x[n] for n in ("q", "k", "v", "beta"))
    _, w, _ = wy.wy_fwd(k, v, beta, info, 64)
    g = torch.Generator(device="cuda").manual_seed(3)
    do = torch.randn(v.shape, generator=g, device="cuda").to(dtype)
    dht = torch.randn(N, H, D, D, generator=g, device="cuda")
    scale = D ** -0.5
    dv_loc = grads.dv_local(q, k, do, scale, info, 64)
    unfused = reverse.state_bwd(q, k, w, do, dv_loc, dht, scale, True, info, 64)
    fused = reverse.state_bwd(q, k, w, do, None, dht, scale, True, info, 64)
    close = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    for name, got, want in zip(("dh", "dv", "dh0"), fused, unfused):
        err = rel_rms(got, want)
        assert err < close, f"{name}: rel RMS {err:.2e}"


@pytest.mark.parametrize("dtype, T_or_lengths, D", [
    (torch.bfloat16, 1000, 128),  # two 64-column V-blocks per head, a partial last chunk
    (torch.bfloat16, 1000, 256),
    (torch.float32, 1000, 64),
    (torch.bfloat16, [0, 1, 63, 64, 65, 700, 0, 333], 128),  # varlen with empty sequences
    (torch.float16, [0, 1, 63, 64, 65, 700, 0, 333], 100),  # non-power-of-two head, masked columns
])
def test_state_wy_fwd_matches_composition(poison, dtype, T_or_lengths, D):
    # the walk computing W, U on chip from the stored Tinv (the backward's recompute where the plan's is "on_chip")
    # against wy.recompute_w_u + walk.state_fwd. Both go through wy.wy_product, the same products in the
    # same order (over the chunk's tokens; the walk's W product is one [C, K] tile where recompute_w_u's is
    # 64 columns at a time, which does not change a column's sum), so the same bits are expected
    varlen = isinstance(T_or_lengths, list)
    B, H = (1, 4) if varlen else (2, 4)
    T = sum(T_or_lengths) if varlen else T_or_lengths
    N = len(T_or_lengths) if varlen else B
    x = make_inputs(B, T, H, D, D, dtype, device="cuda", seed=D + T)
    cu = random_cu_seqlens(T_or_lengths, "cuda") if varlen else None
    info = seq_info(B, T, torch.device("cuda"), cu, None if cu is None else cu.cpu())
    k, v, beta = x["k"], x["v"], x["beta"]
    h0 = torch.randn(N, H, D, D, device="cuda")
    tinv, _, _ = wy.wy_fwd(k, v, beta, info, 64)
    w, u = wy.recompute_w_u(k, v, beta, tinv, info, 64)
    want = (w, *walk.state_fwd(k, w, u, h0, True, info, 64))
    got = walk.state_wy_fwd(k, v, beta, tinv, h0, True, info, 64)
    for name, a, b in zip(("w", "h", "v_new", "final_state"), got, want):
        assert torch.equal(a, b), f"{name}: not bitwise equal, rel RMS {rel_rms(a, b):.2e}"


@pytest.mark.parametrize("T, lengths", [(1000, None), (None, (0, 1, 63, 65, 700, 0, 1171))])
def test_grouped_value_heads(triton_backend, poison, T, lengths):
    """The ungated rule with 8 value heads over q's and k's 2 at the Hopper paths' shapes (16 sequences x value heads
    and up, K = V = 128, bf16: the walk in the residual form), forward and backward, against the chunkwise reference
    on q and k repeated for each value head (their gradients summed over each group by autograd)."""
    Hk, Hv, D, dtype = 2, 8, 128, torch.bfloat16
    B, T = (2, T) if lengths is None else (1, sum(lengths))
    N = B if lengths is None else len(lengths)
    x = make_inputs(B, T, Hv, D, D, dtype, device="cuda", initial_state=True, N=N, seed=21)
    g = torch.Generator().manual_seed(22)
    x["q"] = torch.randn(B, T, Hk, D, generator=g).to("cuda", dtype)
    x["k"] = torch.nn.functional.normalize(torch.randn(B, T, Hk, D, generator=g), dim=-1).to("cuda", dtype)
    x = {n: t.detach().requires_grad_() for n, t in x.items()}
    cu = None if lengths is None else random_cu_seqlens(list(lengths), "cuda")
    if hopper_fits(x["k"], x["v"]):
        p = plan.plan_for_shape(B, T, Hv, D, D, dtype, key_heads=Hk, lengths=lengths)
        assert p.walk == "hopper" and p.residual
    gen = torch.Generator(device="cuda").manual_seed(23)
    do = torch.randn(x["v"].shape, generator=gen, device="cuda").double()
    dht = torch.randn(N, Hv, D, D, generator=gen, device="cuda").double()
    ref_x = {n: t.detach().double().requires_grad_() for n, t in x.items()}
    o_ref, final_ref = chunk_delta_rule_reference(
        ref_x["q"].repeat_interleave(Hv // Hk, 2), ref_x["k"].repeat_interleave(Hv // Hk, 2), ref_x["v"],
        ref_x["beta"], D ** -0.5, ref_x["initial_state"], True, cu_seqlens=cu, chunk_size=64)[:2]
    grads_ref = dict(zip(NAMES, torch.autograd.grad((o_ref * do).sum() + (final_ref * dht).sum(),
                                                    [ref_x[n] for n in NAMES])))
    o, final, grads = run(deltatron.chunk_delta_rule, x, D ** -0.5, do, dht, cu,
                          cu_seqlens_cpu=None if cu is None else cu.cpu())
    errors = {"o": rel_rms(o, o_ref), "final_state": rel_rms(final, final_ref),
              **{f"d{n}": rel_rms(grads[n], grads_ref[n]) for n in NAMES}}
    print("grouped, rel RMS against the reference: " + ", ".join(f"{n} {e:.2e}" for n, e in errors.items()))
    assert all(e <= BOUNDS[dtype] for e in errors.values()), errors


def test_long_sequence_bf16(triton_backend):
    """65536 tokens in bf16: output and gradients within the bf16 bound of an fp32 reference (rel_rms
    fails on any non-finite value)."""
    x = make_inputs(1, 65536, 4, 128, 128, torch.bfloat16, device="cuda", initial_state=True, seed=2,
                    requires_grad=True)
    check(x, 128 ** -0.5, 64, ref_dtype=torch.float32, outputs=True)
