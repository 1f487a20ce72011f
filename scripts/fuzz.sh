#!/usr/bin/env bash
# Fuzzes every parser of untrusted bytes (cargo-fuzz targets in fuzz/fuzz_targets/) for a fixed
# number of executions each, and prints per target: executions, seconds, result.
#
#   scripts/fuzz.sh                       # every target, 1000000 executions each
#   scripts/fuzz.sh --runs 10000          # a quick pass
#   scripts/fuzz.sh --target guest_line   # one target
#
# Needs the nightly toolchain and cargo-fuzz (`cargo install cargo-fuzz`). Runs under `nice -n 19`
# and builds with one job: it shares the machine. Not run by CI (too slow for 2 CPUs); CI replays
# the seed corpus (fuzz/corpus/<target>/) and every crash reproducer (fuzz/regressions/<target>/)
# as ordinary unit tests of the owning crate on stable (`fuzz_inputs_replay`).
#
# New inputs the fuzzer finds go to a scratch corpus (target/fuzz-corpus/<target>/), never into the
# committed seeds. A crash (panic, failed assertion, out of memory, timeout) is written to
# fuzz/regressions/<target>/ and the script exits non-zero. To reproduce one:
#
#   cd fuzz && cargo +nightly fuzz run --sanitizer none <target> regressions/<target>/<file>
#
# (that runs the one input and shows the panic), or replay them all on stable:
# `cargo test -p <crate> fuzz_inputs_replay`. Then fix the parser; keep the file: it is now a
# regression test.
set -euo pipefail
cd "$(dirname "$0")/.."

runs=1000000
only=""
while [ $# -gt 0 ]; do
    case "$1" in
        --runs) runs="$2"; shift 2 ;;
        --target) only="$2"; shift 2 ;;
        -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
        *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
    esac
done

if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
    echo "cargo-fuzz on the nightly toolchain is needed: cargo install cargo-fuzz" >&2
    exit 2
fi

target_dir="${CARGO_TARGET_DIR:-$PWD/target}"
targets=$(cd fuzz && cargo +nightly fuzz list)
if [ -n "$only" ]; then
    if ! grep -qx "$only" <<<"$targets"; then
        echo "no fuzz target $only; there are: $(tr '\n' ' ' <<<"$targets")" >&2
        exit 2
    fi
    targets="$only"
fi

# Sanitizer off: the parsers are safe Rust; overflow checks and debug assertions stay on.
fuzz=(cargo +nightly fuzz)
opts=(--sanitizer none --debug-assertions --target-dir "$target_dir")
(cd fuzz && CARGO_BUILD_JOBS=1 nice -n 19 "${fuzz[@]}" build "${opts[@]}")

# Per target: longest input tried (the stream cutter needs room for page records).
max_len() {
    case "$1" in
        stream_cutter) echo 262144 ;;
        *) echo 8192 ;;
    esac
}

# Keep freed memory in the process: the stream cutter's FastCDC tail allocates and shifts a 1 MiB
# buffer per input, and glibc handing it back to the kernel each time made page faults most of
# the run (~500 inputs/s instead of thousands).
export MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=268435456

failed=0
printf '%-18s %12s %9s  %s\n' target executions seconds result
for t in $targets; do
    scratch="$target_dir/fuzz-corpus/$t"
    regressions="fuzz/regressions/$t"
    mkdir -p "$scratch" "$regressions"
    dirs=("$scratch" "corpus/$t")
    [ -n "$(ls -A "$regressions")" ] && dirs+=("regressions/$t")
    log="$target_dir/fuzz-$t.log"
    start=$(date +%s.%N)
    set +e
    (cd fuzz && nice -n 19 "${fuzz[@]}" run "${opts[@]}" "$t" "${dirs[@]}" -- \
        -runs="$runs" -max_len="$(max_len "$t")" -timeout=10 -rss_limit_mb=2048 \
        -artifact_prefix="regressions/$t/" -print_final_stats=1) >"$log" 2>&1
    status=$?
    set -e
    seconds=$(echo "$(date +%s.%N) - $start" | bc)
    execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1)
    if [ "$status" -eq 0 ]; then
        result=ok
    else
        result="CRASH (exit $status): $(ls -t "$regressions" | head -1) — log $log"
        failed=1
    fi
    rmdir "$regressions" 2>/dev/null || true
    printf '%-18s %12s %9.0f  %s\n' "$t" "${execs:-?}" "$seconds" "$result"
done
exit "$failed"
