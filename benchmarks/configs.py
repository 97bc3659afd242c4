"""The benchmark's configurations, implementations and inputs, and the roofline floor model.

The floor of a call is max(FLOPs / matmul ceiling, bytes / copy ceiling), with the FLOP and HBM byte counts of
work() (docs/performance.md derives them; work() says what the gate and grouped value heads add).

Two families of rows: the delta rule (deltatron's forms, fla's chunk_delta_rule, FlashQLA with g = 0) and the
gated delta rule (GATED: deltatron's, fla's and FlashQLA's chunk_gated_delta_rule with a real gate, called as
Qwen3-Next calls it, deltatron's and fla's gated decode step, fused_recurrent_gated_delta_rule, deltatron's
speculative-decoding verify step, and KDA's chunk_kda with a gate per key channel). A
configuration's H is its value heads (v, beta, g, the state), Hk its query/key heads: Hk < H is grouped value heads
(GVA), which only the gated rows time."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

CHUNK = 64                    # C of the floor model
ANCHOR_TFLOPS = 800.0         # H200 ceilings, used when the run does not measure its own (smoke)
ANCHOR_TBPS = 4.27
L2_BYTES = 60 * 10**6         # H200; used when the device does not report its L2 size
L2_MULTIPLE = 4               # rotate input sets until one pass over them spans this many L2s
MAX_INPUT_SETS = 32
RECURRENT_MAX_T = 4096        # the token-serial form runs the short configurations only
GRAD_INPUTS = ("q", "k", "v", "beta")
GATED_GRAD_INPUTS = ("q", "k", "v", "g", "beta")   # the gate g is computed outside the op, a leaf like the rest

# Also the run order: the head-to-head rows first (the delta rule's, then the gated rule's), so that a run cut
# short by --budget-s keeps the comparisons and loses the slow forms (fused_chunk and fused_recurrent take most
# of a full run).
IMPLS = (
    "deltatron.chunk",
    "deltatron.chunk_save_states",  # chunk_delta_rule(save_states=True): the opt-in that keeps the forward's states
    "fla.chunk",
    "flash_qla.g0",           # chunk_gated_delta_rule with log-decay g = 0; K = V = 128 only
    "deltatron.chunk_gated",  # chunk_gated_delta_rule with a real gate (GATED)
    "fla.chunk_gated",
    "flash_qla.gated",        # K = V = 128 only
    "fla.fused_recurrent",    # decode rows only
    "deltatron.fused_recurrent",
    "fla.fused_recurrent_gated",        # decode rows only: the gated decode step, the state in place (GATED)
    "deltatron.fused_recurrent_gated",  # decode rows only
    "deltatron.fused_recurrent_gated_v_first",  # decode rows only: the state as [V, K] (vLLM's pools), in place
    "deltatron.verify_gated",  # verify rows only: fused_recurrent_gated_delta_rule with per-token state slots
    "deltatron.chunk_kda",    # chunk_kda with a real per-channel gate (KDA)
    "fla.chunk_kda",
    "deltatron.fused_chunk",
)
OURS = tuple(i for i in IMPLS if i.startswith("deltatron."))
# The gated delta rule, with the inputs of make_inputs(gated=True), the gradients of GATED_GRAD_INPUTS and the
# ratios against the gated competitors (report.baseline_impl).
GATED_CHUNK = ("deltatron.chunk_gated", "fla.chunk_gated", "flash_qla.gated")
GATED_DECODE = ("fla.fused_recurrent_gated", "deltatron.fused_recurrent_gated",
                "deltatron.fused_recurrent_gated_v_first")
# The speculative verify step as vLLM and SGLang call it: num_accepted_tokens picks each sequence's starting state
# among the previous step's per-token slots, and the state after every token goes to its own slot
VERIFY = ("deltatron.verify_gated",)
KDA = ("deltatron.chunk_kda", "fla.chunk_kda")  # Kimi Delta Attention: a gate per key channel, g [B, T, H, K]
GATED = GATED_CHUNK + GATED_DECODE + VERIFY + KDA
# The token-serial decode forms: the only ones the decode rows time, and they time nothing else (but ours, ungated)
DECODE_IMPLS = ("fla.fused_recurrent", "deltatron.fused_recurrent") + GATED_DECODE + VERIFY


@dataclass(frozen=True)
class Config:
    name: str
    B: int
    T: int
    H: int                                      # value heads: v, beta, g, the state (Hv)
    K: int
    V: int
    seqlens: Optional[Tuple[int, ...]] = None   # packed sequences: B = 1, T = sum(seqlens)
    decode: bool = False                        # one token per sequence, from a given fp32 state
    verify: bool = False                        # decode of T draft tokens per sequence (VERIFY): a state slot each
    Hk: Optional[int] = None                    # query/key heads (default H); Hk < H: grouped value heads

    def __post_init__(self):
        if self.Hk is None:
            object.__setattr__(self, "Hk", self.H)
        if self.Hk < 1 or self.H % self.Hk:
            raise ValueError(f"{self.name}: H = {self.H} value heads must be a multiple of Hk = {self.Hk}")


def dense(B: int, T: int, H: int, K: int) -> Config:
    return Config(f"b{B}-t{T}-h{H}-k{K}", B, T, H, K, K)


def varlen(total: int, n: int, H: int, K: int, seed: int) -> Config:
    """n sequences of random lengths >= 1 summing to total, from random cut points (seeded)."""
    cuts = sorted(random.Random(seed).sample(range(1, total), n - 1))
    lengths = tuple(b - a for a, b in zip([0, *cuts], [*cuts, total]))
    return Config(f"varlen{n}-t{total}-h{H}-k{K}", 1, total, H, K, K, seqlens=lengths)


def decode(B: int, H: int, K: int) -> Config:
    return Config(f"decode-b{B}-h{H}-k{K}", B, 1, H, K, K, decode=True)


def grouped(B: int, T: int, Hk: int, H: int, K: int, name: Optional[str] = None) -> Config:
    """Grouped value heads: q, k with Hk heads, v, beta, g and the state with H (a multiple of Hk)."""
    return Config(name or f"b{B}-t{T}-hk{Hk}-hv{H}-k{K}", B, T, H, K, K, Hk=Hk)


def qwen3next(B: int, T: int) -> Config:
    """Qwen3-Next's Gated DeltaNet layer: 16 query/key heads, 32 value heads, K = V = 128."""
    return grouped(B, T, 16, 32, 128, name=f"qwen3next-b{B}-t{T}")


def qwen3next_decode(B: int) -> Config:
    """One decode step of Qwen3-Next's layer for B sequences, each from its fp32 state [32, 128, 128]."""
    return Config(f"qwen3next-decode-b{B}", B, 1, 32, 128, 128, decode=True, Hk=16)


def qwen3next_verify(B: int, S: int) -> Config:
    """A speculative verify step of Qwen3-Next's layer: B sequences of S draft tokens each."""
    return Config(f"qwen3next-verify-b{B}-s{S}", B, S, 32, 128, 128, decode=True, Hk=16, verify=True)


CONFIGS = (
    dense(8, 2048, 16, 128),
    dense(4, 4096, 16, 128),
    dense(2, 8192, 32, 128),
    dense(1, 32768, 16, 128),
    dense(1, 32768, 64, 128),
    dense(16, 2048, 8, 64),
    dense(4, 4096, 16, 256),
    varlen(32768, 20, 16, 128, seed=0),
    qwen3next(8, 4096),
    qwen3next(1, 32768),
    decode(64, 16, 128),
    *(qwen3next_decode(B) for B in (1, 8, 64, 256)),
    *(qwen3next_verify(B, 4) for B in (8, 64)),
)
SMOKE_CONFIGS = (dense(2, 40, 1, 16), varlen(40, 3, 1, 16, seed=0), decode(2, 1, 16), grouped(2, 40, 1, 2, 16),
                 Config("verify-b2-s3-hk1-hv2-k16", 2, 3, 2, 16, 16, decode=True, Hk=1, verify=True))


def by_name(names: Sequence[str], smoke: bool = False) -> List[Config]:
    """The configurations of CONFIGS (SMOKE_CONFIGS with smoke) with these names, in this order; KeyError names
    the unknown one and lists the known."""
    table = {c.name: c for c in (SMOKE_CONFIGS if smoke else CONFIGS)}
    unknown = [n for n in names if n not in table]
    if unknown:
        raise KeyError(f"unknown configuration {', '.join(unknown)}; known: {', '.join(table)}")
    return [table[n] for n in names]


def skip_reason(impl: str, cfg: Config) -> Optional[str]:
    """Why the run does not time this (implementation, configuration) pair, or None where it does. Skipped pairs
    are not rows at all; the report's legend states these rules."""
    if cfg.verify != (impl in VERIFY):
        return ("verify rows time deltatron's verify step only (the per-token state slots and num_accepted_tokens "
                "of vLLM's and SGLang's calls)" if cfg.verify else f"{impl} times the verify rows only")
    if cfg.decode and impl not in DECODE_IMPLS:
        return "decode rows time the token-serial fused_recurrent forms only"
    if not cfg.decode and impl in DECODE_IMPLS and impl != "deltatron.fused_recurrent":
        return f"{impl} times the decode rows only"
    if cfg.Hk != cfg.H and impl not in GATED:
        return ("grouped value heads (Hk < H): timed on the gated rows only (fla's and FlashQLA's ungated delta rule "
                "take one head count for q, k and v)")
    if impl == "deltatron.fused_recurrent" and cfg.T > RECURRENT_MAX_T:
        return f"the token-serial form runs T <= {RECURRENT_MAX_T} only"
    if impl in KDA and cfg.Hk != cfg.H:
        return "KDA rows at Kimi Linear's layout only: as many query/key heads as value heads"
    if impl.startswith("flash_qla.") and not cfg.K == cfg.V == 128:
        return "FlashQLA's kernels take K = V = 128 only"
    return None


def applies(impl: str, cfg: Config) -> bool:
    """Which (implementation, configuration) pairs the run times; the others are not rows at all."""
    return skip_reason(impl, cfg) is None


def grad_inputs(impl: str) -> Tuple[str, ...]:
    """The inputs a forward+backward row differentiates: the gated rows' include the gate g."""
    return GATED_GRAD_INPUTS if impl in GATED else GRAD_INPUTS


# ---------------------------------------------------------------------------------------------------------
# Floor model
# ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Peaks:
    tflops: float
    tbps: float
    measured: bool


def work(cfg: Config, gated: bool = False, per_channel: bool = False) -> Dict[str, float]:
    """FLOPs and HBM bytes of one call: forward ('fwd') and forward+backward ('fwdbwd'); decode: one step.

    Per value token-head (B T H of them) the chunkwise matmuls and the v, o, do, dv bytes; q, k and their
    gradients per query/key token-head (B T Hk): with grouped value heads a group of H / Hk value heads reads
    one q, k. The FLOPs stay per value head, as the kernels compute them (the q k^T and k k^T products a group
    could share are counted once per value head). The gated rule adds its fp32 log decay g: read by the
    forward (4 bytes a value token-head), read again and its gradient written by the backward (12 in all); its
    exp and cumulative sums are a few FLOPs a token against thousands, not counted. beta (2 bytes) is not
    counted either. KDA's gate (per_channel) has K of them a value token-head. A decode step reads and writes each
    sequence's fp32 state; a verify step reads it once and writes one state a token."""
    n = cfg.B * cfg.T * cfg.H          # value token-heads
    nk = cfg.B * cfg.T * cfg.Hk        # query/key token-heads
    C, K, V = CHUNK, cfg.K, cfg.V
    if cfg.decode:  # the fp32 states; S^T k, k v'^T, S^T q; q, k per key head, v, o (and g) per value head
        states = cfg.B * cfg.H + (n if cfg.verify else cfg.B * cfg.H)
        return dict(flops_fwd=n * 6 * K * V,
                    bytes_fwd=states * 4 * K * V + n * (2 * 2 * V + (4 if gated else 0)) + nk * 2 * 2 * K)
    fwd = 2 * (3 * C * K + 2 * C * V + 3 * K * V)
    bwd = 2 * (7 * C * K + 4 * C * V + 6 * K * V + 2 * C * C)
    width = K if per_channel else 1
    gate_fwd, gate_fwdbwd = (4 * width, 12 * width) if gated else (0, 0)
    return dict(flops_fwd=n * fwd, bytes_fwd=nk * 2 * 2 * K + n * (2 * 2 * V + gate_fwd),
                flops_fwdbwd=n * (fwd + bwd), bytes_fwdbwd=nk * 2 * 6 * K + n * (2 * 5 * V + gate_fwdbwd))


def roofline(cfg: Config, times_ms: Dict[str, float], peaks: Peaks, gated: bool = False,
             per_channel: bool = False) -> Dict[str, float]:
    """The counts (work(cfg, gated, per_channel)), the floor per phase, and for each timed phase the FLOP rate and %
    of the floor."""
    out = work(cfg, gated, per_channel)
    for phase in ("fwd", "fwdbwd"):
        if f"flops_{phase}" not in out:
            continue
        flops, nbytes = out[f"flops_{phase}"], out[f"bytes_{phase}"]
        floor_ms = 1e3 * max(flops / (peaks.tflops * 1e12), nbytes / (peaks.tbps * 1e12))
        out[f"floor_{phase}_ms"] = floor_ms
        ms = times_ms.get(phase)
        if ms:
            out[f"tflops_{phase}"] = flops / (ms * 1e-3) / 1e12
            out[f"pct_floor_{phase}"] = 100.0 * floor_ms / ms
    return out


# ---------------------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------------------

def make_inputs(cfg: Config, device: torch.device, seed: int, gated: bool = False,
                per_channel: bool = False) -> Dict[str, torch.Tensor]:
    """bf16 q and k (unit-norm) with Hk heads, v with H; beta = sigmoid(randn); do for the backward; decode: an fp32
    state h (and h_v_first, the same states as [V, K]); verify: a state pool with a slot per token and the accepted
    tokens of the previous step. g: zeros (FlashQLA's log decay for the plain delta rule), or with gated the real
    gate of gate() (fp32, a leaf that takes a gradient), drawn after everything else so the other inputs are the
    same."""
    gen = torch.Generator(device=device).manual_seed(seed)
    B, T, H, Hk, K, V = cfg.B, cfg.T, cfg.H, cfg.Hk, cfg.K, cfg.V

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    bf16 = torch.bfloat16
    x = dict(q=randn(B, T, Hk, K).to(bf16), k=F.normalize(randn(B, T, Hk, K), dim=-1).to(bf16),
             v=randn(B, T, H, V).to(bf16), beta=randn(B, T, H).sigmoid().to(bf16))
    if cfg.verify:  # a pool of B T slots: sequence b's token t writes slot b T + t, and starts from its token
        # accepted[b] - 1's slot of the previous step
        x["pool"] = randn(B * T, H, K, V)
        x["slots"] = torch.arange(B * T, dtype=torch.int32, device=device).view(B, T)
        x["accepted"] = torch.randint(1, T + 1, (B,), generator=gen, device=device, dtype=torch.int32)
    elif cfg.decode:
        x["h"] = randn(B, H, K, V)
        x["h_v_first"] = x["h"].transpose(-1, -2).contiguous()  # the same states as [V, K]
    if cfg.decode:
        if gated:
            x["g"] = gate(B, T, H, gen, device)
        return x
    x["do"] = randn(B, T, H, V).to(bf16)
    if per_channel:  # KDA: a gate per key channel, as Kimi Linear makes it
        x["g"] = kimi_gate(B, T, H, K, gen, device)
    else:
        x["g"] = gate(B, T, H, gen, device) if gated else torch.zeros(B, T, H, device=device)
    for name in GATED_GRAD_INPUTS if gated else GRAD_INPUTS:
        x[name].requires_grad_()
    if cfg.seqlens is not None:
        cu = torch.tensor([0, *cfg.seqlens]).cumsum(0)
        x["cu_seqlens_cpu"] = cu
        x["cu_seqlens"] = cu.to(device)                       # int64, as fla documents it
        x["cu_seqlens_i32"] = cu.to(device, torch.int32)      # what FlashQLA builds for itself
    return x


def gate(B: int, T: int, H: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """The log decay [B, T, H] (fp32, <= 0) as Qwen3-Next computes it before its gated op:
    g = -exp(A_log) softplus(a + dt_bias), with a the projection's output (randn here) and its initialization of
    the per-head parameters, A_log = log(uniform(0, 16)) and dt_bias = 1. The decay per token exp(g) then
    ranges from about 1 (A near 0) to far below (A near 16), as in a model at the start of training."""
    a = torch.randn(B, T, H, generator=gen, device=device)
    A_log = torch.rand(H, generator=gen, device=device).mul(16).log()
    dt_bias = torch.ones(H, device=device)
    return -A_log.exp() * F.softplus(a + dt_bias)


def kimi_gate(B: int, T: int, H: int, K: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """KDA's log decay per key channel [B, T, H, K] (fp32, <= 0) as Kimi Linear computes it before its op
    (transformers' KimiLinearForgetGate): g = -exp(A_log) softplus(a + dt_bias), with a the projection's output (randn
    here) and Kimi Linear's initialization, A_log = log(uniform(1, 16)) per head and dt_bias the inverse softplus of dt,
    log-uniform in [1e-3, 1e-1] per head and channel. The decay per token ranges from about 1 to about exp(-10)."""
    a = torch.randn(B, T, H, K, generator=gen, device=device)
    A_log = (1 + 15 * torch.rand(H, 1, generator=gen, device=device)).log()
    dt = (math.log(1e-3) + (math.log(1e-1) - math.log(1e-3)) * torch.rand(H, K, generator=gen, device=device)).exp()
    dt_bias = dt + torch.log(-torch.expm1(-dt))
    return -A_log.exp() * F.softplus(a + dt_bias)


def input_sets(cfg: Config, device: torch.device, l2_bytes: int, limit: int,
               gated: bool = False, per_channel: bool = False) -> List[Dict[str, torch.Tensor]]:
    """Enough independent input sets (at most limit) that cycling through them streams several L2s of
    data per pass."""
    first = make_inputs(cfg, device, seed=0, gated=gated, per_channel=per_channel)
    # by device type: torch.device("cuda") != the "cuda:0" its tensors report
    on_device = [t for t in first.values() if t.device.type == torch.device(device).type]
    nbytes = sum(t.numel() * t.element_size() for t in on_device)
    count = max(1, min(limit, math.ceil(L2_MULTIPLE * l2_bytes / nbytes)))
    return [first] + [make_inputs(cfg, device, seed=i, gated=gated, per_channel=per_channel) for i in range(1, count)]
