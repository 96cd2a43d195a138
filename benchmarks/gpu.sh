#!/usr/bin/env bash
# One GPU session's checks, in order of what they prove: the CUDA tests (`pytest -m gpu`), the
# scorer against the naive baseline and the bound (presets small, qwen3-30b-a3b, short), the
# trainer's step on Qwen3-30B-A3B's shape, and the kernel paths' numerics. Each step's log lands in
# OUTDIR; each step gets at most its own limit and what is left of BUDGET seconds, so a step that
# hangs or compiles for ever costs its own figures and not the later steps'.
#
#   benchmarks/gpu.sh OUTDIR [BUDGET_SECONDS]
#
# STEPS="name name ..." runs only those steps (a session that measured the rest earlier).
#
# PYTHON picks the interpreter (default: .venv-gpu/bin/python, else python3). It needs the
# project's dependencies importable; `make test-gpu` builds such a venv where a package index is
# reachable. JAX stays off the GPU (bm25s imports it where installed). A GPU image with torch,
# transformers, Triton and pytest but no package index (the lent H100 of 2026-11-26) lacked these,
# carried as cp312 wheels on PYTHONPATH: fastapi, starlette, anyio, pydantic, pydantic-core,
# pydantic-settings, python-dotenv, typing-extensions, typing-inspection, annotated-types,
# annotated-doc, opentelemetry-api, redis, sniffio, bm25s, json-repair, pytest-asyncio.
# The DeepSpeed test also wants deepspeed (a wheel built with DS_BUILD_OPS=0) and hjson, the
# `deepspeed` launcher beside the interpreter, and the wheels on sys.path through a .pth file: the
# test gives the launcher's workers a PYTHONPATH of its own.
set -u
out=${1:?usage: benchmarks/gpu.sh OUTDIR [BUDGET_SECONDS]}
budget=${2:-540}
mkdir -p "$out"
cd "$(dirname "$0")/.."
py=${PYTHON:-$([ -x .venv-gpu/bin/python ] && echo .venv-gpu/bin/python || echo python3)}
export JAX_PLATFORMS=cpu PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
deadline=$((SECONDS + budget))

step() {  # step NAME LIMIT COMMAND...
    local name=$1 limit=$2
    shift 2
    [[ -n ${STEPS:-} && " $STEPS " != *" $name "* ]] && return
    local left=$((deadline - SECONDS))
    ((left < limit)) && limit=$left
    if ((limit < 20)); then
        echo "== $name: skipped, ${left}s of the budget left" | tee -a "$out/summary.txt"
        return
    fi
    echo "== $name (limit ${limit}s): $*"
    local t0=$SECONDS
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc $rc in $((SECONDS - t0))s" | tee -a "$out/summary.txt"
    tail -n 25 "$out/$name.log"
}

{
    date -u
    git log -1 --format='commit %H' 2>/dev/null
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    "$py" -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
    "$py" -c "import deepspeed; print('deepspeed', deepspeed.__version__)" 2>/dev/null || echo "deepspeed: not importable"
} 2>&1 | tee "$out/summary.txt"

# Steps in the order of the goals they measure (issue 26): ours against naive on `small` and
# `short` (>= 3x) and against the bound on `qwen3-30b-a3b` (>= 0.95), then the numerics and the
# trainer, then the CUDA tests (they passed on two earlier sessions: 57 and 70 s on an H100). Each
# packed preset meets two static flex lengths, so ours' warm-up is two compiles (2026-11-26 and
# -27 it never finished: Triton compiled create_block_mask's kernel, which the scorer no longer
# uses). Each scorer step prints every method's result as it ends, so a step cut short keeps what
# it measured, and keeps each method's stderr (stages, recompiles, a stack dump just before a
# method's timeout) in OUTDIR/scorer-PRESET/METHOD.log.
step scorer-small 180 env TORCH_LOGS=recompiles "$py" benchmarks/scorer.py --preset small \
    --methods ours,naive,bound --method-timeout 120 --profile 25 --logs "$out/scorer-small"
# `small` misses its 3x on an H200 at the default budget (three forwards) and meets it with one
# forward of the whole workload (2026-11-28): the GPU waits on kernel launches there, which
# --profile's busy-time line shows.
step scorer-small-64k 120 env TORCH_LOGS=recompiles "$py" benchmarks/scorer.py --preset small --methods ours,naive \
    --budget 65536 --method-timeout 60 --profile 25 --logs "$out/scorer-small-64k"
step scorer-qwen3 200 env TORCH_LOGS=recompiles "$py" benchmarks/scorer.py --preset qwen3-30b-a3b \
    --methods ours,bound,bound-packed,ours-chunked --method-timeout 90 --logs "$out/scorer-qwen3"
# The same shape by budget: one forward of 64K tokens against the default's nine (2026-11-28).
step scorer-qwen3-64k 100 env TORCH_LOGS=recompiles "$py" benchmarks/scorer.py --preset qwen3-30b-a3b \
    --methods ours,bound --budget 65536 --method-timeout 90 --logs "$out/scorer-qwen3-64k"
step scorer-short 140 env TORCH_LOGS=recompiles "$py" benchmarks/scorer.py --preset short \
    --methods ours,naive,bound --method-timeout 60 --logs "$out/scorer-short"
step numerics 60 "$py" benchmarks/scorer_numerics.py
step trainer-qwen3 90 "$py" benchmarks/trainer.py --preset qwen3-30b-a3b --parts 1
step trainer-qwen3-64k 200 "$py" benchmarks/trainer.py --preset qwen3-30b-a3b --parts 2
step tests 180 "$py" -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py tests/test_deepspeed.py
