#!/usr/bin/env bash
# The whole test suite: every test at 1 rank, the fault matrix (its own mpiexec jobs, several
# at a time), then the multi-rank tests (marked `mpi`) under mpiexec at 2, 3 and 4 ranks.
# Each run has an outer timeout and commlib's watchdog (COMMLIB_TIMEOUT) aborts a
# deadlocked job in seconds, so a hang fails fast.
set -euo pipefail
cd "$(dirname "$0")/.."
export COMMLIB_TIMEOUT="${COMMLIB_TIMEOUT:-120}"
PYTEST=(python -m pytest -q --tb=short -rfE)
status=0
echo "=== 1 rank: all tests but the fault matrix"
timeout 1500 "${PYTEST[@]}" --with-mpi -m "not fault_matrix" tests || status=1
echo "=== fault matrix (algorithm x fault x 2, 3 ranks)"
timeout 1500 "${PYTEST[@]}" -m fault_matrix tests || status=1
for n in 2 3 4; do
  echo "=== $n ranks: multi-rank tests"
  timeout 900 mpiexec -n "$n" "${PYTEST[@]}" --only-mpi tests || status=1
done
[ "$status" -eq 0 ] && echo "=== all test runs passed" || echo "=== FAILED (see above)"
exit "$status"
