#!/usr/bin/env bash
# The test suite on the MPI runtime of the active venv (tests/run_all.sh runs it on each
# runtime): every test at 1 rank, the fault matrix (its own mpiexec jobs, several at a time),
# then the multi-rank tests (marked `mpi`) under mpiexec at 2, 3 and 4 ranks. The launcher's options (Open MPI's --oversubscribe,
# its root permission) come from commlib.mpi.mpi_impl, never from this script.
#
# PHASES (default "serial fault_matrix 2 3 4") picks the phases; SERIAL_FILES (default: all
# of tests/) the files of the 1-rank phase. Each run has an outer timeout and commlib's
# watchdog (COMMLIB_TIMEOUT) aborts a deadlocked job in seconds, so a hang fails fast (the
# fault matrix and the exit-path tests of test_faults.py run their jobs at commlib's default
# settings, COMMLIB_TIMEOUT unset). The run must leave /dev/shm as it found it: the MPI
# library's segments (mpich_* for MPICH, sm_segment.* for Open MPI) that appeared during the
# run and are still there at its end fail it (commlib unlinks its jobs' segments once every
# rank of the node maps them, so only a job that died before `import commlib` finished can
# leave one; on a machine shared with other MPI jobs set ALLOW_SHM_LEFTOVERS=1, the fault
# tests still check each of their own jobs).
set -euo pipefail
cd "$(dirname "$0")/.."
export COMMLIB_TIMEOUT="${COMMLIB_TIMEOUT:-120}"
PHASES="${PHASES:-serial fault_matrix 2 3 4}"
PYTEST=(python -m pytest -q --tb=short -rfE)
RUNTIME="$(python -m commlib.mpi.mpi_impl)"
mapfile -t PREFIXES < <(python -m commlib.mpi.mpi_impl --shm-prefixes | sed '/^$/d')
while IFS= read -r kv; do [ -n "$kv" ] && export "$kv"; done \
  < <(python -m commlib.mpi.mpi_impl --launch-env)
segments() {  # the /dev/shm files whose names start with one of PREFIXES
  ls /dev/shm 2>/dev/null | awk -v p="${PREFIXES[*]-}" \
    'BEGIN { n = split(p, a, " ") } { for (i = 1; i <= n; i++) if (index($0, a[i]) == 1) { print; break } }' | sort
}
has() { [[ " $PHASES " == *" $1 "* ]]; }
t0=$SECONDS
took() { echo "=== took $(( SECONDS - t0 )) s"; t0=$SECONDS; }
shm_before="$(segments)"
status=0
# Every pytest run's output also goes to LOG (run_all.sh repeats the failures found there at
# the end of its output, where a long output's tail keeps them)
LOG="${RUN_LOG:-/dev/null}"
[ "$LOG" = /dev/null ] || : > "$LOG"
logged() { "$@" 2>&1 | tee -a "$LOG"; }
echo "=== MPI runtime: $RUNTIME; phases: $PHASES"
# The 1-rank phase is mostly jobs the tests launch (mpiexec, torchrun, srun), which wait as
# much as they compute: two test files run at a time (pytest-xdist, whole files per worker;
# the tests isolate their jobs by tag, port, namespace and temp dir). TEST_WORKERS=0 runs
# them one at a time.
WORKERS="${TEST_WORKERS:-2}"
XDIST=()
if [ "$WORKERS" != 0 ] && python -c "import xdist" 2>/dev/null; then
  XDIST=(-n "$WORKERS" --dist loadfile)
fi
read -r -a SERIAL <<< "${SERIAL_FILES:-tests}"
if has serial; then
  echo "=== 1 rank: ${SERIAL[*]} but the fault matrix (${XDIST[*]:-one file at a time})"
  logged timeout 1500 "${PYTEST[@]}" --durations=12 --with-mpi -m "not fault_matrix" \
    ${XDIST[@]+"${XDIST[@]}"} "${SERIAL[@]}" || status=1
  took
fi
if has fault_matrix; then
  echo "=== fault matrix (algorithm x fault x 2, 3 ranks)"
  logged timeout 1500 "${PYTEST[@]}" -m fault_matrix tests || status=1
  took
fi
# Only the files that hold `mpi`-marked tests: every rank of every run collects what it is
# given, and the others' modules (and what they import) would only be skipped.
mapfile -t MPI_FILES < <(grep -l 'mark\.mpi' tests/test_*.py)
# MPI_EXCLUDE (space-separated paths): files left out of the multi-rank phases (run_all.sh:
# the numerics of algorithms and front-ends on the other runtimes, covered on the first)
if [ -n "${MPI_EXCLUDE:-}" ]; then
  mapfile -t MPI_FILES < <(printf '%s\n' "${MPI_FILES[@]}" | grep -vxF -f <(tr ' ' '\n' <<< "$MPI_EXCLUDE" | sed '/^$/d'))
fi
[ "${#MPI_FILES[@]}" -gt 0 ] || { echo "=== no mpi-marked test files found"; exit 1; }
# FILES_AT_4 (space-separated paths): at 4 ranks only these of the files above (run_all.sh:
# on the other runtimes, the primitives, the shared-memory tier, the wait modes and the
# front-ends' exchanges, oversubscribed; every file runs at 2 ranks)
AT_4=("${MPI_FILES[@]}")
if [ -n "${FILES_AT_4:-}" ]; then
  mapfile -t AT_4 < <(printf '%s\n' "${MPI_FILES[@]}" | grep -xF -f <(tr ' ' '\n' <<< "$FILES_AT_4" | sed '/^$/d'))
fi
for n in 2 3 4; do
  has "$n" || continue
  files=("${MPI_FILES[@]}")
  [ "$n" = 4 ] && files=("${AT_4[@]}")
  mapfile -t LAUNCH < <(python -m commlib.mpi.mpi_impl --launch "$n")
  echo "=== $n ranks: multi-rank tests (${#files[@]} files): mpiexec ${LAUNCH[*]}"
  logged timeout 900 mpiexec "${LAUNCH[@]}" "${PYTEST[@]}" --only-mpi "${files[@]}" \
    || status=1
  took
done
left="$(comm -13 <(echo "$shm_before") <(segments) | tr '\n' ' ')"
if [ -n "${left// /}" ]; then
  echo "=== /dev/shm: MPI segments left by this run: $left"
  [ "${ALLOW_SHM_LEFTOVERS:-0}" = 1 ] || status=1
fi
[ "$status" -eq 0 ] && echo "=== all test runs passed ($RUNTIME)" || echo "=== FAILED ($RUNTIME, see above)"
exit "$status"
