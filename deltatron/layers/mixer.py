"""What the token mixers (DeltaNet, GatedDeltaNet) share at their entry: the input check and the cache dispatch."""
from __future__ import annotations

from typing import Optional

import torch

from .. import context_parallel


def run_mixer(layer, hidden_states: torch.Tensor, cu_seqlens: Optional[torch.Tensor], cache, cp_group=None
              ) -> torch.Tensor:
    """layer._forward(hidden_states, cu_seqlens, cache, cp_group) after checking hidden_states is [B, T, hidden_size]
    (the error names the layer's class and the expected shape); with a cache, a decode call: no gradients, and the
    layer needs its layer_idx (its key in the cache). cp_group (context parallelism, DESIGN.md §13): hidden_states is
    this rank's shard of the stream that cu_seqlens describes; mode "chunk" and no cache."""
    name = type(layer).__name__
    expected = f"[B, T, hidden_size={layer.hidden_size}]"
    if not isinstance(hidden_states, torch.Tensor):
        raise TypeError(f"{name}: hidden_states must be a torch.Tensor {expected}, "
                        f"got {type(hidden_states).__name__}")
    if hidden_states.dim() != 3 or hidden_states.shape[-1] != layer.hidden_size:
        got = "[" + ", ".join(str(s) for s in hidden_states.shape) + "]"
        raise ValueError(f"{name}: hidden_states must be {expected}, got {got}")
    if cp_group is not None:
        if cache is not None or layer.mode != "chunk":
            raise ValueError(f"{name}: cp_group needs mode 'chunk' and no cache (context parallelism is for training "
                             f"and prefill of a sharded stream), got mode {layer.mode!r}"
                             f"{' and a cache' if cache is not None else ''}")
        context_parallel.check_group(name, cp_group, {})
    if cache is None:
        return layer._forward(hidden_states, cu_seqlens, None, cp_group)
    if layer.layer_idx is None:
        raise ValueError("decoding with a cache needs the layer's layer_idx (its key in the cache)")
    with torch.no_grad():
        return layer._forward(hidden_states, cu_seqlens, cache, None)
