#!/usr/bin/env bash
# Validate the optimizer on a machine with CUDA GPUs, in one command:
#
#   scripts/gpu_check.sh                   # --device cuda: NCCL, every GPU of the machine
#   scripts/gpu_check.sh --device cpu      # the same checks on CPU/gloo (CI runs this form)
#   scripts/gpu_check.sh --quick           # fewer configs and benchmark sizes
#   scripts/gpu_check.sh --out DIR         # where logs, traces and results go (default bench_results/gpu_check)
#
# 1. the mesh-config matrix under torchrun, each config checked against single-device
#    Muon fed the same gradients, with the Newton–Schulz compute dtype fp32 and bf16;
# 2. one step on FSDP+TP-style placements (scripts/gpu_check_step.py): equal to
#    single-device Muon, no host synchronisation beyond the agreement's one read (CUDA:
#    torch.cuda.set_sync_debug_mode), and a profiler trace of a step with the time its
#    all-to-alls overlapped Newton–Schulz;
# 3. the step-time and Newton–Schulz benchmarks on the device.
#
# Uses $PYTHON, else .venv/bin/python (scripts/install.sh test,bench makes it), else python3.
# Exits non-zero if any check fails; the summary says which.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

DEVICE=cuda
QUICK=0
OUT=bench_results/gpu_check
while [ $# -gt 0 ]; do
    case "$1" in
        --device) DEVICE="$2"; shift 2 ;;
        --quick) QUICK=1; shift ;;
        --out) OUT="$2"; shift 2 ;;
        *) echo "gpu_check.sh: unknown argument $1 (use --device cuda|cpu, --quick, --out DIR)" >&2; exit 2 ;;
    esac
done
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
mkdir -p "$OUT"
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1

if [ "$DEVICE" = cuda ]; then
    NPROC=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')
    if [ "$NPROC" -lt 1 ]; then
        echo "gpu_check.sh: no CUDA device visible; run with --device cpu" >&2
        exit 2
    fi
else
    NPROC=4
fi
"$PYTHON" -c "import torch; print('torch', torch.__version__, '| device $DEVICE x $NPROC')" | tee "$OUT/summary.txt"

failed=()
run() {  # run NAME CMD...: log to $OUT/NAME.log, record the outcome
    local name="$1"; shift
    echo "== $name: $*"
    if "$@" >"$OUT/$name.log" 2>&1; then
        echo "$name: ok" | tee -a "$OUT/summary.txt"
    else
        failed+=("$name")
        echo "$name: FAILED (log: $OUT/$name.log)" | tee -a "$OUT/summary.txt"
        tail -20 "$OUT/$name.log"
    fi
}
torchrun() { "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$1" "${@:2}"; }

# 1. the config matrix against single-device Muon, fp32 and bf16 Newton–Schulz
CONFIGS=(configs/*.toml)
[ "$QUICK" = 1 ] && CONFIGS=(configs/fsdp_tp.toml)
for cfg in "${CONFIGS[@]}"; do
    n=$("$PYTHON" -c "import sys; sys.path.insert(0, '.'); from examples.config import config_world_size; print(config_world_size('$cfg'))")
    if [ "$n" -gt "$NPROC" ]; then echo "== skip $cfg: needs $n ranks, $NPROC available" | tee -a "$OUT/summary.txt"; continue; fi
    name=$(basename "$cfg" .toml)
    for dtype in fp32 bf16; do
        run "config_${name}_${dtype}" torchrun "$n" examples/train.py --config "$cfg" --check --steps 6 \
            --device "$DEVICE" --compute-dtype "$dtype"
    done
done

# 2. one step: agreement, host syncs, overlap trace
run step_checks torchrun "$NPROC" scripts/gpu_check_step.py --device "$DEVICE" --out "$OUT"

# 2b. the tests that need CUDA (skipped on CPU): flex_attention's max scores
if [ "$DEVICE" = cuda ]; then
    run cuda_tests "$PYTHON" -m pytest -q tests/qk_clip/test_max_logits.py
fi

# 3. benchmarks on the device
if [ "$QUICK" = 1 ] && [ "$DEVICE" = cpu ]; then
    # CI's form (tests/end_to_end/test_gpu_check_script.py): the benchmark's code end to end on
    # 4 gloo ranks sharing 2 cores, so the smallest model that still has every variant and one
    # timed step after the warm-up (the "whole" variant reads the warm-up's stats).
    run step_time torchrun "$NPROC" benchmarks/step_time.py --steps 1 --dim 128 --ffn-dim 256 --layers 2 --out "$OUT"
    run ns_efficiency "$PYTHON" benchmarks/ns_efficiency.py --device "$DEVICE" --repeats 1 --shapes 256x256,256x1024,2x128x512 --out "$OUT"
elif [ "$QUICK" = 1 ]; then
    run step_time torchrun "$NPROC" benchmarks/step_time.py --steps 2 --dim 256 --ffn-dim 512 --layers 2 --out "$OUT"
    run ns_efficiency "$PYTHON" benchmarks/ns_efficiency.py --device "$DEVICE" --repeats 2 --shapes 256x256,256x1024,2x128x512 --out "$OUT"
else
    run step_time torchrun "$NPROC" benchmarks/step_time.py --steps 5 --out "$OUT"
    run ns_efficiency "$PYTHON" benchmarks/ns_efficiency.py --device "$DEVICE" --out "$OUT"
fi

echo
if [ ${#failed[@]} -eq 0 ]; then
    echo "gpu_check: all checks passed on $DEVICE ($OUT/summary.txt)"
    exit 0
fi
echo "gpu_check: FAILED: ${failed[*]} (logs in $OUT)"
exit 1
