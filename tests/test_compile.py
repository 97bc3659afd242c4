"""torch.compile: the public API and a model of DeltaNet layers compile to one graph (fullgraph, no graph
break), forward and backward, with the eager results; the custom ops pass torch.library.opcheck."""
import pytest
import torch
import torch._dynamo.testing

import deltatron
from deltatron import (chunk_delta_rule, chunk_gated_delta_rule, chunk_kda, fused_recurrent_delta_rule,
                       fused_recurrent_gated_delta_rule, fused_recurrent_kda, parallel_delta_rule)
from deltatron.library import delta_rule
from deltatron.cli.train import DeltaNetLM

from .helpers import make_inputs, random_cu_seqlens, rel_rms


@pytest.fixture(autouse=True)
def fresh_dynamo(monkeypatch):
    monkeypatch.setenv("DELTATRON_BACKEND", "torch")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _grads(outputs, inputs, seed=0):
    g = torch.Generator().manual_seed(seed)
    weights = [torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.device) for o in outputs]
    loss = sum((o.double() * w).sum() for o, w in zip(outputs, weights))
    return torch.autograd.grad(loss, inputs)


def test_model_fullgraph_forward_backward_match_eager():
    """Dynamo and AOT autograd (the fake implementations, the autograd registration, functionalization)
    over a two-layer model; inductor's C++ codegen of a whole model takes about a minute on two cores, so
    it runs around the op alone below and on the whole model in the GPU suite."""
    torch.manual_seed(0)
    model = DeltaNetLM(vocab_size=16, d_model=16, num_layers=2, num_heads=2)
    tokens = torch.randint(0, 16, (2, 9))
    explanation = torch._dynamo.explain(model)(tokens)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    params = list(model.parameters())
    logits = compiled(tokens)
    grads = _grads([logits], params)
    assert counter.frame_count == 1
    logits_ref = model(tokens)
    grads_ref = _grads([logits_ref], params)
    assert rel_rms(logits, logits_ref) <= 1e-6
    for g, g_ref in zip(grads, grads_ref):
        assert rel_rms(g, g_ref) <= 1e-6


def test_inductor_around_the_op():
    """inductor (C++ kernels on the CPU) fusing work before and after the op, forward and backward."""
    inp = make_inputs(1, 12, 2, 8, 8, initial_state=True, N=2, seed=7, requires_grad=True)
    cu = random_cu_seqlens([5, 7])
    args = [inp[n] for n in ("q", "k", "v", "beta", "initial_state")]

    def run(q, k, v, beta, initial_state):
        o, s = chunk_delta_rule(torch.tanh(q), k, v * 2, beta.sigmoid(), initial_state=initial_state,
                                output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
        return o.square() + 1, s.sin()

    got = torch.compile(run, fullgraph=True)(*args)
    ref = run(*args)
    for x, x_ref in zip(list(got) + list(_grads(got, args)), list(ref) + list(_grads(ref, args))):
        assert rel_rms(x, x_ref) <= 1e-5


def test_model_on_packed_sequences_is_one_graph():
    torch.manual_seed(0)
    model = DeltaNetLM(vocab_size=16, d_model=16, num_layers=2, num_heads=2)
    tokens, cu = torch.randint(0, 16, (1, 12)), random_cu_seqlens([5, 0, 1, 6])
    explanation = torch._dynamo.explain(model)(tokens, cu_seqlens=cu)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    assert rel_rms(compiled(tokens, cu_seqlens=cu), model(tokens, cu_seqlens=cu)) <= 1e-6


@pytest.mark.parametrize("fn", [chunk_delta_rule, parallel_delta_rule, fused_recurrent_delta_rule])
def test_api_varlen_with_states_is_one_graph(fn):
    lengths = [3, 0, 1, 9]
    inp = make_inputs(1, sum(lengths), 2, 8, 6, initial_state=True, N=len(lengths), seed=1, requires_grad=True)
    cu = random_cu_seqlens(lengths)

    def run(q, k, v, beta, initial_state):
        return fn(q, k, v, beta, initial_state=initial_state, output_final_state=True, cu_seqlens=cu,
                  use_qk_l2norm_in_kernel=True)

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(run, backend=counter, fullgraph=True)
    args = [inp[n] for n in ("q", "k", "v", "beta", "initial_state")]
    got, ref = compiled(*args), run(*args)
    assert counter.frame_count == 1
    for x, x_ref in zip(got, ref):
        assert rel_rms(x, x_ref) <= 1e-6
    for g, g_ref in zip(_grads(got, args), _grads(ref, args)):
        assert rel_rms(g, g_ref) <= 1e-6


def test_compiled_decode_step_updates_state_in_place():
    inp = make_inputs(3, 1, 2, 8, 8, initial_state=True, seed=2)
    state = inp["initial_state"].clone()

    @torch.compile(backend="aot_eager", fullgraph=True)
    def step(q, k, v, beta, s):
        return fused_recurrent_delta_rule(q, k, v, beta, initial_state=s, inplace_final_state=True)

    with torch.no_grad():
        o, s = step(inp["q"], inp["k"], inp["v"], inp["beta"], state)
        o_ref, s_ref = fused_recurrent_delta_rule(inp["q"], inp["k"], inp["v"], inp["beta"],
                                                  initial_state=inp["initial_state"], output_final_state=True)
    assert s is state
    assert rel_rms(o, o_ref) <= 1e-6 and rel_rms(state, s_ref) <= 1e-6


def test_attentions_and_unrequested_state_under_compile():
    inp = make_inputs(2, 7, 2, 8, 8, seed=3)
    compiled = torch.compile(parallel_delta_rule, backend="aot_eager", fullgraph=True)
    o, s, attn = compiled(inp["q"], inp["k"], inp["v"], inp["beta"], output_attentions=True)
    o_ref, _, attn_ref = parallel_delta_rule(inp["q"], inp["k"], inp["v"], inp["beta"], output_attentions=True)
    assert s is None
    assert rel_rms(o, o_ref) <= 1e-6 and rel_rms(attn, attn_ref) <= 1e-6


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("fn", [chunk_delta_rule, chunk_gated_delta_rule, chunk_kda], ids=lambda f: f.__name__)
@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_chunk_states_under_compile(fn, varlen, backend, monkeypatch):
    # the states entering every chunk as the op's extra output: B * ceil(T / C) of them, or with cu_seqlens a number
    # the graph learns at run time; o, the final state and the gradients as eagerly on the PyTorch backend
    if backend == "triton":
        pytest.importorskip("triton")
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(10)
    B, T = (1, 21) if varlen else (2, 21)
    q, k = torch.randn(B, T, 1, 8, generator=gen), torch.randn(B, T, 1, 8, generator=gen)
    v, beta = torch.randn(B, T, 2, 4, generator=gen), torch.rand(B, T, 2, generator=gen)
    g = -torch.rand(B, T, 2, *((8,) if fn is chunk_kda else ()), generator=gen)
    cu = torch.tensor([0, 4, 4, 21]) if varlen else None

    def run(q, k, v, beta, g, cu):
        return fn(q, k, v, beta=beta, **({} if fn is chunk_delta_rule else {"g": g}), output_final_state=True,
                  chunk_size=16, output_chunk_states=True, cu_seqlens=cu)

    def results(x, compiled, device):
        x = [t.to(device).requires_grad_(i < 3) if t is not None else t for i, t in enumerate(x)]
        out = (torch.compile(run, backend="aot_eager", fullgraph=True) if compiled else run)(*x)
        return [t.cpu() for t in list(out) + list(_grads(out[:2], x[:3]))]

    monkeypatch.setenv("DELTATRON_BACKEND", backend)
    got = results((q, k, v, beta, g, cu), True, device)
    monkeypatch.setenv("DELTATRON_BACKEND", "torch")
    ref = results((q, k, v, beta, g, cu), False, "cpu")
    assert got[2].shape == ref[2].shape == ((3 if varlen else 4), 2, 8, 4)
    for x, x_ref in zip(got, ref):
        assert rel_rms(x, x_ref) <= 1e-4


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("fn", [fused_recurrent_gated_delta_rule, chunk_gated_delta_rule], ids=lambda f: f.__name__)
def test_state_pool_under_compile(fn, backend, monkeypatch):
    # a decode step and a chunk prefill on a pool's slots (one a padding entry) in place: one graph, the eager
    # call's outputs and pool bit for bit
    if backend == "triton":
        pytest.importorskip("triton")
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(12)
    B, T = 3, (1 if fn is fused_recurrent_gated_delta_rule else 20)
    q, k = torch.randn(B, T, 1, 16, generator=gen), torch.randn(B, T, 1, 16, generator=gen)
    x = [t.to(device) for t in (q, torch.nn.functional.normalize(k, dim=-1), torch.randn(B, T, 2, 8, generator=gen),
                                -torch.rand(B, T, 2, generator=gen), torch.rand(B, T, 2, generator=gen))]
    pool = torch.randn(5, 2, 16, 8, generator=gen).to(device)
    slots = torch.tensor([4, -1, 1], dtype=torch.int32, device=device)

    def step(q, k, v, g, beta, pool, slots):
        return fn(q, k, v, g, beta, initial_state=pool, inplace_final_state=True, ssm_state_indices=slots)[0]

    monkeypatch.setenv("DELTATRON_BACKEND", backend)
    eager_pool, compiled_pool = pool.clone(), pool.clone()
    with torch.no_grad():
        want = step(*x, eager_pool, slots)
        got = torch.compile(step, backend="aot_eager", fullgraph=True)(*x, compiled_pool, slots)
    assert torch.equal(got, want) and torch.equal(compiled_pool, eager_pool)
    assert not torch.equal(eager_pool[[1, 4]], pool[[1, 4]]) and torch.equal(eager_pool[[0, 2, 3]], pool[[0, 2, 3]])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fused_gating_decode_step_under_compile(backend, monkeypatch):
    # vLLM's fused decode step compiles to one graph (the gate, sigmoid beta and the norms as torch operations around
    # the op): the eager step's outputs and pool, to fp32 rounding on the Triton backend (one kernel eagerly)
    if backend == "triton":
        pytest.importorskip("triton")
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(13)
    q, k, a, b = (torch.randn(3, 1, *shape, generator=gen).to(device) for shape in ((1, 16), (1, 16), (2,), (2,)))
    v = torch.randn(3, 1, 2, 8, generator=gen).to(device)
    A_log, dt_bias = (torch.randn(2, generator=gen).to(device) for _ in range(2))
    pool = torch.randn(5, 2, 16, 8, generator=gen).to(device)
    slots = torch.tensor([4, -1, 1], dtype=torch.int32, device=device)

    def step(q, k, v, a, b, pool, slots):
        return deltatron.fused_sigmoid_gating_delta_rule_update(A_log, a, dt_bias, 1.0, 20.0, q, k, v, b, pool, slots,
                                                                use_qk_l2norm_in_kernel=True)

    monkeypatch.setenv("DELTATRON_BACKEND", backend)
    eager_pool, compiled_pool = pool.clone(), pool.clone()
    with torch.no_grad():
        want = step(q, k, v, a, b, eager_pool, slots)
        got = torch.compile(step, backend="aot_eager", fullgraph=True)(q, k, v, a, b, compiled_pool, slots)
    bound = 0.0 if backend == "torch" else 1e-6
    assert rel_rms(got, want) <= bound and rel_rms(compiled_pool, eager_pool) <= bound


def test_token_states_refused_under_compile():
    # a verify step's state per token is made one token at a time outside the kernel: refused by name under compile
    q = torch.randn(2, 2, 1, 8)
    slots, accepted = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.tensor([1, 2], dtype=torch.int32)
    pool = torch.zeros(4, 1, 8, 8)

    def verify(q, pool):
        return fused_recurrent_gated_delta_rule(q, q, q, -torch.ones(2, 2, 1), torch.ones(2, 2, 1), initial_state=pool,
                                                ssm_state_indices=slots, num_accepted_tokens=accepted,
                                                inplace_final_state=True)[0]

    with torch.no_grad(), pytest.raises(Exception, match="a state per token .* not supported under torch.compile"):
        torch.compile(verify, backend="aot_eager", fullgraph=True)(q, pool)


@pytest.mark.parametrize("output", ["attentions", "chunk_states"])
def test_opcheck_extra_output(output):
    inp = make_inputs(1, 7, 2, 8, 4, seed=11, requires_grad=True)
    form, cu = ("parallel", None) if output == "attentions" else ("chunk", random_cu_seqlens([2, 0, 5]))
    args = (inp["q"], inp["k"], inp["v"], inp["beta"], None, None, cu, None, form, 0.3, False, False, 16,
            output == "attentions", False, output == "chunk_states")
    torch.library.opcheck(delta_rule, args)


def test_cu_seqlens_values_still_checked_under_compile():
    inp = make_inputs(1, 10, 2, 8, 8, seed=4)
    compiled = torch.compile(chunk_delta_rule, backend="aot_eager", fullgraph=True)
    with pytest.raises(ValueError, match="must end at T = 10"):
        compiled(inp["q"], inp["k"], inp["v"], inp["beta"], cu_seqlens=torch.tensor([0, 4, 9]))
    # shapes are checked while tracing; under fullgraph dynamo reports the ValueError as its own error
    with pytest.raises(Exception, match="initial_state must have shape"):
        compiled(inp["q"], inp["k"], inp["v"], inp["beta"], cu_seqlens=torch.tensor([0, 4, 10]),
                 initial_state=torch.zeros(3, 2, 8, 8))


@pytest.mark.parametrize("with_state, save_states", [(False, False), (True, True)])
def test_opcheck(with_state, save_states):
    lengths = [2, 0, 5]
    inp = make_inputs(1, 7, 2, 8, 4, initial_state=with_state, N=3, seed=5, requires_grad=True)
    args = (inp["q"], inp["k"], inp["v"], inp["beta"], None, inp.get("initial_state"), random_cu_seqlens(lengths),
            None, "chunk", 0.3, with_state, True, 16, False, save_states, False)
    torch.library.opcheck(delta_rule, args)


@pytest.mark.parametrize("per_channel", [False, True], ids=["gated", "kda"])
def test_opcheck_gated_grouped(per_channel):
    # the gated rule's g (per channel: KDA's) and grouped value heads (v with 4 heads over q's and k's 2) through
    # the same op
    gen = torch.Generator().manual_seed(8)
    q, k = (torch.randn(1, 7, 2, 8, generator=gen).requires_grad_() for _ in range(2))
    v, h0 = torch.randn(1, 7, 4, 4, generator=gen).requires_grad_(), torch.randn(3, 4, 8, 4).requires_grad_()
    beta = torch.rand(1, 7, 4).requires_grad_()
    g = (-torch.rand(1, 7, 4, *((8,) if per_channel else ()))).requires_grad_()
    args = (q, k, v, beta, g, h0, random_cu_seqlens([2, 0, 5]), None, "chunk", 0.3, True, True, 16, False, False,
            False)
    torch.library.opcheck(delta_rule, args)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("fn", [chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, chunk_kda,
                                fused_recurrent_kda])
def test_gated_api_is_one_graph(fn, backend, monkeypatch):
    # every option of the gated ops and KDA's (gate and beta made in the op, V-first states, grouped heads) in one
    # graph
    if backend == "triton":
        pytest.importorskip("triton")
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(9)
    lengths = [3, 0, 9]
    q, k = (torch.randn(1, 12, 1, 16, generator=gen).to(device).requires_grad_() for _ in range(2))
    kda = fn in (chunk_kda, fused_recurrent_kda)  # a per channel; A_log, dt_bias in Kimi Linear's shapes
    v, a, b = (torch.randn(1, 12, 2, *s, generator=gen).to(device).requires_grad_()
               for s in ((16,), (16,) if kda else (), ()))
    A_log, dt_bias = (torch.randn(*s, generator=gen).to(device).requires_grad_()
                      for s in (((1, 1, 2, 1), (32,)) if kda else ((2,), (2,))))
    h0 = torch.randn(3, 2, 16, 16, generator=gen).to(device).requires_grad_()
    cu = random_cu_seqlens(lengths, device=device)
    args = [q, k, v, a, b, A_log, dt_bias, h0]

    def run(q, k, v, a, b, A_log, dt_bias, h0):
        return fn(q, k, v, a, b, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                  use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                  use_beta_sigmoid_in_kernel=True, state_v_first=True)

    monkeypatch.setenv("DELTATRON_BACKEND", backend)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    got = torch.compile(run, backend=counter, fullgraph=True)(*args)
    grads = _grads(got, args)
    assert counter.frame_count == 1
    monkeypatch.setenv("DELTATRON_BACKEND", "torch")
    ref = run(*args)
    for x, x_ref in zip(list(got) + list(grads), list(ref) + list(_grads(ref, args))):
        assert rel_rms(x, x_ref) <= 1e-4


@pytest.mark.parametrize("save_states", [False, True])
def test_triton_backend_under_compile(monkeypatch, save_states):
    """The custom op's forward and its recomputing backward on the Triton forms (Triton's interpreter here), with
    chunk_delta_rule's save_states carried through both ops."""
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    inp = make_inputs(1, 20, 2, 16, 16, device=device, initial_state=True, N=2, seed=6, requires_grad=True)
    cu = random_cu_seqlens([7, 13], device=device)
    args = [inp[n] for n in ("q", "k", "v", "beta", "initial_state")]

    def run(q, k, v, beta, initial_state):
        return chunk_delta_rule(q, k, v, beta, initial_state=initial_state, output_final_state=True,
                                cu_seqlens=cu, chunk_size=16, save_states=save_states)

    monkeypatch.setenv("DELTATRON_BACKEND", "triton")
    got = torch.compile(run, backend="aot_eager", fullgraph=True)(*args)
    grads = _grads(got, args)
    monkeypatch.setenv("DELTATRON_BACKEND", "torch")
    ref = run(*args)
    for x, x_ref in zip(list(got) + list(grads), list(ref) + list(_grads(ref, args))):
        assert rel_rms(x, x_ref) <= 1e-4
