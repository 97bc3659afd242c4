"""portable/kkt.py and portable/solve_tril.py, launched apart (stages.py): A = strictly lower (beta K K^T) per chunk and its inverse T~ = (I + A)^-1
against float64 intra_chunk_wy on the same (dtype-rounded) inputs."""
import pytest
import torch

from deltatron.kernels.chunk.portable import wy
from deltatron.kernels.utils import seq_info
from deltatron.reference.chunk import intra_chunk_wy

from ....helpers import DEVICE, nearly_parallel_keys, random_cu_seqlens, rel_rms
from ..helpers import needs_triton, packed, per_sequence_chunks
from . import stages

pytestmark = needs_triton


@pytest.mark.parametrize("dtype, C, lengths, K", [
    (torch.float32, 16, [5, 16, 17], 24),
    (torch.float32, 64, [70, 1], 40),
    (torch.bfloat16, 32, [33, 0, 9], 32),
])
def test_kkt_and_solve_tril(poison, dtype, C, lengths, K):
    inp, info, ref = packed(lengths, 2, K, 16, dtype, seed=1, normalized_keys=False, beta_max=2.0)
    A_ref, T_ref, _, _ = per_sequence_chunks(lengths, C, intra_chunk_wy, ref["k"], ref["v"], ref["beta"])
    A = stages.chunk_kkt(inp["k"], inp["beta"], info, C)
    assert A.dtype == torch.float32
    assert rel_rms(A, A_ref) < 1e-6  # fp32 dot of the rounded inputs
    # solve_tril reads only the strict lower triangle: garbage on and above the diagonal must not matter
    upper = torch.ones(C, C, dtype=torch.bool, device=A.device).triu()
    rows = torch.cat([torch.arange(L) % C for L in lengths]).to(A.device)
    junk = torch.where(upper[rows][None, :, None, :], torch.randn_like(A), A)
    T = stages.solve_tril(junk, info, C)
    assert rel_rms(T, T_ref) < 1e-5


@pytest.mark.parametrize("C", [32, 64])
def test_solve_tril_nearly_parallel_keys(poison, C):
    # repeated tokens: keys almost equal and beta near 2 make A almost 2 * (strictly lower ones), whose
    # powers grow like binomial coefficients while the inverse stays bounded (1, -2, 2, -2, ... down each
    # diagonal): an inverse built from series or powers of A would cancel catastrophically here
    lengths, K = [C, C - 3], 32
    k, beta = nearly_parallel_keys((1, sum(lengths), 2, K), 1.95, torch.float32, DEVICE, seed=5)
    cu = random_cu_seqlens(lengths, DEVICE)
    info = seq_info(1, sum(lengths), torch.device(DEVICE), cu, cu.cpu())
    _, T_ref, _, _ = per_sequence_chunks(lengths, C, intra_chunk_wy, *(x.cpu().double() for x in (k, k, beta)))
    assert T_ref.abs().max() <= 2.5  # bounded, as the comment says
    T = stages.solve_tril(stages.chunk_kkt(k, beta, info, C), info, C)
    assert rel_rms(T, T_ref) < 1e-5
    tinv, _, _ = wy.wy_fwd(k, k, beta, info, C)
    assert rel_rms(tinv, T_ref) < 1e-5


@pytest.mark.parametrize("precision", ["tf32_newton", "tf32x3"])
def test_solve_tril_precision_switch(poison, monkeypatch, precision):
    # the switch reaches the inverse's products (the interpreter computes tf32 dots in full fp32, so the GPU
    # suite checks the precision levels themselves; here: both variants build and are right)
    monkeypatch.setenv("DELTATRON_TRIL_PRECISION", precision)
    lengths, C = [64, 40], 64
    inp, info, ref = packed(lengths, 1, 32, 16, torch.float32, seed=2)
    _, T_ref, _, _ = per_sequence_chunks(lengths, C, intra_chunk_wy, ref["k"], ref["v"], ref["beta"])
    T = stages.solve_tril(stages.chunk_kkt(inp["k"], inp["beta"], info, C), info, C)
    assert rel_rms(T, T_ref) < 1e-5


def test_tril_precision_rejects_unknown(monkeypatch):
    monkeypatch.setenv("DELTATRON_TRIL_PRECISION", "fp64")
    lengths = [16]
    inp, info, _ = packed(lengths, 1, 16, 16, torch.float32, seed=3)
    A = stages.chunk_kkt(inp["k"], inp["beta"], info, 16)
    with pytest.raises(ValueError, match="DELTATRON_TRIL_PRECISION"):
        stages.solve_tril(A, info, 16)
