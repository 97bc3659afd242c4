"""The Hopper reverse pass's host wrapper (kernels/chunk/hopper/reverse.py) where it launches nothing, so on the
CPU: the batch without tokens (a TMA descriptor cannot be built on zero rows: dh is empty, dh0 is dht, or
zeros), the misuse it refuses, and the launch it makes (the kernel replaced by a recorder): the V-block width
(plan.hopper_block_v's unless given) with its grid, dO's descriptor block and REVERSE_CONFIGS' warps, registers
and ring slots. The kernel itself is checked on the GPU (test_reverse_gpu.py); a PyTorch model of its arithmetic in
test_reverse_model.py."""
import functools

import pytest
import torch

from deltatron.kernels.utils import seq_info

from ....helpers import make_inputs, misaligned, random_cu_seqlens

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
from deltatron.kernels.chunk.hopper import reverse as gluon_reverse  # noqa: E402

D = gluon_reverse.D_WALK
REVERSE_ARGS = gluon_reverse.gluon_reverse_kernel.arg_names  # (the recorder that stands in for the kernel has none)


@pytest.mark.parametrize("block_v", [None, 64, 128])
@pytest.mark.parametrize("lengths", [[0, 0, 0], []])
def test_no_tokens_passes_dht_through(poison, lengths, block_v):
    H, N = 2, len(lengths)
    x = make_inputs(1, 0, H, D, D, torch.bfloat16, initial_state=True, N=N, seed=0)
    cu = random_cu_seqlens(lengths)
    info = seq_info(1, 0, torch.device("cpu"), cu, cu)
    q, k, v, dht = x["q"], x["k"], x["v"], x["initial_state"]
    reverse = functools.partial(gluon_reverse.gluon_state_bwd, block_v=block_v)
    dh, dv, dh0 = reverse(q, k, k, v, dht, 0.1, True, info)
    assert dh.shape == (0, H, D, D) and dh.dtype == q.dtype and dv.shape == v.shape
    assert dh0.dtype == torch.float32 and torch.equal(dh0, dht)
    _, _, dh0 = reverse(q, k, k, v, None, 0.1, True, info)
    assert dh0.shape == (N, H, D, D) and not dh0.any()
    _, _, dh0 = reverse(q, k, k, v, dht, 0.1, False, info)
    assert dh0 is None


class LaunchRecorder:
    """Stands in for gluon_reverse_kernel: kernel[grid](*args, **kwargs) records the launch instead."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, args, kwargs))


@pytest.mark.parametrize("B, H, block_v, expected", [(1, 16, None, 64), (3, 22, None, 64), (3, 23, None, 128),
                                                     (4, 16, None, 64), (8, 16, None, 128), (8, 16, 64, 64),
                                                     (1, 16, 128, 128)])
def test_launches_the_chosen_v_block(monkeypatch, B, H, block_v, expected):
    # plan.hopper_block_v's width on the tensors' device's SMs (here as the H200's 132: 64 while 2 x sequences x heads fit
    # one wave) unless one is given; 128 / block_v programs a head, on that width's config
    kernel = LaunchRecorder()
    monkeypatch.setattr(gluon_reverse, "gluon_reverse_kernel", kernel)
    monkeypatch.setattr(gluon_reverse, "num_sms", lambda device: 132)
    x = make_inputs(B, 3, H, D, D, torch.bfloat16)
    gluon_reverse.gluon_state_bwd(x["q"], x["k"], x["k"], x["v"], None, 0.1, False,
                                  seq_info(B, 3, torch.device("cpu"), None, None), block_v=block_v)
    (grid, args, kwargs), = kernel.launches
    cfg = gluon_reverse.REVERSE_CONFIGS[expected]
    assert grid == (B * H * D // expected, )
    assert [desc.block_shape for desc in args[:4]] == [[64, D], [64, expected], [64, D], [64, D]]  # w, do, k, q
    assert kwargs == {"num_warps": expected // 16} and args[-2:] == (cfg.offchain_regs, cfg.stages)


def test_refuses_misuse():
    x = make_inputs(2, 64, 2, D, D, torch.bfloat16, initial_state=True)
    info = seq_info(2, 64, torch.device("cpu"), None, None)
    q, k, v, dht = x["q"], x["k"], x["v"], x["initial_state"]
    with pytest.raises(ValueError, match="share one 16-bit dtype"):
        gluon_reverse.gluon_state_bwd(q, k, k, v.float(), None, 0.1, False, info)
    with pytest.raises(ValueError, match="share one 16-bit dtype"):
        gluon_reverse.gluon_state_bwd(q.float(), k.float(), k.float(), v.float(), None, 0.1, False, info)
    with pytest.raises(ValueError, match="K = V = 128"):
        gluon_reverse.gluon_state_bwd(q, k, k, v[..., :64], None, 0.1, False, info)
    with pytest.raises(ValueError, match="tokens"):  # rows that are not the batch's B * T
        gluon_reverse.gluon_state_bwd(q[:1], k[:1], k[:1], v[:1], None, 0.1, False, info)
    with pytest.raises(ValueError, match="contiguous"):
        gluon_reverse.gluon_state_bwd(q, k, k, v.transpose(1, 2).contiguous().transpose(1, 2), None, 0.1, False, info)
    with pytest.raises(ValueError, match="dht"):
        gluon_reverse.gluon_state_bwd(q, k, k, v, dht[:1], 0.1, False, info)
    with pytest.raises(ValueError, match="16-byte aligned"):  # TMA: the descriptor's base
        gluon_reverse.gluon_state_bwd(q, k, misaligned(k), v, None, 0.1, False, info)
    with pytest.raises(ValueError, match="chunk_size"):
        gluon_reverse.gluon_state_bwd(q, k, k, v, None, 0.1, False, info, chunk_size=32)
    for block_v in (32, 96, 256):  # wgmma's M is 64 a warp group: no narrower V-block; others do not tile 128
        with pytest.raises(ValueError, match="block_v"):
            gluon_reverse.gluon_state_bwd(q, k, k, v, None, 0.1, False, info, block_v=block_v)


def reshaped_descriptors(pairs, TT, H):
    """The descriptors as the wrappers built them before (TensorDescriptor.from_tensor on a [TT, H * 128] reshape):
    what tma_descriptors' must equal, field by field."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from deltatron.kernels.chunk.hopper.walk import tile_layout
    return [TensorDescriptor.from_tensor(x.reshape(TT, H * D), [64, width], tile_layout(x.dtype, 64, width))
            for x, width in pairs]


def assert_same_descriptors(got, expected):
    for g, e in zip(got, expected, strict=True):
        assert g.base.data_ptr() == e.base.data_ptr() and g.base.dtype == e.base.dtype
        assert list(g.shape) == list(e.shape) and list(g.strides) == list(e.strides)
        assert list(g.block_shape) == list(e.block_shape) and g.layout == e.layout and g.padding == e.padding


@pytest.mark.parametrize("B, T, H, block_v", [(2, 70, 3, 64), (2, 70, 3, 128), (1, 5, 16, None)])
def test_descriptors_and_launch_as_before(monkeypatch, B, T, H, block_v):
    # the descriptors given the [TT, H * 128] view's shape and strides directly are the reshaped tensors' ones;
    # the production path (checked=True: backward.reverse_pass's checks made, not check_inputs again) launches the same
    kernel = LaunchRecorder()
    monkeypatch.setattr(gluon_reverse, "gluon_reverse_kernel", kernel)
    x = make_inputs(B, T, H, D, D, torch.bfloat16, initial_state=True)
    info = seq_info(B, T, torch.device("cpu"), None, None)
    w = torch.randn_like(x["k"])
    for checked in (False, True):
        gluon_reverse.gluon_state_bwd(x["q"], x["k"], w, x["v"], x["initial_state"], 0.1, True, info,
                                      block_v=block_v, checked=checked)
    (grid, args, kwargs), (grid2, args2, kwargs2) = kernel.launches
    width = args[1].block_shape[1]
    assert_same_descriptors(args[:4], reshaped_descriptors(((w, D), (x["v"], width), (x["k"], D), (x["q"], D)),
                                                           B * T, H))
    assert_same_descriptors(args2[:4], args[:4])
    assert grid2 == grid and kwargs2 == kwargs and len(args2) == len(args)
    assert all(a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride() if torch.is_tensor(a) else a == b
               for a, b in zip(args[4:], args2[4:]) if a is not None or b is not None)
    assert args[5].is_contiguous() and args[5].shape == x["v"].shape  # dv, from empty_like(do)


def gated_grouped_inputs(Hk, H, B=2, T=70):
    """(q, k over Hk key heads, two bf16 [B, T, H, D] tensors over the value heads, γ, the batch's SeqInfo): a
    gated, grouped launch's inputs."""
    q, k = (torch.randn(B, T, Hk, D).to(torch.bfloat16) for _ in range(2))
    x, y = (torch.randn(B, T, H, D).to(torch.bfloat16) for _ in range(2))
    return q, k, x, y, -torch.rand(B, T, H), seq_info(B, T, torch.device("cpu"), None, None)


@pytest.mark.parametrize("Hk, H", [(2, 4), (1, 3)])
def test_gated_grouped_launch(monkeypatch, Hk, H):
    # the gate and grouped value heads: q, k's descriptors over their Hk heads, w, dO's over H, γ with USE_G, HK the
    # key heads, dh and dh0 per value head; the same grid as without the gate
    kernel = LaunchRecorder()
    monkeypatch.setattr(gluon_reverse, "gluon_reverse_kernel", kernel)
    B, T = 2, 70
    q, k, w, do, gam, info = gated_grouped_inputs(Hk, H, B, T)
    dh, dv, dh0 = gluon_reverse.gluon_state_bwd(q, k, w, do, None, 0.1, True, info, block_v=64, gam=gam)
    gluon_reverse.gluon_state_bwd(q, k, w, do, None, 0.1, True, info, block_v=64)
    (grid, args, _), (grid2, args2, _) = kernel.launches
    names = dict(zip(REVERSE_ARGS, args))
    assert_same_descriptors(args[:2], reshaped_descriptors(((w, D), (do, 64)), B * T, H))
    assert_same_descriptors(args[2:4], reshaped_descriptors(((k, D), (q, D)), B * T, Hk))
    assert names["gam"] is gam and (names["USE_G"], names["H"], names["HK"]) == (True, H, Hk)
    assert dict(zip(REVERSE_ARGS, args2))["gam"] is None and grid == grid2 == (B * H * 2, )
    assert dh.shape == (info.chunks(64).num_chunks, H, D, D) and dh0.shape == (B, H, D, D) and dv.shape == do.shape
    with pytest.raises(ValueError, match="gam"):
        gluon_reverse.gluon_state_bwd(q, k, w, do, None, 0.1, True, info, gam=gam[..., :1].contiguous())
