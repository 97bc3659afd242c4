"""chunk_delta_rule's save_states (the forward keeps its states for the backward: the Gluon walk stores each chunk's
S^T and V'^T, and the backward skips its recompute walk): the training forward and the forward+backward through the
API without and with it (the benchmark's deltatron.chunk and deltatron.chunk_save_states), the gradients compared,
the times interleaved, and the peak memory of each.

Per config (the benchmark's bf16 inputs and dO): whether the states are kept there (backward.keeps_forward_states:
the Gluon walk on whole sequences and an unsegmented backward; elsewhere both settings run the same launches);
dq, dk, dv, dbeta with True against False (within BOUND; bitwise where the Gluon walk's states equal the Triton
recompute's); READINGS interleaved rounds of the forward with autograd recording (what it writes for the backward)
and of the forward+backward; then one forward+backward's peak allocation above its inputs (bench.peak_memory).

    python benchmarks/diagnostics/save_states.py [--configs b8-t2048-h16-k128 ...]
"""
from __future__ import annotations

import importlib
import os
import sys

os.environ["DELTATRON_BACKEND"] = "triton"

import torch  # noqa: E402

# switch_probe: same folder (sys.path[0] when run as a script)
from switch_probe import SETTINGS, api_fwd_bwd, gpu_probe_main, interleaved, rel  # noqa: E402

from deltatron import bench  # noqa: E402
from deltatron.kernels.chunk import seq_split  # noqa: E402

backward = importlib.import_module("deltatron.kernels.chunk.backward")  # the package exports a function of that name

CONFIGS = ["b8-t2048-h16-k128", "b4-t4096-h16-k128", "b2-t8192-h32-k128", "varlen20-t32768-h16-k128"]
BOUND = 1e-2  # bf16's, DESIGN.md §6
C = 64


def compare(cfg: bench.Config, device: torch.device, measure) -> bool:
    """Prints where the states are kept, the gradients' comparison, the readings and the peaks; whether the
    gradients agree within BOUND."""
    x, _, info = api_fwd_bwd(cfg, device)
    q, k, v = (x[n].reshape(1, -1, *x[n].shape[2:]) for n in ("q", "k", "v"))
    keeps = seq_split.plan_for(k, v, info, C) is None and backward.keeps_forward_states(q, k, v, info, C)
    print(f"\n{cfg.name}: {info.num_seqs} x {cfg.H} sequences x heads; save_states "
          + ("keeps the forward's states" if keeps else "keeps nothing here (the same launches both ways)"))
    calls = {s: bench.resolve("deltatron.chunk_save_states" if s else "deltatron.chunk", smoke=False)
             for s in SETTINGS}
    setting = [False]  # the setting the phases below run under (switch)

    def forward():
        return calls[setting[0]](x)

    def fwd_bwd():
        return torch.autograd.grad(forward(), [x[n] for n in bench.GRAD_INPUTS], x["do"])

    def switch(on, fn):
        setting[0] = on
        try:
            return fn()
        finally:
            setting[0] = False

    grads = {s: switch(s, fwd_bwd) for s in SETTINGS}
    errs = [rel(a, b) for a, b in zip(grads[True], grads[False])]
    agree = max(errs) <= BOUND
    print("  True against False, rel RMS: " + ", ".join(f"d{n} {e:.2e}" for n, e in zip(bench.GRAD_INPUTS, errs))
          + ("  OK" if agree else "  DIFFER"))
    interleaved(measure, switch, {"forward": forward, "forward+backward": fwd_bwd}, "save_states")
    opts = bench.Options(mode="full", warmup_ms=0, rep_ms=0, budget_s=0, device=device)
    peaks = {s: switch(s, lambda: bench.peak_memory(fwd_bwd, opts)) for s in SETTINGS}
    print("  peak of one forward+backward above its inputs, False / True: "
          + " / ".join(f"{peaks[s] / 2 ** 20:.1f}" for s in SETTINGS) + " MiB")
    return agree


if __name__ == "__main__":
    sys.exit(gpu_probe_main(__doc__, CONFIGS, compare))
