"""deltatron.integrations.transformers: transformers' Gated DeltaNet models (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) with
deltatron's gated delta rule, and Kimi Linear with deltatron's KDA, against the same models on transformers' own
PyTorch fallback (logits, gradients to every parameter, cached decoding, fp64), packed sequences against separate
runs, the adapters against transformers' reference functions on random inputs, and enable()/disable()."""
import importlib
import importlib.util
import inspect
import warnings

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

import deltatron.integrations.transformers as dt_hf  # noqa: E402

from ..helpers import rel_rms  # noqa: E402

CHUNK, RECURRENT = "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"
KDA_CHUNK, KDA_RECURRENT = "chunk_kimi_delta_attention", "recurrent_kimi_delta_attention"
TOL = 1e-4  # relative RMS; transformers' fallback computes in fp32 also for fp64 models, so fp64 gets it too


def modeling(name):
    try:
        return importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    except ModuleNotFoundError:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")


@pytest.fixture(autouse=True)
def _restore():
    """No test leaves transformers patched, even when it fails."""
    dt_hf.disable()
    yield
    dt_hf.disable()


@pytest.fixture
def calls(monkeypatch):
    """Records each call of deltatron's gated and KDA ops by the adapters: {"chunk": [cu_seqlens, ...], "recurrent":
    [...]}, so that a test cannot pass by comparing transformers' fallback with itself."""
    seen = {"chunk": [], "recurrent": []}
    for key, name in (("chunk", "chunk_gated_delta_rule"), ("recurrent", "fused_recurrent_gated_delta_rule"),
                      ("chunk", "chunk_kda"), ("recurrent", "fused_recurrent_kda")):
        real = getattr(dt_hf, name)
        monkeypatch.setattr(dt_hf, name, lambda *a, _real=real, _key=key, **k: seen[_key].append(k["cu_seqlens"])
                            or _real(*a, **k))
    return seen


def reference(module, attr):
    """transformers' PyTorch fallback itself, beneath the wrapper (which would call fla if fla were installed) and,
    where the kernels package is installed, beneath the nn.Module (kernels' `Func`) whose forward calls the wrapper."""
    fn = getattr(module, attr)
    assert not hasattr(fn, "_deltatron_original")
    if isinstance(fn, torch.nn.Module):
        fn = inspect.getclosurevars(type(fn).forward).nonlocals["func"]  # the function Func was made from
    return inspect.unwrap(fn)


# ---------------------------------------------------------------------------------------------------------------
# The adapters against transformers' reference functions, on random inputs

def op_inputs(B, T, Hk, Hv, K, V, seed=0, per_channel=False):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)
    g = F.logsigmoid(r(B, T, Hv, *((K,) if per_channel else ())) + 2)  # per key channel: KDA's
    return dict(query=r(B, T, Hk, K), key=r(B, T, Hk, K), value=r(B, T, Hv, V), g=g,
                beta=torch.sigmoid(r(B, T, Hv)), initial_state=r(B, Hv, K, V) * 0.3)


def run_op(fn, x, seed=1, expand_heads=False, **kwargs):
    """(o, final state, gradients of a random projection of both to every input), called as transformers' layers
    call the op: q, k, v positionally, the rest by keyword. expand_heads: q and k repeated to the value heads
    (repeat_interleave, value head h reading key head h // (Hv / Hk)) before the call, as transformers' layers did
    before its reference functions took grouped heads themselves."""
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    args = dict(leaves)
    q, k, v = args.pop("query"), args.pop("key"), args.pop("value")
    if expand_heads:
        q, k = (t.repeat_interleave(v.shape[2] // t.shape[2], dim=2) for t in (q, k))
    o, s = fn(q, k, v, **args, output_final_state=True, use_qk_l2norm_in_kernel=True, **kwargs)
    gen = torch.Generator().manual_seed(seed)
    ((o * torch.randn(o.shape, generator=gen)).sum() + (s * torch.randn(s.shape, generator=gen)).sum()).backward()
    return o.detach(), s.detach(), {n: t.grad for n, t in leaves.items()}


def assert_close(got, ref, what):
    err = rel_rms(got, ref)
    assert err <= TOL, f"{what}: relative RMS {err:.2e} > {TOL:.0e}"


# what the layers pass on besides the op's own arguments (dropped by the adapters, as by transformers' wrapper)
MODEL_KWARGS = dict(use_cache=False, position_ids=torch.arange(5)[None], cu_seq_lens_k=None, max_length_q=None,
                    seq_idx=None, output_attentions=False)


@pytest.mark.parametrize("attr, T", [(CHUNK, 37), (CHUNK, 130), (RECURRENT, 1), (RECURRENT, 9)])
def test_adapters_match_transformers_reference_functions(attr, T):
    module = modeling("qwen3_next")
    ref_fn = reference(module, attr)
    x = op_inputs(2, T, 2, 4, 16, 24)
    o_ref, s_ref, g_ref = run_op(ref_fn, x, expand_heads=True)
    dt_hf.enable(["qwen3_next"])
    adapter = getattr(module, attr)
    assert adapter._deltatron_original is not None
    o, s, grads = run_op(adapter, x, cu_seqlens=None, **MODEL_KWARGS)
    assert o.dtype == o_ref.dtype and s.dtype == s_ref.dtype == torch.float32
    assert_close(o, o_ref, "o")
    assert_close(s, s_ref, "final state")
    for n in x:
        assert_close(grads[n], g_ref[n], f"d{n}")


def test_chunk_adapter_takes_chunk_size_where_transformers_puts_it():
    """The sixth positional parameter is chunk_size in transformers' signature (scale in fla's and deltatron's)."""
    module = modeling("qwen3_next")
    ref_fn = reference(module, CHUNK)
    x = op_inputs(1, 40, 1, 2, 16, 16, seed=3)
    args = [x[n] for n in ("query", "key", "value", "g", "beta")]
    o_ref, s_ref = ref_fn(*[t.repeat_interleave(2, dim=2) for t in args[:2]], *args[2:], 16, x["initial_state"], True,
                          True)
    dt_hf.enable(["qwen3_next"])
    o, s = getattr(module, CHUNK)(*args, 16, x["initial_state"], True, True)
    assert_close(o, o_ref, "o")
    assert_close(s, s_ref, "final state")
    assert getattr(module, CHUNK)(*args, 16, None, False, True)[1] is None


# ---------------------------------------------------------------------------------------------------------------
# Whole models: logits and every parameter's gradient, deltatron against transformers' fallback

SMALL = dict(vocab_size=64, hidden_size=64, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
             head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
             linear_value_head_dim=16, rms_norm_eps=1e-6)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)


def build(name, layer_types=("linear_attention", "full_attention"), dtype=torch.float32, seed=0, **overrides):
    """A tiny random model. Weights ~ N(0, 0.2) rather than the 0.02 of the initializer, and A_log, dt_bias set for
    decays exp(g) mostly in (0.5, 1): with the initializer's A in (0.01, 16) most heads forget everything at each
    token, and the gradients to A_log and dt_bias are too small to compare."""
    kw = dict(SMALL, num_hidden_layers=len(layer_types), layer_types=list(layer_types), **overrides)
    if name == "qwen3_next":
        from transformers import Qwen3NextConfig as Config, Qwen3NextForCausalLM as Model
        kw.update(MOE)
    elif name == "qwen3_5":
        modeling(name)
        from transformers import Qwen3_5ForCausalLM as Model, Qwen3_5TextConfig as Config
    elif name == "qwen3_5_moe":
        modeling(name)
        from transformers import Qwen3_5MoeForCausalLM as Model, Qwen3_5MoeTextConfig as Config
        kw.update(MOE)
    torch.manual_seed(seed)
    model = Model(Config(**kw))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                Hv = layer.linear_attn.num_v_heads
                layer.linear_attn.A_log.copy_((torch.rand(Hv, generator=gen) * 0.95 + 0.05).log())
                layer.linear_attn.dt_bias.copy_(torch.randn(Hv, generator=gen) - 1)
    return model.to(dtype).train()


def loss_and_grads(model, ids, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids, **{"use_cache": False, **kwargs})
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name, dtype", [("qwen3_next", torch.float32), ("qwen3_next", torch.float64),
                                         ("qwen3_5", torch.float32), ("qwen3_5_moe", torch.float32)])
def test_model_logits_and_gradients_match_transformers_fallback(name, dtype, calls):
    # fp64: dense MLPs (the MoE experts' grouped matmul has no fp64 kernel on CPU)
    model = build(name, dtype=dtype, **(dict(mlp_only_layers=[0, 1]) if dtype == torch.float64 else {}))
    ids = torch.randint(0, 64, (2, 45), generator=torch.Generator().manual_seed(1))
    logits_ref, grads_ref = loss_and_grads(model, ids)
    assert dt_hf.enable([name]) == (name,)
    assert calls["chunk"] == []
    logits, grads = loss_and_grads(model, ids)
    assert calls["chunk"] == [None] and logits.dtype == dtype
    assert_close(logits, logits_ref, "logits")
    assert set(grads) == set(grads_ref)
    for n in grads_ref:
        assert grads_ref[n] is not None and grads[n] is not None, n
        assert_close(grads[n], grads_ref[n], f"d {n}")


@torch.no_grad()
def prefill_then_steps(model, ids, prefill: int = 20):
    """The logits of a cached prefill of ids[:, :prefill] then one cached step per remaining token."""
    out = model(ids[:, :prefill], use_cache=True)
    logits = [out.logits]
    for t in range(prefill, ids.shape[1]):
        # the cache is `cache` in recent transformers, `past_key_values` before
        name = "cache" if hasattr(out, "cache") else "past_key_values"
        out = model(ids[:, t:t + 1], **{name: getattr(out, name)}, use_cache=True)
        logits.append(out.logits)
    return torch.cat(logits, 1)


def check_cached_decoding(model, model_type, calls, ids):
    """A cached prefill (the chunk op, writing the cache) and 4 cached steps (the recurrent op, from the cache) with
    deltatron enabled for model_type give the logits of transformers' own fallback; returns them."""
    ref = prefill_then_steps(model, ids)
    dt_hf.enable([model_type])
    got = prefill_then_steps(model, ids)
    assert len(calls["chunk"]) == 1 and len(calls["recurrent"]) == 4
    assert_close(got, ref, "decoded logits")
    return got


def test_cached_decoding_matches_transformers_fallback(calls):
    """Prefill (the chunk op, writing the cache) then token-by-token steps (the recurrent op, from the cache)."""
    model = build("qwen3_next").eval()
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(2))
    got = check_cached_decoding(model, "qwen3_next", calls, ids)
    with torch.no_grad():  # and the steps agree with one pass over the whole sequence
        assert_close(got, model(ids, use_cache=False).logits, "decoded vs. full-sequence logits")


def test_packed_sequences_match_separate_runs(calls):
    """transformers hands the op `cu_seqlens` from the `cu_seq_lens_q` keyword, which its PyTorch fallback refuses
    (transformers 5.20; 5.16 ignored it); deltatron keeps the sequences apart (and enable()'s convolution wrapper
    keeps the causal conv from leaking across them); the full-attention layer finds the boundaries in position_ids."""
    model = build("qwen3_next")
    assert model.config.linear_conv_kernel_dim == 4
    lengths = (13, 1, 30)
    gen = torch.Generator().manual_seed(4)
    seqs = [torch.randint(0, 64, (1, n), generator=gen) for n in lengths]
    ids = torch.cat(seqs, 1)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, 13, 14, 44], dtype=torch.int32)
    packed = dict(position_ids=position_ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=30, max_length_k=30,
                  use_cache=False)
    dt_hf.enable(["qwen3_next"])
    logits = model(ids, **packed).logits
    assert len(calls["chunk"]) == 1 and calls["chunk"][0] is cu
    separate = torch.cat([model(s, use_cache=False).logits for s in seqs], 1)
    assert_close(logits, separate, "packed logits")
    # and the gradients of a loss over the packed batch are the sums of those over the separate sequences
    params = dict(model.named_parameters())
    grad = lambda out: torch.autograd.grad(out.square().sum(), list(params.values()), allow_unused=True)
    got = grad(model(ids, **packed).logits)
    per_seq = [grad(model(s, use_cache=False).logits) for s in seqs]
    for i, n in enumerate(params):
        parts = [g[i] for g in per_seq if g[i] is not None]
        assert (got[i] is None) == (not parts), n
        if parts:
            assert_close(got[i], sum(parts), f"d {n}")


def test_conv_wrapper_only_acts_on_packed_calls():
    module = modeling("qwen3_next")
    conv = getattr(module, "causal_conv1d_fn")
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(1, 6, 20, generator=gen), torch.randn(6, 4, generator=gen)
    dt_hf.enable(["qwen3_next"])
    wrapper = getattr(module, "causal_conv1d_fn")
    assert wrapper._deltatron_original is conv
    assert torch.equal(wrapper(x, w, None, activation="silu", use_cache=False), conv(x, w, None, activation="silu"))
    cu = torch.tensor([0, 7, 7, 20], dtype=torch.int32)
    got = wrapper(x, w, None, activation="silu", cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    assert torch.equal(got, torch.cat([conv(x[..., :7], w, None, "silu"), conv(x[..., 7:], w, None, "silu")], -1))
    with pytest.raises(ValueError, match="batch of 1"):
        wrapper(x.expand(2, -1, -1), w, cu_seq_lens_q=cu)
    with pytest.raises(ValueError, match="batch of 1"):
        wrapper(x, w, cu_seq_lens_q=torch.tensor([0, 7, 19]))


# ---------------------------------------------------------------------------------------------------------------
# enable() / disable()

def test_enable_disable_round_trip(calls):
    module = modeling("qwen3_next")
    originals = {attr: getattr(module, attr) for attr in (CHUNK, RECURRENT, "causal_conv1d_fn")}
    model = build("qwen3_next", layer_types=("linear_attention",))  # built before enable()
    ids = torch.randint(0, 64, (1, 8))

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every known module present has the expected signatures
        patched = dt_hf.enable()
    present = [n for n in dt_hf.MODELING_MODULES if importlib.util.find_spec(f"transformers.models.{n}")]
    assert patched == tuple(present) and "qwen3_next" in patched and dt_hf.is_enabled("qwen3_next")
    adapters = {attr: getattr(module, attr) for attr in originals}
    assert all(adapters[a] is not originals[a] and adapters[a]._deltatron_original is originals[a] for a in originals)
    assert dt_hf.enable() == patched  # twice: harmless, nothing wrapped twice
    assert all(getattr(module, a) is adapters[a] for a in originals)
    with torch.no_grad():
        model(ids, use_cache=False)
    assert len(calls["chunk"]) == 1

    dt_hf.disable()
    assert not dt_hf.is_enabled("qwen3_next")
    assert all(getattr(module, a) is originals[a] for a in originals)
    with torch.no_grad():
        model(ids, use_cache=False)
    assert len(calls["chunk"]) == 1
    dt_hf.disable()  # twice: harmless
    assert all(getattr(module, a) is originals[a] for a in originals)

    assert dt_hf.enable(["qwen3_next"]) == ("qwen3_next",)
    with torch.no_grad():
        build("qwen3_next", layer_types=("linear_attention",))(ids, use_cache=False)  # built after enable()
    assert len(calls["chunk"]) == 2


def test_enable_refuses_unknown_models_and_old_transformers_and_skips_unexpected_signatures(monkeypatch):
    with pytest.raises(ValueError, match="unknown model"):
        dt_hf.enable(["llama"])
    monkeypatch.setattr("transformers.__version__", "5.14.1")  # by name: transformers swaps its module object
    with pytest.raises(RuntimeError, match="needs transformers >= 5.15"):
        dt_hf.enable()
    monkeypatch.undo()

    module = modeling("qwen3_next")

    def drifted(query, key, value, g, beta, scale=None, **kwargs):
        raise AssertionError("not to be called")

    monkeypatch.setattr(module, CHUNK, drifted)
    with pytest.warns(RuntimeWarning, match="unexpected signature"):
        assert dt_hf.enable(["qwen3_next"]) == ()
    assert getattr(module, CHUNK) is drifted and not dt_hf.is_enabled("qwen3_next")
    assert not any(hasattr(getattr(module, a), "_deltatron_original") for a in (RECURRENT, "causal_conv1d_fn"))


# ---------------------------------------------------------------------------------------------------------------
# Kimi Linear: its KDA layer's two functions on deltatron.chunk_kda / fused_recurrent_kda

@pytest.mark.parametrize("attr, T", [(KDA_CHUNK, 37), (KDA_CHUNK, 130), (KDA_RECURRENT, 1), (KDA_RECURRENT, 9)])
def test_kda_adapters_match_transformers_reference_functions(attr, T):
    module = modeling("kimi_linear")
    ref_fn = reference(module, attr)
    x = op_inputs(2, T, 3, 3, 16, 24, per_channel=True)  # Kimi Linear's layer has as many key as value heads
    o_ref, s_ref, g_ref = run_op(ref_fn, x)
    dt_hf.enable(["kimi_linear"])
    o, s, grads = run_op(getattr(module, attr), x, **MODEL_KWARGS)
    assert_close(o, o_ref, "o")
    assert_close(s, s_ref, "final state")
    for n in x:
        assert_close(grads[n], g_ref[n], f"d{n}")


def build_kimi(layer_types=("linear_attention", "full_attention"), seed=0):
    """A tiny random Kimi Linear model (a KDA layer and an MLA layer, dense and MoE MLPs), weights ~ N(0, 0.2) and
    decays exp(g) mostly in (0.5, 1) per channel (as build's)."""
    from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearForCausalLM

    config = KimiLinearConfig(
        vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=len(layer_types), num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16,
        q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, num_local_experts=4, num_experts_per_tok=2, layer_types=list(layer_types),
        mlp_layer_types=["dense", "sparse"][:len(layer_types)], linear_attn_config={"head_dim": 16, "num_heads": 2},
        rms_norm_eps=1e-6, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = KimiLinearForCausalLM(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        for layer in model.model.layers:
            gate = getattr(layer.self_attn, "forget_gate", None)
            if gate is not None:
                gate.A_log.copy_((torch.rand(gate.A_log.shape, generator=gen) * 0.95 + 0.05).log())
                gate.dt_bias.copy_(torch.randn(gate.dt_bias.shape, generator=gen) - 1)
    return model.train()


def test_kimi_linear_logits_and_gradients_match_transformers_fallback(calls):
    modeling("kimi_linear")
    model = build_kimi()
    ids = torch.randint(0, 64, (2, 45), generator=torch.Generator().manual_seed(1))
    logits_ref, grads_ref = loss_and_grads(model, ids)
    assert dt_hf.enable(["kimi_linear"]) == ("kimi_linear",)
    logits, grads = loss_and_grads(model, ids)
    assert calls["chunk"] == [None]
    assert_close(logits, logits_ref, "logits")
    assert set(grads) == set(grads_ref)
    for n in grads_ref:
        if grads_ref[n] is not None:  # (an expert no token was routed to has none, either way)
            assert_close(grads[n], grads_ref[n], f"d {n}")


def test_kimi_linear_cached_decoding_matches_transformers_fallback(calls):
    modeling("kimi_linear")
    model = build_kimi().eval()
    check_cached_decoding(model, "kimi_linear", calls, torch.randint(0, 64, (2, 24),
                                                                   generator=torch.Generator().manual_seed(2)))


def test_kimi_linear_packed_sequences_match_separate_runs(calls):
    """Kimi Linear's layer passes its caller's keywords on to the op: the KDA adapters take the packed offsets from
    cu_seq_lens_q (and enable()'s convolution wrapper keeps the causal conv from leaking across sequences)."""
    modeling("kimi_linear")
    model = build_kimi(layer_types=("linear_attention",))
    lengths = (13, 1, 30)
    gen = torch.Generator().manual_seed(4)
    seqs = [torch.randint(0, 64, (1, n), generator=gen) for n in lengths]
    cu = torch.tensor([0, 13, 14, 44], dtype=torch.int32)
    dt_hf.enable(["kimi_linear"])
    logits = model(torch.cat(seqs, 1), cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=30, max_length_k=30,
                   use_cache=False).logits
    assert len(calls["chunk"]) == 1 and calls["chunk"][0] is cu
    separate = torch.cat([model(s, use_cache=False).logits for s in seqs], 1)
    assert_close(logits, separate, "packed logits")
