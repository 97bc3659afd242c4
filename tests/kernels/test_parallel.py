"""parallel_delta_rule on the Triton backend (deltatron/kernels/parallel.py), through the public API.

o, the final state, the attention matrix P and all five gradients are checked against torch.autograd
through the float64 parallel reference run on the same inputs after rounding to the test dtype."""
import pytest
import torch

import deltatron.kernels.parallel as parallel
from deltatron import parallel_delta_rule
from deltatron.reference import parallel_delta_rule_reference

from ..helpers import DEVICE, INTERPRET, assert_within_bounds, make_inputs, random_cu_seqlens

pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not INTERPRET, reason="needs a GPU or TRITON_INTERPRET=1")


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch):
    monkeypatch.setenv("DELTATRON_BACKEND", "triton")


def run(fn, inp, lengths, output_final_state, use_l2norm, output_attentions, seed=0):
    """o, final state, P and the gradients of a random linear loss on o (and the final state)."""
    cu = None if lengths is None else random_cu_seqlens(lengths, inp["q"].device)
    o, s, *P = fn(inp["q"], inp["k"], inp["v"], inp["beta"], scale=0.3, initial_state=inp.get("initial_state"),
                  output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_l2norm, cu_seqlens=cu,
                  output_attentions=output_attentions)
    assert len(P) == output_attentions
    g = torch.Generator().manual_seed(seed)
    loss = (o.double() * torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.device)).sum()
    if output_final_state:
        loss = loss + (s.double() * torch.randn(s.shape, generator=g, dtype=torch.float64).to(s.device)).sum()
    names = list(inp)
    grads = torch.autograd.grad(loss, [inp[n] for n in names])
    out = {"o": o, **{f"d{n}": x for n, x in zip(names, grads)}}
    if output_final_state:
        out["state"] = s
    if output_attentions:
        out["P"] = P[0]
    return out


def reference(q, k, v, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
              output_attentions):
    return parallel_delta_rule_reference(q, k, v, beta, scale, initial_state, output_final_state,
                                         use_qk_l2norm_in_kernel, cu_seqlens, output_attentions)


def check(B, T, H, K, V, dtype, lengths=None, initial_state=True, output_final_state=True, use_l2norm=False,
          output_attentions=True, beta_dtype=None, seed=0, **input_kwargs):
    N = None if lengths is None else len(lengths)
    inp = make_inputs(B, T, H, K, V, dtype, device=DEVICE, initial_state=initial_state, N=N, seed=seed,
                      requires_grad=True, **input_kwargs)
    if beta_dtype is not None:
        inp["beta"] = inp["beta"].detach().to(beta_dtype).requires_grad_()
    flags = (output_final_state, use_l2norm, output_attentions, seed)
    got = run(parallel_delta_rule, inp, lengths, *flags)
    rounded = {n: x.detach().double().requires_grad_() for n, x in inp.items()}
    want = run(reference, rounded, lengths, *flags)
    assert got["o"].dtype == dtype and got["dbeta"].dtype == inp["beta"].dtype
    assert not output_attentions or got["P"].dtype == torch.float32
    assert got.keys() == want.keys()
    assert_within_bounds(got, want, dtype)


# T = 1, a partial block, one full block, two blocks (block size 64); K != V, sizes not powers of two
CASES = [
    # T, B, H, K, V, initial_state, use_l2norm
    (1, 2, 1, 40, 24, True, False),
    (15, 2, 1, 24, 40, False, True),
    (64, 1, 2, 24, 16, True, True),
    (100, 1, 2, 16, 40, True, False),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("T, B, H, K, V, initial_state, use_l2norm", CASES)
def test_matches_float64_reference(T, B, H, K, V, initial_state, use_l2norm, dtype):
    check(B, T, H, K, V, dtype, initial_state=initial_state, use_l2norm=use_l2norm, seed=T)


def test_without_final_state_and_attentions():
    check(1, 37, 2, 24, 24, torch.float32, output_final_state=False, output_attentions=False, seed=1)


def test_keys_not_normalized_beta_up_to_2():
    # the transitions I - beta k k^T are no longer contractions: the same function must come out
    check(1, 100, 1, 24, 40, torch.float32, normalized_keys=False, beta_max=2.0, seed=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_varlen(dtype, poison):
    lengths = [0, 1, 15, 0, 64, 17]
    # bf16 inputs with an fp32 beta (beta may have its own dtype)
    check(1, sum(lengths), 1, 24, 40, dtype, lengths=lengths, use_l2norm=dtype == torch.bfloat16,
          beta_dtype=torch.float32, seed=3)


@pytest.mark.parametrize("block", [16, 32])
def test_small_blocks(block, monkeypatch, poison):
    # more row blocks per sequence: the substitution loops run several steps deep
    monkeypatch.setattr(parallel, "block_size", lambda K: block)
    lengths = [block - 1, 3 * block + 5, block, block + 1]
    check(1, sum(lengths), 1, 24, 40, torch.float32, lengths=lengths, seed=block)
