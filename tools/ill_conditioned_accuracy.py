"""Whether chunk_delta_rule's bf16 errors on nearly parallel keys (repeated tokens), beta from 1 to near 2, come from
the problem's conditioning or from an avoidable rounding point of the chunk kernels.

Inputs: q, v ~ N(0, 1); keys along one direction plus `noise` times N(0, 1), unit norm (tests/helpers.
nearly_parallel_keys with the noise as a parameter); beta uniform in [beta, min(beta + 0.05, 2)]. The loss is
<o, dO> + <S_T, dS_T> with random dO, dS_T, so the final state's gradient enters the backward too.

Every row is measured against autograd through the float64 recurrence (deltatron.reference) run on the
bf16-rounded inputs, as the tests measure, and gives the relative RMS error of o, the final state S and the
gradients (mean over seeds). Rows:
  input rounding            the float64 recurrence on the unrounded inputs: how much rounding the inputs to bf16
                            moves the exact answer (the problem's sensitivity at bf16 input precision; not an
                            error of any implementation, since the tests compare on rounded inputs)
  deltatron bf16            chunk_delta_rule on bf16 inputs (Triton kernels; the interpreter without a GPU)
  deltatron fp32 -> bf16    chunk_delta_rule on the same inputs cast to fp32, o and gradients rounded to bf16 at
                            the end: the floor of an implementation whose inputs and results are bf16
  fla-core bf16             fla-core's chunk_delta_rule on bf16 inputs, where fla is importable and a GPU runs it
  model: <points>           a float64 chunkwise model (the same chunk size) that rounds to bf16 at the named points
                            only, o and gradients rounded at the end. The points are where deltatron's chunk
                            kernels hold a value in 16 bits (kernels/chunk/*.py docstrings):
      W, U      W = T~ diag(beta) K and U = T~ diag(beta) V as stored; in the backward dW and dU as stored
      h         the state entering each chunk, in the products W S and Q S (the accumulator stays fp32)
      v_new     V' = U - W S as stored and used; in the backward the full dV' as stored and used
      qk        the masked Q K^T in the output's product; in the backward (dO V'^T ⊙ M) alike
      dh        the backward's dS_next in its products K dS_next and V' dS_next^T (its chain stays fp32)
      wy_bwd    T~ diag(beta) as an operand of the WY backward's products T~^T dW, T~^T dU
      T16       T~ diag(beta) rounded before the W, U products: fla's kernels do this, deltatron passes it
                as a 16-bit hi + lo pair (wy.tinv_beta_pair) and does not
The "deltatron" model uses every point but T16, "fla-like" every point. --ablation adds the model with each point
alone; --wy-stage runs the WY backward stage alone (wy_bwd) on the problem's own dW, dU and on random ones.
Conditioning columns, means over chunks: |T~ diag(beta)|_2 (spectral norm), and |V'| / |K^T V'| (Frobenius): how much
the rows of V' cancel in the state's update K^T V' (and likewise in the output's (Q K^T ⊙ M) V'), which is what
turns a 16-bit U, V' or Q K^T into error (unit keys spread over K dimensions give about 1).

    python tools/ill_conditioned_accuracy.py [--betas 1.0 1.5 1.9 1.95 1.99] [--noises 1e-3]
        [--T 512] [--H 2] [--K 64] [--V 64] [--chunk 64] [--seeds 0 1] [--dtype bf16]
        [--ablation] [--wy-stage]

Without a GPU it sets TRITON_INTERPRET=1 and DELTATRON_BACKEND=triton itself (unless already set), so the rows
"deltatron" are the Triton kernels in the interpreter (where tf32 is exact fp32; deltatron's mm widens 16-bit
operands to fp32 there, so bf16 products are right). The defaults take about 4 minutes on 2 CPU cores.
--dtype fp16 puts fp16 wherever this text says bf16 (the rows are named after the dtype)."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: deltatron and tests.helpers

if not torch.cuda.is_available():  # before deltatron imports triton: the interpreter is chosen at its import
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("DELTATRON_BACKEND", "triton")

from deltatron import chunk_delta_rule  # noqa: E402
from deltatron.reference import recurrent_delta_rule  # noqa: E402
from tests.helpers import rel_rms  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the 16-bit dtype under study: bf16, or fp16 with --dtype fp16 (main sets it before any case runs)
LOW = torch.bfloat16
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
BOUNDS = {torch.bfloat16: 1e-2, torch.float16: 3e-3}  # DESIGN.md §6
RESULTS = ("o", "S", "dq", "dk", "dv", "dbeta")
# (rounds the value in the forward, rounds its gradient in the backward) at each point (module docstring)
POINTS = {"T16": (True, False), "W": (True, True), "U": (True, True), "h": (True, False),
          "v_new": (True, True), "qk": (True, True), "dh": (False, True)}
DELTATRON_POINTS = ("W", "U", "h", "v_new", "qk", "dh", "wy_bwd")
MODELS = {
    "model: inputs and results only": (),
    "model: deltatron's points, forward only": ("W", "U", "h", "v_new", "qk"),
    "model: deltatron's points": DELTATRON_POINTS,
    "model: deltatron's but U, V' fp32": ("W", "h", "qk", "dh", "wy_bwd"),
    "model: deltatron's but U, V', qk fp32": ("W", "h", "dh", "wy_bwd"),
    "model: deltatron's but U, V', qk, wy_bwd fp32": ("W", "h", "dh"),
    "model: fla-like (+ T16)": DELTATRON_POINTS + ("T16",),
}
ABLATIONS = {f"model: {p} only": (p,) for p in DELTATRON_POINTS}


def fla_chunk_delta_rule():
    """fla-core's chunk_delta_rule (the same signature as deltatron's) on a GPU where fla is importable, else
    None: its Triton kernels are not meant for the interpreter."""
    if DEVICE != "cuda":
        return None
    try:
        from fla.ops.delta_rule import chunk_delta_rule as fla_chunk
    except ImportError:
        return None
    return fla_chunk


def low_name() -> str:
    return next(name for name, dtype in DTYPES.items() if dtype == LOW)


def to_low(x: torch.Tensor) -> torch.Tensor:
    """x rounded to LOW, in x's dtype."""
    return x.to(LOW).to(x.dtype)


class Round(torch.autograd.Function):
    """A value held in 16 bits: rounded in the forward and/or its gradient rounded in the backward."""

    @staticmethod
    def forward(ctx, x, rounds_value, rounds_grad):
        ctx.rounds_grad = rounds_grad
        return to_low(x) if rounds_value else x.clone()

    @staticmethod
    def backward(ctx, grad):
        return (to_low(grad) if ctx.rounds_grad else grad), None, None


class ProductLowBackward(torch.autograd.Function):
    """a @ b, exact in the forward; its backward takes a rounded to 16 bits in a^T dY (the WY backward's T~^T dW,
    T~^T dU with T~ rounded) and b as it is (K, V are 16-bit inputs already)."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a @ b

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        return grad @ b.transpose(-1, -2), to_low(a).transpose(-1, -2) @ grad


def to_chunks(x, chunk):
    """[T, H, *] -> [H, T / chunk, chunk, *]."""
    return x.movedim(1, 0).reshape(x.shape[1], x.shape[0] // chunk, chunk, *x.shape[2:])


def from_chunks(x):
    """[H, NC, C, *] -> [1, NC * C, H, *], contiguous: the kernels' packed layout."""
    return x.movedim(0, 2).reshape(1, x.shape[1] * x.shape[2], x.shape[0], *x.shape[3:]).contiguous()


def wy_factors(k_c, v_c, b_c, points):
    """T~, T~ diag(beta), W and U of every chunk ([H, NC, C, *], float64), 16-bit at the named points."""
    def held(name, x):
        return Round.apply(x, *POINTS[name]) if name in points else x

    chunk = k_c.shape[-2]
    eye = torch.eye(chunk, dtype=k_c.dtype)
    A = torch.tril(b_c[..., None] * (k_c @ k_c.transpose(-1, -2)), diagonal=-1)
    t_inv = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False, unitriangular=True)
    t_beta = held("T16", t_inv * b_c[..., None, :])
    product = ProductLowBackward.apply if "wy_bwd" in points else torch.matmul
    return t_inv, t_beta, held("W", product(t_beta, k_c)), held("U", product(t_beta, v_c))


def state_pass(q_c, k_c, W, U, scale, points):
    """o [H, NC, C, V] and the final state [H, K, V] from W, U (float64), 16-bit at the named points; also the
    mean over chunks of |V'| / |K^T V'|."""
    def held(name, x):
        return Round.apply(x, *POINTS[name]) if name in points else x

    chunk = k_c.shape[-2]
    causal = torch.ones(chunk, chunk, dtype=torch.bool).tril()
    S = q_c.new_zeros(k_c.shape[0], k_c.shape[-1], U.shape[-1])
    outs, cancellations = [], []
    for c in range(k_c.shape[1]):
        S_held = held("h", S)
        v_new = held("v_new", U[:, c] - W[:, c] @ S_held)
        qk = held("qk", (q_c[:, c] @ k_c[:, c].transpose(-1, -2)).masked_fill(~causal, 0))
        outs.append(scale * (q_c[:, c] @ S_held + qk @ v_new))
        update = k_c[:, c].transpose(-1, -2) @ v_new
        cancellations.append(v_new.detach().norm(dim=(-2, -1)) / update.detach().norm(dim=(-2, -1)))
        S = S + held("dh", update)
    return torch.stack(outs, 1), S, float(torch.stack(cancellations).mean())


def chunk_model(q, k, v, beta, scale, points, chunk):
    """(o [T, H, V], final state) of the chunkwise delta rule in float64, [T, H, *] inputs (one sequence, T a
    multiple of chunk), 16-bit only at the named points. Also returns (|T~ diag(beta)|_2 mean, |V'| / |K^T V'|
    mean)."""
    q_c, k_c, v_c, b_c = (to_chunks(x, chunk) for x in (q, k, v, beta))
    _, t_beta, W, U = wy_factors(k_c, v_c, b_c, points)
    o_c, S, cancellation = state_pass(q_c, k_c, W, U, scale, points)
    conditioning = (float(torch.linalg.matrix_norm(t_beta.detach(), ord=2).mean()), cancellation)
    return from_chunks(o_c)[0], S, conditioning


def make_case(T, H, K, V, beta_low, noise, seed):
    """float64 q, k, v, beta [B=1, T, H, *] and the loss's dO, dS_T (module docstring)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.nn.functional.normalize(torch.randn(K, generator=g, dtype=torch.float64), dim=0)
    k = torch.nn.functional.normalize(base + noise * torch.randn(1, T, H, K, generator=g, dtype=torch.float64),
                                      dim=-1)
    spread = min(0.05, 2.0 - beta_low)
    beta = beta_low + spread * torch.rand(1, T, H, generator=g, dtype=torch.float64)
    q = torch.randn(1, T, H, K, generator=g, dtype=torch.float64)
    v = torch.randn(1, T, H, V, generator=g, dtype=torch.float64)
    d_o = torch.randn(1, T, H, V, generator=g, dtype=torch.float64)
    d_state = torch.randn(1, H, K, V, generator=g, dtype=torch.float64)
    return dict(q=q, k=k, v=v, beta=beta), d_o, d_state


def results_of(run, inputs, d_o, d_state, dtype, device="cpu"):
    """o, S and the gradients of <o, dO> + <S, dS_T> from run(q, k, v, beta) -> (o, S), inputs cast to dtype
    on device."""
    leaves = {n: x.detach().to(device=device, dtype=dtype).requires_grad_() for n, x in inputs.items()}
    o, S = run(**leaves)
    loss = (o.double() * d_o.to(device)).sum() + (S.double() * d_state.to(device)).sum()
    grads = torch.autograd.grad(loss, [leaves[n] for n in ("q", "k", "v", "beta")])
    return dict(zip(RESULTS, (o, S, *grads)))


def rounded_results(res):
    """o and the gradients rounded to LOW (what a 16-bit call returns; the state stays fp32)."""
    return {n: (x.float() if n == "S" else to_low(x.double())) for n, x in res.items()}


def measure_case(T, H, K, V, chunk, beta_low, noise, seed, rows):
    """{row: {result: rel RMS}} and the case's conditioning columns."""
    inputs, d_o, d_state = make_case(T, H, K, V, beta_low, noise, seed)
    rounded = {n: to_low(x) for n, x in inputs.items()}
    scale = K ** -0.5

    def recurrence(q, k, v, beta):
        return recurrent_delta_rule(q, k, v, beta, scale, output_final_state=True)

    def deltatron(q, k, v, beta):
        return chunk_delta_rule(q, k, v, beta, scale, output_final_state=True, chunk_size=chunk)

    conditioning = []

    def model(points):
        def run(q, k, v, beta):
            o, S, cond = chunk_model(q[0], k[0], v[0], beta[0], scale, points, chunk)
            conditioning.append(cond)
            return o[None], S[None]
        return run

    exact = results_of(recurrence, rounded, d_o, d_state, torch.float64)
    in_fp32 = results_of(deltatron, rounded, d_o, d_state, torch.float32, DEVICE)
    got = {"input rounding": results_of(recurrence, inputs, d_o, d_state, torch.float64),
           f"deltatron {low_name()}": results_of(deltatron, rounded, d_o, d_state, LOW, DEVICE),
           f"deltatron fp32 -> {low_name()}": rounded_results(in_fp32)}
    fla_chunk = fla_chunk_delta_rule()
    if fla_chunk is not None:
        def fla(q, k, v, beta):
            return fla_chunk(q, k, v, beta, scale, output_final_state=True)
        got[f"fla-core {low_name()}"] = results_of(fla, rounded, d_o, d_state, LOW, DEVICE)
    for row, points in rows.items():
        got[row] = rounded_results(results_of(model(points), rounded, d_o, d_state, torch.float64))
    errors = {row: {n: rel_rms(res[n], exact[n]) for n in RESULTS} for row, res in got.items()}
    return errors, conditioning[0]


def wy_stage_errors(T, H, K, V, chunk, beta_low, noise, seed):
    """The WY backward stage alone (kernels/chunk/wy_bwd.py) in LOW, fed this case's own dW, dU (the loss's,
    through the float64 model, rounded to LOW as the backward stores them) and then random ones of the same
    RMS (what tests/kernels/test_chunk_backward.py::test_wy_bwd feeds): {feed: (dk, dv, dbeta) rel RMS} against
    autograd of the float64 W, U with the same rounded dW, dU."""
    from deltatron.kernels.chunk.portable import wy_bwd
    from deltatron.kernels.utils import seq_info

    inputs, d_o, d_state = make_case(T, H, K, V, beta_low, noise, seed)
    q, k, v, beta = (to_low(inputs[n])[0] for n in ("q", "k", "v", "beta"))
    leaves = [x.clone().requires_grad_() for x in (k, v, beta)]
    t_inv, _, W, U = wy_factors(*(to_chunks(x, chunk) for x in leaves), ())
    W_leaf, U_leaf = W.detach().requires_grad_(), U.detach().requires_grad_()
    o_c, S, _ = state_pass(to_chunks(q, chunk), to_chunks(k, chunk), W_leaf, U_leaf, K ** -0.5, ())
    loss = (from_chunks(o_c) * d_o).sum() + (S * d_state[0]).sum()
    d_w, d_u = torch.autograd.grad(loss, (W_leaf, U_leaf))
    g = torch.Generator().manual_seed(seed)
    feeds = {"the problem's dW, dU": (d_w, d_u),
             "random dW, dU": tuple(torch.randn(x.shape, generator=g, dtype=x.dtype) * x.pow(2).mean().sqrt()
                                    for x in (d_w, d_u))}
    info = seq_info(1, T, torch.device(DEVICE), None, None)
    on_device = {n: x[None].to(device=DEVICE, dtype=LOW) for n, x in zip(("k", "v", "beta"), (k, v, beta))}
    errors = {}
    for feed, (d_w, d_u) in feeds.items():
        d_w, d_u = to_low(d_w), to_low(d_u)
        want = torch.autograd.grad((W * d_w).sum() + (U * d_u).sum(), leaves, retain_graph=True)
        got = wy_bwd.wy_bwd(on_device["k"], on_device["v"], on_device["beta"],
                            from_chunks(t_inv.detach()).to(device=DEVICE, dtype=torch.float32),
                            *(from_chunks(x).to(device=DEVICE, dtype=LOW) for x in (d_w, d_u)),
                            torch.zeros_like(on_device["k"]), info, chunk)
        errors[feed] = tuple(rel_rms(x[0], ref) for x, ref in zip(got, want))
    return errors


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--betas", type=float, nargs="+", default=[1.0, 1.5, 1.9, 1.95, 1.99],
                        help="lower ends of beta's range (each range is 0.05 wide, capped at 2)")
    parser.add_argument("--noises", type=float, nargs="+", default=[1e-3],
                        help="size of the keys' spread around their common direction (1e-3: the tests' keys)")
    parser.add_argument("--T", type=int, default=512, help="tokens (a multiple of the chunk size)")
    parser.add_argument("--H", type=int, default=2)
    parser.add_argument("--K", type=int, default=64)
    parser.add_argument("--V", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=64, choices=[16, 32, 64], help="chunk size C")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="the 16-bit dtype under study")
    parser.add_argument("--ablation", action="store_true", help="also the model with each point alone")
    parser.add_argument("--wy-stage", action="store_true",
                        help="also the WY backward stage alone on the problem's dW, dU and on random ones")
    args = parser.parse_args()
    global LOW
    LOW = DTYPES[args.dtype]
    assert args.T % args.chunk == 0, "T must be a multiple of the chunk size"
    rows = {**MODELS, **(ABLATIONS if args.ablation else {})}
    print(f"T={args.T} H={args.H} K={args.K} V={args.V} C={args.chunk} seeds={args.seeds} device={DEVICE}; "
          f"rel RMS vs the float64 recurrence on the {args.dtype}-rounded inputs ({args.dtype} bound "
          f"{BOUNDS[LOW]:.0e})")
    for noise in args.noises:
        for beta_low in args.betas:
            per_seed = [measure_case(args.T, args.H, args.K, args.V, args.chunk, beta_low, noise, s, rows)
                        for s in args.seeds]
            t_norm = sum(c[0] for _, c in per_seed) / len(per_seed)
            cancel = sum(c[1] for _, c in per_seed) / len(per_seed)
            print(f"\nnoise {noise:g}, beta [{beta_low:g}, {beta_low + min(0.05, 2 - beta_low):g}]: "
                  f"|T~ diag(beta)|_2 {t_norm:.1f}, |V'|/|K^T V'| {cancel:.1f}")
            print(f"| {'row':44s} | " + " | ".join(f"{n:>7s}" for n in RESULTS) + " |")
            print(f"|{'-' * 46}|" + "|".join("-" * 9 for _ in RESULTS) + "|")
            for row in per_seed[0][0]:
                mean = {n: sum(e[row][n] for e, _ in per_seed) / len(per_seed) for n in RESULTS}
                print(f"| {row:44s} | " + " | ".join(f"{mean[n]:7.1e}" for n in RESULTS) + " |")
            if args.wy_stage:
                stage = [wy_stage_errors(args.T, args.H, args.K, args.V, args.chunk, beta_low, noise, s)
                         for s in args.seeds]
                print(f"WY backward stage alone (wy_bwd, {args.dtype}), rel RMS dk / dv / dbeta:")
                for feed in stage[0]:
                    mean = [sum(e[feed][i] for e in stage) / len(stage) for i in range(3)]
                    print(f"  {feed:22s} " + " / ".join(f"{x:.1e}" for x in mean))


if __name__ == "__main__":
    main()
