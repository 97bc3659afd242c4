"""A PyTorch model of gluon_walk_kernel's arithmetic, run through the GPU test's own check() against the
shipped walk (in the interpreter, fp16: the interpreter's bf16 dot is wrong, DESIGN.md §6).

The model does what the kernel does per (sequence, head, V-block of block_v rows of S^T), chunk by chunk:
[C, 128] tiles of W, K, Q and U's [C, block_v] V-block read from the packed rows at bos + t * C (past the
sequence's end the next sequence's rows, past TT zeros as TMA fills them), S^T's V-block rounded to the input
dtype for both of its products, V'^T = U^T - S^T W^T with its columns past the end zeroed and then rounded,
S^T += V'^T K, (Q K^T masked j <= i) rounded, O's V-block columns = scale (Q S + P V') stored for the rows
before the end. It checks the kernel's indexing and rounding points, not its synchronization (that only the
GPU can), and that check() fails on the three wrong kernels nearest to it: V' not masked past the end (the
next sequence's rows reach the state), the diagonal left out of the causal mask, and every V-block reading
U's first (a missing V-block offset). The residual form (RESIDUAL: the W slot holding Tb's pair, the U slot V,
V'^T = (V^T - S^T K^T rounded) Tb^T) likewise, through the GPU test's check (residual=True)."""
import itertools
import types

import pytest
import torch

from deltatron.kernels.utils import seq_info

from . import test_walk_gpu as gpu_test
from ....helpers import INTERPRET, make_inputs, random_cu_seqlens

pytestmark = pytest.mark.skipif(not INTERPRET, reason="the shipped walk on CPU tensors needs the interpreter")

C, D = 64, 128


def kernel_model(q, k, w, u, scale, h0, output_final_state, info, block_v, bug=None, residual=False):
    TT, H, dt = info.total_tokens, k.shape[2], k.dtype
    tiles = [torch.cat([x.reshape(TT, H, D), x.new_zeros(C, H, D)]) for x in (q, k, w, u)]  # zero fill past TT
    o = torch.full((TT, H, D), float("nan"), dtype=dt)
    final = torch.full((info.num_seqs, H, D, D), float("nan")) if output_final_state else None
    cu = info.cu_seqlens_cpu.tolist()
    tok = torch.arange(C)
    for n in range(info.num_seqs):
        bos, eos = cu[n], cu[n + 1]
        for h, v0 in itertools.product(range(H), range(0, D, block_v)):
            blk = slice(v0, v0 + block_v)
            u_blk = slice(0, block_v) if bug == "no V-block offset" else blk
            st = h0[n, h].float().T[blk].clone() if h0 is not None else torch.zeros(block_v, D)
            for t in range((eos - bos + C - 1) // C):
                row = bos + t * C
                b_q, b_k, b_w, b_u = (x[row:row + C, h].float() for x in tiles)
                sd = st.to(dt).float()
                valid = C if bug == "no V' mask" else eos - row
                if residual:  # w holds Tb's pair [C, hi | lo], u holds V: V'^T = (V^T - S^T K^T) Tb^T
                    yt = (b_u[:, u_blk].T - sd @ b_k.T).to(dt).float()
                    tb_hi, tb_lo = b_w[:, :C], b_w[:, C:]
                    if bug == "Tb not transposed":
                        tb_hi, tb_lo = tb_hi.T, tb_lo.T
                    vt = yt @ tb_hi.T + yt @ tb_lo.T
                else:
                    vt = b_u[:, u_blk].T - sd @ b_w.T
                vnt = torch.where(tok[None, :] < valid, vt, 0.0).to(dt).float()
                keep = tok[:, None] > tok[None, :] if bug == "no diagonal" else tok[:, None] >= tok[None, :]
                p = torch.where(keep, b_q @ b_k.T, 0.0).to(dt).float()
                b_o = b_q @ sd.T + p @ vnt.T
                st = st + vnt @ b_k
                rows = min(C, eos - row)
                o[row:row + rows, h, blk] = (b_o * scale).to(dt)[:rows]
            if output_final_state:
                final[n, h, :, blk] = st.T
    return o.reshape(u.shape), final


def inputs(case):
    if case == "dense":  # 200 = 3 chunks + 8 rows: each partial chunk reads the next sequence's rows or zeros
        B, T, H = 2, 200, 2
        x = gpu_test.packed(make_inputs(B, T, H, D, D, torch.float16, initial_state=True, seed=3), B, T, H)
        return x, seq_info(B, T, torch.device("cpu"), None, None)
    lengths = [0, 1, 63, 64, 65, 130, 7]
    TT = sum(lengths)
    x = make_inputs(1, TT, 2, D, D, torch.float16, initial_state=True, N=len(lengths), seed=3)
    cu = random_cu_seqlens(lengths)
    return x, seq_info(1, TT, torch.device("cpu"), cu, cu.long())


@pytest.mark.parametrize("case", ["dense", "varlen"])
@pytest.mark.parametrize("residual, bug, block_v", [
    (False, None, 128), (False, None, 64), (False, "no V' mask", 128), (False, "no diagonal", 128),
    (False, "no V-block offset", 64),
    # the residual form (V' = Tb (V - K S), gluon_walk_kernel's RESIDUAL) against the same shipped walk on W, U
    (True, None, 128), (True, None, 64), (True, "Tb not transposed", 128), (True, "no V' mask", 64)])
def test_kernel_model_against_the_gpu_test(case, residual, bug, block_v):
    x, info = inputs(case)
    model = types.SimpleNamespace(gluon_state_output_fwd=lambda *a, block_v, residual=False: kernel_model(
        *a, block_v, bug=bug, residual=residual))
    if bug is None:
        gpu_test.check(model, x, info, True, block_v, residual)
        gpu_test.check(model, x, info, False, block_v, residual)
    else:
        with pytest.raises(AssertionError):
            gpu_test.check(model, x, info, True, block_v, residual)
