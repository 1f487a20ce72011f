#!/usr/bin/env bash
# Prepare a Debian 12 host for backstop's QEMU tests: install the host
# packages, then build (or reuse) the test guest. Idempotent and
# non-interactive; when everything is already in place it only checks.
#
# CI runs this on a clean machine as root. See DESIGN.md, "Machines this
# builds and tests on".
set -euo pipefail

die() { echo "setup: error: $*" >&2; exit 1; }
log() { echo "setup: $*" >&2; }

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

# package -> a file it must provide. Checking the file as well as the dpkg
# status catches a package that is "installed" but lost its binary (e.g. a
# newer qemu-utils removed while installing qemu-system-x86).
declare -A needs=(
	[qemu-system-x86]=/usr/bin/qemu-system-x86_64
	[qemu-utils]=/usr/bin/qemu-img
	[busybox-static]=/bin/busybox # the guest's whole userland; must be static
	[cpio]=/usr/bin/cpio          # initramfs archive
	[kmod]=/sbin/depmod           # modules.dep for the downloaded kernel
	[xz-utils]=/usr/bin/xz        # unpacks the kernel out of its bzImage
	[ovmf]=/usr/share/OVMF/OVMF_CODE_4M.fd # UEFI firmware (firmware = "ovmf" tests)
	[iproute2]=/sbin/ip                    # network namespace, bridge and tap of the tap-NIC test
	[python3]=/usr/bin/python3             # scripts/run-tests.py, the benchmarks
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
	[[ $EUID -eq 0 ]] || die "installing packages needs root (rerun as root)"
	export DEBIAN_FRONTEND=noninteractive
	apt-get update -q || die "apt-get update failed"
	# qemu-system-x86 can pull out a newer qemu-utils (and with it qemu-img)
	# that some images ship; asking for bookworm's qemu-utils alongside keeps
	# a matching one, downgrading if needed.
	apt-get install -y -q --allow-downgrades \
		qemu-system-x86 qemu-utils/bookworm busybox-static cpio kmod xz-utils ovmf iproute2 python3 ||
		die "apt-get install failed"
	for pkg in "${!needs[@]}"; do
		[[ -e ${needs[$pkg]} ]] || die "$pkg installed but ${needs[$pkg]} is missing"
	done
fi

qemu_version=$(qemu-system-x86_64 --version | head -n1)
case $qemu_version in
*" 7.2."*) ;;
*) log "warning: backstop is developed against QEMU 7.2, found: $qemu_version" ;;
esac

"$here/build-guest.sh" || die "building the test guest failed"

# A stock Debian guest booted from its own disk, with qemu-guest-agent (debian_guest.rs):
# built from Debian's packages (~35 s, ~125 MiB downloaded), cached like the test guest.
# Needs root (mmdebstrap); without it the tests that use it skip, saying why.
if [[ $EUID -eq 0 ]]; then
	"$here/build-debian-guest.sh" >&2 || die "building the Debian test guest failed"
else
	log "not root: the Debian test guest is not built (its tests skip)"
fi

# QEMU 10 beside the system's 7.2, never replacing it: bookworm-backports' packages unpacked
# with dpkg-deb into a directory (they run on bookworm's libraries), behind a wrapper that
# `exec`s the binary (same pid: PR_SET_PDEATHSIG and pid tracking keep working) with the
# unpacked firmware (-L) and modules. The QEMU end-to-end tests run against both.
qemu10_dir=${BACKSTOP_QEMU10_DIR:-$HOME/.cache/backstop/qemu-10}
qemu10=$qemu10_dir/bin/qemu-system-x86_64
if [[ -x $qemu10 ]] && "$qemu10" --version 2>/dev/null | head -n1 | grep -q "version 10\."; then
	:
else
	[[ $EUID -eq 0 ]] || die "installing QEMU 10 needs root (rerun as root)"
	export DEBIAN_FRONTEND=noninteractive
	# The backports suite, on the host the system's own Debian sources use.
	mirror=$(grep -rhoE 'https?://[^ ]+/debian/?( |$)' /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null |
		head -n1 | tr -d ' ' | sed 's,/$,,') || true
	mirror=${mirror:-http://deb.debian.org/debian}
	if ! grep -rqsE '^[^#]*bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/; then
		log "adding bookworm-backports ($mirror)"
		echo "deb $mirror bookworm-backports main" >/etc/apt/sources.list.d/backstop-bookworm-backports.list
	fi
	apt-get update -q >/dev/null || die "apt-get update failed"
	work=$(mktemp -d)
	chmod 0755 "$work" # apt downloads as _apt
	trap 'rm -rf "$work"' EXIT
	# Backports is never the candidate (priority 100): name the suite.
	(cd "$work" && apt-get download -q qemu-system-x86/bookworm-backports \
		qemu-system-common/bookworm-backports qemu-system-data/bookworm-backports) ||
		die "apt-get download of QEMU 10 from bookworm-backports failed"
	rm -rf "$qemu10_dir.new"
	mkdir -p "$qemu10_dir.new/bin"
	for deb in "$work"/*.deb; do
		dpkg-deb -x "$deb" "$qemu10_dir.new" || die "dpkg-deb -x $deb failed"
	done
	{
		echo '#!/bin/sh'
		echo '# QEMU 10 from bookworm-backports, unpacked by backstop scripts/setup.sh. exec keeps the pid.'
		echo "QEMU_MODULE_DIR='$qemu10_dir/usr/lib/x86_64-linux-gnu/qemu'"
		echo 'export QEMU_MODULE_DIR'
		echo "exec '$qemu10_dir/usr/bin/qemu-system-x86_64' -L '$qemu10_dir/usr/share/qemu' \"\$@\""
	} >"$qemu10_dir.new/bin/qemu-system-x86_64"
	chmod 0755 "$qemu10_dir.new/bin/qemu-system-x86_64"
	rm -rf "$qemu10_dir"
	mv "$qemu10_dir.new" "$qemu10_dir"
	version=$("$qemu10" --version 2>&1 | head -n1) || true
	[[ $version == *"version 10."* ]] || die "the unpacked QEMU 10 does not run: $version"
fi

# libvirt (the libvirt backend and its tests): opt-in, ~55 s on a fresh machine (apt).
if [[ ${BACKSTOP_WITH_LIBVIRT:-0} == 1 ]]; then
	"$here/setup-libvirt.sh" >&2 || die "setting up libvirt failed"
fi

# Ceph (one monitor, a memstore OSD and a RADOS Gateway for the off-host replication tests):
# opt-in, ~21 s on a fresh machine (apt, 62 MB); scripts/ceph-cluster.sh starts the throwaway
# clusters the tests use.
if [[ ${BACKSTOP_WITH_CEPH:-0} == 1 ]]; then
	"$here/setup-ceph.sh" >&2 || die "setting up Ceph failed"
fi

guest=${BACKSTOP_GUEST_DIR:-$HOME/.cache/backstop/guest}
log "$qemu_version"
log "guest: $guest ($(sed -n 's/^kernel_release=//p' "$guest/stamp"))"
log "QEMU 10: $qemu10 ($("$qemu10" --version | head -n1))"
# stdout: the guest directory, then the QEMU 10 wrapper (BACKSTOP_QEMU for the second test pass).
echo "$guest"
echo "$qemu10"
