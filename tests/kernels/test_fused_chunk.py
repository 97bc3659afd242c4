"""fused_chunk_delta_rule on the Triton backend (deltatron/kernels/fused_chunk.py), through the public API.

o, the final state and dq, dk, dv, dbeta, dh0 are checked against torch.autograd through the float64
recurrence (deltatron.reference.recurrent_delta_rule) run on the same inputs after rounding to the test
dtype."""
import pytest
import torch

import deltatron.kernels.fused_chunk as fused_chunk
from deltatron import fused_chunk_delta_rule
from deltatron.kernels.utils import seq_info
from deltatron.reference import recurrent_delta_rule

from ..helpers import DEVICE, INTERPRET, assert_within_bounds, make_inputs, random_cu_seqlens

pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not INTERPRET, reason="needs a GPU or TRITON_INTERPRET=1")


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch):
    monkeypatch.setenv("DELTATRON_BACKEND", "triton")


def run(fn, inp, cu_seqlens, chunk_size, output_final_state, use_l2norm, seed):
    """o, final state and the gradients of every input under a random linear loss on o and the state."""
    kwargs = dict(chunk_size=chunk_size) if fn is fused_chunk_delta_rule else {}
    o, s = fn(inp["q"], inp["k"], inp["v"], inp["beta"], scale=0.3, initial_state=inp.get("initial_state"),
              output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_l2norm, cu_seqlens=cu_seqlens,
              **kwargs)
    g = torch.Generator().manual_seed(seed)
    loss = (o.double() * torch.randn(o.shape, generator=g, dtype=torch.float64)).sum()
    if output_final_state:
        loss = loss + (s.double() * torch.randn(s.shape, generator=g, dtype=torch.float64)).sum()
    else:
        assert s is None
    names = list(inp)
    out = {"o": o, **{f"d{n}": x for n, x in zip(names, torch.autograd.grad(loss, [inp[n] for n in names]))}}
    if output_final_state:
        out["state"] = s
    return out


def reference(q, k, v, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens):
    return recurrent_delta_rule(q, k, v, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                                cu_seqlens)


def check(B, T, H, K, V, dtype, chunk_size, lengths=None, initial_state=True, output_final_state=True,
          use_l2norm=False, seed=0, **input_kwargs):
    N = None if lengths is None else len(lengths)
    inp = make_inputs(B, T, H, K, V, dtype, device=DEVICE, initial_state=initial_state, N=N, seed=seed,
                      requires_grad=True, **input_kwargs)
    cu = None if lengths is None else random_cu_seqlens(lengths, DEVICE)
    got = run(fused_chunk_delta_rule, inp, cu, chunk_size, output_final_state, use_l2norm, seed)
    rounded = {n: x.detach().cpu().double().requires_grad_() for n, x in inp.items()}
    want = run(reference, rounded, None if cu is None else cu.cpu(), chunk_size, output_final_state, use_l2norm,
               seed)
    assert got["o"].dtype == dtype and got.keys() == want.keys()
    assert not output_final_state or got["state"].dtype == torch.float32
    assert_within_bounds(got, want, dtype)


# K != V, head sizes not powers of two, partial last chunks; every chunk size and dtype
CASES = [
    # T, B, H, K, V, chunk_size, initial_state, use_l2norm
    (1, 2, 1, 40, 24, 64, True, False),
    (63, 1, 2, 24, 16, 16, False, True),
    (64, 1, 1, 16, 40, 32, True, False),
    (65, 1, 1, 24, 32, 64, True, True),
    (130, 1, 1, 32, 24, 64, False, False),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("T, B, H, K, V, chunk_size, initial_state, use_l2norm", CASES)
def test_matches_float64_reference(T, B, H, K, V, chunk_size, initial_state, use_l2norm, dtype):
    check(B, T, H, K, V, dtype, chunk_size, initial_state=initial_state, use_l2norm=use_l2norm, seed=T)


def test_without_final_state():
    # no gradient flows into the final state (dht is None)
    check(1, 40, 2, 24, 24, torch.float32, 32, output_final_state=False, seed=1)


@pytest.mark.parametrize("dtype, chunk_size", [(torch.float32, 16), (torch.float16, 64)], ids=str)
def test_keys_not_normalized_beta_up_to_2(dtype, chunk_size):
    # the transitions I - beta k k^T are no longer contractions: the same function must come out
    check(1, 70, 1, 24, 40, dtype, chunk_size, normalized_keys=False, beta_max=2.0, seed=2)


@pytest.mark.parametrize("dtype, chunk_size", [(torch.float32, 16), (torch.bfloat16, 32)], ids=str)
def test_varlen(dtype, chunk_size, poison):
    # empty sequences (final state = initial state, dh0 = dht), a single token, C - 1, C, C + 1 tokens
    C = chunk_size
    lengths = [0, 1, C + 1, 0, C, C - 1]
    check(1, sum(lengths), 1, 24, 40, dtype, chunk_size, lengths=lengths, use_l2norm=dtype == torch.bfloat16,
          seed=3)


def test_several_v_blocks(poison):
    # K = 130 takes 256 state rows: V = 70 is split into V-blocks (the last one partial) forward and backward,
    # whose partial sums of dq, dk and dbeta must add up
    inp = make_inputs(1, 9, 1, 130, 70, torch.float32)
    info = seq_info(1, 9, torch.device(DEVICE), None, None)
    for backward in (False, True):
        assert fused_chunk._blocks(inp["q"], inp["v"], info, backward)[1] < 70
    check(1, 9, 1, 130, 70, torch.float32, 16, seed=4)


def test_backward_is_deterministic():
    inp = make_inputs(1, 40, 1, 24, 100, torch.bfloat16, device=DEVICE, initial_state=True, seed=5,
                      requires_grad=True)
    first, second = (run(fused_chunk_delta_rule, inp, None, 32, True, False, seed=5) for _ in range(2))
    for name in first:
        assert torch.equal(first[name], second[name]), name
