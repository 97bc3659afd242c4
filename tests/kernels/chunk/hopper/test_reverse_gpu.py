"""The warp-specialized Hopper reverse state pass (kernels/chunk/hopper/reverse.py) against the portable reverse pass
(portable/reverse.py's state_bwd with dv_local=None, the backward's fused pass) on the same q, k, W, dO: sm_90 only, 16-bit,
K = V = 128, C = 64, each check for both V-block widths (block_v 128: one program a sequence and head; 64: two,
each walking half of dS^T's rows). Both passes round dS_next, dV' and A^T to the input dtype at the same points,
so they differ by the order of fp32 sums, and through it by a rounding of the dtype here and there.

The kernel's partitions wait on each other through mbarriers: a wrong phase hangs the GPU rather than
failing a test, and would take the whole GPU suite with it. So the first use of the fixture runs one small
call of each V-block width, each in a child process under a time limit (gluon_smoke); if one hangs or
crashes, its child is killed and every test of that width (and those of none) fails with its output, without
a launch in this process."""
import importlib

import pytest
import torch

from deltatron.kernels import chunk
from deltatron.kernels.chunk import plan
from deltatron.kernels.chunk.portable import reverse as state_bwd
from deltatron.kernels.chunk.portable import wy
from deltatron.kernels.chunk.portable.gate import chunk_gamma
from deltatron.kernels.utils import seq_info

from ....helpers import (BOUNDS, gluon_smoke, make_gated_inputs, make_inputs, random_cu_seqlens, rel_rms,
                         require_smoke_passed)

pytestmark = pytest.mark.gpu

D, C = 128, 64
BLOCK_V = [128, 64]  # hopper.reverse.REVERSE_CONFIGS' V-block widths, each forced
SMOKE = """
import sys
import torch
from deltatron.kernels.chunk.hopper import reverse as gluon_reverse
from deltatron.kernels.utils import seq_info
B, T, H, block_v = 2, 200, 2, int(sys.argv[1])
g = torch.Generator(device="cuda").manual_seed(0)
q, k, w, do = (torch.randn(B, T, H, 128, generator=g, device="cuda").to(torch.bfloat16) for _ in range(4))
dht = torch.randn(B, H, 128, 128, generator=g, device="cuda")
info = seq_info(B, T, torch.device("cuda"), None, None)
dh, dv, dh0 = gluon_reverse.gluon_state_bwd(q, k, w, do, dht, 128 ** -0.5, True, info, block_v=block_v)
gam = -torch.rand(B, T, H, generator=g, device="cuda").cumsum(1)
gated = gluon_reverse.gluon_state_bwd(q[:, :, :1].contiguous(), k[:, :, :1].contiguous(), w, do, dht, 128 ** -0.5,
                                      True, info, block_v=block_v, gam=gam)
torch.cuda.synchronize()
print(f"gluon reverse smoke calls (block_v {block_v}; gated with grouped heads) done, finite:",
      all(bool(torch.isfinite(x).all()) for x in (dh, dv, dh0, *gated)))
"""


@pytest.fixture(scope="module")
def smoke_failures():
    """{block_v: why its smoke call failed, or None}."""
    return {block_v: gluon_smoke(SMOKE, str(block_v)) for block_v in BLOCK_V}


@pytest.fixture
def gluon_reverse(smoke_failures, request):
    require_smoke_passed(smoke_failures, request, BLOCK_V, "the Gluon reverse pass")
    from deltatron.kernels.chunk.hopper import reverse

    return reverse


def reverse_inputs(B, T, H, dtype, device, N=None, seed=0, cu_seqlens=None):
    """q, k, W (from wy.wy_fwd, as the backward has it), dO, dht [N, H, 128, 128] fp32, packed [1, B * T, H, 128];
    and the batch's SeqInfo."""
    x = make_inputs(B, T, H, D, D, dtype, device=device, initial_state=True, N=N, seed=seed)
    q, k, v = (x[n].reshape(1, B * T, H, D) for n in ("q", "k", "v"))
    do = torch.randn(v.shape, generator=torch.Generator().manual_seed(seed + 1)).to(device=device, dtype=dtype)
    beta = x["beta"].reshape(1, B * T, H)
    info = (seq_info(B, T, torch.device(device), None, None) if cu_seqlens is None
            else seq_info(1, B * T, torch.device(device), cu_seqlens, cu_seqlens.cpu()))
    _, w, _ = wy.wy_fwd(k, v, beta, info, C)
    return (q, k, w, do, x["initial_state"]), info


def close(x, ref, bound):
    if not ref.any():  # dh of a single chunk without dht: zeros, exactly
        return torch.equal(x, ref)
    return rel_rms(x, ref) < bound


def check(gluon_reverse, inputs, info, with_dht: bool, need_dh0: bool, block_v: int = 128):
    q, k, w, do, dht = inputs
    dht = dht if with_dht else None
    ref = state_bwd.state_bwd(q, k, w, do, None, dht, D ** -0.5, need_dh0, info, C)
    got = gluon_reverse.gluon_state_bwd(q, k, w, do, dht, D ** -0.5, need_dh0, info, block_v=block_v)
    bound = BOUNDS[q.dtype]
    for name, x, r in zip(("dh", "dv", "dh0"), got, ref):
        if r is None:
            assert x is None, name
            continue
        assert x.shape == r.shape and x.dtype == r.dtype, name
        assert torch.isfinite(x).all(), name
        assert close(x, r, bound), f"{name}: rel RMS {rel_rms(x, r) if r.any() else 'not zero'} above {bound}"
    # no atomics, no cross-program work: a second run must give the same bits. A race between the partitions
    # (a ring slot or a hand-off tile read before it is written or after it is overwritten) would show here
    # even where it moves the error by less than the bound
    again = gluon_reverse.gluon_state_bwd(q, k, w, do, dht, D ** -0.5, need_dh0, info, block_v=block_v)
    for x, y in zip(got, again):
        assert (x is None and y is None) or torch.equal(x, y)


@pytest.mark.parametrize("block_v", BLOCK_V)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B, T, H", [(8, 2048, 16), (2, 1000, 4), (3, 64, 2), (1, 1, 3)])
@pytest.mark.parametrize("with_dht, need_dh0", [(False, False), (True, True), (True, False), (False, True)])
def test_gluon_reverse_matches_triton_pass(poison, gluon_reverse, dtype, B, T, H, with_dht, need_dh0, block_v):
    # T = 1000: a partial last chunk whose TMA tiles read the next sequence's rows (which must not reach dS,
    # dh or dv); T = 1: every chunk partial; T = 64: exactly one chunk
    inputs, info = reverse_inputs(B, T, H, dtype, "cuda", seed=T + H)
    check(gluon_reverse, inputs, info, with_dht, need_dh0, block_v)


@pytest.mark.parametrize("block_v", BLOCK_V)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_dht", [False, True])
def test_gluon_reverse_varlen(poison, gluon_reverse, dtype, with_dht, block_v):
    g = torch.Generator().manual_seed(7)
    lengths = [0, 1, C - 1, C, C + 1] + torch.randint(1, 1500, (11,), generator=g).tolist()
    lengths = [lengths[i] for i in torch.randperm(len(lengths), generator=g).tolist()]
    cu = random_cu_seqlens(lengths, "cuda")
    inputs, info = reverse_inputs(1, sum(lengths), 8, dtype, "cuda", N=len(lengths), seed=3, cu_seqlens=cu)
    check(gluon_reverse, inputs, info, with_dht, True, block_v)


@pytest.mark.parametrize("block_v", BLOCK_V)
def test_gluon_reverse_unpacked_batch(poison, gluon_reverse, block_v):
    # [B, T, H, 128] without packing (B > 1): the descriptors span all B * T rows, the same bits as packed
    B, T, H = 3, 200, 2
    (q, k, w, do, dht), info = reverse_inputs(B, T, H, torch.bfloat16, "cuda", seed=5)
    packed = gluon_reverse.gluon_state_bwd(q, k, w, do, dht, D ** -0.5, True, info, block_v=block_v)
    unpacked = gluon_reverse.gluon_state_bwd(*(x.reshape(B, T, H, D) for x in (q, k, w, do)), dht, D ** -0.5, True,
                                             info, block_v=block_v)
    assert unpacked[1].shape == (B, T, H, D)
    assert torch.equal(packed[0], unpacked[0]) and torch.equal(packed[1], unpacked[1].reshape(packed[1].shape))
    assert torch.equal(packed[2], unpacked[2])


def test_backward_runs_hopper_reverse_where_forced(gluon_reverse):
    # 2 x 4 heads: forced (plan.overrides(hopper_reverse=True)), the backward's reverse pass runs the Hopper pass
    # at the plan's V-block (plan.hopper_block_v: 16 programs fit one wave, 64)
    (q, k, w, do, dht), info = reverse_inputs(2, 300, 4, torch.bfloat16, "cuda", seed=11)
    direct = gluon_reverse.gluon_state_bwd(q, k, w, do, dht, D ** -0.5, True, info, block_v=64)
    with plan.overrides(hopper_reverse=True):
        call_plan = chunk.plan_call(q, k, do, info, True, C)
    assert call_plan.reverse == "hopper" and call_plan.reverse_launch.block_v == 64
    backward = importlib.import_module("deltatron.kernels.chunk.backward")
    dispatched = backward.reverse_pass(call_plan, q, k, w, do, dht, D ** -0.5, True, info)
    assert all(torch.equal(x, y) for x, y in zip(direct, dispatched))


@pytest.mark.parametrize("block_v", BLOCK_V)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gates, Hk, lengths", [("soft", 2, None), ("strong", 4, None), ("soft", 1, (1500, 0, 1)),
                                                ("strong", 2, (0, 1, C - 1, C, C + 1, 700, 0, 1333))])
def test_gluon_reverse_gated_grouped(poison, gluon_reverse, dtype, gates, Hk, lengths, block_v):
    """The gate (USE_G) with grouped value heads (Hv = 4 reading Hk key heads) against the portable pass on the same
    q, k, W, dO and γ: soft and strong gates (down to -20 a token), partial chunks, empty sequences, with dht and
    dh0; a second run the same bits."""
    B, T = (3, 1000) if lengths is None else (1, sum(lengths))
    N = B if lengths is None else len(lengths)
    x = {n: t.cuda() for n, t in make_gated_inputs(B, T, Hk, 4, D, D, dtype, N=N, gates=gates, seed=Hk).items()}
    q, k, v, beta, g = (x[n].reshape(1, B * T, *x[n].shape[2:]) for n in ("q", "k", "v", "beta", "g"))
    if lengths is None:
        info = seq_info(B, T, torch.device("cuda"), None, None)
    else:
        cu = random_cu_seqlens(list(lengths), "cuda")
        info = seq_info(1, T, torch.device("cuda"), cu, cu.cpu())
    gam = chunk_gamma(g, info, C)
    _, w, _ = wy.wy_fwd(k, v, beta, info, C, gam=gam)
    gen = torch.Generator().manual_seed(Hk + 1)
    do = torch.randn(v.shape, generator=gen).to(device="cuda", dtype=dtype)
    dht = torch.randn(N, 4, D, D, generator=gen).cuda()
    ref = state_bwd.state_bwd(q, k, w, do, None, dht, D ** -0.5, True, info, C, gam=gam)
    got, again = (gluon_reverse.gluon_state_bwd(q, k, w, do, dht, D ** -0.5, True, info, block_v=block_v, gam=gam)
                  for _ in range(2))
    for name, x_, r in zip(("dh", "dv", "dh0"), got, ref):
        assert x_.shape == r.shape and x_.dtype == r.dtype and torch.isfinite(x_).all(), name
        print(f"gated gluon reverse, {gates} gates, Hk {Hk} (block_v {block_v}): {name} {rel_rms(x_, r):.2e}")
        assert close(x_, r, BOUNDS[dtype]), f"{name}: rel RMS {rel_rms(x_, r):.2e} above {BOUNDS[dtype]}"
    assert all(torch.equal(a, b) for a, b in zip(got, again))


def test_gluon_reverse_refuses_other_shapes(gluon_reverse):
    x = make_inputs(1, 64, 2, 64, 64, torch.bfloat16, device="cuda")
    info = seq_info(1, 64, torch.device("cuda"), None, None)
    with pytest.raises(ValueError, match="K = V = 128"):
        gluon_reverse.gluon_state_bwd(x["q"], x["k"], x["k"], x["v"], None, 0.125, False, info)


@pytest.mark.parametrize("block_v", BLOCK_V)
@pytest.mark.parametrize("lengths", [[0, 0], []])
def test_gluon_reverse_no_tokens(poison, gluon_reverse, lengths, block_v):
    # no token at all: nothing launches (a TMA descriptor's shape must be positive); dh0 is dht (or zeros)
    H, N = 2, len(lengths)
    x = make_inputs(1, 0, H, D, D, torch.bfloat16, device="cuda", initial_state=True, N=N, seed=1)
    cu = random_cu_seqlens(lengths, "cuda")
    info = seq_info(1, 0, torch.device("cuda"), cu, cu.cpu())
    dh, dv, dh0 = gluon_reverse.gluon_state_bwd(x["q"], x["k"], x["k"], x["v"], x["initial_state"], 0.1, True, info,
                                                block_v=block_v)
    assert dh.shape == (0, H, D, D) and dv.shape == x["v"].shape and torch.equal(dh0, x["initial_state"])
    _, _, dh0 = gluon_reverse.gluon_state_bwd(x["q"], x["k"], x["k"], x["v"], None, 0.1, True, info, block_v=block_v)
    assert dh0.shape == (N, H, D, D) and not dh0.any()
