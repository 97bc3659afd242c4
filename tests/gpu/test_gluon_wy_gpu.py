"""The Gluon WY forward (kernels/chunk/gluon_wy.py, wy.wy_fwd's fused 16-bit case where wy.GLUON_WY is True)
against wy_kernel (wy.wy_fwd with the switch off) and the float64 oracle (reference.chunk.intra_chunk_wy on the
dtype-rounded inputs, per sequence): sm_90 only, bf16 and fp16, C = 64, K = V = 128 and 64. Both kernels compute
Tinv with tf32 products and one Newton step (tf32x3 residual), so Tinv agrees to fp32 level; W and U are rounded
to the input dtype by both, so they differ by about one rounding here and there. Partial last chunks (whose TMA
tiles hold the next sequence's rows), T = 1, packed sequences with empty ones, and nearly parallel keys.

The kernel waits on TMA through mbarriers: a wrong byte count hangs the GPU rather than failing a test, so the
first use of the fixture runs one small call in a child process under a time limit (gluon_smoke), and every
test fails with its output if that hangs or crashes."""
import functools

import pytest
import torch

from deltatron.kernels import chunk
from deltatron.kernels.chunk import wy
from deltatron.kernels.utils import seq_info
from deltatron.reference.chunk import intra_chunk_wy

from ..helpers import BOUNDS, make_inputs, nearly_parallel_keys, random_cu_seqlens, rel_rms
from ..kernels.test_chunk_forward import ONE_ROUNDING, STAGE_BOUNDS, per_sequence_chunks
from . import gluon_smoke, require_smoke_passed

pytestmark = pytest.mark.gpu

C = 64
BLOCKED = [False, True]  # gluon_wy_fwd's blocked_levels: the doubling levels on the whole tile or on pieces
SMOKE = """
import torch
from deltatron.kernels.chunk import gluon_wy
from deltatron.kernels.utils import seq_info
from tests.helpers import make_inputs
B, T, H = 2, 200, 2
for D in gluon_wy.HEAD_SIZES:
  for blocked in (False, True):
    x = make_inputs(B, T, H, D, D, torch.bfloat16, device="cuda", seed=0)
    info = seq_info(B, T, torch.device("cuda"), None, None)
    tinv, w, u = gluon_wy.gluon_wy_fwd(x["k"], x["v"], x["beta"], info, blocked_levels=blocked)
    torch.cuda.synchronize()
    print(f"gluon_wy smoke call (K = V = {D}, blocked_levels {blocked}) done, finite:",
          bool(torch.isfinite(tinv).all() and torch.isfinite(w).all() and torch.isfinite(u).all()))
"""


@pytest.fixture(scope="module")
def smoke_failures():
    return {None: gluon_smoke(SMOKE)}


@pytest.fixture
def gluon_wy(smoke_failures, request):
    require_smoke_passed(smoke_failures, request, [None], "the Gluon WY kernel")
    from deltatron.kernels.chunk import gluon_wy

    return gluon_wy


def packed_inputs(lengths, H, D, dtype, seed):
    x = make_inputs(1, sum(lengths), H, D, D, dtype, device="cuda", N=len(lengths), seed=seed)
    cu = random_cu_seqlens(lengths, "cuda")
    return x["k"], x["v"], x["beta"], seq_info(1, sum(lengths), torch.device("cuda"), cu, cu.cpu())


def check(gluon_wy, k, v, beta, info, lengths, blocked, tinv_bound=1e-5, wu_bound=None):
    """Tinv, W, U against wy_kernel's and the oracle's (lengths: the sequences' tokens, for the oracle), the
    outputs without Tinv the same bits, and a rerun the same bits; blocked: the doubling levels on pieces of their
    nonzero blocks (else on the whole tile)."""
    dtype = k.dtype
    run = functools.partial(gluon_wy.gluon_wy_fwd, k, v, beta, info, C, blocked_levels=blocked)
    tinv, w, u = run()
    tinv_ref, w_ref, u_ref = wy.wy_fwd(k, v, beta, info, C)
    _, T_o, w_o, u_o = per_sequence_chunks(lengths, C, intra_chunk_wy, *(x.cpu().double() for x in (k, v, beta)))
    errs = dict(tinv=rel_rms(tinv, tinv_ref), w=rel_rms(w, w_ref), u=rel_rms(u, u_ref), tinv_oracle=rel_rms(tinv, T_o),
                w_oracle=rel_rms(w, w_o), u_oracle=rel_rms(u, u_o), wy_kernel_tinv_oracle=rel_rms(tinv_ref, T_o))
    print({n: f"{e:.1e}" for n, e in errs.items()})
    assert errs["tinv"] < 2 * tinv_bound and errs["tinv_oracle"] < tinv_bound
    assert max(errs["w"], errs["u"]) < (wu_bound or ONE_ROUNDING[dtype])
    assert max(errs["w_oracle"], errs["u_oracle"]) < (wu_bound or STAGE_BOUNDS[dtype])
    # no atomics, no cross-program work: a second run gives the same bits; without Tinv, W and U are unchanged
    again = run()
    assert all(torch.equal(a, b) for a, b in zip(again, (tinv, w, u)))
    none, w2, u2 = run(store_tinv=False)
    assert none is None and torch.equal(w2, w) and torch.equal(u2, u)


@pytest.mark.parametrize("blocked", BLOCKED)
@pytest.mark.parametrize("D", [128, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B, T, H", [(8, 2048, 16), (2, 1000, 4), (3, 64, 2), (3, 1, 3)])
def test_fixed_length(poison, gluon_wy, dtype, D, B, T, H, blocked):
    # T = 1000: a partial last chunk whose TMA tiles read the next sequence's rows; T = 1: every chunk one token;
    # T = 64: exactly one chunk. As packed [1, B * T] and as [B, T]: the same bits
    k, v, beta, info = packed_inputs([T] * B, H, D, dtype, seed=T + D)
    check(gluon_wy, k, v, beta, info, [T] * B, blocked)
    unpacked = [x.reshape(B, T, *x.shape[2:]) for x in (k, v, beta)]
    unpacked_info = seq_info(B, T, torch.device("cuda"), None, None)
    got = gluon_wy.gluon_wy_fwd(*unpacked, unpacked_info, C, blocked_levels=blocked)
    packed = gluon_wy.gluon_wy_fwd(k, v, beta, info, C, blocked_levels=blocked)
    assert all(torch.equal(a.reshape(b.shape), b) for a, b in zip(got, packed))


@pytest.mark.parametrize("blocked", BLOCKED)
@pytest.mark.parametrize("D", [128, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_varlen_with_empty_sequences(poison, gluon_wy, dtype, D, blocked):
    g = torch.Generator().manual_seed(7)
    lengths = [0, 1, C - 1, C, C + 1, 0] + torch.randint(1, 1500, (11,), generator=g).tolist()
    lengths = [lengths[i] for i in torch.randperm(len(lengths), generator=g).tolist()]
    k, v, beta, info = packed_inputs(lengths, 8, D, dtype, seed=3)
    check(gluon_wy, k, v, beta, info, lengths, blocked)


@pytest.mark.parametrize("blocked", BLOCKED)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_nearly_parallel_keys(poison, gluon_wy, dtype, blocked):
    # beta near 2 and almost equal keys: the inverse's products and W's rows cancel heavily (the Newton step and
    # the hi + lo pair are what keep them within bounds; tests/gpu/test_chunk_forward_gpu.py has wy_kernel's
    # numbers). T within 1e-3 of the oracle, W and U within the dtype's bound
    lengths, H, D = [512, 200, 61], 4, 128
    k, v, beta, info = packed_inputs(lengths, H, D, dtype, seed=11)
    k, beta = nearly_parallel_keys(k.shape, 1.95, dtype, "cuda", seed=11)
    check(gluon_wy, k, v, beta, info, lengths, blocked, tinv_bound=1e-3, wu_bound=BOUNDS[dtype])


def test_refuses_other_shapes(gluon_wy):
    k, v, beta, info = packed_inputs([64], 2, 256, torch.bfloat16, seed=1)
    with pytest.raises(ValueError, match="K = V"):
        gluon_wy.gluon_wy_fwd(k, v, beta, info)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_forward_with_the_switch_on(poison, gluon_wy, monkeypatch, dtype):
    # wy.wy_fwd runs the Gluon kernel with GLUON_WY True (its bits), and the chunk forward on it stays within a
    # rounding of the dtype of the forward on wy_kernel
    lengths = [300, 0, 64, 1000]
    H, D = 4, 128
    x = make_inputs(1, sum(lengths), H, D, D, dtype, device="cuda", initial_state=True, N=len(lengths), seed=5)
    cu = random_cu_seqlens(lengths, "cuda")
    info = seq_info(1, sum(lengths), torch.device("cuda"), cu, cu.cpu())
    args = (x["q"], x["k"], x["v"], x["beta"], D ** -0.5, x["initial_state"], True, info)
    o_ref, s_ref, _, _ = chunk.forward(*args)
    monkeypatch.setattr(wy, "GLUON_WY", True)
    got = wy.wy_fwd(x["k"], x["v"], x["beta"], info, C)
    direct = gluon_wy.gluon_wy_fwd(x["k"], x["v"], x["beta"], info, C)
    assert all(torch.equal(a, b) for a, b in zip(got, direct))
    o, s, _, _ = chunk.forward(*args)
    assert rel_rms(o, o_ref) < BOUNDS[dtype] and rel_rms(s, s_ref) < BOUNDS[dtype]
    # its products are tf32 with the Newton step: another DELTATRON_TRIL_PRECISION keeps wy_kernel
    assert wy.gluon_wy_applies(x["k"], x["v"], x["beta"], C)
    monkeypatch.setenv("DELTATRON_TRIL_PRECISION", "tf32x3")
    assert not wy.gluon_wy_applies(x["k"], x["v"], x["beta"], C)
