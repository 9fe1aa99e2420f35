#!/usr/bin/env bash
# The wheels the GPU machine lacks (tensordict and its pyvers; the machine has torch,
# Triton and pytest, and reaches no package index), fetched here into .whl/ (kept out
# of git through .git/info/exclude) for the device tool's `carry`: see
# scripts/gpu-figures.sh. Needs pip's index; run from the repository's root. The
# versions are the ones this project's CPU machines run; the GPU machine's python3 is
# 3.12 (the device tool's KINDS.md), both wheels are pure Python.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")"
grep -qxF "/.whl/" "$exclude" 2>/dev/null || echo "/.whl/" >> "$exclude"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "tensordict==${TENSORDICT_VERSION:-0.15.3}" "pyvers==${PYVERS_VERSION:-0.2.3}"
ls -l .whl
# what the device command does with them, tried here once: a clean target folder that
# imports (this machine's own torch stands in for the GPU machine's)
tmp="$(mktemp -d)"
python3 -m pip install -q --no-index --no-deps --target "$tmp" .whl/*.whl
PYTHONPATH="$tmp:$PWD" python3 -c "import tensordict, pyvers, muonfx; print('wheels ok: tensordict', tensordict.__version__)"
rm -rf "$tmp"
