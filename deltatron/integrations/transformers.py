"""Hugging Face transformers: run the gated delta rule of its Gated DeltaNet layers (Qwen3-Next, Qwen3.5, Qwen3.5-MoE
and the other models that share that layer's code), and Kimi Linear's KDA layers, on deltatron's ops.

    import deltatron.integrations.transformers as dt_hf
    dt_hf.enable()   # every Gated DeltaNet layer, built before or after this call, now runs deltatron
    ...
    dt_hf.disable()  # transformers' own functions again

How transformers picks the op. Each of these modeling modules (e.g. transformers.models.qwen3_next.modeling_qwen3_next)
defines two module-level functions, `torch_chunk_gated_delta_rule` (training, prefill) and
`torch_recurrent_gated_delta_rule` (one-token steps from a cache). transformers' decorator
`use_kernel_func_from_hub_with_fallback` replaces each, when the module is imported, by a wrapper bound once to fla's
`chunk_gated_delta_rule` / `fused_recurrent_gated_delta_rule` if fla is installed (from 5.25, for inputs on a device fla
supports), else to the PyTorch code beneath it. Where the kernels package is installed (a dependency of transformers
from 5.25, optional before), the decorator then makes each name hold an nn.Module (kernels' `Func`) whose forward, of
the function's signature, calls that wrapper (the layer class keeps copies of them for kernels' kernelize, but calls the
op through the module's names). The layer's forward looks both names up in its module's globals on every call. enable()
rebinds those two names in each module to adapters that call `deltatron.chunk_gated_delta_rule` /
`deltatron.fused_recurrent_gated_delta_rule` (which run wherever deltatron's gated ops run; see their docstrings). The
gated RMSNorm, the full-attention layers and, except for packed sequences (below), the short convolution stay
transformers' own code. disable() binds back the objects that enable() replaced.

Covered:
- models built before and after enable(), since the names are looked up at call time (a layer calls them only
  through these names); call enable() before torch.compile, so that the compiled graph is traced through deltatron;
- training (gradients to q, k, v, g, beta and the initial state), prefill, and cached decoding;
- packed sequences. The layer hands the op `cu_seqlens=kwargs.pop("cu_seq_lens_q", None)`: the flash-attention
  keyword `cu_seq_lens_q` that the caller passes to the model (for instance from
  `DataCollatorWithFlattening(return_flash_attn_kwargs=True)`, batch of 1); transformers does not derive it from
  position_ids. Without fla, transformers' PyTorch fallback refuses cu_seqlens with a ValueError (5.20; 5.16
  silently ignored them); deltatron keeps the sequences apart. The layer's causal convolution, which runs before the
  op, gets the same keywords but ignores `cu_seq_lens_q` (transformers' wrapper passes a function only the keywords
  it names, and the convolution keeps sequences apart only given `seq_idx` and the causal-conv1d package), so the
  last `linear_conv_kernel_dim - 1` tokens of each sequence would leak into the next one, and from there into its
  whole recurrent state. enable() therefore also wraps the module's `causal_conv1d_fn`: a call that carries
  `cu_seq_lens_q` and no `seq_idx` runs transformers' own function on each packed sequence separately (one host read
  of cu_seq_lens_q); every other call goes to transformers' function untouched.
Needs transformers 5.15 or later: earlier releases bind the op in the layer's __init__ (or call it by another
convention), and enable() refuses them with a RuntimeError.
Not covered: a layer whose whole forward transformers replaces by a Hub kernel (with `use_kernels=True`,
`Qwen3_5GatedDeltaNet` on a few devices), and a modeling module whose functions have other signatures than the
ones below (a later transformers release): enable() skips such a module with a RuntimeWarning rather than guess.
With the kernels package, a model pickled whole while enabled does not unpickle until disable() (kernels rebuilds the
layer's copies from the rebound names); state_dict, save_pretrained and copy.deepcopy are not affected.

Kimi Linear (kimi_linear). Its KDA layer calls `chunk_kimi_delta_attention` and `recurrent_kimi_delta_attention`
the same way, with signatures equal to the two above and a per-channel g [B, T, H, K] that its forget gate makes;
enable() rebinds them to adapters on `deltatron.chunk_kda` / `deltatron.fused_recurrent_kda` (on the Triton backend
chunk_kda runs chunkwise kernels, forward and backward, token-serial ones at head sizes above 128, its
docstring), and wraps its `causal_conv1d_fn` as above. That layer
passes its caller's keywords on unchanged, so for packed sequences the KDA adapters take the offsets from
`cu_seq_lens_q` where no `cu_seqlens` is given; its full-attention (MLA) layers stay transformers' own.

Argument mapping. transformers' layers call the op as its PyTorch fallback is declared, `(query, key, value, g,
beta, [chunk_size,] initial_state, output_final_state, use_qk_l2norm_in_kernel, **kwargs)`, all but the first three
by keyword. The sixth positional parameter is `chunk_size` there but `scale` in fla's and deltatron's functions, so
the adapters take transformers' signature and pass each argument to deltatron by name. q is scaled by K^-0.5 (the
fallback's fixed scale, deltatron's default). The layouts already agree: q, k [B, T, Hk, K]; v [B, T, Hv, V] with
Hv a multiple of Hk (value head h reads key head h // (Hv / Hk) in both; layers of transformers before about 5.20
repeat q and k to Hv heads themselves); g (log decays, float32) and beta
[B, T, Hv]; states [B, Hv, K, V], float32 (deltatron keeps float64 for a float64 model, where the fallback computes
in float32). `kwargs` holds `cu_seqlens` and whatever keywords the model was given (`use_cache`, `position_ids`,
`cu_seq_lens_k`, `max_length_q`, `seq_idx`, ...): `cu_seqlens` goes to deltatron and the rest is dropped, as
transformers' own wrapper drops every keyword that fla's function does not name (deltatron's functions reject
unknown keywords). Under torch.export the adapters call transformers' original function, as transformers' wrapper
does instead of fla.
"""
from __future__ import annotations

import importlib
import inspect
import warnings
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch

from ..api import chunk_gated_delta_rule, chunk_kda, fused_recurrent_gated_delta_rule, fused_recurrent_kda

__all__ = ["enable", "disable", "is_enabled", "MODELING_MODULES", "MIN_TRANSFORMERS"]

# transformers.models.<name>.modeling_<name> for every model whose Gated DeltaNet layer calls the functions below
# (the same code, copied by transformers' modular files). Modules the installed transformers lacks are skipped.
# Kimi Linear's KDA layer (kimi_linear) calls its own two functions, with the same signatures, on a per-channel g.
MODELING_MODULES: Tuple[str, ...] = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "olmo_hybrid", "lara_mini", "qwen4_exp",
                                     "kimi_linear")

_CHUNK = "torch_chunk_gated_delta_rule"
_RECURRENT = "torch_recurrent_gated_delta_rule"
_KDA_CHUNK = "chunk_kimi_delta_attention"
_KDA_RECURRENT = "recurrent_kimi_delta_attention"
_CONV = "causal_conv1d_fn"
# The parameters of transformers' PyTorch fallbacks, which fix how its layers call the ops (and so the adapters)
_EXPECTED_PARAMS = {
    _CHUNK: ("query", "key", "value", "g", "beta", "chunk_size", "initial_state", "output_final_state",
             "use_qk_l2norm_in_kernel", "kwargs"),
    _RECURRENT: ("query", "key", "value", "g", "beta", "initial_state", "output_final_state",
                 "use_qk_l2norm_in_kernel", "kwargs"),
    _CONV: ("hidden_states", "weight", "bias", "activation", "kwargs"),
}
_EXPECTED_PARAMS[_KDA_CHUNK] = _EXPECTED_PARAMS[_CHUNK]
_EXPECTED_PARAMS[_KDA_RECURRENT] = _EXPECTED_PARAMS[_RECURRENT]


def _functions(name: str) -> Tuple[str, ...]:
    """The functions enable() replaces in transformers.models.<name>.modeling_<name>."""
    return (_KDA_CHUNK, _KDA_RECURRENT, _CONV) if name == "kimi_linear" else (_CHUNK, _RECURRENT, _CONV)

# the first release whose layers look the functions up at call time, with the signatures above
MIN_TRANSFORMERS = (5, 15)

# (module name, function name) -> the object enable() replaced
_originals: Dict[Tuple[str, str], Callable] = {}


def _exporting() -> bool:
    try:
        return torch.compiler.is_exporting()
    except AttributeError:  # older torch
        return False


def _cu_seqlens(kwargs: dict, packed_keyword: bool):
    """The packed sequences' offsets a layer hands the op: `cu_seqlens`; for Kimi Linear's layer (packed_keyword),
    which passes its caller's keywords on unchanged, else the flash-attention keyword `cu_seq_lens_q`."""
    cu_seqlens = kwargs.get("cu_seqlens")
    return kwargs.get("cu_seq_lens_q") if cu_seqlens is None and packed_keyword else cu_seqlens


def _make_chunk_adapter(original: Callable, op: str = "chunk_gated_delta_rule") -> Callable:
    def chunk_gated_delta_rule_adapter(query, key, value, g, beta, chunk_size=64, initial_state=None,
                                       output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs):
        """transformers' `torch_chunk_gated_delta_rule` on `deltatron.chunk_gated_delta_rule` (Kimi Linear's
        `chunk_kimi_delta_attention` on `deltatron.chunk_kda`; see deltatron.integrations.transformers)."""
        if _exporting():
            return original(query, key, value, g=g, beta=beta, chunk_size=chunk_size, initial_state=initial_state,
                            output_final_state=output_final_state,
                            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs)
        return globals()[op](query, key, value, g=g, beta=beta, initial_state=initial_state,
                             output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                             cu_seqlens=_cu_seqlens(kwargs, op == "chunk_kda"), chunk_size=chunk_size)

    chunk_gated_delta_rule_adapter._deltatron_original = original
    return chunk_gated_delta_rule_adapter


def _make_recurrent_adapter(original: Callable, op: str = "fused_recurrent_gated_delta_rule") -> Callable:
    def recurrent_gated_delta_rule_adapter(query, key, value, g, beta, initial_state=None, output_final_state=False,
                                           use_qk_l2norm_in_kernel=False, **kwargs):
        """transformers' `torch_recurrent_gated_delta_rule` on `deltatron.fused_recurrent_gated_delta_rule` (Kimi
        Linear's `recurrent_kimi_delta_attention` on `deltatron.fused_recurrent_kda`; see
        deltatron.integrations.transformers)."""
        if _exporting():
            return original(query, key, value, g=g, beta=beta, initial_state=initial_state,
                            output_final_state=output_final_state,
                            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs)
        return globals()[op](query, key, value, g=g, beta=beta, initial_state=initial_state,
                             output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                             cu_seqlens=_cu_seqlens(kwargs, op == "fused_recurrent_kda"))

    recurrent_gated_delta_rule_adapter._deltatron_original = original
    return recurrent_gated_delta_rule_adapter


def _make_conv_adapter(original: Callable) -> Callable:
    def causal_conv1d_fn_adapter(hidden_states, weight, bias=None, activation=None, **kwargs):
        """transformers' `causal_conv1d_fn`, run on each packed sequence separately when the call carries
        `cu_seq_lens_q` without `seq_idx` (see deltatron.integrations.transformers); otherwise untouched."""
        cu_seqlens = kwargs.get("cu_seq_lens_q")
        if cu_seqlens is None or kwargs.get("seq_idx") is not None or _exporting():
            return original(hidden_states, weight, bias, activation=activation, **kwargs)
        bounds = [int(b) for b in cu_seqlens.tolist()]  # one host read, as for deltatron's own varlen calls
        B, _, T = hidden_states.shape
        if B != 1 or bounds[0] != 0 or bounds[-1] != T or any(b > e for b, e in zip(bounds, bounds[1:])):
            raise ValueError(
                f"causal_conv1d_fn: packed sequences need a batch of 1 whose {T} tokens cu_seq_lens_q covers "
                f"(0 = c_0 <= c_1 <= ... = {T}), got batch {B} and cu_seq_lens_q {bounds} (with a cache, the "
                f"convolution's input also holds the cached tokens: packed sequences are not supported there)")
        kwargs.pop("cu_seq_lens_q")
        pieces = [original(hidden_states[..., b:e], weight, bias, activation=activation, **kwargs)
                  for b, e in zip(bounds, bounds[1:]) if e > b]
        return torch.cat(pieces, dim=-1) if pieces else original(hidden_states, weight, bias, activation=activation,
                                                                    **kwargs)

    causal_conv1d_fn_adapter._deltatron_original = original
    return causal_conv1d_fn_adapter


_ADAPTERS = {_CHUNK: _make_chunk_adapter, _RECURRENT: _make_recurrent_adapter, _CONV: _make_conv_adapter,
             _KDA_CHUNK: lambda fn: _make_chunk_adapter(fn, "chunk_kda"),
             _KDA_RECURRENT: lambda fn: _make_recurrent_adapter(fn, "fused_recurrent_kda")}


def _import(name: str):
    """transformers.models.<name>.modeling_<name>, or None where the installed transformers lacks the model."""
    try:
        return importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    except ModuleNotFoundError:
        return None


def _signature_matches(fn: Callable, attr: str) -> bool:
    if isinstance(fn, torch.nn.Module):  # kernels' `Func` (module docstring): its forward has the function's signature
        fn = fn.forward
    try:
        # inspect follows __wrapped__ (functools.wraps) to the PyTorch fallback's own signature
        return tuple(inspect.signature(fn).parameters) == _EXPECTED_PARAMS[attr]
    except (TypeError, ValueError):
        return False


def enable(models: Optional[Sequence[str]] = None) -> Tuple[str, ...]:
    """Makes transformers' Gated DeltaNet layers run deltatron's gated delta rule (module docstring: what is covered).

    Args:
        models: names from MODELING_MODULES (e.g. ("qwen3_next",)); None: every one the installed transformers has.
    Returns the names of the modules whose functions now call deltatron (already-enabled ones included).
    Calling it again is harmless: a function already replaced is left as it is. Needs transformers installed."""
    import transformers  # a clear ImportError when it is missing
    from packaging.version import Version  # a dependency of transformers

    if Version(transformers.__version__).release[:2] < MIN_TRANSFORMERS:
        raise RuntimeError(f"deltatron.integrations.transformers needs transformers >= "
                           f"{'.'.join(map(str, MIN_TRANSFORMERS))}, found {transformers.__version__}")

    names = MODELING_MODULES if models is None else tuple(models)
    unknown = [n for n in names if n not in MODELING_MODULES]
    if unknown:
        raise ValueError(f"enable: unknown model module(s) {unknown}; known: {list(MODELING_MODULES)}")
    patched = []
    for name in names:
        module = _import(name)
        if module is None:
            if models is not None:
                raise ValueError(f"enable: the installed transformers has no transformers.models.{name}")
            continue
        current = {attr: getattr(module, attr, None) for attr in _functions(name)}
        todo = {attr: fn for attr, fn in current.items() if not hasattr(fn, "_deltatron_original")}
        bad = [attr for attr, fn in todo.items() if fn is None or not _signature_matches(fn, attr)]
        if bad:
            warnings.warn(f"deltatron.integrations.transformers: {module.__name__}.{', '.join(bad)} is missing or "
                          f"has an unexpected signature in transformers {transformers.__version__}; this model "
                          f"keeps transformers' own gated delta rule", RuntimeWarning, stacklevel=2)
            continue
        for attr, fn in todo.items():
            _originals[(name, attr)] = fn
            setattr(module, attr, _ADAPTERS[attr](fn))
        patched.append(name)
    return tuple(patched)


def disable() -> None:
    """Undoes enable(): transformers' own functions (fla's or the PyTorch fallback, as transformers chose them) are
    bound again. Harmless when nothing is enabled."""
    for (name, attr), original in list(_originals.items()):
        module = _import(name)
        if module is not None and hasattr(getattr(module, attr, None), "_deltatron_original"):
            setattr(module, attr, original)
        del _originals[(name, attr)]


def is_enabled(model: str) -> bool:
    """Whether transformers.models.<model>.modeling_<model> has deltatron's adapters in place (enable())."""
    module = _import(model) if model in MODELING_MODULES else None
    return module is not None and all(hasattr(getattr(module, attr, None), "_deltatron_original")
                                      for attr in _functions(model))
