"""fused_recurrent_delta_rule on the GPU at realistic sizes (B*H up to 64, T up to 4096, K = V up to 256,
20 packed sequences), the decode step at the benchmark size (B=64, H=16, K=V=128) and decoding after a
chunk_delta_rule prefill. The oracle is the float64 recurrence (deltatron.reference.recurrent_delta_rule)
on the same inputs after rounding to the test dtype, with torch.autograd for the gradients."""
import pytest
import torch

from deltatron import chunk_delta_rule, fused_recurrent_delta_rule
from deltatron.reference import recurrent_delta_rule

from ..helpers import BOUNDS, assert_within_bounds, make_inputs, random_cu_seqlens, rel_rms

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch):
    monkeypatch.setenv("DELTATRON_BACKEND", "triton")


def run(fn, inp, cu_seqlens, use_l2norm, seed, grads=True):
    """o, final state and (with grads) the gradients of a random linear loss on o and the final state."""
    o, s = fn(inp["q"], inp["k"], inp["v"], inp["beta"], scale=inp["q"].shape[-1] ** -0.5,
              initial_state=inp.get("initial_state"), output_final_state=True, use_qk_l2norm_in_kernel=use_l2norm,
              cu_seqlens=cu_seqlens)
    out = {"o": o, "state": s}
    if grads:
        g = torch.Generator(device=o.device).manual_seed(seed)
        loss = (o.double() * torch.randn(o.shape, generator=g, dtype=torch.float64, device=o.device)).sum()
        loss = loss + (s.double() * torch.randn(s.shape, generator=g, dtype=torch.float64, device=o.device)).sum()
        names = list(inp)
        out.update({f"d{n}": x for n, x in zip(names, torch.autograd.grad(loss, [inp[n] for n in names]))})
    return out


def reference(q, k, v, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens):
    return recurrent_delta_rule(q, k, v, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                                cu_seqlens)


def check(B, T, H, K, V, dtype, lengths=None, use_l2norm=False, grads=True, seed=0):
    N = None if lengths is None else len(lengths)
    inp = make_inputs(B, T, H, K, V, dtype, device="cuda", initial_state=True, N=N, seed=seed,
                      requires_grad=grads)
    cu = None if lengths is None else random_cu_seqlens(lengths, "cuda")
    with torch.set_grad_enabled(grads):
        got = run(fused_recurrent_delta_rule, inp, cu, use_l2norm, seed, grads)
        rounded = {n: x.detach().double().requires_grad_(grads) for n, x in inp.items()}
        want = run(reference, rounded, cu, use_l2norm, seed, grads)
    assert_within_bounds(got, want, dtype)


@pytest.mark.parametrize("B, T, H, K, V, dtype, use_l2norm", [
    (4, 1024, 16, 128, 128, torch.bfloat16, True),
    (1, 4096, 16, 64, 64, torch.float32, False),
    (2, 512, 4, 256, 256, torch.float16, False),
    (2, 300, 8, 100, 60, torch.bfloat16, False),
], ids=str)
def test_forward_backward(B, T, H, K, V, dtype, use_l2norm):
    check(B, T, H, K, V, dtype, use_l2norm=use_l2norm, seed=T)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_long_forward(dtype):
    check(4, 4096, 16, 128, 128, dtype, grads=False, seed=1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_varlen_20_sequences(dtype):
    g = torch.Generator().manual_seed(2)
    lengths = [0, 1, 2, 63, 64, 65, 0] + torch.randint(1, 500, (13,), generator=g).tolist()
    check(1, sum(lengths), 8, 128, 128, dtype, lengths=lengths, use_l2norm=True, seed=2)


def test_backward_is_deterministic():
    inp = make_inputs(2, 512, 8, 128, 128, torch.bfloat16, device="cuda", initial_state=True, seed=3,
                      requires_grad=True)
    first, second = (run(fused_recurrent_delta_rule, inp, None, False, seed=3) for _ in range(2))
    for name in first:
        assert torch.equal(first[name], second[name]), name


def decode(inp, state, start, stop):
    """Feeds tokens start..stop-1 one at a time through the in-place step; returns o of those tokens."""
    outs = []
    for t in range(start, stop):
        o, s = fused_recurrent_delta_rule(inp["q"][:, t:t + 1], inp["k"][:, t:t + 1], inp["v"][:, t:t + 1],
                                          inp["beta"][:, t:t + 1], initial_state=state, inplace_final_state=True)
        assert s.data_ptr() == state.data_ptr()
        outs.append(o)
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_decode_benchmark_size(dtype):
    # the decode benchmark: B=64, H=16, K=V=128, fp32 state, a few steps in place
    B, T, H, K = 64, 4, 16, 128
    inp = make_inputs(B, T, H, K, K, dtype, device="cuda", initial_state=True, seed=4)
    with torch.no_grad():
        state = inp["initial_state"].clone()
        o_steps = decode(inp, state, 0, T)
        o_once, s_once = fused_recurrent_delta_rule(**inp, output_final_state=True)
        o_ref, s_ref = recurrent_delta_rule(**{n: x.double() for n, x in inp.items()}, scale=K ** -0.5,
                                            output_final_state=True)
    torch.testing.assert_close(state, s_once, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(o_steps, o_once, **({} if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)))
    assert rel_rms(o_steps, o_ref) <= BOUNDS[dtype]
    assert rel_rms(state, s_ref) <= BOUNDS[torch.float32]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_decode_after_chunk_prefill(dtype):
    # prefill T0 tokens with chunk_delta_rule, decode the rest in place: the same outputs and final state
    # as chunk_delta_rule over all the tokens, and both within the bounds of the float64 recurrence
    B, T0, T, H, K = 8, 200, 208, 16, 128
    inp = make_inputs(B, T, H, K, K, dtype, device="cuda", initial_state=True, seed=5)
    with torch.no_grad():
        prefill = {n: x[:, :T0] for n, x in inp.items() if n != "initial_state"}
        _, state = chunk_delta_rule(**prefill, initial_state=inp["initial_state"], output_final_state=True)
        o_decode = decode(inp, state, T0, T)
        o_chunk, s_chunk = chunk_delta_rule(**inp, output_final_state=True)
        o_ref, s_ref = recurrent_delta_rule(**{n: x.double() for n, x in inp.items()}, scale=K ** -0.5,
                                            output_final_state=True)
    assert rel_rms(o_decode, o_chunk[:, T0:]) <= BOUNDS[dtype]
    assert rel_rms(state, s_chunk) <= BOUNDS[dtype]
    assert rel_rms(o_decode, o_ref[:, T0:]) <= BOUNDS[dtype]
    assert rel_rms(state, s_ref) <= BOUNDS[dtype]
