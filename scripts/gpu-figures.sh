#!/usr/bin/env bash
# Every GPU figure issue 11 asks for, in parts that each fit one 10-minute command on a
# lent H100/H200 (no GPU has been lent to this project yet: docs/performance.md lists
# them as not measured). Each part writes its log to $OUT (the device tool's output
# folder) or /tmp/muonfx-gpu-figures, and prints it.
#
#   scripts/gpu-figures.sh tests     # muonfx info; the CUDA, Triton-kernel and compile tests
#   scripts/gpu-figures.sh ns        # Newton-Schulz GFLOP/s against the measured bf16 peak, per shape and route
#   scripts/gpu-figures.sh muon      # Muon step vs torch.optim.Muon: GPT-2 small (12 layers), MoE (8 x 32 experts)
#   scripts/gpu-figures.sh llama     # the same on the Llama-1B-like set (22 layers)
#   scripts/gpu-figures.sh rows      # GPT-2 small with every muonfx row (float32, bf16 standard, auto, Gram)
#   scripts/gpu-figures.sh adamw     # AdamW vs torch fused and foreach, GPT-2 small
#   scripts/gpu-figures.sh memory    # extra step memory per path, Llama-1B-like and 32-expert MoE
#
# The GPU machine has torch, Triton and pytest but no tensordict: bring its wheel and
# pyvers' (the device tool's README, "wheel" section), from this repository's root:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       -d .whl tensordict==0.15.3 pyvers==0.2.3
# and run each part with carry [".whl"] and the command
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && scripts/gpu-figures.sh PART
# (pyvers is pure Python; if pip finds no tensordict wheel for 3.12 there, `python3 -V`
# on the device machine tells which --python-version to ask for.)
set -u -o pipefail

part="${1:-}"
case "$part" in
    tests|ns|muon|llama|rows|adamw|memory) ;;
    *) echo "usage: scripts/gpu-figures.sh tests|ns|muon|llama|rows|adamw|memory" >&2; exit 2 ;;
esac
out="${OUT:-/tmp/muonfx-gpu-figures}"
mkdir -p "$out"
log="$out/$part.log"
export PYTHONPATH="${PYTHONPATH:-}${PYTHONPATH:+:}$PWD"

run() {
    echo "\$ $*" | tee -a "$log"
    "$@" 2>&1 | grep -v "USDT" | tee -a "$log"
    return "${PIPESTATUS[0]}"
}

: > "$log"
case "$part" in
    tests)
        run python3 -m muonfx info
        run python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_triton_ns.py -rs -s
        # the GPU machine's torch (2.11) specialises float hyperparameters: the compiled
        # step's schedule handling, on its own version
        run python3 -m pytest -q -p no:cacheprovider tests/test_compile.py
        ;;
    ns)
        run python3 benchmarks/newton_schulz.py --only speed --device cuda --repeats 5
        ;;
    muon)
        # the default row only: every row compiles its own step before it is timed
        run python3 benchmarks/muon_step.py --device cuda --sets gpt2 --layers 12 --repeats 5 --variants default
        run python3 benchmarks/muon_step.py --device cuda --sets moe32 --repeats 5 --variants default
        ;;
    llama)
        run python3 benchmarks/muon_step.py --device cuda --sets llama1b --repeats 5 --variants default
        ;;
    rows)
        # the other rows (float32, bf16 standard/auto/gram) on GPT-2 small
        run python3 benchmarks/muon_step.py --device cuda --sets gpt2 --layers 12 --repeats 5
        ;;
    adamw)
        run python3 benchmarks/adamw_step.py --device cuda --layers 12 --repeats 7 --fused --compile
        ;;
    memory)
        run python3 benchmarks/step_memory.py --device cuda --sets llama1b,moe32 --layers 2
        ;;
esac
