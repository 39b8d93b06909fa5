#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py) on a host with torch but none of vitrieval's
# installs: wheels brought in WHEELS (default .whl/, e.g. faiss-cpu) go into a target
# folder first, the repository goes on PYTHONPATH, every part's JSON lands in OUT.
#   bench/gpu_check.sh OUT [gpu_check.py options]      (WHEELS=dir to change the folder)
set -u
out=${1:?usage: bench/gpu_check.sh OUT [gpu_check.py options]}
shift
repo=$(cd "$(dirname "$0")/.." && pwd)
wheels=${WHEELS:-$repo/.whl}
python=${PYTHON:-python3}
mkdir -p "$out"
if compgen -G "$wheels/*.whl" >/dev/null; then
    site=$(mktemp -d)
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target "$site" "$wheels"/*.whl || exit 1
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$repo:$repo/bench${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
cd "$repo" && exec "$python" bench/gpu_check.py --out "$out" "$@"
