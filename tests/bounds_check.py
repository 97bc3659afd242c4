"""Bounds checking for Triton's interpreter: with DELTATRON_BOUNDS_CHECK=1 (tests/conftest.py installs it), every
address a kernel loads or stores under a true mask must lie inside the storage of one of its launch's tensor
arguments, else the launch fails naming the kernel. On a GPU such an access reads or writes memory the call does not
own, or faults (an illegal memory access that poisons the CUDA context); in the interpreter it would read whatever
the host's memory holds there. The storage, not the view: a view may be read past its end by design (a prepared
varlen batch's spare chunks read the entry past its cu_seqlens view, which its buffer holds). It hooks the
interpreter's launch and its masked loads and stores, so it applies to kernels run with TRITON_INTERPRET=1 only."""
from __future__ import annotations

import numpy as np
import torch
from triton.runtime import interpreter

# the interpreter's methods install() wraps: its argument copy (to record the spans), masked load and masked store
HOOKS = ((interpreter.GridExecutor, "_init_args_hst"), (interpreter.InterpreterBuilder, "create_masked_load"),
         (interpreter.InterpreterBuilder, "create_masked_store"))
_launch = {"kernel": "", "spans": []}  # the running launch's kernel name and its arguments' storages' byte spans


def _spans(args) -> list:
    """[start, end) of each tensor argument's storage (a tuple's too)."""
    spans = []
    for arg in args:
        if isinstance(arg, tuple):
            spans += _spans(arg)
        elif isinstance(arg, torch.Tensor):
            storage = arg.untyped_storage()
            spans.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    return spans


def _check(ptrs, mask, access: str) -> None:
    addresses = np.asarray(ptrs.data).astype(np.uint64)
    addresses = addresses[np.broadcast_to(np.asarray(mask.data, dtype=bool), addresses.shape)]
    inside = np.zeros(addresses.shape, dtype=bool)
    for start, end in _launch["spans"]:
        inside |= (addresses >= start) & (addresses < end)
    if not inside.all():
        raise AssertionError(f"{_launch['kernel']}: {int((~inside).sum())} addresses of a {access} outside every "
                             f"tensor argument's storage")


def install() -> None:
    """Wraps HOOKS: the argument copy records the spans, the masked load and store check them."""
    executor, builder = interpreter.GridExecutor, interpreter.InterpreterBuilder
    missing = [name for cls, name in HOOKS if not hasattr(cls, name)]
    if missing:
        raise RuntimeError(f"DELTATRON_BOUNDS_CHECK: this triton's interpreter has no {', '.join(missing)} to hook")
    init_args, load, store = executor._init_args_hst, builder.create_masked_load, builder.create_masked_store

    def init_args_checked(self, args_dev, kwargs):
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        _launch.update(kernel=self.fn.__name__, spans=_spans(list(args_hst) + list(kwargs_hst.values())))
        return args_hst, kwargs_hst

    def load_checked(self, ptrs, mask, other, *rest):
        _check(ptrs, mask, "load")
        return load(self, ptrs, mask, other, *rest)

    def store_checked(self, ptrs, value, mask, *rest):
        _check(ptrs, mask, "store")
        return store(self, ptrs, value, mask, *rest)

    executor._init_args_hst = init_args_checked
    builder.create_masked_load = load_checked
    builder.create_masked_store = store_checked
