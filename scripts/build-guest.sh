#!/usr/bin/env bash
# Build the tiny test guest the QEMU backend tests boot: Debian's stock 6.1
# kernel plus a busybox-only initramfs whose /init (scripts/guest/init) runs a
# disk workload and a virtio-serial agent. See DESIGN.md, "Machines this
# builds and tests on".
#
# Output, outside the git tree so it never gets committed:
#   ${BACKSTOP_GUEST_DIR:-$HOME/.cache/backstop/guest}/
#     vmlinuz          kernel for -kernel (an uncompressed PVH ELF, see below)
#     vmlinuz.bzimage  Debian's original bzImage, same kernel
#     initrd.img       busybox + modules + /init + qemu-ga and its shared
#                      libraries, gzip'd newc cpio
#     disk-base.qcow2  64 MiB empty disk, the backing file for test overlays
#     stamp            input hash, then what was built (key=value lines)
#
# qemu-ga is Debian's qemu-guest-agent, for the guests that test
# vm.heartbeat = "qemu-ga" (scripts/guest/init, backstop.qga=1). It is the one
# dynamic binary in the guest: its libraries are the host's (resolved by ldd),
# which are the ones a Debian guest would have, as the host is Debian too.
#
# The stamp holds a hash of this script and scripts/guest/*, so a rerun with
# unchanged inputs is a no-op. The kernel is not part of the key on purpose:
# a new Debian kernel upload must not silently change a guest the tests
# already rely on; edit the inputs (or delete the stamp) to pick it up.
#
# Environment:
#   BACKSTOP_GUEST_DIR     output directory (default above)
#   BACKSTOP_GUEST_KERNEL  pin a kernel package, e.g. linux-image-6.1.0-56-amd64-unsigned
#   BACKSTOP_GUEST_FORCE=1 rebuild even if the stamp matches
set -euo pipefail

die() { echo "build-guest: error: $*" >&2; exit 1; }
log() { echo "build-guest: $*" >&2; }

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
guest_src=$here/guest
out=${BACKSTOP_GUEST_DIR:-$HOME/.cache/backstop/guest}
busybox=/bin/busybox # from busybox-static: must be static, the initramfs has no libc

[[ -f $guest_src/init && -f $guest_src/modules ]] || die "missing $guest_src/init or $guest_src/modules"

# --- cache check -------------------------------------------------------------
# File names are hashed with the contents so a rename also invalidates.
key=$(
	cd "$here"
	{
		echo "kernel-pin=${BACKSTOP_GUEST_KERNEL:-}"
		for f in build-guest.sh $(find guest -type f | LC_ALL=C sort); do
			echo "== $f"
			cat "$f"
		done
	} | sha256sum | cut -d' ' -f1
)

if [[ ${BACKSTOP_GUEST_FORCE:-0} != 1 && -f $out/stamp &&
	$(head -n1 "$out/stamp") == "$key" &&
	-f $out/vmlinuz && -f $out/initrd.img && -f $out/disk-base.qcow2 ]]; then
	log "up to date: $out"
	exit 0
fi

# --- tools -------------------------------------------------------------------
# depmod lives in /sbin, which a non-root PATH may lack.
PATH=$PATH:/usr/sbin:/sbin
for tool in apt-get apt-cache dpkg-deb depmod cpio gzip xz qemu-img sha256sum od ldd; do
	command -v "$tool" >/dev/null || die "'$tool' not found (run scripts/setup.sh)"
done
[[ -x $busybox ]] || die "$busybox not found (install busybox-static)"
# The dynamic "busybox" package ships the same path; its binary would fail in
# the guest with nothing but a kernel panic ("No working init found").
[[ $(dpkg-query -S "$busybox" 2>/dev/null) == busybox-static:* ]] ||
	die "$busybox is not from busybox-static; install busybox-static"

work=$(mktemp -d "${TMPDIR:-/tmp}/backstop-guest.XXXXXX")
trap 'rm -rf "$work"' EXIT

# --- kernel package ----------------------------------------------------------
# Newest generic 6.1 flavour. Not -cloud: it lacks i6300esb. Not -rt: slower
# to boot and nothing here needs it. The signed and -unsigned packages carry
# the same kernel and modules, so either will do; prefer -unsigned on a tie.
newest_kernel_pkg() {
	apt-cache search --names-only '^linux-image-6\.1\.0-[0-9]+-amd64(-unsigned)?$' |
		awk '$1 ~ /^linux-image-6\.1\.0-[0-9]+-amd64(-unsigned)?$/ {
			split($1, part, "-"); print part[4], ($1 ~ /-unsigned$/), $1 }' |
		sort -k1,1nr -k2,2nr | head -n1 | cut -d' ' -f3
}

has_candidate() {
	local cand
	cand=$(apt-cache policy "$1" 2>/dev/null | awk '/Candidate:/ { print $2 }')
	[[ -n $cand && $cand != "(none)" ]]
}

# A fresh machine may have empty package lists; refresh them once (for both
# packages) if we can. False if we cannot, or already did.
apt_refreshed=0
refresh_apt_lists() {
	[[ $EUID -eq 0 && $apt_refreshed == 0 ]] || return 1
	log "$1; running apt-get update"
	apt-get update -qq >/dev/null
	apt_refreshed=1
}

# download_deb PKG: fetch PKG's .deb into a directory of its own (so the two
# packages' globs cannot mix) and set $deb to its path.
download_deb() {
	local dir=$work/dl-$1 debs
	mkdir -p "$dir"
	log "downloading $1"
	# apt-get download writes into the cwd; as root it warns that the _apt
	# sandbox user cannot write there, which is harmless, so its chatter is
	# only shown on failure.
	(cd "$dir" && apt-get download -q "$1" 2>&1) >"$work/download.log" || {
		cat "$work/download.log" >&2
		die "apt-get download $1 failed"
	}
	debs=("$dir"/*.deb)
	deb=${debs[0]}
	[[ -f $deb ]] || die "apt-get download $1 produced no .deb"
}

pkg=${BACKSTOP_GUEST_KERNEL:-$(newest_kernel_pkg)}
if [[ -z $pkg ]] || ! has_candidate "$pkg"; then
	if refresh_apt_lists "no kernel package found in the apt lists"; then
		pkg=${BACKSTOP_GUEST_KERNEL:-$(newest_kernel_pkg)}
	fi
	if [[ -z $pkg ]] || ! has_candidate "$pkg"; then
		die "kernel package '${pkg:-linux-image-6.1.0-*-amd64}' not available from apt (apt-get update as root?)"
	fi
fi

download_deb "$pkg"
pkg_version=$(dpkg-deb -f "$deb" Version)

root=$work/root
dpkg-deb -x "$deb" "$root"
rm -f "$deb"

kdirs=("$root"/lib/modules/*)
kver=${kdirs[0]##*/}
[[ ${#kdirs[@]} -eq 1 && -f $root/boot/vmlinuz-$kver ]] || die "$pkg has no boot/vmlinuz-<ver> with lib/modules/<ver>"
moddir=$root/lib/modules/$kver

# --- kernel image ------------------------------------------------------------
# Debian's bzImage is xz-compressed, and decompressing ~64 MiB under TCG takes
# 3-6 s of every boot (first tick at 6.7-9 s measured, against 3.3 s
# otherwise). So we ship the vmlinux ELF inside it instead: with CONFIG_PVH
# QEMU's -kernel boots it directly through the PVH entry point, with the same
# -initrd/-append, under TCG and KVM alike. The original bzImage is kept as
# vmlinuz.bzimage as a fallback.
kernel_format=bzimage
cp "$root/boot/vmlinuz-$kver" "$work/vmlinuz.bzimage"

# Little-endian fields of the x86 boot header (Documentation/x86/boot.rst).
hdr_u8() { od -An -tu1 -j"$1" -N1 "$work/vmlinuz.bzimage" | tr -d ' '; }
hdr_u32() { od -An -tu4 -j"$1" -N4 "$work/vmlinuz.bzimage" | tr -d ' '; }

extract_vmlinux() {
	local setup_sects payload_offset payload_length start magic
	grep -q '^CONFIG_PVH=y' "$root/boot/config-$kver" || return 1
	setup_sects=$(hdr_u8 0x1f1)
	((setup_sects == 0)) && setup_sects=4
	payload_offset=$(hdr_u32 0x248)
	payload_length=$(hdr_u32 0x24c)
	start=$(((setup_sects + 1) * 512 + payload_offset))
	magic=$(dd if="$work/vmlinuz.bzimage" iflag=skip_bytes skip="$start" bs=6 count=1 status=none |
		od -An -tx1 | tr -d ' \n')
	# Debian builds with CONFIG_KERNEL_XZ; anything else takes the fallback.
	[[ $magic == fd377a585a00 ]] || return 1
	# The payload ends with the 4-byte decompressed size, hence single-stream.
	dd if="$work/vmlinuz.bzimage" iflag=skip_bytes,count_bytes \
		skip="$start" count="$payload_length" status=none |
		xz -dc --single-stream >"$work/vmlinux" || return 1
	[[ $(head -c 4 "$work/vmlinux" | od -An -tx1 | tr -d ' \n') == 7f454c46 ]]
}

if extract_vmlinux; then
	kernel_format=pvh-elf
else
	log "could not extract a PVH vmlinux; shipping the bzImage (slower boot under TCG)"
	cp "$work/vmlinuz.bzimage" "$work/vmlinux"
fi

# --- qemu guest agent --------------------------------------------------------
# Only usr/sbin/qemu-ga is used: the package's init script, udev rule and
# systemd unit have nothing to run under in the guest (its /init starts it).
qga_pkg=qemu-guest-agent
if ! has_candidate "$qga_pkg"; then
	refresh_apt_lists "no $qga_pkg package found in the apt lists" || true
	has_candidate "$qga_pkg" || die "package '$qga_pkg' not available from apt (apt-get update as root?)"
fi
download_deb "$qga_pkg"
qga_version=$(dpkg-deb -f "$deb" Version)
qga_root=$work/qga
dpkg-deb -x "$deb" "$qga_root"
rm -f "$deb"
qga_bin=$qga_root/usr/sbin/qemu-ga
[[ -x $qga_bin ]] || die "$qga_pkg $qga_version has no usr/sbin/qemu-ga"

# Its shared libraries, loader included, as ldd resolves them on this host.
# ldd prints "name => /path (addr)", "/loader (addr)", "name (addr)" for the
# vDSO (no file), and "name => not found" for what is missing.
ldd_status=0
qga_ldd=$(ldd "$qga_bin" 2>&1) || ldd_status=$?
if grep -q 'not found' <<<"$qga_ldd"; then
	die "qemu-ga needs libraries this host lacks:"$'\n'"$(grep 'not found' <<<"$qga_ldd")"
fi
((ldd_status == 0)) || die "ldd $qga_bin failed:"$'\n'"$qga_ldd"
mapfile -t qga_libs < <(awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }' <<<"$qga_ldd")
[[ ${#qga_libs[@]} -gt 0 ]] || die "ldd listed no libraries for qemu-ga:"$'\n'"$qga_ldd"

# --- module closure ----------------------------------------------------------
# The package ships no modules.dep (postinst runs depmod), so generate it
# against the extracted tree.
depmod -b "$root" "$kver"

# Module names treat '-' and '_' as the same; index by the '_' spelling.
norm() { local n=${1##*/}; n=${n%%.ko*}; echo "${n//-/_}"; }

declare -A mod_path mod_deps builtin
while IFS= read -r line; do
	path=${line%%:*}
	name=$(norm "$path")
	mod_path[$name]=$path
	mod_deps[$name]=${line#*:}
done <"$moddir/modules.dep"
while IFS= read -r path; do
	builtin[$(norm "$path")]=1
done <"$moddir/modules.builtin"

# Depth-first, dependencies before dependents: the order insmod needs, since
# busybox insmod does no resolution of its own.
declare -A visited
load_order=()
resolve() {
	local name dep
	name=$(norm "$1")
	[[ -n ${visited[$name]:-} ]] && return 0
	visited[$name]=1
	if [[ -n ${builtin[$name]:-} ]]; then
		log "  $name is built into the kernel"
		return 0
	fi
	[[ -n ${mod_path[$name]:-} ]] || die "module $name is neither in modules.dep nor built in ($kver)"
	for dep in ${mod_deps[$name]}; do
		resolve "$dep"
	done
	load_order+=("$name")
}

while read -r name _; do
	[[ -z $name || $name == \#* ]] && continue
	resolve "$name"
done <"$guest_src/modules"

# --- initramfs tree ----------------------------------------------------------
initrd=$work/initrd
mkdir -p "$initrd"/{bin,dev,proc,sys,tmp,run,etc/backstop,lib/modules}
cp "$busybox" "$initrd/bin/busybox"
# Applet links at build time so /init can use plain command names from line 1.
for applet in $("$busybox" --list); do
	[[ $applet == busybox ]] || ln -sf busybox "$initrd/bin/$applet"
done
ln -s bin "$initrd/sbin"
install -m 0755 "$guest_src/init" "$initrd/init"

# qemu-ga and its libraries at the paths ldd found them at, which are the
# loader's default directories, so no ld.so.cache is needed. cp -L: the real
# file, not the host's symlink (libudev.so.1 -> libudev.so.1.7.5, and the
# loader's /lib64/ld-linux-x86-64.so.2 is one too).
install -D -m 0755 "$qga_bin" "$initrd/usr/sbin/qemu-ga"
for lib in "${qga_libs[@]}"; do
	mkdir -p "$initrd${lib%/*}"
	cp -L "$lib" "$initrd$lib"
done

# busybox insmod takes a plain ELF object, so compressed modules (other
# kernel builds use .ko.xz/.ko.zst) are expanded here on the host.
for name in "${load_order[@]}"; do
	src=$moddir/${mod_path[$name]}
	dst=$initrd/lib/modules/$name.ko
	case $src in
	*.ko) cp "$src" "$dst" ;;
	*.ko.xz) xz -dc "$src" >"$dst" ;;
	*.ko.zst) zstd -qdc "$src" >"$dst" ;;
	*.ko.gz) gzip -dc "$src" >"$dst" ;;
	*) die "unknown module format: $src" ;;
	esac
	echo "$name" >>"$initrd/etc/backstop/modules.load"
done

# One sector of newlines: the workload pads each record with it. Shipped
# rather than generated at boot so every record is byte-identical by design.
head -c 512 /dev/zero | tr '\0' '\n' >"$initrd/etc/backstop/pad512"

# /dev/console comes from the kernel's built-in initramfs, which is unpacked
# before this one, so no device nodes (and no root) are needed here.
# Sorted names and fixed owner keep the archive stable between builds.
(cd "$initrd" && find . -mindepth 1 -print0 | LC_ALL=C sort -z |
	cpio --null --create --format=newc --owner=0:0 --quiet) |
	gzip -9 -n >"$work/initrd.img"

# 64 MiB, empty: the workload uses it as a raw device (sector 0 + a log).
qemu-img create -q -f qcow2 "$work/disk-base.qcow2" 64M

# --- install -----------------------------------------------------------------
# The stamp goes last, so an interrupted build is simply redone next time.
mkdir -p "$out"
rm -f "$out/stamp"
mv "$work/vmlinux" "$out/vmlinuz"
mv "$work/vmlinuz.bzimage" "$out/vmlinuz.bzimage"
mv "$work/initrd.img" "$out/initrd.img"
mv "$work/disk-base.qcow2" "$out/disk-base.qcow2"
{
	echo "$key"
	echo "kernel_package=$pkg"
	echo "kernel_package_version=$pkg_version"
	echo "kernel_release=$kver"
	echo "kernel_format=$kernel_format"
	echo "modules=${load_order[*]}"
	echo "qemu-ga=$qga_version"
	echo "built=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
} >"$out/stamp"

log "built guest in $out: kernel $kver ($pkg $pkg_version, $kernel_format), modules: ${load_order[*]}, qemu-ga $qga_version"
