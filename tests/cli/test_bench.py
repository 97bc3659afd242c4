"""`deltatron bench` (deltatron/cli/bench.py): it runs the checkout's benchmarks/harness.py with the options
given, and without that folder (a non-editable install) says in one line that it needs a source checkout."""
import sys

import pytest

from deltatron.cli import bench


def test_without_a_checkout_one_line_and_exit_2(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(bench, "benchmarks_dir", lambda: tmp_path / "site-packages" / "benchmarks")
    assert bench.main(["--smoke"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("deltatron bench: needs a source checkout") and err.count("\n") == 1


@pytest.fixture
def fake_checkout(monkeypatch, tmp_path):
    """A checkout whose harness records its arguments; the real benchmarks package is put back afterwards."""
    folder = tmp_path / "benchmarks"
    folder.mkdir()
    (folder / "__init__.py").write_text("")  # a package, as the checkout's benchmarks/ is
    (folder / "harness.py").write_text("calls = []\n\ndef main(argv):\n    calls.append(argv)\n    return 7\n")
    monkeypatch.setattr(bench, "benchmarks_dir", lambda: folder)
    monkeypatch.setattr(sys, "path", list(sys.path))
    saved = {name: sys.modules.pop(name) for name in list(sys.modules)
             if name == "benchmarks" or name.startswith("benchmarks.")}
    yield tmp_path
    for name in [n for n in sys.modules if n == "benchmarks" or n.startswith("benchmarks.")]:
        del sys.modules[name]
    sys.modules.update(saved)


def test_runs_the_harness_with_the_options(fake_checkout):
    assert bench.main(["--smoke", "--out", "x"]) == 7
    harness = sys.modules["benchmarks.harness"]
    assert harness.__file__ == str(fake_checkout / "benchmarks" / "harness.py")
    assert harness.calls == [["--smoke", "--out", "x"]]
    assert sys.path[0] == str(fake_checkout)
