"""`deltatron check` (the README's main job): it passes on correct implementations, fails loudly on a wrong
one, and runs a case only in the dtypes the case names."""
import torch

from deltatron.cli import check


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
    monkeypatch.setattr(check, "cases_for", lambda device, interpret: cases)
    lines = []
    assert check.run_checks(torch.device("cpu"), ["torch"], [torch.float32, torch.bfloat16], printer=lines.append)
    rows = [line.split()[:3] for line in lines[2:]]
    assert len(rows) == len(check.ENTRY_POINTS) * 3  # first case in fp32 and bf16, second in bf16 only
    assert sum(dtype == "fp32" for _, _, dtype in rows) == len(check.ENTRY_POINTS)
