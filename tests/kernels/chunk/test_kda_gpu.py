"""KDA's chunkwise inference forward at realistic sizes on the GPU (marked gpu): bf16 with K = V = 128 and 4096 tokens,
grouped value heads, strong gates, both walks, 20 packed sequences with empty ones; against the float64 recurrence as
tests/kernels/chunk/test_kda.py does on the CPU."""
import pytest
import torch

from deltatron.kernels.chunk import plan

from ...helpers import twenty_lengths
from .test_kda import WALKS, check

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("forced", WALKS, ids=str)
@pytest.mark.parametrize("gates", ["soft", "strong"])
def test_4096_tokens_grouped_heads(forced, gates):
    with plan.overrides(**forced):
        check(1, 4096, 2, 4, 128, 128, torch.bfloat16, 64, gates=gates, seed=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_half_the_channels_strong(dtype):
    gen = torch.Generator().manual_seed(2)
    g = -20 * torch.rand(2, 1000, 4, 128, generator=gen)
    g[..., 1::2] = -1e-3 * torch.rand(2, 1000, 4, 64, generator=gen)
    check(2, 1000, 2, 4, 128, 128, dtype, 64, g=g, seed=3)


@pytest.mark.parametrize("C", [16, 32, 64])
def test_varlen_20_sequences(C):
    lengths = twenty_lengths(700)
    check(1, sum(lengths), 2, 4, 128, 128, torch.bfloat16, C, lengths=lengths, gates="strong", seed=4)
