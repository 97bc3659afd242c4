"""The head-first layout warning of the chunkwise entry points (deltatron/validation.py): it fires where a
[B, H, T, K] tensor is passed as [B, T, H, K] with more tokens than heads, is attributed to the caller's
line, and stays silent on single tokens, on the decoding form and in the DeltaNet layer's short prompts."""
import warnings

import pytest
import torch

from deltatron import chunk_delta_rule, fused_chunk_delta_rule, fused_recurrent_delta_rule, parallel_delta_rule
from deltatron.layers import DeltaNet, DeltaNetCache
from deltatron.validation import LayoutWarning

CHUNKWISE = [chunk_delta_rule, fused_chunk_delta_rule, parallel_delta_rule]


@pytest.fixture(autouse=True)
def torch_backend(monkeypatch):
    monkeypatch.setenv("DELTATRON_BACKEND", "torch")


def _inputs(B, T, H, K=8, V=8):
    return torch.randn(B, T, H, K), torch.randn(B, T, H, K), torch.randn(B, T, H, V), torch.rand(B, T, H)


@pytest.mark.parametrize("fn", CHUNKWISE)
def test_head_first_input_warns_at_the_callers_line(fn):
    # a user's head-first tensors: B = 2, T = 10 tokens, H = 4 heads, laid out [B, H, T, K] = [2, 4, 10, 8]
    q, k, v, beta = (x.transpose(1, 2) for x in _inputs(2, 10, 4))
    with pytest.warns(LayoutWarning) as record:
        fn(q, k, v, beta)
    assert len(record) == 1
    message = str(record[0].message)
    assert message.startswith(f"{fn.__name__}: q looks head-first [B, H, T, K]: deltatron expects [B, T, H, K]")
    assert "got [2, 4, 10, 8], that is T = 4 tokens < H = 10 heads" in message
    assert record[0].filename == __file__  # attributed to the line that called the entry point


@pytest.mark.parametrize("fn", CHUNKWISE + [fused_recurrent_delta_rule])
@pytest.mark.parametrize("B, T, H", [(2, 6, 4), (2, 4, 4), (3, 1, 16)])  # T > H, T = H, one token with 16 heads
def test_no_warning_for_the_expected_layout_or_a_single_token(fn, B, T, H):
    with warnings.catch_warnings():
        warnings.simplefilter("error", LayoutWarning)
        fn(*_inputs(B, T, H))


def test_the_decoding_form_does_not_warn_on_a_few_tokens_with_many_heads():
    # speculative decoding verifies a few tokens per call with any number of heads
    with warnings.catch_warnings():
        warnings.simplefilter("error", LayoutWarning)
        fused_recurrent_delta_rule(*_inputs(1, 3, 8))


@pytest.mark.parametrize("mode", ["chunk", "fused_recurrent"])
def test_the_layer_does_not_warn_on_a_prompt_shorter_than_its_heads(mode):
    layer = DeltaNet(hidden_size=64, num_heads=8, mode=mode, layer_idx=0)
    x = torch.randn(2, 3, 64)  # 3 tokens, 8 heads
    with warnings.catch_warnings():
        warnings.simplefilter("error", LayoutWarning)
        y = layer(x)
        cache = DeltaNetCache()
        layer(x, cache=cache)
        layer(torch.randn(2, 1, 64), cache=cache)
    assert y.shape == x.shape
