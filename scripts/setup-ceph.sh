#!/usr/bin/env bash
# Prepare a Debian 12 host for backstop's off-host replication tests: install the Ceph daemons a
# throwaway single-host cluster needs (one monitor, one memory-backed OSD, one RADOS Gateway;
# scripts/ceph-cluster.sh starts and stops it). Idempotent and non-interactive; prints the Ceph
# version on stdout.
#
# Called by scripts/setup.sh when BACKSTOP_WITH_CEPH=1. Needs root. No mgr (S3 does not need
# one) and --no-install-recommends: ~53 packages, ~62 MB.
set -euo pipefail

die() { echo "setup-ceph: error: $*" >&2; exit 1; }
log() { echo "setup-ceph: $*" >&2; }

[[ $EUID -eq 0 ]] || die "needs root (apt-get)"

declare -A needs=(
	[ceph-mon]=/usr/bin/ceph-mon
	[ceph-osd]=/usr/bin/ceph-osd
	[radosgw]=/usr/bin/radosgw
	[ceph-common]=/usr/bin/radosgw-admin
)
installed() {
	[[ $(dpkg-query -W -f='${Status}' "$1" 2>/dev/null) == "install ok installed" ]]
}
missing=()
for pkg in "${!needs[@]}"; do
	if ! installed "$pkg" || [[ ! -e ${needs[$pkg]} ]]; then
		missing+=("$pkg")
	fi
done
if ((${#missing[@]})); then
	log "missing: ${missing[*]}"
	export DEBIAN_FRONTEND=noninteractive
	# An install straight away works when the package lists are fresh; update only if not.
	if ! apt-get install -y -q --no-install-recommends "${!needs[@]}" >/dev/null 2>&1; then
		apt-get update -q >/dev/null || die "apt-get update failed"
		apt-get install -y -q --no-install-recommends "${!needs[@]}" >/dev/null ||
			die "apt-get install failed"
	fi
	for pkg in "${!needs[@]}"; do
		[[ -e ${needs[$pkg]} ]] || die "$pkg installed but ${needs[$pkg]} is missing"
	done
fi
for tool in ceph-authtool monmaptool uuidgen curl; do
	command -v "$tool" >/dev/null || die "$tool not found"
done
ceph-mon --version | sed -n 's/^ceph version \([^ ]*\).*/ceph \1/p'
