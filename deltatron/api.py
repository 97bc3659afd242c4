"""Public API (DESIGN.md §9): fla-compatible entry points. Thin: validation, backend choice, autograd wiring.

Layout: q, k [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; states [N, H, K, V] (N = B, or the number of
sequences in cu_seqlens, where B must be 1). Grouped value heads (chunk, fused_recurrent and the gated ops): v, beta,
g and the states have Hv, a multiple of q's and k's H, and value head h reads q, k head h // (Hv / H). Every entry
point returns (o, final_state); o has the input dtype, final_state is fp32 (None unless output_final_state)."""
from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from . import backends, context_parallel, library
from .reference import (chunk_delta_rule_reference, chunk_gated_delta_rule_reference, parallel_delta_rule_reference,
                        recurrent_delta_rule, recurrent_gated_delta_rule)
from .reference.common import compute_dtype, prepare_qk
from .validation import (check_gate_shape, check_inputs, check_state_pool, check_token_buffer, offsets_tensor,
                         reject_unknown_kwargs, takes_grad, warn_if_head_first)
from .varlen import VarlenMetadata, capturing, chunk_table

_TORCH_IMPLS = {
    "chunk": chunk_delta_rule_reference,
    "fused_chunk": chunk_delta_rule_reference,
    "fused_recurrent": recurrent_delta_rule,
    "parallel": parallel_delta_rule_reference,
}
_GATED_TORCH_IMPLS = {"chunk": chunk_gated_delta_rule_reference, "fused_recurrent": recurrent_gated_delta_rule}


def _run_gated_torch(form, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                     cu_seqlens, options):
    """(o in q's dtype, final_state) of the gated references (grouped heads; in fp32 for 16-bit inputs)."""
    dt = compute_dtype(q.dtype)
    qc, kc = prepare_qk(q, k, use_qk_l2norm_in_kernel)
    o, final_state = _GATED_TORCH_IMPLS[form](
        qc.to(dt), kc.to(dt), v.to(dt), g.to(dt), beta.to(dt), scale,
        None if initial_state is None else initial_state.to(dt), output_final_state, cu_seqlens, **options)
    return o.to(q.dtype), final_state


# the forms that take grouped value heads (v with more heads than q and k, DESIGN.md §11)
_GROUPED_FORMS = ("chunk", "fused_recurrent")


def _run(form, q, k, v, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
         cu_seqlens, cu_seqlens_cpu, kwargs, **options):
    reject_unknown_kwargs(f"{form}_delta_rule", kwargs)
    grouped = (isinstance(q, torch.Tensor) and isinstance(v, torch.Tensor) and q.dim() == v.dim() == 4
               and v.shape[2] != q.shape[2])
    if grouped and form not in _GROUPED_FORMS:
        raise ValueError(f"{form}_delta_rule: v has {v.shape[2]} heads and q, k {q.shape[2]}: grouped value heads "
                         f"run in chunk_delta_rule and fused_recurrent_delta_rule; here v must have q's heads")
    if beta is None and isinstance(v, torch.Tensor):
        beta = v.new_ones(v.shape[:3])
    pooled = options.get("state_indices") is not None  # initial_state is a pool, checked by _state_pool
    scale, cu_seqlens_cpu = check_inputs(q, k, v, beta, scale, None if pooled else initial_state, cu_seqlens,
                                         cu_seqlens_cpu, options.get("chunk_size"), grouped=grouped)
    prepared = _check_prepared(f"{form}_delta_rule", form, cu_seqlens, options.get("output_chunk_states"))
    if torch.compiler.is_compiling():
        # one opaque custom op (deltatron/library.py): no graph break; it runs this function at run time
        return library.run_compiled(form, q, k, v, beta, scale, initial_state, output_final_state,
                                    use_qk_l2norm_in_kernel, cu_seqlens, cu_seqlens_cpu, **options)
    backend = backends.select_backend(q)
    if backend == "torch":
        cu_seqlens = offsets_tensor(cu_seqlens)
        inplace = options.pop("inplace_final_state", False)
        options.pop("save_states", None)  # the reference's autograd keeps what it keeps
        if options.pop("output_chunk_states", False):
            o, final_state = _run("chunk", q, k, v, beta, scale, initial_state, output_final_state,
                                  use_qk_l2norm_in_kernel, cu_seqlens, cu_seqlens_cpu, {}, **options)
            return o, final_state, _chunk_states_torch(q, k, v, None, beta, scale, initial_state, cu_seqlens,
                                                       options["chunk_size"], use_qk_l2norm_in_kernel)
        if grouped:  # the gated references take grouped heads; with g = 0 they are the delta rule
            o, final_state = _run_gated_torch(form, q, k, v, v.new_zeros(v.shape[:3]), beta, scale, initial_state,
                                              output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, options)
            extras = []
        else:
            o, final_state, *extras = _TORCH_IMPLS[form](
                q, k, v, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
                **options,
            )
        if inplace:
            final_state = initial_state.copy_(final_state)
        return _torch_rows((o, final_state, *extras), q.shape[1])
    run_form, seq_info = _triton_dispatch()
    backends.check_triton_inputs(q, v)
    B, T = q.shape[:2]
    info = seq_info(B, T, q.device, cu_seqlens, cu_seqlens_cpu)
    q, k, v, beta = q.contiguous(), k.contiguous(), v.contiguous(), beta.contiguous()
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    result = run_form(backends.triton_form(form), q, k, v, beta, initial_state, scale, output_final_state,
                      use_qk_l2norm_in_kernel, info, options)
    return _zero_rows_past_sequences(result, info) if prepared else result


def _check_prepared(fn, form, cu_seqlens, output_chunk_states=False) -> bool:
    """Whether cu_seqlens is prepare_varlen's metadata, which the chunk and fused_recurrent forms take (the others
    refuse it, as output_chunk_states does: its per-chunk states would follow the capacity's spare chunks)."""
    if not isinstance(cu_seqlens, VarlenMetadata):
        return False
    if form not in ("chunk", "fused_recurrent"):
        raise ValueError(f"{fn}: prepare_varlen's metadata is taken by the chunk and fused_recurrent forms; pass "
                         f"cu_seqlens as a tensor here")
    if output_chunk_states:
        raise ValueError(f"{fn}: output_chunk_states does not combine with prepare_varlen's metadata")
    return True


def _zero_rows_past_sequences(result, info):
    """result with o's rows past the last sequence's end (prepared metadata's spare capacity: no kernel writes them)
    set to zero, on the device, without reading the offsets back."""
    o, *rest = result
    live = torch.arange(o.shape[1], device=o.device) < info.cu_seqlens[-1]
    return (torch.where(live.view(1, -1, 1, 1), o, 0), *rest)


def _torch_rows(result, T: int):
    """result with o zero-padded to T rows: the references return the rows the sequences cover, which prepared
    metadata's spare capacity leaves short of the tensors' T."""
    o, *rest = result
    return (F.pad(o, (0, 0, 0, 0, 0, T - o.shape[1])) if o.shape[1] < T else o, *rest)


@functools.lru_cache(maxsize=None)
def _triton_dispatch():
    """(autograd.run_form, kernels.utils.seq_info), imported on the first Triton call (they import triton,
    which a PyTorch-only install lacks) and cached: an import statement in the call path costs about 1 µs
    a call in importlib's machinery even when the module is loaded."""
    from .autograd import run_form
    from .kernels.utils import seq_info

    return run_form, seq_info


def chunk_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    cu_seqlens_cpu: Optional[torch.Tensor] = None,
    chunk_size: int = 64,
    save_states: bool = False,
    inplace_final_state: bool = False,
    ssm_state_indices: Optional[torch.Tensor] = None,
    output_chunk_states: bool = False,
    cp_group=None,
    **kwargs,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Delta rule by the chunkwise WY algorithm: the default for training and prefill.

    Args:
        q, k: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H] (fp16, bf16 or fp32; beta any float dtype). Grouped
            value heads: v [B, T, Hv, V], beta [B, T, Hv] and states [N, Hv, K, V], Hv a multiple of H.
        scale: factor on q·k, default K ** -0.5.
        initial_state: [N, H, K, V] state before the first token (fp32 recommended).
        output_final_state: also return the state after the last token, [N, H, K, V] fp32.
        use_qk_l2norm_in_kernel: L2-normalize q and k inside the op (gradients flow through the norm).
        cu_seqlens: [N + 1] int offsets of N packed sequences (B must be 1); lengths may be 0.
        cu_seqlens_cpu: the same offsets on the CPU; avoids a device sync when given.
        chunk_size: 16, 32 or 64.
        save_states: in training, keep the forward's per-chunk states for the backward instead of recomputing
            them there: the same gradients, a faster backward (it skips its recompute walk), for 1 KiB more per
            token and head (K = V = 128) held from the forward to the backward. Taken where the Hopper walk runs
            (sm_90, 16-bit, K = V = 128, chunk_size 64, no sequence split, an unsegmented backward; DESIGN.md §6);
            elsewhere, and under torch.compile's forward, it changes nothing.
        inplace_final_state, ssm_state_indices: a prefill into a serving engine's state pool, as
            fused_recurrent_delta_rule's (inference only). The chunk form reads the slots into dense states and
            writes the final states back (copies of N states, on the device only: capturable in a CUDA graph with
            prepare_varlen's metadata).
        output_chunk_states: also return the state entering every chunk, [NT, H, K, V] fp32 (chunks of
            chunk_size tokens along each sequence, sequence after sequence; an empty sequence has none), for prefix
            caching: chunk c + 1's entry is the state after chunk c (on a state pool, zeros for a padding entry's
            chunks). Under torch.compile with cu_seqlens, their number is an unbacked size of the graph.
        cp_group: context parallelism (DESIGN.md §13): a torch.distributed ProcessGroup over which the token stream
            is sharded; each rank passes its contiguous shard (ranks in group order; with cu_seqlens, T tokens on
            every rank and cu_seqlens the whole stream's offsets). o is the rank's shard; initial_state [N, ...]
            (the same on every rank) applies and the final states [N, ...] come back on every rank. The gradients
            are those of the sum of the ranks' losses (a rank's initial_state gradient is its share).
    Returns:
        (o [B, T, H, V] in the input dtype, final_state or None), and chunk_states with output_chunk_states."""
    warn_if_head_first("chunk_delta_rule", q)
    if cp_group is not None:
        return _context_parallel(
            "chunk_delta_rule", lambda v_, h0, cu, cu_cpu: chunk_delta_rule(
                q, k, v_, beta, scale, h0, True, use_qk_l2norm_in_kernel, cu, cu_cpu, chunk_size, save_states,
                **kwargs), q, k, v, beta, None, scale, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu,
            chunk_size, cp_group, dict(inplace_final_state=inplace_final_state,
                                       ssm_state_indices=ssm_state_indices is not None,
                                       output_chunk_states=output_chunk_states))
    if not isinstance(save_states, bool):
        raise TypeError(f"chunk_delta_rule: save_states must be a bool, got {save_states!r}")
    states = _chunk_states_option("chunk_delta_rule", output_chunk_states)
    if ssm_state_indices is not None:
        return _state_pool("chunk_delta_rule", chunk_delta_rule, q, k, v, beta, dict(
            scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
            cu_seqlens_cpu=cu_seqlens_cpu, chunk_size=chunk_size, **states, **kwargs), initial_state,
            ssm_state_indices, output_final_state, inplace_final_state, kernel_slots=False)[0]
    if inplace_final_state:
        _check_inplace(q, k, v, beta, initial_state)
        o, final_state, *extras = _run("chunk", q, k, v, beta, scale, initial_state, True, use_qk_l2norm_in_kernel,
                                       cu_seqlens, cu_seqlens_cpu, kwargs, chunk_size=chunk_size, **states)
        return (o, initial_state.copy_(final_state), *extras)
    return _run("chunk", q, k, v, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                cu_seqlens, cu_seqlens_cpu, kwargs, chunk_size=chunk_size, save_states=save_states, **states)


def fused_chunk_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    cu_seqlens_cpu: Optional[torch.Tensor] = None,
    chunk_size: int = 64,
    **kwargs,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The chunkwise algorithm with each (sequence, head) walked by one fused kernel that keeps every
    per-chunk intermediate on chip. Same arguments and results as chunk_delta_rule."""
    warn_if_head_first("fused_chunk_delta_rule", q)
    return _run("fused_chunk", q, k, v, beta, scale, initial_state, output_final_state,
                use_qk_l2norm_in_kernel, cu_seqlens, cu_seqlens_cpu, kwargs, chunk_size=chunk_size)


def fused_recurrent_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    cu_seqlens_cpu: Optional[torch.Tensor] = None,
    inplace_final_state: bool = False,
    ssm_state_indices: Optional[torch.Tensor] = None,
    num_accepted_tokens: Optional[torch.Tensor] = None,
    **kwargs,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The recurrence token by token: the decoding kernel (few tokens per call) and a GPU reference.

    Same arguments and results as chunk_delta_rule (beta defaults to ones), plus:
        inplace_final_state: write the final state into initial_state (which must be given, fp32 and
            contiguous) and return that tensor as final_state: one decode step allocates no state.
            Inference only (no gradients).
        ssm_state_indices: [N] int32/int64, a serving engine's state pool: initial_state is the pool [S, H, K, V]
            (fp32, contiguous) and sequence n starts from slot ssm_state_indices[n]; -1 marks a padding entry
            (its outputs are zeros, no slot is read or written). With inplace_final_state the final states go back
            into those slots and the pool is returned; else final_state is [N, H, K, V] (zeros for padding).
            Inference only; the slots are read from the device once per call (not while a CUDA graph is being
            captured) to check them against S.
            Speculative decoding (vLLM's layout): ssm_state_indices [N, W], a slot per token. Sequence n starts from
            slot [n, num_accepted_tokens[n] - 1] (num_accepted_tokens [N] in [1, W], the tokens the last step
            accepted; column 0 without it) and, with inplace_final_state, the state after its token j is written
            into slot [n, j] (-1: not written). Without inplace_final_state nothing is committed (a verify step)."""
    done, pool = _state_pool("fused_recurrent_delta_rule", fused_recurrent_delta_rule, q, k, v, beta, dict(
        scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu, **kwargs), initial_state, ssm_state_indices, output_final_state,
        inplace_final_state, num_accepted_tokens=num_accepted_tokens)
    if done is not None:
        return done
    if inplace_final_state and not pool:
        _check_inplace(q, k, v, beta, initial_state)
    return _run("fused_recurrent", q, k, v, beta, scale, initial_state, output_final_state or inplace_final_state,
                use_qk_l2norm_in_kernel, cu_seqlens, cu_seqlens_cpu, kwargs,
                inplace_final_state=inplace_final_state, **pool)


def parallel_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    cu_seqlens_cpu: Optional[torch.Tensor] = None,
    output_attentions: bool = False,
    **kwargs,
):
    """The fully parallel O(T^2) form, for short sequences and as a cross-check.

    Same arguments and results as chunk_delta_rule, plus:
        output_attentions: also return the delta-rule attention matrix P [B, H, T, T] (fp32; o equals
            P v when there is no initial state; block-diagonal over packed sequences). The result is
            then (o, final_state, P)."""
    warn_if_head_first("parallel_delta_rule", q)
    return _run("parallel", q, k, v, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                cu_seqlens, cu_seqlens_cpu, kwargs, output_attentions=output_attentions)


def fused_sigmoid_gating_delta_rule_update(
    A_log: torch.Tensor,
    a: torch.Tensor,
    dt_bias: torch.Tensor,
    softplus_beta: float,
    softplus_threshold: float,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    b: torch.Tensor,
    initial_state_source: torch.Tensor,
    initial_state_indices: torch.Tensor,
    scale: Optional[float] = None,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    cu_seqlens_cpu: Optional[torch.Tensor] = None,
    disable_state_update: bool = False,
    intermediate_states_buffer: Optional[torch.Tensor] = None,
    intermediate_state_indices: Optional[torch.Tensor] = None,
    cache_steps: Optional[int] = None,
) -> torch.Tensor:
    """A serving engine's gated decode step from the raw projections, vLLM's and SGLang's
    fused_sigmoid_gating_delta_rule_update: g = -exp(A_log) softplus(a + dt_bias) (softplus(x) = log(1 + exp(sx)) / s
    with s = softplus_beta, x itself where s x > softplus_threshold), beta = sigmoid(b), the optional L2 norm of q
    and k, and the gated delta rule from and back into the slots initial_state_indices [N] of the state pool
    initial_state_source [S, Hv, K, V] (-1: a padding entry). Returns o [B, T, Hv, V]. On the Triton backend all of
    it is one kernel launch; inference only.

    q, k [B, T, Hk, K]; v [B, T, Hv, V]; a, b [B, T, Hv]; A_log, dt_bias [Hv]; cu_seqlens as fused_recurrent's.

    Speculative verify (SGLang's): intermediate_states_buffer [R, steps, Hv, K, V] (fp32, contiguous, the pool's
    layout) receives the state after token j of sequence n at [intermediate_state_indices[n], j], for j < steps
    (cache_steps, if given, must be steps; an index of -1, or a padding sequence, writes nothing), and
    disable_state_update=True leaves the pool's slots as they were: the tokens are verified without committing, and
    the engine later copies the state after the last accepted token from the buffer."""
    fn = "fused_sigmoid_gating_delta_rule_update"
    if not isinstance(disable_state_update, bool):
        raise TypeError(f"{fn}: disable_state_update must be a bool, got {disable_state_update!r}")
    for name, x in (("a", a), ("b", b), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(x).__name__}")
    Hv = v.shape[2] if v.dim() == 4 else -1
    for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != (Hv,) or not x.is_floating_point():
            raise ValueError(f"{fn}: {name} must be a floating-point [Hv] = [{Hv}] tensor, got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    for name, x in (("softplus_beta", softplus_beta), ("softplus_threshold", softplus_threshold)):
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not x > 0:
            raise ValueError(f"{fn}: {name} must be a positive number, got {x!r}")
    N = (v.shape[0] if cu_seqlens is None else cu_seqlens.num_seqs if isinstance(cu_seqlens, VarlenMetadata) else
         cu_seqlens.shape[0] - 1)
    token_buffer = check_token_buffer(fn, intermediate_states_buffer, intermediate_state_indices, cache_steps, N,
                                      tuple(initial_state_source.shape[1:]) if isinstance(
                                          initial_state_source, torch.Tensor) else None, q.device)
    if torch.compiler.is_compiling() or backends.select_backend(q) == "torch":
        g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float(), beta=softplus_beta,
                                              threshold=softplus_threshold)
        args = (q, k, v, g, b.float().sigmoid())
        options = dict(scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
                       cu_seqlens_cpu=cu_seqlens_cpu)
        if token_buffer is None:
            return fused_recurrent_gated_delta_rule(*args, initial_state=initial_state_source,
                                                    inplace_final_state=not disable_state_update,
                                                    ssm_state_indices=initial_state_indices, **options)[0]
        _refuse_token_states_under_compile(fn)
        return _verify_torch(args, options, initial_state_source, initial_state_indices, token_buffer,
                             disable_state_update)
    scale, cu_seqlens_cpu = check_inputs(q, k, v, b, scale, None, cu_seqlens, cu_seqlens_cpu, g=a, grouped=True)
    prepared = _check_prepared(fn, "fused_recurrent", cu_seqlens)
    _check_pool(fn, q, k, v, b, a, initial_state_source, initial_state_indices, cu_seqlens)
    backends.check_triton_inputs(q, v)
    _, seq_info = _triton_dispatch()
    info = seq_info(q.shape[0], q.shape[1], q.device, cu_seqlens, cu_seqlens_cpu)
    q, k, v, a, b = (x.contiguous() for x in (q, k, v, a, b))
    commit = not disable_state_update
    o, _, _, _ = backends.triton_form("fused_recurrent").forward(
        q, k, v, b, scale, initial_state_source, commit, info, needs_backward=False, inplace_final_state=commit, g=a,
        state_indices=initial_state_indices, raw_gate=(A_log, dt_bias, softplus_beta, softplus_threshold),
        token_buffer=token_buffer,
        beta_logits_scale=1.0, qk_l2norm=use_qk_l2norm_in_kernel)
    return _zero_rows_past_sequences((o,), info)[0] if prepared else o


def _check_pool(fn_name, q, k, v, beta, g, pool, state_indices, cu_seqlens, v_first=False,
                num_accepted_tokens=None) -> int:
    """Checks a call on a state pool (validation.check_state_pool), inference only; returns N, the sequences."""
    if not isinstance(v, torch.Tensor) or v.dim() != 4 or not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"{fn_name}: q [B, T, H, K] and v [B, T, Hv, V] tensors are needed with a state pool")
    N = (v.shape[0] if cu_seqlens is None else cu_seqlens.num_seqs if isinstance(cu_seqlens, VarlenMetadata) else
         cu_seqlens.shape[0] - 1)
    K, V = q.shape[-1], v.shape[-1]
    check_state_pool(fn_name, pool, state_indices, N, v.shape[2], *((V, K) if v_first else (K, V)), q.device,
                     num_accepted_tokens)
    if takes_grad(q, k, v, beta, g, pool):
        raise ValueError(f"{fn_name}: a state pool is for inference: call it under torch.no_grad()")
    return N


def _state_pool(fn_name, fn, q, k, v, beta, options, pool, state_indices, output_final_state, inplace, g=None,
                kernel_slots=True, num_accepted_tokens=None):
    """A call on states held in a pool by slot (ssm_state_indices), as (result, kernel options). Without slots:
    (None, {}). Where the Triton kernel reads and writes the slots itself (kernel_slots: the fused_recurrent kernel,
    [K, V] or [V, K] states): (None, the options that pass the slots to it). Elsewhere (the PyTorch backend, which
    defines the semantics, the chunk form, torch.compile): (fn's (o, final_state, and chunk states where options ask) on
    the slots read into dense states, with the final states written back into the slots (inplace) or returned per
    sequence, padding entries zeroed, {}); on the Triton backend the slots are read and written on the device only
    (kernels.state_pool), so that the call can be captured in a CUDA graph.
    Slots per token ([N, W]): the sequence starts from column num_accepted_tokens - 1 (or 0) and, inplace, the state
    after its token j goes to slot [n, j] (the states after each token made one token at a time)."""
    if state_indices is None:
        if num_accepted_tokens is not None:
            raise ValueError(f"{fn_name}: num_accepted_tokens needs ssm_state_indices [N, W]")
        return None, {}
    cu, v_first = options.get("cu_seqlens"), options.get("state_v_first", False)
    N = _check_pool(fn_name, q, k, v, beta, g, pool, state_indices, cu, v_first, num_accepted_tokens)
    if kernel_slots and _slot_kernels(q):
        return None, {"state_indices": state_indices, "num_accepted_tokens": num_accepted_tokens}
    token_states = state_indices.dim() == 2 and inplace  # the PyTorch definition, one token at a time
    if capturing() and (token_states or not _slot_kernels(q)):
        raise RuntimeError(f"{fn_name}: {'a state per token' if token_states else 'the PyTorch backend'} reads the "
                           f"pool's slots back on the host and cannot be captured in a CUDA graph; capture the Triton "
                           f"backend's fused_recurrent (decode, verify) or chunk (prefill) on a [S, Hv, K, V] pool")
    gate = {} if g is None else {"g": g}
    cu = offsets_tensor(cu)
    first = state_indices
    if state_indices.dim() == 2:
        column = (num_accepted_tokens - 1 if num_accepted_tokens is not None else
                  torch.zeros_like(state_indices[:, 0]))
        first = state_indices.gather(1, column.long()[:, None]).squeeze(1)
    live = first >= 0
    h0 = _read_slots(pool, first, q)
    if token_states:
        _refuse_token_states_under_compile(fn_name)
        return (_token_states_into_pool(fn, q, k, v, beta, g, h0, options, pool, state_indices, live), pool), {}
    o, final_state, *extras = fn(q, k, v, beta=beta, initial_state=h0, output_final_state=True, **gate, **options)
    if cu is None:
        o = o * live.view(-1, 1, 1, 1).to(o.dtype)
    else:  # each token's sequence, from the offsets
        # each row's sequence (N past the last one: prepared metadata's spare rows, zeroed with the padding)
        seq = torch.searchsorted(cu[1:].long(), torch.arange(o.shape[1], device=o.device), right=True)
        o = o * torch.cat([live, live.new_zeros(1)])[seq].view(1, -1, 1, 1).to(o.dtype)
    if extras:  # output_chunk_states: a padding entry's chunks read as zeros too
        offsets = torch.arange(N + 1) * o.shape[1] if cu is None else cu.cpu()
        seq_of_chunk = chunk_table(offsets, options["chunk_size"])[0].to(live.device)
        extras = [extras[0] * live[seq_of_chunk].view(-1, 1, 1, 1)]
    if inplace:
        _write_slots(pool, final_state, first, q)
        return (o, pool, *extras), {}
    return (o, final_state * live.view(-1, 1, 1, 1) if output_final_state else None, *extras), {}


def _slot_kernels(q) -> bool:
    """Whether Triton kernels read and write a pool's slots (the fused_recurrent kernel itself, or kernels.state_pool
    around a call on dense states; no host read of the slots): on the Triton backend outside torch.compile, whose
    custom op takes dense states (there torch's index ops serve)."""
    return not torch.compiler.is_compiling() and backends.select_backend(q) == "triton"


def _read_slots(pool, slots, q) -> torch.Tensor:
    """pool[slots] as dense states [N, ...], zeros where the slot is -1."""
    if _slot_kernels(q):
        from .kernels.state_pool import read_slots
        return read_slots(pool, slots)
    return pool.index_select(0, slots.clamp(min=0)) * (slots >= 0).view(-1, 1, 1, 1)


def _write_slots(pool, states, slots, q) -> None:
    """pool[slots[n]] = states[n] where the slot is not -1."""
    if _slot_kernels(q):
        from .kernels.state_pool import write_slots
        return write_slots(pool, states, slots)
    rows = (slots >= 0).nonzero().squeeze(1)
    pool.index_copy_(0, slots.index_select(0, rows).long(), states.index_select(0, rows))


def _chunk_states_option(fn_name, output_chunk_states) -> dict:
    """The chunk form's options for output_chunk_states (checked)."""
    if not isinstance(output_chunk_states, bool):
        raise TypeError(f"{fn_name}: output_chunk_states must be a bool, got {output_chunk_states!r}")
    return {"output_chunk_states": True} if output_chunk_states else {}


def _chunk_states_torch(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size, use_qk_l2norm_in_kernel):
    """The state entering every chunk [NT, Hv, K, V] (fp32; float64 for float64 inputs) by the gated recurrence (g
    None: the delta rule), chunk by chunk along each sequence: output_chunk_states on the PyTorch backend."""
    dt = compute_dtype(q.dtype)
    qc, kc = prepare_qk(q, k, use_qk_l2norm_in_kernel)
    B, T, Hv = v.shape[:3]
    g = v.new_zeros(v.shape[:3]) if g is None else g
    spans = ([(b, 0, T) for b in range(B)] if cu_seqlens is None else
             [(0, int(a), int(b)) for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())])
    states = []
    with torch.no_grad():
        for n, (row, start, end) in enumerate(spans):
            S = (initial_state[n].to(dt) if initial_state is not None else
                 v.new_zeros(Hv, q.shape[-1], v.shape[-1], dtype=dt))
            for c0 in range(start, end, chunk_size):
                states.append(S)
                x = [t[row:row + 1, c0:min(c0 + chunk_size, end)].to(dt) for t in (qc, kc, v, g, beta)]
                S = recurrent_gated_delta_rule(*x, scale, S[None], True)[1][0]
    return torch.stack(states) if states else v.new_zeros(0, Hv, q.shape[-1], v.shape[-1], dtype=dt)


def _refuse_token_states_under_compile(fn_name) -> None:
    """The per-token states of a verify step (slots [N, W] written in place, SGLang's intermediate_states_buffer) are
    made one token at a time outside the Triton kernel, which torch.compile cannot trace."""
    if torch.compiler.is_compiling():
        raise RuntimeError(f"{fn_name}: a state per token (ssm_state_indices [N, W] with inplace_final_state, or "
                           f"intermediate_states_buffer) is not supported under torch.compile; call the step outside "
                           f"the compiled region (on the Triton backend it is one kernel launch, CUDA-graph safe)")


def _token_states_into_pool(fn, q, k, v, beta, g, h0, options, pool, state_indices, live) -> torch.Tensor:
    """o of fn run one token at a time from the states h0, each live sequence's state after its token j written into
    slot state_indices[n, j] (where j < W and the slot is not -1); padding sequences output zeros."""
    slots = state_indices.tolist()

    def store(n, j, state):
        if j < len(slots[n]) and slots[n][j] >= 0:
            pool[slots[n][j]] = state

    return _token_by_token(fn, q, k, v, beta, g, h0, options, live, store)


def _token_by_token(fn, q, k, v, beta, g, h0, options, live, store) -> torch.Tensor:
    """o of fn run one token at a time from the states h0 (the PyTorch backend's definition of the per-token state
    outputs), store(n, j, state) called with each live sequence's state after its token j; padding sequences (not
    live) output zeros."""
    cu = offsets_tensor(options.get("cu_seqlens"))
    options = {name: x for name, x in options.items() if name not in ("cu_seqlens", "cu_seqlens_cpu")}
    spans = ([(n, 0, v.shape[1]) for n in range(v.shape[0])] if cu is None else
             [(0, int(a), int(b)) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])
    o = torch.zeros(v.shape, dtype=q.dtype, device=v.device)
    for n, (row, start, end) in enumerate(spans):
        if not bool(live[n]):
            continue
        state = h0[n:n + 1]
        for t in range(start, end):
            step = [x[row:row + 1, t:t + 1] for x in (q, k, v, beta)]
            gate = {} if g is None else {"g": g[row:row + 1, t:t + 1]}
            o[row:row + 1, t:t + 1], state = fn(*step[:3], beta=step[3], initial_state=state, output_final_state=True,
                                                **gate, **options)
            store(n, t - start, state[0])
    return o


def _verify_torch(args, options, pool, slots, token_buffer, disable_state_update) -> torch.Tensor:
    """fused_sigmoid_gating_delta_rule_update's speculative verify on the PyTorch backend: o, every token's state into
    its buffer row and step, and (unless disable_state_update) each live sequence's last state into its slot."""
    q, k, v, g, beta = args
    buffer, rows = token_buffer
    live = slots >= 0
    h0 = _read_slots(pool, slots, q)
    row_of, last = rows.tolist(), {}

    def store(n, j, state):
        last[n] = state
        if 0 <= row_of[n] < buffer.shape[0] and j < buffer.shape[1]:
            buffer[row_of[n], j] = state

    o = _token_by_token(fused_recurrent_gated_delta_rule, q, k, v, beta, g, h0, options, live, store)
    if not disable_state_update:
        for n, state in last.items():
            pool[int(slots[n])] = state
    return o


def _context_parallel(fn, op, q, k, v, beta, g, scale, initial_state, output_final_state, cu_seqlens,
                      cu_seqlens_cpu, chunk_size, cp_group, refused, per_channel=False):
    """(o, final_state) of a chunk op whose token stream is sharded over cp_group (deltatron/context_parallel.py);
    op(v, initial_state, cu_seqlens, cu_seqlens_cpu) is the rule's op on this rank's shard."""
    context_parallel.check_group(fn, cp_group, refused)
    if isinstance(cu_seqlens, VarlenMetadata):
        raise ValueError(f"{fn}: cp_group takes cu_seqlens as a tensor of the whole stream's offsets, not "
                         f"prepare_varlen's metadata")
    _, cu_seqlens_cpu = check_inputs(q, k, v, beta, scale, initial_state, cu_seqlens, cu_seqlens_cpu, chunk_size,
                                     g=g, grouped=True, shards=context_parallel.dist.get_world_size(cp_group),
                                     per_channel_gate=per_channel)
    return context_parallel.sharded_chunk(op, v, q.shape[-1], initial_state, output_final_state, cu_seqlens_cpu,
                                          cp_group)


def _check_inplace(q, k, v, beta, initial_state) -> None:
    if initial_state is None:
        raise ValueError("inplace_final_state=True needs initial_state: the tensor that receives the new state")
    if initial_state.dtype != torch.float32 or not initial_state.is_contiguous():
        raise ValueError(
            f"inplace_final_state=True needs a contiguous float32 initial_state, got {initial_state.dtype}"
            f"{'' if initial_state.is_contiguous() else ', non-contiguous'}"
        )
    if takes_grad(q, k, v, beta, initial_state):
        raise ValueError("inplace_final_state=True is for inference: call it under torch.no_grad()")


# ---------------------------------------------------------------------------------------------------------------
# The gated delta rule (Gated DeltaNet, DESIGN.md §11): fla's chunk_gated_delta_rule and
# fused_recurrent_gated_delta_rule, with grouped value heads

def _gate(fn, g, beta, A_log, dt_bias, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, Hv,
          K=None):
    """(g, beta) as the recurrence takes them, from the raw projections where the flags say so:
    g = -exp(A_log) softplus(g + dt_bias) (fp32) and beta = sigmoid(beta), times 2 with allow_neg_eigval. A_log and
    dt_bias are [Hv] for the per-head gate; with K (KDA's per-channel gate, Kimi Linear's form) A_log has Hv values
    ([Hv], or Kimi Linear's [1, 1, Hv, 1]) and dt_bias one per value head and key channel ([Hv * K] or [Hv, K])."""
    for name, flag in (("use_gate_in_kernel", use_gate_in_kernel),
                       ("use_beta_sigmoid_in_kernel", use_beta_sigmoid_in_kernel),
                       ("allow_neg_eigval", allow_neg_eigval)):
        if not isinstance(flag, bool):
            raise TypeError(f"{fn}: {name} must be a bool, got {flag!r}")
    if use_gate_in_kernel:
        shapes = {"A_log": ((Hv,),), "dt_bias": ((Hv,),)} if K is None else {
            "A_log": ((Hv,), (1, 1, Hv, 1)), "dt_bias": ((Hv * K,), (Hv, K))}
        for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
            want = " or ".join(str(list(shape)) for shape in shapes[name])
            if not isinstance(x, torch.Tensor):
                raise ValueError(f"{fn}: use_gate_in_kernel=True needs {name} {want}, got {x!r}")
            if tuple(x.shape) not in shapes[name] or not x.is_floating_point():
                raise ValueError(f"{fn}: {name} must be a floating-point {want} tensor, got {tuple(x.shape)} "
                                 f"{x.dtype}")
        if K is None:
            g = -A_log.float().exp() * F.softplus(g.float() + dt_bias.float())
        else:
            g = -A_log.float().reshape(Hv, 1).exp() * F.softplus(g.float() + dt_bias.float().reshape(Hv, K))
    elif A_log is not None or dt_bias is not None:
        raise ValueError(f"{fn}: A_log and dt_bias are read only with use_gate_in_kernel=True")
    if use_beta_sigmoid_in_kernel:
        beta = beta.float().sigmoid()
    if allow_neg_eigval:
        beta = beta * 2.0
    return g, beta


def _run_gated(form, fn, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
               cu_seqlens, cu_seqlens_cpu, kwargs, gate, state_v_first, inplace_final_state=False, chunk_size=None,
               state_indices=None, num_accepted_tokens=None, output_chunk_states=False, per_channel=False):
    reject_unknown_kwargs(fn, kwargs)
    if not isinstance(state_v_first, bool):
        raise TypeError(f"{fn}: state_v_first must be a bool, got {state_v_first!r}")
    for name, x in (("q", q), ("v", v), ("g", g)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(x).__name__}")
    if v.dim() != 4:
        raise ValueError(f"{fn}: v must have shape [B, T, Hv, V], got {list(v.shape)}")
    if q.dim() != 4:
        raise ValueError(f"{fn}: q must have shape [B, T, Hk, K], got {list(q.shape)}")
    if beta is None:
        beta = v.new_ones(v.shape[:3])
    Hv, K = v.shape[2], q.shape[3]
    if gate[2]:  # use_gate_in_kernel: g's shape checked before the gate is made from it
        check_gate_shape(g, *v.shape[:3], K, per_channel)
    g, beta = _gate(fn, g, beta, *gate, Hv, K if per_channel else None)
    # the kernels' layout is [N, Hv, K, V]; state_v_first callers keep their pool as [N, Hv, V, K]
    h0 = initial_state.transpose(-1, -2) if state_v_first and isinstance(initial_state, torch.Tensor) else initial_state
    # with state_indices, h0 is a pool _state_pool checked (the Triton kernel reads its slots)
    scale, cu_seqlens_cpu = check_inputs(q, k, v, beta, scale, None if state_indices is not None else h0, cu_seqlens,
                                         cu_seqlens_cpu, chunk_size, g=g, grouped=True, per_channel_gate=per_channel)
    if inplace_final_state:
        _check_inplace(q, k, v, beta, initial_state)
        output_final_state = True
    _check_prepared(fn, form, cu_seqlens, output_chunk_states)
    extras = ()
    if torch.compiler.is_compiling():
        # the same custom op as the ungated rule's, carrying g (deltatron/library.py): no graph break
        o, final_state, *extras = library.run_compiled(
            form, q, k, v, beta, scale, h0, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, cu_seqlens_cpu,
            g=g, output_chunk_states=output_chunk_states, **({} if chunk_size is None else {"chunk_size": chunk_size}))
    else:
        # inference on the Triton backend: the fused_recurrent kernel reads and writes [V, K] states itself
        v_first_kernel = (state_v_first and form == "fused_recurrent" and backends.select_backend(q) == "triton"
                          and not takes_grad(q, k, v, g, beta, initial_state))
        in_place = inplace_final_state and form == "fused_recurrent" and (v_first_kernel or not state_v_first)
        o, final_state, *extras = _gated_core(form, q, k, v, g, beta, scale, initial_state if v_first_kernel else h0,
                                              output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, cu_seqlens_cpu,
                                              chunk_size, in_place, state_indices, num_accepted_tokens,
                                              output_chunk_states, v_first_kernel)
        if in_place or v_first_kernel:  # the kernel wrote the caller's state, or [V, K] states
            return o, final_state
    if final_state is not None and state_v_first:
        final_state = final_state.transpose(-1, -2).contiguous()
    if inplace_final_state:
        final_state = initial_state.copy_(final_state)
    return (o, final_state, *extras)


def _gated_core(form, q, k, v, g, beta, scale, h0, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
                cu_seqlens_cpu, chunk_size=None, inplace_final_state=False, state_indices=None,
                num_accepted_tokens=None, output_chunk_states=False, state_v_first=False):
    """(o, final_state [N, Hv, K, V]) of the gated rule on validated inputs (g and beta as the recurrence takes
    them), on the call's backend; inplace_final_state: the final state is written into h0 (by the Triton
    fused_recurrent kernel itself) and h0 returned; output_chunk_states (chunk): the state entering every chunk
    after them; state_v_first (the Triton fused_recurrent form, inference): h0 and the final state are [.., V, K]."""
    if backends.select_backend(q) == "torch":
        cu_seqlens = offsets_tensor(cu_seqlens)
        o, final_state = _run_gated_torch(form, q, k, v, g, beta, scale, h0, output_final_state,
                                          use_qk_l2norm_in_kernel, cu_seqlens,
                                          {} if chunk_size is None else {"chunk_size": chunk_size})
        extras = (_chunk_states_torch(q, k, v, g, beta, scale, h0, cu_seqlens, chunk_size, use_qk_l2norm_in_kernel),
                  ) if output_chunk_states else ()
        return _torch_rows((o, h0.copy_(final_state) if inplace_final_state else final_state, *extras), q.shape[1])
    if form == "chunk" and g.dim() == 4:
        from .kernels.chunk import plan as chunk_plan
        refusal = chunk_plan.kda_chunk_refusal(q.shape[-1], v.shape[-1], chunk_plan.device_capabilities(q.device))
        if refusal and output_chunk_states:
            raise ValueError(f"chunk_kda: output_chunk_states needs the chunk kernels' walk, and {refusal}")
        if refusal:  # head sizes this device's shared memory does not take in KDA's chunk kernels (DESIGN.md §12)
            form = "fused_recurrent"
    run_form, seq_info = _triton_dispatch()
    backends.check_triton_inputs(q, v)
    B, T = q.shape[:2]
    info = seq_info(B, T, q.device, cu_seqlens, cu_seqlens_cpu)
    q, k, v, beta, g = q.contiguous(), k.contiguous(), v.contiguous(), beta.contiguous(), g.contiguous()
    if h0 is not None:
        h0 = h0.contiguous()  # the caller's own tensor where the kernel updates it in place (checked contiguous)
    options = ({"inplace_final_state": inplace_final_state, **({"state_v_first": True} if state_v_first else {})}
               if form == "fused_recurrent" else
               {"chunk_size": chunk_size, **({"output_chunk_states": True} if output_chunk_states else {})})
    if state_indices is not None:
        options.update(state_indices=state_indices, num_accepted_tokens=num_accepted_tokens)
    result = run_form(backends.triton_form(form), q, k, v, beta, h0, scale, output_final_state,
                      use_qk_l2norm_in_kernel, info, options, g=g)
    return tuple(_zero_rows_past_sequences(result, info) if info.prepared else result)


_GATE_ARGS = ("A_log", "dt_bias", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval")


def _chunk_gated(fn_name, entry, per_channel, q, k, v, g, beta, scale, initial_state, output_final_state,
                 use_qk_l2norm_in_kernel, cu_seqlens, cu_seqlens_cpu, chunk_size, gate, state_v_first,
                 inplace_final_state, ssm_state_indices, output_chunk_states, kwargs, cp_group=None):
    """chunk_gated_delta_rule (per_channel False) and chunk_kda (True): entry is the public function, which a state
    pool's call runs again on the gathered slots, and context parallelism on each rank's shard; gate: the values of
    _GATE_ARGS."""
    if cp_group is not None:
        flip = state_v_first and isinstance(initial_state, torch.Tensor)
        o, final_state = _context_parallel(
            fn_name, lambda v_, h0, cu, cu_cpu: entry(q, k, v_, g, beta, scale, h0, True, use_qk_l2norm_in_kernel, cu,
                                                      cu_cpu, chunk_size, **dict(zip(_GATE_ARGS, gate)), **kwargs),
            q, k, v, beta, g, scale, initial_state.transpose(-1, -2) if flip else initial_state, output_final_state,
            cu_seqlens, cu_seqlens_cpu, chunk_size, cp_group, dict(
                inplace_final_state=inplace_final_state, ssm_state_indices=ssm_state_indices is not None,
                output_chunk_states=output_chunk_states), per_channel)
        flip = state_v_first and final_state is not None
        return o, final_state.transpose(-1, -2).contiguous() if flip else final_state
    states = _chunk_states_option(fn_name, output_chunk_states)
    if ssm_state_indices is not None:
        return _state_pool(fn_name, entry, q, k, v, beta, dict(
            scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
            cu_seqlens_cpu=cu_seqlens_cpu, chunk_size=chunk_size, state_v_first=state_v_first,
            **dict(zip(_GATE_ARGS, gate)), **states, **kwargs), initial_state, ssm_state_indices, output_final_state,
            inplace_final_state, g=g, kernel_slots=False)[0]
    return _run_gated("chunk", fn_name, q, k, v, g, beta, scale, initial_state, output_final_state,
                      use_qk_l2norm_in_kernel, cu_seqlens, cu_seqlens_cpu, kwargs, gate, state_v_first,
                      inplace_final_state=inplace_final_state, chunk_size=chunk_size, per_channel=per_channel,
                      **states)


def _fused_recurrent_gated(fn_name, entry, per_channel, q, k, v, g, beta, scale, initial_state, output_final_state,
                           use_qk_l2norm_in_kernel, cu_seqlens, cu_seqlens_cpu, inplace_final_state, gate,
                           state_v_first, ssm_state_indices, num_accepted_tokens, kwargs):
    """fused_recurrent_gated_delta_rule (per_channel False) and fused_recurrent_kda (True), as _chunk_gated."""
    done, pool = _state_pool(fn_name, entry, q, k, v, beta, dict(
        scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu, state_v_first=state_v_first, **dict(zip(_GATE_ARGS, gate)), **kwargs),
        initial_state, ssm_state_indices, output_final_state, inplace_final_state, g=g,
        num_accepted_tokens=num_accepted_tokens)
    if done is not None:
        return done
    return _run_gated("fused_recurrent", fn_name, q, k, v, g, beta, scale, initial_state, output_final_state,
                      use_qk_l2norm_in_kernel, cu_seqlens, cu_seqlens_cpu, kwargs, gate, state_v_first,
                      inplace_final_state=inplace_final_state, per_channel=per_channel, **pool)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    cu_seqlens_cpu: Optional[torch.Tensor] = None,
    chunk_size: int = 64,
    use_gate_in_kernel: bool = False,
    A_log: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    inplace_final_state: bool = False,
    ssm_state_indices: Optional[torch.Tensor] = None,
    output_chunk_states: bool = False,
    cp_group=None,
    **kwargs,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The gated delta rule (Gated DeltaNet) by the chunkwise form, with grouped value heads (DESIGN.md §11):
    per token S <- exp(g_t) S, then the delta rule's update; fla's chunk_gated_delta_rule.

    Args (as chunk_delta_rule's, plus):
        q, k: [B, T, Hk, K]; v: [B, T, Hv, V] with Hv a multiple of Hk (value head h reads q, k head
            h // (Hv / Hk)); g, beta: [B, T, Hv]; states [N, Hv, K, V] fp32 (or [N, Hv, V, K] with state_v_first).
        g: log decays (<= 0), or with use_gate_in_kernel the raw projection a: g = -exp(A_log) softplus(a + dt_bias),
            A_log and dt_bias [Hv], with gradients to all three.
        use_beta_sigmoid_in_kernel: beta holds logits (beta = sigmoid(beta)); allow_neg_eigval: beta in (0, 2)
            (beta times 2).
        inplace_final_state, ssm_state_indices, output_chunk_states: as chunk_delta_rule's (a prefill into a state
            pool, in its layout; the chunk states in the kernels' [NT, Hv, K, V] layout).
        cp_group: context parallelism, as chunk_delta_rule's."""
    return _chunk_gated("chunk_gated_delta_rule", chunk_gated_delta_rule, False, q, k, v, g, beta, scale, initial_state,
                        output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, cu_seqlens_cpu, chunk_size,
                        (A_log, dt_bias, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval),
                        state_v_first, inplace_final_state, ssm_state_indices, output_chunk_states, kwargs, cp_group)


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    cu_seqlens_cpu: Optional[torch.Tensor] = None,
    inplace_final_state: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    ssm_state_indices: Optional[torch.Tensor] = None,
    num_accepted_tokens: Optional[torch.Tensor] = None,
    **kwargs,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The gated delta rule token by token (decoding), forward and backward; fla's fused_recurrent_gated_delta_rule.
    Arguments as chunk_gated_delta_rule's (beta defaults to ones), plus inplace_final_state, ssm_state_indices and
    num_accepted_tokens as fused_recurrent_delta_rule's (the new states written into initial_state, or into its
    slots, in its layout)."""
    return _fused_recurrent_gated(
        "fused_recurrent_gated_delta_rule", fused_recurrent_gated_delta_rule, False, q, k, v, g, beta, scale,
        initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, cu_seqlens_cpu, inplace_final_state,
        (A_log, dt_bias, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval), state_v_first,
        ssm_state_indices, num_accepted_tokens, kwargs)


# ---------------------------------------------------------------------------------------------------------------
# Kimi Delta Attention (KDA, DESIGN.md §12): the gated delta rule with a log decay per key channel, g [B, T, Hv, K];
# fla's chunk_kda and fused_recurrent_kda, on the gated rule's plumbing (the references and kernels take either gate)

def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    cu_seqlens_cpu: Optional[torch.Tensor] = None,
    chunk_size: int = 64,
    use_gate_in_kernel: bool = False,
    A_log: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    inplace_final_state: bool = False,
    ssm_state_indices: Optional[torch.Tensor] = None,
    output_chunk_states: bool = False,
    cp_group=None,
    **kwargs,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Kimi Delta Attention (DESIGN.md §12), fla's chunk_kda: per token S <- diag(exp(g_t)) S (row c of the
    [K, V] state decays by exp(g_t[c])), then the delta rule's update; o_t = scale S^T q_t.

    Args as chunk_gated_delta_rule's, except:
        g: [B, T, Hv, K] log decays per key channel (<= 0), or with use_gate_in_kernel the raw projection:
            g = -exp(A_log) softplus(g + dt_bias) per channel (Kimi Linear's gate), A_log [Hv] (or [1, 1, Hv, 1]) and
            dt_bias [Hv * K] (or [Hv, K]), with gradients to all three.
    On the PyTorch backend it is the chunkwise float64-stable form (every decay factor exp of a non-positive
    difference of within-chunk cumulative sums per channel). On the Triton backend it runs the chunkwise kernels with
    the per-channel gate, forward and backward (every exponent a sum of g within 16-token sub-chunks), at every head
    size up to 256 where the GPU's shared memory holds them (above 128: sm_90 and sm_100); elsewhere heads above 128
    run the token-serial fused_recurrent kernels (chunk_size then unused past its check)."""
    return _chunk_gated("chunk_kda", chunk_kda, True, q, k, v, g, beta, scale, initial_state, output_final_state,
                        use_qk_l2norm_in_kernel, cu_seqlens, cu_seqlens_cpu, chunk_size,
                        (A_log, dt_bias, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval),
                        state_v_first, inplace_final_state, ssm_state_indices, output_chunk_states, kwargs, cp_group)


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    cu_seqlens_cpu: Optional[torch.Tensor] = None,
    inplace_final_state: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    ssm_state_indices: Optional[torch.Tensor] = None,
    num_accepted_tokens: Optional[torch.Tensor] = None,
    **kwargs,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Kimi Delta Attention token by token (decoding), forward and backward; fla's fused_recurrent_kda. Arguments as
    chunk_kda's (beta defaults to ones), plus inplace_final_state, ssm_state_indices and num_accepted_tokens as
    fused_recurrent_gated_delta_rule's."""
    return _fused_recurrent_gated(
        "fused_recurrent_kda", fused_recurrent_kda, True, q, k, v, g, beta, scale, initial_state, output_final_state,
        use_qk_l2norm_in_kernel, cu_seqlens, cu_seqlens_cpu, inplace_final_state,
        (A_log, dt_bias, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval), state_v_first,
        ssm_state_indices, num_accepted_tokens, kwargs)
