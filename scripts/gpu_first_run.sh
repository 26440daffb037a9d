#!/usr/bin/env bash
# The first run on a lent GPU, in one command: every table and the environment in one folder.
#
#   scripts/gpu_first_run.sh                  # CUDA; the folder is $OUT (the device tool's), else bench_results/gpu_first_run
#   scripts/gpu_first_run.sh DIR              # the folder
#   scripts/gpu_first_run.sh --device cpu DIR # the dry run CI makes (small sizes, gloo, the interpreter)
#
# In order, each within its time limit (seconds; ~9.5 minutes in all on CUDA):
#   1. scripts/gpu_check.sh: correctness on the device (configs, a step on FSDP+TP placements, host
#      syncs, the CUDA-only tests; --quick on CPU)                               GPU_CHECK_LIMIT_S=270
#   2. benchmarks/gpu_step.py: Newton–Schulz and optimizer steps against torch.optim.Muon and dion;
#      fails if our kernels failed their first-use check here (--tiny on CPU)  GPU_STEP_LIMIT_S=210
#   3. benchmarks/ns_kernels.py: each product per tile against cuBLAS, the
#      elementwise stages (to check or re-fit the tile rule; --tiny on CPU)     NS_KERNELS_LIMIT_S=90
# Writes environment.txt (nvidia-smi, Python, torch, Triton, CUDA, the git commit and changes,
# dion's), a log and the tables of each part, and summary.txt. dion's source goes on PYTHONPATH
# when found (DION_SRC, else shared/dion, ../shared/dion, third_party/dion: a folder holding
# dion/__init__.py), so gpu_step.py compares against it. Exits non-zero if a correctness check
# failed (gpu_check.sh, or our kernels' first-use check on the GPU), a part failed or ran out of time.
#
# Uses $PYTHON, else .venv/bin/python, else python3 (torch >= 2.10 with the Triton its CUDA wheel
# brings: torch 2.11 + Triton 3.6 on the GPU machines).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

DEVICE=cuda
FOLDER=""
while [ $# -gt 0 ]; do
    case "$1" in
        --device) DEVICE="$2"; shift 2 ;;
        -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
        -*) echo "gpu_first_run.sh: unknown option $1 (use --device cuda|cpu and a folder)" >&2; exit 2 ;;
        *) FOLDER="$1"; shift ;;
    esac
done
FOLDER="${FOLDER:-${OUT:-bench_results/gpu_first_run}}"
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHON
mkdir -p "$FOLDER"
FOLDER="$(cd "$FOLDER" && pwd)"
export PYTHONUNBUFFERED=1
if [ "$DEVICE" = cuda ]; then
    unset TRITON_INTERPRET  # it would run the kernels on the CPU, and they would refuse CUDA tensors
fi

dion_src=""
for candidate in "${DION_SRC:-}" shared/dion ../shared/dion third_party/dion; do
    if [ -n "$candidate" ] && [ -f "$candidate/dion/__init__.py" ]; then
        dion_src="$(cd "$candidate" && pwd)"
        export PYTHONPATH="$dion_src${PYTHONPATH:+:$PYTHONPATH}"
        break
    fi
done

{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "host: $(hostname)"
    echo "device: $DEVICE"
    echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)"
    echo "changes against it:"
    git status --short 2>/dev/null | sed 's/^/  /'
    if [ -n "$dion_src" ]; then
        echo "dion: $dion_src (commit $(git -C "$dion_src" rev-parse HEAD 2>/dev/null || echo unknown))"
    else
        echo "dion: not found (DION_SRC, shared/dion, ../shared/dion, third_party/dion): gpu_step.py runs without it"
    fi
    "$PYTHON" - <<'PY'
import platform, sys
print("python:", sys.version.split()[0], platform.platform())
import torch
print("torch:", torch.__version__, "| CUDA", torch.version.cuda, "| cuDNN", torch.backends.cudnn.version())
try:
    import triton
    print("triton:", triton.__version__)
except ImportError as error:
    print("triton: not importable:", error)
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i}: {p.name}, capability {p.major}.{p.minor}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.1f} GiB")
PY
    if command -v nvidia-smi >/dev/null 2>&1; then
        echo "nvidia-smi:"
        nvidia-smi 2>&1
    else
        echo "nvidia-smi: not on this machine"
    fi
} >"$FOLDER/environment.txt" 2>&1
cat "$FOLDER/environment.txt"
echo "device: $DEVICE, folder: $FOLDER" >"$FOLDER/summary.txt"

failed=()
# Stopped from outside (a caller's own time limit): stop the running part and everything under it
# (timeout passes the signal on to its command's process group) rather than leave it running.
part_pid=""
trap 'if [ -n "$part_pid" ]; then kill -TERM "$part_pid" 2>/dev/null; wait "$part_pid"; fi; exit 143' TERM INT HUP
# part NAME LIMIT CMD...: run CMD within LIMIT seconds, its output in NAME.log, the outcome in summary.txt
part() {
    local name="$1" limit="$2"
    shift 2
    echo "== $name (at most ${limit} s): $*"
    local start=$SECONDS rc=0
    timeout --kill-after=20 "$limit" "$@" >"$FOLDER/$name.log" 2>&1 &
    part_pid=$!
    wait "$part_pid" || rc=$?
    part_pid=""
    local outcome="ok"
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
        outcome="FAILED (out of time after ${limit} s)"
    elif [ "$rc" != 0 ]; then
        outcome="FAILED (exit status $rc)"
    fi
    [ "$outcome" = ok ] || failed+=("$name")
    echo "$name: $outcome, $((SECONDS - start)) s (log: $name.log)" | tee -a "$FOLDER/summary.txt"
    [ "$outcome" = ok ] || tail -20 "$FOLDER/$name.log"
}

if [ "$DEVICE" = cuda ]; then
    part gpu_check "${GPU_CHECK_LIMIT_S:-270}" bash scripts/gpu_check.sh --device cuda --out "$FOLDER/gpu_check"
    # --strict: a kernel that failed its first-use check on this GPU fails the part (the tables are still written)
    part gpu_step "${GPU_STEP_LIMIT_S:-210}" "$PYTHON" benchmarks/gpu_step.py --device cuda --strict --out "$FOLDER/gpu_step.json"
    part ns_kernels "${NS_KERNELS_LIMIT_S:-90}" "$PYTHON" benchmarks/ns_kernels.py --device cuda --out "$FOLDER" --tag cuda
else
    part gpu_check "${GPU_CHECK_LIMIT_S:-600}" bash scripts/gpu_check.sh --device cpu --quick --out "$FOLDER/gpu_check"
    part gpu_step "${GPU_STEP_LIMIT_S:-300}" "$PYTHON" benchmarks/gpu_step.py --device cpu --tiny --warmup 1 --repeats 1 \
        --out "$FOLDER/gpu_step.json"
    part ns_kernels "${NS_KERNELS_LIMIT_S:-300}" "$PYTHON" benchmarks/ns_kernels.py --device cpu --tiny --out "$FOLDER" --tag cpu
fi

echo
if [ ${#failed[@]} -eq 0 ]; then
    echo "gpu_first_run: every part passed on $DEVICE; tables and environment in $FOLDER" | tee -a "$FOLDER/summary.txt"
    exit 0
fi
echo "gpu_first_run: FAILED: ${failed[*]} (logs in $FOLDER)" | tee -a "$FOLDER/summary.txt"
exit 1
