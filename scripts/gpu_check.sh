#!/usr/bin/env bash
# The GPU checks in one run, for a session lent a GPU machine (CONTRIBUTING.md, "GPU sessions"):
# versions, the GPU tests, the README loop against a raw loop (bench/bench_gpu.py), and, given a
# nanoGPT checkout, the main example's model at GPT-2-124M shapes against nanoGPT's train.py.
#
#   bash scripts/gpu_check.sh [NANOGPT_DIR [bench_gpu.py flags for the nanoGPT run...]]
#   PARTS=nanogpt bash scripts/gpu_check.sh NANOGPT_DIR     # one part again
#
# Parts: versions, gpu_tests, llama, nanogpt (the last only with NANOGPT_DIR); PARTS picks some
# (comma-separated). Output goes to the terminal and to $OUT (the device tool's folder), else
# bench/out/. Sized for one 10-minute device call (at most 560 s in all): each part has its
# own time limit, and a failing part does not stop the next. Exit status: the number of parts
# that failed.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
out="${OUT:-bench/out}"
mkdir -p "$out"
py=python3
failed=0

parts=",${PARTS:-versions,gpu_tests,llama,nanogpt},"

part() {  # part NAME SECONDS COMMAND...: run it with a limit, keep its output in $out/NAME.txt
    local name=$1 limit=$2
    shift 2
    [[ $parts == *",$name,"* ]] || return 0
    echo "== $name (at most ${limit}s): $*"
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$out/$name.txt"
    local rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || { echo "== $name failed: exit $rc"; failed=$((failed + 1)); }
}

part versions 30 "$py" -c "import sys, torch, transformers, ftrain
print(sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__,
      'ftrain', ftrain.__version__)
print(torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device')"
part gpu_tests 60 "$py" -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_kernels_gpu.py
part llama 70 "$py" bench/bench_gpu.py --rounds 2 --memory-rounds 1
if [ $# -ge 1 ]; then
    nanogpt=$1
    shift
    part nanogpt 400 "$py" bench/bench_gpu.py --nanogpt "$nanogpt" --rounds 2 --iters 40 \
        --warmup 10 --sides nanogpt,ftrain,ftrain+divide,raw "$@"
fi
echo "== $failed part(s) failed; outputs in $out/"
exit "$failed"
