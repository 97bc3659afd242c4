"""deltatron/varlen.py: prepare_varlen's metadata (CUDA-graph-safe varlen calls) on both backends (Triton in its
interpreter without a GPU): a call on the metadata equals the same call on the packed sequences alone, rows past the
last sequence come out zero, padding sequences keep their initial states, update() refills the same buffers with new
lengths, and what cannot work is refused with a clear error. Capture and replay: tests/test_varlen_gpu.py."""
import pytest
import torch

import deltatron
from deltatron.varlen import SeqInfo, chunk_table, host_chunk_index

from .test_state_pool import _device, _inputs, backend  # noqa: F401 (backend: the fixture, both backends)


CALLS = {
    "chunk": lambda q, k, v, beta, g, **kw: deltatron.chunk_delta_rule(q, k, v, beta, chunk_size=16, **kw),
    "chunk_gated": lambda q, k, v, beta, g, **kw: deltatron.chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16,
                                                                                  **kw),
    "fused_recurrent_gated": lambda q, k, v, beta, g, **kw: deltatron.fused_recurrent_gated_delta_rule(
        q, k, v, g, beta, **kw),
}


def _pad_rows(x, rows):
    return torch.cat([x, torch.randn(1, rows, *x.shape[2:], generator=torch.Generator().manual_seed(5)).to(x)], 1)


def _check_against_packed(call, backend, meta, lengths, max_sequences, spare_rows, seed):
    """The call on meta (lengths padded to max_sequences sequences, spare_rows rows past them) against the call on the
    packed sequences alone."""
    Hk, Hv, K, V = 1, 2, 16, 16
    device = _device(backend)
    (q, k, v, beta, g), cu = _inputs(lengths, Hk, Hv, K, V, device, seed=seed)
    h0 = torch.randn(max_sequences, Hv, K, V, generator=torch.Generator().manual_seed(seed + 1)).to(device)
    want_o, want_ht = CALLS[call](q, k, v, beta, g, initial_state=h0[:len(lengths)], output_final_state=True,
                                  cu_seqlens=cu)
    q, k, v, beta, g = (_pad_rows(x, spare_rows) for x in (q, k, v, beta, g))
    with torch.no_grad():
        o, ht = CALLS[call](q, k, v, beta, g, initial_state=h0, output_final_state=True, cu_seqlens=meta)
    T = sum(lengths)
    assert o.shape == v.shape and ht.shape == h0.shape
    torch.testing.assert_close(o[:, :T], want_o, rtol=1e-5, atol=1e-5)
    assert torch.equal(o[:, T:], torch.zeros_like(o[:, T:]))  # rows past the last sequence
    torch.testing.assert_close(ht[:len(lengths)], want_ht, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ht[len(lengths):], h0[len(lengths):])  # padding sequences are empty


@pytest.mark.parametrize("call", list(CALLS))
def test_call_on_metadata_matches_packed_sequences(backend, call):
    lengths = [5, 0, 19]
    meta = deltatron.prepare_varlen([0, 5, 5, 24], max_sequences=5, max_tokens=30, chunk_sizes=(16,),
                                    device=_device(backend))
    _check_against_packed(call, backend, meta, lengths, 5, 6, seed=3)


def test_update_refills_the_same_buffers(backend):
    device = _device(backend)
    meta = deltatron.prepare_varlen([0, 3, 7], max_sequences=3, max_tokens=24, chunk_sizes=(16,), device=device)
    addresses = [meta.cu_seqlens.data_ptr(), meta.chunks(16).chunk_indices.data_ptr(),
                 meta.chunks(16).chunk_offsets.data_ptr()]
    assert meta.chunks(16).num_chunks == 24 // 16 + 3  # room for any cut of 24 tokens into 3 sequences
    for lengths in ([17, 0, 7], [24], [1, 1, 1]):
        cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
        assert meta.update(cu) is meta
        assert [meta.cu_seqlens.data_ptr(), meta.chunks(16).chunk_indices.data_ptr(),
                meta.chunks(16).chunk_offsets.data_ptr()] == addresses
        padded = cu + [cu[-1]] * (3 + 1 - len(cu))
        assert meta.cu_seqlens.tolist() == padded and meta.cu_seqlens_cpu.tolist() == padded
        # the index of these lengths, then spare chunks of the empty sequence past the last (no rows)
        seq, local, offsets = chunk_table(torch.tensor(padded), 16)
        index = meta.chunks(16).chunk_indices.tolist()
        assert index[:len(seq)] == torch.stack([seq, local], 1).tolist()
        assert index[len(seq):] == [[3, 0]] * (meta.chunks(16).num_chunks - len(seq))
        assert meta.chunks(16).chunk_offsets.tolist() == offsets.tolist()
        _check_against_packed("chunk_gated", backend, meta, lengths, 3, 24 - sum(lengths), seed=len(lengths))


def test_host_chunk_index_is_cached_by_the_lengths():
    # one host table per (lengths, chunk size), whichever tensor carries the lengths; bounded
    def index(cu, chunk_size=16):
        return SeqInfo(cu.to(torch.int32), cu, len(cu) - 1, int(cu[-1])).chunks(chunk_size)

    host_chunk_index.cache_clear()
    a, b = torch.tensor([0, 5, 5, 40]), torch.tensor([0, 5, 5, 40])
    first = host_chunk_index(a.numpy().tobytes(), 16)
    assert host_chunk_index(b.numpy().tobytes(), 16) is first
    assert index(a).chunk_indices.tolist() == [[0, 0], [2, 0], [2, 1], [2, 2]]
    assert index(torch.tensor([0, 5, 6, 40])).chunk_indices.tolist() == [[0, 0], [1, 0], [2, 0], [2, 1], [2, 2]]
    assert index(a, 32).chunk_indices.tolist() == [[0, 0], [2, 0], [2, 1]]
    assert host_chunk_index(a.numpy().tobytes(), 32) is not first
    for n in range(host_chunk_index.cache_info().maxsize + 10):
        index(torch.tensor([0, n + 1]))
    assert host_chunk_index.cache_info().currsize == host_chunk_index.cache_info().maxsize


def test_plain_seq_info_is_not_prepared():
    assert not SeqInfo(torch.zeros(2), torch.zeros(2), 1, 0).prepared
    assert deltatron.prepare_varlen([0, 4], device="cpu").prepared


@pytest.mark.parametrize("change, error, match", [
    (dict(cu=[0, 5, 3]), ValueError, "non-decreasing"),
    (dict(cu=[1, 5]), ValueError, "start at 0"),
    (dict(cu=torch.tensor([0.0, 4.0])), TypeError, "integers on the host"),
    (dict(max_sequences=0), ValueError, "max_sequences must be a positive int"),
    (dict(max_tokens=3), ValueError, "exceed the capacity"),
    (dict(max_sequences=1), ValueError, "exceed the capacity"),
])
def test_prepare_errors(change, error, match):
    args = dict(cu=[0, 2, 5], max_sequences=4, max_tokens=8)
    args.update(change)
    with pytest.raises(error, match=match):
        deltatron.prepare_varlen(args.pop("cu"), device="cpu", **args)


@pytest.mark.parametrize("case, error, match", [
    ("rows", ValueError, r"\[1, max_tokens, H, K\] = \[1, 12, H, K\]"),
    ("cu_seqlens_cpu", ValueError, "cu_seqlens_cpu must be None"),
    ("grad", ValueError, "for inference"),
    ("fused_chunk", ValueError, "chunk and fused_recurrent forms"),
    ("chunk_states", ValueError, "output_chunk_states does not combine"),
])
def test_call_errors(backend, case, error, match):
    meta = deltatron.prepare_varlen([0, 4, 9], max_sequences=3, max_tokens=12, device=_device(backend))
    (q, k, v, beta, g), _ = _inputs([4, 5, 3], 1, 1, 16, 16, _device(backend), seed=0)
    kwargs = dict(cu_seqlens=meta)
    fn = deltatron.chunk_delta_rule
    if case == "rows":
        q, k, v, beta = (x[:, :9] for x in (q, k, v, beta))
    elif case == "cu_seqlens_cpu":
        kwargs["cu_seqlens_cpu"] = torch.tensor([0, 4, 9])
    elif case == "grad":
        q.requires_grad_()
    elif case == "fused_chunk":
        fn = deltatron.fused_chunk_delta_rule
    else:
        kwargs["output_chunk_states"] = True
    with pytest.raises(error, match=match):
        fn(q, k, v, beta, **kwargs)


def test_no_host_copies_while_capturing(monkeypatch):
    meta = deltatron.prepare_varlen([0, 4, 9], max_sequences=3, max_tokens=12, device="cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="not while a CUDA graph is being captured"):
        meta.update([0, 12])
    with pytest.raises(RuntimeError, match=r"pass chunk_sizes=\(32,\)"):
        meta.chunks(32)
    assert meta.chunks(64).num_chunks == 12 // 64 + 3  # prepared before capture
