"""The Hopper walk's host wrapper (kernels/chunk/hopper/walk.py) where it launches nothing, so on the CPU: the
batch without tokens (a TMA descriptor cannot be built on zero rows: the final state is the initial state,
or zeros), the misuse it refuses, and the V-block width it launches (plan.hopper_block_v's unless given); the walk
without its output (gluon_state_final_fwd) launches the same kernel and grid without Q, o and the output partition,
and forward.walk_final_states runs it where the plan's walk is the Hopper one. The kernel itself is checked on the
GPU (test_walk_gpu.py); a PyTorch model of its arithmetic in test_walk_model.py."""
import functools
import importlib

import pytest
import torch

from deltatron.kernels.chunk import plan
from deltatron.kernels.utils import seq_info

from ....helpers import make_inputs, misaligned, random_cu_seqlens

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
from deltatron.kernels.chunk.hopper import walk as gluon_walk  # noqa: E402

D = gluon_walk.D_WALK
ARG_NAMES = gluon_walk.gluon_walk_kernel.arg_names  # (the recorder that stands in for the kernel has none)


def named(args):
    """A recorded launch's arguments by the kernel's parameter names."""
    return dict(zip(ARG_NAMES, args))


@pytest.mark.parametrize("block_v", [None, 64, 128])
@pytest.mark.parametrize("lengths", [[0, 0, 0], []])
def test_no_tokens_passes_the_state_through(poison, lengths, block_v):
    H, N = 2, len(lengths)
    x = make_inputs(1, 0, H, D, D, torch.bfloat16, initial_state=True, N=N, seed=0)
    cu = random_cu_seqlens(lengths)
    info = seq_info(1, 0, torch.device("cpu"), cu, cu)
    walk = functools.partial(gluon_walk.gluon_state_output_fwd, block_v=block_v)
    o, s = walk(x["q"], x["k"], x["k"], x["v"], 0.1, x["initial_state"], True, info)
    assert o.shape == x["v"].shape and torch.equal(s, x["initial_state"])
    _, s = walk(x["q"], x["k"], x["k"], x["v"], 0.1, None, True, info)
    assert s.shape == (N, H, D, D) and not s.any()
    _, s = walk(x["q"], x["k"], x["k"], x["v"], 0.1, None, False, info)
    assert s is None
    final_only = functools.partial(gluon_walk.gluon_state_final_fwd, block_v=block_v)
    assert torch.equal(final_only(x["k"], x["k"], x["v"], x["initial_state"], info), x["initial_state"])
    s = final_only(x["k"], x["k"], x["v"], None, info)
    assert s.shape == (N, H, D, D) and not s.any()


@pytest.mark.parametrize("B, H, block_v, expected", [(1, 16, None, 64), (3, 21, None, 64), (4, 16, None, 64),
                                                     (8, 16, None, 128), (8, 16, 64, 64), (1, 16, 128, 128)])
def test_launches_the_chosen_v_block(monkeypatch, B, H, block_v, expected):
    # plan.hopper_block_v's width on the tensors' device's SMs (here as the H200's 132) unless one is given
    launched = []
    monkeypatch.setattr(gluon_walk, "gluon_walk_launch", lambda *a, **kw: launched.append(a[-1]))
    monkeypatch.setattr(gluon_walk, "num_sms", lambda device: 132)
    x = make_inputs(B, 3, H, D, D, torch.bfloat16)
    gluon_walk.gluon_state_output_fwd(x["q"], x["k"], x["k"], x["v"], 0.1, None, False,
                                      seq_info(B, 3, torch.device("cpu"), None, None), block_v=block_v)
    assert launched == [expected]


def test_refuses_misuse():
    x = make_inputs(2, 64, 2, D, D, torch.bfloat16, initial_state=True)
    info = seq_info(2, 64, torch.device("cpu"), None, None)
    q, k, v, h0 = x["q"], x["k"], x["v"], x["initial_state"]
    with pytest.raises(ValueError, match="share one 16-bit dtype"):
        gluon_walk.gluon_state_output_fwd(q, k, k.float(), v, 0.1, None, False, info)
    with pytest.raises(ValueError, match="K = V = 128"):
        gluon_walk.gluon_state_output_fwd(q, k, k, v[..., :64], 0.1, None, False, info)
    with pytest.raises(ValueError, match="tokens"):  # rows that are not the batch's B * T
        gluon_walk.gluon_state_output_fwd(q[:1], k[:1], k[:1], v[:1], 0.1, None, False, info)
    with pytest.raises(ValueError, match="initial_state"):
        gluon_walk.gluon_state_output_fwd(q, k, k, v, 0.1, h0[:1], False, info)
    with pytest.raises(ValueError, match="16-byte aligned"):  # TMA: the descriptor's base
        gluon_walk.gluon_state_output_fwd(q, k, misaligned(k), v, 0.1, None, False, info)
    with pytest.raises(ValueError, match="chunk_size"):
        gluon_walk.gluon_state_output_fwd(q, k, k, v, 0.1, None, False, info, chunk_size=32)
    for block_v in (32, 96, 256):  # wgmma's M is 64 a warp group: no narrower V-block; others do not tile 128
        with pytest.raises(ValueError, match="block_v"):
            gluon_walk.gluon_state_output_fwd(q, k, k, v, 0.1, None, False, info, block_v=block_v)
    # the walk without its output: the same checks on k, w, u (q is not read), and it must store the final states
    with pytest.raises(ValueError, match="share one 16-bit dtype"):
        gluon_walk.gluon_state_final_fwd(k, k.float(), v, None, info)
    with pytest.raises(ValueError, match="16-byte aligned"):
        gluon_walk.gluon_state_final_fwd(k, k, misaligned(v), None, info)
    with pytest.raises(ValueError, match="chunk_size"):
        gluon_walk.gluon_state_final_fwd(k, k, v, None, info, chunk_size=32)
    with pytest.raises(ValueError, match="final states"):
        gluon_walk.gluon_walk_launch(None, k, k, v, None, 0.1, None, None, info)


@pytest.mark.parametrize("B, T, H, block_v", [(2, 70, 3, 64), (2, 70, 3, 128), (1, 5, 16, None)])
def test_descriptors_and_launch_as_before(monkeypatch, B, T, H, block_v):
    # as test_reverse.py's: the descriptors without a reshape are the reshaped tensors' ones,
    # and the production path (checked=True) launches the same
    from .test_reverse import LaunchRecorder, assert_same_descriptors, reshaped_descriptors
    kernel = LaunchRecorder()
    monkeypatch.setattr(gluon_walk, "gluon_walk_kernel", kernel)
    x = make_inputs(B, T, H, D, D, torch.bfloat16, initial_state=True)
    info = seq_info(B, T, torch.device("cpu"), None, None)
    w, u = torch.randn_like(x["k"]), torch.randn_like(x["v"])
    for checked in (False, True):
        gluon_walk.gluon_state_output_fwd(x["q"], x["k"], w, u, 0.1, x["initial_state"], True, info,
                                          block_v=block_v, checked=checked)
    (grid, args, kwargs), (grid2, args2, kwargs2) = kernel.launches
    width = args[1].block_shape[1]
    assert_same_descriptors(args[:4], reshaped_descriptors(((w, D), (u, width), (x["k"], D), (x["q"], D)), B * T, H))
    assert_same_descriptors(args2[:4], args[:4])
    assert grid2 == grid and kwargs2 == kwargs and len(args2) == len(args)
    assert all(a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride() if torch.is_tensor(a) else a == b
               for a, b in zip(args[4:], args2[4:]) if a is not None or b is not None)
    a = named(args)
    assert a["o"].is_contiguous() and a["o"].shape == u.shape  # o, from empty_like(u)
    assert a["st_desc"] is a["vt_desc"] is a["chunk_offsets"] is a["gam"] is None  # no states, no gate
    assert (a["SAVE_STATES"], a["RESIDUAL"], a["USE_G"], a["H"], a["HK"]) == (False, False, False, H, H)  # W, U


@pytest.mark.parametrize("B, T, H, block_v, has_h0", [(2, 70, 3, 64, True), (2, 70, 3, 128, False),
                                                      (1, 5, 16, None, True)])
def test_final_only_launch(monkeypatch, B, T, H, block_v, has_h0):
    # the same kernel, grid and chain warps as the walk with its output; no Q descriptor, no o, WITH_OUTPUT off,
    # the final state stored and the ring of WALK_CONFIGS' final_only_stages
    from .test_reverse import LaunchRecorder, assert_same_descriptors
    kernel = LaunchRecorder()
    monkeypatch.setattr(gluon_walk, "gluon_walk_kernel", kernel)
    x = make_inputs(B, T, H, D, D, torch.bfloat16, initial_state=True)
    info = seq_info(B, T, torch.device("cpu"), None, None)
    w, u = torch.randn_like(x["k"]), torch.randn_like(x["v"])
    h0 = x["initial_state"] if has_h0 else None
    gluon_walk.gluon_state_output_fwd(x["q"], x["k"], w, u, 0.1, h0, True, info, block_v=block_v)
    s = gluon_walk.gluon_state_final_fwd(x["k"], w, u, h0, info, block_v=block_v)
    (grid, args, kwargs), (grid2, args2, kwargs2) = kernel.launches
    assert grid2 == grid and kwargs2 == kwargs and len(args2) == len(args)
    assert_same_descriptors(args2[:3], args[:3])  # w, u, k
    a, a2 = named(args), named(args2)
    assert a2["q_desc"] is None and a2["o"] is None and a2["ht"] is s and s.shape == (B, H, D, D)
    assert (a2["HAS_H0"], a2["STORE_HT"], a2["WITH_OUTPUT"]) == (has_h0, True, False) and a["WITH_OUTPUT"] is True
    cfg = gluon_walk.WALK_CONFIGS[args[1].block_shape[1]]
    assert (a["STAGES"], a2["STAGES"]) == (cfg.stages, cfg.final_only_stages)


@pytest.mark.parametrize("lengths, block_v", [([70, 0, 130], 64), ([70, 0, 130], 128), ([1], None)])
def test_saves_states_through_their_descriptors(monkeypatch, lengths, block_v):
    # states (gluon_walk.states_buffers): their descriptors over [NT * H * 128, width] rows with the hand-off's blocks
    # [block_v, width] (block_v rows of S^T or V'^T), the chunks' global numbering (chunk_offsets) and SAVE_STATES
    from .test_reverse import LaunchRecorder
    kernel = LaunchRecorder()
    monkeypatch.setattr(gluon_walk, "gluon_walk_kernel", kernel)
    H, TT = 3, sum(lengths)
    x = make_inputs(1, TT, H, D, D, torch.bfloat16)
    cu = random_cu_seqlens(lengths)
    info = seq_info(1, TT, torch.device("cpu"), cu, cu)
    states = gluon_walk.states_buffers(x["k"], x["v"], info, 64)
    NT = info.chunks(64).num_chunks
    assert [tuple(s.shape) for s in states] == [(NT, H, D, D), (NT, H, D, 64)]
    gluon_walk.gluon_state_output_fwd(x["q"], x["k"], x["k"], x["v"], 0.1, None, False, info, block_v=block_v,
                                      states=states)
    ((grid, args, _), ) = kernel.launches
    width = args[1].block_shape[1]  # the V-block the program walks
    for desc, buf, cols in zip(args[4:6], states, (D, 64)):
        assert desc.base is buf and list(desc.shape) == [NT * H * D, cols] and list(desc.strides) == [cols, 1]
        assert list(desc.block_shape) == [width, cols] and desc.layout == gluon_walk.tile_layout(buf.dtype, width, cols)
    assert torch.equal(named(args)["chunk_offsets"], info.chunks(64).chunk_offsets) and named(args)["SAVE_STATES"]


def test_refuses_states_it_cannot_save():
    x = make_inputs(2, 64, 2, D, D, torch.bfloat16)
    info = seq_info(2, 64, torch.device("cpu"), None, None)
    q, k, v = x["q"], x["k"], x["v"]
    st, vt = gluon_walk.states_buffers(k, v, info, 64)
    for bad in ((st[:1], vt), (st, vt[..., :32]), (st.float(), vt), (st.transpose(2, 3), vt)):
        with pytest.raises(ValueError, match="states"):
            gluon_walk.gluon_state_output_fwd(q, k, k, v, 0.1, None, False, info, states=bad)
    with pytest.raises(ValueError, match="states"):  # the walk without its output has no hand-off to save from
        gluon_walk.gluon_walk_launch(None, k, k, v, None, 0.1, None, torch.empty(2, 2, D, D), info, states=(st, vt))


@pytest.mark.parametrize("hopper", [True, False])
def test_walk_final_states_dispatch(monkeypatch, hopper):
    # forward.walk_final_states (the split's pass 1) runs the Hopper walk without its output where the plan's walk is
    # the Hopper one (checks already made, its V-block and WY form), else the portable fused walk's final state (here
    # recorded, not run)
    chunk_forward = importlib.import_module("deltatron.kernels.chunk.forward")
    x = make_inputs(1, 64, 2, D, D, torch.bfloat16, initial_state=True)
    info = seq_info(1, 64, torch.device("cpu"), None, None)
    calls = []
    monkeypatch.setattr(gluon_walk, "gluon_state_final_fwd", lambda *a, **kw: calls.append(("gluon", a, kw)) or "s")
    monkeypatch.setattr(chunk_forward, "state_output_fwd", lambda *a, **kw: calls.append(("output", a, kw)) or ("o", "s2"))
    with plan.overrides(hopper_walk=hopper):
        call_plan = plan.make_plan(plan.Problem(torch.bfloat16, 2, D, D, 1, 64), plan.named_capabilities("sm90"))
    args = (x["q"], x["k"], x["k"], x["v"], x["initial_state"], info)
    assert chunk_forward.walk_final_states(call_plan, *args) == ("s" if hopper else "s2")
    ((name, call_args, kw), ) = calls
    if hopper:
        assert name == "gluon" and call_args == (x["k"], x["k"], x["v"], x["initial_state"], info, 64)
        assert kw == dict(block_v=64, checked=True, residual=True)
    else:
        assert name == "output" and kw == {}
        assert call_args == (x["q"], x["k"], x["k"], x["v"], 1.0, x["initial_state"], True, info, 64)


@pytest.mark.parametrize("B, T, H, block_v", [(2, 70, 3, 64), (1, 5, 16, None)])
def test_residual_form_launch(monkeypatch, B, T, H, block_v):
    # the residual form: Tb's descriptor ([.., H, 2 x 64], W's box [64, 128]) in W's place and V's in U's, RESIDUAL on,
    # everything else as the walk on W, U launches it
    from .test_reverse import LaunchRecorder, assert_same_descriptors, reshaped_descriptors
    kernel = LaunchRecorder()
    monkeypatch.setattr(gluon_walk, "gluon_walk_kernel", kernel)
    x = make_inputs(B, T, H, D, D, torch.bfloat16, initial_state=True)
    info = seq_info(B, T, torch.device("cpu"), None, None)
    tb = torch.randn(B, T, H, 2 * gluon_walk.C_WALK).to(torch.bfloat16)
    for residual in (False, True):
        gluon_walk.gluon_state_output_fwd(x["q"], x["k"], tb, x["v"], 0.1, x["initial_state"], True, info,
                                          block_v=block_v, residual=residual)
    (grid, args, kwargs), (grid2, args2, kwargs2) = kernel.launches
    width = args2[1].block_shape[1]
    assert_same_descriptors(args2[:4], reshaped_descriptors(((tb, D), (x["v"], width), (x["k"], D), (x["q"], D)),
                                                            B * T, H))
    a, a2 = named(args), named(args2)
    assert (a["RESIDUAL"], a2["RESIDUAL"]) == (False, True) and grid2 == grid and kwargs2 == kwargs
    assert all(a2[n] == a[n] for n in ARG_NAMES[ARG_NAMES.index("H"):] if n not in ("RESIDUAL", "num_warps"))


@pytest.mark.parametrize("Hk, H", [(2, 4), (3, 3), (1, 5)])
def test_gated_grouped_launch(monkeypatch, Hk, H):
    # the gate and grouped value heads: q, k's descriptors over their Hk heads ([TT, Hk * 128]), w, u's over H, γ
    # passed with USE_G, HK the key heads; the same grid (value heads) as without the gate
    from .test_reverse import LaunchRecorder, assert_same_descriptors, gated_grouped_inputs, reshaped_descriptors
    kernel = LaunchRecorder()
    monkeypatch.setattr(gluon_walk, "gluon_walk_kernel", kernel)
    B, T = 2, 70
    q, k, w, u, gam, info = gated_grouped_inputs(Hk, H, B, T)
    o, s = gluon_walk.gluon_state_output_fwd(q, k, w, u, 0.1, None, True, info, block_v=64, gam=gam)
    gluon_walk.gluon_state_output_fwd(q, k, w, u, 0.1, None, True, info, block_v=64)
    (grid, args, kwargs), (grid2, args2, _) = kernel.launches
    a, a2 = named(args), named(args2)
    assert_same_descriptors(args[:2], reshaped_descriptors(((w, D), (u, 64)), B * T, H))
    assert_same_descriptors(args[2:4], reshaped_descriptors(((k, D), (q, D)), B * T, Hk))
    assert a["gam"] is gam and (a["USE_G"], a["H"], a["HK"], a["RESIDUAL"]) == (True, H, Hk, False)
    assert a2["gam"] is None and a2["USE_G"] is False and grid == grid2 == (B * H * 2, )
    assert o.shape == u.shape and s.shape == (B, H, D, D)


def test_refuses_gated_and_grouped_misuse():
    from .test_reverse import gated_grouped_inputs
    B, T = 1, 64
    q, k, w, u, gam, info = gated_grouped_inputs(2, 4, B, T)
    with pytest.raises(ValueError, match="key heads"):  # 3 key heads do not divide 4 value heads
        gluon_walk.gluon_state_output_fwd(q[:, :, :1].expand(B, T, 3, D).contiguous(), k[:, :, :1].expand(
            B, T, 3, D).contiguous(), w, u, 0.1, None, False, info)
    with pytest.raises(ValueError, match="gam"):
        gluon_walk.gluon_state_output_fwd(q, k, w, u, 0.1, None, False, info, gam=gam[..., :2].contiguous())
    with pytest.raises(ValueError, match="gam"):
        gluon_walk.gluon_state_output_fwd(q, k, w, u, 0.1, None, False, info, gam=gam.double())
    with pytest.raises(ValueError, match="takes no kept states"):
        gluon_walk.gluon_state_output_fwd(q, k, w, u, 0.1, None, False, info, gam=gam,
                                          states=gluon_walk.states_buffers(k, u, info, 64))


def test_tma_descriptor_is_the_constructed_one():
    # tma_descriptor: TensorDescriptor's fields with the checks of the shape made once (descriptor_template, one per
    # shape, holding no tensor, bounded); the base's alignment checked on every call
    import dataclasses

    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    gluon_walk.descriptor_template.cache_clear()
    x = torch.randn(70, 3, D, dtype=torch.bfloat16)
    got = gluon_walk.tma_descriptor(x, 70, 3 * D, 64, 64)
    want = TensorDescriptor(x, [70, 3 * D], [3 * D, 1], [64, 64], gluon_walk.tile_layout(x.dtype, 64, 64))
    assert type(got) is TensorDescriptor and got.base is x
    assert {f.name: getattr(got, f.name) for f in dataclasses.fields(got) if f.name != "base"} == \
        {f.name: getattr(want, f.name) for f in dataclasses.fields(want) if f.name != "base"}
    template = gluon_walk.descriptor_template(x.dtype, 70, 3 * D, 64, 64)
    assert template.base is None and gluon_walk.descriptor_template.cache_info().currsize == 1
    assert gluon_walk.tma_descriptor(torch.randn_like(x), 70, 3 * D, 64, 64).base is not x
    assert gluon_walk.descriptor_template(x.dtype, 70, 3 * D, 64, 64) is template
    assert gluon_walk.descriptor_template(torch.float16, 70, 3 * D, 64, 64) is not template
    with pytest.raises(ValueError, match="16-byte aligned"):
        gluon_walk.tma_descriptor(misaligned(x), 70, 3 * D, 64, 64)
    with pytest.raises((AssertionError, ValueError), match="power of 2"):  # TensorDescriptor's checks, by the template
        gluon_walk.tma_descriptor(x, 70, 3 * D, 64, 48)
    for rows in range(gluon_walk.descriptor_template.cache_info().maxsize + 5):
        gluon_walk.descriptor_template(x.dtype, rows + 1, 3 * D, 64, 64)
    assert gluon_walk.descriptor_template.cache_info().currsize == gluon_walk.descriptor_template.cache_info().maxsize
