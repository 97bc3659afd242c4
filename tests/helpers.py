"""Shared test utilities: input generation, the relative-RMS metric and its bounds (DESIGN.md §6); for the GPU tests
(marked gpu, skipped without CUDA; run with tests/gpu/run_suite.py) their shapes and the Gluon kernels' smoke calls."""
from __future__ import annotations

import os
import subprocess
import sys
from typing import Optional, Sequence

import pytest
import torch

from deltatron.reference import chunk_gated_delta_rule_reference, recurrent_gated_delta_rule

# Bounds on ||x - ref|| / ||ref|| against the float64 oracle.
BOUNDS = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 1e-2, torch.float64: 1e-10}

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# where the Triton kernels run in tests: the GPU when there is one, else the CPU through the interpreter
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel_rms(x: Optional[torch.Tensor], ref: Optional[torch.Tensor]) -> float:
    """||x - ref||_2 / ||ref||_2 in float64; NaN/inf in x give inf (never passes); ref must be nonzero."""
    assert x is not None and ref is not None, "missing tensor"
    assert x.shape == ref.shape, f"shape {tuple(x.shape)} != reference {tuple(ref.shape)}"
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    if not torch.isfinite(x).all():
        return float("inf")
    denom = ref.norm()
    assert denom > 0, "reference is all zeros: the check would be meaningless"
    return float((x - ref).norm() / denom)


def assert_within_bounds(got: dict, want: dict, dtype: torch.dtype) -> None:
    """Every quantity of want (o, state, gradients...) within the rel-RMS bound of dtype; names the ones
    that are not."""
    errors = {name: rel_rms(got[name], want[name]) for name in want}
    bad = {name: f"{e:.2e}" for name, e in errors.items() if not e <= BOUNDS[dtype]}
    assert not bad, f"rel RMS above {BOUNDS[dtype]:.0e}: {bad}"


def make_inputs(B, T, H, K, V, dtype=torch.float32, device="cpu", normalized_keys=True, beta_max=1.0,
                initial_state=False, N: Optional[int] = None, seed: Optional[int] = None, requires_grad=False):
    """Fresh random q, k, v, beta (beta in (0, beta_max)) and optionally h0 [N or B, H, K, V] (fp32; float64
    for float64 inputs). Keys are unit-norm when normalized_keys, else N(0, 1.5/K)-scaled. Returns a dict."""
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    q = torch.randn(B, T, H, K, generator=g, dtype=torch.float64)
    k = torch.randn(B, T, H, K, generator=g, dtype=torch.float64)
    k = k / k.norm(dim=-1, keepdim=True).clamp_min(1e-6) if normalized_keys else k * (1.5 / K) ** 0.5
    v = torch.randn(B, T, H, V, generator=g, dtype=torch.float64)
    beta = torch.rand(B, T, H, generator=g, dtype=torch.float64) * beta_max
    out = dict(q=q, k=k, v=v, beta=beta)
    if initial_state:
        out["initial_state"] = torch.randn(N if N is not None else B, H, K, V, generator=g, dtype=torch.float64)
    for name, x in out.items():
        # states are fp32, except in float64 oracle runs
        dt = (torch.float64 if dtype == torch.float64 else torch.float32) if name == "initial_state" else dtype
        out[name] = x.to(device=device, dtype=dt).requires_grad_(requires_grad)
    return out


def nearly_parallel_keys(shape, beta_low=1.95, dtype=torch.float32, device="cpu", seed=0):
    """Repeated tokens: keys [*shape] (shape ends with K) along one direction plus 1e-3 noise, unit norm,
    and beta [*shape[:-1]] in [beta_low, beta_low + 0.05]. With beta near 2 the inverse's products and the
    terms of W's rows cancel heavily. Returns (k, beta) in dtype on device."""
    g = torch.Generator().manual_seed(seed)
    base = torch.nn.functional.normalize(torch.randn(shape[-1], generator=g, dtype=torch.float64), dim=0)
    k = torch.nn.functional.normalize(base + 1e-3 * torch.randn(*shape, generator=g, dtype=torch.float64), dim=-1)
    beta = beta_low + 0.05 * torch.rand(*shape[:-1], generator=g, dtype=torch.float64)
    return k.to(device=device, dtype=dtype), beta.to(device=device, dtype=dtype)


def chunk_spans(lengths: Sequence[int], C: int) -> list:
    """(first token, last token + 1) of every chunk of the packed batch, in global chunk order."""
    out, bos = [], 0
    for L in lengths:
        out += [(t0, min(t0 + C, bos + L)) for t0 in range(bos, bos + L, C)]
        bos += L
    return out


def transposed_states(h: torch.Tensor, v_new: torch.Tensor, lengths: Sequence[int], C: int):
    """h [NT, H, K, V] and v_new [1, TT, H, V] laid out as the forward's Gluon walk saves them
    (hopper.walk.states_buffers): S^T [NT, H, V, K] and V'^T [NT, H, V, C], zero past each sequence's end."""
    vt = v_new.new_zeros(h.shape[0], h.shape[1], v_new.shape[-1], C)
    for c, (t0, t1) in enumerate(chunk_spans(lengths, C)):
        vt[c, ..., : t1 - t0] = v_new[0, t0:t1].permute(1, 2, 0)
    return h.transpose(-1, -2).contiguous(), vt


def twenty_lengths(longest: int, seed: int = 2) -> list:
    """Lengths of 20 packed sequences for the GPU tests: empty ones, 1 and 2 tokens, around a chunk's 64 tokens,
    and 13 random ones up to longest."""
    g = torch.Generator().manual_seed(seed)
    return [0, 1, 2, 63, 64, 65, 0] + torch.randint(1, longest, (13,), generator=g).tolist()


def random_cu_seqlens(lengths: Sequence[int], device="cpu") -> torch.Tensor:
    lens = torch.tensor([0, *lengths], dtype=torch.int64)
    return lens.cumsum(0).to(device=device, dtype=torch.int32)


def misaligned(x):
    """x's values in a contiguous tensor that starts one element (2 bytes) past a 16-byte boundary."""
    flat = torch.empty(x.numel() + 1, dtype=x.dtype)[1:]
    return flat.view(x.shape).copy_(x)


# ---------------------------------------------------------------- GPU tests (marked gpu)

# (B, T, H, head size K = V, chunk size) of the chunk pipeline's fixed-length tests, forward and backward:
# long and short sequences, B*H up to 64, every head size class (16, 64, 128, 256 and 100), every chunk size
CHUNK_SHAPES = [
    (2, 8192, 4, 128, 64),
    (4, 2048, 16, 64, 64),
    (1, 4096, 8, 256, 64),
    (8, 1000, 8, 100, 32),
    (2, 777, 32, 128, 16),
    (8, 128, 4, 16, 64),  # 16-wide heads (deltatron train's CPU preset), where the fused WY kernel once failed on the GPU
]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GLUON_SMOKE_TIMEOUT_S = 240  # compiles (seconds) and runs a small call (microseconds)


def gluon_smoke(code: str, *args: str) -> Optional[str]:
    """Runs code (python -c, args after it: a small call of a Gluon kernel) in a child process under
    GLUON_SMOKE_TIMEOUT_S and returns why it failed, or None. The Gluon kernels' partitions wait on each other
    through mbarriers: a wrong phase hangs the GPU rather than failing a test, and would take the whole suite
    with it, so each Gluon test file runs its kernel here before any launch in its own process. Skips the
    calling test off sm_90 or without Gluon."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels are written for sm_90 (wgmma, TMA, setmaxnreg)")
    pytest.importorskip("triton.experimental.gluon")
    try:
        proc = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=GLUON_SMOKE_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        return (f"did not finish in {GLUON_SMOKE_TIMEOUT_S} s (a hang: mbarrier phases?); its output: "
                f"{e.stdout!r} {e.stderr!r}")
    print(proc.stdout.strip())
    return f"failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}" if proc.returncode else None


def smoke_both_widths(code: str, kernel: str) -> None:
    """gluon_smoke at both V-block widths (block_v 128 and 64) before a test of another file launches the kernel;
    fails the calling test with the first failure."""
    for block_v in ("128", "64"):
        failure = gluon_smoke(code, block_v)
        if failure:
            pytest.fail(f"{kernel}'s smoke call (block_v {block_v}) " + failure, pytrace=False)


def require_smoke_passed(smoke_failures: dict, request, widths, kernel: str) -> None:
    """Fails the calling test unless the smoke calls (smoke_failures: {block_v: gluon_smoke's result}) of the
    V-block widths it runs passed: its block_v parameter, or every width for a test without one."""
    callspec = getattr(request.node, "callspec", None)
    runs = [callspec.params["block_v"]] if callspec is not None and "block_v" in callspec.params else widths
    failed = [f"block_v {block_v}: {smoke_failures[block_v]}" for block_v in runs if smoke_failures[block_v]]
    if failed:
        pytest.fail(f"{kernel}'s smoke call " + "\n".join(failed), pytrace=False)


def make_gated_inputs(B, T, Hk, Hv, K, V, dtype, N=None, gates="soft", initial_state=True, seed=0,
                      per_channel=False):
    """Fresh random float64 q, k [B, T, Hk, K] (unit-norm keys), v [B, T, Hv, V], beta in (0, 1), g [B, T, Hv]
    ([B, T, Hv, K] per_channel, KDA's gate; gates: "soft" -softplus(N(0, 1)), "strong" uniform in [-20, 0]) and
    h0 [N or B, Hv, K, V]."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hk, K, generator=gen, dtype=torch.float64)
    k = torch.nn.functional.normalize(torch.randn(B, T, Hk, K, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, Hv, V, generator=gen, dtype=torch.float64)
    beta = torch.rand(B, T, Hv, generator=gen, dtype=torch.float64)
    g_shape = (B, T, Hv, K) if per_channel else (B, T, Hv)
    if gates == "strong":
        g = -20 * torch.rand(*g_shape, generator=gen, dtype=torch.float64)
    else:
        g = -torch.nn.functional.softplus(torch.randn(*g_shape, generator=gen, dtype=torch.float64))
    out = dict(q=q, k=k, v=v, beta=beta, g=g)
    if initial_state:
        out["initial_state"] = torch.randn(N if N is not None else B, Hv, K, V, generator=gen, dtype=torch.float64)
    # the rounding of every input to what the kernels see; g and the state in fp32
    return {n: x.to(dtype if n in ("q", "k", "v", "beta") else torch.float32) for n, x in out.items()}


def gated_oracle(inp, scale, cu_seqlens, do, dht):
    """o, the final state and the gradients of <o, do> + <final state, dht> (dht may be None) by torch.autograd
    through the float64 recurrence, on make_gated_inputs's inputs. On a GPU, through the float64 chunkwise form
    there (equal to the recurrence within 1e-12: tests/reference/test_gated.py): the token loop's launches would
    take minutes at the GPU tests' lengths."""
    x = {n: t.to(DEVICE, torch.float64).requires_grad_() for n, t in inp.items()}
    if DEVICE == "cpu":
        form = recurrent_gated_delta_rule
    else:
        form, cu_seqlens = chunk_gated_delta_rule_reference, None if cu_seqlens is None else cu_seqlens.to(DEVICE)
        do, dht = do.to(DEVICE), None if dht is None else dht.to(DEVICE)
    o, ht = form(x["q"], x["k"], x["v"], x["g"], x["beta"], scale, x.get("initial_state"), True,
                 cu_seqlens=cu_seqlens)
    loss = (o * do.double()).sum() + (0 if dht is None else (ht * dht.double()).sum())
    grads = torch.autograd.grad(loss, list(x.values()))
    out = dict(o=o, state=ht, **{f"d{n}": d for n, d in zip(x, grads)})
    return out


def gated_form_outputs(form, inp, scale, info, do, dht, output_final_state=True, **options):
    """o, the final state and the six gradients of a Triton form's forward and backward (the form contract,
    deltatron/autograd.py) with the gate g."""
    dev = lambda x: None if x is None else x.to(DEVICE)
    q, k, v, beta, g, h0 = (dev(inp.get(n)) for n in ("q", "k", "v", "beta", "g", "initial_state"))
    o, ht, saved, _ = form.forward(q, k, v, beta, scale, h0, output_final_state, info, g=g, **options)
    dq, dk, dv, dbeta, dh0, dg = form.backward(q, k, v, beta, scale, h0, saved, dev(do), dev(dht), info, g=g,
                                               **options)
    out = dict(o=o, dq=dq, dk=dk, dv=dv, dbeta=dbeta, dg=dg)
    if h0 is not None:
        out["dinitial_state"] = dh0
    if output_final_state:
        out["state"] = ht
    return out


def check_gated_backward_deterministic(form, B, T, Hk, Hv, K, V, dtype, seed, per_channel=False, **options):
    """A gated Triton form's forward and backward twice on one input (initial state and final-state gradient
    included): every output and gradient the same bits."""
    inp, _, info = gated_case(B, T, Hk, Hv, K, V, dtype, seed=seed, per_channel=per_channel)
    gen = torch.Generator().manual_seed(seed + 1000)
    do = torch.randn(inp["v"].shape, generator=gen).to(dtype)
    dht = torch.randn(inp["initial_state"].shape, generator=gen)
    first, second = (gated_form_outputs(form, inp, 0.1, info, do, dht, **options) for _ in range(2))
    assert first.keys() == second.keys()
    for name, a in first.items():
        assert torch.equal(a, second[name]), f"{name} differs between two identical calls"


def gated_case(B, T, Hk, Hv, K, V, dtype, lengths=None, gates="soft", initial_state=True, seed=0, per_channel=False,
               g=None):
    """(make_gated_inputs' inputs with g replacing their gate where given, the packed lengths' cu_seqlens on the host
    or None, the kernels' SeqInfo on DEVICE): one case of a gated Triton form."""
    from deltatron.kernels.utils import seq_info

    inp = make_gated_inputs(B, T, Hk, Hv, K, V, dtype, N=None if lengths is None else len(lengths), gates=gates,
                            initial_state=initial_state, seed=seed, per_channel=per_channel)
    if g is not None:
        inp["g"] = g
    cu = None if lengths is None else random_cu_seqlens(lengths)
    return inp, cu, seq_info(B, T, torch.device(DEVICE), None if cu is None else cu.to(DEVICE), cu)


def half_strong_gate(B, T, H, K, seed):
    """A per-channel gate [B, T, H, K] whose even channels are strong (uniform in [-20, 0]) and odd ones nearly none
    (-1e-3 at most): late in a chunk the factors near 1 sit beside cumulative sums of hundreds, where differences of
    the chunk's cumulative sums would lose fp32 accuracy (DESIGN.md §12)."""
    gen = torch.Generator().manual_seed(seed)
    g = -20 * torch.rand(B, T, H, K, generator=gen)
    g[..., 1::2] = -1e-3 * torch.rand(B, T, H, K // 2, generator=gen)
    return g


def check_gated_form(form, B, T, Hk, Hv, K, V, dtype, lengths=None, gates="soft", initial_state=True, dht=True,
                     output_final_state=True, seed=0, per_channel=False, g=None, **options):
    """A gated Triton form (a module of deltatron.kernels) against gated_oracle within BOUNDS[dtype], on
    make_gated_inputs' inputs (per_channel: KDA's gate; g: a gate of that shape to use instead, fp32); lengths:
    packed sequences (B = 1, T = their sum). Returns the form's outputs."""
    N = None if lengths is None else len(lengths)
    inp, cu, info = gated_case(B, T, Hk, Hv, K, V, dtype, lengths, gates, initial_state, seed, per_channel, g)
    gen = torch.Generator().manual_seed(seed + 1000)
    do = torch.randn(B, T, Hv, V, generator=gen).to(dtype)
    ht_grad = torch.randn(N or B, Hv, K, V, generator=gen) if dht and output_final_state else None
    scale = K ** -0.5
    got = gated_form_outputs(form, inp, scale, info, do, ht_grad, output_final_state, **options)
    want = gated_oracle(inp, scale, cu, do, ht_grad)
    if not output_final_state:
        assert got.get("state") is None
        del want["state"]
    assert got["o"].dtype == dtype and got["dg"].dtype == torch.float32
    assert got["dq"].shape == inp["q"].shape and got["dg"].shape == inp["g"].shape
    assert got.keys() == want.keys()
    assert_within_bounds(got, want, dtype)
    return got


def check_varlen_prefill_then_steps(layer, hidden_size: int) -> None:
    """A token-mixer layer with a cache (deltatron.layers' DeltaNet and GatedDeltaNet): a packed prefill of four
    sequences, single-token steps, then a two-token continuation (the chunk path from the cached state) equal the
    layer on each whole sequence without a cache."""
    from deltatron.layers import DeltaNetCache

    lengths, steps = [3, 1, 6, 2], 5
    xs = [torch.randn(1, n + steps, hidden_size) for n in lengths]
    cache = DeltaNetCache()
    prompt = torch.cat([x[:, :n] for x, n in zip(xs, lengths)], dim=1)
    y_prompt = layer(prompt, cu_seqlens=random_cu_seqlens(lengths), cache=cache)
    ys = [layer(torch.cat([x[:, n + t:n + t + 1] for x, n in zip(xs, lengths)]), cache=cache)
          for t in range(steps - 2)]
    ys.append(layer(torch.cat([x[:, -2:] for x in xs]), cache=cache))
    cont = torch.cat(ys, dim=1)  # [N, steps, D]
    bounds = random_cu_seqlens(lengths).tolist()
    for i, (x, n) in enumerate(zip(xs, lengths)):
        full = layer(x)
        assert rel_rms(y_prompt[:, bounds[i]:bounds[i + 1]], full[:, :n]) <= 1e-5
        assert rel_rms(cont[i], full[0, n:]) <= 1e-5


def check_hidden_states_errors(layer, name: str) -> None:
    """The errors a token-mixer layer of hidden_size 16 raises on hidden_states that are not [B, T, 16] tensors."""
    import re

    from deltatron.layers import DeltaNetCache

    wrong_width = f"{name}: hidden_states must be [B, T, hidden_size=16], got [2, 10, 8]"
    with pytest.raises(ValueError, match=re.escape(wrong_width)):
        layer(torch.randn(2, 10, 8))
    with pytest.raises(ValueError, match=re.escape("must be [B, T, hidden_size=16], got [10, 16]")):
        layer(torch.randn(10, 16))  # no batch dimension
    with pytest.raises(ValueError, match=re.escape("got [1, 2, 10, 16]")):
        layer(torch.randn(1, 2, 10, 16), cache=DeltaNetCache())
    with pytest.raises(TypeError, match="hidden_states must be a torch.Tensor"):
        layer([[0.0] * 16])


def plain_causal_conv(x, conv):
    """A layer's short causal depthwise convolution with SiLU, token by token, written out: x [T, C] (functional,
    so that autograd runs through it)."""
    W = conv.kernel_size
    out = []
    for t in range(x.shape[0]):
        acc = conv.bias if conv.bias is not None else torch.zeros_like(x[0])
        for i in range(W):
            if t - (W - 1) + i >= 0:
                acc = acc + conv.weight[:, i] * x[t - (W - 1) + i]
        out.append(torch.nn.functional.silu(acc))
    return torch.stack(out)



def check_grouped_equals_repeated_heads(gva, full, projection: str, hidden_size: int) -> None:
    """A gated layer with grouped value heads (gva) equals the same layer (full) whose query/key heads repeat each of
    gva's for its group of value heads, given gva's weights with the q and k rows of `projection` and of the
    convolution repeated: value head h reads key head h // (Hv / Hk)."""
    kd, K, group = gva.key_dim, gva.head_k_dim, full.num_k_heads // gva.num_k_heads

    def repeat_heads(t):  # rows [q heads | k heads | rest] -> each q and k head `group` times
        q, k, rest = t[:kd], t[kd:2 * kd], t[2 * kd:]
        q, k = (u.unflatten(0, (-1, K)).repeat_interleave(group, 0).flatten(0, 1) for u in (q, k))
        return torch.cat([q, k, rest])

    state = dict(gva.state_dict())
    for name in (f"{projection}.weight", "conv1d.weight", "conv1d.bias"):
        state[name] = repeat_heads(state[name])
    full.load_state_dict(state)
    x = torch.randn(2, 11, hidden_size)
    assert rel_rms(gva(x), full(x)) <= 1e-5


def check_every_gradient(layer, hidden_size: int) -> None:
    """The layer keeps [B, T, hidden_size], and every parameter and the input get a finite, nonzero gradient."""
    x = torch.randn(3, 9, hidden_size, requires_grad=True)
    y = layer(x)
    assert y.shape == x.shape
    y.square().sum().backward()
    for name, p in [("x", x), *layer.named_parameters()]:
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
