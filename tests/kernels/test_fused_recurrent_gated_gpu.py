"""The gated, grouped-value-head fused_recurrent forms (USE_G, and KDA's per-channel gate USE_GK) on the GPU at
realistic sizes (T up to 2048, K = V up to 128, Hv up to 8 over Hk up to 4, 20 packed sequences): o, final state
and all six gradients against the float64 oracle (deltatron.reference.recurrent_gated_delta_rule) with
torch.autograd, as in test_fused_recurrent_gated.py, whose check runs here on CUDA; and the backward's
determinism."""
import pytest
import torch

import deltatron.kernels.fused_recurrent as fused_recurrent
from deltatron.kernels.utils import seq_info

from ..helpers import make_gated_inputs, twenty_lengths
from .test_fused_recurrent_gated import check

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("B, T, Hk, Hv, K, V, dtype, gates", [
    (2, 1024, 4, 8, 128, 128, torch.bfloat16, "soft"),
    (1, 2048, 2, 4, 64, 64, torch.float32, "strong"),
    (2, 300, 2, 6, 100, 60, torch.float16, "soft"),
    (1, 777, 4, 4, 128, 128, torch.float32, "soft"),
], ids=str)
@pytest.mark.parametrize("per_channel", [False, True], ids=["gated", "kda"])
def test_forward_backward(B, T, Hk, Hv, K, V, dtype, gates, per_channel):
    check(B, T, Hk, Hv, K, V, dtype, gates=gates, seed=T, per_channel=per_channel)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("per_channel", [False, True], ids=["gated", "kda"])
def test_varlen_20_sequences(dtype, per_channel):
    lengths = twenty_lengths(300)
    check(1, sum(lengths), 2, 4, 128, 128, dtype, lengths=lengths, gates="strong", seed=2, per_channel=per_channel)


@pytest.mark.parametrize("per_channel", [False, True], ids=["gated", "kda"])
def test_backward_is_deterministic(per_channel):
    inp = {n: x.cuda() for n, x in make_gated_inputs(2, 512, 2, 8, 128, 128, torch.bfloat16, seed=3,
                                                     per_channel=per_channel).items()}
    info = seq_info(2, 512, torch.device("cuda"), None, None)
    q, k, v, beta, g, h0 = (inp[n] for n in ("q", "k", "v", "beta", "g", "initial_state"))
    do = torch.randn_like(v)
    dht = torch.randn_like(h0)

    def grads():
        _, _, saved, _ = fused_recurrent.forward(q, k, v, beta, 0.1, h0, True, info, g=g)
        return fused_recurrent.backward(q, k, v, beta, 0.1, h0, saved, do, dht, info, g=g)

    for a, b in zip(grads(), grads()):
        assert torch.equal(a, b)
