#!/usr/bin/env bash
# Every GPU figure of docs/performance.md, measured on one CUDA machine (H100/H200).
#
# `all` runs every figure in one command, most wanted first, inside one deadline
# (FIGURES_BUDGET_S, default 480 s), so that a GPU rented for a few minutes gives the
# most it can: a step that would outlast the deadline is stopped, those after it are
# skipped, and the log says so. The single parts below rerun one group each.
#
# What cost the time on an H100 (2026-11-26, a run of `all` that did not fit) and what changed:
# the optimizer timed eager against compiled steps before keeping one (six or more extra
# steps, a whole-model graph compiled and then one graph per piece), measured the extra
# memory of its first compiled step, and timed the Triton kernels against torch's products
# on the first batch of every shape (autotuning the kernels); the benchmarks drew every
# value on the CPU (two billion for Llama-1B and MoE). Now paths come from rules (a
# compiled group compiles once, at its first step, its pieces' graphs only), nothing is
# measured, Triton is off unless asked for, and values are drawn on the GPU. Nothing is
# compiled unless asked (the default path is eager, AdamW groups in torch's fused kernel),
# so no step of `all` waits for a compiler. The CUDA test
# step runs the GPU-marked tests of tests/test_cuda.py and tests/test_fused_catalogue.py without the slow compile sweeps
# (`-m "cuda and not slow"`); the Triton-interpreter tests (tests/test_triton_ns.py) run
# in the CPU suite, and with everything else in the `tests` part.
#
#   scripts/gpu-figures.sh all       # info; Muon Llama-1B, MoE, GPT-2 default rows (extra memory too); first step; CUDA tests; AdamW; NS
#   scripts/gpu-figures.sh first     # time to the first step and steady step of the hybrid optimizer vs torch's pair
#   scripts/gpu-figures.sh tests     # muonfx info; every CUDA, Triton-kernel and compile test
#   scripts/gpu-figures.sh ns        # Newton-Schulz GFLOP/s against the measured bf16 peak, per shape and route
#   scripts/gpu-figures.sh muon      # Muon step vs torch.optim.Muon: GPT-2 small (12 layers), MoE (8 x 32 experts)
#   scripts/gpu-figures.sh llama     # the same on the Llama-1B-like set (22 layers)
#   scripts/gpu-figures.sh rows      # GPT-2 small with every muonfx row (float32, bf16 standard, auto, Gram)
#   scripts/gpu-figures.sh adamw     # AdamW vs torch fused and foreach, GPT-2 small
#   scripts/gpu-figures.sh memory    # extra step memory per path, Llama-1B-like and 32-expert MoE
#   scripts/gpu-figures.sh host      # host cost: Python calls and time against torch.optim.Muon (CPU-side)
#
# Each part writes its log to $OUT (when set) or /tmp/muonfx-gpu-figures as PART.log,
# and the table rows and test results of it as PART.summary.txt.
#
# A GPU machine without a package index and without tensordict: fetch its wheel and
# pyvers' where pip reaches an index, from this repository's root:
#   scripts/gpu-wheels.sh
# copy the checkout with .whl/ to the GPU machine and run there
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && scripts/gpu-figures.sh all
set -u -o pipefail

part="${1:-}"
case "$part" in
    all|tests|ns|muon|llama|rows|adamw|memory|host|first) ;;
    *) echo "usage: scripts/gpu-figures.sh all|tests|ns|muon|llama|rows|adamw|memory|host|first" >&2; exit 2 ;;
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

# all: one deadline for every step; a step gets at most CAP seconds and what is left
budget="${FIGURES_BUDGET_S:-480}"
min_step="${FIGURES_MIN_STEP_S:-20}"  # no step is started with less than this left
worst=0  # all's exit status: 1 once a step failed, was stopped or was skipped
deadline=$(( $(date +%s) + budget ))
step() {  # step CAP command...
    local cap=$1 left
    shift
    left=$(( deadline - $(date +%s) ))
    if (( left < min_step )); then
        echo "skipped, the budget is spent: $*" | tee -a "$log"
        worst=1
        return 0
    fi
    (( cap > left )) && cap=$left
    run timeout -k 10 "$cap" "$@"
    local rc=$?
    (( rc != 0 )) && worst=1
    if (( rc == 124 || rc == 137 )); then
        echo "stopped after ${cap} s (its share of the ${budget} s budget): $*" | tee -a "$log"
    elif (( rc != 0 )); then
        echo "exit status $rc: $*" | tee -a "$log"
    fi
    return 0
}

: > "$log"
export PYTHONUNBUFFERED=1  # a stopped step's output so far reaches the log
case "$part" in
    all)
        step 40 python3 -m muonfx info
        # the targets, most wanted first: Muon <= 0.65x torch.optim.Muon on the Llama-1B-like
        # set, extra step memory <= 1 GiB there and on the 32-expert MoE, <= 0.3x on GPT-2
        step 170 python3 benchmarks/muon_step.py --device cuda --sets llama1b --repeats 5 --variants default
        step 130 python3 benchmarks/muon_step.py --device cuda --sets moe32 --repeats 5 --variants default
        step 80 python3 benchmarks/muon_step.py --device cuda --sets gpt2 --layers 12 --repeats 5 --variants default
        # time to the first step: the hybrid optimizer against torch.optim.Muon + AdamW(fused=True)
        step 60 python3 benchmarks/first_step.py --device cuda --sets gpt2,moe
        # whether the CUDA paths compute what they should (GPU-marked tests, no compile sweeps)
        step 110 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_fused_catalogue.py -m "cuda and not slow" -rs --durations=8
        step 50 python3 benchmarks/adamw_step.py --device cuda --layers 12 --repeats 7 --fused --host
        step 90 python3 benchmarks/newton_schulz.py --only speed --device cuda --repeats 5
        ;;
    tests)
        run python3 -m muonfx info
        run python3 -m pytest -q -p no:cacheprovider -m "slow or not slow" tests/test_cuda.py tests/test_fused_catalogue.py tests/test_triton_ns.py -rs -s
        # the GPU machine's torch (2.11) specialises float hyperparameters: the compiled
        # step's schedule handling, on its own version
        run python3 -m pytest -q -p no:cacheprovider -m "slow or not slow" tests/test_compile.py
        ;;
    first)
        run python3 benchmarks/first_step.py --device cuda --sets gpt2,moe --rounds 2
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
        run python3 benchmarks/adamw_step.py --device cuda --layers 12 --repeats 7 --fused --host --compile
        ;;
    memory)
        run python3 benchmarks/step_memory.py --device cuda --sets llama1b,moe32 --layers 2
        ;;
    host)
        run python3 benchmarks/host_cost.py
        ;;
esac
status=$?
[[ "$part" == all ]] && status=$worst
# the tables' rows, the tests' tallies and every stop or skip, for a quick read
grep -E '^\||^[0-9]+ (passed|failed)|passed|failed|^(FAILED|ERROR)|^skipped, |^stopped after |^exit status |Error' "$log" \
    > "$out/$part.summary.txt" || true
exit "$status"
