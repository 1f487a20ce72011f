#!/usr/bin/env bash
# Incremental storage, measured: bytes the store adds for
#   first   a snapshot of a guest with FILL MiB of random data resident,
#   idle    a second snapshot right after it (the guest idle but for its ticking init),
#   dirty   a third one after the guest rewrote 10% of its RAM (DIRTY MiB).
# Goal: idle stores under 10% of first.
#
# "stored" is the new chunk bytes the snapshot's manifest reports (bytes_stored); the table also
# shows the snapshot's own files (chunk index, manifest), which are new for every snapshot.
# The store cuts the stream at QEMU's page records (crates/backstop-qemu/src/stream_chunks.rs).
#
# It then reads the RAM/device streams back out of the store and parses QEMU 7.2's migration
# stream (RAM section: be64 addr|flags, idstr unless CONTINUE, 4096-byte PAGE or 1-byte ZERO)
# to say *why* the figures are what they are: how many pages changed, how they spread over
# 1 MiB regions, how many came out of address order (userfaultfd write-faults during the
# background snapshot), what a page-addressed store would add (the floor), and what other
# group sizes of the page-record cutting would store (for tuning).
#
#   sudo scripts/bench-incremental.sh [MEM_MIB] [FILL_MIB]     (defaults 1024 and 400)
#
# Needs QEMU 7.2 and the test guest (scripts/setup.sh). Builds backstop in release mode.
set -euo pipefail
cd "$(dirname "$0")/.."

MEM=${1:-1024}
FILL=${2:-400}
DIRTY=$((MEM / 10))
EVERY=60 # seconds between the guest's dirtying bursts: first and idle fit before the first
GUEST=${BACKSTOP_GUEST_DIR:-$HOME/.cache/backstop/guest}

cargo build --release -q -p backstopd -p backstop-cli
BIN=$PWD/target/release
work=$(mktemp -d /tmp/bs-bench-incr.XXXXXX)
run=/tmp/bsr-incr-$$
cleanup() {
	[ -n "${pid:-}" ] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null || true
	rm -rf "$run"
	if [ -z "${KEEP:-}" ]; then rm -rf "$work"; else echo "kept $work" >&2; fi
}
trap cleanup EXIT

cat >"$work/backstop.toml" <<EOF
[daemon]
state_dir = "$work/state"
run_dir = "$run"

[vm]
name = "bench"
accel = "auto"
memory_mib = $MEM
kernel = "$GUEST/vmlinuz"
initrd = "$GUEST/initrd.img"
append = "console=ttyS0 quiet panic=-1 no_timer_check backstop.fill_mib=$FILL backstop.dirty_mib=$DIRTY backstop.dirty_every=$EVERY"
nics = ["net0"]

[[vm.disks]]
id = "data"
path = "$GUEST/disk-base.qcow2"
snapshot = "capture"

[watchdog]
heartbeat_timeout_s = 60
boot_grace_s = 600
EOF

"$BIN/backstopd" --config "$work/backstop.toml" >"$work/backstopd.log" 2>&1 &
pid=$!
bs() { "$BIN/backstop" --socket "$run/control.sock" --json "$@"; }
serial=$work/state/bench-serial.log
wait_serial() { # PATTERN TIMEOUT_S [FROM_BYTE]
	local deadline=$((SECONDS + $2))
	until tail -c +$((${3:-0} + 1)) "$serial" 2>/dev/null | grep -qa "$1"; do
		[ $SECONDS -lt $deadline ] || { echo "timed out waiting for '$1'" >&2; tail -5 "$serial" >&2; exit 1; }
		sleep 0.5
	done
}
echo "bench: ${MEM} MiB guest, ${FILL} MiB random data resident, ${DIRTY} MiB (10%) dirtied" >&2
wait_serial "BACKSTOP fill mib=" 600
snap() {
	bs snapshot create --reason "bench: $1" | python3 -c '
import json, sys
v = json.load(sys.stdin)
s, m = v["summary"], v["manifest"]
print(s["snapshot_id"], s["bytes_stored"], m["capture"]["vmstate_bytes"], m["payload_refs"][0]["chunks"])'
}
own_files() { du -cb "$work/state/store/snapshots/$1"/* | tail -1 | cut -f1; }
read -r first_id first_new first_total first_chunks < <(snap first)
read -r idle_id idle_new idle_total idle_chunks < <(snap idle)
from=$(stat -c %s "$serial")
wait_serial "BACKSTOP dirty end n=1" $((EVERY * 3)) "$from"
read -r dirty_id dirty_new dirty_total dirty_chunks < <(snap dirty)

pct() { python3 -c "print(f'{100 * $1 / $2:.1f}%')"; }
mib() { python3 -c "print(f'{$1 / 1048576:.1f} MiB')"; }
echo
echo "snapshot  stream (RAM+devices)  chunks  stored (new bytes)  stored / first  own files (index, manifest)"
for k in first idle dirty; do
	eval "id=\$${k}_id total=\$${k}_total chunks=\$${k}_chunks new=\$${k}_new"
	printf "%-8s  %-20s  %-6s  %-18s  %-14s  %s\n" "$k" "$(mib "$total")" "$chunks" "$(mib "$new")" \
		"$(pct "$new" "$first_new")" "$(mib "$(own_files "$id")")"
done
echo

# Why: the streams, parsed.
python3 - "$work/state/store" "$first_id" "$idle_id" "$dirty_id" <<'PY'
import hashlib, json, struct, sys
from pathlib import Path

store, ids = Path(sys.argv[1]), sys.argv[2:]
PAGE = 4096
F_ZERO, F_MEM_SIZE, F_PAGE, F_EOS, F_CONTINUE = 0x02, 0x04, 0x08, 0x10, 0x20

def stream(sid):
    idx = json.loads((store / "snapshots" / sid / "vmstate.index").read_bytes())
    return b"".join((store / "chunks" / c["sha256"][:2] / c["sha256"]).read_bytes() for c in idx["chunks"])

def parse(buf):
    """RAM pages of a QEMU 7.2 migration stream: [(block, addr, digest, start, end)] in stream
    order (start/end: the record's bytes), and the offset where the device state begins."""
    start = buf.find(b"\x03ram")          # QEMU_VM_SECTION_START, id, len 3, "ram", ...
    assert start > 0 and buf[start - 5] == 0x01, "no RAM section start"
    p = start + 4 + 8                      # idstr, instance_id, version_id
    pages, block = [], None
    def section_data(p):
        nonlocal block
        while True:
            rec = p
            hdr, = struct.unpack_from(">Q", buf, p); p += 8
            flags, addr = hdr & 0xfff, hdr & ~0xfff
            if flags & F_EOS:
                return p
            if flags & F_MEM_SIZE:
                total, got = addr, 0
                while got < total:
                    n = buf[p]; p += 1 + n
                    used, = struct.unpack_from(">Q", buf, p); p += 8
                    got += used
                continue
            if not flags & F_CONTINUE:
                n = buf[p]; block = buf[p + 1:p + 1 + n].decode(); p += 1 + n
            if flags & F_ZERO:
                pages.append((block, addr, b"zero%d" % buf[p], rec, p + 1)); p += 1
            elif flags & F_PAGE:
                pages.append((block, addr, hashlib.sha1(buf[p:p + PAGE]).digest(), rec, p + PAGE)); p += PAGE
            else:
                raise ValueError(f"flags {flags:#x} at {p}")
    p = section_data(p)
    while True:
        if buf[p] == 0x7e:                  # section footer
            p += 5
        kind = buf[p]
        if kind not in (0x02, 0x03):        # PART or END of the RAM section; else devices
            break
        p = section_data(p + 5)
        if kind == 0x03:
            break
    return pages, p

def record_aligned_chunks(buf, pages, dev_start, group):
    """The chunks a stream-aware chunker would cut: a boundary before every record whose
    address is a multiple of `group` and around every record out of address order; the bytes
    before the first record and the device state are chunks of their own."""
    cuts = {0, pages[0][3], dev_start, len(buf)}
    prev = None
    for blk, addr, _, start, end in pages:
        ooo = prev is not None and prev[0] == blk and addr < prev[1]
        if ooo or addr % group == 0:
            cuts.add(start)
        if ooo:
            cuts.add(end)
        prev = (blk, addr)
    cuts = sorted(cuts)
    return [hashlib.sha1(buf[a:b]).digest() + b"%d" % (b - a) for a, b in zip(cuts, cuts[1:]) if b > a]

streams = {sid: stream(sid) for sid in ids}
parsed = {sid: parse(streams[sid]) for sid in ids}
names = dict(zip(ids, ["first", "idle", "dirty"]))
for sid in ids:
    pages, dev = parsed[sid]
    tail = len(streams[sid]) - dev
    nonzero = sum(1 for p in pages if not p[2].startswith(b"zero"))
    out_of_order = sum(1 for p0, p1 in zip(pages, pages[1:]) if p0[0] == p1[0] and p1[1] < p0[1])
    print(f"{names[sid]:6}: {len(pages)} page records ({nonzero} full pages = {nonzero * PAGE / 2**20:.1f} MiB, "
          f"rest zero), {out_of_order} out of address order, device state {tail / 1024:.0f} KiB")
prev_all = set()
for a, b in zip(ids, ids[1:]):
    pa = {(p[0], p[1]): p[2] for p in parsed[a][0]}
    pb = {(p[0], p[1]): p[2] for p in parsed[b][0]}
    prev_all |= {d for d in pa.values()}
    changed = [k for k, d in pb.items() if pa.get(k) != d]
    regions = {(blk, ad >> 20) for blk, ad in changed}
    all_regions = {(blk, ad >> 20) for blk, ad in pb}
    new_pages = {d for d in pb.values() if d not in prev_all and not d.startswith(b"zero")}
    print(f"{names[a]} -> {names[b]}: {len(changed)} pages changed ({len(changed) * PAGE / 2**20:.1f} MiB) "
          f"in {len(regions)} of {len(all_regions)} 1-MiB regions; a page-addressed store would add "
          f"{len(new_pages) * PAGE / 2**20:.1f} MiB")
for group in (16 << 10, 64 << 10, 256 << 10):
    seen, out = set(), []
    for sid in ids:
        chunks = record_aligned_chunks(streams[sid], parsed[sid][0], parsed[sid][1], group)
        new = sum(int(c[20:]) for c in set(chunks) if c not in seen)
        seen |= set(chunks)
        out.append(f"{names[sid]} {new / 2**20:.1f} MiB ({len(chunks)} chunks)")
    print(f"page-record cutting with {group >> 10} KiB groups (no merging), simulated: " + ", ".join(out))
PY
