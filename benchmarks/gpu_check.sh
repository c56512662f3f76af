#!/usr/bin/env bash
# One prepared command that checks commlib's GPU path on a GPU machine with no network
# (see docs/benchmarks/gpu-check.md):
#
#   bash benchmarks/gpu_check.sh --fetch-wheels   # here, with PyPI: fill wheelhouse/
#   bash benchmarks/gpu_check.sh                  # there: install from wheelhouse/, run all
#   bash benchmarks/gpu_check.sh --dry-run        # a CPU machine: simulator, GPU parts skipped
#
# Results go to $OUT (default benchmarks/results/gpu_check): gpu_check.json and
# gpu_check.log. Exit status 0 when no stage that could run failed.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WHEELS=$ROOT/wheelhouse
MODE=device
EXTRA=()
for arg in "$@"; do
  case "$arg" in
    --fetch-wheels) MODE=fetch ;;
    --dry-run) MODE=dry ;;
    --budget-s=*) EXTRA+=(--budget-s "${arg#*=}") ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$arg' (--fetch-wheels, --dry-run, --budget-s=N)" >&2
       exit 2 ;;
  esac
done

# What the GPU image lacks (it has torch, cupy, numba, numba-cuda, mpi4py, pytest,
# pytest-timeout, hypothesis): the MPI runtime, pytest-mpi, and fallbacks for the rest.
# distribution=import name
PACKAGES=(mpich=mpich mpi4py=mpi4py pytest-mpi=pytest_mpi pytest-timeout=pytest_timeout
          hypothesis=hypothesis sortedcontainers=sortedcontainers)

if [ "$MODE" = fetch ]; then
  PY=${PYTHON:-python3}
  mkdir -p "$WHEELS"
  rm -f "$WHEELS"/*.whl
  for entry in "${PACKAGES[@]}"; do
    dist=${entry%%=*}
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      --platform manylinux1_x86_64 -d "$WHEELS" "$dist" || { echo "cannot fetch $dist" >&2; exit 1; }
  done
  ls -l "$WHEELS"
  du -sh "$WHEELS"
  echo "carry it with the device tool: carry: [\"wheelhouse\"] (limit 64 MiB with the tree)"
  exit 0
fi

OUT=${OUT:-$ROOT/benchmarks/results/gpu_check}
mkdir -p "$OUT"
: > "$OUT/gpu_check.log"
say() { echo "$*" | tee -a "$OUT/gpu_check.log"; }

if [ "$MODE" = dry ]; then
  if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
  elif [ -n "${VIRTUAL_ENV:-}" ]; then PY=$VIRTUAL_ENV/bin/python
  elif [ -x "$ROOT/.venv/bin/python" ]; then PY=$ROOT/.venv/bin/python
  else PY=python3; fi
  say "gpu_check: dry run with $PY (no installs)"
  exec "$PY" benchmarks/gpu_check.py --out "$OUT" --dry-run "${EXTRA[@]}"
fi

# -- device: install from wheelhouse/ (no network) -----------------------------------------
PY=${PYTHON:-python3}
INSTALL_LOG=$(mktemp)
export GPU_CHECK_INSTALL_LOG=$INSTALL_LOG
note() { echo "$*" | tee -a "$OUT/gpu_check.log" "$INSTALL_LOG"; }
SCRIPTS=$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')
export PATH=$SCRIPTS:$PATH
TARGET=""   # set when the interpreter's own site-packages cannot be written
pip_install() {
  local args=(-m pip install -q --no-index --find-links "$WHEELS" --no-deps --no-cache-dir
              --disable-pip-version-check "$@")
  if [ -z "$TARGET" ] && "$PY" "${args[@]}" >>"$OUT/gpu_check.log" 2>&1; then return 0; fi
  TARGET=/tmp/gpu_check_site
  export PYTHONPATH=$TARGET${PYTHONPATH:+:$PYTHONPATH} PATH=$TARGET/bin:$PATH
  export LD_LIBRARY_PATH=$TARGET/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  "$PY" "${args[@]}" --target "$TARGET" --upgrade >>"$OUT/gpu_check.log" 2>&1
}
wheel_of() { ls "$WHEELS"/"$(echo "$1" | tr - _)"-*.whl 2>/dev/null | head -1; }

[ -d "$WHEELS" ] || note "gpu_check: no wheelhouse/ (run --fetch-wheels where pip works, carry it)"
for entry in "${PACKAGES[@]}"; do
  dist=${entry%%=*}; mod=${entry#*=}
  case "$dist" in mpich|mpi4py) continue ;; esac
  if "$PY" -c "import $mod" 2>/dev/null; then
    note "have $dist $("$PY" -c "import importlib.metadata as m; print(m.version('$dist'))" 2>/dev/null)"
  elif [ -n "$(wheel_of "$dist")" ] && pip_install "$(wheel_of "$dist")"; then
    note "installed $(basename "$(wheel_of "$dist")")"
  else
    note "MISSING $dist (no wheel or install failed)"
  fi
done

# MPI: keep what works (mpi4py imports and an mpiexec is there); else the mpich wheel's
# runtime (mpi4py >= 4 finds its libmpi); else also the carried mpi4py wheel.
mpi_works() {
  command -v mpiexec >/dev/null && "$PY" -c "from mpi4py import MPI; MPI.Get_library_version()" 2>/dev/null
}
if mpi_works; then
  note "MPI: using the image's: $(command -v mpiexec)"
else
  [ -n "$(wheel_of mpich)" ] && pip_install "$(wheel_of mpich)" && note "installed $(basename "$(wheel_of mpich)")"
  hash -r
  if ! mpi_works && [ -n "$(wheel_of mpi4py)" ]; then
    note "mpi4py of the image does not load the mpich wheel's libmpi: installing the carried mpi4py"
    pip_install --force-reinstall "$(wheel_of mpi4py)" && note "installed $(basename "$(wheel_of mpi4py)")"
    hash -r
  fi
  mpi_works && note "MPI: mpich wheel, $(command -v mpiexec)" || note "MPI: NOT WORKING (mpi stages will fail)"
fi
note "MPI library: $("$PY" -c "from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])" 2>&1 | tail -1)"

# commlib itself: editable, no dependencies (setuptools is in the image), else PYTHONPATH
if "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e "$ROOT" >>"$OUT/gpu_check.log" 2>&1; then
  note "installed commlib (editable)"
else
  export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
  note "commlib: editable install failed, using PYTHONPATH=$ROOT"
fi
if command -v nvidia-smi >/dev/null; then nvidia-smi 2>&1 | tee -a "$OUT/gpu_check.log" | head -20
else note "no nvidia-smi on this machine"; fi
exec "$PY" benchmarks/gpu_check.py --out "$OUT" "${EXTRA[@]}"
