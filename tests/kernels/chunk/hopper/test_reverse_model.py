"""A PyTorch model of gluon_reverse_kernel's arithmetic, run through the GPU test's own check() against the Triton
reverse pass (in the interpreter, fp16: the interpreter's bf16 dot is wrong, DESIGN.md §6).

The model does what the kernel does per (sequence, head, V-block of block_v rows of dS^T), chunk by chunk
backwards: [C, 128] tiles of W, K, Q and dO's [C, block_v] V-block read from the packed rows at bos + t * C (past
the sequence's end the next sequence's rows, past TT zeros as TMA fills them); off the chain A^T = K Q^T kept for
j <= i < n, scaled and rounded, dV'_local = A^T dO, and scale dO^T Q with dO's rows from n on zeroed; on the chain
dS^T's V-block (fp32) rounded for dh and for dV'^T = dV'_local^T + dS_next^T K^T, whose columns from n on are
zeroed before it is rounded for dv and for dS^T += scale dO^T Q - dV'^T W. It checks the kernel's orientation,
V-block indexing, masks and rounding points, not its synchronization (that only the GPU can), and that check()
fails on the three wrong kernels nearest to it: dV' not masked past the end (the next sequence's rows reach dS),
the tail of the chunk not masked off the chain (the next sequence's q and dO reach dV'_local and Q^T dO), and
every V-block reading dO's first (a missing V-block offset in the loader)."""
import itertools
import types

import pytest
import torch

from . import test_reverse_gpu as gpu_test
from ....helpers import INTERPRET, random_cu_seqlens

pytestmark = pytest.mark.skipif(not INTERPRET, reason="the Triton reverse pass on CPU tensors needs the interpreter")

C, D = 64, 128


def kernel_model(q, k, w, do, dht, scale, need_dh0, info, block_v, bug=None):
    TT, H, dt = info.total_tokens, k.shape[2], k.dtype
    tiles = [torch.cat([x.reshape(TT, H, D), x.new_zeros(C, H, D)]) for x in (q, k, w, do)]  # zero fill past TT
    chunks = info.chunks(C)
    dh = torch.full((chunks.num_chunks, H, D, D), float("nan"), dtype=dt)
    dv = torch.full((TT, H, D), float("nan"), dtype=dt)
    dh0 = torch.full((info.num_seqs, H, D, D), float("nan")) if need_dh0 else None
    cu, first = info.cu_seqlens_cpu.tolist(), chunks.chunk_offsets.tolist()
    tok = torch.arange(C)
    for s in range(info.num_seqs):
        bos, eos = cu[s], cu[s + 1]
        for h, v0 in itertools.product(range(H), range(0, D, block_v)):
            blk = slice(v0, v0 + block_v)
            do_blk = slice(0, block_v) if bug == "no V-block offset" else blk
            dst = dht[s, h].float().T[blk].clone() if dht is not None else torch.zeros(block_v, D)
            for t in reversed(range((eos - bos + C - 1) // C)):
                row = bos + t * C
                n = C if bug == "no tail mask" else eos - row
                b_q, b_k, b_w, b_do = (x[row:row + C, h].float() for x in tiles)
                b_do = b_do[:, do_blk]
                # off the chain
                keep = (tok[:, None] <= tok[None, :]) & (tok[None, :] < n)
                at = torch.where(keep, b_k @ b_q.T * scale, 0.0).to(dt).float()
                dvl = at @ b_do
                qdo_t = (torch.where(tok[:, None] < n, b_do, 0.0).T @ b_q) * scale
                # the chain
                dsd = dst.to(dt).float()
                dvt = dvl.T + dsd @ b_k.T
                dst = dst + qdo_t
                valid = C if bug == "no dV' mask" else eos - row
                dvd = torch.where(tok[None, :] < valid, dvt, 0.0).to(dt).float()
                dst = dst - dvd @ b_w
                rows = min(C, eos - row)
                dv[row:row + rows, h, blk] = dvd.T[:rows].to(dt)
                dh[first[s] + t, h, :, blk] = dsd.T.to(dt)
            if need_dh0:
                dh0[s, h, :, blk] = dst.T
    return dh, dv.reshape(do.shape), dh0


def inputs(case):
    if case == "dense":  # 200 = 3 chunks + 8 rows: each partial chunk reads the next sequence's rows or zeros
        return gpu_test.reverse_inputs(2, 200, 2, torch.float16, "cpu", seed=3)
    lengths = [0, 1, 63, 64, 65, 130, 7]
    cu = random_cu_seqlens(lengths)
    return gpu_test.reverse_inputs(1, sum(lengths), 2, torch.float16, "cpu", N=len(lengths), seed=3, cu_seqlens=cu)


@pytest.mark.parametrize("case", ["dense", "varlen"])
@pytest.mark.parametrize("bug, block_v", [(None, 128), (None, 64), ("no dV' mask", 128), ("no tail mask", 128),
                                          ("no V-block offset", 64)])
def test_kernel_model_against_the_gpu_test(case, bug, block_v):
    x, info = inputs(case)
    model = types.SimpleNamespace(gluon_state_bwd=lambda *a, block_v: kernel_model(*a, block_v, bug=bug))
    if bug is None:
        gpu_test.check(model, x, info, True, True, block_v)
        gpu_test.check(model, x, info, False, False, block_v)
    else:
        with pytest.raises(AssertionError):
            gpu_test.check(model, x, info, True, True, block_v)
