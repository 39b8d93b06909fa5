"""The search service on Ray Serve against the single-process server: searches/s.

Two servers on loopback over the same model and index: `vitrieval-serve --read-only`
(one process, dynamic batching on) and `vitrieval-serve --ray local --read-only` (a
local Ray cluster started by the command: the embedder, shard and ingress
deployments, one replica each). Per client count (default 1, 4, 16), closed-loop
clients send POST /v1/search (a multipart JPEG, k = 10) for `--warmup` + `--duration`
seconds, the two servers interleaved cell by cell (the order swapped every client
count), with bench/serve_load.py's `run_cell`: req/s, p50/p99 latency, errors, server
CPU ms per request (for Ray: every process of the command's session, the cluster's
processes included). The Ray server's start-up (command to /readyz 200) is timed too.

Without --model/--index, serve_load.py's throwaway pair is built (an untrained `small`
preset, 64 px input, and an index of 300 digits). The table is printed and written as
markdown to --out (default /tmp/ray_serve_doc.md).

Run:  cd bench && ../.venv/bin/python ray_serve.py [--model M.onnx --index DIR]
      [--clients 1,4,16] [--duration 8] [--warmup 2] [--out /tmp/ray_serve_doc.md]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from machine import cpu_model  # bench/machine.py (scripts run from bench/)
from serve_http import HOST, REPO, Server, free_port
from serve_load import build_throwaway, parse_clients, query_jpegs, run_cell

START_TIMEOUT_S = 180.0


class RayServer(Server):
    """`vitrieval-serve --ray local --read-only` in its own session; its CPU is that of
    every process in the session (the driver, Ray's raylet, GCS and workers)."""

    def __init__(self, model: Path, index: Path, logs: Path) -> None:
        self.mode = "ray"
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.command = [
            sys.executable, "-m", "vitrieval.service.cli", "--ray", "local",
            "--model", str(model), "--index", str(index),
            "--host", HOST, "--port", str(self.port), "--read-only", "--log-level", "warning",
        ]  # fmt: skip
        self.log_path = logs / f"server-ray-{self.port}.log"
        self.log = self.log_path.open("w")
        self.process = subprocess.Popen(
            self.command,
            cwd=REPO,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    def cpu_seconds(self) -> float:
        total = 0.0
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == self.process.pid:  # the session id
                total += int(fields[11]) + int(fields[12])
        return total / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(60)
        # what the cluster left in the session (Ray's agents outlive their raylet)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(10)
        self.log.close()


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None or value != value else f"{value:,.{digits}f}"


def table(cells: list[dict[str, Any]], clients: list[int]) -> list[str]:
    lines = [
        "| clients | single req/s | p50 ms | p99 ms | CPU ms/req | Ray Serve req/s | p50 ms "
        "| p99 ms | CPU ms/req | Ray / single | errors single/Ray |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in clients:
        by = {c["mode"]: c for c in cells if c["clients"] == n}
        one, ray = by.get("on"), by.get("ray")
        if not one or not ray:
            continue
        ratio = ray["rps"] / one["rps"] if one["rps"] else float("nan")
        lines.append(
            f"| {n} | {fmt(one['rps'])} | {fmt(one['p50_ms'])} | {fmt(one['p99_ms'])} "
            f"| {fmt(one['server_cpu_ms_per_request'])} | {fmt(ray['rps'])} "
            f"| {fmt(ray['p50_ms'])} | {fmt(ray['p99_ms'])} "
            f"| {fmt(ray['server_cpu_ms_per_request'])} | {ratio:.2f}x "
            f"| {sum(one['errors'].values())}/{sum(ray['errors'].values())} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--index", type=Path)
    parser.add_argument("--clients", type=parse_clients, default=[1, 4, 16])
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("/tmp/ray_serve_doc.md"))
    args = parser.parse_args()
    if (args.model is None) != (args.index is None):
        parser.error("give both --model and --index, or neither")
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="ray_serve_bench_") as tmp:
        folder = Path(tmp)
        model, index = args.model, args.index
        if model is None:
            model, index = build_throwaway(folder, 300)
        jpegs = query_jpegs(32, 256)
        started = time.monotonic()
        ray = RayServer(model, index, folder)
        single = None
        try:
            ray.wait_ready(START_TIMEOUT_S)
            ready_s = {"ray": time.monotonic() - started}
            started = time.monotonic()
            single = Server("on", model, index, folder, [], {})
            single.wait_ready(START_TIMEOUT_S)
            ready_s["on"] = time.monotonic() - started
            print(f"ready after {ready_s['ray']:.1f} s (Ray Serve), {ready_s['on']:.1f} s (single)")
            cells = []
            for i, n in enumerate(args.clients):
                for server in (single, ray) if i % 2 == 0 else (ray, single):
                    cell = asyncio.run(
                        run_cell(server, n, args.warmup, args.duration, jpegs, args.k, "raw")
                    )
                    cells.append(cell)
                    print(
                        f"  {n:>3} clients, {server.mode:>3}: {cell['rps']:7.1f} req/s, "
                        f"p50 {cell['p50_ms']:7.1f} ms, p99 {cell['p99_ms']:7.1f} ms, "
                        f"CPU {cell['server_cpu_ms_per_request']:6.2f} ms/req, "
                        f"errors {sum(cell['errors'].values())}",
                        flush=True,
                    )
        finally:
            ray.stop()
            if single is not None:
                single.stop()
    load_after = os.getloadavg()
    lines = [
        f"{os.cpu_count()} cores of {cpu_model()}, load average {load_before[0]:.2f} before "
        f"and {load_after[0]:.2f} after; {args.warmup:g} s warm-up + {args.duration:g} s "
        f"measured per cell, k = {args.k}, 256 px JPEG queries, model {Path(model).name}:",
        "",
        *table(cells, args.clients),
        "",
        f"From the command to /readyz 200: {ready_s['ray']:.1f} s on Ray Serve (a local "
        f"cluster started), {ready_s['on']:.1f} s for the single-process server.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.write_text(text)
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
