"""The gated chunk form at realistic sizes on the GPU (marked gpu): dtypes, head sizes up to 256, grouped value heads,
strong gates, 20 packed sequences with empty ones, 65536 tokens, chunk sizes, and a bitwise-deterministic backward;
against the float64 recurrence with torch.autograd, as tests/kernels/chunk/test_gated.py does on the CPU."""
import pytest
import torch

from deltatron.kernels import chunk

from ...helpers import check_gated_backward_deterministic, twenty_lengths
from .test_gated import check

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("B, T, Hk, Hv, K, V, dtype, gates, C", [
    (2, 1024, 4, 8, 128, 128, torch.bfloat16, "soft", 64),
    (2, 1024, 8, 8, 128, 128, torch.float16, "soft", 64),
    (1, 2048, 2, 4, 64, 64, torch.float32, "strong", 64),
    (2, 300, 2, 6, 100, 60, torch.float16, "soft", 32),
    (1, 777, 2, 4, 256, 256, torch.bfloat16, "strong", 64),
    (1, 513, 1, 3, 128, 128, torch.float32, "soft", 16),
], ids=str)
def test_forward_backward(B, T, Hk, Hv, K, V, dtype, gates, C):
    check(B, T, Hk, Hv, K, V, dtype, gates=gates, seed=T, chunk_size=C)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_varlen_20_sequences(dtype):
    lengths = twenty_lengths(700)
    check(1, sum(lengths), 2, 4, 128, 128, dtype, lengths=lengths, gates="strong", seed=2)


def test_65536_tokens():
    check(1, 65536, 1, 2, 128, 128, torch.bfloat16, seed=5)


def test_backward_is_deterministic():
    check_gated_backward_deterministic(chunk, 2, 2048, 4, 8, 128, 128, torch.bfloat16, seed=3)
