"""KDA's chunkwise kernels at realistic sizes on the GPU (marked gpu): the inference forward and the training forward
and backward, bf16 with K = V = 128 and 4096 tokens, grouped value heads, strong gates, both walks, 20 packed
sequences with empty ones, K = V = 64 and 256, a bitwise-deterministic backward; against the float64 recurrence (its
chunkwise form's autograd for the gradients, as tests/helpers.gated_oracle takes it on a GPU) as
tests/kernels/chunk/test_kda.py does on the CPU."""
import pytest
import torch

from deltatron.kernels import chunk
from deltatron.kernels.chunk import plan

from ...helpers import check_gated_backward_deterministic, half_strong_gate, twenty_lengths
from .test_kda import WALKS, check, check_training

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("forced", WALKS, ids=str)
@pytest.mark.parametrize("gates", ["soft", "strong"])
def test_4096_tokens_grouped_heads(forced, gates):
    with plan.overrides(**forced):
        check(1, 4096, 2, 4, 128, 128, torch.bfloat16, 64, gates=gates, seed=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_half_the_channels_strong(dtype):
    g = half_strong_gate(2, 1000, 4, 128, seed=2)
    check(2, 1000, 2, 4, 128, 128, dtype, 64, g=g, seed=3)


@pytest.mark.parametrize("C", [16, 32, 64])
def test_varlen_20_sequences(C):
    lengths = twenty_lengths(700)
    check(1, sum(lengths), 2, 4, 128, 128, torch.bfloat16, C, lengths=lengths, gates="strong", seed=4)


@pytest.mark.parametrize("forced", WALKS, ids=str)
@pytest.mark.parametrize("gates", ["soft", "strong"])
def test_backward_4096_tokens_grouped_heads(forced, gates):
    with plan.overrides(**forced):
        check_training(1, 4096, 2, 4, 128, 128, torch.bfloat16, gates=gates, seed=5, chunk_size=64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_backward_half_the_channels_strong(dtype):
    g = half_strong_gate(2, 1000, 4, 128, seed=6)
    check_training(2, 1000, 2, 4, 128, 128, dtype, g=g, seed=7, chunk_size=64)


def test_backward_strongest_gates_head_size_64():
    g = -19 - torch.rand(2, 700, 4, 64, generator=torch.Generator().manual_seed(8))
    check_training(2, 700, 4, 4, 64, 64, torch.float32, g=g, seed=9, chunk_size=64)


@pytest.mark.parametrize("C", [16, 32, 64])
def test_backward_varlen_20_sequences(C):
    lengths = twenty_lengths(700)
    check_training(1, sum(lengths), 2, 4, 128, 128, torch.bfloat16, lengths=lengths, gates="strong", seed=10,
                   chunk_size=C)


# K = V = 256 and K 256 / V 192 (the largest head sizes; the reverse pass at BV 32 and 229,376 B of shared memory in
# bf16, wy_bwd spilling in fp32: DESIGN.md §12), called on the chunk kernels directly, on GPUs whose blocks can have
# that shared memory (elsewhere chunk_kda runs fused_recurrent there: tests/test_api_gated.py)
needs_large_head_memory = pytest.mark.skipif(
    torch.cuda.is_available()
    and plan.kda_chunk_refusal(256, 256, plan.device_capabilities(torch.device("cuda"))) is not None,
    reason="this GPU's shared memory does not hold KDA's chunk kernels at K = 256")


@needs_large_head_memory
@pytest.mark.parametrize("V, dtype", [(256, torch.bfloat16), (256, torch.float32), (192, torch.float16)], ids=str)
def test_head_size_256(V, dtype):
    check(1, 1000, 2, 2, 256, V, dtype, 64, gates="strong", seed=11)


@needs_large_head_memory
@pytest.mark.parametrize("V, dtype", [(256, torch.bfloat16), (256, torch.float32), (192, torch.float16)], ids=str)
def test_backward_head_size_256(V, dtype):
    check_training(1, 1000, 2, 2, 256, V, dtype, gates="strong", seed=12, chunk_size=64)


def test_backward_is_deterministic():
    # every gradient the same bits on a second call: each output element written by one program, dg's partial sums
    # over V-blocks added in a fixed order (DESIGN.md §12)
    check_gated_backward_deterministic(chunk, 2, 2048, 4, 8, 128, 128, torch.bfloat16, seed=8, per_channel=True)
