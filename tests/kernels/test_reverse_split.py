"""The backward's reverse pass split along long sequences (deltatron/kernels/chunk/reverse_split.py,
backward.REVERSE_SPLIT): gradients with the split forced against the unsplit backward and the float64 recurrence,
pass 1's output-free reverse pass, the switch's default and its precedence over the segmented backward. Tiny shapes
for the interpreter (C = 16, a few hundred tokens, the split from 64 or 128 tokens); tests/gpu/
test_reverse_split_gpu.py runs the benchmark's b1-t32768-h16."""
import importlib

import pytest
import torch

from deltatron.kernels.chunk import reverse_split, seq_split, state_bwd
from deltatron.kernels.utils import seq_info

from ..helpers import BOUNDS, DEVICE, INTERPRET, make_inputs, random_cu_seqlens, rel_rms
from .test_chunk_backward import check_against_recurrence

pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not INTERPRET, reason="needs a GPU or TRITON_INTERPRET=1")

chunk_backward = importlib.import_module("deltatron.kernels.chunk.backward")
NAMES = ("dq", "dk", "dv", "dbeta", "dh0")


def gradients_both_ways(monkeypatch, P, min_tokens, *args, **kwargs):
    """check_against_recurrence's gradients (each checked against the float64 recurrence there) with the reverse
    pass split (REVERSE_SPLIT = True, P partitions from min_tokens tokens) and unsplit; asserts that the split ran,
    in P partitions, and returns (split, unsplit, the plan)."""
    plans = []
    split = reverse_split.split_state_bwd
    monkeypatch.setattr(reverse_split, "split_state_bwd", lambda *a: plans.append(a[-2]) or split(*a))
    monkeypatch.setattr(seq_split, "SPLIT_PARTITIONS", P)
    monkeypatch.setattr(seq_split, "SPLIT_MIN_TOKENS", min_tokens)
    monkeypatch.setattr(chunk_backward, "REVERSE_SPLIT", True)
    got, _ = check_against_recurrence(monkeypatch, *args, **kwargs)
    assert len(plans) == 1 and len(plans[0].rows_parts) == P
    monkeypatch.setattr(chunk_backward, "REVERSE_SPLIT", False)
    want, _ = check_against_recurrence(monkeypatch, *args, **kwargs)
    assert len(plans) == 1
    return got, want, plans[0]


def assert_close(got, want, tol):
    for name, x, y in zip(NAMES, got, want):
        if y is None:
            assert x is None, name
        else:
            err = rel_rms(x, y)
            assert err <= tol, f"{name}: {err:.2e} off the unsplit backward's"


# check_against_recurrence(monkeypatch, B, T or lengths, H, K, V, dtype, C, with_state, with_dht, growing, seed)
@pytest.mark.parametrize("P, lengths, with_state, with_dht, growing", [
    (3, [300], True, True, False),  # 19 chunks: 7 6 6, the last one partial (12 tokens)
    (4, [260], False, False, False),  # the last chunk partial (4 tokens)
    (4, [200], True, False, True),  # transitions that grow (unnormalized keys, beta up to 2)
    (2, [150], False, True, False),  # P = 2: no walk on W, E_0 = D_1
    (3, [40, 250, 0, 180], True, True, False),  # packed: 40 and the empty one unsplit, fillers between 250 and 180
])
def test_split_fp32_matches_unsplit(monkeypatch, poison, P, lengths, with_state, with_dht, growing):
    min_tokens = 128
    got, want, plan = gradients_both_ways(monkeypatch, P, min_tokens, 1, lengths, 2, 24, 32, torch.float32, 16,
                                          with_state, with_dht, growing=growing, seed=P + len(lengths))
    assert plan.parts.num_seqs == len(lengths) + (P - 1) * sum(L >= min_tokens for L in lengths)
    assert_close(got, want, 1e-5)


@pytest.mark.parametrize("dtype, P, lengths", [(torch.float16, 4, [30, 200]), (torch.bfloat16, 3, [170])])
def test_split_16_bit_within_bounds(monkeypatch, poison, dtype, P, lengths):
    # against the float64 recurrence within the dtype's bound (check_against_recurrence), both ways; and near the
    # unsplit gradients (the walk on W and the combine round differently: a fraction of the bound)
    got, want, _ = gradients_both_ways(monkeypatch, P, 64, 1, lengths, 2, 32, 16, dtype, 16, True, True,
                                       seed=P)
    assert_close(got, want, BOUNDS[dtype] / 2)


def test_output_free_pass_same_dh0(poison):
    # pass 1's reverse pass without dh and dV' (store_outputs=False): the full pass's dh0, bit for bit
    lengths, H, K, V = [70, 0, 33], 2, 24, 32
    inp = make_inputs(1, sum(lengths), H, K, V, torch.float16, device=DEVICE, seed=5, initial_state=True,
                      N=len(lengths))
    cu = random_cu_seqlens(lengths, DEVICE)
    info = seq_info(1, sum(lengths), torch.device(DEVICE), cu, cu.cpu())
    w, do = torch.randn_like(inp["k"]) * 0.1, torch.randn_like(inp["v"])
    args = (inp["q"], inp["k"], w, do, None, inp["initial_state"], 0.2, True, info, 16)
    dh, dv, dh0 = state_bwd.state_bwd(*args)
    no_dh, no_dv, dh0_alone = state_bwd.state_bwd(*args, store_outputs=False)
    assert no_dh is None and no_dv is None and torch.equal(dh0_alone, dh0)


def test_switch_off_by_default_and_unsegmented_when_split(monkeypatch, poison):
    # off by default; forced on where the segmented backward is forced too, the split runs and the segments do not
    assert chunk_backward.REVERSE_SPLIT is False
    ran = []
    split = reverse_split.split_state_bwd
    monkeypatch.setattr(reverse_split, "split_state_bwd", lambda *a: ran.append(1) or split(*a))
    monkeypatch.setattr(chunk_backward, "segmented_backward", lambda *a: pytest.fail("segmented"))
    monkeypatch.setattr(chunk_backward, "SEGMENTED_BACKWARD", True)
    monkeypatch.setattr(chunk_backward, "REVERSE_SPLIT", True)
    monkeypatch.setattr(seq_split, "SPLIT_MIN_TOKENS", 64)
    check_against_recurrence(monkeypatch, 1, [120], 1, 16, 16, torch.float32, 16, True, True, seed=3)
    assert ran == [1]


def test_no_sequence_long_enough_runs_unsplit(monkeypatch, poison):
    # forced on with no sequence of SPLIT_MIN_TOKENS: no plan, the plain reverse pass
    monkeypatch.setattr(chunk_backward, "REVERSE_SPLIT", True)
    monkeypatch.setattr(seq_split, "SPLIT_MIN_TOKENS", 1000)
    monkeypatch.setattr(reverse_split, "split_state_bwd", lambda *a: pytest.fail("split"))
    check_against_recurrence(monkeypatch, 1, [50, 70], 1, 16, 16, torch.float32, 16, True, True, seed=2)
