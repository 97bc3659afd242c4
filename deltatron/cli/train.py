"""`deltatron train`: a small language model of DeltaNet layers learns multi-query associative recall.

MQAR (Arora et al., 2023, "Zoology"): a sequence lists key-value pairs, then asks for every key again,
in random order; the model must predict each asked key's value. It measures what a recurrent state can store and
retrieve, which is what the delta rule improves over plain linear attention: `--mixer linear` trains the
same model with the additive update S += k v^T (no delta rule) for comparison, and `--mixer gated_deltanet` with
Qwen3-Next's Gated DeltaNet layer (the delta rule with a learned per-token decay, grouped value heads: --num-heads
value heads, half as many query/key heads when it is even). Data is generated on the fly
from the seed (no download); accuracy is measured on the values at query positions of a fixed held-out
set. Writes <out>/mqar_<mixer>.json (config, per-step losses, evaluations) and <out>/mqar.png (loss and
accuracy of every run in <out>, when matplotlib is installed).

Defaults: a CPU run of a few minutes (PyTorch backend); on a GPU larger settings and the Triton kernels. The gated
ops refuse the Triton backend where deltatron has no gated kernel for the form yet (the error says so);
DELTATRON_BACKEND=torch runs gated_deltanet on the PyTorch backend, on a GPU too."""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .. import backends
from ..layers import DeltaNet, GatedDeltaNet
from ..reference.common import l2norm
from . import fail, parse_device

IGNORE = -100
MIXERS = ("delta", "linear", "gated_deltanet")
MODE_MIXERS = ("delta", "gated_deltanet")      # the mixers whose layer takes --mode
# autocast dtype of training (fp32: no autocast); the long names are accepted on the command line too
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DTYPE_ALIASES = {"float32": "fp32", "bfloat16": "bf16"}

# Settings per device; every one can be overridden on the command line.
PRESETS = {
    "cpu": dict(vocab_size=64, seq_len=64, num_kv=12, d_model=64, num_layers=2, num_heads=4, batch_size=64,
                steps=800, lr=3e-3, eval_every=50, dtype="fp32"),
    "cuda": dict(vocab_size=128, seq_len=256, num_kv=32, d_model=128, num_layers=2, num_heads=4, batch_size=256,
                 steps=800, lr=3e-3, eval_every=50, dtype="bf16"),
}


@dataclass
class Config:
    vocab_size: int
    seq_len: int
    num_kv: int
    d_model: int
    num_layers: int
    num_heads: int
    batch_size: int
    steps: int
    lr: float
    eval_every: int
    dtype: str
    mixer: str = "delta"
    mode: str = "chunk"
    eval_size: int = 512
    seed: int = 0
    device: str = "cpu"
    compile: bool = False

    @classmethod
    def preset(cls, device: str, **overrides) -> "Config":
        """The device's settings (PRESETS) with the given ones replaced."""
        return cls(**dict(PRESETS["cuda" if device.startswith("cuda") else "cpu"], device=device, **overrides))


def mqar_batch(batch_size: int, seq_len: int, num_kv: int, vocab_size: int, generator: torch.Generator):
    """(inputs, targets), both [batch_size, seq_len] int64. Keys are tokens 1 .. vocab/2 - 1 (distinct within
    a sequence), values vocab/2 .. vocab - 1, 0 is filler. A sequence is k1 v1 ... kn vn, then every key once
    more, in random order at random even offsets of the rest, each followed by its value. The target at an
    asked key is its value (next-token prediction); every other target is ignored (-100)."""
    half = vocab_size // 2
    slots = (seq_len - 2 * num_kv) // 2
    if num_kv < 1 or num_kv > half - 1 or num_kv > slots:
        raise ValueError(f"num_kv = {num_kv} needs 1 <= num_kv <= vocab_size/2 - 1 = {half - 1} and "
                         f"<= (seq_len - 2 num_kv) / 2 = {slots} query slots")
    keys = torch.rand(batch_size, half - 1, generator=generator).argsort(-1)[:, :num_kv] + 1
    values = torch.randint(half, vocab_size, (batch_size, num_kv), generator=generator)
    inputs = torch.zeros(batch_size, seq_len, dtype=torch.int64)
    inputs[:, : 2 * num_kv] = torch.stack([keys, values], dim=-1).reshape(batch_size, 2 * num_kv)
    where = 2 * num_kv + 2 * torch.rand(batch_size, slots, generator=generator).argsort(-1)[:, :num_kv]
    inputs.scatter_(1, where, keys)
    inputs.scatter_(1, where + 1, values)
    targets = torch.full_like(inputs, IGNORE).scatter_(1, where, values)
    return inputs, targets


class LinearAttention(DeltaNet):
    """The baseline: the DeltaNet layer with the additive update S_t = S_{t-1} + k_t v_t^T (no delta rule,
    no beta), o_t = scale S_t^T q_t, same projections, convolutions, L2 norm and output gate. Training only
    (fixed-length batches, no cache): o = scale (Q K^T ⊙ M) V in plain PyTorch."""

    def __init__(self, **kwargs):
        super().__init__(use_beta=False, **kwargs)

    def _attend(self, q, k, v, beta, initial_state, output_final_state, cu_seqlens, cp_group=None):
        if initial_state is not None or output_final_state or cu_seqlens is not None or cp_group is not None:
            raise NotImplementedError("the linear-attention baseline takes fixed-length batches only, no cache and no "
                                      "cp_group")
        q, k = l2norm(q), l2norm(k)
        scores = torch.einsum("bthk,bshk->bhts", q, k).tril()  # s <= t
        return q.shape[-1] ** -0.5 * torch.einsum("bhts,bshv->bthv", scores, v), None


def gated_deltanet(d_model: int, num_heads: int, mode: str, layer_idx: int) -> GatedDeltaNet:
    """The Gated DeltaNet mixer at the width of the others: num_heads value heads of d_model / num_heads (the value
    width d_model, as DeltaNet's), and grouped value heads as in Qwen3-Next (16 query/key heads for 32 value heads):
    num_heads / 2 query/key heads of the same size when num_heads is even, else num_heads."""
    head_dim = d_model // num_heads
    return GatedDeltaNet(hidden_size=d_model, num_k_heads=num_heads // 2 if num_heads % 2 == 0 else num_heads,
                         num_v_heads=num_heads, head_k_dim=head_dim, head_v_dim=head_dim, mode=mode,
                         layer_idx=layer_idx)


class Block(nn.Module):
    """Pre-norm residual block: x + mixer(norm(x)), then x + MLP(norm(x))."""

    def __init__(self, d_model: int, num_heads: int, mixer: str, mode: str, layer_idx: int):
        super().__init__()
        self.mixer_norm = nn.RMSNorm(d_model)
        if mixer == "delta":
            self.mixer = DeltaNet(hidden_size=d_model, num_heads=num_heads, mode=mode, layer_idx=layer_idx)
        elif mixer == "gated_deltanet":
            self.mixer = gated_deltanet(d_model, num_heads, mode, layer_idx)
        else:
            self.mixer = LinearAttention(hidden_size=d_model, num_heads=num_heads, layer_idx=layer_idx)
        self.mlp_norm = nn.RMSNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x, cu_seqlens=None, cache=None, cp_group=None):
        x = x + self.mixer(self.mixer_norm(x), cu_seqlens=cu_seqlens, cache=cache, cp_group=cp_group)
        return x + self.mlp(self.mlp_norm(x))


class DeltaNetLM(nn.Module):
    """Token embedding, num_layers blocks, final RMSNorm, LM head: tokens [B, T] -> logits [B, T, vocab]; with
    cp_group, tokens is this rank's shard of each sequence (context parallelism, DESIGN.md §13)."""

    def __init__(self, vocab_size: int, d_model: int, num_layers: int, num_heads: int, mixer: str = "delta",
                 mode: str = "chunk"):
        super().__init__()
        if mixer not in MIXERS:
            raise ValueError(f"mixer must be one of {', '.join(MIXERS)}, got {mixer!r}")
        self.embed = nn.Embedding(vocab_size, d_model)
        self.blocks = nn.ModuleList(Block(d_model, num_heads, mixer, mode, i) for i in range(num_layers))
        self.norm = nn.RMSNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, tokens, cu_seqlens=None, cache=None, cp_group=None):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cu_seqlens=cu_seqlens, cache=cache, cp_group=cp_group)
        return self.lm_head(self.norm(x))


def recall_loss(logits, targets):
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE)


@torch.no_grad()
def evaluate(model, inputs, targets, batch_size: int, autocast) -> tuple:
    """(mean loss, accuracy) over the query positions of a held-out set."""
    loss_sum, correct, count = 0.0, 0, 0
    for i in range(0, inputs.shape[0], batch_size):
        x, y = inputs[i:i + batch_size], targets[i:i + batch_size]
        with autocast():
            logits = model(x)
        asked = y != IGNORE
        loss_sum += recall_loss(logits, y).item() * int(asked.sum())
        correct += int((logits.argmax(-1)[asked] == y[asked]).sum())
        count += int(asked.sum())
    return loss_sum / count, correct / count


class _LinePrinter:
    """Progress without tqdm: one line rewritten in place on a terminal, else a line every tenth of the run."""

    def __init__(self, total: int, desc: str, stream=None):
        self.total, self.desc, self.n, self.postfix = total, desc, 0, ""
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.start = time.perf_counter()

    def set_postfix_str(self, text: str) -> None:
        self.postfix = text

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.tty or self.n == self.total or self.n % max(1, self.total // 10) == 0:
            elapsed = time.perf_counter() - self.start
            line = f"{self.desc}: {self.n}/{self.total} [{elapsed:.0f}s] {self.postfix}"
            self.stream.write(("\r" + line) if self.tty else line + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")


def _progress(total: int, desc: str):
    try:
        from tqdm import tqdm
    except ImportError:
        return _LinePrinter(total, desc)
    return tqdm(total=total, desc=desc)


def _lr_at(step: int, cfg: Config) -> float:
    """Linear warm-up over the first 10% of steps, then cosine decay to a tenth of the peak."""
    warmup = max(1, cfg.steps // 10)
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    t = (step - warmup) / max(1, cfg.steps - warmup)
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * t)))


class TrainingDiverged(RuntimeError):
    """The training loss stopped being finite."""


def train(cfg: Config, progress: Callable = _progress) -> dict:
    """Trains and evaluates; returns the log (what the JSON file holds). Raises TrainingDiverged as soon
    as a step's loss is not finite, before that step updates the weights."""
    device = torch.device(cfg.device)
    torch.manual_seed(cfg.seed)
    model = DeltaNetLM(cfg.vocab_size, cfg.d_model, cfg.num_layers, cfg.num_heads, cfg.mixer, cfg.mode).to(device)
    forward = torch.compile(model, fullgraph=True) if cfg.compile else model
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([dict(params=decay, weight_decay=0.1), dict(params=rest, weight_decay=0.0)],
                                  lr=cfg.lr, betas=(0.9, 0.98))
    dtype = DTYPES[DTYPE_ALIASES.get(cfg.dtype, cfg.dtype)]

    def autocast():
        return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)

    data = torch.Generator().manual_seed(cfg.seed)
    eval_inputs, eval_targets = (t.to(device) for t in mqar_batch(
        cfg.eval_size, cfg.seq_len, cfg.num_kv, cfg.vocab_size, torch.Generator().manual_seed(cfg.seed + 1)))
    log = dict(config=asdict(cfg), backend=backends.select_backend(eval_inputs.float()),
               parameters=sum(p.numel() for p in model.parameters()), losses=[], evals=[])
    bar = progress(cfg.steps, f"mqar {cfg.mixer}")
    start = time.perf_counter()
    for step in range(cfg.steps):
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, cfg)
        inputs, targets = (t.to(device) for t in mqar_batch(cfg.batch_size, cfg.seq_len, cfg.num_kv,
                                                             cfg.vocab_size, data))
        with autocast():
            logits = forward(inputs)
        loss = recall_loss(logits, targets)
        log["losses"].append(loss.item())
        if not math.isfinite(log["losses"][-1]):
            bar.close()
            raise TrainingDiverged(
                f"the training loss is {log['losses'][-1]} at step {step + 1} of {cfg.steps} ({log['backend']} "
                f"backend, {cfg.dtype}); DELTATRON_BACKEND=torch runs the same model on the PyTorch reference")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            eval_loss, accuracy = evaluate(forward, eval_inputs, eval_targets, cfg.batch_size, autocast)
            log["evals"].append(dict(step=step + 1, loss=eval_loss, accuracy=accuracy,
                                     seconds=time.perf_counter() - start))
            recent = log["losses"][-cfg.eval_every:]
            bar.set_postfix_str(f"train loss {sum(recent) / len(recent):.3f} (mean of last {len(recent)} steps), "
                                f"held-out answer accuracy {accuracy:.3f}")
        bar.update(1)
    bar.close()
    log["seconds"] = time.perf_counter() - start
    log["final_accuracy"] = log["evals"][-1]["accuracy"]
    return log


def plot(logs: dict, path: str) -> bool:
    """Loss (per step) and held-out accuracy of each run in logs ({label: log}); False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    for label, log in sorted(logs.items()):
        ax_loss.plot(range(1, len(log["losses"]) + 1), log["losses"], label=label, linewidth=0.8)
        ax_acc.plot([e["step"] for e in log["evals"]], [e["accuracy"] for e in log["evals"]], label=label)
    ax_loss.set(xlabel="step", ylabel="training loss (query positions)", yscale="log")
    ax_acc.set(xlabel="step", ylabel="held-out answer accuracy", ylim=(0, 1.02))
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend()
    c = next(iter(logs.values()))["config"]
    fig.suptitle(f"multi-query associative recall: {c['num_kv']} pairs, length {c['seq_len']}, "
                 f"vocab {c['vocab_size']}, {c['num_layers']} layers of width {c['d_model']}, {c['num_heads']} heads")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _positive(kind):
    """An argparse type: a number of the given kind, > 0."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}") from None
        if not value > 0 or (kind is float and not math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"must be a positive {kind.__name__}, got {text}")
        return value

    parse.__name__ = f"positive {kind.__name__}"
    return parse


def _dtype(text: str) -> str:
    return DTYPE_ALIASES.get(text, text)


SETTINGS_HELP = {
    "vocab_size": "tokens in the vocabulary: 0 is filler, keys in the lower half, values in the upper half",
    "seq_len": "tokens per sequence",
    "num_kv": "key-value pairs per sequence (every key is asked once)",
    "d_model": "model width",
    "num_layers": "number of blocks (mixer + MLP)",
    "num_heads": "heads per mixer (d_model must be divisible by it); gated_deltanet: value heads, with half as many "
                 "query/key heads when even",
    "batch_size": "sequences per training step (and per evaluation batch)",
    "steps": "training steps",
    "lr": "peak learning rate (linear warm-up over 10%% of the steps, then cosine decay to a tenth)",
    "eval_every": "evaluate on the held-out set every this many steps (and after the last)",
    "eval_size": "sequences in the held-out set (default 512)",
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="deltatron train", description=__doc__.splitlines()[0],
                                     epilog="Settings left out take the device's preset: " + "; ".join(
                                         f"{d}: " + ", ".join(f"{k}={v}" for k, v in p.items())
                                         for d, p in PRESETS.items()))
    parser.add_argument("--mixer", choices=MIXERS, default="delta",
                        help="delta: DeltaNet layers; linear: the same model with plain linear attention; "
                             "gated_deltanet: Gated DeltaNet layers (Qwen3-Next's, grouped value heads)")
    parser.add_argument("--mode", choices=["chunk", "fused_recurrent"], default="chunk",
                        help="the delta-rule form used in training, delta and gated_deltanet mixers (default chunk)")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    parser.add_argument("--dtype", type=_dtype, choices=list(DTYPES), default=None,
                        help="bf16: train under bf16 autocast; fp32: no autocast (float32 and bfloat16 are "
                             "accepted too; default: the device's preset)")
    for name, kind in (("vocab_size", int), ("seq_len", int), ("num_kv", int), ("d_model", int),
                       ("num_layers", int), ("num_heads", int), ("batch_size", int), ("steps", int),
                       ("lr", float), ("eval_every", int), ("eval_size", int)):
        parser.add_argument("--" + name.replace("_", "-"), type=_positive(kind), default=None,
                            metavar=name.upper(), help=SETTINGS_HELP[name])
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the data (default 0)")
    parser.add_argument("--compile", action="store_true", help="train the torch.compile'd model (fullgraph)")
    parser.add_argument("--out", default="runs/mqar", help="output folder (default runs/mqar)")
    args = parser.parse_args(argv)

    try:
        device = parse_device(args.device)
    except ValueError as e:
        return fail("train", str(e))
    cfg = Config.preset(str(device), **{k: v for k, v in vars(args).items()
                                        if v is not None and k in Config.__dataclass_fields__ and k != "device"})
    if cfg.mixer not in MODE_MIXERS and cfg.mode != "chunk":
        parser.error(f"--mode applies to the {' and '.join(MODE_MIXERS)} mixers only")
    if cfg.d_model % cfg.num_heads:
        parser.error(f"--d-model ({cfg.d_model}) must be divisible by --num-heads ({cfg.num_heads})")
    try:
        mqar_batch(1, cfg.seq_len, cfg.num_kv, cfg.vocab_size, torch.Generator())
    except ValueError as e:
        parser.error(str(e))

    try:
        log = train(cfg)
    except TrainingDiverged as e:
        print(f"deltatron train: {e}", file=sys.stderr)
        return 1
    os.makedirs(args.out, exist_ok=True)
    log_path = os.path.join(args.out, f"mqar_{cfg.mixer}.json")
    with open(log_path, "w") as f:
        json.dump(log, f, indent=1)
    print(f"{cfg.mixer}: final held-out answer accuracy {log['final_accuracy']:.3f}, held-out loss "
          f"{log['evals'][-1]['loss']:.3f}, "
          f"{log['seconds']:.0f} s ({cfg.steps} steps, {log['parameters']} parameters, {device}, "
          f"{log['backend']} backend); log: {log_path}")
    logs = {}
    for path in sorted(glob.glob(os.path.join(args.out, "mqar_*.json"))):
        with open(path) as f:
            logs[os.path.basename(path)[5:-5]] = json.load(f)
    png = os.path.join(args.out, "mqar.png")
    if plot(logs, png):
        print(f"plot of {', '.join(sorted(logs))}: {png}")
    else:
        print("matplotlib is not installed: no plot (pip install matplotlib); the curves are in the JSON log")
    return 0
