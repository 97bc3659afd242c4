"""The `deltatron` dispatcher (deltatron/cli/__init__.py): usage on no command or --help, one line and usage
on an unknown command, and a module with main(argv) behind every command."""
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from deltatron import cli

ROOT = Path(__file__).resolve().parents[2]


def test_no_command_prints_usage_and_fails(capsys):
    assert cli.main([]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith("usage: deltatron <command> [options]")
    assert all(f"  {name} " in out.err for name in cli.COMMANDS)


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_help_prints_usage_and_succeeds(flag, capsys):
    assert cli.main([flag]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("usage: deltatron <command> [options]") and out.err == ""


def test_unknown_command_is_one_line_and_usage(capsys):
    assert cli.main(["chek"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "deltatron: unknown command 'chek' (choose from check, explain, train, bench)"
    assert err[1] == "usage: deltatron <command> [options]"


def test_commands_and_their_modules():
    assert {name: module for name, (module, _) in cli.COMMANDS.items()} == {
        "check": "deltatron.cli.check", "explain": "deltatron.cli.explain", "train": "deltatron.cli.train",
        "bench": "deltatron.cli.bench"}
    assert cli.COMMANDS["explain"][1] == \
        "print which kernels chunk_delta_rule runs for a shape (the plan), on any machine"
    for name in ("check", "train", "bench"):
        assert callable(importlib.import_module(cli.COMMANDS[name][0]).main)


def test_python_dash_m_deltatron_dispatches():
    run = subprocess.run([sys.executable, "-m", "deltatron", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and run.stdout.startswith("usage: deltatron <command> [options]")
    run = subprocess.run([sys.executable, "-m", "deltatron"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stderr.startswith("usage: deltatron")
