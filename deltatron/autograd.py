"""Autograd wiring of the Triton backend: one torch.autograd.Function serves every form.

A form is a module of deltatron.kernels with two functions (the form contract, DESIGN.md §9):

    forward(q, k, v, beta, scale, initial_state, output_final_state, info, needs_backward, **options)
        -> (o, final_state or None, saved: tuple of tensors for backward, extras: tuple of outputs
            that take no gradient, e.g. an attention matrix); without needs_backward (inference) a form
            may save nothing and skip work done only for its backward
    backward(q, k, v, beta, scale, initial_state, saved, do, dht, info, **options)
        -> (dq, dk, dv, dbeta, dh0 or None)

A form may also have plan_call(q, k, v, info, needs_backward, **options) -> plan: the plan is made once per call
here and passed to both functions as options["plan"] (the chunk form's, DESIGN.md §6).

q and k arrive already L2-normalized when use_qk_l2norm_in_kernel is set (the norm and its chain rule
are applied here, in Triton); `info` is the SeqInfo of the packed batch; dht is None when the final
state took no gradient. Inputs are contiguous; gradients may come back in fp32 (cast here)."""
from __future__ import annotations

import torch

from .kernels.l2norm import l2norm_bwd, l2norm_fwd
from .validation import takes_grad


def run_form(form, q, k, v, beta, initial_state, scale, output_final_state, use_qk_l2norm, info, options, g=None):
    """(o, final_state, *extras) of a Triton form: through DeltaRuleFunction when a gradient can flow,
    else straight to the form's forward (inference and decoding: no autograd node, nothing kept alive, and an
    in-place state update returns the caller's own state tensor). g: the gated rule's log decays (DESIGN.md §11),
    passed to the form as g= (and its gradient returned) only where given."""
    inputs = (q, k, v, beta, initial_state, g)
    needs_backward = takes_grad(*inputs)
    gate = {} if g is None else {"g": g}
    plan_call = getattr(form, "plan_call", None)
    if plan_call is not None:  # one plan for the call: its forward and backward execute it
        options = dict(options, plan=plan_call(q, k, v, info, needs_backward, **options, **gate))
    if needs_backward:
        return DeltaRuleFunction.apply(*inputs, form, scale, output_final_state, use_qk_l2norm, info, options)
    if use_qk_l2norm and getattr(form, "NORMALIZES_QK", False):  # in the form's kernel: two launches fewer
        options = dict(options, qk_l2norm=True)
    elif use_qk_l2norm:
        q, _, k, _ = l2norm_fwd(q, k)
    o, final_state, _, extras = form.forward(q, k, v, beta, scale, initial_state, output_final_state, info,
                                             needs_backward=False, **options, **gate)
    return (o, final_state, *extras)


class DeltaRuleFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, beta, initial_state, g, form, scale, output_final_state, use_qk_l2norm, info, options):
        q_rstd = k_rstd = None
        if use_qk_l2norm:
            q, q_rstd, k, k_rstd = l2norm_fwd(q, k)
        gate = {} if g is None else {"g": g}
        o, final_state, saved, extras = form.forward(
            q, k, v, beta, scale, initial_state, output_final_state, info, needs_backward=True, **options, **gate
        )
        ctx.form, ctx.scale, ctx.info, ctx.options = form, scale, info, options
        ctx.use_qk_l2norm = use_qk_l2norm
        ctx.num_saved = len(saved)
        ctx.save_for_backward(q, k, v, beta, initial_state, g, q_rstd, k_rstd, *saved)
        ctx.mark_non_differentiable(*extras)
        return (o, final_state, *extras)

    @staticmethod
    def backward(ctx, do, dht, *_):
        q, k, v, beta, initial_state, g, q_rstd, k_rstd, *saved = ctx.saved_tensors
        gate = {} if g is None else {"g": g}
        dq, dk, dv, dbeta, dh0, *dg = ctx.form.backward(
            q, k, v, beta, ctx.scale, initial_state, tuple(saved), do.contiguous(),
            None if dht is None else dht.contiguous(), ctx.info, **ctx.options, **gate,
        )
        dg = dg[0] if dg and g is not None else None
        if ctx.use_qk_l2norm:
            dq, dk = l2norm_bwd(q, q_rstd, dq, k, k_rstd, dk)
        dh0 = _in_dtype(dh0, initial_state.dtype) if dh0 is not None and initial_state is not None else None
        dg = _in_dtype(dg, g.dtype) if dg is not None else None
        return (_in_dtype(dq, q.dtype), _in_dtype(dk, k.dtype), _in_dtype(dv, v.dtype), _in_dtype(dbeta, beta.dtype),
                dh0, dg, None, None, None, None, None, None)


def _in_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x.to(dtype), without the call where x has that dtype already (a no-op .to() still costs the host a torch
    call)."""
    return x if x.dtype == dtype else x.to(dtype)
