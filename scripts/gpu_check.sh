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

# 1. the config matrix against single-device Muon, fp32 and bf16 Newton–Schulz. The cases of one
#    world size share a launch (examples/train_cases.py: each case is train.py's main with these
#    arguments, one after another in one process group): each launch's start-up, every rank
#    importing torch, costs more than a case. Each case still gets its line, config_<name>_<dtype>.
CONFIGS=(configs/*.toml)
[ "$QUICK" = 1 ] && CONFIGS=(configs/fsdp_tp.toml)
# $OUT/config_cases_ws<N>.json: the cases of world size N; a config that needs more ranks is skipped
rm -f "$OUT"/config_cases_ws*
"$PYTHON" -c '
import json, os, sys
sys.path.insert(0, ".")
from examples.config import config_world_size
out, nproc, device, configs = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
launches = {}
for cfg in configs:
    n, name = config_world_size(cfg), os.path.splitext(os.path.basename(cfg))[0]
    if n > nproc:
        print(f"== skip {cfg}: needs {n} ranks, {nproc} available")
        continue
    for dtype in ("fp32", "bf16"):
        launches.setdefault(n, {})[f"config_{name}_{dtype}"] = [
            "--config", cfg, "--check", "--steps", "6", "--device", device, "--compute-dtype", dtype]
for n, cases in launches.items():
    with open(os.path.join(out, f"config_cases_ws{n}.json"), "w") as f:
        json.dump(cases, f, indent=1)
' "$OUT" "$NPROC" "$DEVICE" "${CONFIGS[@]}" | tee -a "$OUT/summary.txt"
for cases in "$OUT"/config_cases_ws*.json; do
    [ -e "$cases" ] || continue
    launch=$(basename "$cases" .json)
    echo "== $launch: torchrun ${launch#config_cases_ws} examples/train_cases.py $cases"
    launch_rc=0 cases_failed=0
    torchrun "${launch#config_cases_ws}" examples/train_cases.py "$cases" "$OUT/${launch}_results.json" \
        --device "$DEVICE" >"$OUT/$launch.log" 2>&1 || launch_rc=$?
    while read -r name outcome; do  # one line per case: "<name> ok" or "<name> FAILED (why)"
        if [ "$outcome" = ok ]; then
            echo "$name: ok" | tee -a "$OUT/summary.txt"
        else
            failed+=("$name")
            cases_failed=1
            echo "$name: $outcome (log: $OUT/$launch.log)" | tee -a "$OUT/summary.txt"
        fi
    done < <("$PYTHON" examples/train_cases.py --outcomes "$cases" "$OUT/${launch}_results.json")
    if [ "$launch_rc" != 0 ] && [ "$cases_failed" = 0 ]; then  # every case passed, the launch did not end well
        failed+=("$launch")
        echo "$launch: FAILED (torchrun exited $launch_rc; log: $OUT/$launch.log)" | tee -a "$OUT/summary.txt"
    fi
    if [ "$launch_rc" != 0 ] || [ "$cases_failed" != 0 ]; then tail -20 "$OUT/$launch.log"; fi
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
    # gloo ranks sharing 2 cores, so the smallest model that still has every variant and one
    # timed step after the warm-up (the "whole" variant reads the warm-up's stats). 2 ranks, not
    # 4: on its default 1-D FSDP mesh the same variants run on 2 ranks as on 4 (no replicas, so no
    # "repeat"; 14 matrices, more than ranks, so no cut matrix and no "whole"), and each rank
    # costs ~9 s of a core to start.
    run step_time torchrun 2 benchmarks/step_time.py --steps 1 --dim 128 --ffn-dim 256 --layers 2 --out "$OUT"
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
