#!/usr/bin/env bash
# backstop side by side with its peers, in one run, on the same guest: libvirt's
# internal snapshots (`virsh snapshot-create-as` / `snapshot-revert`) and QEMU's own
# stop-and-copy (`stop` + `migrate` to a file + `cont`, restore into a fresh QEMU).
#
#   sudo scripts/bench.sh            # full run: 1 GiB guest, 400 MiB of random data, 5 repetitions
#   sudo scripts/bench.sh --quick    # CI: 1 repetition, 256 MiB guest, 100 MiB of data
#
# Every contender runs once per QEMU version (the system 7.2 and the QEMU 10 wrapper setup.sh
# unpacks; virsh on the system QEMU only), then the watchdog expiry -> running figure per version.
# `python3 bench/report.py results/<timestamp>/raw.json` redraws the table from a saved run.
#   scripts/bench.sh --help          # every option (repetitions, sizes, contenders, ...)
# Method, goals and the figures of the saved run: docs/benchmarks.md.
#
# Installs what it needs (QEMU and the test guest via setup.sh, libvirt from Debian, matplotlib
# from PyPI into .cache/bench-venv), builds backstop in release mode, and runs bench/run.py, which
# prints a table of median / min / max with ratios against the peers and writes the same as JSON
# (summary.json, raw.json), table.txt and chart.png under results/<timestamp>/. It asserts no
# figure: it exits non-zero only when a contender could not be measured. Everything it starts
# (daemons, QEMUs, libvirt domains, and libvirtd/virtlogd if they were not running) is stopped
# and removed at the end.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

die() { echo "bench: error: $*" >&2; exit 1; }
log() { echo "bench: $*" >&2; }

for a in "$@"; do
	case $a in -h | --help) exec python3 bench/run.py --help ;; esac
done
[[ $EUID -eq 0 ]] || die "run as root (libvirt's system daemon, QEMU as root)"

# setup.sh prints the guest directory, then the QEMU 10 wrapper: every contender runs on the
# system QEMU (7.2) and on QEMU 10; virsh on the system QEMU only (libvirt is
# packaged with it and would have to be told about a second emulator).
BENCH_QEMU10=$(scripts/setup.sh | tail -n1) || die "scripts/setup.sh failed"
[[ -x $BENCH_QEMU10 ]] || die "scripts/setup.sh did not print the QEMU 10 wrapper (got: $BENCH_QEMU10)"
export BENCH_QEMU10

# --- libvirt, for the virsh peer -------------------------------------------------------------
# (libvirt-dev + pkg-config: backstopd is built with its libvirt backend for `bslibvirt`.)
if ! command -v virsh >/dev/null || ! command -v libvirtd >/dev/null ||
	! pkg-config --exists libvirt 2>/dev/null; then
	log "installing libvirt (Debian's libvirt-daemon-system, libvirt-clients, libvirt-dev)"
	export DEBIAN_FRONTEND=noninteractive
	pkgs=(libvirt-daemon-system libvirt-clients libvirt-dev pkg-config)
	apt-get install -y -q --no-install-recommends "${pkgs[@]}" >/dev/null ||
		{ apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends \
			"${pkgs[@]}" >/dev/null; } ||
		die "installing libvirt failed"
fi
started=()
stop_started() {
	local pidfile pid
	for pidfile in "${started[@]}"; do
		pid=$(cat "$pidfile" 2>/dev/null || true)
		if [[ -n $pid ]]; then kill "$pid" 2>/dev/null || true; fi
	done
}
trap stop_started EXIT
if ! virsh -q -c qemu:///system uri >/dev/null 2>&1; then
	# No systemd here: start the daemons ourselves, and stop them again at the end.
	if ! { [[ -f /run/virtlogd.pid ]] && kill -0 "$(cat /run/virtlogd.pid)" 2>/dev/null; }; then
		virtlogd -d && started+=(/run/virtlogd.pid)
	fi
	if ! { [[ -f /run/libvirtd.pid ]] && kill -0 "$(cat /run/libvirtd.pid)" 2>/dev/null; }; then
		libvirtd -d && started+=(/run/libvirtd.pid)
	fi
	for _ in $(seq 1 100); do
		virsh -q -c qemu:///system uri >/dev/null 2>&1 && break
		sleep 0.1
	done
	virsh -q -c qemu:///system uri >/dev/null 2>&1 || die "libvirtd does not answer on qemu:///system"
fi

# --- matplotlib for the chart, in a private venv ------------------------------------------------
venv=$root/.cache/bench-venv
python=python3
if "$venv/bin/python" -c 'import matplotlib' 2>/dev/null; then
	python=$venv/bin/python
else
	log "installing matplotlib into $venv"
	if python3 -m venv "$venv" && "$venv/bin/pip" install -q matplotlib >/dev/null; then
		python=$venv/bin/python
	else
		log "warning: no matplotlib; the run goes on without chart.png"
	fi
fi

log "building backstop (release)"
# With the libvirt backend (the `bslibvirt` contender adopts a libvirt domain; needs libvirt-dev).
cargo build --release --quiet -p backstopd -p backstop-cli --features backstopd/libvirt
# The store's ingest of a recorded stream (run.py runs it on each QEMU's recorded stream).
cargo build --release --quiet -p backstop-engine --example store_ingest

"$python" bench/run.py "$@"
