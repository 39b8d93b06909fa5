"""Ctrl-C and SIGTERM stop a training command cleanly (training/interrupt.py): the process
exits, its data-loader workers with it, one line says where to resume, and `--resume`
continues from the last checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vitrieval.training import interrupt
from vitrieval.training.interrupt import Interrupted

TRAIN = [sys.executable, "-m", "vitrieval.training.cli"]
REPO = Path(__file__).resolve().parents[1]


# -- the module -----------------------------------------------------------------------


def _signal(signum: int) -> None:
    """Send `signum` to this process's main thread, the one whose handlers run (os.kill
    may wake another thread, and the handler runs a few instructions later)."""
    signal.pthread_kill(threading.main_thread().ident, signum)


@pytest.fixture(autouse=True)
def python_default_handlers():
    """Each test starts from Python's own handlers, as a training command does: another
    library in this test process (Ray's driver, started by the distributed tests)
    installs a SIGTERM handler of its own, which `stop_on_signals` rightly leaves alone.
    The handlers found are put back afterwards."""
    found = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    for signum, handler in found.items():
        if handler is not None:
            signal.signal(signum, handler)


def test_sigterm_raises_interrupted_in_the_block_and_the_default_comes_back():
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    with pytest.raises(Interrupted) as caught, interrupt.stop_on_signals():
        _signal(signal.SIGTERM)
        time.sleep(5)  # the handler raises long before this ends
    assert caught.value.signum == signal.SIGTERM and caught.value.exit_status == 143
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_deferred_holds_the_signal_until_the_block_has_run():
    done = []
    with pytest.raises(Interrupted), interrupt.stop_on_signals():
        with interrupt.deferred():
            _signal(signal.SIGTERM)
            time.sleep(0.2)
            done.append("checkpoint")
            done.append("metrics row")
        done.append("next epoch")  # never reached
    assert done == ["checkpoint", "metrics row"]


class _SignalInDel:
    """Sends SIGTERM from __del__: the handler runs there, and Python drops (prints) the
    exception it raises, as in a fork callback."""

    def __del__(self) -> None:
        _signal(signal.SIGTERM)
        for _ in range(100):  # the handler runs, and raises, in here
            time.sleep(0.01)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_dropped_stop_is_raised_before_the_next_batch():
    seen = []
    with (
        pytest.raises(Interrupted),
        interrupt.stop_on_signals(),
        interrupt.loader_batches(range(5)) as batches,
    ):
        for batch in batches:
            seen.append(batch)
            if batch == 1:
                dropper = _SignalInDel()
                del dropper
                seen.append("went on")
    assert seen == [0, 1, "went on"]


def test_loader_batches_shuts_the_workers_down_however_the_loop_ends():
    from torch.utils.data import DataLoader

    before = _children(os.getpid())
    loader = DataLoader(range(1000), batch_size=2, num_workers=2)
    with pytest.raises(RuntimeError), interrupt.loader_batches(loader) as batches:
        for _ in batches:
            workers = {pid: t for pid, t in _children(os.getpid()).items() if pid not in before}
            raise RuntimeError("the loop fails")
    # `batches` (and the exception) still hold the iterator: its workers are gone anyway
    assert len(workers) == 2
    assert _left(workers) == []
    del batches


def test_a_handler_the_application_installed_is_left_alone():
    calls = []
    previous = signal.signal(signal.SIGTERM, lambda *_: calls.append("theirs"))
    try:
        with interrupt.stop_on_signals():
            _signal(signal.SIGTERM)
            time.sleep(0.2)
        assert calls == ["theirs"]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_resume_line_names_the_checkpoint_and_the_command(tmp_path):
    run = tmp_path / "my run"
    line = interrupt.resume_line(run, "pretrain", signal.SIGTERM)
    assert line == (
        "vitrieval-train pretrain: stopped by SIGTERM before its first checkpoint: nothing "
        "to resume, the same command starts over"
    )
    (run / "checkpoint").mkdir(parents=True)
    (run / "checkpoint" / "state.json").write_text(json.dumps({"epoch": 3, "stage": "finetune"}))
    line = interrupt.resume_line(run, "fit", signal.SIGINT)
    assert line == (
        f"vitrieval-train fit: stopped by Ctrl-C (SIGINT); {run} holds the checkpoint of "
        f"finetune epoch 3: `vitrieval-train fit --out '{run}' --resume` continues it"
    )


def test_exit_status_is_128_plus_the_signal_and_reports_once(capsys):
    reported = Interrupted(signal.SIGTERM, "the line")
    reported.reported = True
    assert interrupt.exit_status("fit", reported) == 143
    assert capsys.readouterr().err == ""
    assert interrupt.exit_status("pretrain", KeyboardInterrupt()) == 130
    assert capsys.readouterr().err == "vitrieval-train pretrain: interrupted\n"


# -- the command line, in a subprocess --------------------------------------------------


def _stat(pid: int) -> tuple[int, str, str] | None:
    """(parent pid, state, start time) of a live process (None: gone or a zombie)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    state, ppid, start = fields[0], int(fields[1]), fields[19]
    return None if state in ("Z", "X") else (ppid, state, start)


def _children(pid: int) -> dict[int, str]:
    """The live child processes of `pid`: {pid: start time}."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat and stat[0] == pid:
                found[int(entry.name)] = stat[2]
    return found


def _left(children: dict[int, str]) -> list[int]:
    """The processes of `children` that still run (same pid and start time)."""
    return [pid for pid, start in children.items() if (_stat(pid) or (0, "", ""))[2] == start]


def _restore_sigint() -> None:
    # a shell's background job ignores SIGINT, and the child would inherit that
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _stop_after_first_checkpoint(command: list[str], run: Path, signum: int, group: bool):
    """Start `command`, wait for its first checkpoint and then for its data-loader workers,
    send `signum` (to the process group, as Ctrl-C in a terminal does, with `group`).
    Returns (completed process, the workers seen, seconds from the signal to the exit)."""
    process = subprocess.Popen(
        command,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=group,
        preexec_fn=_restore_sigint,
    )
    seen: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 300
        state = run / "checkpoint" / "state.json"
        while not state.exists():
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "no checkpoint after 300 s"
            time.sleep(0.2)
        while not seen:  # the next epoch's workers
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "no data-loader workers"
            seen.update(_children(process.pid))
            time.sleep(0.05)
        time.sleep(0.3)  # into the epoch
        seen.update(_children(process.pid))
        sent = time.monotonic()
        if group:
            os.killpg(process.pid, signum)
        else:
            process.send_signal(signum)
        out, err = process.communicate(timeout=120)
        waited = time.monotonic() - sent
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return subprocess.CompletedProcess(command, process.returncode, out, err), seen, waited


def _check_stopped(result, seen, run: Path, command: str, signum: int) -> int:
    """The checks every stop shares; returns the checkpoint's epoch."""
    assert result.returncode == 128 + signum, result.stderr  # 143 SIGTERM, 130 Ctrl-C
    assert "interrupted" not in result.stderr, result.stderr  # the resume line says it all
    assert "Traceback" not in result.stderr, result.stderr
    assert _left(seen) == [], f"data-loader workers left running: {_left(seen)}"
    epoch = json.loads((run / "checkpoint" / "state.json").read_text())["epoch"]
    hint = f"`vitrieval-train {command} --out {run} --resume` continues it"
    lines = [line for line in result.stderr.splitlines() if "--resume" in line]
    assert len(lines) == 1 and lines[0].endswith(hint), result.stderr
    assert f"holds the checkpoint of epoch {epoch}:" in lines[0]
    # the checkpoint and its metrics row were written together
    rows = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(row)["epoch"] for row in rows] == list(range(1, epoch + 1))
    return epoch


@pytest.fixture(scope="module")
def noise_images(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("noise")
    rng = np.random.default_rng(0)
    for i in range(96):
        pixels = (rng.random((32, 32, 3)) * 255).astype(np.uint8)
        Image.fromarray(pixels).save(folder / f"{i:03d}.png")
    return folder


def test_sigterm_stops_pretrain_with_its_workers_and_resume_continues(tmp_path, noise_images):
    run = tmp_path / "run"
    command = [
        *TRAIN,
        "pretrain",
        "--images",
        str(noise_images),
        "--preset",
        "tiny",
        "--epochs",
        "100",
        "--batch-size",
        "8",
        "--workers",
        "2",
        "--out",
        str(run),
    ]
    result, seen, waited = _stop_after_first_checkpoint(command, run, signal.SIGTERM, False)
    assert "stopped by SIGTERM" in result.stderr
    assert len(seen) == 2  # --workers 2
    assert waited < 60
    epoch = _check_stopped(result, seen, run, "pretrain", signal.SIGTERM)

    more = [*TRAIN, "pretrain", "--out", str(run), "--resume", "--epochs", str(epoch + 1)]
    resumed = subprocess.run(more, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming {run} after epoch {epoch}" in resumed.stdout
    assert json.loads((run / "checkpoint" / "state.json").read_text())["epoch"] == epoch + 1


def test_ctrl_c_stops_fit_with_its_workers(tmp_path):
    """SIGINT to the whole process group, workers included, as a terminal's Ctrl-C."""
    run = tmp_path / "run"
    command = [
        *TRAIN,
        "fit",
        "--dataset",
        "digits",
        "--preset",
        "tiny",
        "--epochs",
        "100",
        "--workers",
        "2",
        "--out",
        str(run),
    ]
    result, seen, waited = _stop_after_first_checkpoint(command, run, signal.SIGINT, True)
    assert "stopped by Ctrl-C (SIGINT)" in result.stderr
    assert waited < 60
    _check_stopped(result, seen, run, "fit", signal.SIGINT)


def test_a_missing_training_package_is_one_line(monkeypatch, capsys) -> None:
    """In a serving install (no torch), a training command names the install it needs."""
    import vitrieval.training.cli as cli

    def needs_torch(args) -> int:
        raise ModuleNotFoundError("No module named 'torch'", name="torch")

    parser = cli.build_parser()
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    parser._subparsers._group_actions[0].choices["fit"].set_defaults(handler=needs_torch)
    assert cli.main(["fit", "--out", "unused"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "vitrieval-train fit: error: torch is not installed; training needs "
        "pip install -c constraints.txt -e '.[train,serve]'"
    ]
