#!/usr/bin/env bash
# Build a small bootable disk image of a stock Debian 12 (bookworm) with
# qemu-guest-agent, for the tests that guard a real distribution guest (as
# opposed to the busybox guest of scripts/build-guest.sh). It boots from its
# own disk, no -kernel, under both of QEMU's x86 firmwares:
#   - SeaBIOS (the default): syslinux's mbr.bin -> syslinux on the FAT
#     partition -> /vmlinuz + /initrd.img on that partition;
#   - OVMF (UEFI): the same FAT partition is the ESP; its
#     EFI/BOOT/BOOTX64.EFI is a unified kernel image (systemd-stub + the same
#     kernel, initrd and command line), found by the firmware's removable
#     media path, so no NVRAM boot entry is needed.
#
# Nothing is mounted and no loop device is used (CI containers may have
# neither): mmdebstrap builds the tree in a directory, mke2fs -d copies it
# into the root filesystem image, mtools fills the FAT image and syslinux
# installs itself into it through mtools, sfdisk partitions the disk image
# file and dd puts the filesystems at their offsets.
#
# Output, outside the git tree so it never gets committed:
#   ${BACKSTOP_DEBIAN_GUEST_DIR:-$HOME/.cache/backstop/debian-guest}/
#     disk.qcow2  the image (qcow2, uncompressed; use it as a backing file)
#     stamp       input hash, then what was built (key=value lines)
#     mmdebstrap.log  the log of the last build
#
# Disk (MBR, disk identifier 0x62737467):
#   p1  FAT, type ef, active, label BSBOOT: ldlinux.sys/.c32, syslinux.cfg,
#       vmlinuz, initrd.img, EFI/BOOT/BOOTX64.EFI. Not mounted by the guest.
#   p2  ext4, label bsroot: the Debian system; root=PARTUUID=62737467-02.
#
# In the guest: hostname bsguest, root has an empty password (serial login
# on ttyS0 works; there is no network service), qemu-guest-agent is started
# by udev when the org.qemu.guest_agent.0 virtio-serial port appears, and
# backstop-up.service prints "BACKSTOP debian up" on ttyS0 after
# multi-user.target (qemu-ga has been started by then, but may take a few
# hundred ms more to answer under TCG: retry guest-ping / guest-sync), and
# backstop-marker.service writes a file when the host raises the link of the
# guest's NIC and says every 2 s whether it is there (the rollback test's
# workload; a fixed delay after boot, 50 s, 100 s, was overtaken by a boot
# slowed by tests beside it, and 300 s made the test wait 5 min).
# Timers and services that would write to the disk on their own are masked,
# drivers for unused q35 devices are blacklisted (iTCO_wdt among them, so
# the i6300esb is /dev/watchdog), the journal is volatile, and the
# machine-id is fixed so that no boot of a fresh overlay is a "first boot".
# A boot, some guest-exec and a clean shutdown write ~2 MiB to an overlay.
#
# The stamp holds a hash of this script and scripts/debian-guest/**, so a
# rerun with unchanged inputs is a no-op. The package versions are not part
# of the key on purpose (as in build-guest.sh): edit the inputs, delete the
# stamp or set BACKSTOP_DEBIAN_GUEST_FORCE=1 to pick up new uploads.
#
# Needs root (mmdebstrap --mode=root, and mke2fs -d must read the tree with
# its owners). Missing host tools are installed with apt-get.
#
# Environment:
#   BACKSTOP_DEBIAN_GUEST_DIR      output directory (default above)
#   BACKSTOP_DEBIAN_GUEST_FORCE=1  rebuild even if the stamp matches
#   BACKSTOP_DEBIAN_MIRROR         default http://deb.debian.org/debian
#   BACKSTOP_DEBIAN_SECURITY_MIRROR default http://deb.debian.org/debian-security
set -euo pipefail

die() { echo "build-debian-guest: error: $*" >&2; exit 1; }
log() { echo "build-debian-guest: $*" >&2; }

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
src=$here/debian-guest
out=${BACKSTOP_DEBIAN_GUEST_DIR:-$HOME/.cache/backstop/debian-guest}
mirror=${BACKSTOP_DEBIAN_MIRROR:-http://deb.debian.org/debian}
security_mirror=${BACKSTOP_DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}

# Fixed identifiers: the image is the same machine every time it boots.
disk_id=62737467                          # MBR disk identifier ("bstg")
root_partuuid=$disk_id-02                 # root=PARTUUID=...
root_uuid=6273746f-6f74-4000-8000-62737267756e # ext4 UUID
fat_volid=62737462                        # FAT volume id
machine_id=6273677565737462ac6b7570ac6b7570   # /etc/machine-id

disk_mib=1024  # virtual size of the whole disk
cmdline="root=PARTUUID=$root_partuuid rw console=ttyS0 quiet"

[[ $src != *"'"* ]] || die "the path $src contains a single quote"
for f in initramfs/backstop.conf initramfs/hook overlay/etc/systemd/system/backstop-up.service \
	overlay/etc/systemd/system/backstop-marker.service overlay/usr/local/sbin/backstop-marker; do
	[[ -f $src/$f ]] || die "missing $src/$f"
done

# --- cache check -------------------------------------------------------------
# File names are hashed with the contents so a rename also invalidates.
key=$(
	cd "$here"
	{
		for f in build-debian-guest.sh $(find debian-guest -type f | LC_ALL=C sort); do
			echo "== $f"
			cat "$f"
		done
	} | sha256sum | cut -d' ' -f1
)

if [[ ${BACKSTOP_DEBIAN_GUEST_FORCE:-0} != 1 && -f $out/stamp &&
	$(head -n1 "$out/stamp") == "$key" && -f $out/disk.qcow2 ]]; then
	log "up to date: $out"
	exit 0
fi

# --- tools -------------------------------------------------------------------
[[ $EUID -eq 0 ]] || die "must run as root (mmdebstrap --mode=root; mke2fs -d keeps file owners)"
PATH=$PATH:/usr/sbin:/sbin

# package -> a file it must provide. ovmf is not needed to build, only to
# boot the image under UEFI, which is what the image is for.
declare -A needs=(
	[mmdebstrap]=/usr/bin/mmdebstrap
	[e2fsprogs]=/usr/sbin/mke2fs
	[dosfstools]=/usr/sbin/mkfs.vfat
	[mtools]=/usr/bin/mcopy
	[syslinux]=/usr/bin/syslinux
	[syslinux-common]=/usr/lib/syslinux/mbr/mbr.bin
	[systemd-boot-efi]=/usr/lib/systemd/boot/efi/linuxx64.efi.stub
	[binutils]=/usr/bin/objcopy
	[fdisk]=/usr/sbin/sfdisk
	[qemu-utils]=/usr/bin/qemu-img
	[ovmf]=/usr/share/OVMF/OVMF_CODE_4M.fd
)
missing=()
for pkg in "${!needs[@]}"; do
	[[ -e ${needs[$pkg]} ]] || missing+=("$pkg")
done
if ((${#missing[@]})); then
	log "installing host tools: ${missing[*]}"
	export DEBIAN_FRONTEND=noninteractive
	apt-get update -q >/dev/null || die "apt-get update failed"
	# No recommends: mmdebstrap's (fakechroot, uidmap, ...) are for the
	# modes not used here.
	apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null ||
		die "apt-get install ${missing[*]} failed"
	for pkg in "${missing[@]}"; do
		[[ -e ${needs[$pkg]} ]] || die "$pkg installed but ${needs[$pkg]} is missing"
	done
fi
for tool in sha256sum dd truncate objdump; do
	command -v "$tool" >/dev/null || die "'$tool' not found"
done

work=$(mktemp -d "${TMPDIR:-/tmp}/backstop-debian-guest.XXXXXX")
chmod 0755 "$work" # apt downloads as _apt
# --one-file-system: should mmdebstrap die with something still mounted in
# the tree, never recurse into it.
trap 'rm -rf --one-file-system "$work"' EXIT
root=$work/root

# --- the Debian tree ---------------------------------------------------------
# minbase + what boots it and the agent; no recommends. dbus (a Recommends
# of systemd, so part of any normal install) is needed for systemd-logind:
# without it qemu-ga's guest-shutdown fails ("shutdown -P +0" asks logind:
# "Failed to connect to bus") and nothing handles the ACPI power button
# (QMP system_powerdown). dpkg leaves out documentation and the kernel
# modules of hardware a QEMU guest never has (GPUs, wireless, sound, media,
# InfiniBand, ...): 186 of the kernel's 390 MiB of modules stay, among them
# the i6300esb watchdog, virtio, storage, USB, HID and virtio/Intel NICs.
kmods='/lib/modules/*/kernel'
excludes=(
	'/usr/share/doc/*' '/usr/share/man/*' '/usr/share/info/*' '/usr/share/locale/*'
	'/usr/share/lintian/*' '/usr/share/linda/*'
)
for d in drivers/gpu drivers/media sound drivers/net/wireless net/wireless net/mac80211 \
	drivers/bluetooth net/bluetooth drivers/infiniband drivers/staging drivers/iio \
	drivers/comedi drivers/isdn drivers/mtd drivers/net/wwan drivers/net/can \
	drivers/net/hamradio drivers/net/ethernet; do
	excludes+=("$kmods/$d/*")
done
includes=('/usr/share/doc/*/copyright' "$kmods/drivers/net/ethernet/intel/*")
dpkgopts=()
for p in "${excludes[@]}"; do dpkgopts+=("--dpkgopt=path-exclude=$p"); done
for p in "${includes[@]}"; do dpkgopts+=("--dpkgopt=path-include=$p"); done

# Written before any package is installed: the initramfs configuration must
# be in place when the kernel's postinst builds the initramfs (once), and
# fstab is what initramfs-tools reads to decide on fsck.
setup_hook=$(
	cat <<EOF
set -e
mkdir -p "\$1/etc/initramfs-tools/conf.d" "\$1/etc/initramfs-tools/hooks"
install -m 0644 '$src/initramfs/backstop.conf' "\$1/etc/initramfs-tools/conf.d/backstop.conf"
install -m 0755 '$src/initramfs/hook' "\$1/etc/initramfs-tools/hooks/backstop"
# Pass 0: no fsck at boot (the kernel replays the ext4 journal when mounting).
printf 'PARTUUID=%s / ext4 rw,errors=remount-ro 0 0\n' '$root_partuuid' >"\$1/etc/fstab"
EOF
)

# After everything is installed: identity, the overlay files, units.
customize_hook=$(
	cat <<EOF
set -e
cp -a --no-preserve=ownership '$src/overlay/.' "\$1/"
echo bsguest >"\$1/etc/hostname"
printf '127.0.0.1\tlocalhost\n127.0.1.1\tbsguest\n::1\tlocalhost ip6-localhost ip6-loopback\n' >"\$1/etc/hosts"
rm -f "\$1/etc/resolv.conf"
chroot "\$1" passwd -d root >/dev/null
chroot "\$1" systemctl enable --quiet backstop-up.service backstop-marker.service
chroot "\$1" systemctl set-default --quiet multi-user.target
# Units that write to the disk on their own schedule, or only cost boot
# time (under TCG every unit started costs ~0.1-1 s of a ~15 s boot).
# Serial getty on ttyS0 stays (console=ttyS0), for debugging.
chroot "\$1" systemctl mask --quiet \
	apt-daily.timer apt-daily-upgrade.timer dpkg-db-backup.timer \
	e2scrub_all.timer e2scrub_reap.service fstrim.timer \
	systemd-tmpfiles-clean.timer systemd-firstboot.service \
	systemd-pstore.service getty@tty1.service getty-static.service \
	dev-hugepages.mount dev-mqueue.mount sys-kernel-debug.mount \
	sys-kernel-tracing.mount sys-kernel-config.mount sys-fs-fuse-connections.mount \
	modprobe@configfs.service modprobe@dm_mod.service modprobe@fuse.service \
	modprobe@drm.service modprobe@efi_pstore.service modprobe@loop.service
EOF
)

# --skip=chroot/mount: no /proc, /sys or /dev mounts in the chroot, the same
# on a workstation as in a container without CAP_SYS_ADMIN (where mmdebstrap
# would skip them anyway); nothing installed here needs them.
log "mmdebstrap bookworm (minbase) into $root"
mmdebstrap --mode=root --variant=minbase --format=directory --skip=chroot/mount \
	--aptopt='APT::Install-Recommends "false"' \
	--include=systemd-sysv,udev,dbus,linux-image-amd64,initramfs-tools,qemu-guest-agent \
	"${dpkgopts[@]}" \
	--setup-hook="$setup_hook" \
	--customize-hook="$customize_hook" \
	bookworm "$root" "deb $mirror bookworm main" "deb $mirror bookworm-updates main" \
	"deb $security_mirror bookworm-security main" </dev/null >"$work/mmdebstrap.log" 2>&1 || {
	tail -n 40 "$work/mmdebstrap.log" >&2
	die "mmdebstrap failed (log above)"
}

# mmdebstrap empties machine-id after the hooks (so each install gets its
# own); here one fixed id means no boot of the image is a "first boot".
echo "$machine_id" >"$root/etc/machine-id"

vmlinuzes=("$root"/boot/vmlinuz-*)
[[ ${#vmlinuzes[@]} -eq 1 && -f ${vmlinuzes[0]} ]] || die "expected one kernel in $root/boot"
kver=${vmlinuzes[0]#"$root"/boot/vmlinuz-}
[[ -f $root/boot/initrd.img-$kver ]] || die "no initrd.img-$kver (initramfs-tools did not run?)"
[[ -n $(find "$root/lib/modules/$kver" -name 'i6300esb.ko*' -print -quit) ]] ||
	die "the kernel has no i6300esb module"
grep -q 'qemu-guest-agent.service' "$root"/lib/udev/rules.d/*qemu-guest-agent*.rules ||
	die "qemu-guest-agent's udev rule no longer starts the service"
# shellcheck disable=SC2016 # ${Version} is dpkg-query's, not ours
pkgver() { chroot "$root" dpkg-query -W -f='${Version}' "$1"; }
kernel_pkg=linux-image-$kver
versions="kernel_package=$kernel_pkg
kernel_package_version=$(pkgver "$kernel_pkg")
kernel_release=$kver
qemu_guest_agent_version=$(pkgver qemu-guest-agent)
systemd_version=$(pkgver systemd)
debian_version=$(cat "$root/etc/debian_version")"

# --- the FAT partition: syslinux (BIOS) and the ESP (UEFI) -------------------
# A unified kernel image: systemd-stub with the kernel, initrd, command line
# and os-release as PE sections, each placed after the previous one.
stub=/usr/lib/systemd/boot/efi/linuxx64.efi.stub
printf '%s' "$cmdline" >"$work/cmdline"
# objdump -h: "Idx Name Size VMA ..."; the stub's image base is 0.
next=0
while read -r idx _ size vma _; do
	[[ $idx =~ ^[0-9]+$ ]] || continue
	end=$((0x$vma + 0x$size))
	((end > next)) && next=$end
done < <(objdump -h "$stub")
((next > 0)) || die "cannot read the sections of $stub"
align() { echo $((($1 + 0xfff) & ~0xfff)); }
next=$(align "$next")
uki_args=()
for sec in osrel:"$root/usr/lib/os-release" cmdline:"$work/cmdline" \
	linux:"$root/boot/vmlinuz-$kver" initrd:"$root/boot/initrd.img-$kver"; do
	name=.${sec%%:*}
	file=${sec#*:}
	uki_args+=(--add-section "$name=$file" --change-section-vma "$name=$(printf '0x%x' "$next")")
	next=$(align $((next + $(stat -c %s "$file"))))
done
objcopy "${uki_args[@]}" "$stub" "$work/BOOTX64.EFI" || die "objcopy (unified kernel image) failed"

cat >"$work/syslinux.cfg" <<EOF
SERIAL 0 115200
DEFAULT debian
PROMPT 0
TIMEOUT 0
LABEL debian
	LINUX /vmlinuz
	INITRD /initrd.img
	APPEND $cmdline
EOF

content=$(du -cb "$root/boot/vmlinuz-$kver" "$root/boot/initrd.img-$kver" "$work/BOOTX64.EFI" | tail -n1 | cut -f1)
# Content + 16 MiB of room, at least 64 MiB, in 8 MiB steps.
fat_mib=$(((content / 1048576 + 16 + 7) / 8 * 8))
((fat_mib < 64)) && fat_mib=64
fat=$work/fat.img
mkfs.vfat -C -n BSBOOT -i "$fat_volid" "$fat" $((fat_mib * 1024)) >/dev/null || die "mkfs.vfat failed"
export MTOOLS_SKIP_CHECK=1
mcopy -i "$fat" "$root/boot/vmlinuz-$kver" ::/vmlinuz
mcopy -i "$fat" "$root/boot/initrd.img-$kver" ::/initrd.img
mcopy -i "$fat" "$work/syslinux.cfg" ::/syslinux.cfg
mmd -i "$fat" ::/EFI ::/EFI/BOOT
mcopy -i "$fat" "$work/BOOTX64.EFI" ::/EFI/BOOT/BOOTX64.EFI
# The mtools flavour of the installer: works on the image file, no mount.
syslinux --install "$fat" || die "syslinux --install failed"

# --- the root filesystem -----------------------------------------------------
# Inode tables and journal are written now (not lazily by the guest kernel at
# first mount, which every boot of a fresh overlay would redo).
start1=2048 # sectors: 1 MiB alignment
size1=$((fat_mib * 2048))
start2=$((start1 + size1))
size2=$((disk_mib * 2048 - start2))
rootimg=$work/root.img
mke2fs -q -F -t ext4 -b 4096 -m 1 -L bsroot -U "$root_uuid" \
	-E lazy_itable_init=0,lazy_journal_init=0 -d "$root" \
	"$rootimg" $((size2 / 8)) >/dev/null || die "mke2fs -d failed"
rm -rf "$root"

# --- the disk ----------------------------------------------------------------
raw=$work/disk.raw
truncate -s "${disk_mib}M" "$raw"
sfdisk -q "$raw" <<EOF || die "sfdisk failed"
label: dos
label-id: 0x$disk_id
unit: sectors
start=$start1, size=$size1, type=ef, bootable
start=$start2, size=$size2, type=83
EOF
dd if=/usr/lib/syslinux/mbr/mbr.bin of="$raw" bs=440 count=1 conv=notrunc status=none
dd if="$fat" of="$raw" bs=1M seek=$((start1 / 2048)) conv=notrunc,sparse status=none
dd if="$rootimg" of="$raw" bs=1M seek=$((start2 / 2048)) conv=notrunc,sparse status=none
rm -f "$fat" "$rootimg"
qemu-img convert -q -f raw -O qcow2 "$raw" "$work/disk.qcow2" || die "qemu-img convert failed"
rm -f "$raw"

# --- install -----------------------------------------------------------------
# The stamp goes last, so an interrupted build is simply redone next time.
mkdir -p "$out"
rm -f "$out/stamp"
mv "$work/disk.qcow2" "$out/disk.qcow2"
mv "$work/mmdebstrap.log" "$out/mmdebstrap.log"
{
	echo "$key"
	echo "format=qcow2"
	echo "disk_size_mib=$disk_mib"
	echo "root=PARTUUID=$root_partuuid"
	echo "cmdline=$cmdline"
	echo "$versions"
	echo "built=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
} >"$out/stamp"

log "built $out/disk.qcow2: Debian $(sed -n 's/^debian_version=//p' "$out/stamp"), kernel $kver, $(du -h "$out/disk.qcow2" | cut -f1) on disk"
