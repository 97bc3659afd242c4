"""Host-side helpers of deltatron/kernels/utils.py."""
import dataclasses

import pytest
import triton

from deltatron.kernels.utils import cdiv, head_block, next_power_of_2


def test_integer_helpers_match_triton():
    # plain-integer stand-ins for triton.cdiv / triton.next_power_of_2 (about 5 µs per call on the host)
    for n in range(1, 1100):
        assert next_power_of_2(n) == triton.next_power_of_2(n)
        for d in (1, 3, 16, 64, 100):
            assert cdiv(n, d) == triton.cdiv(n, d)


def test_head_block():
    assert [head_block(s) for s in (1, 16, 17, 24, 40, 64, 100, 128, 129, 256)] == [16, 16, 32, 32, 64, 64, 128,
                                                                                     128, 256, 256]


def test_tril_precision_defaults(monkeypatch):
    import torch

    from deltatron.kernels.utils import tril_precision
    monkeypatch.delenv("DELTATRON_TRIL_PRECISION", raising=False)
    # fp32-level accuracy in the inverse for every input dtype: tf32 alone is not accurate enough for nearly
    # parallel keys, tf32 with a Newton step is (tests/tools/test_accuracy_models.py::test_tril_precision_emulation)
    assert [tril_precision(d) for d in (torch.float32, torch.float16, torch.bfloat16)] == [
        ("ieee", False), ("tf32", True), ("tf32", True)]
    monkeypatch.setenv("DELTATRON_TRIL_PRECISION", "tf32x3")
    assert tril_precision(torch.bfloat16) == ("tf32x3", False)
    monkeypatch.setenv("DELTATRON_TRIL_PRECISION", "tf32")  # plain tf32 is not offered: the error lists what is
    with pytest.raises(ValueError, match="ieee, tf32x3, tf32_newton"):
        tril_precision(torch.bfloat16)


@pytest.mark.parametrize("lengths", [[5], [0], [0, 0], [64, 0, 1, 65, 0], [0, 130, 63, 64, 0, 0, 1], [1] * 7])
def test_chunk_index(lengths):
    # (sequence, chunk within it) of every chunk and each sequence's first chunk, against a plain loop; empty
    # sequences own no chunk, also at the ends
    import torch

    from deltatron.kernels.utils import seq_info
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    chunks = seq_info(1, sum(lengths), torch.device("cpu"), cu, cu).chunks(64)
    expected = [(s, c) for s, n in enumerate(lengths) for c in range(cdiv(n, 64))]
    assert chunks.num_chunks == len(expected)
    assert chunks.chunk_indices.tolist() == [list(e) for e in expected]
    per_seq = [cdiv(n, 64) for n in lengths]
    assert chunks.chunk_offsets.tolist() == [sum(per_seq[:i]) for i in range(len(lengths) + 1)]


def test_cached_launch_decisions_match_uncached():
    # the plan's per-shape launch rules are cached (functools.lru_cache): pure functions of their arguments (the SM
    # count and the interpreter reach them as arguments, not globals)
    from deltatron.kernels.chunk.plan import reverse_launch, walk_launch, wy_bwd_launch, wy_launch
    from deltatron.kernels.utils import head_tile

    for K in (16, 64, 100, 128, 256):
        assert head_block(K) == head_block.__wrapped__(K) and head_tile(K) == head_tile.__wrapped__(K)
        for V in (64, 128, 256):
            for es in (2, 4):
                assert wy_bwd_launch(K, V, es) == wy_bwd_launch.__wrapped__(K, V, es)
                for interpret in (False, True):
                    for states in (1, 16, 128, 320):
                        for fused in (False, True):
                            assert wy_launch(K, V, es, fused) == wy_launch.__wrapped__(K, V, es, fused)
                            assert walk_launch(K, V, states, es, fused, interpret) == \
                                walk_launch.__wrapped__(K, V, states, es, fused, interpret)
                        for sms in (1, 132):
                            assert reverse_launch(K, V, states, es, sms, interpret) == \
                                reverse_launch.__wrapped__(K, V, states, es, sms, interpret)
    with pytest.raises(dataclasses.FrozenInstanceError):
        wy_bwd_launch(128, 128, 2).maxnreg = 0  # shared between calls: read-only
