#!/usr/bin/env bash
# Run muonfx's distributed/numerics tests against the OLDEST torch we claim to support,
# in a separate virtualenv, without touching the main environment.
#
# What it proves: with torch==$TORCH_VERSION (default 2.9.0, the oldest pyproject.toml claims) and the newest tensordict
# that still accepts that torch, the FSDP2/DTensor code paths (tests/test_fsdp.py: real
# 2/3/4-rank gloo worlds, HSDP, DCP checkpoints resharded across world sizes;
# tests/test_testing_dtensor.py), numerical parity with torch.optim.Muon/AdamW
# (tests/test_parity.py) and optimizer checkpointing (tests/test_checkpoint.py) all pass.
# Measured (2026-11-25; torch 2.10.0, tensordict 0.14.3), with
# TESTS="tests/test_pieces.py tests/test_executor.py tests/test_memory.py tests/test_leafwise.py
# tests/test_fsdp.py tests/test_parity.py tests/test_checkpoint.py tests/test_compile.py
# tests/test_conformance.py tests/test_faults.py": all pass. torch 2.10's dynamo guards
# float hyperparameters by value, so a compiled step recompiles when lr, momentum or weight
# decay change; the executor detects that first recompilation and steps eagerly from then
# on: tests/test_compile.py passes whole on torch 2.10.0 and 2.11.0 (TORCH_VERSION=2.11.0
# installs the version of the H100 figures in docs/performance.md in a venv of its own). On 2.11.0 (tensordict 0.15.3)
# the TESTS above plus tests/test_triton_ns.py and tests/test_recipes.py passed in 3 min
# 7 s; TESTS="tests" (the whole suite, 4 min 55 s) failed only the two docs blocks that
# import lightning, which this script does not install. On 2.10.0 the whole suite
# (docs pages deselected): 1078 passed, 25 skipped, 8 min 53 s (2026-11-26).
# Earlier: torch 2.10.0, 2.9.1 and 2.9.0 (each with tensordict 0.14.3) pass all 83 (the count when measured);
# torch 2.8.0 does not (DTensor has no sharding rule for aten.clamp_min, used by
# muonfx/transforms/rows.py; HSDP parity off; no torch.optim.Muon), so 2.9 is the floor.
# The repo is NOT pip-installed into the venv: it is put on PYTHONPATH, so this always
# tests the working tree as it is.
#
# How long (measured on 2 shared cores, no GPU): a fresh venv first downloads and installs
# torch (PyPI's Linux wheel is the CUDA build: ~900 MB torch + ~2.5 GB nvidia-* wheels, ~7 GB
# on disk; no GPU is needed, every test here runs on the CPU), ~2-4 min; then the ~85 tests
# take ~1-2 min (test_fsdp.py's spawned gloo worlds dominate). A rerun reusing the venv is
# ~1-2 min in all (pip only checks what is installed).
#
# Usage:
#   scripts/test-oldest-torch.sh                       # torch 2.9.0 in ~/.cache/muonfx-torch29
#   VENV=/work/venvs/torch210 scripts/test-oldest-torch.sh
#   TORCH_VERSION=2.9.1 VENV=~/.cache/muonfx-torch29 scripts/test-oldest-torch.sh
#   scripts/test-oldest-torch.sh -x -k parity          # extra args go to pytest
#
# Environment knobs:
#   VENV            virtualenv path (created if missing, reused otherwise)
#   TORCH_VERSION   torch to install (default 2.9.0, the oldest pyproject.toml claims)
#   TENSORDICT_SPEC tensordict requirement (default: let pip pick the newest tensordict
#                   compatible with the pinned torch; tensordict>=0.15 requires torch>=2.11,
#                   so for torch 2.10 this resolves to tensordict 0.14.3)
#   PYTHON          interpreter used to create the venv (default python3)
#   TESTS           test files to run (default: the four files listed above)
#
# Exit status: pytest's (0 = all passed), or non-zero if the install fails.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$HOME/.cache/muonfx-torch29}"
TORCH_VERSION="${TORCH_VERSION:-2.9.0}"
TENSORDICT_SPEC="${TENSORDICT_SPEC:-tensordict}"
PYTHON="${PYTHON:-python3}"
TESTS="${TESTS:-tests/test_fsdp.py tests/test_testing_dtensor.py tests/test_parity.py tests/test_checkpoint.py}"

if [[ ! -x "$VENV/bin/python" ]]; then
    echo ">> creating venv $VENV"
    "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
export PIP_DISABLE_PIP_VERSION_CHECK=1

# Pin torch in the same resolve as everything else, so pip can never upgrade it and picks
# a tensordict whose metadata accepts this torch.
echo ">> installing torch==$TORCH_VERSION, $TENSORDICT_SPEC and test deps into $VENV"
"$PY" -m pip install -q "torch==$TORCH_VERSION" "$TENSORDICT_SPEC" numpy hypothesis pytest pytest-xdist

# Refuse to test anything but the requested torch (e.g. a reused venv with another one).
"$PY" - "$TORCH_VERSION" <<'EOF'
import sys
import torch, tensordict
want = sys.argv[1]
have = torch.__version__.split("+")[0]
print(f">> torch {torch.__version__}  tensordict {tensordict.__version__}  "
      f"python {sys.version.split()[0]}  cuda available: {torch.cuda.is_available()}")
if have != want:
    sys.exit(f"!! venv has torch {torch.__version__}, wanted {want}")
EOF

cd "$REPO"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export ONEDNN_MAX_CPU_ISA="${ONEDNN_MAX_CPU_ISA:-AVX512_CORE_BF16}"
# muonfx must come from the working tree, not from some installed copy
"$PY" -c "import muonfx, os, sys; p = os.path.dirname(muonfx.__file__); print('>> muonfx from', p); \
sys.exit(0 if p.startswith(os.path.realpath('$REPO')) else 'muonfx is not the working tree')"

echo ">> $PY -m pytest -q -p no:cacheprovider $TESTS $*"
set +e
# shellcheck disable=SC2086
"$PY" -m pytest -q -p no:cacheprovider $TESTS "$@"
rc=$?
set -e
echo ">> pytest exit status $rc (torch $TORCH_VERSION)"
exit $rc
