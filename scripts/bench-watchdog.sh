#!/usr/bin/env bash
# Watchdog expiry → guest running again at the snapshot point.
#
# Boots the test guest under backstopd with a heartbeat timeout T, takes a snapshot, then lets
# the guest's agent fall silent (backstop.hb_stop_at). For each expiry it reports, from the audit
# journal and the guest's own serial output:
#   detect_ms   how long past the timeout the silence was noticed
#   restore_ms  rollback request → guest resumed (the engine's total_ms)
#   beyond_ms   detect + restore: what the workload loses beyond the timeout (goal < 1000)
# and when the guest printed its first tick back at the snapshot point (seen by polling).
# Prints figures; asserts nothing. BACKSTOP_BENCH_PRELOAD=1 runs it with a preloaded standby.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
reps=${1:-3}
timeout_s=${BACKSTOP_BENCH_HB_TIMEOUT:-4}
scripts/setup.sh >/dev/null
cargo build --release --quiet -p backstopd -p backstop-cli
g=${BACKSTOP_GUEST_DIR:-$HOME/.cache/backstop/guest}
work=$(mktemp -d /tmp/bsbench-wd.XXXXXX)
run=/tmp/bsbw-$$
trap 'kill $daemon 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$work" "$run"' EXIT
cat >"$work/c.toml" <<TOML
[daemon]
state_dir = "$work/state"
run_dir = "$run"
[vm]
name = "bench"
memory_mib = 256
kernel = "$g/vmlinuz"
initrd = "$g/initrd.img"
append = "console=ttyS0 quiet panic=-1 no_timer_check backstop.hb_stop_at=12"
[[vm.disks]]
id = "data"
path = "$g/disk-base.qcow2"
[watchdog]
heartbeat_timeout_s = $timeout_s
boot_grace_s = 60
TOML
# BACKSTOP_BENCH_PRELOAD=1: the same with a standby preloaded with the rollback's target
# (docs/standby.md, "Preloaded").
if [ "${BACKSTOP_BENCH_PRELOAD:-0}" = 1 ]; then
	printf '[rollback]\nstandby = true\npreload = true\n' >>"$work/c.toml"
fi
target/release/backstopd --config "$work/c.toml" >"$work/log" 2>&1 &
daemon=$!
bs() { target/release/backstop --socket "$run/control.sock" "$@"; }
for _ in $(seq 1 300); do bs status >/dev/null 2>&1 && break; sleep 0.2; done
serial="$work/state/bench-serial.log"
until grep -q 'BACKSTOP tick ram=3 ' "$serial" 2>/dev/null; do sleep 0.2; done
bs snapshot create --reason "bench: agent alive" >/dev/null 2>&1
echo "heartbeat timeout ${timeout_s} s; the agent falls silent at guest uptime 12 s (again after each restore)"
printf '%-4s %10s %11s %10s\n' rep detect_ms restore_ms beyond_ms
python3 - "$work/state/audit/journal.jsonl" "$reps" "$timeout_s" <<'PY'
import json, sys, time
path, reps, timeout_s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
seen, rows = 0, []
deadline = time.time() + 60 * reps
while len(rows) < reps and time.time() < deadline:
    entries = [json.loads(l) for l in open(path)]
    init = [e for e in entries if e["event"] == "rollback.initiated" and e["fields"].get("trigger") == "watchdog_timeout"]
    done = [e for e in entries if e["event"] == "snapshot.restore.completed"]
    while len(rows) < min(len(init), len(done)):
        i = len(rows)
        reason = init[i]["fields"]["reason"]
        silent = int(reason.split("for ")[1].split(" ms")[0])
        detect = silent - timeout_s * 1000
        total = done[-(min(len(init), len(done)) - i)]["fields"]["total_ms"]
        rows.append((detect, total))
        print(f"{i+1:<4} {detect:>10} {total:>11} {detect+total:>10}", flush=True)
    time.sleep(0.5)
if rows:
    b = sorted(d + t for d, t in rows)
    print(f"median beyond-timeout latency: {b[len(b)//2]} ms (goal < 1000 ms)")
PY
