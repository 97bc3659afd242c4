"""How accurate the chunk inverse T = (I + A)^{-1} is at each precision of its products, emulated on the CPU
(no GPU needed: tf32 is emulated by rounding each product's fp32 operands to 10 mantissa bits, as the tensor
cores do; tf32x3 as the sum of the three tf32 products that triton issues).

It follows solve_tril's algorithm: doubling levels T <- T - T E T (block sizes 1 -> 2 -> ... -> 64) at the
precision under test; with tf32_newton the products are tf32 and one Newton step T <- T + T (I - (I + A) T)
follows, its residual product in tf32x3 and its correction product in tf32; "tf32" is the same without the
Newton step (not offered by the library: it is here to show why). For three kinds of keys (bf16, C = 64,
K = 128):
  normalized       L2-normalized random keys, beta = sigmoid(randn): the benchmark's inputs;
  unnormalized     keys randn / sqrt(K), beta up to 2;
  nearly parallel  one direction plus 1e-3 noise, beta near 2: repeated tokens. A is then close to twice
                   the strictly lower matrix of ones; the merges cancel heavily;
it prints the relative error of T and of one chunk's output o = (P ⊙ M) r(T) V. P is random scores, and r
rounds T to the input dtype, as the WY kernel does before its products. Both are measured against T in float64.

    python tools/tril_precision_emulation.py [--chunks 256] [--smoke]
"""
from __future__ import annotations

import argparse

import torch

C, K, BLOCK = 64, 128, 16
KINDS = ("normalized", "unnormalized", "nearly parallel")
PRECISIONS = ("tf32", "tf32_newton", "tf32x3", "ieee")


def to_tf32(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> tf32 (10 mantissa bits), round to nearest."""
    bits = x.float().contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


def product(a: torch.Tensor, b: torch.Tensor, precision: str) -> torch.Tensor:
    if precision == "tf32":
        return to_tf32(a) @ to_tf32(b)
    if precision == "tf32x3":
        a_hi, b_hi = to_tf32(a), to_tf32(b)
        return a_hi @ b_hi + a_hi @ to_tf32(b - b_hi) + to_tf32(a - a_hi) @ b_hi
    return a.float() @ b.float()


def inverse(A: torch.Tensor, precision: str) -> torch.Tensor:
    """solve_tril's algorithm on fp32 [n, C, C] tiles at `precision` (one of PRECISIONS)."""
    products = "tf32" if precision == "tf32_newton" else precision
    r = torch.arange(C)
    eye = torch.eye(C)
    T = eye.expand_as(A).clone()
    S = 1
    while S < C:
        E = torch.where((r[:, None] // (2 * S) == r[None, :] // (2 * S)) & (r[:, None] // S > r[None, :] // S),
                        A, 0.0)
        T = T - product(T, product(E, T, products), products)
        S *= 2
    if precision == "tf32_newton":
        T = T + product(T, eye - T - product(A, T, "tf32x3"), "tf32")
    return T


def keys(kind: str, n: int, g: torch.Generator):
    f64 = dict(dtype=torch.float64, generator=g)
    if kind == "normalized":
        k = torch.nn.functional.normalize(torch.randn(n, C, K, **f64), dim=-1)
        beta = torch.sigmoid(torch.randn(n, C, **f64))
    elif kind == "unnormalized":
        k = torch.randn(n, C, K, **f64) / K ** 0.5
        beta = 2 * torch.rand(n, C, **f64)
    else:
        base = torch.nn.functional.normalize(torch.randn(K, **f64), dim=0)
        k = torch.nn.functional.normalize(base + 1e-3 * torch.randn(n, C, K, **f64), dim=-1)
        beta = 1.95 + 0.05 * torch.rand(n, C, **f64)
    return k.to(torch.bfloat16).double(), beta


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref).norm() / ref.norm())


def table(n: int, seed: int = 0):
    """{(kind, input dtype, precision): (T error, output error)}."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    mask = torch.tril(torch.ones(C, C, dtype=torch.float64))
    for kind in KINDS:
        k, beta = keys(kind, n, g)
        A = torch.tril(beta[..., None] * (k @ k.transpose(-1, -2)), -1)
        T_exact = torch.linalg.inv(torch.eye(C, dtype=torch.float64) + A)
        P = torch.randn(n, C, C, dtype=torch.float64, generator=g) * mask / K ** 0.5
        V = torch.randn(n, C, K, dtype=torch.float64, generator=g)
        o_exact = P @ (T_exact @ V)
        for precision in PRECISIONS:
            T = inverse(A.float(), precision)
            for dtype in (torch.bfloat16, torch.float16):
                o = P @ (T.to(dtype).double() @ V)
                out[(kind, str(dtype).split(".")[-1], precision)] = (rel(T, T_exact), rel(o, o_exact))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=256)
    parser.add_argument("--smoke", action="store_true", help="16 chunks")
    args = parser.parse_args()
    results = table(16 if args.smoke else args.chunks)
    print(f"{'keys':<17}{'inputs':<10}{'precision':<12}{'T error':>10}{'o error':>10}")
    for (kind, dtype, precision), (t_err, o_err) in results.items():
        print(f"{kind:<17}{dtype:<10}{precision:<12}{t_err:>10.2e}{o_err:>10.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
