#!/usr/bin/env bash
# The one script to run on a GPU machine (made for a lent H200 with torch, triton and
# transformers preinstalled: torch 2.11, triton 3.6). It installs nothing and finishes in under
# 8 minutes (the step limits add up to 7 3/4):
#   1. the kernel-correctness suite, compiled, at full size (PAGEDSERVE_KERNEL_GRID=full),
#      including "no attention kernel compiles after the warm-up" (kernels/test_warmup_gpu.py);
#      the CPU-side checks (ahead-of-time compile check, --impl) are left to CI;
#   2. kernels/bench.py: Triton vs the torch reference vs the device's copy bandwidth;
#   3. tools/bench_e2e_gpu.py: Qwen3-0.6B-shaped random model, Triton with CUDA graphs on and
#      off (--enforce-eager), the reference path and transformers;
#   4. the CUDA-graph capture check (tests/engine/test_cuda_graph.py).
# Then it prints one table of the steps. Run from the repository root:
#   bash tools/gpu_check.sh            (PYTHON=... to pick an interpreter; E2E_ARGS=... for
#                                       bench_e2e_gpu.py, e.g. "--layers 8 --num-prompts 64")
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
PYTHONPATH=$(ls -d packages/*/src | paste -sd: -)
export PYTHONPATH
export PAGEDSERVE_KERNEL_GRID=full
unset TRITON_INTERPRET PAGEDSERVE_KERNELS
LOGS=${LOGS:-$(mktemp -d)}
ROWS=()

step() {  # step NAME TIMEOUT_S COMMAND...: run, tee the output to a log, record a table row
    local name=$1 limit=$2
    shift 2
    echo "=== ${name}: $*"
    local start=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee "$LOGS/${name}.log"
    local rc=${PIPESTATUS[0]}
    local status=ok
    [ "$rc" -ne 0 ] && status="FAILED (rc $rc)"
    [ "$rc" -eq 124 ] && status="TIMEOUT (${limit}s)"
    ROWS+=("$(printf '%-18s %-18s %6ss  %s' "$name" "$status" "$((SECONDS - start))" "$(tail -n 1 "$LOGS/${name}.log" | cut -c1-70)")")
}

"$PYTHON" - <<'PY'
import torch, triton
print(f"torch {torch.__version__}, triton {triton.__version__}, cuda {torch.version.cuda}, "
      f"device {torch.cuda.get_device_name() if torch.cuda.is_available() else 'NONE'}")
PY

PARALLEL=()
"$PYTHON" -c "import xdist" 2>/dev/null && PARALLEL=(-n 8)  # compile kernels in parallel
# PYTEST_ARGS (e.g. "-k store_kv") narrows the suite for a quick smoke run.
CPU_ONLY=(--ignore=kernels/test_compile_check.py --ignore=kernels/test_impl_option.py)
step kernel-suite 180 "$PYTHON" -m pytest kernels -q -p no:cacheprovider "${PARALLEL[@]}" "${CPU_ONLY[@]}" ${PYTEST_ARGS:-}
step kernel-bench 45 "$PYTHON" kernels/bench.py
# shellcheck disable=SC2086  # E2E_ARGS is a list of options
step e2e-generation 110 "$PYTHON" tools/bench_e2e_gpu.py ${E2E_ARGS:-}

# --- CUDA graphs for decode (engine/cuda_graph.py): capture every bucket of a tiny model, replay
# decode steps, and match the eager (--enforce-eager) tokens; plus the padded path's CPU tests.
step cuda-graphs 130 "$PYTHON" -m pytest tests/engine/test_cuda_graph.py -q -p no:cacheprovider -rs
# --- end of the CUDA-graph block

echo
echo "=== gpu_check summary (logs in $LOGS)"
printf '%-18s %-18s %7s  %s\n' step status time "last line"
for row in "${ROWS[@]}"; do echo "$row"; done
! printf '%s\n' "${ROWS[@]}" | grep -qE 'FAILED|TIMEOUT'
