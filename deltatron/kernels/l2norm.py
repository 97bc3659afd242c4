"""Row-wise L2 normalization y = x / sqrt(sum(x^2) + eps) and its backward dx = r (dy - y <dy, y>), r the row's
1 / sqrt(sum(x^2) + eps), for use_qk_l2norm_in_kernel (DESIGN.md §4, chain rules outside the form)."""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..reference.common import L2NORM_EPS
from .launch import launch
from .utils import cdiv, next_power_of_2

ROWS_PER_PROGRAM = 16


@triton.jit
def l2norm_fwd_rows(x, y, rstd, n_rows, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr, EPS: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < D)
    offs = rows[:, None].to(tl.int64) * D + cols[None, :]
    b_x = tl.load(x + offs, mask=mask, other=0.0).to(tl.float32)
    b_rstd = 1.0 / tl.sqrt(tl.sum(b_x * b_x, axis=1) + EPS)
    tl.store(y + offs, (b_x * b_rstd[:, None]).to(y.dtype.element_ty), mask=mask)
    tl.store(rstd + rows, b_rstd, mask=rows < n_rows)


@triton.jit
def l2norm_fwd_kernel(x, y, rstd, x2, y2, rstd2, n_rows, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr,
                      EPS: tl.constexpr):
    # grid axis 1: the tensor (x, or x2 where two are normalized by one launch)
    if tl.program_id(1) == 0:
        l2norm_fwd_rows(x, y, rstd, n_rows, D, BD, BR, EPS)
    else:
        l2norm_fwd_rows(x2, y2, rstd2, n_rows, D, BD, BR, EPS)


@triton.jit
def l2norm_bwd_rows(y, rstd, dy, dx, n_rows, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
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


@triton.jit
def l2norm_bwd_kernel(y, rstd, dy, dx, y2, rstd2, dy2, dx2, n_rows, D: tl.constexpr, BD: tl.constexpr,
                      BR: tl.constexpr):
    if tl.program_id(1) == 0:
        l2norm_bwd_rows(y, rstd, dy, dx, n_rows, D, BD, BR)
    else:
        l2norm_bwd_rows(y2, rstd2, dy2, dx2, n_rows, D, BD, BR)


def l2norm_fwd(x: torch.Tensor, x2: Optional[torch.Tensor] = None):
    """(y in x's dtype, rstd fp32 with one entry per row of the last dimension) of contiguous x; with x2 (contiguous,
    x's shape and dtype: k beside q), (y, rstd, y2, rstd2) from one launch."""
    D = x.shape[-1]
    y, rstd = torch.empty_like(x), torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    y2, rstd2 = (y, rstd) if x2 is None else (torch.empty_like(x2), torch.empty_like(rstd))
    n_rows = rstd.numel()
    launch(l2norm_fwd_kernel, (cdiv(n_rows, ROWS_PER_PROGRAM), 1 if x2 is None else 2), x, y, rstd,
           x if x2 is None else x2, y2, rstd2, n_rows, D, next_power_of_2(D), ROWS_PER_PROGRAM, L2NORM_EPS)
    return (y, rstd) if x2 is None else (y, rstd, y2, rstd2)


def l2norm_bwd(y: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor, y2: Optional[torch.Tensor] = None,
               rstd2: Optional[torch.Tensor] = None, dy2: Optional[torch.Tensor] = None):
    """dx of l2norm_fwd's y, rstd (in dy's dtype); with y2, rstd2, dy2 (of y's shape; dy2 of dy's dtype: one launch,
    else two) (dx, dx2)."""
    if y2 is not None and dy2.dtype != dy.dtype:
        return l2norm_bwd(y, rstd, dy), l2norm_bwd(y2, rstd2, dy2)
    D = y.shape[-1]
    dy = dy.contiguous()
    dx = torch.empty_like(y, dtype=dy.dtype)
    if y2 is None:
        y2, rstd2, dy2, dx2 = y, rstd, dy, dx
    else:
        dy2 = dy2.contiguous()
        dx2 = torch.empty_like(y2, dtype=dy2.dtype)
    n_rows = rstd.numel()
    launch(l2norm_bwd_kernel, (cdiv(n_rows, ROWS_PER_PROGRAM), 1 if dx2 is dx else 2), y, rstd, dy, dx, y2, rstd2,
           dy2, dx2, n_rows, D, next_power_of_2(D), ROWS_PER_PROGRAM)
    return dx if dx2 is dx else (dx, dx2)
