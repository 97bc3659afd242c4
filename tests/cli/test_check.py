"""`deltatron check` (the README's main job): it passes on correct implementations, fails loudly on a wrong
one, runs a case only in the dtypes the case names, picks the quick matrix on a GPU, turns Triton's interpreter
on without a GPU, and answers a bad option with one line."""
import os
import subprocess
import sys
from pathlib import Path

import torch

from deltatron.cli import check

ROOT = Path(__file__).resolve().parents[2]


def test_check_passes_on_the_torch_backend(capsys):
    assert check.main(["--backend", "torch", "--dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    assert "all checks passed" in out and " ok" in out and "FAIL" not in out


def test_check_fails_on_a_wrong_output(monkeypatch, capsys):
    right = check.ENTRY_POINTS["chunk"]

    def off_by_one_percent(**kwargs):
        o, s = right(**kwargs)[:2]
        return o * 1.01, s

    monkeypatch.setitem(check.ENTRY_POINTS, "chunk", off_by_one_percent)
    assert check.main(["--backend", "torch", "--dtype", "fp32"]) == 1
    out = capsys.readouterr().out
    assert "SOME CHECKS FAILED" in out
    assert all("FAIL (bound 1e-04)" in line for line in out.splitlines() if line.startswith("chunk "))


def test_a_case_runs_only_its_dtypes(monkeypatch):
    cases = [check.Case(1, 1, 16, 16, T=20), check.Case(1, 1, 16, 16, T=20, dtypes=(torch.bfloat16,))]
    monkeypatch.setattr(check, "cases_for", lambda device, interpret, full: cases)
    lines = []
    assert check.run_checks(torch.device("cpu"), ["torch"], [torch.float32, torch.bfloat16], printer=lines.append)
    rows = [line.split()[:3] for line in lines[2:]]
    assert len(rows) == len(check.ENTRY_POINTS) * 3  # first case in fp32 and bf16, second in bf16 only
    assert sum(dtype == "fp32" for _, _, dtype in rows) == len(check.ENTRY_POINTS)


def test_the_gpu_default_is_the_quick_matrix_and_full_is_everything():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert check.matrix(cuda, full=False) == (("chunk", "fused_recurrent"), [torch.float16, torch.bfloat16])
    everything = (tuple(check.ENTRY_POINTS), [torch.float32, torch.float16, torch.bfloat16])
    assert check.matrix(cuda, full=True) == everything
    assert check.matrix(cpu, full=False) == everything  # nothing to compile on the CPU
    assert check.matrix(cuda, full=False, dtype="fp32") == (("chunk", "fused_recurrent"), [torch.float32])
    assert check.matrix(cpu, full=False, dtype="all") == everything
    quick_cases, all_cases = check.cases_for(cuda, False, full=False), check.cases_for(cuda, False, full=True)
    assert len(quick_cases) == 2 and quick_cases == all_cases[:2]
    assert [c.lengths is None for c in quick_cases] == [True, False]  # one fixed-length, one packed


def test_device_errors_are_one_line(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert check.main(["--device", "cuda"]) == 2
    assert capsys.readouterr().err == "deltatron check: --device cuda but no CUDA device is available\n"
    assert check.main(["--device", "mps"]) == 2
    assert capsys.readouterr().err == "deltatron check: --device must be cpu, cuda or cuda:N, got 'mps'\n"


def test_interpreter_is_set_only_without_cuda_and_only_if_unset(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    kernels_loaded = any(m == "deltatron.kernels" or m.startswith("deltatron.kernels.") for m in sys.modules)
    assert check.use_interpreter_without_cuda(environ := {}) == (not kernels_loaded)
    if environ:
        assert environ == {"TRITON_INTERPRET": "1"}
    assert not check.use_interpreter_without_cuda(environ := {"TRITON_INTERPRET": "0"})
    assert environ == {"TRITON_INTERPRET": "0"}  # the user's choice stands
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not check.use_interpreter_without_cuda(environ := {}) and environ == {}


def test_without_cuda_the_triton_kernels_run_in_the_interpreter():
    # a fresh process with no GPU and TRITON_INTERPRET unset, as on a new user's CPU machine: the command sets
    # the variable before deltatron.kernels is imported, and the Triton rows run and pass
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "DELTATRON_BACKEND")}
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-m", "deltatron", "check", "--backend", "triton", "--dtype", "bf16"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == check.INTERPRETER_NOTE
    rows = [line.split() for line in lines if line.endswith(" ok")]
    assert len(rows) == 2 * len(check.ENTRY_POINTS) and all(row[1:3] == ["triton", "bf16"] for row in rows)
    assert lines[-1] == "all checks passed"
