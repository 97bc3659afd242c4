"""The Gluon walk's host wrapper (kernels/chunk/gluon_walk.py) where it launches nothing, so on the CPU: the
batch without tokens (a TMA descriptor cannot be built on zero rows: the final state is the initial state,
or zeros) and the misuse it refuses. The kernel itself is checked on the GPU (tests/gpu/test_gluon_walk_gpu.py)."""
import pytest
import torch

from deltatron.kernels.utils import seq_info

from .helpers import make_inputs, random_cu_seqlens

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
from deltatron.kernels.chunk import gluon_walk  # noqa: E402

D = gluon_walk.D_WALK


@pytest.mark.parametrize("lengths", [[0, 0, 0], []])
def test_no_tokens_passes_the_state_through(poison, lengths):
    H, N = 2, len(lengths)
    x = make_inputs(1, 0, H, D, D, torch.bfloat16, initial_state=True, N=N, seed=0)
    cu = random_cu_seqlens(lengths)
    info = seq_info(1, 0, torch.device("cpu"), cu, cu)
    o, s = gluon_walk.gluon_state_output_fwd(x["q"], x["k"], x["k"], x["v"], 0.1, x["initial_state"], True, info)
    assert o.shape == x["v"].shape and torch.equal(s, x["initial_state"])
    _, s = gluon_walk.gluon_state_output_fwd(x["q"], x["k"], x["k"], x["v"], 0.1, None, True, info)
    assert s.shape == (N, H, D, D) and not s.any()
    _, s = gluon_walk.gluon_state_output_fwd(x["q"], x["k"], x["k"], x["v"], 0.1, None, False, info)
    assert s is None


def test_refuses_misuse():
    x = make_inputs(2, 64, 2, D, D, torch.bfloat16, initial_state=True)
    info = seq_info(2, 64, torch.device("cpu"), None, None)
    q, k, v, h0 = x["q"], x["k"], x["v"], x["initial_state"]
    with pytest.raises(ValueError, match="share one 16-bit dtype"):
        gluon_walk.gluon_state_output_fwd(q, k, k.float(), v, 0.1, None, False, info)
    with pytest.raises(ValueError, match="K = V = 128"):
        gluon_walk.gluon_state_output_fwd(q, k, k, v[..., :64], 0.1, None, False, info)
    with pytest.raises(ValueError, match="tokens"):  # rows that are not the batch's B * T
        gluon_walk.gluon_state_output_fwd(q[:1], k[:1], k[:1], v[:1], 0.1, None, False, info)
    with pytest.raises(ValueError, match="initial_state"):
        gluon_walk.gluon_state_output_fwd(q, k, k, v, 0.1, h0[:1], False, info)
    with pytest.raises(ValueError, match="chunk_size"):
        gluon_walk.gluon_state_output_fwd(q, k, k, v, 0.1, None, False, info, chunk_size=32)
