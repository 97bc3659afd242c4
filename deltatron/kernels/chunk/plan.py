"""The plan of one chunk_delta_rule call: every choice of kernels, schedule and launch configuration, in one place.

A plan is made once per call (make_plan) from the problem's shape and dtype, the device's capabilities and explicit
overrides, and is frozen: the forward (forward.py) and the backward (backward.py) only execute it, and
`deltatron explain` prints it. Every rule and threshold of the chunk algorithm lives in this file; each choice
carries a one-line reason. The rules and the measurements behind them: docs/DESIGN.md §6 and docs/performance.md.

Overrides replace a rule's answer for the calls made inside `overrides(...)` (tests, probes): None keeps the rule's.
A forced choice that the device or the shape cannot run is refused with a ValueError when the plan is made."""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib
from dataclasses import dataclass
from typing import Iterator, Optional, Tuple

import torch

from ..utils import INTERPRET, head_block, head_tile, state_block_v

# Hopper walk: from this many sequences x heads (the fewest it was measured faster at)
HOPPER_WALK_MIN_STATES = 16
# Sequence split: at SPLIT_MIN_STATES <= sequences x heads < SPLIT_MAX_STATES (from 64 the walk fills the SMs alone),
# on sequences of SPLIT_MIN_TOKENS or more, partitions of SPLIT_MIN_PARTITION_TOKENS or more, at most
# SPLIT_MAX_PARTITIONS
SPLIT_MIN_STATES, SPLIT_MAX_STATES = 16, 64
SPLIT_MIN_TOKENS = 8192
SPLIT_MIN_PARTITION_TOKENS = 2048
SPLIT_MAX_PARTITIONS = 16
# Two-launch recompute overlapped with the reverse pass: at most this many sequences x heads, sequences this long
OVERLAP_MAX_STATES, OVERLAP_MIN_TOKENS = 32, 8192
# Segmented backward: this many segments, at most this many sequences x heads, sequences this long
SEGMENTS, SEGMENT_MAX_STATES, SEGMENT_MIN_TOKENS = 2, 32, 16384
# Hopper reverse pass: from this many sequences x heads (up to one wave; the per-head gated rule up to two), sequences
# this long
HOPPER_REVERSE_MIN_STATES, HOPPER_REVERSE_MIN_TOKENS = 16, 2048
HOPPER_REVERSE_GATED_WAVES = 2
HOPPER_CHUNK, HOPPER_HEAD = 64, 128  # the Gluon kernels' chunk size and head size (K = V)
_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


# ---------------------------------------------------------------------------------------------------------------
# What a plan is made from

@dataclass(frozen=True)
class Capabilities:
    """What the device offers the kernels. `name` is for explain."""

    name: str
    cuda: bool
    interpret: bool  # Triton's interpreter (TRITON_INTERPRET=1): programs run one at a time, no Gluon, no streams
    sm: Optional[Tuple[int, int]]
    num_sms: int
    gluon: bool  # the installed triton has the Gluon Hopper API the hopper/ kernels are written against
    shared_memory: Optional[int] = None  # bytes of shared memory a block can have (None: no limit, the interpreter)

    @property
    def hopper(self) -> bool:
        return self.cuda and not self.interpret and self.sm == (9, 0) and self.gluon

    @property
    def two_streams(self) -> bool:
        return self.cuda and not self.interpret


# GPUs that explain can plan for on any machine: (compute capability, SMs, shared memory a block can opt into)
NAMED_GPUS = {"sm90": ((9, 0), 132, 232_448), "sm80": ((8, 0), 108, 166_912), "sm89": ((8, 9), 128, 101_376),
              "sm100": ((10, 0), 148, 232_448)}


def named_capabilities(gpu: str) -> Capabilities:
    """Capabilities of a named GPU (NAMED_GPUS; sm90 has 132 SMs as the H200), or of "cpu" (the PyTorch backend's
    machine, where Triton runs in its interpreter), whether or not this machine has it."""
    if gpu in ("cpu", "interpreter"):
        return Capabilities("cpu (Triton interpreter)", cuda=False, interpret=True, sm=None, num_sms=1, gluon=False)
    if gpu not in NAMED_GPUS:
        raise ValueError(f"gpu must be one of {', '.join(list(NAMED_GPUS) + ['cpu'])}, got {gpu!r}")
    sm, sms, shared_memory = NAMED_GPUS[gpu]
    return Capabilities(f"{gpu} ({sms} SMs)", cuda=True, interpret=False, sm=sm, num_sms=sms, gluon=sm == (9, 0),
                        shared_memory=shared_memory)


@functools.lru_cache(maxsize=None)
def gluon_available() -> bool:
    """Whether triton has the Gluon Hopper API of the hopper/ kernels (triton 3.6's)."""
    try:
        importlib.import_module(f"{__package__}.hopper.walk")
        importlib.import_module(f"{__package__}.hopper.reverse")
    except (ImportError, AttributeError):
        return False
    return True


@functools.lru_cache(maxsize=None)
def device_capabilities(device: torch.device) -> Capabilities:
    """This process's capabilities for tensors on `device`."""
    if device.type != "cuda" or INTERPRET:
        return Capabilities("cpu (Triton interpreter)" if INTERPRET else device.type, cuda=device.type == "cuda",
                            interpret=INTERPRET, sm=None, num_sms=1, gluon=False)
    props = torch.cuda.get_device_properties(device)
    sm = (props.major, props.minor)
    return Capabilities(f"{props.name} (sm{props.major}{props.minor}, {props.multi_processor_count} SMs)", cuda=True,
                        interpret=False, sm=sm, num_sms=props.multi_processor_count,
                        gluon=sm == (9, 0) and gluon_available(), shared_memory=block_shared_memory(device))


@functools.lru_cache(maxsize=None)
def block_shared_memory(device: torch.device) -> int:
    """The shared memory a block can opt into on `device`, in bytes (what Triton checks a launch against)."""
    import triton
    index = device.index if device.index is not None else torch.cuda.current_device()
    return triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]


@dataclass(frozen=True)
class Problem:
    """The call's shape: q, k [.., key_heads, K], v [.., heads, V], num_seqs sequences of total_tokens tokens in all;
    gated: the gated rule (a log decay per token and head, DESIGN.md §11); per_channel: with KDA's gate instead (a log
    decay per token, head and key channel, DESIGN.md §12; gated is then set too)."""

    dtype: torch.dtype
    heads: int
    K: int
    V: int
    num_seqs: int
    total_tokens: int
    chunk_size: int = 64
    training: bool = True  # a backward will run (the forward keeps what it needs)
    save_states: bool = False  # the caller asked the forward to keep its per-chunk states (chunk_delta_rule's option)
    tma_aligned: bool = True  # q, k, v contiguous and 16-byte aligned, as TMA descriptors take them
    gated: bool = False
    key_heads: int = 0  # heads of q and k (0: as many as v's); fewer: grouped value heads
    chunk_states: bool = False  # the caller asked for the state entering every chunk (output_chunk_states)
    prepared: bool = False  # prepare_varlen's metadata: a CUDA graph may replay the call on other lengths
    per_channel: bool = False  # KDA's per-channel gate: portable stages only

    @property
    def grouped(self) -> bool:
        return self.key_heads not in (0, self.heads)

    @property
    def states(self) -> int:
        return self.num_seqs * self.heads

    @property
    def sixteen_bit(self) -> bool:
        return self.dtype in (torch.float16, torch.bfloat16)

    @property
    def element_size(self) -> int:
        return 4 if self.dtype == torch.float32 else 2

    def long_sequences(self, tokens: int) -> bool:
        """Whether the sequences are at least `tokens` long on average."""
        return self.total_tokens >= tokens * max(self.num_seqs, 1)


@dataclass(frozen=True)
class Overrides:
    """Choices forced instead of the rules' (None: the rule's). See overrides()."""

    hopper_walk: Optional[bool] = None
    fused_output: Optional[bool] = None  # the portable walk with the output fused in, where the Hopper walk is off
    residual: Optional[bool] = None
    split_partitions: Optional[int] = None  # 1: no split; >= 2: that many partitions
    split_min_tokens: Optional[int] = None  # sequences shorter than this are not split
    keep_states: Optional[bool] = None  # as save_states=True on every training call (False: never keep)
    segments: Optional[int] = None
    overlap: Optional[bool] = None
    hopper_reverse: Optional[bool] = None
    local_dv_apart: Optional[bool] = None  # the portable reverse pass reads the local dV' of grads.dv_local
    wy_maxnreg: Optional[int] = None  # the forward WY kernel's register cap (0: none), for A/B of the rule's
    wy_bwd_maxnreg: Optional[int] = None  # the WY backward's register cap (0: none), likewise
    dqkw_warps: Optional[int] = None  # the gradient stage's dqkw warps, likewise
    walk_block_v: Optional[int] = None  # the portable walks' V-block (the forward's and the recompute's), likewise
    reverse_block_v: Optional[int] = None  # the portable reverse pass's V-block, likewise


_OVERRIDES: contextvars.ContextVar[Overrides] = contextvars.ContextVar("deltatron_plan_overrides", default=Overrides())


@contextlib.contextmanager
def overrides(**choices) -> Iterator[Overrides]:
    """Force plan choices for the chunk calls made inside (nested calls combine, inner ones win):

        with plan.overrides(segments=2, overlap=True):
            o, _ = chunk_delta_rule(q, k, v, beta)

    Keywords are Overrides' fields. Restored on exit, on error too."""
    unknown = set(choices) - {f.name for f in dataclasses.fields(Overrides)}
    if unknown:
        raise TypeError(f"overrides: unknown choices {sorted(unknown)}; known: "
                        f"{[f.name for f in dataclasses.fields(Overrides)]}")
    token = _OVERRIDES.set(dataclasses.replace(_OVERRIDES.get(), **choices))
    try:
        yield _OVERRIDES.get()
    finally:
        _OVERRIDES.reset(token)


def current_overrides() -> Overrides:
    return _OVERRIDES.get()


# ---------------------------------------------------------------------------------------------------------------
# Launch configurations

@dataclass(frozen=True)
class Launch:
    """A kernel's launch: the state's V-block a program walks (block_v; 0 where the kernel has none), warps, the
    register cap (0: none) and the head tiles (0: the kernel's own)."""

    block_v: int = 0
    warps: int = 4
    maxnreg: int = 0
    tile_k: int = 0
    tile_v: int = 0

    def options(self) -> dict:
        """The launch options triton takes beyond num_warps: maxnreg where there is a cap."""
        return {"maxnreg": self.maxnreg} if self.maxnreg else {}

    def __str__(self) -> str:
        parts = ([f"block_v {self.block_v}"] if self.block_v else []) + [f"{self.warps} warps"]
        parts += [f"maxnreg {self.maxnreg}"] if self.maxnreg else []
        parts += [f"tiles {self.tile_k}x{self.tile_v}"] if self.tile_k else []
        return ", ".join(parts)


@functools.lru_cache(maxsize=None)
def walk_launch(K: int, V: int, num_states: int, element_size: int, fused: bool, interpret: bool = INTERPRET) -> Launch:
    """The portable walk: state_block_v's V-block on 4 warps (8 at K = 256), except
    - fused with K = 128: a [128, 128] state on 8 warps while that fills the SMs (one program per head: Q K^T is not
      recomputed per V-block; the fused walk's shared memory allows one program an SM);
    - plain at K = 256 in 16-bit: [256, 64] on 4 warps (one program an SM either way; 32-wide products idle the
      tensor cores);
    - fused fp32: at most 32 wide at K = 128 and 16 at K = 256 (shared memory)."""
    BK = head_block(K)
    shrink = not interpret
    if fused and BK == 128:
        BV, warps = state_block_v(K, V, num_states, max_tile=16384, shrink=shrink), 8
    elif not fused and BK >= 256 and element_size == 2:
        BV, warps = state_block_v(K, V, num_states, max_tile=16384, shrink=shrink), 4
    else:
        BV, warps = state_block_v(K, V, num_states, shrink=shrink), 8 if BK >= 256 else 4
    if fused and element_size == 4:
        BV = min(BV, 16 if BK >= 256 else 32)
    return Launch(block_v=BV, warps=warps)


@functools.lru_cache(maxsize=None)
def reverse_launch(K: int, V: int, num_states: int, element_size: int, sms: int, interpret: bool = INTERPRET) -> Launch:
    """The portable reverse pass: state_block_v's V-block on 4 warps; 8 at K = 256, at K = 128 and in fp32 (it holds
    A^T [C, C] beside the state gradient); 16-bit K = 128 up to 128 wide while its programs fit one wave; fp32 at
    K = 256 at most 16 wide (shared memory)."""
    BK = head_block(K)
    wide = K == 128 and element_size == 2 and (interpret or num_states <= sms)
    BV = state_block_v(K, V, num_states, max_tile=16384 if wide else 8192, shrink=not interpret)
    if element_size == 4 and BK >= 256:
        BV = min(BV, 16)
    warps = 8 if BK >= 256 or BK == 128 or element_size == 4 else 4
    return Launch(block_v=BV, warps=warps)


def hopper_block_v(num_states: int, sms: int) -> int:
    """The Hopper kernels' V-block: 64 (two programs a head) while the doubled grid fits one wave, else 128."""
    return 64 if 2 * num_states <= sms else 128


def hopper_launch(num_states: int, sms: int) -> Launch:
    block_v = hopper_block_v(num_states, sms)
    return Launch(block_v=block_v, warps=block_v // 16)


@functools.lru_cache(maxsize=None)
def wy_launch(K: int, V: int, element_size: int, fused: bool, uncapped: bool = False) -> Launch:
    """The WY kernel: 4 warps (2 spill the 16-bit inverse), 64-wide head tiles, masked for narrower heads: on the
    H200 with triton 3.6 narrower tiles gave wrong W, U once the inverse runs in tf32 (16-bit inputs), 16-wide ones
    always, 32-wide ones with nearly parallel keys at V = 32 (W 0.84 off in relative RMS) and in KDA's fp16 at
    K = V = 32 (the output 1.25 off; once an illegal address). The 16-bit kernel that inverts (fused) is capped at
    168 registers up to 128-wide heads (3 blocks an SM instead of 2), but for the variants that spill under that cap
    (uncapped): the per-head gated rule's W, U (160 bytes; uncapped it took 1.579 ms against 1.699 of the forward at
    Qwen3-Next's layout, B = 8, T = 4096, H200) and KDA's forward, which forms the output's scores beside A (648
    bytes against 40 uncapped; the forward 1.152 ms against 1.178 at B = 8, T = 2048, H = 16, K = V = 128, outputs
    bitwise equal)."""
    cap = 168 if fused and element_size == 2 and max(K, V) <= 128 and not uncapped else 0
    return Launch(warps=4, maxnreg=cap, tile_k=64, tile_v=64)


@functools.lru_cache(maxsize=None)
def wy_bwd_launch(K: int, V: int, element_size: int, per_channel: bool = False, gated: bool = False) -> Launch:
    """The WY backward: its C x C fp32 matrices leave little room for head tiles, so 16-bit heads up to 128 run
    capped at 168 registers (3 blocks an SM), with 32-wide tiles once a head is wider than 64; wider heads and fp32
    uncapped on 64-wide tiles. KDA's variant (per_channel: channel_mix's per-channel terms) uncapped on 32-wide
    tiles: on the H200 at B = 8, T = 2048, H = 16, K = V = 128 it took 1.565 ms at 4 warps against 2.621 capped at
    168 registers and 1.907 at 8 warps. The per-head gated variant (gated) uncapped too: it spills under the cap
    and none uncapped (2 blocks an SM), and measured faster so (docs/performance.md §4)."""
    BK, BV = head_tile(K), head_tile(V)
    if per_channel and element_size == 2 and max(K, V) <= 128:
        return Launch(warps=4, tile_k=min(32, BK), tile_v=min(32, BV))
    if element_size != 2 or max(K, V) > 128:
        return Launch(warps=4, tile_k=BK, tile_v=BV)
    if max(K, V) > 64:
        BK, BV = min(32, BK), min(32, BV)
    return Launch(warps=4, maxnreg=0 if gated else 168, tile_k=BK, tile_v=BV)


DQKW_LAUNCH = Launch(warps=4)  # grads.dqkw: K-tiles and V-tiles of head_tile's width


def _wy_forward_launch(p: Problem, o: Overrides, residual: bool) -> Launch:
    """wy_launch's for the forward (it inverts; residual: T~'s pair, no W carrying the decays), with the register
    cap overrides(wy_maxnreg=...) forces."""
    return _capped(wy_launch(p.K, p.V, p.element_size, True, p.per_channel or (p.gated and not residual)),
                   "wy_maxnreg", o.wy_maxnreg)


def _capped(rule: Launch, name: str, cap: Optional[int]) -> Launch:
    """rule with the register cap overrides(name=cap) forces (None: the rule's)."""
    if cap is None:
        return rule
    if cap < 0:
        raise ValueError(f"overrides({name}={cap}): a register cap is >= 0 (0: none)")
    return dataclasses.replace(rule, maxnreg=cap)


def _block_v(rule: Launch, name: str, block_v: Optional[int]) -> Launch:
    """rule with the V-block overrides(name=block_v) forces (None: the rule's)."""
    if block_v is None:
        return rule
    if block_v not in (16, 32, 64, 128):
        raise ValueError(f"overrides({name}={block_v}): V-blocks are 16, 32, 64 or 128 wide")
    return dataclasses.replace(rule, block_v=block_v)


def _warps(rule: Launch, name: str, warps: Optional[int]) -> Launch:
    """rule with the warps overrides(name=warps) forces (None: the rule's)."""
    if warps is None:
        return rule
    if warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"overrides({name}={warps}): warps are a power of two from 1 to 16")
    return dataclasses.replace(rule, warps=warps)


def wy_on_chip(K: int, V: int, num_states: int, element_size: int, interpret: bool = INTERPRET) -> bool:
    """Whether the backward's walk computes W, U on chip from T~ (one launch) rather than reading them from the WY
    kernel: 16-bit (fp32's ieee products spill in every walk), the plain walk's V-block at least 64 wide (every
    V-block program recomputes W), and K <= 64 or K = 128 with whole V-blocks (elsewhere the variant spills
    hundreds of bytes)."""
    BV = walk_launch(K, V, num_states, element_size, False, interpret).block_v
    wide = BV >= min(64, head_block(V))
    spill_free = head_block(K) <= 64 or (K == 128 and V % BV == 0)
    return element_size == 2 and wide and spill_free


def split_partitions(num_seqs: int, heads: int, tokens: int, sms: int, v_blocks: int = 2) -> int:
    """Partitions a long sequence is split into (1: none): the most P in [3, SPLIT_MAX_PARTITIONS] whose pass 1
    (2NP - 3 partition-walks of v_blocks programs a head, fillers included) fits one wave of the SMs, with
    partitions of SPLIT_MIN_PARTITION_TOKENS or more; only at SPLIT_MIN_STATES <= sequences x heads <
    SPLIT_MAX_STATES on sequences of SPLIT_MIN_TOKENS or more on average. P = 2 is never chosen: pass 1 would walk
    half the sequence and pass 2 the other half after it."""
    states = num_seqs * heads
    if not SPLIT_MIN_STATES <= states < SPLIT_MAX_STATES or tokens < SPLIT_MIN_TOKENS * num_seqs:
        return 1
    fit = (sms // (heads * v_blocks) + 3) // (2 * num_seqs)
    P = min(fit, SPLIT_MAX_PARTITIONS, tokens // (num_seqs * SPLIT_MIN_PARTITION_TOKENS))
    return P if P >= 3 else 1


# ---------------------------------------------------------------------------------------------------------------
# The plan

@dataclass(frozen=True)
class ChunkPlan:
    """Every choice of one call. Forward: the WY form, the walk, the sequence split, whether states are kept.
    Backward: recompute, overlap, segments, the reverse pass. Launches of the stages that choose one."""

    problem: Problem
    caps: Capabilities
    walk: str  # "hopper" | "portable_fused" (state pass and output in one kernel) | "portable" (walk, then output)
    residual: bool  # the WY stage makes Tb = T~ diag(beta) and the walk forms V' = Tb (V - K S): no W, U
    split_partitions: int  # 1: whole sequences
    split_min_tokens: int
    keep_states: bool  # the forward stores S^T, V'^T per chunk; the backward recomputes nothing
    walk_launch: Launch
    wy_launch: Launch  # the forward's WY kernel (it inverts)
    recompute: str  # "on_chip" (one launch) | "two_launch" (WY kernel, then the walk) | "none" (kept states, inference)
    recompute_launch: Launch  # the recompute's walk
    recompute_wy_launch: Launch  # the two-launch recompute's WY kernel (from the stored T~)
    overlap: bool  # the two-launch recompute's walk on a side stream beside the reverse pass
    segments: int  # the reverse pass and the gradient stage run in this many segments (1: whole)
    reverse: str  # "hopper" | "portable" | "none" (inference)
    reverse_launch: Launch
    local_dv_apart: bool  # the local dV' from grads.dv_local before the (portable) reverse pass, not computed in it
    dqkw_launch: Launch
    wy_bwd_launch: Launch
    reasons: Tuple[Tuple[str, str], ...] = ()

    @property
    def split(self) -> bool:
        return self.split_partitions > 1

    @property
    def keep_scores(self) -> bool:
        """KDA in training: the forward keeps the scores P that its WY stage formed for the output stage (a stage of
        its own) for grads.dv_local, which forms the local dV' before the reverse pass."""
        p = self.problem
        return p.per_channel and p.training and self.walk == "portable" and self.local_dv_apart

    def reason(self, choice: str) -> str:
        return dict(self.reasons).get(choice, "")


def _forced(name: str, value, rule_value, reason: str) -> Tuple[object, str]:
    return (rule_value, reason) if value is None else (value, f"forced by overrides({name}={value!r})")


# KDA's chunk kernels at head sizes above 128 need this much shared memory a block: the reverse pass at K = V = 256
# and block_v 32 takes 229,376 B in 16 bits (tools/offline_compile.py --kda --heads 256, triton 3.6). sm_90 and
# sm_100 offer 232,448 B; sm_80 166,912, sm_86 and sm_89 101,376.
KDA_LARGE_HEAD_SHARED_MEMORY = 229_376


def kda_chunk_refusal(K: int, V: int, caps: Capabilities) -> Optional[str]:
    """Why KDA's per-channel gate cannot run the chunk kernels at these head sizes on this device (chunk_kda then runs
    the token-serial fused_recurrent kernels, forward and backward), or None where it can."""
    if max(K, V) <= 128 or caps.shared_memory is None or caps.shared_memory >= KDA_LARGE_HEAD_SHARED_MEMORY:
        return None
    return (f"KDA's chunk kernels at K or V > 128 (here K = {K}, V = {V}) need {KDA_LARGE_HEAD_SHARED_MEMORY:,} B of "
            f"shared memory a block and {caps.name} has {caps.shared_memory:,}, so chunk_kda runs fused_recurrent")


_CALL_PLANS: dict = {}  # the plans of recent calls by their key: the host's cost of a call's plan is a lookup
_MAX_CALL_PLANS = 4096


def call_plan(dtype: torch.dtype, heads: int, K: int, V: int, num_seqs: int, total_tokens: int, chunk_size: int,
              training: bool, save_states: bool, tma_aligned: bool, device: torch.device, gated: bool = False,
              key_heads: int = 0, chunk_states: bool = False, prepared: bool = False,
              per_channel: bool = False) -> ChunkPlan:
    """make_plan for a call on `device` under the calling context's overrides, from the call's facts (a dict lookup
    where the same call was planned before: building a Problem costs the host more than the lookup)."""
    forced = _OVERRIDES.get()
    key = (dtype, heads, K, V, num_seqs, total_tokens, chunk_size, training, save_states, tma_aligned, device, forced,
           gated, key_heads, chunk_states, prepared, per_channel)
    plan = _CALL_PLANS.get(key)
    if plan is None:
        if len(_CALL_PLANS) >= _MAX_CALL_PLANS:
            _CALL_PLANS.clear()
        problem = Problem(dtype, heads, K, V, num_seqs, total_tokens, chunk_size, training, save_states, tma_aligned,
                          gated, 0 if key_heads == heads else key_heads, chunk_states, prepared, per_channel)
        plan = _CALL_PLANS[key] = _make_plan(problem, device_capabilities(device), forced)
    return plan


def make_plan(problem: Problem, caps: Capabilities, forced: Optional[Overrides] = None) -> ChunkPlan:
    """The plan for problem on a device with caps (docs/DESIGN.md §6). forced: the overrides (default: the
    calling context's, current_overrides())."""
    return _make_plan(problem, caps, current_overrides() if forced is None else forced)


@functools.lru_cache(maxsize=512)
def _make_plan(p: Problem, caps: Capabilities, o: Overrides) -> ChunkPlan:
    reasons = []
    nh = f"sequences x heads {p.states}"
    refusal = kda_chunk_refusal(p.K, p.V, caps) if p.per_channel else None
    if refusal:
        raise ValueError(refusal)
    # -- forward walk
    hopper_fits = (caps.hopper and p.sixteen_bit and p.chunk_size == HOPPER_CHUNK and p.K == HOPPER_HEAD
                   and p.V == HOPPER_HEAD and p.tma_aligned and not p.chunk_states and not p.per_channel)
    if not hopper_fits:
        hopper = False
        why = ("the states entering each chunk come from the portable walk" if p.chunk_states else
               "the Hopper walk takes the per-head gate only, not KDA's per-channel gate" if p.per_channel else
               "the Hopper walk needs sm_90 with Gluon, 16-bit, K = V = 128, chunk 64 and 16-byte aligned q, k, v")
        if o.hopper_walk:
            raise ValueError(f"overrides(hopper_walk=True): {why}")
    else:
        hopper, why = _forced("hopper_walk", o.hopper_walk, p.states >= HOPPER_WALK_MIN_STATES,
                              f"{nh} {'>=' if p.states >= HOPPER_WALK_MIN_STATES else '<'} {HOPPER_WALK_MIN_STATES}, "
                              f"the fewest the Hopper walk was measured faster at")
    fused_launch = walk_launch(p.K, p.V, p.states, p.element_size, True, caps.interpret)
    if hopper:
        walk, launch = "hopper", hopper_launch(p.states, caps.num_sms)
    else:
        fits = (p.sixteen_bit and head_block(p.K) <= 128 and fused_launch.block_v >= 64 and not p.chunk_states
                and not p.per_channel)
        fused, fwhy = _forced("fused_output", o.fused_output, fits,
                              "the output fused into the walk (16-bit, K <= 128, V-block >= 64)" if fits else
                              "the walk stores the state entering each chunk (output_chunk_states), the output apart"
                              if p.chunk_states else
                              "the output as a stage of its own: KDA's scores under per-channel decays "
                              "(gate.channel_scores) are parallel over chunks there, and would sit on the walk's "
                              "serial path, once a chunk in every V-block program" if p.per_channel else
                              f"the output as a stage of its own: the fused walk needs 16-bit, K <= 128 and a V-block "
                              f">= 64 (here {fused_launch.block_v}), as every V-block program recomputes Q K^T")
        if fused and p.chunk_states:
            raise ValueError("overrides(fused_output=True): output_chunk_states needs the walk that stores the states")
        walk = "portable_fused" if fused else "portable"
        why = f"{why}; {fwhy}"
        launch = _block_v(fused_launch if fused else walk_launch(p.K, p.V, p.states, p.element_size, False,
                                                                 caps.interpret), "walk_block_v", o.walk_block_v)
    reasons.append(("walk", why))

    # -- sequence split (Hopper walk only: measured there)
    if o.split_partitions is not None:
        partitions, why = o.split_partitions, f"forced by overrides(split_partitions={o.split_partitions})"
        if partitions < 1:
            raise ValueError(f"overrides(split_partitions=...) must be >= 1, got {partitions}")
        if partitions > 1 and (p.gated or p.grouped):
            raise ValueError("overrides(split_partitions>1): the split's combine takes neither the gate nor grouped "
                             "value heads")
        if partitions > 1 and p.prepared:
            raise ValueError("overrides(split_partitions>1): prepared varlen metadata takes no sequence split (its "
                             "partitions are cut from the lengths on the host)")
    elif walk == "hopper" and p.prepared:
        partitions, why = 1, "prepared varlen metadata: the partitions are cut from the lengths on the host"
    elif walk == "hopper" and (p.gated or p.grouped):
        partitions, why = 1, "the split's combine takes neither the gate nor grouped value heads"
    elif walk == "hopper":
        partitions = split_partitions(p.num_seqs, p.heads, p.total_tokens, caps.num_sms)
        why = (f"{nh} on long sequences leave SMs idle; pass 1 fits one wave" if partitions > 1 else
               f"only at {SPLIT_MIN_STATES} <= sequences x heads < {SPLIT_MAX_STATES}, sequences of "
               f"{SPLIT_MIN_TOKENS}+ tokens")
    else:
        partitions, why = 1, "measured on the Hopper walk only"
    if partitions > 1 and walk == "hopper":
        launch = Launch(block_v=64, warps=4)  # pass 1 fits one wave at two programs a head, so every walk does
    min_tokens = SPLIT_MIN_TOKENS if o.split_min_tokens is None else o.split_min_tokens
    reasons.append(("split", why))

    # -- backward: segments, then whether the forward keeps its states
    if not p.training:
        segments, why = 1, "inference: no backward"
    elif p.gated or p.grouped:
        segments, why = 1, "the segmented backward takes neither the gate nor grouped value heads"
        if o.segments not in (None, 1):
            raise ValueError(f"overrides(segments={o.segments}): {why}")
    else:
        rule = caps.two_streams and p.states <= SEGMENT_MAX_STATES and p.long_sequences(SEGMENT_MIN_TOKENS)
        segments, why = _forced("segments", o.segments, SEGMENTS if rule else 1,
                                f"later segments' gradients fill the SMs the reverse pass leaves idle ({nh})" if rule
                                else f"only with two CUDA streams, sequences x heads <= {SEGMENT_MAX_STATES}, "
                                     f"sequences of {SEGMENT_MIN_TOKENS}+ tokens")
    reasons.append(("segments", why))
    asked = p.save_states if o.keep_states is None else o.keep_states
    keep = (p.training and asked and walk == "hopper" and partitions == 1 and segments == 1 and not p.gated
            and not p.grouped)
    if o.keep_states and p.training and not keep:
        raise ValueError("overrides(keep_states=True): states are kept only on the Hopper walk, unsplit, unsegmented, "
                         "ungated, without grouped value heads")
    reasons.append(("keep_states", "the Hopper walk stores them: the backward recomputes nothing" if keep else
                    "not asked (save_states)" if not asked or not p.training else
                    "kept only on the Hopper walk, unsplit, with an unsegmented backward, ungated, without grouped "
                    "value heads"))

    # -- WY form
    if walk != "hopper":
        residual, why = False, "the residual form runs on the Hopper walk only"
        if o.residual:
            raise ValueError(f"overrides(residual=True): {why}")
    elif keep:
        residual, why = False, "kept states need W"
        if o.residual:
            raise ValueError("overrides(residual=True): kept states need W, U")
    else:
        residual, why = _forced("residual", o.residual, True,
                                "no W, U made: the WY stage writes Tb (256 B a token and head) instead")
    reasons.append(("residual", why))

    # -- backward: recompute, overlap, reverse pass
    recompute_launch = _block_v(walk_launch(p.K, p.V, p.states, p.element_size, False, caps.interpret),
                                "walk_block_v", o.walk_block_v)
    if not p.training:
        recompute, why = "none", "inference: no backward"
    elif keep:
        recompute, why = "none", "the forward kept its states"
    elif p.per_channel:
        recompute, why = "two_launch", "KDA's W, U from portable.wy: the walk's on-chip W, U take the per-head gate " \
                                       "only"
    elif wy_on_chip(p.K, p.V, p.states, p.element_size, caps.interpret):
        recompute, why = "on_chip", "16-bit, a wide spill-free V-block: W, U made in the walk, U never in HBM"
    else:
        recompute, why = "two_launch", (f"W, U in the walk would spill or be recomputed by narrow V-blocks "
                                        f"({_DTYPES.get(p.dtype)}, K = {p.K}, V-block {recompute_launch.block_v})")
    reasons.append(("recompute", why))
    if recompute == "two_launch" and segments == 1:
        rule = caps.two_streams and p.states <= OVERLAP_MAX_STATES and p.long_sequences(OVERLAP_MIN_TOKENS)
        overlap, why = _forced("overlap", o.overlap, rule,
                               f"{nh} on long sequences leave SMs idle beside the reverse pass" if rule else
                               f"only with two CUDA streams, sequences x heads <= {OVERLAP_MAX_STATES}, sequences "
                               f"of {OVERLAP_MIN_TOKENS}+ tokens")
    else:
        overlap = False
        why = "the segments run the recompute walk on the side stream" if segments > 1 else "nothing to overlap"
        if o.overlap and p.training:
            raise ValueError(f"overrides(overlap=True): only the two-launch recompute of an unsegmented backward "
                             f"overlaps (here recompute {recompute}, {segments} segments)")
    if overlap and not caps.two_streams:
        raise ValueError("overrides(overlap=True) needs two CUDA streams (a GPU, not the interpreter)")
    reasons.append(("overlap", why))

    if not p.training:
        reverse, why = "none", "inference: no backward"
    elif not hopper_fits:
        reverse, why = "portable", "the Hopper pass needs what the Hopper walk needs"
        if o.hopper_reverse:
            raise ValueError(f"overrides(hopper_reverse=True): {why}")
    else:
        # the gated portable pass spills more than the Hopper one, which therefore wins over two waves too
        waves = HOPPER_REVERSE_GATED_WAVES if p.gated else 1
        rule = (HOPPER_REVERSE_MIN_STATES <= p.states <= waves * caps.num_sms
                and p.long_sequences(HOPPER_REVERSE_MIN_TOKENS))
        hopper_reverse, why = _forced(
            "hopper_reverse", o.hopper_reverse, rule,
            f"{nh} within {waves} wave(s), sequences of {HOPPER_REVERSE_MIN_TOKENS}+ tokens: measured faster" if rule
            else f"measured faster only at {HOPPER_REVERSE_MIN_STATES} <= sequences x heads <= {waves * caps.num_sms} "
                 f"({waves} x the SMs) on sequences of {HOPPER_REVERSE_MIN_TOKENS}+ tokens")
        reverse = "hopper" if hopper_reverse else "portable"
    reasons.append(("reverse", why))
    if o.reverse_block_v is not None and reverse == "hopper":
        raise ValueError("overrides(reverse_block_v=...): the portable reverse pass's; the Hopper pass takes its own")
    rev_launch = (hopper_launch(p.states, caps.num_sms) if reverse == "hopper" else
                  _block_v(reverse_launch(p.K, p.V, p.states, p.element_size, caps.num_sms, caps.interpret),
                           "reverse_block_v", o.reverse_block_v))
    if reverse != "portable" or (p.gated and not p.per_channel):
        local_dv_apart, why = False, ("no backward" if reverse == "none" else
                                      "the Hopper pass computes the local dV' itself" if reverse == "hopper" else
                                      "the gated pass computes its local dV' itself (the decays E on its scores)")
        if o.local_dv_apart and p.training:  # (inference: the override does not apply)
            raise ValueError(f"overrides(local_dv_apart=True): {why}")
    else:
        local_dv_apart, why = _forced(
            "local_dv_apart", o.local_dv_apart, p.per_channel,
            "KDA's scores P under per-channel decays are parallel work over chunks in grads.dv_local; in the pass "
            "they would run once a chunk in every V-block program, on its serial path" if p.per_channel else
            "in the pass, from the Q, K and dO tiles it loads anyway: a launch and the local dV's HBM round trip less")
    reasons.append(("local_dv", why))

    return ChunkPlan(problem=p, caps=caps, walk=walk, residual=residual, split_partitions=partitions,
                     split_min_tokens=min_tokens, keep_states=keep, walk_launch=launch,
                     wy_launch=_wy_forward_launch(p, o, residual), recompute=recompute,
                     recompute_launch=recompute_launch, recompute_wy_launch=wy_launch(p.K, p.V, p.element_size, False),
                     overlap=overlap, segments=segments, reverse=reverse, reverse_launch=rev_launch,
                     local_dv_apart=local_dv_apart, dqkw_launch=_warps(DQKW_LAUNCH, "dqkw_warps", o.dqkw_warps),
                     wy_bwd_launch=_capped(wy_bwd_launch(p.K, p.V, p.element_size, p.per_channel,
                                                         p.gated and not p.per_channel),
                                           "wy_bwd_maxnreg", o.wy_bwd_maxnreg), reasons=tuple(reasons))


# ---------------------------------------------------------------------------------------------------------------
# What a plan runs, in words

def kernels(plan: ChunkPlan) -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
    """The launches of the forward and of the backward, in order (stage names as in the source tree)."""
    p = plan.problem
    walk = {"hopper": "hopper.walk", "portable_fused": "portable.walk (output fused)",
            "portable": "portable.walk"}[plan.walk]
    if plan.residual:
        wy = "portable.wy (T~ and its Tb pair)"
    elif p.per_channel:
        wy = ("portable.wy (T~, W, U; KDA's per-channel decays from the gate's sums, the walk's decayed K beside W"
              + ("; the output's scores P beside A, exp(Γ) ⊙ Q beside W)" if plan.walk == "portable" else ")"))
    else:
        wy = "portable.wy (T~, W, U)"
    gate = ["portable.gate (KDA's sums within sub-chunks)" if p.per_channel else "portable.gate (γ)"] if p.gated else []
    fwd = gate + [wy]
    if plan.split:
        fwd += [f"{walk} pass 1 without output, on U (and on W beside it, side stream)", "combine (torch)",
                f"{walk} pass 2 on {plan.split_partitions} partitions a long sequence"]
    else:
        fwd.append(walk + (" (stores S^T, V'^T per chunk)" if plan.keep_states else ""))
    if plan.walk == "portable":
        fwd.append("portable.output" + (" (the WY stage's scores P, kept for the backward's local dV')"
                                        if plan.keep_scores else " (the WY stage's scores P)" if p.per_channel
                                        else ""))
    if not p.training:
        return tuple(fwd), ()
    bwd = list(gate)
    if plan.recompute == "on_chip":
        bwd.append("portable.walk (W, U on chip from T~)")
    elif plan.recompute == "two_launch":
        bwd += ["portable.wy (W, U from T~" + ("; KDA's decayed K, Q for both serial passes beside W)" if p.per_channel
                                               else ")"),
                "portable.walk" + (" (side stream, beside the reverse pass)" if plan.overlap or plan.segments > 1
                                   else "")]
    rev = f"{plan.reverse}.reverse"
    grads = "portable.grads, portable.wy_bwd"
    if p.grouped:
        grads += f" (each {p.heads // p.key_heads} launches: one a member of each key head's group, dq and dk summed)"
    if plan.segments > 1:
        bwd.append(f"per segment (x{plan.segments}, last first): {rev}; then {grads} of the segment after it, "
                   f"side stream")
    elif plan.local_dv_apart:
        bwd += ["portable.grads (local dV'" + (" from the forward's scores P)" if plan.keep_scores else ")"),
                rev + " (reads the local dV')", grads]
    else:
        bwd += [rev, grads]
    if p.gated:
        bwd.append("portable.gate (dg per key channel)" if p.per_channel else "portable.gate (dg)")
    return tuple(fwd), tuple(bwd)


def explain(plan: ChunkPlan) -> str:
    """The plan as text: the problem, the device, each choice with its reason, and the launches."""
    p = plan.problem
    heads = f"{p.key_heads} key heads, {p.heads} value heads" if p.grouped else f"{p.heads} heads"
    gate = "per-channel gate (KDA), " if p.per_channel else "gated, " if p.gated else ""
    lines = [f"problem: {gate}{p.num_seqs} sequences, {p.total_tokens} tokens, {heads}, "
             f"K = {p.K}, V = {p.V}, {_DTYPES.get(p.dtype, p.dtype)}, chunk {p.chunk_size}, "
             f"{'training' if p.training else 'inference'}" + (", save_states" if p.save_states else "")
             + (", output_chunk_states" if p.chunk_states else ""),
             f"device:  {plan.caps.name}", "choices:"]
    backward = p.training
    values = {"walk": f"{plan.walk} [{plan.walk_launch}]",
              "split": f"{plan.split_partitions} partitions" if plan.split else "no",
              "segments": str(plan.segments), "keep_states": "yes" if plan.keep_states else "no",
              "residual": "yes" if plan.residual else "no (W, U)",
              "recompute": f"{plan.recompute} [{plan.recompute_launch}]" if plan.recompute in ("on_chip", "two_launch")
              else plan.recompute,
              "overlap": "yes" if plan.overlap else "no",
              "reverse": f"{plan.reverse} [{plan.reverse_launch}]" if backward else plan.reverse,
              "local_dv": "apart" if plan.local_dv_apart else "in the pass" if plan.reverse != "none" else "none"}
    for name, reason in plan.reasons:
        lines.append(f"  {name:<12} {values[name]:<34} {reason}")
    launches = f"wy [{plan.wy_launch}]"
    if backward:
        launches += (f"; recompute wy [{plan.recompute_wy_launch}]; dqkw [{plan.dqkw_launch}]; "
                     f"wy_bwd [{plan.wy_bwd_launch}]")
    lines.append(f"  {'launches':<12} {launches}")
    fwd, bwd = kernels(plan)
    lines.append("forward:  " + " -> ".join(fwd))
    if bwd:
        lines.append("backward: " + " -> ".join(bwd))
    return "\n".join(lines)


def plan_for_shape(B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype, gpu: str = "sm90",
                   lengths: Optional[Tuple[int, ...]] = None, chunk_size: int = 64, training: bool = True,
                   save_states: bool = False, gated: bool = False, key_heads: int = 0,
                   per_channel: bool = False) -> ChunkPlan:
    """The plan of a call on a named GPU (named_capabilities): [B, T] sequences, or packed `lengths` (B = 1); H value
    heads, key_heads of q and k (0: H); per_channel: KDA's gate."""
    num_seqs, tokens = (len(lengths), sum(lengths)) if lengths else (B, B * T)
    problem = Problem(dtype, H, K, V, num_seqs, tokens, chunk_size, training, save_states, True, gated or per_channel,
                      0 if key_heads == H else key_heads, per_channel=per_channel)
    return make_plan(problem, named_capabilities(gpu))
