"""launch(kernel, grid, *args, **kwargs): kernel[grid](*args, **kwargs) with less host work once the kernel has been
compiled for these arguments (DESIGN.md §5, launch path).

triton's JITFunction.run binds, specializes and keys every argument on every call (16-22 µs of host time a launch
on triton 3.6). Here the first launch of each specialization goes through kernel[grid], and the CompiledKernel it
returns is kept under our own key; a later launch with that key calls its launcher directly, with the arguments
JITFunction.run would pass. The key is at least as fine as triton 3.6's specialization, so a launch triton would
compile differently never reuses a binary: the current device; per argument in signature order, constexprs by value
and type, tensors by dtype and 16-byte alignment, ints by type, == 1, % 16 == 0 and i32 / i64 / u64 range, bools by
value, floats by type, Gluon TMA descriptors by dtype, block shape, layout and padding (anything else takes
kernel[grid]); the launch options in the order given, with the debug and instrumentation settings triton adds.
kernel[grid] also runs (and nothing is remembered) under TRITON_INTERPRET, on a triton version not in
_CHECKED_TRITON, where JITFunction.run has been replaced (tools that compile offline or force launch options),
where pre-run or launch enter / exit hooks are set (profilers see every launch), where a global the kernel read has
changed (triton raises), for ints outside [-2**63, 2**64) (the launcher would wrap them) and for callable grids.
Option values are keyed by ==, where triton keys str(options): enable_fp_fusion=1 and True share one binary here."""
from __future__ import annotations

from typing import Any, Dict, Tuple

import torch
import triton

from .utils import INTERPRET

# triton versions whose JITFunction.run this mirrors (the launcher's arguments, the options run adds, the
# specialization): another version launches through kernel[grid] only
_CHECKED_TRITON = ("3.6",)
_ENABLED = not INTERPRET and ".".join(triton.__version__.split(".")[:2]) in _CHECKED_TRITON

if _ENABLED:
    from triton import knobs
    from triton.compiler.compiler import CompiledKernel
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
    from triton.knobs import HookChain
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    _TRITON_RUN = JITFunction.run
    # triton's own run, not a replacement in place when deltatron was imported (one that forces launch options would
    # put kernels compiled under them in the cache)
    _ENABLED = (_TRITON_RUN.__module__, _TRITON_RUN.__qualname__) == ("triton.runtime.jit", "JITFunction.run")

_I32_MIN, _I32_MAX, _U64_MIN = -2 ** 31, 2 ** 31 - 1, 2 ** 63
_I64_MIN, _U64_MAX = -2 ** 63, 2 ** 64 - 1  # beyond: triton raises OverflowError (the launcher's u64 "K" would wrap)
_NOT_PRESENT = object()


class _Unsupported(Exception):
    """An argument only triton may specialize (launch takes kernel[grid])."""


def _arg_key(x):
    """The key of a runtime (not constexpr) argument other than a plain torch.Tensor (_Plan.bind inlines those)."""
    if isinstance(x, torch.Tensor):
        return x.dtype, x.data_ptr() % 16 == 0
    if x is None:
        return None
    t = type(x)
    if t is bool:
        return t, x
    if t is int:
        if not _I64_MIN <= x <= _U64_MAX:
            raise _Unsupported  # kernel[grid] raises triton's OverflowError
        return t, x == 1, x % 16 == 0, _I32_MIN <= x <= _I32_MAX, x >= _U64_MIN
    if t is float:
        return t
    if t is GluonTensorDescriptor:
        return t, x.base.dtype, tuple(x.block_shape), x.layout, x.padding
    raise _Unsupported


class _Plan:
    """What launch needs of a kernel, made once: bind(*args, **kwargs), generated for the kernel's signature like
    triton's binder, returning (every parameter's argument in signature order, the launch options in the order
    given, the arguments' key); and the compiled kernels launched so far, by key."""

    def __init__(self, kernel):
        self.kernel = kernel  # (the plans are looked up by id(kernel))
        self.compiled: Dict[Tuple, Any] = {}
        names = kernel.arg_names
        parts = [f"_dt_type({n}), {n}" if p.is_constexpr else
                 f"({n}.dtype, {n}.data_ptr() % 16 == 0) if _dt_type({n}) is _dt_Tensor else _dt_arg_key({n})"
                 for n, p in zip(names, kernel.params)]
        src = (f"def bind({', '.join(names)}, **_dt_options):\n"
               f"    return ({', '.join(names)},), tuple(_dt_options.items()), ({', '.join(parts)},)\n")
        namespace = dict(_dt_type=type, _dt_Tensor=torch.Tensor, _dt_arg_key=_arg_key)
        exec(src, namespace)  # noqa: S102 (source built from the kernel's parameter names)
        self.bind = namespace["bind"]


_plans: Dict[int, _Plan] = {}


def launch(kernel, grid, *args, **kwargs):
    """kernel[grid](*args, **kwargs), through the compiled kernel's launcher directly when this specialization
    was launched before (module docstring). Returns what kernel[grid] returns: the CompiledKernel."""
    # (kernel may be a stand-in without run: tests replace kernels by recorders)
    if not _ENABLED or getattr(getattr(kernel, "run", None), "__func__", None) is not _TRITON_RUN or \
            kernel.pre_run_hooks or callable(grid):
        return kernel[grid](*args, **kwargs)
    enter, exit_ = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    if not (enter is None or type(enter) is HookChain and not enter.calls) or \
            not (exit_ is None or type(exit_) is HookChain and not exit_.calls):
        return kernel[grid](*args, **kwargs)
    plan = _plans.get(id(kernel))
    if plan is None or plan.kernel is not kernel:
        if any(n.startswith("_dt_") for n in kernel.arg_names):
            return kernel[grid](*args, **kwargs)
        plan = _plans[id(kernel)] = _Plan(kernel)
    device = driver.active.get_current_device()
    try:
        values, options, arg_key = plan.bind(*args, **kwargs)
        key = (device, options, kernel.debug, knobs.runtime.debug, knobs.compilation.instrumentation_mode, arg_key)
        compiled = plan.compiled.get(key)
    except (_Unsupported, TypeError):  # an argument only triton specializes, a missing argument, an unhashable one
        return kernel[grid](*args, **kwargs)
    if compiled is not None:
        for (name, _), (value, globals_dict) in kernel.used_global_vals.items():
            if globals_dict.get(name, _NOT_PRESENT) != value:
                return kernel[grid](*args, **kwargs)  # triton raises its error
        n = len(grid)
        compiled.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1,
                     driver.active.get_current_stream(device), compiled.function, compiled.packed_metadata,
                     None, None, None, *values)
        return compiled
    compiled = kernel[grid](*args, **kwargs)
    if type(compiled) is CompiledKernel:
        plan.compiled[key] = compiled
    return compiled
