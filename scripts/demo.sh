#!/usr/bin/env bash
# The demo: boots the test guest under backstopd with the embedded default config, snapshots it,
# lets the guest change its RAM counter and its disk, and rolls it back from the console.
# Prints the guest pause of the snapshot and the time the rollback took.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
[ "$(id -u)" = 0 ] || { echo "demo: run as root (the default config uses /var/lib/backstop and /run/backstop)" >&2; exit 1; }

state=/var/lib/backstop
# The demo starts from a clean slate, but never wipes a state directory it did not create.
if [ -e "$state" ] && [ ! -e "$state/.backstop-demo" ]; then
	echo "demo: $state exists and was not created by this demo; refusing to touch it" >&2
	exit 1
fi

scripts/setup.sh
echo "== building (release)"
cargo build --release --quiet -p backstopd -p backstop-cli
bd=target/release/backstopd
bs=target/release/backstop
rm -rf "$state"
mkdir -p "$state" && touch "$state/.backstop-demo"

log=$(mktemp /tmp/backstopd-demo.XXXXXX.log)
echo "== starting backstopd (embedded default config; log: $log)"
"$bd" >"$log" 2>&1 &
daemon=$!
trap 'kill $daemon 2>/dev/null; wait $daemon 2>/dev/null || true' EXIT
for _ in $(seq 1 600); do
	"$bs" status >/dev/null 2>&1 && break
	kill -0 $daemon 2>/dev/null || { echo "backstopd exited:"; cat "$log"; exit 1; }
	sleep 0.2
done
"$bs" status

serial="$state/demo-serial.log"
last_tick() { grep -a 'BACKSTOP tick' "$serial" | tail -n 1; }
wait_ticks() { # wait until the guest has printed N more ticks
	local n=$1 start; start=$(grep -ac 'BACKSTOP tick' "$serial" || true)
	for _ in $(seq 1 600); do
		[ "$(grep -ac 'BACKSTOP tick' "$serial" || true)" -ge $((start + n)) ] && return 0
		sleep 0.2
	done
	echo "demo: the guest stopped ticking" >&2; exit 1
}

echo "== waiting for the guest to boot and count"
wait_ticks 3
echo "guest says:   $(last_tick)"

echo "== snapshot"
before_snap=$(last_tick)
"$bs" snapshot create --reason "demo: before the change"
id=$("$bs" --json snapshot list | python3 -c 'import json,sys; print(json.load(sys.stdin)["snapshots"][-1]["snapshot_id"])')
pause=$("$bs" --json snapshot show "$id" | python3 -c 'import json,sys; print(json.load(sys.stdin)["summary"]["pause_us"])')
echo "guest says:   $before_snap   <- last tick before the snapshot request"
echo "              $(last_tick)   <- first tick after it (the capture instant lies between)"

echo "== the guest changes its RAM counter and its disk"
wait_ticks 8
echo "guest says:   $(last_tick)"

echo "== rollback"
before=$(wc -l <"$serial")
"$bs" rollback --to "$id" --reason "demo: undo the change"
took=$("$bs" --json audit tail -n 5 | python3 -c '
import json,sys
for e in reversed(json.load(sys.stdin)["entries"]):
    if e["event"] == "snapshot.restore.completed":
        print(e["fields"]["total_ms"]); break')
wait_ticks 2
echo "guest says (after rollback):"
tail -n +"$((before + 1))" "$serial" | grep -a 'BACKSTOP' | grep -av "tick ram=.*" | sed 's/^/              /' || true
tail -n +"$((before + 1))" "$serial" | grep -a 'BACKSTOP tick' | head -n 3 | sed 's/^/              /'

echo "== audit"
"$bs" audit verify

echo
echo "snapshot guest pause: ${pause} us"
echo "rollback took:        ${took} ms (request to guest running at the snapshot point)"
