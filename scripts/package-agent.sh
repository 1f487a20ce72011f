#!/usr/bin/env bash
# Builds the Debian package `backstop-agent`, the guest agent, from a static release build:
#
#   bash scripts/package-agent.sh [--out DIR]
#
# and prints the .deb's path as its last line (default DIR: <cargo target dir>/debian).
#
# The binary runs inside guests, whatever their libc (or none: the busybox test guest), so it is
# linked statically. Not with the musl target (not installed here), but with glibc's static
# libraries, on the host's own gnu target:
#
#   RUSTFLAGS="-C target-feature=+crt-static" \
#     cargo build --release -p backstop-agent --target x86_64-unknown-linux-gnu
#
# --target is needed although it names the host: with it, RUSTFLAGS reaches only what is built
# for the target, not build scripts and proc-macros (clap's derive, thiserror), which cannot be
# linked static. The build goes to <target dir>/<triple>/release/, apart from the workspace's
# other builds, which it neither rebuilds nor disturbs. The binary uses nothing of glibc that
# needs loading at run time (no NSS, no dlopen). The script refuses a binary with an ELF
# interpreter or a NEEDED library.
#
# The package: /usr/sbin/backstop-agent (debug info stripped, symbols kept); the unit
# dist/backstop-agent/backstop-agent.service in /lib/systemd/system and the udev rule
# 60-backstop-agent.rules in /lib/udev/rules.d (the unit starts when the port appears); README
# and copyright in /usr/share/doc/backstop-agent (dist/backstop-agent/copyright, then every crate
# the binary links with its licence: ci/check-licenses.py); the maintainer scripts of dist/backstop-agent/
# (enable on first install, restart on upgrade, stop on removal). Depends on nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
umask 022

out=""
while [[ $# -gt 0 ]]; do
	case $1 in
	--out)
		out=${2:?--out needs a directory}
		shift
		;;
	-h | --help)
		sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"
		exit 0
		;;
	*)
		echo "package-agent.sh: unknown argument $1 (see --help)" >&2
		exit 2
		;;
	esac
	shift
done

triple=$(rustc -vV | sed -n 's/^host: //p')
if [[ $triple != *-linux-gnu ]]; then
	echo "package-agent.sh: the host target is $triple; this builds on a *-linux-gnu host" >&2
	exit 1
fi
target=${CARGO_TARGET_DIR:-target}
bin=$target/$triple/release/backstop-agent
out=${out:-$target/debian}

RUSTFLAGS="${RUSTFLAGS:+$RUSTFLAGS }-C target-feature=+crt-static" \
	cargo build --release -p backstop-agent --target "$triple"

# Static, or refused: no interpreter, no shared library.
if readelf -lW "$bin" | grep -q 'INTERP' || readelf -dW "$bin" | grep -q '(NEEDED)'; then
	echo "package-agent.sh: $bin is not static:" >&2
	readelf -dW "$bin" | grep '(NEEDED)' >&2 || true
	exit 1
fi

version=$(sed -n '/^\[workspace\.package\]/,/^\[/s/^version = "\(.*\)"$/\1/p' Cargo.toml)
arch=$(dpkg --print-architecture)
got=$("$bin" --version)
if [[ $got != "backstop-agent $version" ]]; then
	echo "package-agent.sh: $bin --version says '$got', Cargo.toml says $version" >&2
	exit 1
fi

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
root=$stage/backstop-agent
dist=dist/backstop-agent
install -d -m 0755 "$root"

install -d -m 0755 "$root/usr/sbin"
objcopy --strip-debug "$bin" "$root/usr/sbin/backstop-agent"
chmod 0755 "$root/usr/sbin/backstop-agent"
install -D -m 0644 "$dist/backstop-agent.service" "$root/lib/systemd/system/backstop-agent.service"
install -D -m 0644 "$dist/60-backstop-agent.rules" "$root/lib/udev/rules.d/60-backstop-agent.rules"
install -D -m 0644 "$dist/README" "$root/usr/share/doc/backstop-agent/README"
python3 ci/check-licenses.py --copyright backstop-agent "$root/usr/share/doc/backstop-agent/copyright"
chmod 0644 "$root/usr/share/doc/backstop-agent/copyright"

installed_kib=$(du -sk "$root" | cut -f1)
install -d -m 0755 "$root/DEBIAN"
install -m 0755 "$dist/postinst" "$dist/prerm" "$dist/postrm" "$root/DEBIAN/"
cat >"$root/DEBIAN/control" <<CONTROL
Package: backstop-agent
Version: $version
Architecture: $arch
Maintainer: ${DEBFULLNAME:-backstop maintainers} <${DEBEMAIL:-root@localhost}>
Installed-Size: $installed_kib
Section: admin
Priority: optional
Description: guest agent for backstop: heartbeats to the host, rollback epochs from it
 Runs inside a VM that backstop snapshots and rolls back. Once a second it
 sends the host a heartbeat over the virtio-serial port org.backstop.agent.0;
 when the host reports that the VM was rolled back, it writes the new epoch to
 /run/backstop/epoch and logs "backstop-agent: rollback epoch <n>".
 .
 The binary is static. The service is enabled on installation and runs
 whenever the VM has the port.
CONTROL

mkdir -p "$out"
deb=$out/backstop-agent_${version}_${arch}.deb
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || date +%s)}
dpkg-deb --root-owner-group -Zxz --build "$root" "$deb" >/dev/null
echo "package-agent.sh: built $(du -h "$deb" | cut -f1) package, static $(du -h "$root/usr/sbin/backstop-agent" | cut -f1) binary, no dependencies"
echo "$deb"
