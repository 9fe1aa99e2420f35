#!/usr/bin/env bash
# The wheels a GPU machine without a package index lacks (tensordict and its pyvers;
# torch, Triton and pytest are assumed there), fetched into .whl/ (kept out of git
# through .git/info/exclude) to be copied there with the checkout: see
# scripts/gpu-figures.sh. Needs pip's index; run from the repository's root. The
# versions default to the ones the project's CI runs; the wheels are pure Python, fetched
# for CPython 3.12 (PYTHON_VERSION to change it).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")"
grep -qxF "/.whl/" "$exclude" 2>/dev/null || echo "/.whl/" >> "$exclude"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${PYTHON_VERSION:-3.12}" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "tensordict==${TENSORDICT_VERSION:-0.15.3}" "pyvers==${PYVERS_VERSION:-0.2.3}"
ls -l .whl
# what the device command does with them, tried here once: a clean target folder that
# imports (this machine's own torch stands in for the GPU machine's)
tmp="$(mktemp -d)"
python3 -m pip install -q --no-index --no-deps --target "$tmp" .whl/*.whl
PYTHONPATH="$tmp:$PWD" python3 -c "import tensordict, pyvers, muonfx; print('wheels ok: tensordict', tensordict.__version__)"
rm -rf "$tmp"
