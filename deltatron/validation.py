"""Argument checks of the public API. Every misuse raises before any kernel runs, with a message that
names the argument, the shape (or value) seen and what was expected."""
from __future__ import annotations

import math
import warnings
from typing import Optional, Tuple

import torch

from .varlen import VarlenMetadata, capturing

INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# float64 runs on the PyTorch backend only (oracles, gradcheck).
TORCH_ONLY_DTYPES = (torch.float64,)
CHUNK_SIZES = (16, 32, 64)


class LayoutWarning(UserWarning):
    """An input whose shape suggests the head-first layout [B, H, T, ...] instead of [B, T, H, ...]."""


def warn_if_head_first(fn_name: str, q) -> None:
    """Warns (LayoutWarning, attributed to the caller of the public entry point) when q [B, T, H, K] has
    1 < T < H, the shape of a head-first [B, H, T, K] tensor with more tokens than heads. fla's rule (T < H)
    except T = 1: a single token with many heads is a decode step or a one-token prompt, not a layout
    mistake. Called by the chunkwise forms (chunk, fused_chunk, parallel); fused_recurrent, the decoding form,
    takes a few tokens per call with any number of heads and does not warn. Not while torch.compile traces."""
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or not 1 < q.shape[1] < q.shape[2]:
        return
    if torch.compiler.is_compiling():
        return
    T, H = q.shape[1], q.shape[2]
    warnings.warn(
        f"{fn_name}: q looks head-first [B, H, T, K]: deltatron expects [B, T, H, K] and got {_shape(q)}, "
        f"that is T = {T} tokens < H = {H} heads. Pass q.transpose(1, 2) (and k, v, beta likewise) if the heads "
        "are dimension 1; if T < H is intended, silence this with warnings.filterwarnings('ignore', "
        "category=deltatron.validation.LayoutWarning)",
        LayoutWarning, stacklevel=3)


def reject_unknown_kwargs(fn_name: str, kwargs: dict) -> None:
    if not kwargs:
        return
    if "head_first" in kwargs:
        raise TypeError(
            f"{fn_name}: head_first is not supported; the layout is [B, T, H, ...] "
            "(q, k: [B, T, H, K], v: [B, T, H, V], beta: [B, T, H]); transpose head-first inputs with "
            "x.transpose(1, 2) before the call"
        )
    gate = sorted(set(kwargs) & _GATE_KWARGS)
    if gate:  # (the gated ops take these by name: they reach here only from the ungated rule's forms)
        raise TypeError(f"{fn_name}: {gate} given, but this form runs the ungated delta rule only; the gated rule "
                        f"and KDA run in chunk_gated_delta_rule / chunk_kda (chunkwise) and "
                        f"fused_recurrent_gated_delta_rule / fused_recurrent_kda (token by token)")
    raise TypeError(f"{fn_name}: unexpected keyword argument(s) {sorted(kwargs)}")


# the gated ops' arguments, named in the error of a form that takes none of them
_GATE_KWARGS = {"g", "A_log", "dt_bias", "use_gate_in_kernel"}


def takes_grad(*tensors) -> bool:
    """Whether autograd would record a call on these (None and non-tensors skipped): grad mode on and one of them
    requiring a gradient."""
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in tensors)


def _shape(x: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in x.shape) + "]"


def check_inputs(
    q, k, v, beta, scale, initial_state, cu_seqlens, cu_seqlens_cpu, chunk_size: Optional[int] = None,
    g=None, grouped: bool = False, shards: int = 1, per_channel_gate: bool = False,
) -> Tuple[float, Optional[torch.Tensor]]:
    """Validates the core arguments. Returns (scale as a float, cu_seqlens_cpu as int64 CPU tensor or
    None). Reading cu_seqlens from the device when cu_seqlens_cpu is not given is the one host-device
    sync of a varlen call; pass cu_seqlens_cpu to avoid it. grouped: v, beta (and g, the log decays of the
    gated rule) may have Hv = m * H value heads, H being q's and k's (DESIGN.md §11); states are [N, Hv, K, V].
    shards: the number of context-parallel ranks holding T tokens each; cu_seqlens then spans all their tokens.
    per_channel_gate: g is KDA's, [B, T, Hv, K] (§12)."""
    for name, x in (("q", q), ("k", k), ("v", v), ("beta", beta)) + ((("g", g),) if g is not None else ()):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if q.dim() != 4:
        raise ValueError(f"q must have shape [B, T, H, K] (4 dimensions), got {_shape(q)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must have the shape of q [B, T, H, K] = {_shape(q)}, got {_shape(k)}")
    if grouped:
        if v.dim() != 4 or v.shape[:2] != q.shape[:2] or v.shape[2] == 0 or v.shape[2] % max(H, 1):
            raise ValueError(f"v must have shape [B, T, Hv, V] = [{B}, {T}, Hv, V] with Hv a multiple of q's "
                             f"{H} heads, got {_shape(v)}")
    elif v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must have shape [B, T, H, V] = [{B}, {T}, {H}, V], got {_shape(v)}")
    Hv = v.shape[2]
    heads = "Hv" if grouped else "H"
    if beta.shape != v.shape[:3]:
        raise ValueError(f"beta must have shape [B, T, {heads}] = [{B}, {T}, {Hv}], got {_shape(beta)}")
    if g is not None:
        check_gate_shape(g, B, T, Hv, K, per_channel_gate)
    if g is not None and not g.is_floating_point():
        raise TypeError(f"g must be a floating-point tensor, got {g.dtype}")
    V = v.shape[-1]
    if K == 0 or V == 0 or H == 0:
        raise ValueError(f"head sizes must be positive: H = {H}, K = {K}, V = {V}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise TypeError(f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if q.dtype not in INPUT_DTYPES + TORCH_ONLY_DTYPES:
        raise TypeError(f"q, k, v dtype must be float16, bfloat16 or float32, got {q.dtype}")
    if not beta.is_floating_point():
        raise TypeError(f"beta must be a floating-point tensor, got {beta.dtype}")
    for name, x in (("k", k), ("v", v), ("beta", beta)) + ((("g", g),) if g is not None else ()):
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device} but q is on {q.device}; all inputs must share a device")

    if scale is None:
        scale = K ** -0.5
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite number (or None for K^-0.5), got {scale!r}")
    scale = float(scale)

    if chunk_size is not None and chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size must be one of {CHUNK_SIZES}, got {chunk_size!r}")

    num_seqs = B
    if cu_seqlens is None:
        if cu_seqlens_cpu is not None:
            raise ValueError("cu_seqlens_cpu was given without cu_seqlens")
    elif isinstance(cu_seqlens, VarlenMetadata):
        cu_seqlens_cpu = _check_metadata(cu_seqlens, cu_seqlens_cpu, q, (k, v, beta, g, initial_state))
        num_seqs = cu_seqlens.num_seqs
    else:
        cu_seqlens_cpu = check_cu_seqlens(cu_seqlens, cu_seqlens_cpu, B, T, shards)
        num_seqs = cu_seqlens.shape[0] - 1

    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor):
            raise TypeError(f"initial_state must be a torch.Tensor, got {type(initial_state).__name__}")
        expected = (num_seqs, Hv, K, V)
        if tuple(initial_state.shape) != expected:
            what = "number of sequences in cu_seqlens" if cu_seqlens is not None else "batch size"
            raise ValueError(
                f"initial_state must have shape [N, {heads}, K, V] = [{num_seqs}, {Hv}, {K}, {V}] (N = {what}), "
                f"got {_shape(initial_state)}"
            )
        if not initial_state.is_floating_point():
            raise TypeError(f"initial_state must be floating point, got {initial_state.dtype}")
        if initial_state.device != q.device:
            raise ValueError(f"initial_state is on {initial_state.device} but q is on {q.device}")
    return scale, cu_seqlens_cpu


def check_gate_shape(g: torch.Tensor, B: int, T: int, Hv: int, K: int, per_channel: bool) -> None:
    """g [B, T, Hv] (one log decay per value head), or per key channel [B, T, Hv, K] (KDA)."""
    if per_channel and tuple(g.shape) != (B, T, Hv, K):
        raise ValueError(f"g must have shape [B, T, Hv, K] = [{B}, {T}, {Hv}, {K}] (a log decay per key channel), got "
                         f"{_shape(g)}")
    if not per_channel and tuple(g.shape) != (B, T, Hv):
        raise ValueError(f"g must have shape [B, T, Hv] = [{B}, {T}, {Hv}], got {_shape(g)}")


def _check_metadata(meta, cu_seqlens_cpu, q, others) -> torch.Tensor:
    """Checks a call on prepared varlen metadata (the lengths were checked by its update()); returns its host
    offsets."""
    if cu_seqlens_cpu is not None:
        raise ValueError("cu_seqlens_cpu must be None when cu_seqlens is prepare_varlen's metadata (it holds both)")
    B, T = q.shape[:2]
    if B != 1 or T != meta.total_tokens:
        raise ValueError(f"with prepare_varlen's metadata q must be [1, max_tokens, H, K] = [1, {meta.total_tokens}, "
                         f"H, K], got {_shape(q)}")
    if meta.cu_seqlens.device != q.device:
        raise ValueError(f"the varlen metadata is on {meta.cu_seqlens.device} but q is on {q.device}")
    if takes_grad(q, *others):
        raise ValueError("prepare_varlen's metadata is for inference (CUDA-graph capture): call under torch.no_grad(), "
                         "or pass cu_seqlens as a tensor for training")
    if torch.compiler.is_compiling():
        raise RuntimeError("prepare_varlen's metadata is not supported under torch.compile; pass cu_seqlens as a "
                           "tensor there")
    return meta.cu_seqlens_cpu


def offsets_tensor(cu_seqlens):
    """The device offsets of cu_seqlens, a tensor or prepare_varlen's metadata (its capacity-padded cu_seqlens)."""
    return cu_seqlens.cu_seqlens if isinstance(cu_seqlens, VarlenMetadata) else cu_seqlens


def check_cu_seqlens(cu_seqlens, cu_seqlens_cpu, B: int, T: int, shards: int = 1) -> torch.Tensor:
    """cu_seqlens as an int64 CPU tensor (cu_seqlens_cpu when given, checked to match) after checking it offsets
    packed sequences of B = 1 rows of T tokens; with context parallelism, of shards ranks holding T tokens each."""
    for name, x in (("cu_seqlens", cu_seqlens), ("cu_seqlens_cpu", cu_seqlens_cpu)):
        if x is None:
            continue
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of integers, got {type(x).__name__}")
        if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
            raise TypeError(f"{name} must have an integer dtype (int32 or int64), got {x.dtype}")
        if x.dim() != 1 or x.numel() < 2:
            raise ValueError(f"{name} must be 1-D with N+1 >= 2 entries, got shape {_shape(x)}")
    if B != 1:
        raise ValueError(f"with cu_seqlens the batch size B must be 1 (sequences packed along T), got B = {B}")
    if torch.compiler.is_compiling():
        # reading the values would break the graph: the op checks them when it runs (deltatron/library.py)
        return cu_seqlens_cpu
    if cu_seqlens_cpu is None:
        cu_seqlens_cpu = cu_seqlens.detach().to("cpu", torch.int64)
    else:
        if cu_seqlens_cpu.shape != cu_seqlens.shape:
            raise ValueError(
                f"cu_seqlens_cpu must match cu_seqlens, got shapes {_shape(cu_seqlens_cpu)} and {_shape(cu_seqlens)}"
            )
        cu_seqlens_cpu = cu_seqlens_cpu.detach().to("cpu", torch.int64)
    values = cu_seqlens_cpu.numpy()  # the checks in numpy: a torch op on a tiny tensor costs the host microseconds
    if values[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {int(values[0])}")
    if (values[1:] < values[:-1]).any():
        raise ValueError(f"cu_seqlens must be non-decreasing, got {cu_seqlens_cpu.tolist()}")
    if values[-1] != T * shards:
        packed = (f"T = {T} (the packed length)" if shards == 1 else
                  f"{shards} * T = {shards * T} (the stream's length: each of the {shards} context-parallel ranks "
                  f"holds T = {T} tokens)")
        raise ValueError(f"cu_seqlens must end at {packed}, got {int(values[-1])}")
    return cu_seqlens_cpu


def check_token_buffer(fn: str, buffer, rows, steps, num_seqs: int, state_shape, device):
    """intermediate_states_buffer [R, steps, Hv, K, V] (fp32, contiguous, the pool's state layout state_shape) and
    intermediate_state_indices [N] (a buffer row per sequence, -1: none), given together; cache_steps None or the
    buffer's steps. Returns (buffer, rows), or None without a buffer. The rows' values are read (a sync) unless a
    CUDA graph is being captured."""
    if buffer is None and rows is None:
        if steps is not None:
            raise ValueError(f"{fn}: cache_steps is read only with intermediate_states_buffer")
        return None
    if buffer is None or rows is None:
        raise ValueError(f"{fn}: intermediate_states_buffer and intermediate_state_indices go together")
    if not isinstance(buffer, torch.Tensor) or buffer.dim() != 5 or tuple(buffer.shape[2:]) != tuple(state_shape or ()):
        raise ValueError(f"{fn}: intermediate_states_buffer must be [R, steps, Hv, K, V] with the pool's state shape "
                         f"{list(state_shape or ())}, got {_shape(buffer)}")
    if buffer.dtype != torch.float32 or not buffer.is_contiguous() or buffer.device != device:
        raise ValueError(f"{fn}: intermediate_states_buffer must be contiguous float32 on q's device {device}, got "
                         f"{buffer.dtype} on {buffer.device}{'' if buffer.is_contiguous() else ', non-contiguous'}")
    if steps is not None and steps != buffer.shape[1]:
        raise ValueError(f"{fn}: cache_steps ({steps}) must be the buffer's steps, intermediate_states_buffer.shape[1] "
                         f"= {buffer.shape[1]}")
    if (not isinstance(rows, torch.Tensor) or rows.dtype not in (torch.int32, torch.int64)
            or tuple(rows.shape) != (num_seqs,) or rows.device != device):
        raise ValueError(f"{fn}: intermediate_state_indices must be an int32 or int64 [N] = [{num_seqs}] tensor on "
                         f"q's device, got {_shape(rows) if isinstance(rows, torch.Tensor) else type(rows).__name__}")
    _check_index_range(fn, "intermediate_state_indices", rows, buffer.shape[0], "R")
    return buffer, rows


def _check_index_range(fn: str, name: str, indices: torch.Tensor, size: int, letter: str) -> bool:
    """Raises unless every index lies in [-1, size); reading them syncs with the device, so nothing is read (and False
    returned) while a CUDA graph is being captured or torch.compile traces the call, or when there are none."""
    if not indices.numel() or capturing() or torch.compiler.is_compiling():
        return False
    low, high = int(indices.min()), int(indices.max())
    if low < -1 or high >= size:
        raise ValueError(f"{fn}: {name} must lie in [-1, {letter}) = [-1, {size}), got values from {low} to {high}")
    return True


def check_state_pool(fn: str, pool, state_indices, num_seqs: int, Hv: int, K: int, V: int, device,
                     num_accepted_tokens=None) -> None:
    """ssm_state_indices [N] (an integer slot of the pool per sequence; -1 marks a padding entry), or [N, W] (a slot
    per token, speculative decoding), into initial_state, the pool [S, Hv, K, V] (fp32, contiguous);
    num_accepted_tokens [N] in [1, W] with [N, W] slots. Values are read, which syncs with the device, unless a CUDA
    graph is being captured or torch.compile traces the call."""
    if pool is None:
        raise ValueError(f"{fn}: ssm_state_indices needs initial_state: the pool [S, Hv, K, V] its slots index")
    if not isinstance(state_indices, torch.Tensor):
        raise TypeError(f"{fn}: ssm_state_indices must be a torch.Tensor of integers, got "
                        f"{type(state_indices).__name__}")
    if state_indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{fn}: ssm_state_indices must be int32 or int64, got {state_indices.dtype}")
    if state_indices.dim() not in (1, 2) or state_indices.shape[0] != num_seqs:
        raise ValueError(f"{fn}: ssm_state_indices must have shape [N] = [{num_seqs}] (one slot per sequence) or "
                         f"[N, W] (one per token), got {_shape(state_indices)}")
    if num_accepted_tokens is not None:
        if state_indices.dim() != 2:
            raise ValueError(f"{fn}: num_accepted_tokens needs ssm_state_indices [N, W], a slot per token")
        if not isinstance(num_accepted_tokens, torch.Tensor) or num_accepted_tokens.dtype not in (torch.int32,
                                                                                               torch.int64):
            raise TypeError(f"{fn}: num_accepted_tokens must be an int32 or int64 tensor")
        if tuple(num_accepted_tokens.shape) != (num_seqs,) or num_accepted_tokens.device != device:
            raise ValueError(f"{fn}: num_accepted_tokens must have shape [N] = [{num_seqs}] on q's device, got "
                             f"{_shape(num_accepted_tokens)} on {num_accepted_tokens.device}")
    if state_indices.device != device or pool.device != device:
        raise ValueError(f"{fn}: ssm_state_indices and initial_state must be on q's device {device}")
    if pool.dim() != 4 or tuple(pool.shape[1:]) != (Hv, K, V) or pool.shape[0] == 0:
        raise ValueError(f"{fn}: with ssm_state_indices, initial_state is the pool [S, Hv, K, V] = [S, {Hv}, {K}, "
                         f"{V}] (S >= 1), got {_shape(pool)}")
    if pool.dtype != torch.float32 or not pool.is_contiguous():
        raise ValueError(f"{fn}: the state pool must be contiguous float32, got {pool.dtype}"
                         f"{'' if pool.is_contiguous() else ', non-contiguous'}")
    read = _check_index_range(fn, "ssm_state_indices", state_indices, pool.shape[0], "S")
    if read and num_accepted_tokens is not None:
        low, high, W = int(num_accepted_tokens.min()), int(num_accepted_tokens.max()), state_indices.shape[1]
        if low < 1 or high > W:
            raise ValueError(f"{fn}: num_accepted_tokens must lie in [1, W] = [1, {W}], got values from {low} to "
                             f"{high}")
