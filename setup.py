"""Maps the repository's top-level folders into the one import package, `vitrieval`.

The checkout keeps `training/`, `index/`, `service/` and `distributed/` at its top level
(the project's layout), and they install as `vitrieval.training`, `vitrieval.index`, ...
beside `vitrieval/` itself: nothing else lands at the top level of site-packages. The rest
of the metadata is in pyproject.toml.
"""

import runpy
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent
FOLDERS = runpy.run_path(str(HERE / "vitrieval" / "_folders.py"))["SUBPACKAGE_FOLDERS"]

packages = ["vitrieval", *find_packages(include=["vitrieval.*"])]
for folder in FOLDERS:
    packages += [f"vitrieval.{name}" for name in find_packages(include=[folder, f"{folder}.*"])]

setup(
    packages=packages,
    package_dir={"vitrieval": "vitrieval", **{f"vitrieval.{f}": f for f in FOLDERS}},
)
