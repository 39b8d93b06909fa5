"""Requirement lists for the Docker images, generated from pyproject.toml.

pyproject.toml stays the one place where dependencies are declared. Its base set names
`onnxruntime` and `faiss-cpu`, so that `pip install vitrieval` (and the Makefile's
`pip install -e '.[train,serve,dev]'`) works on any CPU machine. A GPU serving image
must not carry them: `onnxruntime` and `onnxruntime-gpu` both install the
`onnxruntime` module and overwrite each other's files (ONNX Runtime's instructions:
uninstall one before installing the other), and `faiss-cpu` and `faiss-gpu` both
install `faiss`. So the images install the project's wheel with `--no-deps` and its
dependencies from the list this script prints, where the GPU runtime swaps
`onnxruntime` for `onnxruntime-gpu` and `faiss-cpu` for a GPU FAISS wheel, keeping
the version bounds. Extras `cpu` / `gpu` would have done the same only by taking
onnxruntime and faiss out of the base set, which would break every plain install.

    python docker/requirements.py serve --runtime cpu     # base + [serve]
    python docker/requirements.py serve --runtime gpu     # same, GPU builds swapped in
    python docker/requirements.py train                   # base + [train]
    python docker/requirements.py sizes [--gpu-wheels DIR]

`sizes` estimates each image's installed Python packages from the environment that
runs it (the sizes of the files in each distribution's RECORD, dependencies followed
transitively); `--gpu-wheels DIR` adds the GPU swaps from wheels downloaded there
(`pip download onnxruntime-gpu faiss-gpu -d DIR`), sized by their unpacked contents.

Standard library only (the Dockerfile's builder stage runs it on a bare Python);
`sizes` also needs `packaging`, which any environment with pip-installed
dependencies has.
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
import zipfile
from collections.abc import Iterable, Sequence
from importlib import metadata
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
RUNTIMES = ("cpu", "gpu")
FAISS_GPU = "faiss-gpu"
"""Meta's own GPU wheel (same version line as faiss-cpu, CUDA 12 libraries from pip,
native code for compute capability 7.0-9.0). faiss-gpu-cu12 also works up to 8.9."""

# base-set distributions that have a GPU build of the same module
GPU_SWAPS = {"onnxruntime": "onnxruntime-gpu", "faiss-cpu": FAISS_GPU}

_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def canonical(name: str) -> str:
    """PEP 503 name: lower case, runs of -_. as one dash."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    match = _NAME.match(requirement)
    if not match:
        raise ValueError(f"cannot read a package name from {requirement!r}")
    return canonical(match.group(1))


def load_project(pyproject: Path = PYPROJECT) -> dict:
    with open(pyproject, "rb") as fh:
        return tomllib.load(fh)["project"]


def requirements(
    project: dict,
    extras: Sequence[str] = (),
    runtime: str = "cpu",
    faiss_gpu: str = FAISS_GPU,
) -> list[str]:
    """The base dependencies plus `extras`, with the GPU builds swapped in for "gpu"."""
    if runtime not in RUNTIMES:
        raise ValueError(f"runtime must be one of {', '.join(RUNTIMES)}, not {runtime!r}")
    optional = project.get("optional-dependencies", {})
    unknown = [extra for extra in extras if extra not in optional]
    if unknown:
        raise ValueError(f"unknown extra(s) {unknown}; pyproject.toml has {sorted(optional)}")
    lines = list(project["dependencies"])
    for extra in extras:
        lines += optional[extra]
    if runtime == "gpu":
        swaps = {**GPU_SWAPS, "faiss-cpu": faiss_gpu}
        lines = [_swap(line, swaps) for line in lines]
    return lines


def _swap(line: str, swaps: dict[str, str]) -> str:
    match = _NAME.match(line)
    assert match is not None  # requirement_name has vetted every line
    name = canonical(match.group(1))
    return swaps[name] + line[match.end() :] if name in swaps else line


# -- size estimate ---------------------------------------------------------------------


def _distribution(name: str) -> metadata.Distribution | None:
    try:
        return metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return None


def closure(roots: Iterable[str]) -> tuple[dict[str, metadata.Distribution], list[str]]:
    """Installed distributions needed by requirement lines `roots` (transitively, markers
    evaluated for this interpreter), and the names that are not installed here."""
    from packaging.requirements import Requirement

    found: dict[str, metadata.Distribution] = {}
    missing: list[str] = []
    todo = [(Requirement(line), "") for line in roots]
    while todo:
        requirement, extra = todo.pop()
        if requirement.marker and not requirement.marker.evaluate({"extra": extra}):
            continue
        name = canonical(requirement.name)
        if name in found:
            continue
        dist = _distribution(name)
        if dist is None:
            missing.append(name)
            continue
        found[name] = dist
        for wanted in ["", *requirement.extras]:
            todo += [(Requirement(line), wanted) for line in dist.requires or []]
    return found, sorted(set(missing))


def installed_size(dist: metadata.Distribution) -> int:
    """Bytes of the files the distribution's RECORD lists (what pip installed)."""
    total = 0
    for file in dist.files or []:
        try:
            total += file.locate().stat().st_size
        except OSError:
            continue
    return total


def wheel_sizes(folder: Path) -> dict[str, int]:
    """Unpacked bytes of every wheel in `folder`, by canonical distribution name."""
    sizes = {}
    for wheel in sorted(folder.glob("*.whl")):
        with zipfile.ZipFile(wheel) as archive:
            sizes[canonical(wheel.name.split("-")[0])] = sum(
                info.file_size for info in archive.infolist()
            )
    return sizes


def _mb(size: int) -> str:
    return f"{size / 2**20:8.0f} MB"


def report_sizes(gpu_wheels: Path | None = None, top: int = 12) -> str:
    project = load_project()
    lines = []
    sets = {
        "serve (cpu)": requirements(project, ["serve"], "cpu"),
        "train": requirements(project, ["train"], "cpu"),
    }
    totals = {}
    serve_dists: dict[str, metadata.Distribution] = {}
    for label, roots in sets.items():
        dists, missing = closure(roots)
        sizes = {name: installed_size(dist) for name, dist in dists.items()}
        totals[label] = sum(sizes.values())
        if label == "serve (cpu)":
            serve_dists = dists
        lines.append(f"{label}: {len(dists)} distributions, {_mb(totals[label]).strip()}")
        for name, size in sorted(sizes.items(), key=lambda kv: -kv[1])[:top]:
            lines.append(f"  {name:32s} {dists[name].version:14s} {_mb(size)}")
        if missing:
            lines.append(f"  not installed here (not counted): {', '.join(missing)}")
    if gpu_wheels is not None:
        wheels = wheel_sizes(gpu_wheels)
        swapped_out = sum(installed_size(serve_dists[n]) for n in GPU_SWAPS if n in serve_dists)
        # the GPU wheels and their own dependencies, less what the CPU set already has
        added = {n: s for n, s in wheels.items() if n not in serve_dists}
        gpu_total = totals["serve (cpu)"] - swapped_out + sum(added.values())
        lines.append(f"serve (gpu): {_mb(gpu_total).strip()} (wheels in {gpu_wheels})")
        for name, size in sorted(added.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {name:32s} {'(wheel)':14s} {_mb(size)}")
        lines.append(f"  less {', '.join(GPU_SWAPS)}: -{_mb(swapped_out).strip()}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="image", required=True)
    serve = sub.add_parser("serve", help="base + [serve]")
    serve.add_argument("--runtime", choices=RUNTIMES, default="cpu")
    serve.add_argument("--faiss-gpu", default=FAISS_GPU, help="GPU FAISS distribution")
    sub.add_parser("train", help="base + [train]")
    sizes = sub.add_parser("sizes", help="estimated installed size of each image's packages")
    sizes.add_argument("--gpu-wheels", type=Path, help="folder of downloaded GPU wheels")
    args = parser.parse_args(argv)
    if args.image == "sizes":
        print(report_sizes(args.gpu_wheels))
        return 0
    project = load_project()
    if args.image == "serve":
        lines = requirements(project, ["serve"], args.runtime, args.faiss_gpu)
    else:
        lines = requirements(project, ["train"], "cpu")
    for line in lines:
        requirement_name(line)  # fail loudly on a line this script cannot read
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
