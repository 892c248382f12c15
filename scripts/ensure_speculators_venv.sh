#!/usr/bin/env bash
# Build .venv-speculators (vllm-project/speculators, CPU torch) only when it is missing or stale.
# Optional: only `make test-speculators` uses it; CI never builds it, and the test that needs it
# (tests/integration/test_speculators_lib.py) skips without it.
#
# A script of its own rather than a third kind in scripts/ensure_venv.sh: that script hashes
# itself into the key of .venv and .venv-vllm, so editing it would rebuild both everywhere.
# Same scheme: the key hashes the Python version, the requirements files, this script and the
# torch wheel; the stamp is written last, so an interrupted build starts over.
#
# torch is the CPU wheel from /opt/wheels (TORCH_WHEEL overrides), else PyTorch's CPU index,
# installed before anything else so nothing can pull the CUDA build. speculators itself is
# installed --no-deps: requirements/speculators.txt says why and lists what it does need.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
dir=.venv-speculators
inputs=(requirements/speculators.txt requirements/speculators-nodeps.txt "$0")

if [[ -z ${TORCH_WHEEL:-} ]]; then
  TORCH_WHEEL=$(ls /opt/wheels/torch-"$TORCH_VERSION"+cpu-*.whl 2>/dev/null | head -n1 || true)
fi
key=$({ "$PYTHON" -c 'import sys; print(sys.version)'; cat "${inputs[@]}"; echo "torch=$TORCH_VERSION ${TORCH_WHEEL##*/}"; } | sha256sum | cut -c1-16)
stamp=$dir/.eagle3-stamp
if [[ -f $stamp && $(cat "$stamp") == "$key" ]]; then
  exit 0
fi

quiet_pip() { "$dir/bin/pip" "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

echo "== building $dir (speculators environment, key $key)"
start=$SECONDS
rm -rf -- "$dir"
"$PYTHON" -m venv "$dir"
quiet_pip install -q --upgrade pip
if [[ -n $TORCH_WHEEL ]]; then
  quiet_pip install -q "$TORCH_WHEEL"
else
  quiet_pip install -q "torch==$TORCH_VERSION" --index-url "$TORCH_CPU_INDEX"
fi
quiet_pip install -q -r requirements/speculators.txt
quiet_pip install -q --no-deps -r requirements/speculators-nodeps.txt
"$dir/bin/python" - <<'PY'
import sys, torch
if torch.version.cuda is not None:
    sys.exit(f"torch {torch.__version__} in {sys.prefix} is a CUDA build; set TORCH_WHEEL or TORCH_CPU_INDEX")
from speculators import SpeculatorModel  # noqa: F401  (the package imports without torchvision)
PY
echo "$key" > "$stamp"
echo "== $dir ready in $((SECONDS - start)) s ($(du -sh "$dir" | cut -f1))"
