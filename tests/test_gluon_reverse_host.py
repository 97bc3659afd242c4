"""The Gluon reverse pass's host wrapper (kernels/chunk/gluon_reverse.py) where it launches nothing, so on the
CPU: the batch without tokens (a TMA descriptor cannot be built on zero rows: dh is empty, dh0 is dht, or
zeros) and the misuse it refuses. The kernel itself is checked on the GPU (tests/gpu/test_gluon_reverse_gpu.py)."""
import pytest
import torch

from deltatron.kernels.utils import seq_info

from .helpers import make_inputs, misaligned, random_cu_seqlens

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
from deltatron.kernels.chunk import gluon_reverse  # noqa: E402

D = gluon_reverse.D_WALK


@pytest.mark.parametrize("lengths", [[0, 0, 0], []])
def test_no_tokens_passes_dht_through(poison, lengths):
    H, N = 2, len(lengths)
    x = make_inputs(1, 0, H, D, D, torch.bfloat16, initial_state=True, N=N, seed=0)
    cu = random_cu_seqlens(lengths)
    info = seq_info(1, 0, torch.device("cpu"), cu, cu)
    q, k, v, dht = x["q"], x["k"], x["v"], x["initial_state"]
    dh, dv, dh0 = gluon_reverse.gluon_state_bwd(q, k, k, v, dht, 0.1, True, info)
    assert dh.shape == (0, H, D, D) and dh.dtype == q.dtype and dv.shape == v.shape
    assert dh0.dtype == torch.float32 and torch.equal(dh0, dht)
    _, _, dh0 = gluon_reverse.gluon_state_bwd(q, k, k, v, None, 0.1, True, info)
    assert dh0.shape == (N, H, D, D) and not dh0.any()
    _, _, dh0 = gluon_reverse.gluon_state_bwd(q, k, k, v, dht, 0.1, False, info)
    assert dh0 is None


def test_refuses_misuse():
    x = make_inputs(2, 64, 2, D, D, torch.bfloat16, initial_state=True)
    info = seq_info(2, 64, torch.device("cpu"), None, None)
    q, k, v, dht = x["q"], x["k"], x["v"], x["initial_state"]
    with pytest.raises(ValueError, match="share one 16-bit dtype"):
        gluon_reverse.gluon_state_bwd(q, k, k, v.float(), None, 0.1, False, info)
    with pytest.raises(ValueError, match="share one 16-bit dtype"):
        gluon_reverse.gluon_state_bwd(q.float(), k.float(), k.float(), v.float(), None, 0.1, False, info)
    with pytest.raises(ValueError, match="K = V = 128"):
        gluon_reverse.gluon_state_bwd(q, k, k, v[..., :64], None, 0.1, False, info)
    with pytest.raises(ValueError, match="tokens"):  # rows that are not the batch's B * T
        gluon_reverse.gluon_state_bwd(q[:1], k[:1], k[:1], v[:1], None, 0.1, False, info)
    with pytest.raises(ValueError, match="contiguous"):
        gluon_reverse.gluon_state_bwd(q, k, k, v.transpose(1, 2).contiguous().transpose(1, 2), None, 0.1, False, info)
    with pytest.raises(ValueError, match="dht"):
        gluon_reverse.gluon_state_bwd(q, k, k, v, dht[:1], 0.1, False, info)
    with pytest.raises(ValueError, match="16-byte aligned"):  # TMA: the descriptor's base
        gluon_reverse.gluon_state_bwd(q, k, misaligned(k), v, None, 0.1, False, info)
    with pytest.raises(ValueError, match="chunk_size"):
        gluon_reverse.gluon_state_bwd(q, k, k, v, None, 0.1, False, info, chunk_size=32)
