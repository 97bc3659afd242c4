"""The segmented backward at realistic sizes (H200; plan.overrides(segments=S), kernels/chunk/schedule/segments.py):
the shape it is for (1 x 16 heads, T = 32768, bf16, K = V = 128) and a varlen batch with empty and one-token
sequences, against an fp32 (long) or float64 (varlen) oracle and against the unsegmented backward; the later
segments' grad stages on the side stream."""
import importlib

import pytest
import torch

import deltatron
from deltatron.kernels.chunk import plan
from deltatron.kernels.chunk.schedule import segments as segmented_bwd
from deltatron.kernels.utils import num_sms, seq_info

from ....helpers import make_inputs, random_cu_seqlens, rel_rms
from ..test_backward_gpu import check, force_reverse_pass, gluon_reverse_runs, triton_backend  # noqa: F401

pytestmark = pytest.mark.gpu

chunk_backward = importlib.import_module("deltatron.kernels.chunk.backward")  # the package exports a function
NAMES = ("q", "k", "v", "beta", "initial_state")


def segmented_and_not(monkeypatch, x, S, cu=None, ref_dtype=torch.float64):
    """check()'s gradients unsegmented, then in S segments; the stream each backward dqkw call ran on, per call."""
    streams = []
    for module in (chunk_backward, segmented_bwd):  # where the unsegmented and the segmented backward call dqkw
        dqkw = module.dqkw
        monkeypatch.setattr(module, "dqkw", lambda *a, _dqkw=dqkw, **kw: streams.append(torch.cuda.current_stream())
                            or _dqkw(*a, **kw))
    grads = {}
    for on in (False, True):
        with plan.overrides(segments=S if on else 1):
            grads[on], _ = check(x, 128 ** -0.5, 64, cu, ref_dtype=ref_dtype)
    return grads, streams


def assert_bitwise(grads):
    for n in NAMES:
        a, b = grads[True][n], grads[False][n]
        assert torch.equal(a, b), f"d{n}: not bitwise equal, rel RMS {rel_rms(a, b):.2e}"


@pytest.mark.parametrize("S", [2, 3])
@pytest.mark.parametrize("reverse", ["triton", "gluon"])
def test_segmented_one_long_sequence(triton_backend, poison, monkeypatch, request, S, reverse):
    # the shape the segmented backward is for: 1 x 16 heads, T = 32768 (the two-launch recompute, state_fwd on the
    # side stream). One sequence: every segment runs the batch's reverse-pass configuration, so the gradients are
    # bitwise the unsegmented ones; S reverse passes (Gluon launches counted), the grad stages of segments 2..S on
    # the side stream, segment 1's on the backward's
    x = make_inputs(1, 32768, 16, 128, 128, torch.bfloat16, device="cuda", initial_state=True, seed=11,
                    requires_grad=True)
    launches = force_reverse_pass(reverse, x, monkeypatch, request)
    grads, streams = segmented_and_not(monkeypatch, x, S, ref_dtype=torch.float32)
    assert_bitwise(grads)
    main, side = torch.cuda.current_stream(), chunk_backward.side_stream(torch.cuda.current_device())
    assert streams == [main] + [side] * (S - 1) + [main]
    assert len(launches) == (1 + S if reverse == "gluon" else 0)


@pytest.mark.parametrize("reverse", ["triton", "gluon"])
def test_segmented_varlen(triton_backend, poison, monkeypatch, request, reverse):
    # 8 sequences, empty and one-token ones among them, cut into 3 segments (cuts inside and between sequences):
    # against the float64 oracle; bitwise equal to the unsegmented backward where every segment's reverse pass runs
    # the batch's configuration (the Triton pass's V-block and the Gluon pass's split follow a launch's sequences x
    # heads), else within 1e-3
    lengths = [0, 1, 3000, 0, 9000, 63, 5000, 0]
    H = 4
    x = make_inputs(1, sum(lengths), H, 128, 128, torch.bfloat16, device="cuda", initial_state=True,
                    N=len(lengths), seed=12, requires_grad=True)
    cu = random_cu_seqlens(lengths, "cuda")
    force_reverse_pass(reverse, x, monkeypatch, request)
    grads, _ = segmented_and_not(monkeypatch, x, 3, cu)
    info = seq_info(1, sum(lengths), x["q"].device, cu, cu.cpu())
    segments = segmented_bwd.segment_plan(info, 3, 64)
    assert len(segments) == 3

    def config(n):
        if reverse == "gluon":
            return plan.hopper_block_v(n * H, num_sms(x["q"].device))
        return plan.reverse_launch(128, 128, n * H, 2, num_sms(x["q"].device), False)

    if all(config(seg.info.num_seqs) == config(len(lengths)) for seg in segments):
        assert_bitwise(grads)
    else:
        for n in NAMES:
            assert rel_rms(grads[True][n], grads[False][n]) <= 1e-3, n


def test_segmented_peak_memory(triton_backend, monkeypatch):
    # the segmented backward releases U, W and each segment's dh and dV' after their last reader, so its peak stays
    # near the unsegmented one's: at 1 x 16 heads, T = 32768, bf16 it held them all to the end, 1.82 GiB against
    # 1.50 (over fla's 1.81). Peak of forward + backward above what is allocated before it, as the
    # benchmark measures it
    x = make_inputs(1, 32768, 16, 128, 128, torch.bfloat16, device="cuda", seed=13, requires_grad=True)
    do = torch.randn_like(x["v"])

    def peak():
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        o, _ = deltatron.chunk_delta_rule(x["q"], x["k"], x["v"], x["beta"])
        torch.autograd.grad(o, [x[n] for n in ("q", "k", "v", "beta")], do)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - held

    peaks = {}
    for on in (False, True):
        with plan.overrides(segments=None if on else 1):  # the rule's 2 segments at this shape
            peak()  # compiles outside the measured call
            peaks[on] = peak()
    print(f"peak: unsegmented {peaks[False] / 2**30:.3f} GiB, segmented {peaks[True] / 2**30:.3f} GiB")
    assert peaks[True] <= 1.1 * peaks[False], peaks
