"""The Triton backend's autograd wiring: inference runs the form directly (no graph, same numbers)."""
import pytest
import torch

from deltatron import chunk_delta_rule

from ..helpers import DEVICE, INTERPRET, make_inputs

pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not INTERPRET, reason="needs a GPU or TRITON_INTERPRET=1")


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch):
    monkeypatch.setenv("DELTATRON_BACKEND", "triton")


@pytest.mark.parametrize("use_l2norm", [False, True])
def test_inference_path_equals_training_path(use_l2norm):
    inp = make_inputs(1, 20, 2, 16, 16, torch.float32, device=DEVICE, initial_state=True, seed=4,
                      normalized_keys=not use_l2norm)
    with torch.no_grad():
        o_inf, s_inf = chunk_delta_rule(**inp, output_final_state=True, use_qk_l2norm_in_kernel=use_l2norm,
                                        chunk_size=16)
    assert o_inf.grad_fn is None
    train = {n: x.clone().requires_grad_() for n, x in inp.items()}
    o, s = chunk_delta_rule(**train, output_final_state=True, use_qk_l2norm_in_kernel=use_l2norm, chunk_size=16)
    assert o.grad_fn is not None
    assert torch.equal(o_inf, o.detach()) and torch.equal(s_inf, s.detach())


def test_backward_casts_only_where_the_dtype_differs():
    # DeltaRuleFunction.backward returns the form's gradients in the inputs' dtypes: a gradient already in its
    # input's dtype comes back as the form's own tensor (no .to() call), another cast (dbeta: fp32 from the kernels)
    from deltatron.autograd import DeltaRuleFunction

    bf16 = torch.bfloat16
    q, k, v = (torch.randn(1, 8, 2, 16, dtype=bf16, requires_grad=True) for _ in range(3))
    beta = torch.rand(1, 8, 2, dtype=bf16, requires_grad=True)
    h0 = torch.randn(1, 2, 16, 16, requires_grad=True)
    grads = (torch.randn(1, 8, 2, 16, dtype=bf16), torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16, dtype=bf16),
             torch.randn(1, 8, 2), torch.randn(1, 2, 16, 16))

    class Form:
        @staticmethod
        def forward(q, k, v, beta, scale, initial_state, output_final_state, info, needs_backward):
            return torch.zeros_like(v), None, (), ()

        @staticmethod
        def backward(q, k, v, beta, scale, initial_state, saved, do, dht, info):
            return grads

    o, _ = DeltaRuleFunction.apply(q, k, v, beta, h0, None, Form, 1.0, False, False, None, {})
    got = torch.autograd.grad(o, (q, k, v, beta, h0), torch.randn_like(o))
    for g, x in zip(got, (q, k, v, beta, h0)):
        assert g.dtype == x.dtype
    assert got[0] is grads[0] and got[2] is grads[2] and got[4] is grads[4]
    assert torch.equal(got[1], grads[1].to(bf16)) and torch.equal(got[3], grads[3].to(bf16))
