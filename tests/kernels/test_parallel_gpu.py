"""parallel_delta_rule on the GPU at realistic sizes: o, final state, P and all five gradients against
torch.autograd through the float64 parallel reference (run on the GPU), and bitwise determinism."""
import pytest
import torch

from deltatron import parallel_delta_rule

from ..helpers import make_inputs, random_cu_seqlens
from .test_parallel import check

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B, T, H, K, V", [(2, 2048, 16, 128, 128), (4, 1024, 8, 64, 64), (2, 777, 4, 100, 60)])
def test_matches_float64_reference(B, T, H, K, V, dtype):
    check(B, T, H, K, V, dtype, use_l2norm=dtype == torch.bfloat16, seed=T)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_varlen(dtype):
    lengths = [0, 1, 63, 64, 65, 700, 2048, 0, 1000]
    check(1, sum(lengths), 4, 128, 128, dtype, lengths=lengths, seed=11)


@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=str)
def test_head_size_256(dtype):
    # the smaller row and V blocks of the largest heads
    check(2, 512, 4, 256, 256, dtype, seed=13)


def test_keys_not_normalized_beta_up_to_2():
    check(2, 1024, 8, 128, 128, torch.float32, normalized_keys=False, beta_max=2.0, seed=17)


def test_deterministic():
    lengths = [300, 1, 1500]
    inp = make_inputs(1, sum(lengths), 8, 128, 128, torch.bfloat16, device="cuda", initial_state=True,
                      N=len(lengths), seed=19, requires_grad=True)
    cu = random_cu_seqlens(lengths, "cuda")
    do = torch.randn(1, sum(lengths), 8, 128, device="cuda", dtype=torch.bfloat16)
    dht = torch.randn(len(lengths), 8, 128, 128, device="cuda")

    def once():
        o, s, P = parallel_delta_rule(**inp, output_final_state=True, cu_seqlens=cu, output_attentions=True)
        grads = torch.autograd.grad((o, s), list(inp.values()), (do, dht))
        return (o, s, P, *grads)

    first, second = once(), once()
    for a, b in zip(first, second):
        assert torch.equal(a, b)
