"""The warp-specialized Gluon walk (kernels/chunk/gluon_walk.py, a feasibility study not wired into the
forward) against the shipped fused walk (state.state_output_fwd) on the same W, U: sm_90 only, 16-bit,
K = V = 128, C = 64. Both round S and V' to the input dtype at the same points, so they differ by the order
of fp32 sums, and through it by a rounding of the dtype here and there."""
import pytest
import torch

from deltatron.kernels.chunk import state, wy
from deltatron.kernels.utils import seq_info

from ..helpers import BOUNDS, make_inputs, random_cu_seqlens, rel_rms

pytestmark = pytest.mark.gpu

D, C = 128, 64


@pytest.fixture
def gluon_walk():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon walk is written for sm_90 (wgmma, TMA, setmaxnreg)")
    pytest.importorskip("triton.experimental.gluon")
    from deltatron.kernels.chunk import gluon_walk

    return gluon_walk


def packed(x, B, T, H):
    return {n: (t.reshape(1, B * T, *t.shape[2:]) if n != "initial_state" else t) for n, t in x.items()}


def check(gluon_walk, x, info, states: bool):
    _, w, u = wy.wy_fwd(x["k"], x["v"], x["beta"], info, C)
    h0 = x["initial_state"] if states else None
    o_ref, s_ref = state.state_output_fwd(x["q"], x["k"], w, u, D ** -0.5, h0, states, info, C)
    o, s = gluon_walk.gluon_state_output_fwd(x["q"], x["k"], w, u, D ** -0.5, h0, states, info)
    bound = BOUNDS[x["q"].dtype]
    assert torch.isfinite(o).all()
    assert rel_rms(o, o_ref) < bound
    if states:
        assert torch.isfinite(s).all()
        assert rel_rms(s, s_ref) < bound
    else:
        assert s is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B, T, H", [(8, 2048, 16), (2, 1000, 4), (3, 64, 2), (1, 1, 3)])
@pytest.mark.parametrize("states", [False, True])
def test_gluon_walk_matches_shipped_walk(poison, gluon_walk, dtype, B, T, H, states):
    # T = 1000: a partial last chunk whose TMA tiles read the next sequence's rows (which must not reach
    # the state); T = 1: every chunk partial; T = 64: exactly one chunk
    x = packed(make_inputs(B, T, H, D, D, dtype, device="cuda", initial_state=True, seed=T + H), B, T, H)
    check(gluon_walk, x, seq_info(B, T, torch.device("cuda"), None, None), states)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gluon_walk_varlen(poison, gluon_walk, dtype):
    g = torch.Generator().manual_seed(7)
    lengths = [0, 1, C - 1, C, C + 1] + torch.randint(1, 1500, (11,), generator=g).tolist()
    lengths = [lengths[i] for i in torch.randperm(len(lengths), generator=g).tolist()]
    TT, H = sum(lengths), 8
    x = make_inputs(1, TT, H, D, D, dtype, device="cuda", initial_state=True, N=len(lengths), seed=3)
    cu = random_cu_seqlens(lengths, "cuda")
    check(gluon_walk, x, seq_info(1, TT, torch.device("cuda"), cu, cu.cpu()), True)


def test_gluon_walk_refuses_other_shapes(gluon_walk):
    x = make_inputs(1, 64, 2, 64, 64, torch.bfloat16, device="cuda")
    info = seq_info(1, 64, torch.device("cuda"), None, None)
    with pytest.raises(ValueError, match="K = V = 128"):
        gluon_walk.gluon_state_output_fwd(x["q"], x["k"], x["k"], x["v"], 0.125, None, False, info)
