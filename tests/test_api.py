"""The public API on the PyTorch backend: results, dtypes, and every validation error."""

import pytest
import torch

import deltatron
from deltatron import chunk_delta_rule, fused_chunk_delta_rule, fused_recurrent_delta_rule, parallel_delta_rule
from deltatron.reference import recurrent_delta_rule

from .helpers import BOUNDS, DEVICE, INTERPRET, make_inputs, random_cu_seqlens, rel_rms

ENTRY_POINTS = [chunk_delta_rule, fused_chunk_delta_rule, fused_recurrent_delta_rule, parallel_delta_rule]


@pytest.fixture(autouse=True)
def torch_backend(monkeypatch):
    monkeypatch.setenv("DELTATRON_BACKEND", "torch")


def _args(B=1, T=10, H=2, K=8, V=6, dtype=torch.float32):
    inp = make_inputs(B, T, H, K, V, dtype, seed=1)
    return inp["q"], inp["k"], inp["v"], inp["beta"]


@pytest.mark.parametrize("fn", ENTRY_POINTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_entry_points_match_oracle(fn, dtype):
    inp = make_inputs(2, 37, 2, 16, 12, dtype, initial_state=True, seed=2)
    o, s = fn(**inp, output_final_state=True)
    assert o.dtype == dtype and s.dtype == torch.float32
    # the oracle runs on the same (rounded) inputs in float64
    rounded = {n: inp[n].double() for n in inp}
    o_ref, s_ref = recurrent_delta_rule(rounded["q"], rounded["k"], rounded["v"], rounded["beta"], 16 ** -0.5,
                                        rounded["initial_state"], True)
    assert rel_rms(o, o_ref) <= BOUNDS[dtype]
    assert rel_rms(s, s_ref) <= BOUNDS[dtype]


def test_final_state_is_none_unless_asked():
    o, s = chunk_delta_rule(*_args())
    assert s is None and o.shape == (1, 10, 2, 6)


def test_beta_defaults_to_ones_in_fused_recurrent():
    q, k, v, _ = _args()
    o1, _ = fused_recurrent_delta_rule(q, k, v)
    o2, _ = fused_recurrent_delta_rule(q, k, v, torch.ones(1, 10, 2))
    assert torch.equal(o1, o2)


def test_inplace_final_state_torch_backend():
    q, k, v, b = _args()
    h = torch.randn(1, 2, 8, 6)
    _, expected = fused_recurrent_delta_rule(q, k, v, b, initial_state=h.clone(), output_final_state=True)
    with torch.no_grad():
        _, s = fused_recurrent_delta_rule(q, k, v, b, initial_state=h, inplace_final_state=True)
    assert s is h and torch.allclose(h, expected)


def test_parallel_returns_attention():
    q, k, v, b = _args()
    o, s, P = parallel_delta_rule(q, k, v, b, output_attentions=True)
    assert P.shape == (1, 2, 10, 10)


def test_l2norm_in_op_gradients_flow():
    inp = make_inputs(1, 9, 2, 8, 4, torch.float32, normalized_keys=False, seed=3, requires_grad=True)
    o, _ = chunk_delta_rule(**inp, use_qk_l2norm_in_kernel=True)
    o.sum().backward()
    assert all(inp[n].grad is not None and torch.isfinite(inp[n].grad).all() for n in inp)


# ---- validation: each misuse raises before any computation, naming the argument -------------------------

def _raises(exc, match, *args, fn=chunk_delta_rule, **kwargs):
    with pytest.raises(exc, match=match):
        fn(*args, **kwargs)


@pytest.mark.parametrize("fn", ENTRY_POINTS)
def test_rank_and_shape_mismatches(fn):
    q, k, v, b = _args()
    _raises(ValueError, r"q must have shape \[B, T, H, K\]", q[0], k, v, b, fn=fn)
    _raises(ValueError, r"k must have the shape of q", q, k[:, :5], v, b, fn=fn)
    _raises(ValueError, r"v must have shape \[B, T, Hv, V\] = \[1, 10, Hv, V\] with Hv a multiple of q's 2 heads, "
                        r"got \[1, 10, 3, 6\]|v has 3 heads and q, k 2", q, k, torch.randn(1, 10, 3, 6), b, fn=fn)
    _raises(ValueError, r"beta must have shape \[B, T, H\] = \[1, 10, 2\], got \[1, 10, 2, 1\]",
            q, k, v, b[..., None], fn=fn)


def test_dtype_errors():
    q, k, v, b = _args()
    _raises(TypeError, r"q, k and v must share one dtype", q, k.half(), v, b)
    _raises(TypeError, r"dtype must be float16, bfloat16 or float32", q.int(), k.int(), v.int(), b)
    _raises(TypeError, r"beta must be a floating-point tensor", q, k, v, b.int())
    _raises(TypeError, r"q must be a torch.Tensor", q.tolist(), k, v, b)


def test_float64_only_on_torch_backend(monkeypatch):
    q, k, v, b = _args(dtype=torch.float64)
    chunk_delta_rule(q, k, v, b)  # fine on torch
    monkeypatch.setenv("DELTATRON_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _raises(TypeError, r"float64 runs on the PyTorch backend", q, k, v, b)


@pytest.mark.parametrize("fn", [chunk_delta_rule, fused_chunk_delta_rule])
@pytest.mark.parametrize("bad", [8, 128, 0, 48])
def test_chunk_size(fn, bad):
    _raises(ValueError, r"chunk_size must be one of \(16, 32, 64\), got", *_args(), fn=fn, chunk_size=bad)


def test_cu_seqlens_errors():
    q, k, v, b = _args(B=1, T=10)
    cu = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    _raises(ValueError, r"batch size B must be 1", *_args(B=2), cu_seqlens=cu(0, 10, 20))
    _raises(TypeError, r"cu_seqlens must have an integer dtype", q, k, v, b, cu_seqlens=torch.tensor([0.0, 10.0]))
    _raises(ValueError, r"cu_seqlens must be 1-D", q, k, v, b, cu_seqlens=cu(0, 10)[None])
    _raises(ValueError, r"cu_seqlens must start at 0, got 2", q, k, v, b, cu_seqlens=cu(2, 10))
    _raises(ValueError, r"cu_seqlens must be non-decreasing", q, k, v, b, cu_seqlens=cu(0, 6, 4, 10))
    _raises(ValueError, r"cu_seqlens must end at T = 10 \(the packed length\), got 9", q, k, v, b,
            cu_seqlens=cu(0, 9))
    _raises(ValueError, r"cu_seqlens_cpu must match cu_seqlens", q, k, v, b, cu_seqlens=cu(0, 5, 10),
            cu_seqlens_cpu=cu(0, 10))
    _raises(ValueError, r"cu_seqlens_cpu was given without cu_seqlens", q, k, v, b, cu_seqlens_cpu=cu(0, 10))
    _raises(TypeError, r"cu_seqlens must be a torch.Tensor", q, k, v, b, cu_seqlens=[0, 10])


def test_zero_length_sequences_are_legal():
    q, k, v, b = _args(B=1, T=10)
    h0 = torch.randn(4, 2, 8, 6)
    o, s = chunk_delta_rule(q, k, v, b, initial_state=h0, output_final_state=True,
                            cu_seqlens=random_cu_seqlens([0, 10, 0, 0]))
    assert torch.equal(s[0], h0[0]) and torch.equal(s[2], h0[2]) and torch.equal(s[3], h0[3])


def test_initial_state_errors():
    q, k, v, b = _args(B=2)
    _raises(ValueError, r"initial_state must have shape \[N, H, K, V\] = \[2, 2, 8, 6\] \(N = batch size\), "
            r"got \[1, 2, 8, 6\]", q, k, v, b, initial_state=torch.zeros(1, 2, 8, 6))
    q, k, v, b = _args(B=1)
    _raises(ValueError, r"= \[3, 2, 8, 6\] \(N = number of sequences in cu_seqlens\)", q, k, v, b,
            initial_state=torch.zeros(1, 2, 8, 6), cu_seqlens=random_cu_seqlens([3, 3, 4]))
    _raises(TypeError, r"initial_state must be floating point", q, k, v, b,
            initial_state=torch.zeros(1, 2, 8, 6, dtype=torch.int64))


@pytest.mark.parametrize("fn", ENTRY_POINTS)
def test_unknown_keywords(fn):
    _raises(TypeError, r"head_first is not supported; the layout is \[B, T, H, ...\]", *_args(), fn=fn,
            head_first=True)
    _raises(TypeError, r"unexpected keyword argument\(s\) \['chunksize'\]", *_args(), fn=fn, chunksize=64)


@pytest.mark.parametrize("fn", ENTRY_POINTS)
def test_forms_without_the_gate_say_where_it_runs(fn):
    q, k, v, b = _args()
    _raises(TypeError, r"\['g'\] given, but this form runs the ungated delta rule only; the gated rule and KDA run in "
            r"chunk_gated_delta_rule", q, k, v, b, fn=fn, g=-torch.rand(b.shape))


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), "0.5", True])
def test_scale_errors(bad):
    _raises(ValueError, r"scale must be a positive finite number", *_args(), scale=bad)


def test_inplace_errors():
    q, k, v, b = _args()
    _raises(ValueError, r"inplace_final_state=True needs initial_state", q, k, v, b, fn=fused_recurrent_delta_rule,
            inplace_final_state=True)
    _raises(ValueError, r"contiguous float32 initial_state", q, k, v, b, fn=fused_recurrent_delta_rule,
            initial_state=torch.zeros(1, 2, 8, 6, dtype=torch.float16), inplace_final_state=True)
    h = torch.zeros(1, 2, 8, 6, requires_grad=True)
    _raises(ValueError, r"is for inference", q, k, v, b, fn=fused_recurrent_delta_rule, initial_state=h,
            inplace_final_state=True)


def test_head_size_limit_on_triton(monkeypatch):
    monkeypatch.setenv("DELTATRON_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _raises(ValueError, r"head sizes up to 256, got K = 300, V = 6", *_args(K=300))


def test_backend_env(monkeypatch):
    monkeypatch.setenv("DELTATRON_BACKEND", "cuda")
    _raises(ValueError, r"DELTATRON_BACKEND must be one of torch, triton, auto; got 'cuda'", *_args())
    monkeypatch.setenv("DELTATRON_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    _raises(RuntimeError, r"TRITON_INTERPRET=1", *_args())


def test_public_surface():
    assert set(deltatron.__all__) == {"chunk_delta_rule", "fused_chunk_delta_rule", "fused_recurrent_delta_rule",
                                      "parallel_delta_rule", "chunk_gated_delta_rule",
                                      "fused_recurrent_gated_delta_rule", "fused_sigmoid_gating_delta_rule_update",
                                      "chunk_kda", "fused_recurrent_kda", "prepare_varlen", "VarlenMetadata"}


def test_save_states_option():
    # chunk_delta_rule's save_states: a bool; on the PyTorch backend it changes nothing (the same outputs and
    # gradients); the other entry points do not take it
    inp = make_inputs(1, 37, 2, 16, 12, torch.float32, initial_state=True, seed=3, requires_grad=True)
    runs = []
    for save_states in (False, True):
        o, s = chunk_delta_rule(**inp, output_final_state=True, save_states=save_states)
        runs.append((o, s, *torch.autograd.grad((o.sum() + s.sum()), list(inp.values()))))
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    for bad in (1, None, "yes"):
        _raises(TypeError, r"save_states must be a bool", *_args(), save_states=bad)
    for fn in (fused_chunk_delta_rule, fused_recurrent_delta_rule, parallel_delta_rule):
        _raises(TypeError, r"unexpected keyword argument\(s\) \['save_states'\]", *_args(), fn=fn, save_states=True)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("fn", [chunk_delta_rule, fused_recurrent_delta_rule])
def test_grouped_value_heads(fn, backend, monkeypatch):
    # v, beta and the states with 6 value heads over q's and k's 2: the rule on repeated q, k (dq, dk summed over
    # each group), on both backends (the Triton one in the interpreter without a GPU)
    if backend == "triton" and DEVICE == "cpu" and not INTERPRET:
        pytest.skip("the Triton backend needs a GPU or TRITON_INTERPRET=1")
    monkeypatch.setenv("DELTATRON_BACKEND", backend)
    gen = torch.Generator().manual_seed(3)
    q, k = (torch.randn(1, 37, 2, 16, generator=gen) for _ in range(2))
    k = torch.nn.functional.normalize(k, dim=-1)
    v, beta, h0 = torch.randn(1, 37, 6, 24, generator=gen), torch.rand(1, 37, 6, generator=gen), \
        torch.randn(1, 6, 16, 24, generator=gen)
    cu = random_cu_seqlens([0, 20, 17])
    h0 = h0.expand(3, -1, -1, -1).contiguous()
    device = DEVICE if backend == "triton" else "cpu"
    leaves = [x.to(device).requires_grad_() for x in (q, k, v, beta, h0)]
    o, ht = fn(*leaves[:4], initial_state=leaves[4], output_final_state=True, cu_seqlens=cu.to(device))
    (o.sum() + (ht * ht).sum()).backward()
    ref = [x.detach().double().requires_grad_() for x in (q, k, v, beta, h0)]
    o_ref, ht_ref = recurrent_delta_rule(ref[0].repeat_interleave(3, 2), ref[1].repeat_interleave(3, 2), *ref[2:4],
                                         16 ** -0.5, ref[4], True, cu_seqlens=cu)
    (o_ref.sum() + (ht_ref * ht_ref).sum()).backward()
    assert rel_rms(o, o_ref) <= 1e-4 and rel_rms(ht, ht_ref) <= 1e-4
    for name, leaf, r in zip(("q", "k", "v", "beta", "h0"), leaves, ref):
        assert rel_rms(leaf.grad, r.grad) <= 1e-4, name


@pytest.mark.parametrize("fn", [fused_chunk_delta_rule, parallel_delta_rule])
def test_grouped_value_heads_refused_where_a_form_lacks_them(fn):
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match="grouped value heads run in chunk_delta_rule"):
        fn(q, q, torch.randn(1, 8, 4, 16), torch.rand(1, 8, 4))
