#!/usr/bin/env bash
# The whole test suite: every test at 1 rank, the fault matrix (its own mpiexec jobs, several
# at a time), then the multi-rank tests (marked `mpi`) under mpiexec at 2, 3 and 4 ranks.
# Each run has an outer timeout and commlib's watchdog (COMMLIB_TIMEOUT) aborts a
# deadlocked job in seconds, so a hang fails fast (the fault matrix and the exit-path tests
# of test_faults.py run their jobs at commlib's default settings, COMMLIB_TIMEOUT unset).
# The run must leave /dev/shm as it found it: MPICH segments (mpich_*) that appeared during
# the run and are still there at its end fail it (commlib unlinks its jobs' segments once
# mapped, so only a job that died before `import commlib` finished can leave one; on a
# machine shared with other MPI jobs set ALLOW_SHM_LEFTOVERS=1, the fault tests still check
# each of their own jobs).
set -euo pipefail
cd "$(dirname "$0")/.."
export COMMLIB_TIMEOUT="${COMMLIB_TIMEOUT:-120}"
PYTEST=(python -m pytest -q --tb=short -rfE)
segments() { ls /dev/shm 2>/dev/null | grep '^mpich_' | sort || true; }
shm_before="$(segments)"
status=0
# The 1-rank phase is mostly jobs the tests launch (mpiexec, torchrun, srun), which wait as
# much as they compute: two test files run at a time (pytest-xdist, whole files per worker;
# the tests isolate their jobs by tag, port, namespace and temp dir). TEST_WORKERS=0 runs
# them one at a time.
WORKERS="${TEST_WORKERS:-2}"
XDIST=()
if [ "$WORKERS" != 0 ] && python -c "import xdist" 2>/dev/null; then
  XDIST=(-n "$WORKERS" --dist loadfile)
fi
echo "=== 1 rank: all tests but the fault matrix (${XDIST[*]:-one file at a time})"
timeout 1500 "${PYTEST[@]}" --with-mpi -m "not fault_matrix" "${XDIST[@]}" tests || status=1
echo "=== fault matrix (algorithm x fault x 2, 3 ranks)"
timeout 1500 "${PYTEST[@]}" -m fault_matrix tests || status=1
# Only the files that hold `mpi`-marked tests: every rank of every run collects what it is
# given, and the others' modules (and what they import) would only be skipped.
mapfile -t MPI_FILES < <(grep -l 'mark\.mpi' tests/test_*.py)
[ "${#MPI_FILES[@]}" -gt 0 ] || { echo "=== no mpi-marked test files found"; exit 1; }
for n in 2 3 4; do
  echo "=== $n ranks: multi-rank tests (${#MPI_FILES[@]} files)"
  timeout 900 mpiexec -n "$n" "${PYTEST[@]}" --only-mpi "${MPI_FILES[@]}" || status=1
done
left="$(comm -13 <(echo "$shm_before") <(segments) | tr '\n' ' ')"
if [ -n "${left// /}" ]; then
  echo "=== /dev/shm: MPICH segments left by this run: $left"
  [ "${ALLOW_SHM_LEFTOVERS:-0}" = 1 ] || status=1
fi
[ "$status" -eq 0 ] && echo "=== all test runs passed" || echo "=== FAILED (see above)"
exit "$status"
