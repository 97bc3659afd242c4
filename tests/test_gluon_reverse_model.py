"""A PyTorch model of gluon_reverse_kernel's arithmetic, run through the GPU test's own check() against the Triton
reverse pass (in the interpreter, fp16: the interpreter's bf16 dot is wrong, DESIGN.md §6).

The model does what the kernel does per (sequence, head), chunk by chunk backwards: [C, 128] tiles read from the
packed rows at bos + t * C (past the sequence's end the next sequence's rows, past TT zeros as TMA fills them);
off the chain A^T = K Q^T kept for j <= i < n, scaled and rounded, dV'_local = A^T dO, and scale dO^T Q with dO's
rows from n on zeroed; on the chain dS^T (fp32) rounded for dh and for dV'^T = dV'_local^T + dS_next^T K^T,
whose columns from n on are zeroed before it is rounded for dv and for dS^T += scale dO^T Q - dV'^T W. It checks
the kernel's orientation, masks and rounding points, not its synchronization (that only the GPU can), and that
check() fails on the two wrong kernels nearest to it: dV' not masked past the end (the next sequence's rows
reach dS), and the tail of the chunk not masked off the chain (the next sequence's q and dO reach dV'_local and
Q^T dO)."""
import types

import pytest
import torch

from .gpu import test_gluon_reverse_gpu as gpu_test
from .helpers import INTERPRET, random_cu_seqlens

pytestmark = pytest.mark.skipif(not INTERPRET, reason="the Triton reverse pass on CPU tensors needs the interpreter")

C, D = 64, 128


def kernel_model(q, k, w, do, dht, scale, need_dh0, info, bug=None):
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
        for h in range(H):
            dst = dht[s, h].float().T.clone() if dht is not None else torch.zeros(D, D)
            for t in reversed(range((eos - bos + C - 1) // C)):
                row = bos + t * C
                n = C if bug == "no tail mask" else eos - row
                b_q, b_k, b_w, b_do = (x[row:row + C, h].float() for x in tiles)
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
                dv[row:row + rows, h] = dvd.T[:rows].to(dt)
                dh[first[s] + t, h] = dsd.T.to(dt)
            if need_dh0:
                dh0[s, h] = dst.T
    return dh, dv.reshape(do.shape), dh0


def inputs(case):
    if case == "dense":  # 200 = 3 chunks + 8 rows: each partial chunk reads the next sequence's rows or zeros
        return gpu_test.reverse_inputs(2, 200, 2, torch.float16, "cpu", seed=3)
    lengths = [0, 1, 63, 64, 65, 130, 7]
    cu = random_cu_seqlens(lengths)
    return gpu_test.reverse_inputs(1, sum(lengths), 2, torch.float16, "cpu", N=len(lengths), seed=3, cu_seqlens=cu)


@pytest.mark.parametrize("case", ["dense", "varlen"])
@pytest.mark.parametrize("bug", [None, "no dV' mask", "no tail mask"])
def test_kernel_model_against_the_gpu_test(case, bug):
    x, info = inputs(case)
    model = types.SimpleNamespace(gluon_state_bwd=lambda *a: kernel_model(*a, bug=bug))
    if bug is None:
        gpu_test.check(model, x, info, True, True)
        gpu_test.check(model, x, info, False, False)
    else:
        with pytest.raises(AssertionError):
            gpu_test.check(model, x, info, True, True)
