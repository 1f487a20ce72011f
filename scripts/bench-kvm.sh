#!/usr/bin/env bash
# Benchmark of the embedded KVM backend (crates/backstop-kvm): restore time by guest memory size,
# diff snapshot size against pages dirtied, capture throughput against memcpy measured in the
# same run. Prints figures; asserts nothing. Needs /dev/kvm (read-write) and ~3x the largest
# guest size in free memory + disk under the work dir.
#
#   scripts/bench-kvm.sh [--sizes-mib 256,1024,4096] [--restores 5] [--work-dir DIR]
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ ! -r /dev/kvm || ! -w /dev/kvm ]]; then
    echo "bench-kvm: /dev/kvm is not usable here" >&2
    exit 1
fi
if grep -qs kvm_pvm /proc/modules 2>/dev/null || [[ -d /sys/module/kvm_pvm ]]; then
    echo "note: paravirtual KVM (kvm_pvm): guest instructions are emulated, VMM figures are real"
fi
cargo build -q -p backstop-kvm --release --example kvm_bench
exec target/release/examples/kvm_bench "$@"
