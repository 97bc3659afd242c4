"""output_chunk_states of chunk_delta_rule, chunk_gated_delta_rule and chunk_kda (prefix caching): the state
entering every chunk of every sequence, on both backends (Triton in its interpreter without a GPU), against the
float64 recurrence over each chunk's prefix; o and the final state as without the option; the plan's walk that
stores the states."""
import pytest
import torch

import deltatron
from deltatron.kernels.chunk import plan
from deltatron.reference import recurrent_gated_delta_rule

from .helpers import BOUNDS, DEVICE, INTERPRET, rel_rms

FORMS = {"delta": deltatron.chunk_delta_rule, "gated": deltatron.chunk_gated_delta_rule, "kda": deltatron.chunk_kda}


@pytest.fixture(params=["torch", "triton"])
def backend(request, monkeypatch):
    if request.param == "triton" and DEVICE == "cpu" and not INTERPRET:
        pytest.skip("the Triton backend needs a GPU or TRITON_INTERPRET=1")
    monkeypatch.setenv("DELTATRON_BACKEND", request.param)
    return request.param


@pytest.mark.parametrize("rule", FORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_chunk_states(backend, rule, dtype):
    C, lengths = 16, [37, 0, 16, 5]
    Hk, Hv, K, V = 1, 2, 16, 24
    device = DEVICE if backend == "triton" else "cpu"
    gen = torch.Generator().manual_seed(8)
    T = sum(lengths)
    q = torch.randn(1, T, Hk, K, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(1, T, Hk, K, generator=gen), dim=-1)
    v, beta = torch.randn(1, T, Hv, V, generator=gen), torch.rand(1, T, Hv, generator=gen)
    g = -torch.rand(1, T, Hv, *([K] if rule == "kda" else []), generator=gen) * (0.0 if rule == "delta" else 1.0)
    h0 = torch.randn(len(lengths), Hv, K, V, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    x = [t.to(device, dtype) for t in (q, k, v)] + [beta.to(device)]
    gate = {} if rule == "delta" else {"g": g.to(device)}
    args = dict(initial_state=h0.to(device), output_final_state=True, cu_seqlens=cu.to(device), chunk_size=C)
    with torch.no_grad():
        o, ht, states = FORMS[rule](*x[:3], beta=x[3], **gate, output_chunk_states=True, **args)
        o_plain, ht_plain = FORMS[rule](*x[:3], beta=x[3], **gate, **args)
    # the walk that stores the states and the output stage apart: o up to the order of fp32 sums over K
    assert rel_rms(o, o_plain) <= 1e-6 and torch.equal(ht, ht_plain)
    NT = sum((n + C - 1) // C for n in lengths)
    assert states.shape == (NT, Hv, K, V) and states.dtype == torch.float32
    rounded = [t.to(dtype).double() for t in (q, k, v)] + [beta.double(), g.double()]
    c = 0
    for n, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        for c0 in range(start, end, C):  # the state entering this chunk: after the sequence's tokens before it
            if c0 == start:
                want = h0[n].double()
            else:
                y = [t[:, start:c0] for t in rounded]
                want = recurrent_gated_delta_rule(y[0], y[1], y[2], y[4], y[3], K ** -0.5, h0[n:n + 1].double(),
                                                  True)[1][0]
            assert rel_rms(states[c], want) <= BOUNDS[dtype], (n, c0)
            c += 1


def test_chunk_states_plan_and_errors():
    p = plan.plan_for_shape(8, 2048, 16, 128, 128, torch.bfloat16, training=False)
    assert p.walk == "hopper"
    problem = plan.Problem(torch.bfloat16, 16, 128, 128, 8, 16384, training=False, chunk_states=True)
    p = plan.make_plan(problem, plan.named_capabilities("sm90"))
    assert p.walk == "portable" and "stores the state entering each chunk" in p.reason("walk")
    with pytest.raises(ValueError, match="output_chunk_states needs the walk that stores the states"):
        plan.make_plan(problem, plan.named_capabilities("sm90"), plan.Overrides(fused_output=True))
    q = torch.randn(1, 4, 1, 8)
    with pytest.raises(TypeError, match="output_chunk_states must be a bool"):
        deltatron.chunk_delta_rule(q, q, q, torch.rand(1, 4, 1), output_chunk_states=1)
