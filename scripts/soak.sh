#!/usr/bin/env bash
# Soak run: N snapshots of the tiny test guest (retention every 10), sampling after each the
# running disk chain's depth, the daemon's open descriptors, the state directory's size and the
# daemon's RSS (tests/tests/soak.rs). Prints the four series, a text plot of each, and fails if
# any of them grows.
#
#   scripts/soak.sh [--snapshots N]      (default 1000; CI runs 100 inside scripts/test.sh)
set -euo pipefail

snapshots=1000
while (($#)); do
	case $1 in
	--snapshots) snapshots=${2:?--snapshots needs a number}; shift 2 ;;
	-h | --help) sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
	*) echo "soak: unknown argument $1 (see --help)" >&2; exit 2 ;;
	esac
done
[[ $snapshots =~ ^[0-9]+$ ]] || { echo "soak: --snapshots must be a number" >&2; exit 2; }

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cd "$here/.."
"$here/setup.sh" >/dev/null
cargo build --workspace --all-targets --features backstopd/fault-injection
out=$(mktemp)
trap 'rm -f "$out"' EXIT
status=0
BACKSTOP_REQUIRE_E2E=1 BACKSTOP_SOAK_SNAPSHOTS=$snapshots cargo test -p backstop-e2e --test soak \
	-- --nocapture 2>&1 | tee "$out" | grep -v '^soak,' || status=$?
grep '^soak,[0-9]' "$out" >"$out.csv" || true
echo
echo "series (n, chain depth, open fds, state dir KiB, daemon RSS KiB): $(wc -l <"$out.csv") samples"
# One text plot per series: 60 columns, each the max of its bucket, scaled min..max to 8 levels.
awk -F, '
	{ n = NR; for (c = 3; c <= 6; c++) v[c, n] = $c }
	END {
		split("chain depth,open fds,state KiB,RSS KiB", name, ",")
		split("▁ ▂ ▃ ▄ ▅ ▆ ▇ █", bar, " ")
		for (c = 3; c <= 6; c++) {
			lo = v[c, 1]; hi = v[c, 1]
			for (i = 1; i <= n; i++) { if (v[c, i] < lo) lo = v[c, i]; if (v[c, i] > hi) hi = v[c, i] }
			line = ""
			cols = n < 60 ? n : 60
			for (b = 0; b < cols; b++) {
				m = lo
				for (i = int(b * n / cols) + 1; i <= int((b + 1) * n / cols); i++) if (v[c, i] > m) m = v[c, i]
				lvl = hi > lo ? int((m - lo) * 7 / (hi - lo)) + 1 : 1
				line = line bar[lvl]
			}
			printf "%-12s %s  min %s max %s last %s\n", name[c - 2], line, lo, hi, v[c, n]
		}
	}' "$out.csv"
rm -f "$out.csv"
exit "$status"
