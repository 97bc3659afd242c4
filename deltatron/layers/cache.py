"""The decoding state of a stack of DeltaNet and GatedDeltaNet layers."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch


@dataclass
class LayerState:
    """recurrent_state: [N, H, K, V] fp32, the delta-rule state of each of N sequences (H = Hv for GatedDeltaNet);
    conv_state: the short convolutions' states ([N, W - 1, C] each), or None without them: DeltaNet's three
    (q, k, v), GatedDeltaNet's one (its convolution over [q | k | v])."""

    recurrent_state: torch.Tensor
    conv_state: Optional[Tuple[torch.Tensor, ...]]


class DeltaNetCache:
    """Per-layer decoding state, keyed by layer_idx. Pass the same cache to every call: the first (prefill)
    fills it, each later call continues from it and updates it; a decode step updates the recurrent state
    in place.

        cache = DeltaNetCache()
        logits = model(prompt, cache=cache)            # [B, T] prompt
        logits = model(next_token[:, None], cache=cache)"""

    def __init__(self):
        self.layers: Dict[int, LayerState] = {}

    def __getitem__(self, layer_idx: int) -> Optional[LayerState]:
        return self.layers.get(layer_idx)

    def __setitem__(self, layer_idx: int, state: LayerState) -> None:
        self.layers[layer_idx] = state

    def __len__(self) -> int:
        return len(self.layers)
