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
		qemu-system-x86 qemu-utils/bookworm busybox-static cpio kmod xz-utils ||
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

guest=${BACKSTOP_GUEST_DIR:-$HOME/.cache/backstop/guest}
log "$qemu_version"
log "guest: $guest ($(sed -n 's/^kernel_release=//p' "$guest/stamp"))"
echo "$guest"
