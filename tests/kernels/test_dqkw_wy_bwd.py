"""The fused dQ/dK/dW + WY backward (deltatron/kernels/chunk/dqkw_wy_bwd.py) against the shipped pair
output_bwd.dqkw + wy_bwd.wy_bwd on the same inputs, and the whole backward with backward.FUSED_DQKW_WY on
against the float64 recurrence."""
import importlib

import pytest
import torch

from deltatron.kernels.chunk import dqkw_wy_bwd, output_bwd, wy, wy_bwd

from ..helpers import DEVICE, INTERPRET, rel_rms
from .test_chunk_backward import check_against_recurrence, packed

pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not INTERPRET, reason="needs a GPU or TRITON_INTERPRET=1")

# the pair rounds alike (dW to the dtype, dK_direct kept fp32); only the order of some fp32 sums differs
CLOSE = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 4e-3}


def pair_inputs(lengths, H, K, V, dtype, C, seed):
    """Inputs of the two backward stages: q, k, v, beta and T~ from packed(), and random V', dO, dU and
    states h, dh ([NT, H, K, V] in the dtype, as the backward's walks write them)."""
    inp, info, _ = packed(lengths, H, K, V, dtype, seed)
    k, beta = inp["k"], inp["beta"]
    g = torch.Generator().manual_seed(seed + 1)
    TT, NT = sum(lengths), info.chunks(C).num_chunks
    rand = lambda *shape: torch.randn(*shape, generator=g).to(device=DEVICE, dtype=dtype)
    x = dict(q=inp["q"], k=k, v=inp["v"], beta=beta, tinv=wy.tinv_fwd(k, beta, info, C),
             v_new=rand(1, TT, H, V), h=rand(NT, H, K, V), dh=rand(NT, H, K, V), do=rand(1, TT, H, V),
             du=rand(1, TT, H, V))
    return x, info


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("C, lengths, H, K, V", [
    (16, [0, 1, 17, 33, 0], 2, 24, 40),  # empty sequences, a 1-token one, partial last chunks
    (32, [1], 1, 40, 24),  # T = 1
    (16, [20, 40], 2, 72, 24),  # three K tiles, the last partial (pass 1 and pass 2 loop over them)
    (64, [65, 3], 1, 32, 72),  # a whole 64-token chunk, V over two tiles
])
def test_matches_the_pair(dtype, C, lengths, H, K, V, poison):
    x, info = pair_inputs(lengths, H, K, V, dtype, C, seed=C + K + V)
    scale = 0.4
    dq, dk_direct, dw = output_bwd.dqkw(x["q"], x["k"], x["v_new"], x["h"], x["dh"], x["do"], x["du"], scale,
                                        info, C)
    want = (dq, *wy_bwd.wy_bwd(x["k"], x["v"], x["beta"], x["tinv"], dw, x["du"], dk_direct, info, C))
    got = dqkw_wy_bwd.dqkw_wy_bwd(x["q"], x["k"], x["v"], x["beta"], x["tinv"], x["v_new"], x["h"], x["dh"],
                                  x["do"], x["du"], scale, info, C)
    for name, a, b in zip(("dq", "dk", "dv", "dbeta"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert rel_rms(a, b) <= CLOSE[dtype], f"{name}: rel RMS {rel_rms(a, b):.2e}"


def refuse(*args, **kwargs):
    raise AssertionError("this kernel must not run here")


@pytest.fixture
def fused(monkeypatch):
    """The backward with the switch on; the pair refuses to run, so the fused kernel is what is checked."""
    # the module: the package exports a function of the same name
    monkeypatch.setattr(importlib.import_module("deltatron.kernels.chunk.backward"), "FUSED_DQKW_WY", True)
    monkeypatch.setattr(output_bwd, "dqkw", refuse)
    monkeypatch.setattr(wy_bwd, "wy_bwd", refuse)


@pytest.mark.parametrize("dtype, C, T, H, K, V, with_state, with_dht, growing", [
    (torch.float32, 16, 1, 1, 40, 24, True, True, False),
    (torch.float32, 32, 65, 1, 24, 40, False, True, True),
    (torch.float16, 32, 63, 1, 40, 24, True, True, True),
    (torch.bfloat16, 16, 65, 1, 40, 24, True, True, True),
    (torch.bfloat16, 64, 130, 1, 24, 32, False, True, False),
])
def test_backward_matches_recurrence(monkeypatch, fused, dtype, C, T, H, K, V, with_state, with_dht, growing,
                                     poison):
    check_against_recurrence(monkeypatch, 2, T, H, K, V, dtype, C, with_state, with_dht, growing, seed=T + C)


@pytest.mark.parametrize("dtype, C", [(torch.float32, 16), (torch.bfloat16, 32)])
def test_backward_varlen_matches_recurrence(monkeypatch, fused, dtype, C, poison):
    lengths = [0, 1, C + 1, C - 1, 2 * C, 0]
    check_against_recurrence(monkeypatch, 1, lengths, 2, 24, 32, dtype, C, True, True, seed=C)


def test_backward_without_the_switch_runs_the_pair(monkeypatch):
    """Off by default: the backward calls dqkw and wy_bwd, not the fused kernel."""
    chunk_backward = importlib.import_module("deltatron.kernels.chunk.backward")
    assert chunk_backward.FUSED_DQKW_WY is False
    monkeypatch.setattr(dqkw_wy_bwd, "dqkw_wy_bwd", refuse)
    check_against_recurrence(monkeypatch, 1, 17, 1, 24, 16, torch.float32, 16, False, False, seed=3)
