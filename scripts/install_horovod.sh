#!/usr/bin/env bash
# Build and install Horovod 0.28.1 (its last release) against the venv's torch, CPU-only unless CUDA exists.
#
# As published, 0.28.1 compiles as C++14 and ATen (torch >= 2.1) needs C++20, so the source package is
# patched: C++ standard 20 in the top-level and horovod/torch CMakeLists, and, for CPU-only builds, the
# CUDA probe in cmake/Modules/FindPytorch.cmake answers False (a CUDA build of torch on a box without a
# GPU would otherwise make Horovod build a CUDA extension). The wheel is cached per torch version, so a
# second run installs in seconds.
#
#   scripts/install_horovod.sh            # uses .venv/bin/python
#   PY=/path/to/python scripts/install_horovod.sh
set -euo pipefail

VERSION=0.28.1
RUN_DEPS="cloudpickle==3.1.3 psutil==7.2.2 packaging==26.3"  # pinned like requirements.txt
BUILD_DEPS="cffi==2.1.1 setuptools==84.2.1 wheel==0.48.0"
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || { echo "install_horovod: no python at $PY (run 'make setup' first)" >&2; exit 2; }
for tool in cmake g++; do
  command -v "$tool" >/dev/null || { echo "install_horovod: '$tool' is missing (apt-get install cmake g++)" >&2; exit 2; }
done

TORCH=$("$PY" -c 'import torch; print(torch.__version__.replace("+", "_"))')
if [ -z "${HOROVOD_GPU_OPERATIONS:-}" ] && ! "$PY" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())'; then
  CPU_ONLY=1; FLAVOUR=cpu
else
  CPU_ONLY=0; FLAVOUR=gpu
fi
CACHE=${HOROVOD_WHEEL_CACHE:-$HOME/.cache/dawnbench/horovod}/$VERSION-torch$TORCH-$FLAVOUR
mkdir -p "$CACHE"

if "$PY" -c "import horovod.torch, sys; sys.exit(horovod.__version__ != '$VERSION')" 2>/dev/null; then
  echo "install_horovod: horovod $VERSION already installed"; exit 0
fi

if ! ls "$CACHE"/horovod-*.whl >/dev/null 2>&1; then
  WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT
  echo "install_horovod: fetching the horovod $VERSION source package"
  "$PY" -m pip download --quiet --no-binary :all: --no-deps "horovod==$VERSION" -d "$WORK"
  tar -xzf "$WORK/horovod-$VERSION.tar.gz" -C "$WORK"
  SRC="$WORK/horovod-$VERSION"
  sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 20)/' "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"
  grep -q 'CMAKE_CXX_STANDARD 20' "$SRC/horovod/torch/CMakeLists.txt" || { echo "install_horovod: C++20 patch did not apply" >&2; exit 1; }
  if [ "$CPU_ONLY" = 1 ]; then
    sed -i 's/print(True if ((torch.version.cuda is not None) and (CUDA_HOME is not None)) else False)/print(False)/' \
      "$SRC/cmake/Modules/FindPytorch.cmake"
    grep -q 'print(False)' "$SRC/cmake/Modules/FindPytorch.cmake" || { echo "install_horovod: CUDA-probe patch did not apply" >&2; exit 1; }
    export HOROVOD_CPU_ONLY=1
  fi
  "$PY" -m pip install --quiet $BUILD_DEPS $RUN_DEPS
  echo "install_horovod: building the wheel (about 2 minutes on 2 cores; log in $CACHE/build.log)"
  if ! HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_WITHOUT_TENSORFLOW=1 \
       HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS="-j$(nproc)" \
       "$PY" -m pip wheel --no-build-isolation --no-deps -w "$CACHE" "$SRC" >"$CACHE/build.log" 2>&1; then
    tail -30 "$CACHE/build.log" >&2; echo "install_horovod: build failed (full log: $CACHE/build.log)" >&2; exit 1
  fi
fi
"$PY" -m pip install --quiet --no-deps --force-reinstall "$CACHE"/horovod-*.whl
"$PY" -m pip install --quiet $RUN_DEPS
"$PY" -c "import horovod.torch as hvd; print('install_horovod: horovod', __import__('horovod').__version__, 'gloo built:', hvd.gloo_built())"
