"""launch(kernel, grid, *args, **kwargs): the same launch as kernel[grid](*args, **kwargs), with less host work
once the kernel has been compiled for these arguments.

triton's JITFunction.run spends 16-22 µs of host time a launch (triton 3.6; benchmarks/diagnostics/host_time.md)
binding the arguments, specializing each (native_specialize_impl), building its cache key (str() of the options
every call), checking the used globals and building launch metadata, before its compiled kernel's launcher runs.
Here the first launch of each specialization goes through kernel[grid](...) as always, and the CompiledKernel it
returns is kept under a key of our own; a later launch with the same key calls that kernel's launcher directly,
with the same arguments JITFunction.run would pass it.

The key is at least as fine as triton 3.6's specialization, so that a launch triton would compile differently
never reuses a binary (tests/kernels/test_launch.py checks it against JITFunction.run on kernels compiled for
sm_90):
  - the current device (triton launches on it, not on the tensors' device);
  - per argument, in signature order (keyword arguments bound to their parameters):
      constexpr parameters: the value and its type (True, 1 and 1.0 are different keys);
      tensors: the dtype and whether data_ptr() is 16-byte aligned (recomputed every launch);
      None; bools by value; ints by type, == 1, % 16 == 0 and triton's i32 / i64 / u64 range (an int outside
      [-2**63, 2**64) takes kernel[grid], which raises); floats by type;
      Gluon TMA descriptors by the base's dtype, the block shape, the layout and the padding;
    any other argument (a tuple, a numpy scalar, another descriptor class) takes kernel[grid] every time;
  - the launch options (num_warps, num_stages, maxnreg, ...) in the order given, as triton's str(options) has
    them, with the kernel's debug flag and knobs.runtime.debug and knobs.compilation.instrumentation_mode, which
    triton adds to them.
And a launch takes kernel[grid] instead (and is not remembered) when:
  - TRITON_INTERPRET is set (kernels are interpreted, not compiled), or triton is not a version whose launch
    path this was checked against (_CHECKED_TRITON);
  - JITFunction.run is not triton's own (offline_compile.py, isolated.forced_launch and the Gluon diagnostics
    replace it to compile or to force launch options: they keep seeing every launch);
  - the kernel has pre-run hooks, or knobs.runtime.launch_enter_hook / launch_exit_hook have hooks (profilers
    such as proton see every launch with its metadata);
  - a global the kernel read when it was compiled changed since (triton raises on that: kernel[grid] does);
  - the grid is a callable (it takes the bound arguments).
With no hooks the launcher gets None for the launch metadata and both hooks; JITFunction.run passes it the empty
hook chains and their metadata, which it calls to no effect.

Review (wip/host-cuts-review, read against triton 3.6's runtime/jit.py, backends/nvidia/driver.py, compiler.py and
triton's specialize.cc; on the dev CPU only, no GPU run):
  - Checked: the generated bind against create_function_from_signature (same parameter names, no defaults: our
    top-level kernels have none, and a missing argument is a TypeError that takes kernel[grid]; keyword arguments
    bind to parameters, the rest are options, as in triton); the key against native_specialize_impl argument by
    argument (tensor dtype and data_ptr() & 15 recomputed per call, views with offsets included; int == 1, % 16,
    i32 / i64 / u64; bool / float / None; Gluon descriptors: triton keys dtype, block shape and repr(layout), the
    TMA map itself is filled per launch by the launcher from base.data_ptr(), shape and strides, so both paths
    do that work); no kernel of ours has do_not_specialize(_on_alignment), annotations or defaults (introspected);
    the launcher call against JITFunction.run's (grid, current stream read per call on the current device read
    per call, function, packed metadata, metadata / hooks None only when no hook is installed, every bound
    argument in signature order; the C launcher skips None hooks; global / profile scratch are allocated inside
    CudaLauncher.__call__ on both paths); every fallback (tests/kernels/test_launch.py). The key holds no data
    pointer or int value beyond what triton specializes, so it grows only with specializations (like triton's
    own cache); _plans keeps each kernel alive (module-level kernels only). Dict updates under the GIL are safe;
    two threads may both build a plan, harmlessly. torch.compile: kernels run inside the custom ops (library.py),
    eagerly, so dynamo never traces launch; under CUDA graph capture the stream is read per launch, as triton does.
    Also ran, outside the test (3 min): all four forms, bf16 / fp16 / fp32, fixed and varlen, Triton and Gluon
    chunk paths: every launch picks JITFunction.run's CompiledKernel and launcher arguments.
  - Found and fixed: an int argument >= 2**64 got the u64 key and reached the launcher, whose "K" format wraps it
    without an overflow check (triton raises OverflowError); ints outside [-2**63, 2**64) now take kernel[grid].
  - Not a divergence: constexprs equal under == but printed apart (-0.0 / 0.0, constexpr[1] / constexpr[1.0]):
    triton's kernel_key_cache looks its key up by == too, so both paths reuse the first one's kernel (test rows).
  - Remaining risks: option values are keyed by == where triton keys str(options) (enable_fp_fusion=1 vs True
    share a kernel here, get two compiles of the same code from triton; not worth the ~0.4 µs a launch to key by
    type); a triton 3.6.x patch release that changes run or the launcher would pass _CHECKED_TRITON; hooks,
    launch_metadata callbacks and pre-run hooks are only honoured by falling back, so a hook added while a
    launch is in flight on another thread may miss that launch; the checks run a stand-in driver, not CUDA.
  - Estimate: bitwise-identical results to kernel[grid] on the H200 for every deltatron launch site: ~97%
    (same CompiledKernel and same launcher arguments in every case checked; the residue is what a CPU stand-in
    cannot show)."""
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
    # triton's own run, not a replacement in place when deltatron was imported (a forced_launch's would put kernels
    # compiled under forced options in the cache)
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
