"""The KimiDeltaAttention layer against transformers' Kimi Linear layer (KimiLinearDeltaAttention, its own PyTorch
code) on the same weights, forward and input gradients; its two modes against each other, varlen against
per-sequence runs, cache-based decoding against the full forward, its initialization and its error messages."""
import math

import pytest
import torch

from deltatron.layers import DeltaNetCache, KimiDeltaAttention

from .helpers import (check_every_gradient, check_grouped_equals_repeated_heads, check_hidden_states_errors,
                      check_varlen_prefill_then_steps, rel_rms)

D = 24  # hidden_size of the test layers


@pytest.fixture(autouse=True)
def torch_backend(monkeypatch):
    monkeypatch.setenv("DELTATRON_BACKEND", "torch")


def _layer(seed=0, **kwargs):
    torch.manual_seed(seed)
    layer = KimiDeltaAttention(**dict(dict(hidden_size=D, num_heads=2, head_dim=8, layer_idx=0), **kwargs))
    with torch.no_grad():
        # nonzero conv biases and norm weights, so that both are checked; decays in about (0.05, 1) per token and
        # channel rather than the initialization's, so that the state carries across many tokens
        layer.norm.weight.uniform_(0.5, 1.5)
        if layer.conv1d.bias is not None:
            layer.conv1d.bias.uniform_(-0.5, 0.5)
        layer.A_log.uniform_(-4.0, 0.0)
        layer.dt_bias.uniform_(-1.0, 1.0)
    return layer


def _kimi_linear_layer(layer):
    """transformers' KimiLinearDeltaAttention with layer's weights (q_proj, k_proj, v_proj: the row blocks of
    in_proj_qkv; conv1d [C, 1, W]; A_log [1, 1, H, 1])."""
    from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

    config = KimiLinearConfig(hidden_size=D, num_hidden_layers=1, rms_norm_eps=layer.norm.eps, linear_attn_config={
        "head_dim": layer.head_k_dim, "num_heads": layer.num_k_heads,
        "short_conv_kernel_size": layer.conv1d.kernel_size})
    theirs = KimiLinearDeltaAttention(config, 0)
    q, k, v = layer.in_proj_qkv.weight.split([layer.key_dim] * 3)
    state = {"q_proj.weight": q, "k_proj.weight": k, "v_proj.weight": v,
             "conv1d.weight": layer.conv1d.weight[:, None], "forget_gate.dt_bias": layer.dt_bias,
             "forget_gate.A_log": layer.A_log.view(1, 1, -1, 1), "o_norm.weight": layer.norm.weight,
             "o_proj.weight": layer.out_proj.weight}
    for name in ("f_a_proj", "f_b_proj"):
        state[f"forget_gate.{name}.weight"] = getattr(layer, name).weight
    for name in ("b_proj", "g_a_proj", "g_b_proj"):
        state[f"{name}.weight"] = getattr(layer, name).weight
    theirs.load_state_dict({n: t.detach().clone() for n, t in state.items()})
    return theirs


@pytest.mark.parametrize("mode", ["chunk", "fused_recurrent"])
def test_matches_kimi_linear(mode):
    pytest.importorskip("transformers")
    layer = _layer(mode=mode)
    theirs = _kimi_linear_layer(layer)
    x = torch.randn(2, 70, D, requires_grad=True)  # more than one chunk of 64
    y, y_ref = layer(x), theirs(x)
    w = torch.randn_like(y)
    dx, dx_ref = (torch.autograd.grad((out * w).sum(), x)[0] for out in (y, y_ref))
    assert rel_rms(y, y_ref) <= 1e-4 and rel_rms(dx, dx_ref) <= 1e-4


def test_modes_agree_across_chunks():
    chunk, recurrent = _layer(), _layer(mode="fused_recurrent")
    recurrent.load_state_dict(chunk.state_dict())
    x = torch.randn(1, 150, D, requires_grad=True)
    w = torch.randn(1, 150, D)
    results = []
    for layer in (chunk, recurrent):
        y = layer(x)
        results.append((y, *torch.autograd.grad((y * w).sum(), (x, *layer.parameters()))))
    for i, (got, want) in enumerate(zip(*results)):
        assert rel_rms(got, want) <= 1e-4, i


def test_grouped_value_heads_equal_repeated_key_heads():
    check_grouped_equals_repeated_heads(_layer(num_v_heads=4, conv_bias=True), _layer(num_heads=4, conv_bias=True),
                                        "in_proj_qkv", D)


@pytest.mark.parametrize("mode", ["chunk", "fused_recurrent"])
def test_cache_decoding_equals_full_forward(mode):
    layer = _layer(mode=mode, conv_bias=True)
    x = torch.randn(2, 9, D)
    full = layer(x)
    cache = DeltaNetCache()
    ys = [layer(x[:, :3], cache=cache)]
    state = cache[0].recurrent_state
    assert state.shape == (2, 2, 8, 8) and state.dtype == torch.float32
    ys += [layer(x[:, t:t + 1], cache=cache) for t in range(3, 9)]
    assert cache[0].recurrent_state is state  # decode steps update the state in place
    assert rel_rms(torch.cat(ys, dim=1), full) <= 1e-5


def test_varlen_prefill_then_steps_and_chunks():
    check_varlen_prefill_then_steps(_layer(conv_bias=True, allow_neg_eigval=True), D)


def test_shapes_gradients_and_initialization():
    torch.manual_seed(0)
    layer = KimiDeltaAttention(hidden_size=32, num_heads=2, head_dim=8, num_v_heads=4, head_v_dim=16)
    assert tuple(layer.in_proj_qkv.weight.shape) == (2 * 16 + 64, 32) and tuple(layer.dt_bias.shape) == (4 * 8,)
    assert tuple(layer.f_b_proj.weight.shape) == (32, 8) and tuple(layer.g_b_proj.weight.shape) == (64, 16)
    A = layer.A_log.exp()
    dt = torch.nn.functional.softplus(layer.dt_bias)  # Kimi Linear's init: dt log-uniform in [1e-3, 1e-1]
    assert ((A >= 1) & (A <= 16)).all() and ((dt > 1e-3 * (1 - 1e-4)) & (dt < 1e-1 * (1 + 1e-4))).all()
    assert math.isclose(layer.norm.eps, 1e-6) and layer.norm.activation == "sigmoid"
    check_every_gradient(layer, 32)


def test_errors():
    with pytest.raises(ValueError, match="num_v_heads = 3 must be a multiple of num_k_heads = 2"):
        KimiDeltaAttention(hidden_size=16, num_heads=2, head_dim=4, num_v_heads=3)
    with pytest.raises(ValueError, match="mode"):
        KimiDeltaAttention(hidden_size=16, num_heads=2, head_dim=4, mode="parallel")
    layer = KimiDeltaAttention(hidden_size=16, num_heads=2, head_dim=4)
    check_hidden_states_errors(layer, "KimiDeltaAttention")
