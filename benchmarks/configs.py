"""The benchmark's configurations, implementations and inputs, and the roofline floor model.

The floor of a call is max(FLOPs / matmul ceiling, bytes / copy ceiling), with the FLOP and HBM byte counts of
work() (docs/performance.md derives them)."""
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

# Also the run order: the head-to-head rows first, so that a run cut short by --budget-s keeps the
# comparisons and loses the slow forms (fused_chunk and fused_recurrent take most of a full run).
IMPLS = (
    "deltatron.chunk",
    "deltatron.chunk_save_states",  # chunk_delta_rule(save_states=True): the opt-in that keeps the forward's states
    "fla.chunk",
    "flash_qla.g0",           # chunk_gated_delta_rule with log-decay g = 0; K = V = 128 only
    "fla.fused_recurrent",    # decode rows only
    "deltatron.fused_recurrent",
    "deltatron.fused_chunk",
)
OURS = tuple(i for i in IMPLS if i.startswith("deltatron."))


@dataclass(frozen=True)
class Config:
    name: str
    B: int
    T: int
    H: int
    K: int
    V: int
    seqlens: Optional[Tuple[int, ...]] = None   # packed sequences: B = 1, T = sum(seqlens)
    decode: bool = False                        # one token per sequence, from a given fp32 state


def dense(B: int, T: int, H: int, K: int) -> Config:
    return Config(f"b{B}-t{T}-h{H}-k{K}", B, T, H, K, K)


def varlen(total: int, n: int, H: int, K: int, seed: int) -> Config:
    """n sequences of random lengths >= 1 summing to total, from random cut points (seeded)."""
    cuts = sorted(random.Random(seed).sample(range(1, total), n - 1))
    lengths = tuple(b - a for a, b in zip([0, *cuts], [*cuts, total]))
    return Config(f"varlen{n}-t{total}-h{H}-k{K}", 1, total, H, K, K, seqlens=lengths)


def decode(B: int, H: int, K: int) -> Config:
    return Config(f"decode-b{B}-h{H}-k{K}", B, 1, H, K, K, decode=True)


CONFIGS = (
    dense(8, 2048, 16, 128),
    dense(4, 4096, 16, 128),
    dense(2, 8192, 32, 128),
    dense(1, 32768, 16, 128),
    dense(1, 32768, 64, 128),
    dense(16, 2048, 8, 64),
    dense(4, 4096, 16, 256),
    varlen(32768, 20, 16, 128, seed=0),
    decode(64, 16, 128),
)
SMOKE_CONFIGS = (dense(2, 40, 1, 16), varlen(40, 3, 1, 16, seed=0), decode(2, 1, 16))


def by_name(names: Sequence[str], smoke: bool = False) -> List[Config]:
    """The configurations of CONFIGS (SMOKE_CONFIGS with smoke) with these names, in this order; KeyError names
    the unknown one and lists the known."""
    table = {c.name: c for c in (SMOKE_CONFIGS if smoke else CONFIGS)}
    unknown = [n for n in names if n not in table]
    if unknown:
        raise KeyError(f"unknown configuration {', '.join(unknown)}; known: {', '.join(table)}")
    return [table[n] for n in names]


def applies(impl: str, cfg: Config) -> bool:
    """Which (implementation, configuration) pairs the run times; the others are not rows at all."""
    if cfg.decode:
        return impl in ("deltatron.fused_recurrent", "fla.fused_recurrent")
    if impl == "fla.fused_recurrent":
        return False
    if impl == "deltatron.fused_recurrent":
        return cfg.T <= RECURRENT_MAX_T
    if impl == "flash_qla.g0":
        return cfg.K == cfg.V == 128
    return True


# ---------------------------------------------------------------------------------------------------------
# Floor model
# ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Peaks:
    tflops: float
    tbps: float
    measured: bool


def work(cfg: Config) -> Dict[str, float]:
    """FLOPs and HBM bytes of one call: forward ('fwd') and forward+backward ('fwdbwd'); decode: one step."""
    n = cfg.B * cfg.T * cfg.H          # token-heads
    C, K, V = CHUNK, cfg.K, cfg.V
    if cfg.decode:                     # read and write the fp32 state; S^T k, k v'^T, S^T q
        return dict(flops_fwd=n * 6 * K * V, bytes_fwd=n * (8 * K * V + 2 * (2 * K + 2 * V)))
    fwd = 2 * (3 * C * K + 2 * C * V + 3 * K * V)
    bwd = 2 * (7 * C * K + 4 * C * V + 6 * K * V + 2 * C * C)
    return dict(flops_fwd=n * fwd, bytes_fwd=n * 2 * (2 * K + 2 * V),
                flops_fwdbwd=n * (fwd + bwd), bytes_fwdbwd=n * 2 * (6 * K + 5 * V))


def roofline(cfg: Config, times_ms: Dict[str, float], peaks: Peaks) -> Dict[str, float]:
    """The counts, the floor per phase, and for each timed phase the FLOP rate and % of the floor."""
    out = work(cfg)
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

def make_inputs(cfg: Config, device: torch.device, seed: int) -> Dict[str, torch.Tensor]:
    """bf16 q, k (unit-norm), v; beta = sigmoid(randn); do for the backward; decode: an fp32 state h."""
    gen = torch.Generator(device=device).manual_seed(seed)
    B, T, H, K, V = cfg.B, cfg.T, cfg.H, cfg.K, cfg.V

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    bf16 = torch.bfloat16
    x = dict(q=randn(B, T, H, K).to(bf16), k=F.normalize(randn(B, T, H, K), dim=-1).to(bf16),
             v=randn(B, T, H, V).to(bf16), beta=randn(B, T, H).sigmoid().to(bf16))
    if cfg.decode:
        x["h"] = randn(B, H, K, V)
        return x
    for name in GRAD_INPUTS:
        x[name].requires_grad_()
    x["do"] = randn(B, T, H, V).to(bf16)
    x["g"] = torch.zeros(B, T, H, device=device)    # FlashQLA's log-decay: 0 is the plain delta rule
    if cfg.seqlens is not None:
        cu = torch.tensor([0, *cfg.seqlens]).cumsum(0)
        x["cu_seqlens_cpu"] = cu
        x["cu_seqlens"] = cu.to(device)                       # int64, as fla documents it
        x["cu_seqlens_i32"] = cu.to(device, torch.int32)      # what FlashQLA builds for itself
    return x


def input_sets(cfg: Config, device: torch.device, l2_bytes: int, limit: int) -> List[Dict[str, torch.Tensor]]:
    """Enough independent input sets (at most limit) that cycling through them streams several L2s of
    data per pass."""
    first = make_inputs(cfg, device, seed=0)
    # by device type: torch.device("cuda") != the "cuda:0" its tensors report
    on_device = [t for t in first.values() if t.device.type == torch.device(device).type]
    nbytes = sum(t.numel() * t.element_size() for t in on_device)
    count = max(1, min(limit, math.ceil(L2_MULTIPLE * l2_bytes / nbytes)))
    return [first] + [make_inputs(cfg, device, seed=i) for i in range(1, count)]
