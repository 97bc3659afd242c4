"""torch.compile support: the delta rule and its gated form as two torch.library custom ops, so that a compiled model
with DeltaNet or Gated DeltaNet layers is one graph (no graph break), forward and backward.

Under torch.compile the public API (api._run) validates shapes and dtypes while tracing, then calls
`delta_rule` below instead of running the implementation inline. To the compiler both ops are opaque:
their fake (meta) implementations give the output shapes, and at run time they call the eager public API,
which checks the cu_seqlens values, picks the backend and runs it (PyTorch, or the Triton form through
DeltaRuleFunction). So compiled and eager runs compute the same function with the same code.

    deltatron::delta_rule(q, k, v, beta, g?, initial_state?, cu_seqlens?, cu_seqlens_cpu?, form, scale,
                          output_final_state, use_qk_l2norm, chunk_size, output_attentions, save_states,
                          output_chunk_states)
        -> (o, final_state, extra)               # empty [0] tensors stand for "not asked for"
    deltatron::delta_rule_backward(do, dht?, q, k, v, beta, g?, initial_state?, cu_seqlens?, cu_seqlens_cpu?,
                                   form, scale, use_qk_l2norm, chunk_size, save_states)
        -> (dq, dk, dv, dbeta, dg, dh0)          # dg, dh0 are [0] without a gate, an initial state

g is the gated rule's log decays (api.chunk_gated_delta_rule's, after its gate and beta transforms, which are
traced as ordinary torch operations); v may have more heads than q and k (grouped value heads). extra is the output
that takes no gradient: the parallel form's attentions or the chunk form's states entering every chunk (with
cu_seqlens their number depends on the lengths: an unbacked size to the compiler).

The backward op recomputes the forward with autograd and returns torch.autograd.grad; on the Triton
backend that runs the form's forward and backward (deltatron.autograd), with save_states (chunk_delta_rule's)
applying between those two. It cannot reuse the tensors the form's forward saved: their number and shapes are
form-specific and, with cu_seqlens, depend on the sequence lengths (one state per chunk), which a fake
implementation cannot know (DESIGN.md §9)."""
from __future__ import annotations

import contextlib
from typing import Optional, Tuple

import torch
from torch import Tensor

from .reference.common import compute_dtype

# The options each form takes (api._run passes them as keyword arguments); the ops carry all of them.
FORM_OPTIONS = {
    "chunk": ("chunk_size", "save_states"),
    "fused_chunk": ("chunk_size",),
    "fused_recurrent": (),
    "parallel": ("output_attentions",),
}
_NOT_ASKED = (0,)


def _eager(form, q, k, v, beta, g, initial_state, cu_seqlens, cu_seqlens_cpu, scale, output_final_state,
           use_qk_l2norm, chunk_size, output_attentions, save_states, output_chunk_states=False):
    from . import api  # here, not at the top: api imports this module

    if g is not None:  # the cu_seqlens values are checked here, at run time, as api._run checks the ungated op's
        chunk_size = chunk_size if form == "chunk" else None
        _, cu_seqlens_cpu = api.check_inputs(q, k, v, beta, scale, initial_state, cu_seqlens, cu_seqlens_cpu,
                                             chunk_size, g=g, grouped=True, per_channel_gate=g.dim() == 4)
        return api._gated_core(form, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm,
                               cu_seqlens, cu_seqlens_cpu, chunk_size, output_chunk_states=output_chunk_states)
    options = dict(chunk_size=chunk_size, output_attentions=output_attentions, save_states=save_states)
    chunk_states = {"output_chunk_states": True} if output_chunk_states else {}
    return api._run(form, q, k, v, beta, scale, initial_state, output_final_state, use_qk_l2norm, cu_seqlens,
                    cu_seqlens_cpu, {}, **{name: options[name] for name in FORM_OPTIONS[form]}, **chunk_states)


def _unaliased(x: Tensor, inputs) -> Tensor:
    """Custom ops must return fresh, contiguous tensors (the fake implementations promise contiguous ones);
    e.g. an empty sequence's final state may come back as the initial state itself."""
    x = x.contiguous()
    if x.numel() and any(i is not None and i.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
                         for i in inputs):
        x = x.clone()
    return x


@torch.library.custom_op("deltatron::delta_rule", mutates_args=())
def delta_rule(
    q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Optional[Tensor], initial_state: Optional[Tensor],
    cu_seqlens: Optional[Tensor], cu_seqlens_cpu: Optional[Tensor], form: str, scale: float, output_final_state: bool,
    use_qk_l2norm: bool, chunk_size: int, output_attentions: bool, save_states: bool, output_chunk_states: bool,
) -> Tuple[Tensor, Tensor, Tensor]:
    with torch.no_grad():
        o, final_state, *extras = _eager(form, q, k, v, beta, g, initial_state, cu_seqlens, cu_seqlens_cpu, scale,
                                         output_final_state, use_qk_l2norm, chunk_size, output_attentions,
                                         save_states, output_chunk_states)
    inputs = (q, k, v, beta, g, initial_state)
    final_state = q.new_empty(_NOT_ASKED) if final_state is None else _unaliased(final_state, inputs)
    extra = _unaliased(extras[0], inputs) if extras else q.new_empty(_NOT_ASKED)
    return _unaliased(o, inputs), final_state, extra


@delta_rule.register_fake
def _(q, k, v, beta, g, initial_state, cu_seqlens, cu_seqlens_cpu, form, scale, output_final_state, use_qk_l2norm,
      chunk_size, output_attentions, save_states, output_chunk_states):
    B, T, _, K = q.shape
    H, V = v.shape[-2:]  # value heads
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    state_dtype = compute_dtype(q.dtype)  # fp32 (float64 for float64 inputs), as the implementations return
    o = q.new_empty(B, T, H, V)
    final_state = q.new_empty((N, H, K, V) if output_final_state else _NOT_ASKED, dtype=state_dtype)
    if output_attentions:
        extra = (B, H, T, T)
    elif output_chunk_states:  # chunks of chunk_size tokens along each sequence
        num_chunks = (B * -(-T // chunk_size) if cu_seqlens is None else
                      torch.library.get_ctx().new_dynamic_size())
        extra = (num_chunks, H, K, V)
    else:
        extra = _NOT_ASKED
    return o, final_state, q.new_empty(extra, dtype=state_dtype)


@contextlib.contextmanager
def _autograd_enabled():
    """Autograd inside a custom op's implementation. The op runs below the autograd dispatch keys (they are
    excluded from the thread's dispatch, whatever torch.is_grad_enabled() says): include them again."""
    C = torch._C
    exclude = C._dispatch_tls_local_exclude_set()
    for key in (C.DispatchKey.AutogradFunctionality, C.DispatchKey.AutogradOther, C.DispatchKey.AutogradNestedTensor,
                C.DispatchKey.ADInplaceOrView):
        exclude = exclude.remove(key)
    with C._ForceDispatchKeyGuard(C._dispatch_tls_local_include_set(), exclude), torch.enable_grad():
        yield


@torch.library.custom_op("deltatron::delta_rule_backward", mutates_args=())
def delta_rule_backward(
    do: Tensor, dht: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Optional[Tensor],
    initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor], cu_seqlens_cpu: Optional[Tensor], form: str,
    scale: float, use_qk_l2norm: bool, chunk_size: int, save_states: bool,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    leaves = {name: x.detach().requires_grad_() for name, x in
              dict(q=q, k=k, v=v, beta=beta, g=g, initial_state=initial_state).items() if x is not None}
    inputs = list(leaves.values())
    with _autograd_enabled():
        o, final_state, *_ = _eager(form, leaves["q"], leaves["k"], leaves["v"], leaves["beta"], leaves.get("g"),
                                    leaves.get("initial_state"), cu_seqlens, cu_seqlens_cpu, scale, dht is not None,
                                    use_qk_l2norm, chunk_size, False, save_states)
        outputs, grads = [o], [do]
        if dht is not None:
            outputs.append(final_state)
            grads.append(dht)
        # allow_unused: with no tokens at all nothing depends on q, k, v, beta
        found = torch.autograd.grad(outputs, inputs, grads, allow_unused=True)
    found = dict(zip(leaves, (torch.zeros_like(x) if d is None else d.contiguous() for d, x in zip(found, inputs))))
    return (found["q"], found["k"], found["v"], found["beta"], found.get("g", q.new_empty(_NOT_ASKED)),
            found.get("initial_state", q.new_empty(_NOT_ASKED)))


@delta_rule_backward.register_fake
def _(do, dht, q, k, v, beta, g, initial_state, cu_seqlens, cu_seqlens_cpu, form, scale, use_qk_l2norm, chunk_size,
      save_states):
    dg = q.new_empty(_NOT_ASKED) if g is None else g.new_empty(g.shape)
    dh0 = q.new_empty(_NOT_ASKED) if initial_state is None else initial_state.new_empty(initial_state.shape)
    return tuple(x.new_empty(x.shape) for x in (q, k, v, beta)) + (dg, dh0)


def _setup_context(ctx, inputs, output):
    q, k, v, beta, g, initial_state, cu_seqlens, cu_seqlens_cpu, form, scale, output_final_state, use_qk_l2norm, \
        chunk_size, _, save_states, _ = inputs
    ctx.save_for_backward(q, k, v, beta, g, initial_state, cu_seqlens, cu_seqlens_cpu)
    ctx.has_initial_state, ctx.has_gate = initial_state is not None, g is not None
    ctx.args = (form, scale, use_qk_l2norm, chunk_size, save_states)
    ctx.output_final_state = output_final_state


def _backward(ctx, do, dht, _):
    q, k, v, beta, g, initial_state, cu_seqlens, cu_seqlens_cpu = ctx.saved_tensors
    dq, dk, dv, dbeta, dg, dh0 = delta_rule_backward(
        do, dht if ctx.output_final_state else None, q, k, v, beta, g, initial_state, cu_seqlens, cu_seqlens_cpu,
        *ctx.args,
    )
    return (dq, dk, dv, dbeta, dg if ctx.has_gate else None, dh0 if ctx.has_initial_state else None) + (None,) * 10


delta_rule.register_autograd(_backward, setup_context=_setup_context)


def run_compiled(form, q, k, v, beta, scale, initial_state, output_final_state, use_qk_l2norm, cu_seqlens,
                 cu_seqlens_cpu, chunk_size: int = 64, output_attentions: bool = False,
                 inplace_final_state: bool = False, save_states: bool = False, g: Optional[Tensor] = None,
                 output_chunk_states: bool = False):
    """api._run (and api._run_gated, with g) under torch.compile (inputs already validated): the same results
    through the custom op."""
    o, final_state, extra = delta_rule(
        q, k, v, beta, g, initial_state, cu_seqlens, cu_seqlens_cpu, form, scale,
        output_final_state or inplace_final_state, use_qk_l2norm, chunk_size, output_attentions, save_states,
        output_chunk_states,
    )
    if inplace_final_state:
        final_state = initial_state.copy_(final_state)
    elif not output_final_state:
        final_state = None
    return (o, final_state, extra) if output_attentions or output_chunk_states else (o, final_state)
