"""The backward's reverse pass split along long sequences at realistic sizes (backward.REVERSE_SPLIT,
kernels/chunk/reverse_split.py): the benchmark's b1-t32768-h16 and a varlen batch with long, short and empty
sequences, on the Triton and the Gluon reverse pass, against an fp32 oracle (check()'s dtype bound) and near the
unsplit backward; pass 1's output-free Gluon pass against the full one, dh0 bit for bit."""
import importlib

import pytest
import torch

from deltatron.kernels.chunk import reverse_split, seq_split, state_bwd, wy
from deltatron.kernels.utils import seq_info

from ..helpers import BOUNDS, make_inputs, random_cu_seqlens, rel_rms
from .test_chunk_backward_gpu import check, force_reverse_pass, gluon_reverse_runs, triton_backend  # noqa: F401

pytestmark = pytest.mark.gpu

chunk_backward = importlib.import_module("deltatron.kernels.chunk.backward")  # the package exports a function
NAMES = ("q", "k", "v", "beta", "initial_state")


def split_and_not(monkeypatch, x, P, cu=None):
    """check()'s gradients (against the fp32 chunkwise oracle, within the dtype's bound) with the reverse pass
    unsplit, then split in P partitions, both unsegmented; asserts that the split ran."""
    plans = []
    split = reverse_split.split_state_bwd
    monkeypatch.setattr(reverse_split, "split_state_bwd", lambda *a: plans.append(a[-2]) or split(*a))
    monkeypatch.setattr(chunk_backward, "SEGMENTED_BACKWARD", False)
    monkeypatch.setattr(seq_split, "SPLIT_PARTITIONS", P)
    grads = {}
    for on in (False, True):
        monkeypatch.setattr(chunk_backward, "REVERSE_SPLIT", on)
        grads[on], _ = check(x, 128 ** -0.5, 64, cu, ref_dtype=torch.float32)
    assert len(plans) == 1 and len(plans[0].rows_parts) == P
    return grads


def assert_near_unsplit(grads, dtype):
    # the walk on W and the combine round otherwise than the unsplit pass: a fraction of the dtype's bound
    for n in NAMES:
        err = rel_rms(grads[True][n], grads[False][n])
        assert err <= BOUNDS[dtype] / 2, f"d{n}: {err:.2e} off the unsplit backward's"


@pytest.mark.parametrize("P", [3, 4])
@pytest.mark.parametrize("reverse", ["triton", "gluon"])
def test_split_b1_t32768_h16(triton_backend, poison, monkeypatch, request, P, reverse):
    # the shape the split is for: 1 x 16 heads, T = 32768, bf16, with dht and the initial state. The Gluon pass:
    # one launch unsplit, two split (pass 1 without outputs, pass 2)
    x = make_inputs(1, 32768, 16, 128, 128, torch.bfloat16, device="cuda", initial_state=True, seed=21,
                    requires_grad=True)
    launches = force_reverse_pass(reverse, x, monkeypatch, request)
    grads = split_and_not(monkeypatch, x, P)
    assert_near_unsplit(grads, torch.bfloat16)
    assert len(launches) == (3 if reverse == "gluon" else 0)


@pytest.mark.parametrize("reverse", ["triton", "gluon"])
def test_split_varlen(triton_backend, poison, monkeypatch, request, reverse):
    # two sequences of 8192 tokens or more split at P = 3 (fillers between them in pass 1), short, empty and
    # one-token ones whole
    lengths = [20000, 0, 1, 63, 64, 65, 9000, 3000]
    x = make_inputs(1, sum(lengths), 16, 128, 128, torch.bfloat16, device="cuda", initial_state=True,
                    N=len(lengths), seed=22, requires_grad=True)
    cu = random_cu_seqlens(lengths, "cuda")
    force_reverse_pass(reverse, x, monkeypatch, request)
    grads = split_and_not(monkeypatch, x, 3, cu)
    assert_near_unsplit(grads, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gluon_output_free_pass_same_dh0(poison, request, dtype):
    # the Gluon pass without dh and dV' (pass 1's store_outputs=False; both V-block widths): the full pass's dh0,
    # bit for bit, and finite. On the WY forward's W: a random W makes the reverse recurrence grow without bound (it
    # overflowed fp16 to NaN over 9,000 tokens on the H200, session 17, where NaN != NaN failed the comparison)
    lengths = [9000, 0, 1, 3000]
    x = make_inputs(1, sum(lengths), 16, 128, 128, dtype, device="cuda", initial_state=True, N=len(lengths),
                    seed=23)
    if not state_bwd.gluon_reverse_applies(x["q"], x["k"], x["k"], x["v"], None, 64):
        pytest.skip("the Gluon reverse pass runs on sm_90 only")
    request.getfixturevalue("gluon_reverse_runs")
    from deltatron.kernels.chunk import gluon_reverse

    cu = random_cu_seqlens(lengths, "cuda")
    info = seq_info(1, sum(lengths), torch.device("cuda"), cu, cu.cpu())
    _, w, _ = wy.wy_fwd(x["k"], x["v"], x["beta"], info, 64, store_tinv=False)
    for block_v in (64, 128):
        args = (x["q"], x["k"], w, x["v"], x["initial_state"], 0.1, True, info)
        _, _, dh0 = gluon_reverse.gluon_state_bwd(*args, block_v=block_v)
        dh, dv, dh0_alone = gluon_reverse.gluon_state_bwd(*args, block_v=block_v, store_outputs=False)
        assert dh is None and dv is None and torch.equal(dh0_alone, dh0), block_v
        assert torch.isfinite(dh0).all(), block_v
