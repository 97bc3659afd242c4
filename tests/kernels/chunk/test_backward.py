"""The chunk backward (deltatron/kernels/chunk/backward.py) as a whole: through the public API against torch.autograd
through the float64 recurrence (DESIGN.md §1), on the forward's kept states (save_states) as on the recompute from T~,
the recompute paths the plan chooses, and the release of intermediates. The stages: tests/kernels/chunk/portable/;
the segmented backward: schedule/test_segments.py; realistic sizes: test_backward_gpu.py."""
import dataclasses
import importlib
import weakref

import pytest
import torch

import deltatron
from deltatron.kernels import chunk
from deltatron.kernels.chunk import plan
from deltatron.kernels.chunk.portable import output, reverse, walk, wy, wy_bwd

from ...helpers import DEVICE, make_inputs, random_cu_seqlens, rel_rms, transposed_states
from .helpers import ONE_ROUNDING_BWD, check_against_recurrence, needs_triton, packed_growing

pytestmark = needs_triton

# the module: the package exports a function of the same name
chunk_backward = importlib.import_module("deltatron.kernels.chunk.backward")


@pytest.mark.parametrize("dtype, C, lengths, K, V, has_h0, with_dht", [
    (torch.float32, 16, [0, 1, 17, 33, 0], 24, 40, True, True),  # empty sequences, a 1-token one, partial chunks
    (torch.float16, 32, [1], 40, 24, False, True),  # T = 1
    (torch.bfloat16, 64, [65, 0, 3], 40, 72, True, False),  # two V-blocks, the second partial
])
def test_backward_on_forward_states_matches_recompute(dtype, C, lengths, K, V, has_h0, with_dht, poison):
    """The backward from saved (T~, W, S^T, V'^T) (chunk_delta_rule's save_states: the forward's Hopper walk saves
    them where the plan keeps states; here laid out from the recompute's own W, h, v_new) against the one from T~ alone, which recomputes them:
    the same stages on the same values, dQ/dK/dW's operands laid out otherwise (about one rounding apart)."""
    H = 2
    inp, info, _ = packed_growing(lengths, H, K, V, dtype, seed=C + K + 1)
    N, TT = len(lengths), sum(lengths)
    g = torch.Generator().manual_seed(13)
    h0 = torch.randn(N, H, K, V, generator=g).to(DEVICE) if has_h0 else None
    do = torch.randn(1, TT, H, V, generator=g).to(device=DEVICE, dtype=dtype)
    dht = torch.randn(N, H, K, V, generator=g).to(DEVICE) if with_dht else None
    q, k, v, beta = inp["q"], inp["k"], inp["v"], inp["beta"]
    tinv = wy.tinv_fwd(k, beta, info, C)
    w, h, v_new, _ = walk.state_wy_fwd(k, v, beta, tinv, h0, False, info, C)
    kept = (tinv, w, *transposed_states(h, v_new, lengths, C))
    want = chunk_backward.backward(q, k, v, beta, 0.4, h0, (tinv,), do, dht, info, C)
    got = chunk_backward.backward(q, k, v, beta, 0.4, h0, kept, do, dht, info, C)
    for name, x, ref in zip(("dq", "dk", "dv", "dbeta", "dh0"), got, want):
        assert (x is None) == (ref is None) == (name == "dh0" and not has_h0), name
        assert x is None or (x.dtype == ref.dtype and rel_rms(x, ref) <= ONE_ROUNDING_BWD[dtype]), name


def stand_in_for_the_saving_walk(monkeypatch, lengths) -> list:
    """Off the GPU, the forward's states kept as the Hopper walk keeps them: each training call with save_states gets
    its plan with the Hopper walk keeping states (make_plan refuses that off sm_90: overrides(keep_states=True) would
    raise), and the Hopper walk (GPU-only) is stood in for by the portable walk and output, its h and V' laid out as
    the Hopper walk stores them (transposed_states). Returns the list each backward on kept states appends its kept
    (W, S^T, V'^T) to."""
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")  # hopper/walk.py holds states_buffers
    from deltatron.kernels.chunk.hopper import walk as hopper_walk

    def walk_saving_states(q, k, w, u, scale, h0, output_final_state, info, chunk_size, states=None, residual=False,
                           **launch):
        assert not residual  # (kept states need W, U)
        h, v_new, final = walk.state_fwd(k, w, u, h0, output_final_state, info, chunk_size)
        for buf, x in zip(states or (), transposed_states(h, v_new, lengths, chunk_size)):
            buf.copy_(x)
        return output.output_fwd(q, k, v_new, h, scale, info, chunk_size), final

    plan_call = chunk.plan_call

    def plan_keeping_states(*args, **kwargs):
        p = plan_call(*args, **kwargs)
        if not (p.problem.training and p.problem.save_states):
            return p
        return dataclasses.replace(p, walk="hopper", residual=False, keep_states=True, recompute="none")

    ran = []
    backward = chunk.backward  # the form's backward (autograd calls the package's)
    monkeypatch.setattr(chunk, "plan_call", plan_keeping_states)
    monkeypatch.setattr(hopper_walk, "gluon_state_output_fwd", walk_saving_states)
    monkeypatch.setattr(chunk, "backward",
                        lambda *a, **kw: (len(a[6]) == 4 and ran.append(a[6][1:])) or backward(*a, **kw))
    return ran


@pytest.mark.parametrize("dtype, lengths, save_states", [(torch.bfloat16, [0, 1, 33, 16], True),
                                                       (torch.float16, [40], True), (torch.float16, [40], False)])
def test_api_gradients_from_kept_states(monkeypatch, dtype, lengths, save_states, poison):
    """Through the API and autograd: with save_states, the forward keeps (T~, W, S^T, V'^T) where
    its plan keeps states, and the backward runs on them instead of recomputing; the gradients match the float64 recurrence as the recomputing backward's do; without it nothing is
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

    ran = stand_in_for_the_saving_walk(monkeypatch, [30, 17])
    from deltatron.kernels.chunk.hopper import walk as hopper_walk
    kept_refs = []
    buffers = hopper_walk.states_buffers
    monkeypatch.setattr(hopper_walk, "states_buffers",
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_local_dv_apart(monkeypatch, dtype, poison):
    # overrides(local_dv_apart=True): the reverse pass reads grads.dv_local's local dV' (KDA's rule) on the
    # ungated rule too
    with plan.overrides(local_dv_apart=True):
        check_against_recurrence(monkeypatch, 1, [0, 17, 40], 2, 24, 32, dtype, 16, True, True, seed=7)


def test_gradients_with_qk_l2norm(monkeypatch, poison):
    check_against_recurrence(monkeypatch, 1, 65, 2, 24, 16, torch.float16, 32, True, True, growing=True,
                             l2norm=True, seed=4)


@pytest.mark.parametrize("dtype, watched", [
    (torch.float32, {"w", "u", "h", "v_new", "dh"}),  # W, U from recompute_w_u, then the plain walk ("two_launch")
    (torch.bfloat16, {"w", "h", "v_new", "dh"}),  # the walk computing W, U on chip (the plan's recompute "on_chip")
])
def test_backward_releases_intermediates_before_the_wy_stage(monkeypatch, dtype, watched):
    """Memory: W, U, the chunk states h, V' and dS are dead when the WY backward allocates its outputs, so
    they do not add to the peak of forward+backward (docs/performance.md, peak memory). The stages are recorded
    where backward.py calls them."""
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

    for name, fn, labels in (("recompute_w_u", wy.recompute_w_u, ("w", "u")),
                             ("state_fwd", walk.state_fwd, ("h", "v_new", None)),
                             ("state_wy_fwd", walk.state_wy_fwd, ("w", "h", "v_new", None)),
                             ("state_bwd", reverse.state_bwd, ("dh", None, None))):
        monkeypatch.setattr(chunk_backward, name, recording(fn, labels))
    monkeypatch.setattr(chunk_backward, "wy_bwd", wy_bwd_checking)
    monkeypatch.setenv("DELTATRON_BACKEND", "triton")
    inp = make_inputs(1, 100, 2, 32, 32, dtype, device=DEVICE, seed=0, requires_grad=True)
    o, _ = deltatron.chunk_delta_rule(inp["q"], inp["k"], inp["v"], inp["beta"])
    torch.autograd.grad(o.sum(), (inp["q"], inp["k"], inp["v"], inp["beta"]))
    assert set(refs) == watched


def test_no_overlap_off_cuda(monkeypatch, poison):
    # the overlap of the two-launch recompute's walk with the reverse pass needs CUDA streams: on CPU tensors (the
    # interpreter) the plan never overlaps (forced: a ValueError when the plan is made, test_plan.py), the backward
    # never asks for the side stream, takes the one-stream path and matches the recurrence
    monkeypatch.setattr(chunk_backward, "side_stream", lambda *args: pytest.fail("asked for a side stream"))
    recomputes, recompute_w_u = [], wy.recompute_w_u
    monkeypatch.setattr(chunk_backward, "recompute_w_u", lambda *a, **kw: recomputes.append(1) or recompute_w_u(*a, **kw))
    plans, plan_call = [], chunk.plan_call
    monkeypatch.setattr(chunk, "plan_call", lambda *a, **kw: plans.append(plan_call(*a, **kw)) or plans[-1])
    # fp32: the two-launch recompute (on chip is 16-bit only)
    check_against_recurrence(monkeypatch, 1, 65, 1, 40, 24, torch.float32, 32, True, True, seed=6)
    assert recomputes == [1]
    assert [(p.recompute, p.overlap, p.segments) for p in plans] == [("two_launch", False, 1)]
    with pytest.raises(ValueError, match="two CUDA streams"), plan.overrides(overlap=True):
        check_against_recurrence(monkeypatch, 1, 65, 1, 40, 24, torch.float32, 32, True, True, seed=6)


@pytest.mark.parametrize("dtype, expected", [(torch.float32, "two_launch"), (torch.bfloat16, "on_chip")])
def test_backward_without_plan_makes_the_forwards(monkeypatch, dtype, expected, poison):
    # called on its own (plan None), the backward runs the plan the forward would have made (plan_call with
    # needs_backward and the same chunk size and save_states): the same gradients as with that plan given
    lengths, C = [20, 0, 33], 16
    inp, info, _ = packed_growing(lengths, 2, 24, 32, dtype, seed=3)
    q, k, v, beta = inp["q"], inp["k"], inp["v"], inp["beta"]
    do = torch.randn(1, sum(lengths), 2, 32).to(device=DEVICE, dtype=dtype)
    tinv = wy.tinv_fwd(k, beta, info, C)
    given = chunk.plan_call(q, k, v, info, True, C)
    assert given.recompute == expected
    want = chunk_backward.backward(q, k, v, beta, 0.3, None, (tinv,), do, None, info, C, plan=given)
    got = chunk_backward.backward(q, k, v, beta, 0.3, None, (tinv,), do, None, info, C)
    for name, x, ref in zip(("dq", "dk", "dv", "dbeta", "dh0"), got, want):
        assert (x is None) == (ref is None) and (x is None or torch.equal(x, ref)), name
