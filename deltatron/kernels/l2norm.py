"""Row-wise L2 normalization y = x / sqrt(sum(x^2) + eps) and its backward dx = r (dy - y <dy, y>), r the row's
1 / sqrt(sum(x^2) + eps), for use_qk_l2norm_in_kernel (DESIGN.md §4, chain rules outside the form)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference.common import L2NORM_EPS
from .launch import launch
from .utils import cdiv, next_power_of_2

ROWS_PER_PROGRAM = 16


@triton.jit
def l2norm_fwd_kernel(x, y, rstd, n_rows, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr, EPS: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < D)
    offs = rows[:, None].to(tl.int64) * D + cols[None, :]
    b_x = tl.load(x + offs, mask=mask, other=0.0).to(tl.float32)
    b_rstd = 1.0 / tl.sqrt(tl.sum(b_x * b_x, axis=1) + EPS)
    tl.store(y + offs, (b_x * b_rstd[:, None]).to(y.dtype.element_ty), mask=mask)
    tl.store(rstd + rows, b_rstd, mask=rows < n_rows)


@triton.jit
def l2norm_bwd_kernel(y, rstd, dy, dx, n_rows, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    # y = x * r with r = (|x|^2 + eps)^-1/2  =>  dx = r * (dy - y * <dy, y>)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < D)
    offs = rows[:, None].to(tl.int64) * D + cols[None, :]
    b_y = tl.load(y + offs, mask=mask, other=0.0).to(tl.float32)
    b_dy = tl.load(dy + offs, mask=mask, other=0.0).to(tl.float32)
    b_r = tl.load(rstd + rows, mask=rows < n_rows, other=0.0)
    b_dx = b_r[:, None] * (b_dy - b_y * tl.sum(b_dy * b_y, axis=1)[:, None])
    tl.store(dx + offs, b_dx.to(dx.dtype.element_ty), mask=mask)


def l2norm_fwd(x: torch.Tensor):
    """Returns (y in x's dtype, rstd fp32 with one entry per row of the last dimension)."""
    D = x.shape[-1]
    y = torch.empty_like(x)
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    n_rows = rstd.numel()
    grid = (cdiv(n_rows, ROWS_PER_PROGRAM),)
    launch(l2norm_fwd_kernel, grid, x, y, rstd, n_rows, D, next_power_of_2(D), ROWS_PER_PROGRAM, L2NORM_EPS)
    return y, rstd


def l2norm_bwd(y: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    D = y.shape[-1]
    dy = dy.contiguous()
    dx = torch.empty_like(y, dtype=dy.dtype)
    n_rows = rstd.numel()
    grid = (cdiv(n_rows, ROWS_PER_PROGRAM),)
    launch(l2norm_bwd_kernel, grid, y, rstd, dy, dx, n_rows, D, next_power_of_2(D), ROWS_PER_PROGRAM)
    return dx
