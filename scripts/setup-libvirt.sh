#!/usr/bin/env bash
# Prepare a Debian 12 host for backstop's libvirt backend and its tests:
# install libvirt 9.0 (daemon, clients, headers for the `virt` crate), make its
# QEMU driver work in a container without systemd, and start virtlogd and
# libvirtd if they are not running. Idempotent and non-interactive; prints the
# libvirt version on stdout.
#
# Called by scripts/setup.sh when BACKSTOP_WITH_LIBVIRT=1 (docs/libvirt.md says what the
# libvirt backend needs of the host). Needs root.
set -euo pipefail

die() { echo "setup-libvirt: error: $*" >&2; exit 1; }
log() { echo "setup-libvirt: $*" >&2; }

[[ $EUID -eq 0 ]] || die "needs root (libvirtd runs as root; qemu:///system)"

declare -A needs=(
	[libvirt-daemon-system]=/usr/sbin/libvirtd
	[libvirt-clients]=/usr/bin/virsh
	[libvirt-dev]=/usr/lib/x86_64-linux-gnu/pkgconfig/libvirt-qemu.pc
	[pkg-config]=/usr/bin/pkg-config
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
	apt-get update -q >/dev/null || die "apt-get update failed"
	# --no-install-recommends: no dnsmasq/firewall/qemu-system-* recommends;
	# the QEMU is the system's 7.2 installed by setup.sh.
	apt-get install -y -q --no-install-recommends \
		libvirt-daemon-system libvirt-clients libvirt-dev pkg-config >/dev/null ||
		die "apt-get install failed"
	for pkg in "${!needs[@]}"; do
		[[ -e ${needs[$pkg]} ]] || die "$pkg installed but ${needs[$pkg]} is missing"
	done
fi

# /dev/kvm as Debian's udev rule leaves it (root:kvm 0660; libvirt-qemu is in group kvm).
# Containers without udev have root:root 0600: libvirt then finds KVM "not usable" for its QEMU
# user while its capability probe (run as root) reports KVM, so it throws its capability cache
# away and re-probes QEMU on every define/lookup (84 s each on these machines, measured).
if [[ -c /dev/kvm ]] && getent group kvm >/dev/null &&
	[[ $(stat -c '%G %a' /dev/kvm) != "kvm 660" ]]; then
	log "/dev/kvm: root:kvm 0660 (as udev does on Debian)"
	chgrp kvm /dev/kvm
	chmod 0660 /dev/kvm
fi

# qemu.conf: libvirt's defaults were enough to start a TCG domain in this container
# (no systemd, cgroup v1 mounted, no AppArmor): security_driver, namespaces and
# cgroup_controllers stay as shipped (docs/libvirt.md, "Tried"). A host that needs
# some of them sets BACKSTOP_LIBVIRT_QEMU_CONF, e.g.
#   'security_driver="none" namespaces=[] cgroup_controllers=[]'
# A marked block, rewritten each time: idempotent.
conf=/etc/libvirt/qemu.conf
begin='# >>> backstop setup-libvirt.sh'
end='# <<< backstop setup-libvirt.sh'
block=$(
	echo "$begin"
	echo "# Added for containers without systemd (see backstop docs/libvirt.md)."
	for kv in ${BACKSTOP_LIBVIRT_QEMU_CONF:-}; do
		echo "${kv%%=*} = ${kv#*=}"
	done
	echo "$end"
)
tmp=$(mktemp)
sed "/^$begin\$/,/^$end\$/d" "$conf" >"$tmp"
echo "$block" >>"$tmp"
restart=0
if ! cmp -s "$tmp" "$conf"; then
	cat "$tmp" >"$conf"
	restart=1
	log "updated $conf"
fi
rm -f "$tmp"

# QEMU 10 for libvirt's domains (the libvirt tests' second pass): scripts/setup.sh unpacks it under
# root's home, which libvirt's QEMU user (libvirt-qemu) cannot traverse, so a copy of the binary,
# its firmware and modules goes where it can, behind its own wrapper. QEMU resolves its module and
# firmware directories relative to its binary when a `qemu-bundle` directory sits beside it: without
# one, libvirt's capability probe (`qom-list-types` loads every module) made the 10.0 binary load
# the system 7.2's modules and abort (`Only modules from the same build can be loaded`, then an
# assertion in util/module.c), so libvirt refused to define the domain. The bundle points the
# modules and QEMU's data at the copy, and SeaBIOS and iPXE at the system's packages (where the
# unpacked QEMU found them before). Idempotent: redone only when the source binary changes.
qemu10_src=${BACKSTOP_QEMU10_DIR:-$HOME/.cache/backstop/qemu-10}
qemu10_dst=${BACKSTOP_LIBVIRT_QEMU10_DIR:-/var/lib/backstop-qemu10}
if [[ -x $qemu10_src/usr/bin/qemu-system-x86_64 ]]; then
	stamp=$(stat -c '%s %Y' "$qemu10_src/usr/bin/qemu-system-x86_64")
	if [[ $(cat "$qemu10_dst/stamp" 2>/dev/null) != "$stamp" ]]; then
		log "publishing QEMU 10 for libvirt at $qemu10_dst"
		rm -rf "$qemu10_dst.new"
		mkdir -p "$qemu10_dst.new/bin" "$qemu10_dst.new/usr/bin" "$qemu10_dst.new/usr/share" \
			"$qemu10_dst.new/usr/lib/x86_64-linux-gnu"
		cp -a "$qemu10_src/usr/bin/qemu-system-x86_64" "$qemu10_dst.new/usr/bin/"
		cp -a "$qemu10_src/usr/share/qemu" "$qemu10_dst.new/usr/share/"
		cp -a "$qemu10_src/usr/lib/x86_64-linux-gnu/qemu" "$qemu10_dst.new/usr/lib/x86_64-linux-gnu/"
		bundle=$qemu10_dst.new/usr/bin/qemu-bundle
		mkdir -p "$bundle/usr/share" "$bundle/usr/lib/x86_64-linux-gnu"
		ln -s "$qemu10_dst/usr/share/qemu" "$bundle/usr/share/qemu"
		ln -s "$qemu10_dst/usr/lib/x86_64-linux-gnu/qemu" "$bundle/usr/lib/x86_64-linux-gnu/qemu"
		ln -s /usr/share/seabios "$bundle/usr/share/seabios"
		ln -s /usr/lib/ipxe "$bundle/usr/lib/ipxe"
		{
			echo '#!/bin/sh'
			echo '# QEMU 10 for libvirt domains, published by backstop scripts/setup-libvirt.sh. exec keeps the pid.'
			echo "QEMU_MODULE_DIR='$qemu10_dst/usr/lib/x86_64-linux-gnu/qemu'"
			echo 'export QEMU_MODULE_DIR'
			echo "exec '$qemu10_dst/usr/bin/qemu-system-x86_64' -L '$qemu10_dst/usr/share/qemu' \"\$@\""
		} >"$qemu10_dst.new/bin/qemu-system-x86_64"
		chmod 0755 "$qemu10_dst.new/bin/qemu-system-x86_64"
		chmod -R a+rX "$qemu10_dst.new"
		echo "$stamp" >"$qemu10_dst.new/stamp"
		rm -rf "$qemu10_dst"
		mv "$qemu10_dst.new" "$qemu10_dst"
	fi
	version=$(runuser -u libvirt-qemu -- "$qemu10_dst/bin/qemu-system-x86_64" --version 2>&1 | head -n1) || true
	[[ $version == *"version 10."* ]] || die "libvirt-qemu cannot run $qemu10_dst/bin/qemu-system-x86_64: $version"
	log "QEMU 10 for libvirt domains: $qemu10_dst/bin/qemu-system-x86_64 ($version)"
else
	log "no unpacked QEMU 10 at $qemu10_src (scripts/setup.sh unpacks it): libvirt's QEMU 10 pass cannot run"
fi

# backstop's libvirt hook (HALTED domains are not startable), as the package installs it.
# libvirtd finds hooks when it starts: a new or changed one restarts it.
hook=/etc/libvirt/hooks/qemu.d/backstop
if ! cmp -s "$(dirname "$0")/../vmm-config/libvirt-hooks/backstop" "$hook"; then
	install -D -m 0755 "$(dirname "$0")/../vmm-config/libvirt-hooks/backstop" "$hook"
	log "installed the libvirt hook $hook"
	restart=1
fi

if ! pgrep -x virtlogd >/dev/null; then
	log "starting virtlogd"
	virtlogd -d || die "virtlogd -d failed"
fi
if ((restart)) && pid=$(pgrep -x libvirtd); then
	log "restarting libvirtd (pid $pid) for the new qemu.conf or hook"
	kill "$pid"
	for _ in $(seq 50); do pgrep -x libvirtd >/dev/null || break; sleep 0.1; done
fi
if ! pgrep -x libvirtd >/dev/null; then
	log "starting libvirtd"
	libvirtd -d || die "libvirtd -d failed"
fi
for _ in $(seq 100); do
	if virsh -c qemu:///system version >/dev/null 2>&1; then break; fi
	sleep 0.1
done
version=$(virsh -c qemu:///system version 2>&1) || die "libvirtd does not answer: $version"
log "$(echo "$version" | tr '\n' ';')"
virsh -c qemu:///system version --daemon | sed -n 's/^Running against daemon: *//p' |
	sed 's/^/libvirt /'
