"""The warp-specialized Hopper walk (kernels/chunk/hopper/walk.py, the forward's fused walk where the plan's walk is
"hopper") against the portable fused walk (portable/walk.py's state_output_fwd) on the same W, U: sm_90 only, 16-bit,
K = V = 128, C = 64, each check for both V-block widths (block_v 128: one program a sequence and head; 64:
two, each walking half of S^T's rows). Both walks round S and V' to the input dtype at the same points, so they
differ by the order of fp32 sums, and through it by a rounding of the dtype here and there. The walk without its
output (gluon_state_final_fwd, the sequence split's pass 1) against the walk with it: the same final states, bit
for bit.

The kernel's partitions wait on each other through mbarriers: a wrong phase hangs the GPU rather than
failing a test, and would take the whole GPU suite (tests/gpu/run_suite.py) with it. So the first use of
the fixture runs one small call of each V-block width (with and without the output), each in a child process
under a time limit
(gluon_smoke); if one hangs or crashes, its child is killed and every test of that width (and those of
none) fails with its output, without a launch in this process."""
import pytest
import torch

from deltatron.kernels.chunk.portable import walk as portable_walk
from deltatron.kernels.chunk.portable import wy
from deltatron.kernels.chunk.portable.gate import chunk_gamma
from deltatron.kernels.utils import seq_info

from ....helpers import (BOUNDS, gluon_smoke, make_gated_inputs, make_inputs, random_cu_seqlens, rel_rms,
                         require_smoke_passed, transposed_states)

pytestmark = pytest.mark.gpu

D, C = 128, 64
BLOCK_V = [128, 64]  # hopper.walk.WALK_CONFIGS' V-block widths, each forced
SMOKE = """
import sys
import torch
from deltatron.kernels.chunk.hopper import walk as gluon_walk
from deltatron.kernels.chunk.portable import wy
from deltatron.kernels.chunk.portable.gate import chunk_gamma
from deltatron.kernels.utils import seq_info
from tests.helpers import make_inputs
B, T, H, block_v = 2, 200, 2, int(sys.argv[1])
x = make_inputs(B, T, H, 128, 128, torch.bfloat16, device="cuda", initial_state=True, seed=0)
info = seq_info(B, T, torch.device("cuda"), None, None)
_, w, u = wy.wy_fwd(x["k"], x["v"], x["beta"], info, 64)
o, s = gluon_walk.gluon_state_output_fwd(x["q"], x["k"], w, u, 128 ** -0.5, x["initial_state"], True, info,
                                         block_v=block_v)
s_only = gluon_walk.gluon_state_final_fwd(x["k"], w, u, x["initial_state"], info, block_v=block_v)
saved = gluon_walk.states_buffers(x["k"], x["v"], info, 64)
o_saving, _ = gluon_walk.gluon_state_output_fwd(x["q"], x["k"], w, u, 128 ** -0.5, x["initial_state"], True, info,
                                                block_v=block_v, states=saved)
_, tb = wy.tinv_pair_fwd(x["k"], x["beta"], info, 64, store_tinv=False)
o_residual, s_residual = gluon_walk.gluon_state_output_fwd(x["q"], x["k"], tb, x["v"], 128 ** -0.5,
                                                           x["initial_state"], True, info, block_v=block_v,
                                                           residual=True)
gam = chunk_gamma(-torch.rand(B, T, 2, device="cuda"), info, 64)
k1 = x["k"][:, :, :1].contiguous()
_, w_g, u_g = wy.wy_fwd(k1, x["v"], x["beta"], info, 64, gam=gam)
o_gated, s_gated = gluon_walk.gluon_state_output_fwd(x["q"][:, :, :1].contiguous(), k1, w_g, u_g, 128 ** -0.5,
                                                     x["initial_state"], True, info, block_v=block_v, gam=gam)
_, tb_g = wy.tinv_pair_fwd(k1, x["beta"], info, 64, store_tinv=False, gam=gam)
o_gres, s_gres = gluon_walk.gluon_state_output_fwd(x["q"][:, :, :1].contiguous(), k1, tb_g, x["v"], 128 ** -0.5,
                                                   x["initial_state"], True, info, block_v=block_v, residual=True,
                                                   gam=gam)
torch.cuda.synchronize()
print(f"gluon walk smoke calls (block_v {block_v}, with and without the output, saving the states, the residual "
      "form, gated with grouped heads, in both forms) done, finite:",
      bool(torch.isfinite(o).all() and torch.isfinite(s).all() and torch.isfinite(s_only).all()
           and torch.isfinite(o_saving).all() and all(torch.isfinite(t).all() for t in saved)
           and torch.isfinite(o_residual).all() and torch.isfinite(s_residual).all()
           and torch.isfinite(o_gated).all() and torch.isfinite(s_gated).all()
           and torch.isfinite(o_gres).all() and torch.isfinite(s_gres).all()))
"""


@pytest.fixture(scope="module")
def smoke_failures():
    """{block_v: why its smoke call failed, or None}."""
    return {block_v: gluon_smoke(SMOKE, str(block_v)) for block_v in BLOCK_V}


@pytest.fixture
def gluon_walk(smoke_failures, request):
    require_smoke_passed(smoke_failures, request, BLOCK_V, "the Gluon walk")
    from deltatron.kernels.chunk.hopper import walk

    return walk


def packed(x, B, T, H):
    return {n: (t.reshape(1, B * T, *t.shape[2:]) if n != "initial_state" else t) for n, t in x.items()}


def check(gluon_walk, x, info, states: bool, block_v: int = 128, residual: bool = False):
    """The Gluon walk on wy_fwd's W, U against the shipped Triton walk on them: the same roundings, fp32 sums in
    another order, so within the dtype's bound. residual: the Gluon walk in its residual form (V' = Tb (V - K S), Tb
    from wy.tinv_pair_fwd), the same V' with the dtype's roundings at other points (W, U there; V - K S here), so
    within the bound too."""
    _, w, u = wy.wy_fwd(x["k"], x["v"], x["beta"], info, C)
    h0 = x["initial_state"] if states else None
    o_ref, s_ref = portable_walk.state_output_fwd(x["q"], x["k"], w, u, D ** -0.5, h0, states, info, C)
    slots, form = ((w, u), {})
    if residual:
        tinv, tb = wy.tinv_pair_fwd(x["k"], x["beta"], info, C, store_tinv=False)
        assert tinv is None
        slots, form = ((tb, x["v"]), dict(residual=True))
    # the kernel has no atomics and no cross-program work: a second run must give the same bits. A race
    # between the partitions (a slot or S / V' tile read before it is written or after it is overwritten)
    # would show there even where it moves the error by less than the bound
    (o, s), (o2, s2) = (gluon_walk.gluon_state_output_fwd(x["q"], x["k"], *slots, D ** -0.5, h0, states, info,
                                                          block_v=block_v, **form) for _ in range(2))
    bound = BOUNDS[x["q"].dtype]
    assert torch.isfinite(o).all()
    err_o = rel_rms(o, o_ref)
    err_s = rel_rms(s, s_ref) if states else None
    print(f"gluon walk{', residual form' if residual else ''} (block_v {block_v}) against the shipped walk: "
          f"o {err_o:.2e}, final state {err_s}")
    assert err_o < bound
    assert torch.equal(o2, o)
    if states:
        assert torch.isfinite(s).all() and err_s < bound and torch.equal(s2, s)
    else:
        assert s is None


@pytest.mark.parametrize("block_v", BLOCK_V)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B, T, H", [(8, 2048, 16), (2, 1000, 4), (3, 64, 2), (1, 1, 3)])
@pytest.mark.parametrize("states", [False, True])
def test_gluon_walk_matches_shipped_walk(poison, gluon_walk, dtype, B, T, H, states, block_v):
    # T = 1000: a partial last chunk whose TMA tiles read the next sequence's rows (which must not reach
    # the state); T = 1: every chunk partial; T = 64: exactly one chunk
    x = packed(make_inputs(B, T, H, D, D, dtype, device="cuda", initial_state=True, seed=T + H), B, T, H)
    check(gluon_walk, x, seq_info(B, T, torch.device("cuda"), None, None), states, block_v)


@pytest.mark.parametrize("block_v", BLOCK_V)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gluon_walk_varlen(poison, gluon_walk, dtype, block_v):
    g = torch.Generator().manual_seed(7)
    lengths = [0, 1, C - 1, C, C + 1] + torch.randint(1, 1500, (11,), generator=g).tolist()
    lengths = [lengths[i] for i in torch.randperm(len(lengths), generator=g).tolist()]
    TT, H = sum(lengths), 8
    x = make_inputs(1, TT, H, D, D, dtype, device="cuda", initial_state=True, N=len(lengths), seed=3)
    cu = random_cu_seqlens(lengths, "cuda")
    check(gluon_walk, x, seq_info(1, TT, torch.device("cuda"), cu, cu.cpu()), True, block_v)


@pytest.mark.parametrize("block_v", BLOCK_V)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B, T, H", [(8, 2048, 16), (2, 1000, 4), (1, 1, 3)])
def test_gluon_walk_residual_form(poison, gluon_walk, dtype, B, T, H, block_v):
    # T = 1000: a partial last chunk, whose Tb rows past the end are the next sequence's and whose Y columns past the
    # end meet Tb's zero columns; T = 1: every chunk partial
    x = packed(make_inputs(B, T, H, D, D, dtype, device="cuda", initial_state=True, seed=T + H + 1), B, T, H)
    info = seq_info(B, T, torch.device("cuda"), None, None)
    check(gluon_walk, x, info, True, block_v, residual=True)
    check(gluon_walk, x, info, False, block_v, residual=True)


@pytest.mark.parametrize("block_v", BLOCK_V)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gluon_walk_residual_form_varlen(poison, gluon_walk, dtype, block_v):
    lengths = [0, 1, C - 1, C, C + 1, 700, 0, 130]
    TT, H = sum(lengths), 4
    x = make_inputs(1, TT, H, D, D, dtype, device="cuda", initial_state=True, N=len(lengths), seed=5)
    cu = random_cu_seqlens(lengths, "cuda")
    check(gluon_walk, x, seq_info(1, TT, torch.device("cuda"), cu, cu.cpu()), True, block_v, residual=True)


@pytest.mark.parametrize("block_v", BLOCK_V)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gluon_walk_saves_the_states(poison, gluon_walk, dtype, block_v):
    # states (chunk_delta_rule's save_states): each chunk's S^T and V'^T as state_fwd's h and v_new on the same W, U
    # (within the o check's bound: the same roundings, fp32 sums in another order), laid out [NT, H, V, K] and
    # [NT, H, V, C] in the chunks' global order, V'^T zero past each sequence's end (dqkw reads whole tiles); o and
    # the final state bit for bit those of the walk that saves nothing
    lengths = [130, 0, 1, 64, 300, 63]
    TT, H = sum(lengths), 3
    x = make_inputs(1, TT, H, D, D, dtype, device="cuda", initial_state=True, N=len(lengths), seed=31)
    cu = random_cu_seqlens(lengths, "cuda")
    info = seq_info(1, TT, torch.device("cuda"), cu, cu.cpu())
    _, w, u = wy.wy_fwd(x["k"], x["v"], x["beta"], info, C)
    h0 = x["initial_state"]
    h, v_new, _ = portable_walk.state_fwd(x["k"], w, u, h0, False, info, C)
    saved = gluon_walk.states_buffers(x["k"], x["v"], info, C)
    o, s = gluon_walk.gluon_state_output_fwd(x["q"], x["k"], w, u, D ** -0.5, h0, True, info, block_v=block_v,
                                             states=saved)
    o_plain, s_plain = gluon_walk.gluon_state_output_fwd(x["q"], x["k"], w, u, D ** -0.5, h0, True, info,
                                                         block_v=block_v)
    assert torch.equal(o, o_plain) and torch.equal(s, s_plain)
    st, vt = saved
    want_st, want_vt = transposed_states(h, v_new, lengths, C)
    past_end = transposed_states(h, torch.ones_like(v_new), lengths, C)[1] == 0  # columns of tokens past the end
    assert st.shape == want_st.shape and vt.shape == want_vt.shape
    assert torch.isfinite(st).all() and torch.isfinite(vt).all()
    bound = BOUNDS[dtype]
    assert rel_rms(st, want_st) <= bound, f"S^T: rel RMS {rel_rms(st, want_st):.2e}"
    assert rel_rms(vt, want_vt) <= bound, f"V'^T: rel RMS {rel_rms(vt, want_vt):.2e}"
    assert past_end.any() and not vt[past_end].any()


@pytest.mark.parametrize("block_v", BLOCK_V)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gates, Hk, lengths, residual", [
    ("soft", 2, None, False), ("strong", 4, None, False), ("soft", 1, (1500, 0, 1), False),
    ("strong", 2, (0, 1, C - 1, C, C + 1, 700, 0, 1333), False), (None, 2, None, False),
    (None, 1, (0, 1, C + 1, 700), True), ("soft", 2, None, True), ("strong", 1, (0, 1, C - 1, C, C + 1, 700, 0), True),
])
def test_gluon_walk_gated_grouped(poison, gluon_walk, dtype, gates, Hk, lengths, residual, block_v):
    """The gate (USE_G) with grouped value heads (Hv = 4 reading Hk key heads) against the portable fused walk on the
    same W, U and γ: soft and strong gates (down to -20 a token: γ reaches about -640 in a chunk), partial chunks,
    empty sequences; grouped heads without the gate; on W, U, and in the residual form (Tb and V in W's and U's slots,
    V' = Tb (V - diag(exp(γ)) K S)); two runs the same bits."""
    B, T = (3, 1000) if lengths is None else (1, sum(lengths))
    N = B if lengths is None else len(lengths)
    gated = gates is not None
    x = {n: t.cuda() for n, t in make_gated_inputs(B, T, Hk, 4, D, D, dtype, N=N, gates=gates or "soft",
                                                   seed=Hk).items()}
    if lengths is not None:
        cu = random_cu_seqlens(list(lengths), "cuda")
        info = seq_info(1, T, torch.device("cuda"), cu, cu.cpu())
    else:
        info = seq_info(B, T, torch.device("cuda"), None, None)
        x = packed(x, B, T, 4)
    gam = chunk_gamma(x["g"], info, C) if gated else None
    _, w, u = wy.wy_fwd(x["k"], x["v"], x["beta"], info, C, gam=gam)
    h0 = x["initial_state"]
    o_ref, s_ref = portable_walk.state_output_fwd(x["q"], x["k"], w, u, D ** -0.5, h0, True, info, C, gam=gam)
    slots, form = (w, u), dict(gam=gam)
    if residual:
        tb = wy.tinv_pair_fwd(x["k"], x["beta"], info, C, store_tinv=False, gam=gam)[1]
        slots, form = (tb, x["v"]), dict(residual=True, gam=gam)
    (o, s), (o2, s2) = (gluon_walk.gluon_state_output_fwd(x["q"], x["k"], *slots, D ** -0.5, h0, True, info,
                                                          block_v=block_v, **form) for _ in range(2))
    err_o, err_s = rel_rms(o, o_ref), rel_rms(s, s_ref)
    print(f"gated gluon walk, {gates} gates, Hk {Hk}, {'residual' if residual else 'W, U'} (block_v {block_v}): "
          f"o {err_o:.2e}, final state {err_s:.2e}")
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert err_o < BOUNDS[dtype] and err_s < BOUNDS[dtype]
    assert torch.equal(o2, o) and torch.equal(s2, s)


def test_gluon_walk_refuses_other_shapes(gluon_walk):
    x = make_inputs(1, 64, 2, 64, 64, torch.bfloat16, device="cuda")
    info = seq_info(1, 64, torch.device("cuda"), None, None)
    with pytest.raises(ValueError, match="K = V = 128"):
        gluon_walk.gluon_state_output_fwd(x["q"], x["k"], x["k"], x["v"], 0.125, None, False, info)


@pytest.mark.parametrize("block_v", BLOCK_V)
def test_gluon_walk_unpacked_batch(poison, gluon_walk, block_v):
    # [B, T, H, 128] without packing (B > 1): the descriptors span all B * T rows, the same bits as packed
    B, T, H = 3, 200, 2
    x = make_inputs(B, T, H, D, D, torch.bfloat16, device="cuda", initial_state=True, seed=5)
    info = seq_info(B, T, torch.device("cuda"), None, None)
    _, w, u = wy.wy_fwd(x["k"], x["v"], x["beta"], info, C)
    o, s = gluon_walk.gluon_state_output_fwd(x["q"], x["k"], w, u, D ** -0.5, x["initial_state"], True, info,
                                             block_v=block_v)
    flat = [t.reshape(1, B * T, H, D) for t in (x["q"], x["k"], w, u)]
    o_p, s_p = gluon_walk.gluon_state_output_fwd(*flat, D ** -0.5, x["initial_state"], True, info, block_v=block_v)
    assert torch.equal(o.reshape(1, B * T, H, D), o_p) and torch.equal(s, s_p)
    o_ref, s_ref = portable_walk.state_output_fwd(x["q"], x["k"], w, u, D ** -0.5, x["initial_state"], True, info, C)
    assert rel_rms(o, o_ref) < BOUNDS[torch.bfloat16] and rel_rms(s, s_ref) < BOUNDS[torch.bfloat16]


@pytest.mark.parametrize("block_v", BLOCK_V)
@pytest.mark.parametrize("lengths", [[0, 0], []])
def test_gluon_walk_no_tokens(poison, gluon_walk, lengths, block_v):
    # no token at all: nothing launches (a TMA descriptor's shape must be positive); the final state is the
    # initial one (or zeros), o is empty
    H = 2
    x = make_inputs(1, 0, H, D, D, torch.bfloat16, device="cuda", initial_state=True, N=len(lengths), seed=1)
    cu = random_cu_seqlens(lengths, "cuda")
    info = seq_info(1, 0, torch.device("cuda"), cu, cu.cpu())
    o, s = gluon_walk.gluon_state_output_fwd(x["q"], x["k"], x["k"], x["v"], 0.1, x["initial_state"], True, info,
                                             block_v=block_v)
    assert o.shape == x["v"].shape and torch.equal(s, x["initial_state"])
    _, s = gluon_walk.gluon_state_output_fwd(x["q"], x["k"], x["k"], x["v"], 0.1, None, True, info, block_v=block_v)
    assert s.shape == (len(lengths), H, D, D) and not s.any()


def check_final_only(gluon_walk, x, w, u, info, block_v):
    """The walk without its output gives the walk with it's final states bit for bit (from the initial state and
    from zero), and the same bits again on a second run."""
    for h0 in (x["initial_state"], None):
        _, s_ref = gluon_walk.gluon_state_output_fwd(x["q"], x["k"], w, u, D ** -0.5, h0, True, info, block_v=block_v)
        s = gluon_walk.gluon_state_final_fwd(x["k"], w, u, h0, info, block_v=block_v)
        assert torch.isfinite(s).all()
        assert torch.equal(s, s_ref), (block_v, h0 is None, float((s - s_ref).abs().max()))
        assert torch.equal(gluon_walk.gluon_state_final_fwd(x["k"], w, u, h0, info, block_v=block_v), s)


@pytest.mark.parametrize("block_v", BLOCK_V)
def test_gluon_walk_final_only_b1_t32768_h16(poison, gluon_walk, block_v):
    # the shape of the sequence split's pass 1 (b1-t32768-h16, where plan.hopper_block_v gives block_v 64)
    x = make_inputs(1, 32768, 16, D, D, torch.bfloat16, device="cuda", initial_state=True, seed=4)
    info = seq_info(1, 32768, torch.device("cuda"), None, None)
    _, w, u = wy.wy_fwd(x["k"], x["v"], x["beta"], info, C)
    check_final_only(gluon_walk, x, w, u, info, block_v)


@pytest.mark.parametrize("block_v", BLOCK_V)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gluon_walk_final_only_varlen(poison, gluon_walk, dtype, block_v):
    # empty sequences (their state passed through), partial last chunks whose tiles read the next sequence's rows,
    # and pass 1's walk on W (U := W: a K x K "state" from zero)
    g = torch.Generator().manual_seed(8)
    lengths = [0, 1, C - 1, C, C + 1, 9000] + torch.randint(1, 3000, (10,), generator=g).tolist()
    TT, H = sum(lengths), 16
    x = make_inputs(1, TT, H, D, D, dtype, device="cuda", initial_state=True, N=len(lengths), seed=6)
    cu = random_cu_seqlens(lengths, "cuda")
    info = seq_info(1, TT, torch.device("cuda"), cu, cu.cpu())
    _, w, u = wy.wy_fwd(x["k"], x["v"], x["beta"], info, C)
    check_final_only(gluon_walk, x, w, u, info, block_v)
    check_final_only(gluon_walk, x, w, w, info, block_v)
