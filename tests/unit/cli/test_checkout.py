"""`kpr demo` and `kpr bench` run the lab and the bench, which live in the repository (lab/,
bench/ beside kpr/), not in the installed package: from a checkout they find them however kpr
was started; without one (a wheel, the image) they say so in one sentence."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from kpr.cli import main
from tests.support.cli import KPR
from tests.support.paths import REPO


def test_the_checkout_is_the_repository_this_kpr_runs_from() -> None:
    assert main.source_checkout() == REPO


@pytest.mark.parametrize("command", ["demo", "bench"])
def test_without_a_checkout_the_command_says_so_in_one_sentence(monkeypatch, command) -> None:
    monkeypatch.setattr(main, "source_checkout", lambda: None)
    result = CliRunner().invoke(main.app, [command])
    assert result.exit_code == 2
    assert isinstance(result.exception, SystemExit)  # typer's Exit, not an ImportError
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"kpr {command} needs a kpr source checkout: ")
    assert "lab/" in line and "bench/" in line and "clone of the repository" in line
    assert "Traceback" not in result.output


@pytest.fixture
def no_lab_imported():
    """`lab` and its modules out of sys.modules for the test, put back afterwards."""
    saved = {k: m for k, m in sys.modules.items() if k == "lab" or k.startswith("lab.")}
    for name in saved:
        del sys.modules[name]
    yield
    for name in [k for k in sys.modules if k == "lab" or k.startswith("lab.")]:
        del sys.modules[name]
    sys.modules.update(saved)


def test_demo_puts_the_checkout_on_sys_path(monkeypatch, tmp_path, no_lab_imported) -> None:
    """As `make demo` starts it (.venv/bin/kpr: sys.path[0] is .venv/bin, not the checkout)."""
    (tmp_path / "lab").mkdir()
    (tmp_path / "lab" / "__init__.py").write_text("")
    (tmp_path / "lab" / "demo.py").write_text(
        "def main(pods, connections):\n    print(f'demo {pods} {connections}')\n    return 0\n"
    )
    monkeypatch.setattr(main, "source_checkout", lambda: tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(REPO))])
    result = CliRunner().invoke(main.app, ["demo", "--pods", "2"])
    assert (result.exit_code, result.stdout) == (0, "demo 2 300\n"), result.output
    assert sys.path[0] == str(tmp_path)


def test_bench_started_outside_the_checkout_reaches_its_bench(tmp_path) -> None:
    """`python -m kpr.cli` from another directory, nothing on PYTHONPATH: the bench is found
    (its own error about the options, not an ImportError)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [*KPR, "bench", "--services", "many"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == "kpr: --services: not a list of numbers: 'many'"
