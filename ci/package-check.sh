#!/usr/bin/env bash
# The Debian package installs and works. Builds it (scripts/package.sh, on the release build
# ci/release-check.sh made), installs it with dpkg into a scratch root (dpkg --root: the real
# unpack, conffile and maintainer-script path, without touching this host), and checks what got
# installed: every file with its mode, the conffiles, the binaries run, every man page renders
# without a warning, the completions parse, the unit passes systemd-analyze verify, the shipped
# config passes the installed daemon's --check-config (and the daemon runs on it with no VM,
# reloads and stops), the vms.d samples load once copied to NAME.toml; then removes and purges.
# Arguments go to scripts/package.sh (`--no-libvirt` checks the build without the libvirt backend).
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS

work=$(mktemp -d)
daemon_pid=""
cleanup() {
	if [[ -n $daemon_pid ]]; then kill "$daemon_pid" 2>/dev/null || true; fi
	rm -rf "$work"
}
trap cleanup EXIT

fail() {
	echo "package-check: FAILED: $*" >&2
	exit 1
}
ok() { echo "package-check: ok: $*"; }
skip() { echo "package-check: SKIPPED: $*"; }

bash scripts/package.sh "$@" --out "$work/out" | tee "$work/package.log"
deb=$(tail -n 1 "$work/package.log")
[[ -f $deb ]] || fail "scripts/package.sh did not print a .deb path (got '$deb')"
version=$(dpkg-deb -f "$deb" Version)

# --- install into a scratch root -------------------------------------------------------------
root=$work/root
mkdir -p "$root/var/lib/dpkg/info" "$root/var/lib/dpkg/updates"
touch "$root/var/lib/dpkg/status"
# --force-depends: the scratch root has no libc or QEMU packages (the host's are used to run).
# --force-script-chrootless: the maintainer scripts run here with DPKG_ROOT set (they skip
# systemctl then); a chroot would need a shell inside the scratch root. --path-include: a
# minimized image's path-exclude (man pages, docs) must not hide files from this check.
dpkg_root() {
	dpkg --root="$root" --force-not-root --force-script-chrootless --force-depends \
		--path-include='*' "$@"
}
dpkg_root -i "$deb" >"$work/dpkg-install.log" 2>&1 || {
	cat "$work/dpkg-install.log" >&2
	fail "dpkg -i into the scratch root"
}
status=$(dpkg-query --admindir="$root/var/lib/dpkg" -W -f='${Status}' backstop)
[[ $status == "install ok installed" ]] || fail "dpkg status is '$status'"
ok "dpkg --root -i: $status ($version)"

# --- files and modes --------------------------------------------------------------------------
expect_mode() { # MODE PATH...
	local mode=$1 path got
	shift
	for path in "$@"; do
		[[ -e $root$path ]] || fail "$path is not installed"
		got=$(stat -c %a "$root$path")
		[[ $got == "$mode" ]] || fail "$path has mode $got, expected $mode"
	done
}
expect_mode 755 /usr/bin/backstopd /usr/bin/backstop /etc/backstop/vms.d \
	/etc/libvirt/hooks/qemu.d/backstop
expect_mode 644 /lib/systemd/system/backstopd.service /etc/backstop/backstopd.toml \
	/etc/backstop/vms.d/README /etc/backstop/vms.d/web1.toml.sample \
	/etc/backstop/vms.d/db1.toml.sample \
	/usr/share/man/man1/backstop.1.gz /usr/share/man/man1/backstop-snapshot-create.1.gz \
	/usr/share/man/man8/backstopd.8.gz \
	/usr/share/bash-completion/completions/backstop \
	/usr/share/zsh/vendor-completions/_backstop \
	/usr/share/fish/vendor_completions.d/backstop.fish \
	/usr/share/doc/backstop/README.md /usr/share/doc/backstop/copyright
# Owned by root in the archive, whoever built it.
if dpkg-deb -c "$deb" | awk '{print $2}' | grep -v '^root/root$' >/dev/null; then
	fail "entries not owned by root/root: $(dpkg-deb -c "$deb" | grep -v ' root/root ')"
fi
# Nothing in vms.d is a VM yet: the loader reads only *.toml.
if compgen -G "$root/etc/backstop/vms.d/*.toml" >/dev/null; then
	fail "the package ships a *.toml in vms.d, which the daemon would load"
fi
conffiles=$(dpkg-query --admindir="$root/var/lib/dpkg" -W -f='${Conffiles}' backstop)
for f in $(cd "$root" && find etc -type f | sed 's|^|/|'); do
	grep -q "^ $f " <<<"$conffiles" || fail "$f is not a conffile"
done
depends=$(dpkg-deb -f "$deb" Depends)
for d in libc6 qemu-system-x86 qemu-utils; do
	grep -q "\b$d\b" <<<"$depends" || fail "Depends lacks $d: $depends"
done
ok "files, modes (binaries 0755), root ownership, conffiles, Depends: $depends"

# --- the copyright file -----------------------------------------------------------------------
# scripts/package.sh writes it from Cargo.lock (ci/check-licenses.py): the crates the binaries
# link, and a License: paragraph for every licence they carry.
copyright=$root/usr/share/doc/backstop/copyright
licenses=$(python3 ci/check-licenses.py --licenses backstop) || fail "ci/check-licenses.py --licenses backstop"
[[ -n $licenses ]] || fail "ci/check-licenses.py --licenses backstop named no licence"
for lic in $licenses; do
	awk -v want="License: $lic" -v RS= 'index($0 "\n", want "\n") == 1 { found = 1 } END { exit !found }' \
		"$copyright" || fail "the copyright file has no 'License: $lic' paragraph"
done
crates=$(grep -c '^Files: vendor/' "$copyright" || true)
[[ $crates -gt 0 ]] || fail "the copyright file lists no bundled crate"
for crate in serde clap; do
	grep -q "^Files: vendor/$crate-[0-9]" "$copyright" || fail "the copyright file does not list $crate"
done
ok "copyright: $crates bundled crates, a License: paragraph for each of $(tr '\n' ' ' <<<"$licenses")"

# --- the installed binaries -------------------------------------------------------------------
got=$("$root/usr/bin/backstopd" --version)
[[ $got == "backstopd $version" ]] || fail "backstopd --version says '$got'"
help=$("$root/usr/bin/backstop" --help)
grep -q '^Exit status:' <<<"$help" || fail "backstop --help has no exit-status table"
n=$(strings "$root/usr/bin/backstopd" | grep -c BACKSTOP_FAULT || true)
[[ $n -eq 0 ]] || fail "the packaged backstopd holds $n BACKSTOP_FAULT string(s)"
ok "backstopd --version, backstop --help (with its exit statuses), no fault-injection hook"

# --- man pages --------------------------------------------------------------------------------
pages=0
for page in "$root"/usr/share/man/man1/*.gz "$root"/usr/share/man/man8/*.gz; do
	warnings=$(LC_ALL=C.UTF-8 MANWIDTH=80 man --warnings -E UTF-8 -l "$page" 2>&1 >/dev/null)
	[[ -z $warnings ]] || fail "man -l $page: $warnings"
	pages=$((pages + 1))
done
LC_ALL=C.UTF-8 MANWIDTH=80 man -l "$root/usr/share/man/man1/backstop.1.gz" 2>/dev/null |
	grep -q 'EXIT STATUS' || fail "backstop(1) has no EXIT STATUS section"
ok "$pages man pages render with man --warnings and no warning"

# --- completions ------------------------------------------------------------------------------
for bin in backstop backstopd; do
	f=$root/usr/share/bash-completion/completions/$bin
	bash -n "$f" || fail "bash -n $f"
	bash -c "source '$f' && complete -p $bin" >/dev/null || fail "$f registers no completion"
done
ok "bash completions parse and register"
for shell in zsh fish; do
	if command -v "$shell" >/dev/null; then
		for f in "$root/usr/share/zsh/vendor-completions/_backstop" \
			"$root/usr/share/fish/vendor_completions.d/backstop.fish"; do
			[[ $f == *"/$shell/"* ]] || continue
			"$shell" -n "$f" || fail "$shell -n $f"
		done
		ok "$shell completion parses"
	else
		skip "$shell is not installed: its completion is not parsed"
	fi
done

# --- the unit ---------------------------------------------------------------------------------
if command -v systemd-analyze >/dev/null; then
	# A root holding the host's units (for the targets the unit depends on), the packaged unit
	# and binaries; MANPATH lets its Documentation=man: lines find the packaged pages.
	vroot=$work/verify-root
	mkdir -p "$vroot/lib/systemd/system" "$vroot/usr/bin"
	cp -a /lib/systemd/system/. "$vroot/lib/systemd/system/"
	cp "$root/lib/systemd/system/backstopd.service" "$vroot/lib/systemd/system/"
	cp -a "$root/usr/bin/backstopd" "$root/usr/bin/backstop" "$vroot/usr/bin/"
	out=$(MANPATH=$root/usr/share/man systemd-analyze verify --root="$vroot" backstopd.service 2>&1) ||
		fail "systemd-analyze verify: $out"
	[[ -z $out ]] || fail "systemd-analyze verify: $out"
	ok "systemd-analyze verify backstopd.service: clean"
else
	skip "systemd-analyze is not installed: the unit is not verified"
fi
grep -qx 'ExecStart=/usr/bin/backstopd --config /etc/backstop/backstopd.toml' \
	"$root/lib/systemd/system/backstopd.service" || fail "the unit does not run the shipped config"
cmp -s vmm-config/backstopd.service "$root/lib/systemd/system/backstopd.service" ||
	fail "the installed unit differs from vmm-config/backstopd.service"

# --- the shipped config -----------------------------------------------------------------------
# It names /etc/backstop/vms.d; here that directory is inside the scratch root. Only that line
# changes (and state_dir/run_dir for the run below).
cfg=$work/backstopd.toml
sed "s|^vms_dir = \"/etc/backstop/vms.d\"|vms_dir = \"$root/etc/backstop/vms.d\"|" \
	"$root/etc/backstop/backstopd.toml" >"$cfg"
[[ $(diff "$root/etc/backstop/backstopd.toml" "$cfg" | grep -c '^>') -eq 1 ]] ||
	fail "the shipped config has no vms_dir = \"/etc/backstop/vms.d\" line"
out=$("$root/usr/bin/backstopd" --check-config --config "$cfg" 2>&1) ||
	fail "backstopd --check-config of the shipped config: $out"
ok "the shipped config passes the installed backstopd --check-config (no VM yet)"

# The daemon runs on it with no VM, reloads (what systemctl reload runs) and stops on SIGTERM.
run=$work/run
sed -e "s|^state_dir = \"/var/lib/backstop\"|state_dir = \"$work/state\"|" \
	-e "s|^run_dir = \"/run/backstop\"|run_dir = \"$run\"|" \
	-e "s|^console_uids = \[0\]|console_uids = [$(id -u)]|" "$cfg" >"$work/run.toml"
"$root/usr/bin/backstopd" --config "$work/run.toml" >"$work/daemon.log" 2>&1 &
daemon_pid=$!
console=("$root/usr/bin/backstop" --socket "$run/control.sock")
for _ in $(seq 50); do
	[[ -S $run/control.sock ]] && break
	sleep 0.1
done
[[ -S $run/control.sock ]] || fail "backstopd made no socket: $(cat "$work/daemon.log")"
[[ $("${console[@]}" vms) == "no VMs" ]] || fail "backstop vms on an empty vms.d"
status=$("${console[@]}" status 2>&1) && fail "backstop status with no VM succeeded"
[[ $status == *"ERR_VM_NOT_FOUND"*"guards no VM yet"*"backstop reload"* ]] ||
	fail "backstop status with no VM: $status"
reload=$(grep -o 'ExecReload=.*' "$root/lib/systemd/system/backstopd.service")
[[ $reload == "ExecReload=/usr/bin/backstop reload" ]] || fail "unexpected $reload"
"${console[@]}" reload >/dev/null || fail "backstop reload"
kill -TERM "$daemon_pid"
rc=0
wait "$daemon_pid" || rc=$?
daemon_pid=""
[[ $rc -eq 0 ]] || fail "backstopd exited $rc on SIGTERM: $(cat "$work/daemon.log")"
ok "backstopd runs with no VM, answers vms and reload, stops cleanly on SIGTERM"

# --- the vms.d samples ------------------------------------------------------------------------
# Copied to NAME.toml as their comments say, with their files present (placeholders: only the
# config is checked here, not a boot) and qemu on PATH.
vms=$work/vms.d
mkdir -p "$vms" "$work/vm" "$work/bin"
for f in vmlinuz initrd.img disk.qcow2; do : >"$work/vm/$f"; done
for p in qemu-system-x86_64 qemu-img; do printf '#!/bin/sh\nexit 1\n' >"$work/bin/$p"; done
chmod 0755 "$work"/bin/*
sed "s|/srv/vm/web1/|$work/vm/|" "$root/etc/backstop/vms.d/web1.toml.sample" >"$vms/web1.toml"
sed "s|^vms_dir = .*|vms_dir = \"$vms\"|" "$cfg" >"$work/samples.toml"
out=$(PATH=$work/bin:$PATH "$root/usr/bin/backstopd" --check-config --config "$work/samples.toml" 2>&1) ||
	fail "web1.toml.sample as web1.toml: $out"
[[ $out == "config OK: vm web1" ]] || fail "web1.toml.sample as web1.toml: $out"
cp "$root/etc/backstop/vms.d/db1.toml.sample" "$vms/db1.toml"
rc=0
out=$("$root/usr/bin/backstopd" --check-config --config "$work/samples.toml" 2>&1) || rc=$?
if grep -q '\blibvirt0\b' <<<"$depends"; then
	# The sample parses; --check-config then asks libvirt about its domain, which this host
	# does not have: refused in one line naming it (or naming libvirt, where none answers),
	# and nothing of libvirt's own error printing.
	[[ $rc -eq 2 ]] && grep -q 'config OK: vm web1' <<<"$out" &&
		grep -Eq "^config REFUSED: vm db1: (libvirt at [^ ]+ has no domain with name db1|cannot connect to libvirt)" <<<"$out" &&
		! grep -q '^libvirt:' <<<"$out" ||
		fail "db1.toml.sample on the libvirt build: $out"
	ok "web1 and db1 samples load (libvirt build); db1's domain is looked up in libvirt"
else
	# This build has no libvirt backend: the sample is refused, by name, as its comment says.
	[[ $rc -eq 2 ]] && grep -q 'config REFUSED: vm db1 .*built without the libvirt backend' <<<"$out" ||
		fail "db1.toml.sample without the libvirt backend: $out"
	ok "web1 sample loads; db1 (libvirt) is refused by this build, naming why"
fi

# --- remove, purge ----------------------------------------------------------------------------
dpkg_root -r backstop >"$work/dpkg-remove.log" 2>&1 || fail "dpkg -r: $(cat "$work/dpkg-remove.log")"
[[ ! -e $root/usr/bin/backstopd ]] || fail "dpkg -r left /usr/bin/backstopd"
[[ -f $root/etc/backstop/backstopd.toml ]] || fail "dpkg -r removed the conffile"
dpkg_root --purge backstop >"$work/dpkg-purge.log" 2>&1 || fail "dpkg --purge: $(cat "$work/dpkg-purge.log")"
[[ ! -e $root/etc/backstop/backstopd.toml ]] || fail "dpkg --purge left the conffile"
ok "dpkg -r keeps the conffiles, --purge removes them"

echo "package-check: $(basename "$deb") passed in $((SECONDS - started)) s"
