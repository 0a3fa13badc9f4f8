#!/usr/bin/env bash
# The GPU session's checks in one script (issue #27's GPU row, the noise benchmark on CUDA), run on a
# lent machine from the repository root:
#
#     bash benchmarks/gpu_run.sh            # on the GPU machine: wheels in .whl/ (opacus, dp-accounting,
#                                           # dm-tree), everything else from its image; logs under $OUT
#     DRY=1 bash benchmarks/gpu_run.sh      # here, on the CPU, tiny sizes: checks the script itself
#     STAGES="env cuda_tests bert" bash benchmarks/gpu_run.sh   # some stages only (default: all but bert)
#
# Stage ``noise`` measures the seed noise as it runs by default (float32 on CUDA: the Triton kernel
# where Triton is installed); ``noise_torch`` the same mechanisms with CORRNOISE_NO_TRITON=1 (the
# compiled torch ops), for the before/after of that kernel in one session.
#
# Each stage has its own time limit and log, so that one stage's failure leaves the others' results.
set -u
OUT=${OUT:-/tmp/gpu_run}
mkdir -p "$OUT"
if [ -d .whl ] && [ -z "${DRY:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site:src
else
    export PYTHONPATH=src
fi
PY=${PY:-python3}
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
if [ -n "${DRY:-}" ]; then
    DEV=cpu; GPT2="--width 64 --layers 2 --vocab 500"; DIM=1e5; S1="--batch 4 --seq 32"; S2="--batch 2 --seq 64"
else
    DEV=cuda; GPT2="--width 768 --layers 12 --vocab 50257"; DIM=1.24e8; S1="--batch 16 --seq 128"
    S2="--batch 8 --seq 512"
fi
METHODS=plain,private,opacus_ghost,lora_plain,lora_private,lora_opacus_ghost

STAGES=${STAGES:-env cuda_tests step_s128 randn noise noise_torch step_s512}
stage() {  # stage NAME SECONDS COMMAND...: run with a limit, log to $OUT/NAME.log, say how it ended
    local name=$1 limit=$2; shift 2
    case " $STAGES " in *" $name "*) ;; *) return 0 ;; esac
    local start=$SECONDS
    echo "== $name (limit ${limit} s): $*" | tee "$OUT/$name.log"
    timeout "$limit" "$@" 2>&1 | tee -a "$OUT/$name.log"
    echo "== $name: rc ${PIPESTATUS[0]} in $((SECONDS - start)) s" | tee -a "$OUT/$name.log"
}

stage env 60 bash -c "nvidia-smi -L 2>/dev/null; uname -m; nproc; $PY -c 'import torch, transformers, peft, opacus, dp_accounting; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"transformers\", transformers.__version__, \"peft\", peft.__version__, \"opacus\", opacus.__version__)'; $PY -c 'import triton; print(\"triton\", triton.__version__)' || echo no triton"
stage cuda_tests 150 $PY -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_noise_counters.py -k "cuda or triton"
stage noise_tests 90 $PY -m pytest -q -p no:cacheprovider tests/test_noise_counters.py -k "cuda or triton"
stage step_s128 240 $PY benchmarks/bench_hf_step.py --device $DEV --models gpt2 $GPT2 $S1 --reps 10 --rounds 2 \
    --methods $METHODS
stage randn 60 $PY -c "import time, torch; d='$DEV'; x=torch.randn(int($DIM), device=d); ts=[]
for _ in range(10):
    s=time.perf_counter(); x.normal_(); torch.cuda.synchronize() if d == 'cuda' else None; ts.append(time.perf_counter()-s)
print(f'torch normal_ in place, m = {int($DIM)}: {sorted(ts)[5]*1e3:.2f} ms (median of 10)')"
stage noise 120 $PY -m corrnoise.cli bench noise --dim $DIM --steps 10 --device $DEV
stage noise_torch 90 env CORRNOISE_NO_TRITON=1 $PY -m corrnoise.cli bench noise --dim $DIM --steps 10 --device $DEV \
    --mechanisms "dpsgd;bsr:4;dpcgd:0.9;bisr:8"
stage step_s512 150 $PY benchmarks/bench_hf_step.py --device $DEV --models gpt2 $GPT2 $S2 --reps 6 --rounds 2 \
    --methods $METHODS
if [ -n "${DRY:-}" ]; then BERT="--width 64 --layers 2 --vocab 500"; else BERT="--width 768 --layers 12 --vocab 30522"; fi
stage bert 120 $PY benchmarks/bench_hf_step.py --device $DEV --models bert $BERT --bert-ffn 4 $S1 --reps 10 --rounds 2 \
    --methods plain,private,lora_plain,lora_private
# a Llama-style decoder (the family most fine-tuning uses), 12 layers of width 2048, its MLP 3x, half as many
# key/value heads, a 32000-word untied head: 0.7B parameters in float32
if [ -n "${DRY:-}" ]; then LLAMA="--width 64 --layers 2 --vocab 500"; else LLAMA="--width 2048 --layers 12 --vocab 32000"; fi
stage llama 240 $PY benchmarks/bench_hf_step.py --device $DEV --models llama $LLAMA $S1 --reps 6 --rounds 2 \
    --methods plain,private,lora_plain,lora_private
# a mixture of experts with its routers and experts trained (issue #27): Mixtral of 6 layers of width 768,
# 4 experts of 1536, top 2, a 32000-word head
if [ -n "${DRY:-}" ]; then MOE="--width 64 --layers 2 --vocab 500"; else MOE="--width 768 --layers 6 --vocab 32000"; fi
stage moe 150 $PY benchmarks/bench_hf_step.py --device $DEV --models mixtral $MOE $S1 --reps 6 --rounds 2 \
    --methods plain,private,lora_plain,lora_private
# the same BERT step without the Triton noise kernel, and on an older engine given as OLD_SRC (a
# `git archive <commit> src` unpacked there): the before/after of a change in one session
stage bert_notriton 90 env CORRNOISE_NO_TRITON=1 $PY benchmarks/bench_hf_step.py --device $DEV --models bert $BERT \
    --bert-ffn 4 $S1 --reps 10 --rounds 2 --methods plain,private
if [ -n "${OLD_SRC:-}" ]; then
    stage bert_old 90 env PYTHONPATH="${PYTHONPATH/src/$OLD_SRC}" $PY benchmarks/bench_hf_step.py --device $DEV \
        --models bert $BERT --bert-ffn 4 $S1 --reps 10 --rounds 2 --methods plain,private
fi
