"""Backend choice (DESIGN.md §9): the one dispatch point between the PyTorch implementations and the Triton kernels.

DELTATRON_BACKEND=torch|triton|auto (default auto): auto runs Triton on CUDA tensors and PyTorch
otherwise; triton on CPU tensors runs the kernels in Triton's interpreter (needs TRITON_INTERPRET=1)."""
from __future__ import annotations

import functools
import importlib
import os

import torch

BACKENDS = ("torch", "triton")
MAX_HEAD_SIZE = 256


def requested_backend() -> str:
    return _parse_backend(os.environ.get("DELTATRON_BACKEND", "auto"))


@functools.lru_cache(maxsize=16)  # read on every call: the variable may change within a process
def _parse_backend(value: str) -> str:
    name = value.strip().lower() or "auto"
    if name not in BACKENDS + ("auto",):
        raise ValueError(f"DELTATRON_BACKEND must be one of torch, triton, auto; got {name!r}")
    return name


@functools.lru_cache(maxsize=None)  # asked on every call; an import does not come or go within a process
def triton_available() -> bool:
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


def select_backend(q: torch.Tensor) -> str:
    name = requested_backend()
    if name == "auto":
        return "triton" if q.is_cuda and triton_available() else "torch"
    if name == "triton":
        if not triton_available():
            raise RuntimeError("DELTATRON_BACKEND=triton but triton is not installed")
        if not q.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1":
            raise RuntimeError(
                f"DELTATRON_BACKEND=triton with tensors on {q.device}: Triton kernels need CUDA tensors, "
                "or TRITON_INTERPRET=1 to run them in Triton's interpreter on the CPU"
            )
    return name


def check_triton_inputs(q: torch.Tensor, v: torch.Tensor) -> None:
    if q.dtype == torch.float64:
        raise TypeError(
            "the Triton backend takes float16, bfloat16 or float32 inputs; float64 runs on the PyTorch "
            "backend (DELTATRON_BACKEND=torch or CPU tensors)"
        )
    K, V = q.shape[-1], v.shape[-1]
    if K > MAX_HEAD_SIZE or V > MAX_HEAD_SIZE:
        raise ValueError(f"the Triton backend supports head sizes up to {MAX_HEAD_SIZE}, got K = {K}, V = {V}")


@functools.lru_cache(maxsize=None)
def triton_form(name: str):
    """The module of deltatron.kernels implementing a form (contract in deltatron.autograd); cached, since
    importlib's lookup costs about as much as the rest of a small call's dispatch."""
    return importlib.import_module(f"deltatron.kernels.{name}")
