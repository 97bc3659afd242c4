"""States of a pool by slot (ssm_state_indices) for the form that runs on dense states [N, ...] (the chunk prefill;
fused_recurrent reads and writes slots in its own kernel): the slots read into dense states before the call and the
final states written back after it, with the slot values read on the device only, so that the call can be captured
in a CUDA graph (DESIGN.md §9). A slot of -1 marks a padding entry: it reads as zeros and is never written."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch
from .utils import cdiv

BLOCK = 4096  # state elements per program: a [K, V] = [128, 128] state is four programs a head


@triton.jit
def slot_copy_kernel(pool, states, slots, ROW: tl.constexpr, BLOCK: tl.constexpr, TO_POOL: tl.constexpr):
    # one program per (entry, block of its ROW state elements); TO_POOL: states -> pool, else pool -> states
    i_n, i_b = tl.program_id(0), tl.program_id(1)
    slot = tl.load(slots + i_n).to(tl.int64)
    cols = i_b * BLOCK + tl.arange(0, BLOCK)
    mask = cols < ROW
    dense = states + i_n.to(tl.int64) * ROW + cols
    if TO_POOL:
        if slot >= 0:
            tl.store(pool + slot * ROW + cols, tl.load(dense, mask=mask), mask=mask)
    else:
        live = cols < tl.where(slot >= 0, ROW, 0)  # a padding entry reads nothing: its row is zeros
        tl.store(dense, tl.load(pool + slot * ROW + cols, mask=live, other=0.0), mask=mask)


def _launch(pool: torch.Tensor, states: torch.Tensor, slots: torch.Tensor, to_pool: bool) -> None:
    row = pool[0].numel()
    if slots.shape[0] and row:
        launch(slot_copy_kernel, (slots.shape[0], cdiv(row, BLOCK)), pool, states, slots, row, BLOCK, to_pool)


def read_slots(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The states pool[slots] [N, ...] (zeros where the slot is -1); pool contiguous, slots [N] int32 or int64."""
    states = pool.new_empty(slots.shape[0], *pool.shape[1:])
    _launch(pool, states, slots, False)
    return states


def write_slots(pool: torch.Tensor, states: torch.Tensor, slots: torch.Tensor) -> None:
    """pool[slots[n]] = states[n] for every n whose slot is not -1 (states [N, ...] as pool's rows, contiguous)."""
    _launch(pool, states.contiguous(), slots, True)
