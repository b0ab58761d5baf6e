#!/usr/bin/env bash
# Create .venv with the pinned packages and every workspace member installed editable.
# torch: on a machine whose python already has a CUDA torch, the venv sees it (system site
# packages) and keeps it; elsewhere it installs torch==2.13.0, the CPU build on local disk.
set -euo pipefail
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
MEMBERS="kernels blockmgr scheduler models engine server cluster"

if "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "setup: CUDA torch found in $PYTHON; the venv keeps it"
    [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv --system-site-packages "$VENV"
    TORCH_SPEC=""
else
    [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
    TORCH_SPEC="torch==2.13.0"
fi

PIP="$VENV/bin/pip --quiet --disable-pip-version-check"
$PIP install $TORCH_SPEC -r requirements.txt
editable=()
for m in $MEMBERS; do editable+=(-e "packages/$m"); done
$PIP install --no-deps --no-build-isolation "${editable[@]}" -e .
"$VENV/bin/python" - <<'PY'
import importlib
for member in ["kernels", "blockmgr", "scheduler", "models", "engine", "server", "cluster"]:
    importlib.import_module(f"pagedserve.{member}")
import torch, triton, transformers
print(f"setup: ok (torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__})")
PY
