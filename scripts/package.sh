#!/usr/bin/env bash
# Builds the Debian package `backstop` from a release build:
#
#   bash scripts/package.sh [--out DIR] [--no-libvirt]
#
# and prints the .deb's path as its last line (default DIR: <cargo target dir>/debian). The
# release build is ci/release-check.sh's own (same command, profile and CARGO_TARGET_DIR), so CI
# compiles once. backstopd is built with the libvirt backend (most hosts run their VMs under
# libvirt): it links libvirt0 and needs libvirt-dev to build (scripts/setup-libvirt.sh).
# --no-libvirt builds it without (no libvirt0 dependency; a VM file with backend = "libvirt" is
# then refused at load).
#
# The package: /usr/bin/backstopd and backstop (debug info stripped, symbols kept), the unit
# vmm-config/backstopd.service, /etc/backstop/backstopd.toml (vmm-config/backstopd.toml) and
# /etc/backstop/vms.d/ (its README and *.toml.sample, which the daemon does not read), all of
# /etc as conffiles; man pages and bash/zsh/fish completions rendered by backstop-dist; README and
# copyright in /usr/share/doc/backstop (dist/debian/copyright, then every crate the binaries link
# with its licence: ci/check-licenses.py, which refuses a licence deny.toml does not allow). Depends: the shared libraries the binaries link
# (dpkg-shlibdeps), qemu-system-x86 and qemu-utils. The maintainer scripts (dist/debian/) only
# make systemd re-read its units; nothing is enabled or started. ci/package-check.sh installs
# the result into a scratch root and checks it.
set -euo pipefail
cd "$(dirname "$0")/.."
umask 022

out=""
libvirt=1
while [[ $# -gt 0 ]]; do
	case $1 in
	--out)
		out=${2:?--out needs a directory}
		shift
		;;
	--libvirt) libvirt=1 ;;
	--no-libvirt) libvirt=0 ;;
	-h | --help)
		sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"
		exit 0
		;;
	*)
		echo "package.sh: unknown argument $1 (see --help)" >&2
		exit 2
		;;
	esac
	shift
done

target=${CARGO_TARGET_DIR:-target}
release=$target/release
out=${out:-$target/debian}
features=()
[[ $libvirt == 1 ]] && features=(--features backstopd/libvirt)

cargo build --release -p backstopd -p backstop-cli "${features[@]}"
# Built on its own: added to the command above it could change the features the daemon is
# built with. After the default build it compiles only itself and its three small dependencies.
cargo build --release -p backstop-dist

version=$(sed -n '/^\[workspace\.package\]/,/^\[/s/^version = "\(.*\)"$/\1/p' Cargo.toml)
arch=$(dpkg --print-architecture)
for bin in backstopd backstop; do
	got=$("$release/$bin" --version)
	if [[ $got != "$bin $version" ]]; then
		echo "package.sh: $release/$bin --version says '$got', Cargo.toml says $version" >&2
		exit 1
	fi
done

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
root=$stage/debian/backstop  # where dpkg-shlibdeps expects a package's files
install -d -m 0755 "$root"

# Binaries and the unit.
install -d -m 0755 "$root/usr/bin"
for bin in backstopd backstop; do
	objcopy --strip-debug "$release/$bin" "$root/usr/bin/$bin"
	chmod 0755 "$root/usr/bin/$bin"
done
install -D -m 0644 vmm-config/backstopd.service "$root/lib/systemd/system/backstopd.service"

# Configuration (conffiles).
install -D -m 0644 vmm-config/backstopd.toml "$root/etc/backstop/backstopd.toml"
install -d -m 0755 "$root/etc/backstop/vms.d"
install -m 0644 vmm-config/vms.d/README vmm-config/vms.d/*.toml.sample "$root/etc/backstop/vms.d/"
# The libvirt hook that keeps a domain backstop HALTED from being started (libvirt ≥ 6.5 runs
# every script in hooks/qemu.d/; libvirtd reads them when it starts).
install -D -m 0755 vmm-config/libvirt-hooks/backstop "$root/etc/libvirt/hooks/qemu.d/backstop"

# Man pages and completions, rendered from the clap definitions.
"$release/backstop-dist" --out "$stage/gen"
install -d -m 0755 "$root/usr/share/man/man1" "$root/usr/share/man/man8"
for page in "$stage"/gen/man/*.1 "$stage"/gen/man/*.8; do
	section=${page##*.}
	gzip -9n <"$page" >"$root/usr/share/man/man$section/$(basename "$page").gz"
	chmod 0644 "$root/usr/share/man/man$section/$(basename "$page").gz"
done
for bin in backstop backstopd; do
	install -D -m 0644 "$stage/gen/completions/$bin.bash" \
		"$root/usr/share/bash-completion/completions/$bin"
	install -D -m 0644 "$stage/gen/completions/_$bin" \
		"$root/usr/share/zsh/vendor-completions/_$bin"
	install -D -m 0644 "$stage/gen/completions/$bin.fish" \
		"$root/usr/share/fish/vendor_completions.d/$bin.fish"
done

# Documentation.
install -D -m 0644 README.md "$root/usr/share/doc/backstop/README.md"
# Written from Cargo.lock at each build, so it names the crates this build links.
python3 ci/check-licenses.py --copyright backstop "$root/usr/share/doc/backstop/copyright"
chmod 0644 "$root/usr/share/doc/backstop/copyright"

# Control area. dpkg-shlibdeps reads the libraries' symbol files for the lowest versions the
# binaries need; it wants a debian/control beside the package root and DEBIAN/ in it.
installed_kib=$(du -sk "$root" | cut -f1)
install -d -m 0755 "$root/DEBIAN"
printf 'Source: backstop\n\nPackage: backstop\nArchitecture: any\n' >"$stage/debian/control"
shlibs=$(cd "$stage" && dpkg-shlibdeps -O debian/backstop/usr/bin/backstopd debian/backstop/usr/bin/backstop)
shlibs=${shlibs#shlibs:Depends=}
install -m 0755 dist/debian/postinst dist/debian/prerm dist/debian/postrm "$root/DEBIAN/"
(cd "$root" && find etc -type f | sort | sed 's|^|/|') >"$root/DEBIAN/conffiles"
suggests=""
[[ $libvirt == 1 ]] && suggests="Suggests: libvirt-daemon-system
"
cat >"$root/DEBIAN/control" <<CONTROL
Package: backstop
Version: $version
Architecture: $arch
Maintainer: ${DEBFULLNAME:-backstop maintainers} <${DEBEMAIL:-root@localhost}>
Installed-Size: $installed_kib
Section: admin
Priority: optional
Depends: $shlibs, qemu-system-x86, qemu-utils
${suggests}Description: live snapshots and atomic rollback of the VMs a host runs
 backstopd runs on the host beside QEMU, takes live snapshots of a VM's RAM,
 device state and disks at one instant, and restores the whole VM to one of
 them atomically, or halts it until a person clears it. Every step is written
 to a hash-chained, HMAC-sealed audit journal. backstop is its console.
 .
 The service is installed but not enabled: put one NAME.toml per VM in
 /etc/backstop/vms.d/, then systemctl enable --now backstopd.
CONTROL

mkdir -p "$out"
deb=$out/backstop_${version}_${arch}.deb
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || date +%s)}
dpkg-deb --root-owner-group -Zxz --build "$root" "$deb" >/dev/null
echo "package.sh: built $(du -h "$deb" | cut -f1) package (Depends: $shlibs, qemu-system-x86, qemu-utils)"
echo "$deb"
