"""The GatedDeltaNet layer against a plain PyTorch reimplementation (token-by-token gated recurrence on the layer's
own weights, forward and gradients), its two modes against each other, varlen against per-sequence runs, cache-based
decoding against the full forward, grouped value heads against repeated key heads, and its error messages."""
import re

import pytest
import torch
import torch.nn.functional as F

from deltatron.layers import DeltaNetCache, GatedDeltaNet

from .helpers import (check_every_gradient, check_grouped_equals_repeated_heads, check_hidden_states_errors,
                      check_varlen_prefill_then_steps, plain_causal_conv, random_cu_seqlens, rel_rms)

D = 24  # hidden_size of the test layers


@pytest.fixture(autouse=True)
def torch_backend(monkeypatch):
    monkeypatch.setenv("DELTATRON_BACKEND", "torch")


def _layer(seed=0, **kwargs):
    torch.manual_seed(seed)
    kwargs = dict(dict(hidden_size=D, num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=6, layer_idx=0), **kwargs)
    layer = GatedDeltaNet(**kwargs)
    with torch.no_grad():
        # nonzero conv biases and norm weights, so that both are checked; decays in (0.02, 1) per token rather than
        # the initialization's mostly-forgetting ones, so that the state carries across many tokens
        layer.norm.weight.uniform_(0.5, 1.5)
        if layer.conv1d.bias is not None:
            layer.conv1d.bias.uniform_(-0.5, 0.5)
        layer.A_log.uniform_(-4.0, 0.0)
        layer.dt_bias.uniform_(-1.0, 1.0)
    return layer


def _plain_layer(layer, x):
    """The layer on one sequence x [T, D], written out: projections, conv over [q | k | v], L2 norm of q and k,
    beta = sigmoid(b) (x 2), g = -exp(A_log) softplus(a + dt_bias), per value head h (key head h // (Hv / Hk)):
    S <- exp(g_t) S, S += beta_t k_t (v_t - S^T k_t)^T, o_t = K^-1/2 S^T q_t; gated RMSNorm, out_proj.
    Functional (no in-place updates), so that autograd runs through it."""
    Hk, Hv, K, V = layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    kd, vd = layer.key_dim, layer.value_dim
    T = x.shape[0]
    W = layer.in_proj_qkvz.weight
    q, k, v, z = x @ W[:kd].T, x @ W[kd:2 * kd].T, x @ W[2 * kd:2 * kd + vd].T, x @ W[2 * kd + vd:].T
    Wba = layer.in_proj_ba.weight
    b, a = x @ Wba[:Hv].T, x @ Wba[Hv:].T
    qkv = plain_causal_conv(torch.cat([q, k, v], dim=-1), layer.conv1d)
    q, k, v = qkv[:, :kd].view(T, Hk, K), qkv[:, kd:2 * kd].view(T, Hk, K), qkv[:, 2 * kd:].view(T, Hv, V)
    q = q / (q.square().sum(-1, keepdim=True) + 1e-6).sqrt()
    k = k / (k.square().sum(-1, keepdim=True) + 1e-6).sqrt()
    beta = torch.sigmoid(b) * (2.0 if layer.allow_neg_eigval else 1.0)
    g = -torch.exp(layer.A_log) * F.softplus(a + layer.dt_bias)
    group = Hv // Hk
    S = [torch.zeros(K, V, dtype=x.dtype) for _ in range(Hv)]
    outs = []
    for t in range(T):
        o_t = []
        for h in range(Hv):
            qh, kh = q[t, h // group], k[t, h // group]
            s = torch.exp(g[t, h]) * S[h]
            S[h] = s + torch.outer(kh, beta[t, h] * (v[t, h] - s.T @ kh))
            o_t.append(K ** -0.5 * S[h].T @ qh)
        outs.append(torch.stack(o_t))
    o = torch.stack(outs)  # [T, Hv, V]
    o = o / (o.square().mean(-1, keepdim=True) + layer.norm.eps).sqrt() * layer.norm.weight
    o = o * F.silu(z.view(T, Hv, V))
    return o.reshape(T, vd) @ layer.out_proj.weight.T


def _grads(y, w, *inputs):
    return torch.autograd.grad((y * w).sum(), inputs)


@pytest.mark.parametrize("kwargs", [
    dict(),
    dict(mode="fused_recurrent", conv_bias=True),
    dict(allow_neg_eigval=True, conv_bias=True),
    dict(num_k_heads=3, num_v_heads=3, head_k_dim=4, head_v_dim=8, conv_size=2),
])
def test_matches_plain_reimplementation(kwargs):
    layer = _layer(**kwargs)
    x = torch.randn(2, 13, D, requires_grad=True)
    y = layer(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    w = torch.randn_like(y)
    gx, gA, gdt = _grads(y, w, x, layer.A_log, layer.dt_bias)
    ref = torch.stack([_plain_layer(layer, x[b]) for b in range(2)])
    rx, rA, rdt = _grads(ref, w, x, layer.A_log, layer.dt_bias)
    for name, got, want in [("y", y, ref), ("dx", gx, rx), ("dA_log", gA, rA), ("ddt_bias", gdt, rdt)]:
        assert rel_rms(got, want) <= 1e-4, name


def test_modes_agree_across_chunks():
    """chunk (T = 150: three chunks of 64) and fused_recurrent, forward and every parameter's gradient."""
    chunk, recurrent = _layer(), _layer(mode="fused_recurrent")
    recurrent.load_state_dict(chunk.state_dict())
    x = torch.randn(1, 150, D, requires_grad=True)
    w = torch.randn(1, 150, D)
    results = []
    for layer in (chunk, recurrent):
        y = layer(x)
        results.append((y, *_grads(y, w, x, *layer.parameters())))
    for i, (got, want) in enumerate(zip(*results)):
        assert rel_rms(got, want) <= 1e-4, i


def test_shapes_gradients_and_initialization():
    torch.manual_seed(0)
    layer = GatedDeltaNet(hidden_size=32, num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=16)
    assert (layer.key_dim, layer.value_dim) == (16, 64)
    assert tuple(layer.in_proj_qkvz.weight.shape) == (2 * 16 + 2 * 64, 32)
    assert tuple(layer.in_proj_ba.weight.shape) == (8, 32) and layer.conv1d.channels == 2 * 16 + 64
    A = layer.A_log.exp()
    assert ((A > 0) & (A < 16)).all() and torch.equal(layer.dt_bias, torch.ones(4))  # Qwen3-Next's init
    check_every_gradient(layer, 32)


def test_grouped_value_heads_equal_repeated_key_heads():
    """Hk = 2, Hv = 4 against Hk = Hv = 4 whose q and k projections (and conv channels) repeat each key head
    for its two value heads: value head h reads key head h // 2."""
    check_grouped_equals_repeated_heads(_layer(conv_bias=True), _layer(conv_bias=True, num_k_heads=4), "in_proj_qkvz",
                                        D)


@pytest.mark.parametrize("mode", ["chunk", "fused_recurrent"])
def test_varlen_equals_per_sequence(mode):
    layer = _layer(mode=mode, conv_bias=True)
    lengths = [5, 0, 1, 3, 17, 2]
    cu = random_cu_seqlens(lengths)
    x = torch.randn(1, sum(lengths), D, requires_grad=True)
    y = layer(x, cu_seqlens=cu)
    w = torch.randn_like(y)
    gx, gA, gdt = _grads(y, w, x, layer.A_log, layer.dt_bias)
    ref_y, ref_gx = torch.zeros_like(y), torch.zeros_like(x)
    ref_gA, ref_gdt = torch.zeros_like(gA), torch.zeros_like(gdt)
    for bos, eos in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if bos == eos:
            continue
        xs = x[:, bos:eos].detach().requires_grad_()
        ys = layer(xs)
        gs, gAs, gdts = _grads(ys, w[:, bos:eos], xs, layer.A_log, layer.dt_bias)
        ref_y[:, bos:eos], ref_gx[:, bos:eos] = ys.detach(), gs
        ref_gA += gAs
        ref_gdt += gdts
    for name, got, want in [("y", y, ref_y), ("dx", gx, ref_gx), ("dA_log", gA, ref_gA), ("ddt_bias", gdt, ref_gdt)]:
        assert rel_rms(got, want) <= 1e-5, name


@pytest.mark.parametrize("mode", ["chunk", "fused_recurrent"])
def test_cache_decoding_equals_full_forward(mode):
    layer = _layer(mode=mode, conv_bias=True)
    x = torch.randn(2, 12, D)
    full = layer(x)
    for prefill in (1, 2, 5):  # shorter than the conv window too
        cache = DeltaNetCache()
        ys = [layer(x[:, :prefill], cache=cache)]
        state = cache[0].recurrent_state
        assert state.shape == (2, 4, 8, 6) and state.dtype == torch.float32
        assert len(cache[0].conv_state) == 1 and cache[0].conv_state[0].shape == (2, 3, 2 * 16 + 24)
        for t in range(prefill, 12):
            ys.append(layer(x[:, t:t + 1], cache=cache))
        assert cache[0].recurrent_state is state  # decode steps update the state in place
        assert not any(y.requires_grad for y in ys)
        assert rel_rms(torch.cat(ys, dim=1), full) <= 1e-5


def test_varlen_prefill_then_steps_and_chunks():
    layer = _layer(conv_bias=True, allow_neg_eigval=True)
    check_varlen_prefill_then_steps(layer, D)


def test_errors():
    with pytest.raises(ValueError, match="mode"):
        GatedDeltaNet(hidden_size=16, num_k_heads=2, num_v_heads=2, head_k_dim=4, head_v_dim=4, mode="parallel")
    with pytest.raises(ValueError, match=re.escape("num_v_heads = 3 must be a multiple of num_k_heads = 2")):
        GatedDeltaNet(hidden_size=16, num_k_heads=2, num_v_heads=3, head_k_dim=4, head_v_dim=4)
    with pytest.raises(ValueError, match="must be positive"):
        GatedDeltaNet(hidden_size=16, num_k_heads=2, num_v_heads=2, head_k_dim=0, head_v_dim=4)
    with pytest.raises(TypeError, match="allow_neg_eigval must be a bool"):
        GatedDeltaNet(hidden_size=16, num_k_heads=2, num_v_heads=2, head_k_dim=4, head_v_dim=4, allow_neg_eigval=1)
    layer = GatedDeltaNet(hidden_size=16, num_k_heads=2, num_v_heads=4, head_k_dim=4, head_v_dim=4)
    with pytest.raises(ValueError, match="layer_idx"):
        layer(torch.randn(1, 3, 16), cache=DeltaNetCache())
    check_hidden_states_errors(layer, "GatedDeltaNet")
    assert "num_k_heads=2, num_v_heads=4" in repr(layer)
