"""The four Triton forms on the same inputs: o, the final state and the five gradients of each agree with
chunk_delta_rule's. Each form also meets the float64 bounds in its own test file; this is the direct
cross-check of the independent implementations against one another (packed sequences with an empty one
and partial chunks, initial state, l2norm in the op)."""
import pytest
import torch

from deltatron import chunk_delta_rule, fused_chunk_delta_rule, fused_recurrent_delta_rule, parallel_delta_rule

from ..helpers import BOUNDS, DEVICE, INTERPRET, make_inputs, random_cu_seqlens, rel_rms

pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not INTERPRET, reason="needs a GPU or TRITON_INTERPRET=1")

OTHER_FORMS = [fused_chunk_delta_rule, fused_recurrent_delta_rule, parallel_delta_rule]


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch):
    monkeypatch.setenv("DELTATRON_BACKEND", "triton")


def outputs(fn, inp, cu, seed=0):
    o, s = fn(inp["q"], inp["k"], inp["v"], inp["beta"], initial_state=inp["initial_state"],
              output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    g = torch.Generator().manual_seed(seed)
    loss = (o.double() * torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.device)).sum()
    loss = loss + (s.double() * torch.randn(s.shape, generator=g, dtype=torch.float64).to(s.device)).sum()
    names = list(inp)
    grads = torch.autograd.grad(loss, [inp[n] for n in names])
    return {"o": o, "state": s, **{f"d{n}": x for n, x in zip(names, grads)}}


@pytest.mark.parametrize("fn", OTHER_FORMS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_form_agrees_with_chunk(fn, dtype):
    lengths = [70, 0, 1, 33]
    inp = make_inputs(1, sum(lengths), 2, 24, 40, dtype, device=DEVICE, initial_state=True, N=len(lengths),
                      seed=11, requires_grad=True)
    cu = random_cu_seqlens(lengths, DEVICE)
    want = outputs(chunk_delta_rule, inp, cu)
    got = outputs(fn, inp, cu)
    # both are within BOUNDS of the float64 recurrence, so within twice that of each other
    errors = {name: rel_rms(got[name], want[name]) for name in want}
    bad = {name: f"{e:.2e}" for name, e in errors.items() if not e <= 2 * BOUNDS[dtype]}
    assert not bad, f"{fn.__name__} differs from chunk_delta_rule: {bad}"
