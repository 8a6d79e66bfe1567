#!/usr/bin/env bash
# A CI performance gate end to end: build a baseline and a candidate of a program, record
# both under the same conditions, and fail when a function's share of the CPU grew.
#
#   scripts/ci-gate.sh                         # candidate = baseline: the gate passes (0)
#   CANDIDATE_CFLAGS=-DCRUNCH_FACTOR=2 scripts/ci-gate.sh   # crunch() 2x slower: exits 1
#
# In a real pipeline the two builds are two commits (e.g. `git worktree add base origin/main`)
# and the recorded command is the project's benchmark; the steps stay the same:
#   1. build base and candidate with frame pointers (-fno-omit-frame-pointer), so stacks
#      are complete;
#   2. record each doing a fixed amount of work at a fixed frequency: samples count CPU
#      time, so the sample count is known however busy the runner is (here ~900 for the
#      baseline: enough to see 5 pts with a z-test, see README);
#   3. `pyrometer diff base new --fail-above PTS`: exit 1 lists the functions whose share grew
#      by more than PTS percentage points significantly; the differential flame graph shows
#      where (red grew, blue shrank). Exit 2 means the gate could not judge (bad input,
#      too few samples), which should fail the job too.
#
# Environment: PYROMETER (binary; default: build target/release/pyrometer), WORK_DIR
# (default: target/ci-gate), CANDIDATE_CFLAGS, ROUNDS (work per run, default 3000), FREQUENCY
# (default 999), FAIL_ABOVE (default 5). Needs root (or CAP_BPF + CAP_PERFMON +
# CAP_SYS_PTRACE) and gcc.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
work="${WORK_DIR:-$root/target/ci-gate}"
rounds="${ROUNDS:-3000}"
frequency="${FREQUENCY:-999}"
fail_above="${FAIL_ABOVE:-5}"
src="$root/tests/fixtures/regress.c"
mkdir -p "$work"

if [[ -z "${PYROMETER:-}" ]]; then
    (cd "$root" && cargo build --release -p pyrometer --bin pyrometer)
    PYROMETER="$root/target/release/pyrometer"
fi

cflags=(-O1 -g -fno-omit-frame-pointer -mno-omit-leaf-frame-pointer -fno-optimize-sibling-calls -fno-inline)
echo "ci-gate: building baseline and candidate (${CANDIDATE_CFLAGS:-no extra flags})" >&2
gcc "${cflags[@]}" "$src" -o "$work/baseline"
# shellcheck disable=SC2086  # CANDIDATE_CFLAGS is a list of flags
gcc "${cflags[@]}" ${CANDIDATE_CFLAGS:-} "$src" -o "$work/candidate"

echo "ci-gate: recording $rounds rounds of each at ${frequency} Hz" >&2
"$PYROMETER" record -F "$frequency" -o "$work/base.pb.gz" -- "$work/baseline" -r "$rounds"
"$PYROMETER" record -F "$frequency" -o "$work/new.pb.gz" -- "$work/candidate" -r "$rounds"

echo "ci-gate: diff --fail-above $fail_above" >&2
set +e
"$PYROMETER" diff "$work/base.pb.gz" "$work/new.pb.gz" --fail-above "$fail_above" \
    --svg "$work/diff.svg" --top 5
status=$?
set -e
case $status in
    0) echo "ci-gate: passed" >&2 ;;
    1) echo "ci-gate: FAILED: regression (differential flame graph: $work/diff.svg)" >&2 ;;
    *) echo "ci-gate: FAILED: the gate could not judge (exit $status)" >&2 ;;
esac
exit $status
