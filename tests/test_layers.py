"""The DeltaNet layer against a plain PyTorch reimplementation (token-by-token recurrence on the
projections), varlen against per-sequence runs, cache-based decoding against the full forward."""
import pytest
import torch
import torch.nn.functional as F

from deltatron.layers import DeltaNet, DeltaNetCache, GatedRMSNorm, ShortConvolution

from .helpers import (check_every_gradient, check_hidden_states_errors, check_varlen_prefill_then_steps,
                      plain_causal_conv, random_cu_seqlens, rel_rms)


@pytest.fixture(autouse=True)
def torch_backend(monkeypatch):
    monkeypatch.setenv("DELTATRON_BACKEND", "torch")


def _layer(seed=0, dtype=torch.float32, **kwargs):
    torch.manual_seed(seed)
    kwargs = dict(dict(hidden_size=24, num_heads=2, layer_idx=0), **kwargs)
    layer = DeltaNet(**kwargs).to(dtype)
    with torch.no_grad():  # nonzero conv biases and norm weights, so that both are checked
        for p in layer.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return layer


def _plain_layer(layer, x):
    """The layer on one sequence x [T, D], written out: projections, conv, SiLU, L2 norm, the recurrence
    S_t = S_{t-1} + beta_t k_t (v_t - S_{t-1}^T k_t)^T, o_t = K^-1/2 S_t^T q_t, gated RMSNorm, output."""
    H, K, V = layer.num_heads, layer.head_k_dim, layer.head_v_dim
    q, k, v = x @ layer.q_proj.weight.T, x @ layer.k_proj.weight.T, x @ layer.v_proj.weight.T
    if layer.use_short_conv:
        q, k, v = plain_causal_conv(q, layer.q_conv1d), plain_causal_conv(k, layer.k_conv1d), plain_causal_conv(v, layer.v_conv1d)
    else:
        q, k, v = F.silu(q), F.silu(k), F.silu(v)
    q, k, v = q.view(-1, H, K), k.view(-1, H, K), v.view(-1, H, V)
    q = q / (q.square().sum(-1, keepdim=True) + 1e-6).sqrt()
    k = k / (k.square().sum(-1, keepdim=True) + 1e-6).sqrt()
    beta = torch.sigmoid(x @ layer.b_proj.weight.T) if layer.use_beta else torch.ones(x.shape[0], H, dtype=x.dtype)
    S = torch.zeros(H, K, V, dtype=x.dtype)
    outs = []
    for t in range(x.shape[0]):
        for h in range(H):
            v_new = beta[t, h] * (v[t, h] - S[h].T @ k[t, h])
            S[h] = S[h] + torch.outer(k[t, h], v_new)
        outs.append(torch.stack([K ** -0.5 * S[h].T @ q[t, h] for h in range(H)]))
    o = torch.stack(outs)  # [T, H, V]
    o = o / (o.square().mean(-1, keepdim=True) + layer.o_norm.eps).sqrt() * layer.o_norm.weight
    if layer.use_gate:
        o = o * F.silu((x @ layer.g_proj.weight.T).view(-1, H, V))
    return o.reshape(x.shape[0], H * V) @ layer.o_proj.weight.T


@pytest.mark.parametrize("kwargs", [
    dict(),
    dict(mode="fused_recurrent", conv_bias=True),
    dict(use_short_conv=False, use_gate=False),
    dict(head_dim=8, expand_v=1.5, num_heads=3, use_beta=False),
])
def test_matches_plain_reimplementation(kwargs):
    layer = _layer(dtype=torch.float64, **kwargs)
    x = torch.randn(2, 13, 24, dtype=torch.float64)
    y = layer(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    for b in range(2):
        assert rel_rms(y[b], _plain_layer(layer, x[b])) <= 1e-10


def test_shapes_and_gradients():
    layer = _layer(hidden_size=32, num_heads=4, expand_k=0.5, expand_v=2.0)
    assert (layer.head_k_dim, layer.head_v_dim) == (4, 16)
    check_every_gradient(layer, 32)


@pytest.mark.parametrize("mode", ["chunk", "fused_recurrent"])
def test_varlen_equals_per_sequence(mode):
    layer = _layer(mode=mode, conv_bias=True)
    lengths = [5, 0, 1, 3, 17, 2]
    cu = random_cu_seqlens(lengths)
    x = torch.randn(1, sum(lengths), 24, requires_grad=True)
    y = layer(x, cu_seqlens=cu)
    w = torch.randn_like(y)
    (gx,) = torch.autograd.grad((y * w).sum(), x)
    for bos, eos in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if bos == eos:
            continue
        xs = x[:, bos:eos].detach().requires_grad_()
        ys = layer(xs)
        (gs,) = torch.autograd.grad((ys * w[:, bos:eos]).sum(), xs)
        assert rel_rms(y[:, bos:eos], ys) <= 1e-5
        assert rel_rms(gx[:, bos:eos], gs) <= 1e-5


def test_cache_decoding_equals_full_forward():
    layer = _layer(conv_bias=True)
    x = torch.randn(2, 12, 24)
    full = layer(x)
    for prefill in (1, 2, 5):  # shorter than the conv window too
        cache = DeltaNetCache()
        ys = [layer(x[:, :prefill], cache=cache)]
        state = cache[0].recurrent_state
        for t in range(prefill, 12):
            ys.append(layer(x[:, t:t + 1], cache=cache))
        assert cache[0].recurrent_state is state  # decode steps update the state in place
        assert not any(y.requires_grad for y in ys)
        assert rel_rms(torch.cat(ys, dim=1), full) <= 1e-5


def test_varlen_prefill_then_steps_and_chunks():
    layer = _layer(conv_bias=True)
    check_varlen_prefill_then_steps(layer, 24)


def test_short_convolution_matches_conv1d_and_carries_state():
    torch.manual_seed(0)
    conv = ShortConvolution(6, kernel_size=4, bias=True, activation=None)
    x = torch.randn(2, 11, 6)
    ref = F.conv1d(F.pad(x.transpose(1, 2), (3, 0)), conv.weight[:, None], conv.bias, groups=6).transpose(1, 2)
    y, state = conv(x, output_state=True)
    assert rel_rms(y, ref) <= 1e-6
    assert torch.equal(state, x[:, -3:])
    y1, s1 = conv(x[:, :2], output_state=True)  # shorter than the window: the state keeps zeros
    assert torch.equal(s1[:, 0], torch.zeros(2, 6)) and torch.equal(s1[:, 1:], x[:, :2])
    y2, s2 = conv(x[:, 2:], state=s1, output_state=True)
    assert rel_rms(torch.cat([y1, y2], dim=1), ref) <= 1e-6
    assert torch.equal(s2, state)


def test_gated_rmsnorm_keeps_dtype():
    norm = GatedRMSNorm(8)
    x, g = torch.randn(3, 8, dtype=torch.bfloat16), torch.randn(3, 8, dtype=torch.bfloat16)
    y = norm(x, g)
    ref = x.float() * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + 1e-5) * F.silu(g.float())
    assert y.dtype == torch.bfloat16 and rel_rms(y, ref) <= 1e-2


def test_errors():
    with pytest.raises(ValueError, match="mode"):
        DeltaNet(hidden_size=16, num_heads=2, mode="parallel")
    with pytest.raises(ValueError, match="divisible by num_heads"):
        DeltaNet(hidden_size=16, num_heads=3)
    with pytest.raises(ValueError, match="layer_idx"):
        DeltaNet(hidden_size=16, num_heads=2)(torch.randn(1, 3, 16), cache=DeltaNetCache())
    with pytest.raises(TypeError, match="save_states must be a bool"):
        DeltaNet(hidden_size=16, num_heads=2, save_states=1)
    layer = DeltaNet(hidden_size=16, num_heads=2)
    check_hidden_states_errors(layer, "DeltaNet")
    conv = ShortConvolution(4)
    with pytest.raises(ValueError, match="conv state"):
        conv(torch.randn(2, 3, 4), state=torch.zeros(2, 4, 4))


@pytest.mark.parametrize("save_states", [False, True])
def test_triton_backend_matches_torch(monkeypatch, save_states):
    """The same layer through the Triton kernels (Triton's interpreter here): chunk forward, backward, and a
    decode step through the fused_recurrent kernel's in-place state update; save_states reaches chunk_delta_rule."""
    pytest.importorskip("triton")  # without CUDA, conftest has set TRITON_INTERPRET=1
    device = "cuda" if torch.cuda.is_available() else "cpu"
    layer = _layer(hidden_size=32, num_heads=2, save_states=save_states).to(device)
    assert f"save_states={save_states}" in repr(layer)
    x = torch.randn(1, 20, 32, device=device, requires_grad=True)
    results = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("DELTATRON_BACKEND", backend)
        y = layer(x)
        (gx,) = torch.autograd.grad(y.square().sum(), x)
        cache = DeltaNetCache()
        layer(x[:, :19].detach(), cache=cache)
        step = layer(x[:, 19:].detach(), cache=cache)
        results[backend] = (y, gx, step)
    for got, ref in zip(results["triton"], results["torch"]):
        assert rel_rms(got, ref) <= 1e-4
