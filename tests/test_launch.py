"""Ctrl-C while a command is still starting: one line and exit 130, never a traceback."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import sysconfig
import time
import tomllib
from pathlib import Path

import pytest

from vitrieval.index.cli import launch

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = Path(sys.executable).parent


def test_every_console_script_goes_through_the_launcher() -> None:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert set(scripts) == {"vitrieval-index", "vitrieval-train", "vitrieval-serve"}
    for name, target in scripts.items():
        module, _, function = target.partition(":")
        assert module == "vitrieval.index.cli.launch", name
        assert callable(getattr(launch, function)), target


def test_an_interrupted_import_is_one_line(tmp_path, monkeypatch, capsys) -> None:
    (tmp_path / "slow_to_start.py").write_text("raise KeyboardInterrupt\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert launch.run_command("vitrieval-index", "slow_to_start") == 130
    assert capsys.readouterr().err == "vitrieval-index: stopped while starting; nothing was done\n"


def test_the_command_answers_once_it_runs(tmp_path, monkeypatch) -> None:
    (tmp_path / "quick_command.py").write_text("def main():\n    return 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert launch.run_command("vitrieval-index", "quick_command") == 7


@pytest.mark.parametrize("program", ["vitrieval-index", "vitrieval-train", "vitrieval-serve"])
def test_ctrl_c_in_the_first_half_second_prints_no_traceback(program: str) -> None:
    script = SCRIPTS / program
    if not script.exists():
        pytest.skip(f"{program} is not installed in this environment")  # pragma: no cover
    # `--help` of a subcommand imports the command's modules: numpy, FAISS, ONNX Runtime,
    # torch for training. Signals land at several points of those imports.
    argv = {
        "vitrieval-index": ["info", "--help"],
        "vitrieval-train": ["fit", "--help"],
        "vitrieval-serve": ["--help"],
    }[program]
    guarded = 0  # runs whose signal came once the guard was in place
    for delay in (0.05, 0.15, 0.3, 0.45):
        proc = subprocess.Popen(
            [str(script), *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=60)
        if before_the_guard(err, script) or (proc.returncode == -signal.SIGINT and not err):
            continue  # (killed by the signal: before Python had its own handler)
        assert "Traceback" not in err, (delay, err)
        # the command may also have finished its help already
        assert proc.returncode in (130, 0), (delay, proc.returncode, err)
        if proc.returncode == 130 and err.strip():  # the server stops quietly once it runs
            assert err.strip().splitlines()[-1].startswith(f"{program}: "), err
        guarded += 1
    assert guarded >= 2, "the signals all came before the guard: a machine this slow tests nothing"


def before_the_guard(err: str, script: Path) -> bool:
    """Whether a Ctrl-C landed before index/cli/launch.py's guard could exist: in the
    interpreter's own start-up (its site module), or in the script's one import line
    (`from vitrieval.index.cli.launch import ...`), whose frames are the script's, the
    package's own initialisation (`vitrieval/__init__.py` and what it imports from the
    standard library) and importlib's. A signal in any command module's import is the
    guard's to answer."""
    if err.startswith("Fatal Python error: init_import_site"):
        return True
    if err.startswith("Error processing line ") and ".pth:" in err.splitlines()[0]:
        return True  # site running the editable install's .pth file: still start-up
    files = re.findall(r'^\s*File "([^"]+)"', err, re.M)
    return bool(files) and all(
        f == str(script)
        or f.startswith("<frozen ")
        or f in PACKAGE_START
        or in_the_standard_library(f)
        for f in files
    )


# what runs before the guard: the package's initialisation and the launcher's own package
PACKAGE_START = {
    str(REPO / path)
    for path in (
        "vitrieval/__init__.py",
        "vitrieval/_folders.py",
        "vitrieval/_version.py",
        "index/__init__.py",
        "index/cli/__init__.py",
        "index/cli/launch.py",
    )
}


def in_the_standard_library(path: str) -> bool:
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    resolved = Path(path).resolve()
    return resolved.is_relative_to(stdlib) and "site-packages" not in resolved.parts


def test_a_signal_in_a_command_module_is_not_before_the_guard() -> None:
    script = SCRIPTS / "vitrieval-index"
    inside_numpy = (
        "Traceback (most recent call last):\n"
        f'  File "{script}", line 8, in <module>\n'
        f'  File "{REPO / "index/cli/launch.py"}", line 25, in run_command\n'
        f'  File "{REPO / "index/cli/__init__.py"}", line 3, in <module>\n'
        f'  File "{REPO / "index/cli/commands.py"}", line 5, in <module>\n'
        f'  File "{Path(sysconfig.get_paths()["purelib"]) / "numpy/__init__.py"}", line 1\n'
        "KeyboardInterrupt\n"
    )
    assert not before_the_guard(inside_numpy, script)
    in_the_package_start = (
        "Traceback (most recent call last):\n"
        f'  File "{script}", line 3, in <module>\n'
        f'  File "{REPO / "vitrieval/__init__.py"}", line 17, in <module>\n'
        f'  File "{Path(sysconfig.get_paths()["stdlib"]) / "os.py"}", line 1\n'
        "KeyboardInterrupt\n"
    )
    assert before_the_guard(in_the_package_start, script)
