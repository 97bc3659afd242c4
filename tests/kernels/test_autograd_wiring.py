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
