"""fused_chunk_delta_rule on the GPU at realistic sizes (B*H up to 64, T up to 8192, K = V in {64, 128, 256}
and a non-power-of-two head size, 20 packed sequences): o, the final state and all five gradients against
torch.autograd through the float64 chunkwise oracle (deltatron.reference.chunk_delta_rule_reference, itself
checked against the recurrence) on the same inputs after rounding to the test dtype; bitwise determinism."""
import pytest
import torch

from deltatron import fused_chunk_delta_rule
from deltatron.reference import chunk_delta_rule_reference

from ..helpers import assert_within_bounds, make_inputs, random_cu_seqlens

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch):
    monkeypatch.setenv("DELTATRON_BACKEND", "triton")


def run(fn, inp, cu_seqlens, chunk_size, use_l2norm, seed):
    """o, final state and the gradients of every input under a random linear loss on o and the state."""
    o, s = fn(inp["q"], inp["k"], inp["v"], inp["beta"], inp["q"].shape[-1] ** -0.5, inp["initial_state"], True,
              use_l2norm, cu_seqlens, chunk_size=chunk_size)
    g = torch.Generator(device="cuda").manual_seed(seed)
    loss = (o.double() * torch.randn(o.shape, generator=g, dtype=torch.float64, device="cuda")).sum()
    loss = loss + (s.double() * torch.randn(s.shape, generator=g, dtype=torch.float64, device="cuda")).sum()
    names = list(inp)
    return {"o": o, "state": s,
            **{f"d{n}": x for n, x in zip(names, torch.autograd.grad(loss, [inp[n] for n in names]))}}


def check(B, T, H, K, V, dtype, chunk_size, lengths=None, use_l2norm=False, seed=0, **input_kwargs):
    N = None if lengths is None else len(lengths)
    inp = make_inputs(B, T, H, K, V, dtype, device="cuda", initial_state=True, N=N, seed=seed,
                      requires_grad=True, **input_kwargs)
    cu = None if lengths is None else random_cu_seqlens(lengths, "cuda")
    got = run(fused_chunk_delta_rule, inp, cu, chunk_size, use_l2norm, seed)
    rounded = {n: x.detach().double().requires_grad_() for n, x in inp.items()}
    want = run(chunk_delta_rule_reference, rounded, cu, chunk_size, use_l2norm, seed)
    assert_within_bounds(got, want, dtype)


@pytest.mark.parametrize("B, T, H, K, V, dtype, chunk_size, use_l2norm", [
    (2, 4096, 16, 128, 128, torch.float32, 64, True),
    (2, 4096, 16, 128, 128, torch.bfloat16, 64, True),
    (4, 2048, 16, 64, 64, torch.float32, 32, False),
    (4, 2048, 16, 64, 64, torch.bfloat16, 64, False),
    (4, 2048, 16, 64, 64, torch.float16, 32, False),
    (1, 8192, 8, 128, 128, torch.float32, 64, False),
    (1, 8192, 8, 128, 128, torch.bfloat16, 64, False),
    (2, 1024, 4, 256, 256, torch.float32, 64, False),
    (2, 1024, 4, 256, 256, torch.bfloat16, 64, False),
    (2, 777, 4, 100, 60, torch.float32, 16, True),
    (2, 777, 4, 100, 60, torch.bfloat16, 16, True),
    (2, 777, 4, 100, 60, torch.float16, 64, True),
], ids=str)
def test_matches_float64_reference(B, T, H, K, V, dtype, chunk_size, use_l2norm):
    check(B, T, H, K, V, dtype, chunk_size, use_l2norm=use_l2norm, seed=T)


# bf16 at T = 100: with growing states its error grows with T (README, "Accuracy")
@pytest.mark.parametrize("dtype, T", [(torch.float32, 2048), (torch.bfloat16, 100)], ids=str)
def test_keys_not_normalized_beta_up_to_2(dtype, T):
    # the transitions are no longer contractions: the same function must come out
    check(2, T, 8, 128, 128, dtype, 64, normalized_keys=False, beta_max=2.0, seed=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_varlen_20_sequences(dtype):
    g = torch.Generator().manual_seed(2)
    lengths = [0, 1, 2, 63, 64, 65, 0] + torch.randint(1, 1500, (13,), generator=g).tolist()
    check(1, sum(lengths), 8, 128, 128, dtype, 64, lengths=lengths, use_l2norm=True, seed=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_backward_is_deterministic(dtype):
    # K = V = 128: several V-blocks backward, whose partial dq, dk, dbeta are summed
    inp = make_inputs(2, 2048, 8, 128, 128, dtype, device="cuda", initial_state=True, seed=3,
                      requires_grad=True)
    first, second = (run(fused_chunk_delta_rule, inp, None, 64, False, seed=3) for _ in range(2))
    for name in first:
        assert torch.equal(first[name], second[name]), name
