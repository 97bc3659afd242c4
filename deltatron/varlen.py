"""Packed-sequence bookkeeping (DESIGN.md §5): the SeqInfo every kernel call takes, the chunk index of its packed
sequences, and VarlenMetadata, the same built once for a capacity so that a call can be captured in a CUDA graph.

Every Triton kernel of deltatron sees the batch as packed sequences: a fixed-length [B, T, H, ...] tensor is, in
memory, the same as [1, B*T, H, ...] with cu_seqlens = [0, T, 2T, ..., B*T]. A call's SeqInfo is built on the host
from cu_seqlens_cpu, and its chunk index is copied to the device once per chunk size: a host-to-device copy, which a
CUDA graph cannot capture. VarlenMetadata keeps those tensors in buffers sized for at most max_sequences sequences of
max_tokens tokens in all, refilled in place by update() between replays, so that a captured call reads the new
lengths from the same addresses. This module needs only torch (the PyTorch backend takes it too)."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence, Tuple

import torch


def capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream (no host reads or copies may happen then)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@dataclass
class ChunkIndex:
    """Chunks of the packed batch. chunk_indices: int32 [NT, 2] = (sequence, chunk within sequence) of
    every chunk, in order; chunk_offsets: int32 [N+1], first global chunk of each sequence (per-chunk
    tensors such as states are indexed by it); num_chunks = NT."""

    chunk_indices: torch.Tensor
    chunk_offsets: torch.Tensor
    num_chunks: int


@dataclass
class SeqInfo:
    """The packed-sequence view of a batch, built once per call on the host without a device sync.

    cu_seqlens: int32 [N+1] on the device; cu_seqlens_cpu: int64 [N+1] on the CPU; total_tokens = B*T.
    prepared: a VarlenMetadata (capacity-sized, CUDA-graph safe: the chunk plan then makes no choice from the
    lengths)."""

    cu_seqlens: torch.Tensor
    cu_seqlens_cpu: torch.Tensor
    num_seqs: int
    total_tokens: int
    _chunks: Dict[int, ChunkIndex] = field(default_factory=dict, repr=False)

    prepared = False

    def chunks(self, chunk_size: int) -> ChunkIndex:
        if chunk_size not in self._chunks:
            self._chunks[chunk_size] = self._chunk_index(chunk_size)
        return self._chunks[chunk_size]

    def _chunk_index(self, chunk_size: int) -> ChunkIndex:
        lengths = self.cu_seqlens_cpu.to(torch.int64).numpy().tobytes()  # the cache's key: the offsets' value
        indices, offsets, num_chunks = host_chunk_index(lengths, chunk_size)
        device = self.cu_seqlens.device
        return ChunkIndex(indices.to(device, non_blocking=True), offsets.to(device, non_blocking=True), num_chunks)


@functools.lru_cache(maxsize=64)
def host_chunk_index(cu_seqlens_cpu: bytes, chunk_size: int) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """(chunk_indices int32 [NT, 2], chunk_offsets int32 [N+1], NT) on the host for the packed offsets given as the
    bytes of an int64 CPU tensor: cached by their value, as a training loop repeats a few length patterns and
    building the table costs the host about 50 µs a call. The tensors are shared by every call with these lengths:
    read-only (the device copies made from them per call are the kernels')."""
    seq, local, offsets = chunk_table(torch.frombuffer(bytearray(cu_seqlens_cpu), dtype=torch.int64), chunk_size)
    return torch.stack([seq, local], dim=1).to(torch.int32), offsets.to(torch.int32), len(seq)


def chunk_table(cu_seqlens_cpu: torch.Tensor, chunk_size: int):
    """(sequence of each chunk, its index within the sequence, first chunk of each sequence [N+1]), int64 on the
    host, for the packed sequences cu_seqlens_cpu cut into chunks of chunk_size tokens."""
    lens = cu_seqlens_cpu[1:] - cu_seqlens_cpu[:-1]
    per_seq = (lens + chunk_size - 1) // chunk_size
    offsets = torch.cat([per_seq.new_zeros(1), per_seq.cumsum(0)])
    total = int(offsets[-1])
    # sequence of each chunk: how many sequences begin at or before it (an empty sequence begins where the
    # next one does). Not torch.repeat_interleave: on the CPU it hands every sequence to the thread pool
    # (parallel_for with grain 1), which costs milliseconds a call on a busy host
    begins = torch.zeros(total + 1, dtype=torch.int64)
    begins.index_add_(0, offsets[1:-1], torch.ones_like(offsets[1:-1]))
    seq = begins[:total].cumsum(0)
    return seq, torch.arange(total) - offsets[:-1][seq], offsets


class VarlenMetadata(SeqInfo):
    """Varlen metadata prepared once for a CUDA graph (deltatron.prepare_varlen), passed as cu_seqlens.

    It stands for max_sequences sequences packed in max_tokens rows: the lengths given are padded with empty
    sequences, and rows past the last sequence's end belong to none (their outputs are zeros). Its device tensors
    (cu_seqlens and the chunk index of each chunk size a call used) keep their addresses: update() writes new lengths
    into them, so a graph captured on this object replays on the new lengths. The chunk index has room for every
    way of cutting max_tokens tokens into max_sequences sequences; the spare entries name an empty sequence past the
    last one, whose chunks have no rows. Inference only."""

    prepared = True

    def __init__(self, cu_seqlens_cpu: Sequence[int], max_sequences: Optional[int] = None,
                 max_tokens: Optional[int] = None, chunk_sizes: Sequence[int] = (64,),
                 device: Optional[torch.device] = None):
        lengths = _host_offsets(cu_seqlens_cpu)
        max_sequences = len(lengths) - 1 if max_sequences is None else max_sequences
        max_tokens = int(lengths[-1]) if max_tokens is None else max_tokens
        for name, x in (("max_sequences", max_sequences), ("max_tokens", max_tokens)):
            if isinstance(x, bool) or not isinstance(x, int) or x < 1:
                raise ValueError(f"prepare_varlen: {name} must be a positive int, got {x!r}")
        device = torch.device("cuda" if device is None and torch.cuda.is_available() else device or "cpu")
        # one entry past the padded cu_seqlens: the empty sequence the index's spare chunks name
        self._cu_buffer = torch.zeros(max_sequences + 2, dtype=torch.int32, device=device)
        super().__init__(self._cu_buffer[:-1], torch.zeros(max_sequences + 1, dtype=torch.int64), max_sequences,
                         max_tokens)
        self.update(cu_seqlens_cpu)
        for chunk_size in chunk_sizes:
            self.chunks(chunk_size)

    def capacity_chunks(self, chunk_size: int) -> int:
        """Chunks of the longest index: sum ceil(l_i / C) <= floor(sum l_i / C) + (sequences)."""
        return self.total_tokens // chunk_size + self.num_seqs

    def update(self, cu_seqlens_cpu: Sequence[int]) -> "VarlenMetadata":
        """Writes new packed lengths (cu_seqlens on the host: a list or a CPU tensor, starting at 0, non-decreasing,
        at most max_sequences sequences of max_tokens tokens in all) into this object's tensors, in place. Not while
        a CUDA graph is being captured (it copies from the host); between replays."""
        if capturing():
            raise RuntimeError("VarlenMetadata.update copies from the host: call it before capture or between "
                               "replays, not while a CUDA graph is being captured")
        cu = _host_offsets(cu_seqlens_cpu)
        if len(cu) - 1 > self.num_seqs or int(cu[-1]) > self.total_tokens:
            raise ValueError(f"prepare_varlen: {len(cu) - 1} sequences of {int(cu[-1])} tokens exceed the capacity "
                             f"of max_sequences={self.num_seqs}, max_tokens={self.total_tokens}")
        padded = torch.cat([cu, cu[-1:].expand(self.num_seqs + 2 - len(cu))])
        self.cu_seqlens_cpu.copy_(padded[:-1])
        self._cu_buffer.copy_(padded)
        for chunk_size, index in self._chunks.items():
            self._fill(index, chunk_size)
        return self

    def _chunk_index(self, chunk_size: int) -> ChunkIndex:
        if capturing():
            raise RuntimeError(f"the varlen metadata has no chunk index for chunk size {chunk_size}, and it cannot be "
                               f"built while a CUDA graph is being captured: pass chunk_sizes=({chunk_size},) to "
                               f"prepare_varlen, or make one call before capture")
        device = self._cu_buffer.device
        cap = self.capacity_chunks(chunk_size)
        index = ChunkIndex(torch.zeros(cap, 2, dtype=torch.int32, device=device),
                           torch.zeros(self.num_seqs + 1, dtype=torch.int32, device=device), cap)
        return self._fill(index, chunk_size)

    def _fill(self, index: ChunkIndex, chunk_size: int) -> ChunkIndex:
        seq, local, offsets = chunk_table(self.cu_seqlens_cpu, chunk_size)
        spare = index.num_chunks - len(seq)
        seq = torch.cat([seq, seq.new_full((spare,), self.num_seqs)])  # the empty sequence past the last
        local = torch.cat([local, local.new_zeros(spare)])
        index.chunk_indices.copy_(torch.stack([seq, local], dim=1))
        index.chunk_offsets.copy_(offsets)
        return index


def _host_offsets(cu_seqlens_cpu) -> torch.Tensor:
    """cu_seqlens as an int64 CPU tensor, checked: 1-D, N+1 >= 2 entries from 0, non-decreasing."""
    if isinstance(cu_seqlens_cpu, torch.Tensor):
        if cu_seqlens_cpu.device.type != "cpu" or cu_seqlens_cpu.dtype.is_floating_point:
            raise TypeError(f"prepare_varlen: cu_seqlens_cpu must be integers on the host (a list or a CPU tensor), "
                            f"got a {cu_seqlens_cpu.dtype} tensor on {cu_seqlens_cpu.device}")
        cu = cu_seqlens_cpu.to(torch.int64)
    else:
        cu = torch.tensor(list(cu_seqlens_cpu), dtype=torch.int64)
    if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"prepare_varlen: cu_seqlens_cpu must be 1-D, start at 0 and be non-decreasing, "
                         f"with N+1 >= 2 entries; got {cu.tolist()}")
    return cu


def prepare_varlen(cu_seqlens_cpu: Sequence[int], max_sequences: Optional[int] = None,
                   max_tokens: Optional[int] = None, chunk_sizes: Sequence[int] = (64,),
                   device: Optional[torch.device] = None) -> VarlenMetadata:
    """Varlen metadata for calls captured in a CUDA graph: pass the result as cu_seqlens (with no cu_seqlens_cpu) to
    chunk_delta_rule, chunk_gated_delta_rule, fused_recurrent_delta_rule, fused_recurrent_gated_delta_rule and
    fused_sigmoid_gating_delta_rule_update, on q, k, v of max_tokens rows (B = 1), and refill it with new lengths by
    its update() between replays. The call then makes no host-to-device copy and reads nothing back from the device.

    cu_seqlens_cpu: the packed offsets on the host (list or CPU tensor). max_sequences, max_tokens: the capacity
    (default: these lengths'); calls see max_sequences sequences (the padding ones empty: states [max_sequences, ...])
    and max_tokens rows (outputs zero past the last sequence). chunk_sizes: the chunk forms' sizes to index now (a
    size first used by a call is indexed then, outside capture). device: where the kernels run (default: cuda when
    there is one). Inference only."""
    return VarlenMetadata(cu_seqlens_cpu, max_sequences, max_tokens, chunk_sizes, device)


def packed_info(bounds: Sequence[int], total_tokens: int, device: torch.device) -> SeqInfo:
    """SeqInfo of the packed sequences [bounds[i], bounds[i + 1]) of a batch of total_tokens rows (the tensors'
    extent: the sequences need not cover it), from bounds on the host (the sequence split's and the segmented
    backward's batches of partitions and segments)."""
    cpu = torch.tensor(bounds, dtype=torch.int64)
    return SeqInfo(cpu.to(torch.int32).to(device, non_blocking=True), cpu, len(bounds) - 1, total_tokens)
