"""The segmented backward (deltatron/kernels/chunk/schedule/segments.py, backward.segmented_backward, forced with
plan.overrides(segments=S)): the plan of segments, gradients against the float64 recurrence and bitwise against the
unsegmented backward, and the order of its streams (modelled on the CPU). The rule (plan.SEGMENTS...) is in
tests/kernels/chunk/test_plan.py."""
import dataclasses
import importlib

import pytest
import torch

from deltatron.kernels import chunk
from deltatron.kernels.chunk import plan
from deltatron.kernels.chunk.portable import wy
from deltatron.kernels.chunk.schedule import segments as segmented_bwd
from deltatron.kernels.utils import SeqInfo

from ..helpers import INTERPRET, check_against_recurrence, needs_triton, packed_growing

pytestmark = needs_triton

chunk_backward = importlib.import_module("deltatron.kernels.chunk.backward")


def info_of(lengths):
    cpu = torch.tensor([0] + lengths).cumsum(0)
    return SeqInfo(cpu.to(torch.int32), cpu, len(lengths), int(cpu[-1]))


@pytest.mark.parametrize("lengths, S, C", [
    ([130], 2, 16), ([130], 3, 32), ([0, 1, 33, 31, 64, 0], 3, 16), ([1, 0, 0, 40, 0], 2, 16),
    ([5, 5, 5], 3, 16), ([100, 3], 4, 16), ([16, 16], 2, 16), ([0, 16, 0, 16, 0], 2, 16), ([7], 2, 16)])
def test_segment_plan_tiles_the_batch(lengths, S, C):
    # segments tile tokens and chunks in order, cut at chunk boundaries; each is a packed batch whose pieces are
    # the batch's sequences in order, a sequence split only where a cut crosses it; every sequence, empty ones
    # included, begins in exactly one segment
    info = info_of(lengths)
    plan = segmented_bwd.segment_plan(info, S, C)
    num_chunks = info.chunks(C).num_chunks
    if num_chunks < 2:
        assert plan is None
        return
    assert 2 <= len(plan) <= S
    assert plan[0].t0 == plan[0].c0 == 0 and plan[-1].t1 == sum(lengths) and plan[-1].c1 == num_chunks
    pieces = {n: [] for n in range(len(lengths))}
    for i, seg in enumerate(plan):
        if i:
            assert seg.t0 == plan[i - 1].t1 and seg.c0 == plan[i - 1].c1
            assert seg.cont_in == plan[i - 1].cont_out
        assert seg.t1 > seg.t0 and seg.info.chunks(C).num_chunks == seg.c1 - seg.c0
        assert seg.info.total_tokens == seg.t1 - seg.t0 == int(seg.info.cu_seqlens_cpu[-1])
        assert seg.info.cu_seqlens.tolist() == seg.info.cu_seqlens_cpu.tolist()
        cu = seg.info.cu_seqlens_cpu.tolist()
        for j in range(seg.info.num_seqs):
            pieces[seg.seq0 + j].append((seg.t0 + cu[j], seg.t0 + cu[j + 1]))
    bos = 0
    for n, L in enumerate(lengths):  # the pieces of a sequence: contiguous, cut at its chunk boundaries only
        assert pieces[n][0][0] == bos and pieces[n][-1][1] == bos + L
        assert all(a[1] == b[0] and (a[1] - bos) % C == 0 for a, b in zip(pieces[n], pieces[n][1:]))
        assert len(pieces[n]) == 1 or all(b > a for a, b in pieces[n])
        bos += L


def gradients_both_ways(monkeypatch, S, *args, **kwargs):
    """check_against_recurrence's gradients with the backward segmented in S segments (checked against the
    recurrence there) and unsegmented; asserts that the segmented path ran."""
    ran = []
    segmented = chunk_backward.segmented_backward
    monkeypatch.setattr(chunk_backward, "segmented_backward", lambda *a: ran.append(len(a[-1])) or segmented(*a))
    with plan.overrides(segments=S):
        got, _ = check_against_recurrence(monkeypatch, *args, **kwargs)
    assert ran and 2 <= ran[0] <= S
    with plan.overrides(segments=1):
        want, _ = check_against_recurrence(monkeypatch, *args, **kwargs)
    assert len(ran) == 1
    return got, want


def assert_bitwise(got, want):
    for name, x, y in zip(("dq", "dk", "dv", "dbeta", "dh0"), got, want):
        if y is None:
            assert x is None, name
        else:
            assert x.shape == y.shape and torch.equal(x, y), name


# check_against_recurrence(monkeypatch, B, T or lengths, H, K, V, dtype, C, with_state, with_dht, growing, seed)
@pytest.mark.parametrize("S, B, T, dtype, C, with_state, with_dht", [
    (2, 1, 65, torch.float32, 16, True, True),
    (3, 1, 70, torch.float32, 16, False, False),
    (2, 2, 40, torch.bfloat16, 16, True, False),  # two sequences: the cut between them
    (3, 2, 33, torch.float16, 16, False, True),  # cuts inside and between sequences
])
def test_segmented_fixed_length(monkeypatch, S, B, T, dtype, C, with_state, with_dht, poison):
    got, want = gradients_both_ways(monkeypatch, S, B, T, 2, 24, 32, dtype, C, with_state, with_dht, growing=True,
                                    seed=S + T)
    assert_bitwise(got, want)


@pytest.mark.parametrize("S, lengths, dtype, with_state, with_dht", [
    (3, [0, 1, 17, 15, 32, 0], torch.float32, True, True),
    (2, [1, 0, 40, 0], torch.bfloat16, False, True),
    (3, [0, 50, 0], torch.float32, True, False),  # one long sequence cut twice between empty ones
])
def test_segmented_varlen(monkeypatch, S, lengths, dtype, with_state, with_dht, poison):
    got, want = gradients_both_ways(monkeypatch, S, 1, lengths, 2, 16, 24, dtype, 16, with_state, with_dht,
                                    seed=S + len(lengths))
    assert_bitwise(got, want)


def test_segmented_unsplittable_runs_unsegmented(monkeypatch, poison):
    # one chunk: no cut, the plain backward
    monkeypatch.setattr(chunk_backward, "segmented_backward", lambda *a: pytest.fail("segmented"))
    with plan.overrides(segments=2):
        check_against_recurrence(monkeypatch, 1, 16, 1, 16, 16, torch.float32, 16, True, True, seed=1)


def test_segments_off_by_rule_on_one_stream():
    # by the rule only where a side stream exists (CUDA, not the interpreter): on one stream the segments would only
    # add launches; forced (tests), they run on one stream too
    assert plan.plan_for_shape(1, 32768, 16, 8, 8, torch.float32, "cpu").segments == 1
    assert plan.plan_for_shape(1, 32768, 16, 8, 8, torch.float32, "sm80").segments == 2
    with plan.overrides(segments=3):
        assert plan.plan_for_shape(1, 32768, 16, 8, 8, torch.float32, "cpu").segments == 3


class FakeStream:
    """A stream of the model below: a vector clock over the streams (one tick per queued operation)."""

    def __init__(self, name, log):
        self.name, self.log, self.clock = name, log, {}

    def tick(self, op):
        self.clock[self.name] = self.clock.get(self.name, 0) + 1
        self.log.append((op, self.name, dict(self.clock)))

    def record_event(self):
        return dict(self.clock)

    def wait_event(self, event):
        for name, n in event.items():
            self.clock[name] = max(self.clock.get(name, 0), n)

    def wait_stream(self, other):
        self.wait_event(other.record_event())


def before(a, b):
    """Whether logged operation a happens before b: b's stream has waited for a's position on a's stream."""
    (_, sa, ca), (_, _, cb) = a, b
    return ca[sa] <= cb.get(sa, 0)


@pytest.mark.skipif(not INTERPRET, reason="a model of the CUDA streams on CPU tensors: needs Triton's interpreter")
@pytest.mark.parametrize("S, with_state, dtype", [(2, True, torch.float32), (3, False, torch.float32),
                                                  (2, True, torch.bfloat16)])
def test_segmented_stream_order(monkeypatch, S, with_state, dtype, poison):
    # the CUDA path's streams, modelled on the CPU (the kernels run in turn; vector clocks stand for the streams; the
    # CPU plan given the caps of a device with two streams):
    # state_fwd on the side stream (fp32: the two-launch recompute; bf16 here recomputes h in one launch with W, on
    # the current stream), rev(S) and rev(s) on the current one, grad(s) for s > 1 on the side stream after rev(s)
    # and h's recompute, grad(1) on the current one after both, and the current stream, which the caller goes on
    # with, after everything; the gradients as on one stream
    log = []
    main, side = FakeStream("main", log), FakeStream("side", log)
    current = [main]

    class on:  # torch.cuda.stream(s)
        def __init__(self, s):
            self.s = s

        def __enter__(self):
            current.append(self.s)

        def __exit__(self, *exc):
            current.pop()

    def logged(module, name, op):
        fn = getattr(module, name)
        monkeypatch.setattr(module, name,
                            lambda *a, **kw: (current[-1] is not None and current[-1].tick(op(a))) or fn(*a, **kw))

    monkeypatch.setattr(chunk_backward, "side_stream", lambda index: side)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: None)
    logged(chunk_backward, "state_fwd", lambda a: "state_fwd")
    logged(chunk_backward, "state_wy_fwd", lambda a: "state_fwd")
    logged(segmented_bwd, "reverse_segment", lambda a: ("rev", a[0].t0))
    logged(segmented_bwd, "grad_segment", lambda a: ("grad", a[0].t0))
    # the CPU plan, segmented, with the streams of a GPU (two_streams: the caps' cuda and not interpret)
    T, C = 48 * (S - 1), 16
    inp, info, _ = packed_growing([T], 1, 16, 16, dtype, seed=S)
    q, k, v, beta = inp["q"], inp["k"], inp["v"], inp["beta"]
    h0 = torch.randn(1, 1, 16, 16) if with_state else None
    g = torch.Generator().manual_seed(S)
    do, dht = torch.randn(1, T, 1, 16, generator=g).to(dtype), torch.randn(1, 1, 16, 16, generator=g)
    tinv = wy.tinv_fwd(k, beta, info, C)
    with plan.overrides(segments=S):
        cpu_plan = chunk.plan_call(q, k, v, info, True, C)
    two_launch = cpu_plan.recompute == "two_launch"
    assert two_launch == (dtype == torch.float32)  # both recompute paths are modelled
    streams_plan = dataclasses.replace(cpu_plan, caps=dataclasses.replace(cpu_plan.caps, cuda=True, interpret=False))
    assert streams_plan.caps.two_streams and streams_plan.segments == S
    got = chunk_backward.backward(q, k, v, beta, 0.3, h0, (tinv,), do, dht, info, C, plan=streams_plan)
    current.append(None)  # the unsegmented backward's launches are not logged
    with plan.overrides(segments=1):
        want = chunk_backward.backward(q, k, v, beta, 0.3, h0, (tinv,), do, dht, info, C)
    assert_bitwise(got, want)
    # the segmented backward: state_fwd, S reverse passes, S grad stages
    assert len(log) == 1 + 2 * S
    ops = {op: (op, s, c) for op, s, c in log}
    starts = sorted({op[1] for op in ops if op != "state_fwd"})
    assert len(starts) == S and len(ops) == len(log)
    assert ops["state_fwd"][1] == ("side" if two_launch else "main") and all(ops["rev", t][1] == "main" for t in starts)
    assert [ops["grad", t][1] for t in starts] == ["main"] + ["side"] * (S - 1)
    for i, t in enumerate(starts):
        assert before(ops["rev", t], ops["grad", t]) and before(ops["state_fwd"], ops["grad", t])
        if i + 1 < S:  # the reverse pass runs from the last segment to the first
            assert before(ops["rev", starts[i + 1]], ops["rev", t])
    end = ("end", "main", dict(main.clock))  # where the caller goes on
    assert all(before(op, end) for op in log)
    assert not before(ops["grad", starts[-1]], ops["rev", starts[0]])  # grad(S) may overlap rev(1)
