"""Whether the forward's residual form (state.RESIDUAL_WALK: V' = Tb (V - K S) in the Gluon walk, Tb = T~ diag(beta)
as a 16-bit pair) is as accurate as the W, U form (V' = U - W S from the stored W, U), emulated in float64.

A float64 chunkwise walk (one head, K = V = 128, C = 64; exact T~) that rounds to the input dtype where the kernels
hold a value in 16 bits:
    W, U form   W = Tb K and U = Tb V rounded; S rounded for W S and Q S; V' = U - W S rounded; Q K^T (masked)
                rounded; O rounded (hopper/walk.py's chain and output partition on wy_fwd's W, U);
    residual    S rounded for K S and Q S; Y = V - K S rounded; V' = Tb Y rounded, Tb exact (its hi + lo pair is
                16 bits more than the dtype: 2^-18 for bf16); Q K^T and O as above;
    residual, Tb rounded   the same with Tb rounded to the dtype alone (no pair), as FlashQLA's forward holds its T~.
Each against the float64 recurrence on the same rounded inputs (deltatron.reference's recurrence, written out here),
relative RMS of o and of the final state, the larger of two heads. Inputs as the GPU tests': random (make_inputs) and
nearly parallel keys with beta from beta_low (nearly_parallel_keys), an initial state.

    python tools/residual_form_emulation.py [--T 512]
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.helpers import make_inputs, nearly_parallel_keys, rel_rms  # noqa: E402

FORMS = ("W, U form", "residual", "residual, Tb rounded")
CASES = [(torch.float16, 0.95), (torch.float16, 1.45), (torch.float16, 1.95), (torch.bfloat16, 0.95),
         (torch.bfloat16, 1.45), (torch.bfloat16, 1.95), (torch.float16, None), (torch.bfloat16, None)]
C, D, H = 64, 128, 2


def rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype).double()


def chunk_walk(q, k, v, beta, h0, dtype, form):
    """(o [T, V], final state [K, V]) of one head, float64 with form's rounding points."""
    S, o, scale = h0.clone(), torch.empty_like(v), D ** -0.5
    for t0 in range(0, k.shape[0], C):
        kc, vc, qc, bc = k[t0:t0 + C], v[t0:t0 + C], q[t0:t0 + C], beta[t0:t0 + C]
        n = kc.shape[0]
        T = torch.linalg.inv(torch.eye(n, dtype=torch.float64) + torch.tril(bc[:, None] * (kc @ kc.T), -1))
        Tb = T * bc[None, :]
        Sd = rounded(S, dtype)
        if form == "W, U form":
            vn = rounded(rounded(Tb @ vc, dtype) - rounded(Tb @ kc, dtype) @ Sd, dtype)
        else:
            Tb = rounded(Tb, dtype) if form == "residual, Tb rounded" else Tb
            vn = rounded(Tb @ rounded(vc - kc @ Sd, dtype), dtype)
        P = rounded(torch.tril(qc @ kc.T), dtype)
        o[t0:t0 + n] = rounded(scale * (qc @ Sd + P @ vn), dtype)
        S = S + kc.T @ vn
    return o, S


def recurrence(q, k, v, beta, h0):
    S, o, scale = h0.clone(), torch.empty_like(v), D ** -0.5
    for t in range(k.shape[0]):
        S = S + torch.outer(k[t], beta[t] * (v[t] - k[t] @ S))
        o[t] = scale * q[t] @ S
    return o, S


def table(T: int = 512) -> Dict[Tuple[str, float, str], Tuple[float, float]]:
    """{(dtype name, beta_low or None for random inputs, form): (o error, final state error)}."""
    out = {}
    for dtype, beta_low in CASES:
        x = make_inputs(1, T, H, D, D, torch.float64, initial_state=True, seed=11)
        if beta_low is not None:
            x["k"], x["beta"] = nearly_parallel_keys((1, T, H, D), beta_low, torch.float64, "cpu", seed=11)
        for form in FORMS:
            errors = []
            for h in range(H):
                q, k, v, beta = (rounded(x[n][0, :, h].detach(), dtype) for n in ("q", "k", "v", "beta"))
                h0 = x["initial_state"][0, h].detach().float().double()
                o, S = chunk_walk(q, k, v, beta, h0, dtype, form)
                o_ref, S_ref = recurrence(q, k, v, beta, h0)
                errors.append((rel_rms(o, o_ref), rel_rms(S, S_ref)))
            out[(str(dtype).split(".")[1], beta_low, form)] = tuple(max(e[i] for e in errors) for i in range(2))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--T", type=int, default=512)
    args = parser.parse_args()
    results = table(args.T)
    print(f"{'dtype':<9} {'keys':<24} " + " ".join(f"{f + ': o / S':<32}" for f in FORMS))
    for dtype, beta_low in CASES:
        name = str(dtype).split(".")[1]
        keys = "random" if beta_low is None else f"nearly parallel, beta {beta_low}"
        print(f"{name:<9} {keys:<24} " + " ".join(
            f"{results[(name, beta_low, f)][0]:.2e} / {results[(name, beta_low, f)][1]:.2e}".ljust(32) for f in FORMS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
