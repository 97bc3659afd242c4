"""deltatron/kernels/state_pool.py: a pool's slots read into dense states (zeros for -1) and dense states written
into slots (-1: nothing), bit for bit against torch's index ops, at state sizes that are and are not a multiple of
the kernel's block, with the slots as int32 and int64."""
import pytest
import torch

from deltatron.kernels.state_pool import read_slots, write_slots

from ..helpers import DEVICE


# a state within one block, two whole blocks, and a partial last block (the kernel's BLOCK is 4096 elements)
@pytest.mark.parametrize("state", [(2, 16, 24), (1, 64, 128), (3, 40, 40)], ids=str)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
def test_read_and_write_slots(state, index_dtype):
    gen = torch.Generator().manual_seed(0)
    pool = torch.randn(7, *state, generator=gen).to(DEVICE)
    slots = torch.tensor([5, -1, 0, 3, -1], dtype=index_dtype, device=DEVICE)
    live = slots >= 0
    got = read_slots(pool, slots)
    assert torch.equal(got, pool[slots.clamp(min=0)] * live.view(-1, 1, 1, 1))
    states = torch.randn(5, *state, generator=gen).to(DEVICE)
    want = pool.clone()
    want[slots[live]] = states[live]
    write_slots(pool, states, slots)
    assert torch.equal(pool, want)  # slots 1, 2, 4 and 6 kept: no live entry names them


def test_no_entries():
    pool = torch.randn(2, 1, 4, 4, device=DEVICE)
    slots = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    assert read_slots(pool, slots).shape == (0, 1, 4, 4)
    before = pool.clone()
    write_slots(pool, pool.new_empty(0, 1, 4, 4), slots)
    assert torch.equal(pool, before)
