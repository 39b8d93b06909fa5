"""A real `vitrieval-serve` on a CPU host: its start-up log says once that there is no
GPU, and Ctrl-C (SIGINT) stops it quietly after its clean shutdown."""

from __future__ import annotations

import signal

import faiss
import httpx
import onnxruntime as ort
from serving import Server


def test_start_says_no_gpu_once_and_ctrl_c_exits_quietly(digits_gallery, served_index) -> None:
    server = Server(digits_gallery["model"], served_index, "--read-only", "--log-level", "info")
    with server:
        assert httpx.get(f"{server.url}/readyz", timeout=5).status_code == 200
        server.process.send_signal(signal.SIGINT)
        code = server.process.wait(30)
    log = server.output()
    assert code in (0, 130), log
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log
    assert "Application shutdown complete" in log, log  # the clean shutdown did run
    if "CUDAExecutionProvider" in ort.get_available_providers() or faiss.get_num_gpus():
        return  # a GPU host says which GPU it uses instead (tests/test_gpu.py)
    gpu_lines = [line for line in log.splitlines() if "GPU" in line or "CUDA" in line]
    assert len(gpu_lines) == 1, gpu_lines
    assert " INFO " in gpu_lines[0] and "onnxruntime: " in gpu_lines[0], gpu_lines
    assert "FAISS: " in gpu_lines[0], gpu_lines
    assert "pyvips" not in log, log
