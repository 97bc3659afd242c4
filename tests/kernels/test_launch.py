"""deltatron.kernels.launch against triton's own launch path: for every launch, the fast path (the compiled
kernel's launcher called directly) picks the same CompiledKernel and hands its launcher the same arguments as
JITFunction.run does, and goes through kernel[grid] where it must.

Real kernels are compiled for sm_90 with triton 3.6 (the version launch.py was checked against; on another it
launches through kernel[grid] only) on this machine without a GPU: offline_compile's stand-in driver
(tools/offline_compile.py) answers device 0, stream 7 and target sm_90, and only two C functions are replaced, by
recorders: the generated launcher's `launch` and `fill_tma_descriptor`. So every Python step of both paths runs as on the GPU host. It runs in a subprocess
(without TRITON_INTERPRET, with triton 3.6 first on the path when the installed triton is another version):

    python tests/kernels/test_launch.py      # the checks, with the triton importable
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# where a `pip install --target DIR triton==3.6.0` is, if anywhere (DELTATRON_TRITON36 names it)
TRITON36_DIRS = [os.environ.get("DELTATRON_TRITON36", "")]


def _triton36_path():
    """"" when the installed triton is 3.6, else a directory holding triton 3.6, else None."""
    import triton
    if triton.__version__.startswith("3.6."):
        return ""
    for d in filter(None, TRITON36_DIRS):
        init = Path(d) / "triton" / "__init__.py"
        if init.is_file() and "__version__ = '3.6." in init.read_text():
            return d
    return None


def test_fast_launch_matches_jit_run():
    path = _triton36_path()
    if path is None:
        import triton
        pytest.skip(f"needs triton 3.6 (launch.py's fast path is only enabled there): the installed triton is "
                    f"{triton.__version__} and none of {[d for d in TRITON36_DIRS if d]} holds a "
                    f"`pip install --target DIR triton==3.6.0` (set DELTATRON_TRITON36=DIR)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled kernels
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [path, str(ROOT), env.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "all checks passed" in proc.stdout, proc.stdout[-4000:]


# ---- the checks (run as a script, in the subprocess above) ----

def main() -> int:
    import torch
    import triton
    import triton.language as tl
    from triton import knobs
    from triton.backends.nvidia import driver as nvidia_driver
    from triton.runtime.jit import JITFunction

    assert triton.__version__.startswith("3.6."), triton.__version__
    from deltatron.kernels import launch as launch_module
    from deltatron.kernels.launch import launch
    assert launch_module._ENABLED

    launches = []  # the arguments of every call of the generated launcher's C `launch`
    sys.path.insert(0, str(ROOT / "tools"))
    from offline_compile import install_stand_in_driver
    install_stand_in_driver(lambda *a: launches.append(a), lambda *args: ("tma", args), stream=7)
    base = nvidia_driver._BASE_ARGS_FORMAT_LEN  # grid, stream, function, ..., metadata, the two hooks

    def same(a, b):
        return len(a) == len(b) and all(x is y or (not isinstance(x, torch.Tensor) and type(x) is type(y) and x == y)
                                        for x, y in zip(a, b))

    def check(kernel, grid, *args, expect_fast=True, **kwargs):
        """kernel[grid] (JITFunction.run) and launch twice with the same arguments: the same CompiledKernel and
        launcher arguments; launch's second call on the fast path (or not, expect_fast=False). Returns whether
        launch's first call was already fast (its key seen before)."""
        launches.clear()
        ref = kernel[grid](*args, **kwargs)
        first = launch(kernel, grid, *args, **kwargs)
        second = launch(kernel, grid, *args, **kwargs)
        assert ref is first is second, (kernel, args, kwargs)
        r, a, b = launches
        assert r[base - 3] is not None  # JITFunction.run: launch metadata and the (empty) hook chains
        for got in (a, b):
            assert same(got[:base - 3], r[:base - 3]) and same(got[base:], r[base:]), (got, r)
            fast = got[base - 3: base] == (None, None, None)
            assert fast or (got[base - 3] is not None and not got[base - 2].calls and not got[base - 1].calls)
        assert (b[base - 3] is None) == expect_fast, (kernel, args, kwargs)
        return a[base - 3] is None

    @triton.jit
    def probe_kernel(x, y, z, n, s, B: tl.constexpr, FLAG: tl.constexpr):
        i = tl.arange(0, B)
        m = i < n
        v = tl.load(x + i, mask=m, other=0.0) * s
        if z is not None:
            v += tl.load(z + i, mask=m, other=0.0)
        if FLAG:
            v = v * 2
        tl.store(y + i, v.to(y.dtype.element_ty), mask=m)

    buf = torch.zeros(256, dtype=torch.bfloat16)
    x, y, z = buf[:64], buf[64:128], buf[128:192]
    assert x.data_ptr() % 16 == 0 and buf[1:].data_ptr() % 16 != 0 and buf[8:].data_ptr() % 16 == 0
    grid = (1,)
    # each a specialization triton compiles separately, or one it shares with an earlier row (the fast path
    # may hit a key seen before only where triton launches that key's kernel: check() asserts it)
    rows = [
        ((x, y, None, 64, 0.5, 64, True), {}),
        ((buf[1:65], y, None, 64, 0.5, 64, True), {}),          # misaligned pointer
        ((buf[8:72], y, None, 64, 0.5, 64, True), {}),          # 16-byte aligned, another address
        ((x, buf[65:129], None, 64, 0.5, 64, True), {}),        # misaligned output
        ((x, y, z, 64, 0.5, 64, True), {}),                     # None -> a tensor
        ((x, y, buf[129:193], 64, 0.5, 64, True), {}),
        ((x, y, None, 1, 0.5, 64, True), {}),                   # an int equal to 1 (a constexpr to triton)
        ((x, y, None, 17, 0.5, 64, True), {}),                  # not a multiple of 16
        ((x, y, None, 48, 0.5, 64, True), {}),                  # a multiple of 16, like 64
        ((x, y, None, 2 ** 31, 0.5, 64, True), {}),             # i64
        ((x, y, None, 2 ** 63, 0.5, 64, True), {}),             # u64
        ((x, y, None, -16, 0.5, 64, True), {}),
        ((x, y, None, 64, 2, 64, True), {}),                    # an int where a float was
        ((x, y, None, 64, 1, 64, True), {}),
        ((x, y, None, 64, True, 64, True), {}),                 # a bool
        ((x, y, None, 64, 0.5, 64, 1), {}),                     # constexpr 1 against True
        ((x, y, None, 64, 0.5, 64, False), {}),
        ((x, y, None, 64, 0.5, 32, True), {}),
        ((x.float(), y, None, 64, 0.5, 64, True), {}),          # dtypes
        ((x, y.float(), None, 64, 0.5, 64, True), {}),
        ((x, y, None, 64, 0.5, 64, True), dict(num_warps=8)),   # launch options
        ((x, y, None, 64, 0.5, 64, True), dict(num_warps=8, num_stages=2)),
        ((x, y, None, 64, 0.5, 64, True), dict(num_stages=2, num_warps=8)),
        ((x, y, None, 64, 0.5, 64, True), dict(maxnreg=128)),
        ((x, y, None, 64, 0.5), dict(B=64, FLAG=True)),         # constexprs by keyword
        ((x, y, None), dict(n=64, s=0.5, B=64, FLAG=True, num_warps=8)),
        # constexprs of one type that are == but print apart: triton's kernel_key_cache looks its key up by ==,
        # so it launches the first one's kernel for both, as launch does (check() asserts the same kernel)
        ((x, y, None, 64, 0.5, 64, 0.0), {}),
        ((x, y, None, 64, 0.5, 64, -0.0), {}),
        ((x, y, None, 64, 0.5, 64, tl.constexpr(1)), {}),
        ((x, y, None, 64, 0.5, 64, tl.constexpr(1.0)), {}),
    ]
    compiled = set()
    for args, kwargs in rows:
        check(probe_kernel, grid, *args, **kwargs)
        compiled.add(probe_kernel[grid](*args, **kwargs))
    assert len(compiled) >= 20, len(compiled)
    # an int no kernel argument can hold (above u64): triton raises, the fast path must not truncate it
    for n in (2 ** 64 + 16, -2 ** 63 - 16):
        launches.clear()
        try:
            launch(probe_kernel, grid, x, y, None, n, 0.5, 64, True)
        except OverflowError:
            pass
        else:
            raise AssertionError(f"{n} launched as {launches}")
        assert not launches, launches
    # grids of 2 and 3 dimensions
    check(probe_kernel, (3, 2), x, y, None, 64, 0.5, 64, True)
    check(probe_kernel, (3, 2, 5), x, y, None, 64, 0.5, 64, True)

    # where launch must take kernel[grid]
    args = (x, y, None, 64, 0.5, 64, True)
    check(probe_kernel, lambda meta: (1,), *args, expect_fast=False)      # a callable grid
    seen = []
    knobs.runtime.launch_enter_hook.add(seen.append)                      # a profiler's launch hook
    try:
        launches.clear()
        launch(probe_kernel, grid, *args)
        # (the stubbed C launch would call it) JITFunction.run's metadata and hook chain reach the launcher
        assert launches[0][base - 3] is not None and launches[0][base - 2] is knobs.runtime.launch_enter_hook
    finally:
        knobs.runtime.launch_enter_hook.remove(seen.append)
    probe_kernel.add_pre_run_hook(lambda *a, **k: seen.append("pre"))     # a pre-run hook
    try:
        launch(probe_kernel, grid, *args)
        assert seen[-1] == "pre"
    finally:
        probe_kernel.pre_run_hooks.clear()
    run = JITFunction.run                                                 # a replaced JITFunction.run
    JITFunction.run = lambda self, *a, **k: seen.append("replaced")
    try:
        assert launch(probe_kernel, grid, *args) is None and seen[-1] == "replaced"
    finally:
        JITFunction.run = run
    assert check(probe_kernel, grid, *args)  # and back on the fast path

    # a global the kernel read at compile time changed: triton's error, not the old binary
    @triton.jit
    def global_kernel(y, B: tl.constexpr):
        tl.store(y + tl.arange(0, B), tl.full([B], SCALE, tl.float32))

    global SCALE
    SCALE = tl.constexpr(2.0)
    yf = torch.zeros(64)
    check(global_kernel, grid, yf, 64)
    SCALE = tl.constexpr(3.0)
    try:
        launch(global_kernel, grid, yf, 64)
    except RuntimeError as e:
        assert "has changed since we compiled this kernel" in str(e)
    else:
        raise AssertionError("a changed global went unnoticed")
    SCALE = tl.constexpr(2.0)

    print("probe kernel: all specializations match JITFunction.run")
    check_chunk(check, torch)
    print("all checks passed")
    return 0


def check_chunk(check, torch):
    """The chunk form's forward and backward (bf16, K = V = 128, 2 x 2 heads) with the Hopper walk and reverse pass
    forced on (plan.overrides; the plan made for sm90's capabilities, which the stand-in driver answers): every
    launch of deltatron's wrappers checked as above (each module's `launch` replaced by check, which calls the real
    one)."""
    from deltatron.kernels import chunk
    from deltatron.kernels.chunk import plan
    from deltatron.kernels.chunk.hopper import reverse, walk  # noqa: F401 (their launch too)
    from deltatron.kernels.utils import seq_info

    sys.path.insert(0, str(ROOT / "tools"))
    from offline_compile import inputs, run_form

    modules = [m for name, m in sys.modules.items() if name.startswith("deltatron.kernels.") and
               getattr(m, "launch", None) is not None and name != "deltatron.kernels.launch"]
    checked = []

    def checking(kernel, grid, *args, **kwargs):
        checked.append(kernel.__name__)
        check(kernel, grid, *args, **kwargs)

    originals = {m: m.launch for m in modules}
    # the tensors are the CPU's: every module that asks plan.device_capabilities gets sm90's (Gluon included), the
    # device the stand-in driver answers for
    sm90 = plan.named_capabilities("sm90")
    asking = {m: m.device_capabilities for name, m in sys.modules.items()
              if name.startswith("deltatron.kernels.chunk") and getattr(m, "device_capabilities", None) is not None}
    for m in asking:
        m.device_capabilities = lambda device: sm90
    for m in modules:
        m.launch = checking
    try:
        x = inputs(2, 128, 2, 128, 128, torch.bfloat16)
        info = seq_info(2, 128, torch.device("cpu"), None, None)
        with plan.overrides(hopper_walk=True, hopper_reverse=True):
            run_form(chunk, x, info)
    finally:
        for m, fn in originals.items():
            m.launch = fn
        for m, fn in asking.items():
            m.device_capabilities = fn
    # every kernel of the forward and the backward (a launch site calling kernel[grid] itself would be missing)
    assert set(checked) == {"wy_kernel", "gluon_walk_kernel", "state_fwd_kernel", "gluon_reverse_kernel",
                            "dqkw_kernel", "wy_bwd_kernel"}, checked
    print(f"chunk form: {len(checked)} launches match JITFunction.run ({', '.join(checked)})")


if __name__ == "__main__":
    sys.exit(main())
