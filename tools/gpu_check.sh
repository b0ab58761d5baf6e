#!/usr/bin/env bash
# The one script to run on a GPU machine (made for a lent H200 with torch, triton and
# transformers preinstalled). It installs nothing and finishes in well under 8 minutes:
#   1. the kernel-correctness suite, compiled, at full size (PAGEDSERVE_KERNEL_GRID=full);
#   2. kernels/bench.py: Triton vs the torch reference vs the device's copy bandwidth;
#   3. an end-to-end generation step: tools/bench_e2e_gpu.py when it exists.
# Then it prints one table of the steps. Run from the repository root:
#   bash tools/gpu_check.sh            (PYTHON=... to pick an interpreter)
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
step kernel-suite 330 "$PYTHON" -m pytest kernels -q -p no:cacheprovider "${PARALLEL[@]}" ${PYTEST_ARGS:-}
step kernel-bench 90 "$PYTHON" kernels/bench.py
if [ -f tools/bench_e2e_gpu.py ]; then
    step e2e-generation 90 "$PYTHON" tools/bench_e2e_gpu.py
else
    ROWS+=("$(printf '%-18s %-18s %6s   %s' e2e-generation skipped - 'tools/bench_e2e_gpu.py does not exist yet')")
fi

# --- CUDA graphs for decode (engine/cuda_graph.py): capture every bucket of a tiny model, replay
# decode steps, and match the eager (--enforce-eager) tokens; plus the padded path's CPU tests.
step cuda-graphs 150 "$PYTHON" -m pytest tests/engine/test_cuda_graph.py -q -p no:cacheprovider -rs
# --- end of the CUDA-graph block

echo
echo "=== gpu_check summary (logs in $LOGS)"
printf '%-18s %-18s %7s  %s\n' step status time "last line"
for row in "${ROWS[@]}"; do echo "$row"; done
! printf '%s\n' "${ROWS[@]}" | grep -qE 'FAILED|TIMEOUT'
