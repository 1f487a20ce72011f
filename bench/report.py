"""Turns the raw records of a run into figures (median / min / max), ratios against the peers,
the goals read against them, a text table and a PNG chart."""

import json
import statistics
import sys
import textwrap

CONTENDERS = [("backstop", "backstop"), ("bsstandby", "backstop + standby"),
              ("bspreload", "backstop + preload"), ("bshuge", "backstop, huge_pages all"),
              ("bsorder", "backstop, migrate first"),
              ("bslibvirt", "backstop on libvirt"), ("virsh", "virsh internal"),
              ("stopcopy", "stop-and-copy"), ("qemubg", "QEMU bg-snap"), ("host", "host")]
# Columns backstop is divided by. "QEMU bg-snap" is plain QEMU's own live snapshot into a file
# (no store), measured on the stop-and-copy guest: what backstop adds on top of its mechanism.
PEERS = ["virsh", "stopcopy", "qemubg", "host"]
SNAP_KINDS = ("first", "idle", "dirty", "busy")

MB = 1e6


def _g(d, *path):
    for p in path:
        if not isinstance(d, dict):
            return None
        d = d.get(p)
    return d


def _snap(rec, kind, *path):
    return _g(rec, "snapshots", kind, *path)


def _clean(s):
    return not _g(s, "contaminated")


def per_snapshot(kinds, *path):
    def f(rec):
        return [_g(rec["snapshots"][k], *path) for k in kinds if k in rec["snapshots"]]
    return f


def ratio(kind, base):
    def f(rec):
        a, b = _snap(rec, kind, "bytes_stored"), _snap(rec, base, "bytes_stored")
        if a is None or not b or not _clean(rec["snapshots"].get(kind)):
            return []
        return [a / b]
    return f


def rate(bytes_key):
    def f(rec):
        s = rec["snapshots"].get("first") or {}
        b, ms = s.get(bytes_key), s.get("capture_ms")
        return [b / (ms / 1e3) / MB] if b and ms else []
    return f


def snap_value(kind, key, scale=1.0):
    def f(rec):
        s = rec["snapshots"].get(kind)
        if not s or s.get(key) is None or not _clean(s):
            return []
        return [s[key] * scale]
    return f


def bg(*path):
    """From the stop-and-copy records' plain-QEMU background snapshot."""
    def f(rec):
        return [_g(rec, "bgsnap", *path)]
    return f


def bg_rate(rec):
    b, ms = _g(rec, "bgsnap", "logical_bytes"), _g(rec, "bgsnap", "capture_ms")
    return [b / (ms / 1e3) / MB] if b and ms else []


def host(key):
    def f(h):
        return [h[key]["bytes_per_s"] / MB] if key in h else []
    return f


def M(key, section, label, unit, fn=None, bgfn=None, hostfn=None, ratios=True):
    return {"key": key, "section": section, "label": label, "unit": unit, "fn": fn, "bg": bgfn,
            "host": hostfn, "ratios": ratios}


def rb_without_probe(rec):
    g = _g(rec, "rollback", "guest", "guest_running_ms")
    return [g - (_g(rec, "rollback", "probe_span_ms") or 0)] if g is not None else []


METRICS = [
    M("pause_stopped", 1, "guest stopped (its clock froze, host's did not)", "ms",
      per_snapshot(SNAP_KINDS, "guest", "stopped_ms"), bg("guest", "stopped_ms")),
    M("pause_silence", 1, "longest silence of the guest, seen on the host", "ms",
      per_snapshot(SNAP_KINDS, "guest", "silence_ms"), bg("guest", "silence_ms")),
    M("pause_guest_clock", 1, "longest stall on the guest's own clock", "ms",
      per_snapshot(("first", "idle", "dirty"), "guest", "guest_clock_stall_ms"),
      bg("guest", "guest_clock_stall_ms")),
    M("pause_guest_clock_busy", 1, "  same, while its writer dirties RAM", "ms",
      per_snapshot(("busy",), "guest", "guest_clock_stall_ms")),
    M("pause_qemu_events", 1, "QEMU STOP->RESUME event timestamps", "ms",
      per_snapshot(SNAP_KINDS, "qemu_pause_ms"), bg("qemu_pause_ms")),
    M("pause_disk_switch", 1, "  of which the disk overlay switch (transaction)", "ms",
      per_snapshot(SNAP_KINDS, "disk_switch_ms")),
    M("pause_qemu_downtime", 1, "QEMU's reported downtime (query-migrate)", "ms",
      per_snapshot(SNAP_KINDS, "qemu_downtime_ms"), bg("qemu_downtime_ms")),
    M("noise_stopped", 1, "noise: 'stopped' in a quiet 2 s window", "ms",
      lambda r: [_g(r, "quiet", "guest", "stopped_ms")], ratios=False),
    M("noise_silence", 1, "noise: 'silence' in a quiet 2 s window", "ms",
      lambda r: [_g(r, "quiet", "guest", "silence_ms")], ratios=False),
    M("noise_guest_clock", 1, "noise: guest-clock stall, quiet 2 s window", "ms",
      lambda r: [_g(r, "quiet", "guest", "guest_clock_stall_ms")], ratios=False),

    M("wall_first", 2, "wall time: first snapshot", "ms", snap_value("first", "wall_ms"), bg("wall_ms")),
    M("wall_idle", 2, "wall time: second, guest idle", "ms", snap_value("idle", "wall_ms")),
    M("wall_dirty", 2, "wall time: second, after 10% of RAM dirtied", "ms", snap_value("dirty", "wall_ms")),
    M("wall_busy", 2, "wall time: while the writer runs", "ms", snap_value("busy", "wall_ms")),
    M("bytes_first", 2, "stored: first snapshot", "MB", snap_value("first", "bytes_stored", 1 / MB)),
    M("bytes_idle", 2, "stored: second, guest idle", "MB", snap_value("idle", "bytes_stored", 1 / MB)),
    M("bytes_dirty", 2, "stored: second, after 10% of RAM dirtied", "MB",
      snap_value("dirty", "bytes_stored", 1 / MB)),
    M("probe_create", 2, "libvirt re-probing QEMU inside snapshot-create-as", "ms",
      per_snapshot(("first", "idle", "dirty"), "probe_span_ms"), ratios=False),
    M("ratio_idle", 2, "stored idle / stored first", "x", ratio("idle", "first")),
    M("ratio_dirty", 2, "stored dirty / stored first", "x", ratio("dirty", "first")),
    M("logical_first", 2, "RAM+device state streamed (first)", "MB",
      snap_value("first", "logical_bytes", 1 / MB), lambda r: [(_g(r, "bgsnap", "logical_bytes") or 0) / MB or None]),

    M("rb_guest", 3, "request -> guest running at snapshot point", "ms",
      lambda r: [_g(r, "rollback", "guest", "guest_running_ms")]),
    M("rb_cold", 3, "the same, page cache dropped first (stream read from disk)", "ms",
      lambda r: [_g(r, "cold_rollback", "guest", "guest_running_ms")]),
    M("rb_probe", 3, "  of which libvirt re-probing QEMU (machine quirk)", "ms",
      lambda r: [_g(r, "rollback", "probe_span_ms")], ratios=False),
    M("rb_guest_noprobe", 3, "  same, with libvirt's re-probe taken out", "ms", rb_without_probe),
    M("rb_tick", 3, "request -> first workload tick after it", "ms",
      lambda r: [_g(r, "rollback", "guest", "first_tick_ms")]),
    M("rb_cmd", 3, "the command itself (request -> it returned)", "ms",
      lambda r: [_g(r, "rollback", "cmd_ms")]),
    M("rb_reported", 3, "backstop's own total_ms", "ms",
      lambda r: [_g(r, "rollback", "reported_total_ms")]),
    M("rb_restore", 3, "of which loading state into the fresh QEMU", "ms",
      lambda r: [_g(r, "rollback", "reported_restore_ms")]),

    M("tput_store", 5, "store write: stored bytes / capture time (first)", "MB/s", rate("bytes_stored")),
    M("tput_stream", 5, "state stream: RAM+device bytes / capture time", "MB/s", rate("logical_bytes"),
      bg_rate),
    M("tput_dd", 5, "dd if=/dev/zero bs=1M conv=fsync, same filesystem", "MB/s", hostfn=host("dd")),
    M("tput_chunks", 5, "1 MiB files, each fsynced+renamed (store's pattern)", "MB/s",
      hostfn=host("chunk_files")),
    M("tput_sha256", 5, "sha256, one core (Python hashlib)", "MB/s", hostfn=host("sha256")),
    M("orphan_reap", 3, "host: PID 1 reaps a killed orphan (libvirt's destroy waits for it)", "ms",
      hostfn=lambda h: [h["orphan_reap"]["ms"]] if "orphan_reap" in h else [], ratios=False),
]

NOT_YET = [
    (4, "watchdog expiry -> guest running",
     "per QEMU version in the headline table above (its own small guest: the heartbeat watchdog's "
     "expiry, as scripts/bench-watchdog.sh)"),
    (6, "embedded KVM backend: restore time vs guest memory",
     "not in this run; scripts/bench-kvm.sh measures it on its own guest program"
     " (a stock Linux guest does not boot on this machine's paravirtual KVM)"),
]

SECTIONS = {
    1: "1. Guest pause per snapshot (first, idle, dirty, busy snapshots)",
    2: "2. Snapshot wall time and bytes stored",
    3: "3. Rollback: request -> guest running again at the snapshot point (guest's view)",
    4: "4. Watchdog expiry -> guest running",
    5: "5. Store write throughput",
    6: "6. Embedded KVM backend",
}


def stats(values):
    v = [x for x in values if isinstance(x, (int, float))]
    if not v:
        return None
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}


def summarize_one(raw):
    meta, records, hosts = raw["meta"], raw["records"], raw.get("host", [])
    figures = {}
    for m in METRICS:
        row = {"section": m["section"], "label": m["label"], "unit": m["unit"], "values": {},
               "show_ratios": m["ratios"]}
        for c, _ in CONTENDERS:
            vals = []
            if c == "host":
                if m["host"]:
                    for h in hosts:
                        vals.extend(m["host"](h))
            elif c == "qemubg":
                if m["bg"]:
                    for r in records:
                        if r["contender"] == "stopcopy" and r.get("bgsnap"):
                            vals.extend(m["bg"](r))
            elif m["fn"]:
                for r in records:
                    if r["contender"] == c:
                        vals.extend(m["fn"](r))
            s = stats(vals)
            if s:
                row["values"][c] = s
        figures[m["key"]] = row
    dd_med = _g(figures, "tput_dd", "values", "host", "median")
    for key, row in figures.items():
        b = _g(row, "values", "backstop", "median")
        row["ratios"] = {}
        if not row.pop("show_ratios"):
            continue
        for p in PEERS:
            pm = _g(row, "values", p, "median")
            if p == "host" and key in ("tput_store", "tput_stream"):
                pm = dd_med  # store throughput is read against dd
            if b is not None and pm:
                row["ratios"][p] = b / pm
    errors = [{"contender": r["contender"], "rep": r["rep"] + 1, "error": r["error"]}
              for r in records if r.get("error")]
    contaminated = [{"contender": r["contender"], "rep": r["rep"] + 1}
                    for r in records if _g(r, "snapshots", "idle", "contaminated")]
    return {"meta": meta, "figures": figures, "goals": goals(figures, meta),
            "not_yet_available": [{"section": s, "label": l, "note": n} for s, l, n in NOT_YET],
            "errors": errors, "idle_contaminated": contaminated}


def _med(figures, key, c="backstop"):
    return _g(figures, key, "values", c, "median")


def goals(f, meta):
    """Each goal: what was measured, meets or misses (by how much), and a reading of why from
    the other figures of the same run. Nothing here is a pass/fail threshold."""
    out = []
    size = f"{meta['memory_mib']} MiB guest" + ("" if meta["memory_mib"] == 1024 else
                                                 "; the goal is stated for 1 GiB")

    def verdict(ok, by):
        return "meets" if ok else f"misses by {by}"

    def fmt(x, unit="ms"):
        return "-" if x is None else f"{_fmt(x)} {unit}"

    stopped, silence = _med(f, "pause_stopped"), _med(f, "pause_silence")
    if stopped is not None:
        bg, sw = _med(f, "pause_qemu_events", "qemubg"), _med(f, "pause_disk_switch", "stopcopy")
        own, own_busy = _med(f, "pause_guest_clock"), _med(f, "pause_guest_clock_busy")
        floor = _med(f, "noise_guest_clock")
        out.append({
            "goal": "guest pause <= 5 ms at 1 GiB", "size": size,
            "measured": f"guest stopped {fmt(stopped)} per snapshot; longest silence seen from outside "
                        f"{fmt(silence)} (quiet-window floor {fmt(_med(f, 'noise_silence'))})",
            "verdict": verdict(stopped <= 5, f"{stopped - 5:.1f} ms ({stopped / 5:.1f}x the goal)"),
            "reading": (
                f"QEMU's own background snapshot, started on the running guest, stops it {fmt(bg)}: its "
                f"migration setup (mostly a pre-fault reading one byte of every page of guest RAM, "
                f"8-26 ms at 1 GiB traced with bench/pause_probe.py --trace, not this run) runs before "
                f"its internal stop. backstop must stop the guest itself so that the disk switch and "
                f"the RAM capture share one instant. On 7.2/8.x it stops first, so that setup runs "
                f"inside its pause; on >= 9.0 it sends `migrate` a learnt lead before `stop` (snapshots "
                f"without a `migrate` phase in their breakdown), so only the rest of the setup does. "
                f"The new overlays are created and opened (blockdev-add) before `stop`; inside the "
                f"window are stop, a blockdev-snapshot transaction (a graph change; creating the qcow2 "
                f"there took {fmt(sw)} in the stop-and-copy peer), the rest of QEMU's setup, its "
                f"device-state save and write-protection start (which walks every small page-table "
                f"entry of guest RAM: `vm.huge_pages = \"all\"`, the bshuge contender, maps it all "
                f"huge again after each snapshot; QEMU >= 9.0 only). After the pause the "
                f"guest runs slowed while RAM streams out: its own clock saw stalls of {fmt(own)} "
                f"({fmt(own_busy)} while its writer dirtied RAM, each first write to a page waiting for "
                f"its copy-out) against a quiet-window floor of {fmt(floor)}."),
        })
    b, v = _med(f, "rb_guest"), _med(f, "rb_guest", "virsh")
    vn = _med(f, "rb_guest_noprobe", "virsh")
    if b is not None and v:
        probe = _med(f, "rb_probe", "virsh") or 0
        loaded, total = _med(f, "rb_restore"), _med(f, "rb_reported")
        sc, sc_load = _med(f, "rb_guest", "stopcopy"), _med(f, "rb_restore", "stopcopy")
        out.append({
            "goal": "rollback <= 1/10 of virsh snapshot-revert", "size": size,
            "measured": f"{fmt(b)} vs virsh {fmt(v)} = {b / v:.2f} of it"
                        + (f"; {b / vn:.2f} of virsh with libvirt's {fmt(probe)} capability re-probe "
                           f"taken out ({fmt(vn)})" if probe and vn else ""),
            "verdict": verdict(b <= v / 10, f"{b - v / 10:.0f} ms ({b / v * 10:.1f}x the goal)")
                       + (f" as measured; {verdict(b <= vn / 10, f'{b - vn / 10:.0f} ms ({b / vn * 10:.1f}x)')}"
                          f" against virsh without the re-probe" if probe and vn else ""),
            "reading": (
                f"backstop's {fmt(total)} = verify the snapshot (signature, every chunk and disk layer, on "
                f"up to 4 threads), end QEMU, start a fresh one, stream the state in ({fmt(loaded)}: a "
                f"reader thread re-checks every chunk and feeds a 1 MiB pipe), check, resume. A bare "
                f"stop-and-copy restore (no verification, state from one flat file) reaches the guest in "
                f"{fmt(sc)}, loading in {fmt(sc_load)}. Loading dominates and is QEMU consuming the "
                f"stream (the daemon log's `restored state loaded` line gives QEMU's load_ms); staging "
                f"the stream in memory and handing QEMU a file was tried and dropped "
                f"(docs/benchmarks.md, Tried). Candidate: start the fresh QEMU "
                f"while verifying."
                + (f" libvirt re-probes QEMU's capabilities inside every revert on this machine "
                   f"({fmt(probe)}): /dev/kvm is 0600 root and paravirtual (kvm_pvm), and libvirt's "
                   f"KVM check flips, so its cache never stays valid; on a stock KVM host that time "
                   f"is not there." if probe else "")),
        })
    r = _med(f, "ratio_idle")
    if r is not None:
        rd = _med(f, "ratio_dirty")
        out.append({
            "goal": "idle second snapshot stores <= 10% of the first", "size": size,
            "measured": f"{_fmt(_med(f, 'bytes_idle'))} MB of {_fmt(_med(f, 'bytes_first'))} MB = {r * 100:.0f}%"
                        + (f" (after 10% of RAM dirtied: {rd * 100:.0f}%)" if rd is not None else ""),
            "verdict": verdict(r <= 0.10, f"{(r - 0.10) * 100:.0f} points ({r / 0.10:.1f}x the goal)"),
            "reading": (
                "the store cuts QEMU's stream at page records, one chunk per 64 KiB run of guest "
                "addresses (crates/backstop-qemu/src/stream_chunks.rs), so RAM that did not change lands "
                "in chunks that did not change, although background-snapshot writes pages in the order "
                "the migration thread and the guest's write faults reach them. What remains is the "
                "scattered pages the guest changed, each costing its whole run; "
                "scripts/bench-incremental.sh breaks it down page by page."),
        })
    t, d = _med(f, "tput_store"), _med(f, "tput_dd", "host")
    if t is not None and d:
        bgs, stream = _med(f, "tput_stream", "qemubg"), _med(f, "tput_stream")
        chunks, sha = _med(f, "tput_chunks", "host"), _med(f, "tput_sha256", "host")
        sc = _med(f, "tput_stream", "stopcopy")
        out.append({
            "goal": "store write throughput >= 70% of dd", "size": size,
            "measured": f"{fmt(t, 'MB/s')} vs dd {fmt(d, 'MB/s')} = {t / d * 100:.0f}%",
            "verdict": verdict(t >= 0.7 * d, f"{(0.7 - t / d) * 100:.0f} points ({0.7 * d / t:.1f}x short)"),
            "reading": (
                f"the store is fed by QEMU's live background-snapshot stream, which on its own, into a plain "
                f"file with no store, ran at {fmt(bgs, 'MB/s')} here"
                + (f" ({bgs / d * 100:.0f}% of dd: a ceiling for any store fed by it)" if bgs and d else "")
                + f"; the same QEMU streams a stopped guest at {fmt(sc, 'MB/s')}. backstop's capture moved "
                f"state at {fmt(stream, 'MB/s')}"
                + (f", {stream / bgs * 100:.0f}% of that bare stream, so the daemon's side (pipe, chunking, "
                   f"hashing, one file per chunk) loses the other {100 - stream / bgs * 100:.0f}%"
                   if stream and bgs and stream < bgs else "")
                + f". The store's write pattern alone (1 MiB files, each fsynced and renamed) does "
                f"{fmt(chunks, 'MB/s')} on this filesystem and sha256 {fmt(sha, 'MB/s')} on one core: neither "
                f"the disk nor the hash is the limit by itself; chunking, hashing and writing run one after "
                f"another on one thread while QEMU waits on the (1 MiB) pipe, on a host whose other core runs the TCG vCPU; "
                f"chunk files are made durable by one syncfs at publish. Candidate: hash and write on "
                f"another thread. Why "
                f"the live stream is so much slower than a stopped one is not measured here (under TCG, "
                f"write-protect faults and copy-out on QEMU's one migration thread are the suspects; KVM "
                f"hosts will differ)."),
        })
    return out


def _fmt(x):
    if x is None:
        return "-"
    a = abs(x)
    if a >= 100:
        return f"{x:.0f}"
    if a >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def _cell(s):
    if not s:
        return ""
    if s["n"] == 1:
        return _fmt(s["median"])
    return f"{_fmt(s['median'])} [{_fmt(s['min'])}..{_fmt(s['max'])}]"


def table_one(summary):
    m = summary["meta"]
    f = summary["figures"]
    lines = []
    lines.append(
        f"backstop benchmark: {m['memory_mib']} MiB guest, {m['fill_mib']} MiB random data resident, "
        f"writer {m['dirty_mib']} MiB ({m['dirty_pct']}% of RAM) every {m['dirty_every_s']} s, "
        f"accel {m['accel']}, {m['reps']} repetition(s)" + (" [--quick]" if m.get("quick") else ""))
    lines.append(f"{summary.get('qemu_version') or m.get('versions', {}).get('qemu') or ''}; libvirt {m.get('versions', {}).get('libvirt') or '-'}; "
                 f"{m['started']} .. {m.get('finished', '')}")
    lines.append("cells: median [min..max] over repetitions (pause rows: over every snapshot); "
                 "backstop / peer: ratio of medians (s&c: stop-and-copy, bg: plain QEMU background "
                 "snapshot to a file, host: dd)")
    cols = [c for c, _ in CONTENDERS if any(c in r["values"] for r in f.values())]
    names = dict(CONTENDERS)
    short = {"virsh": "virsh", "stopcopy": "s&c", "qemubg": "bg", "host": "host"}

    def ratios(r):
        return "  ".join(f"{short[p]} {_fmt(r['ratios'][p])}x" for p in PEERS if p in r["ratios"])

    lw = max((len(r["label"]) + len(r["unit"]) + 3 for r in f.values()), default=0)
    cw = max([len(names[c]) for c in cols] + [len(_cell(r["values"].get(c))) for r in f.values() for c in cols], default=0)
    header = " " * lw + "".join(f"  {names[c]:>{cw}}" for c in cols) + "  backstop / peer"
    sections = sorted(set(r["section"] for r in f.values()) | {s for s, _, _ in NOT_YET})
    for sec in sections:
        lines.append("")
        lines.append(SECTIONS[sec])
        na = [x for x in NOT_YET if x[0] == sec]
        for _, label, note in na:
            lines.append(f"  {label}: {note}")
        rows = [r for r in f.values() if r["section"] == sec and r["values"]]
        if not rows:
            continue
        lines.append(header)
        for r in rows:
            lab = f"{r['label']} ({r['unit']})"
            line = f"{lab:<{lw}}" + "".join(f"  {_cell(r['values'].get(c)):>{cw}}" for c in cols)
            line += "  " + ratios(r)
            lines.append(line.rstrip())
    lines.append("")
    lines.append("Goals (read against the table, not asserted)")
    for g in summary["goals"]:
        lines.append(f"- {g['goal']} [{g['size']}]")
        lines.append(f"  measured: {g['measured']}")
        lines.append(f"  verdict:  {g['verdict']}")
        lines.extend(textwrap.wrap(g["reading"], 100, initial_indent="  why:      ",
                                   subsequent_indent="            "))
    if summary["idle_contaminated"]:
        lines.append("  note: the writer ran between 'first' and 'idle' in "
                     + ", ".join(f"{x['contender']} rep {x['rep']}" for x in summary["idle_contaminated"])
                     + "; those idle samples are left out")
    if summary["errors"]:
        lines.append("")
        lines.append("Errors")
        for e in summary["errors"]:
            lines.append(f"  {e['contender']} rep {e['rep']}: {e['error'].splitlines()[0]}")
    return "\n".join(lines) + "\n"


def chart_one(summary, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    f = summary["figures"]
    names = dict(CONTENDERS)
    colors = {"backstop": "#1f77b4", "bsstandby": "#17becf", "bspreload": "#bcbd22", "bshuge": "#8c564b", "bsorder": "#e377c2", "bslibvirt": "#9467bd", "virsh": "#d62728", "stopcopy": "#ff7f0e", "qemubg": "#2ca02c",
              "host": "#7f7f7f"}
    panels = [
        ("Guest pause per snapshot (ms, log)", ["pause_stopped", "pause_silence", "pause_guest_clock"],
         ["stopped", "silence", "own-clock stall"], True),
        ("Snapshot wall time (ms, log)", ["wall_first", "wall_idle", "wall_dirty"],
         ["first", "idle", "dirty 10%"], True),
        ("Bytes stored (MB)", ["bytes_first", "bytes_idle", "bytes_dirty"], ["first", "idle", "dirty 10%"], False),
        ("Rollback: request -> guest running (ms, log)", ["rb_guest", "rb_tick"],
         ["guest running", "first tick"], True),
        ("Write throughput (MB/s)", ["tput_store", "tput_stream", "tput_dd", "tput_chunks"],
         ["store write", "state stream", "dd fsync", "1 MiB files"], False),
    ]
    fig, grid = plt.subplots(2, 3, figsize=(15, 9))
    axes = list(grid.flat)
    m = summary["meta"]
    fig.suptitle(f"backstop vs peers - {m['memory_mib']} MiB guest, {m['fill_mib']} MiB data, "
                 f"accel {m['accel']}, {m['reps']} rep(s); bars: median, whiskers: min-max", fontsize=10)
    for ax, (title, keys, labels, log) in zip(axes[:len(panels)], panels):
        cs = [c for c, _ in CONTENDERS if any(c in f[k]["values"] for k in keys)]
        width = 0.8 / max(1, len(cs))
        for j, c in enumerate(cs):
            xs, meds, lo, hi = [], [], [], []
            for i, k in enumerate(keys):
                s = f[k]["values"].get(c)
                if not s:
                    continue
                xs.append(i + (j - (len(cs) - 1) / 2) * width)
                meds.append(max(s["median"], 1e-3) if log else s["median"])
                lo.append(max(0, s["median"] - s["min"]))
                hi.append(max(0, s["max"] - s["median"]))
            if xs:
                ax.bar(xs, meds, width, yerr=[lo, hi], capsize=2, label=names[c], color=colors[c])
        ax.set_xticks(range(len(keys)))
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_title(title, fontsize=9)
        if log:
            ax.set_yscale("log")
        ax.legend(fontsize=7)
    ax = axes[len(panels)]
    ax.axis("off")
    text = "Goals (not asserted)\n\n" + "\n\n".join(
        textwrap.fill(f"{g['goal']}: {g['verdict']}. {g['measured']}", 60) for g in summary["goals"])
    ax.text(0, 1, text, va="top", ha="left", fontsize=8, family="monospace")
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# --- per QEMU version: every contender runs once per QEMU in the same run -----------

def qemu_labels(raw):
    """The QEMU versions of a run, in run order; one unnamed version for a run from before."""
    labels = [q["label"] for q in raw["meta"].get("qemus") or []]
    for r in raw["records"]:
        if r.get("qemu") and r["qemu"] not in labels:
            labels.append(r["qemu"])
    return labels or [None]


def _major(label):
    try:
        return int(str(label).split(".")[0])
    except ValueError:
        return None


def summarize(raw):
    """One summary per QEMU version (the same figures as before for each), and a headline table:
    pause, rollback, watchdog, store/dd per version with the goal each is held against."""
    meta = raw["meta"]
    per = {}
    qemus = {q["label"]: q for q in meta.get("qemus") or []}
    for lab in qemu_labels(raw):
        sub = dict(raw, records=[r for r in raw["records"] if lab is None or r.get("qemu") == lab])
        one = summarize_one(sub)
        one["qemu_version"] = _g(qemus, lab, "version") or lab
        per[str(lab)] = one
    return {"meta": meta, "per_qemu": per, "headline": headline(raw, per)}


def _ratio_stats(vals, base):
    if not base:
        return None
    return stats([v / base for v in vals if isinstance(v, (int, float))])


def headline(raw, per):
    meta = raw["meta"]
    size = f"{meta['memory_mib']} MiB guest" + ("" if meta["memory_mib"] == 1024 else
                                                 " (goals are stated for 1 GiB)")
    # virsh runs on the system QEMU only (libvirt is packaged with it): its rollback is the
    # reference for every version, named with the version it ran on.
    virsh = next(((lab, _g(s, "figures", "rb_guest", "values", "virsh")) for lab, s in per.items()
                  if _g(s, "figures", "rb_guest", "values", "virsh")), (None, None))
    rows = []
    for lab, s in per.items():
        f = s["figures"]
        major = _major(lab)
        pause_goal = 5 if (major or 0) >= 9 else 12
        out = {"qemu": lab, "version": s.get("qemu_version"), "size": size, "rows": []}

        def row(name, st, unit, goal, ok):
            out["rows"].append({"figure": name, "stats": st, "unit": unit, "goal": goal,
                                "meets": None if st is None or ok is None else ok(st["median"])})

        def of(contender, fn):
            """`fn`'s values from every record of `contender` on this QEMU."""
            return [v for r in raw["records"] if r["contender"] == contender
                    and (lab == "None" or r.get("qemu") == lab) for v in fn(r)]

        pst = _g(f, "pause_qemu_events", "values", "backstop")
        row("pause (QEMU STOP->RESUME)", pst, "ms", f"<= {pause_goal} ms at 1 GiB",
            lambda m: m <= pause_goal)
        row("pause seen by the guest (its clock stopped)", _g(f, "pause_stopped", "values", "backstop"),
            "ms", f"<= {pause_goal} ms at 1 GiB", lambda m: m <= pause_goal)
        # The same with one backstop option set, when that contender ran: `vm.huge_pages = "all"`
        # (the guest's whole RAM mapped huge after each snapshot), `vm.capture_order =
        # "migrate-first"` (QEMU < 9.0; on >= 9.0 that is what backstop does by default).
        for contender, what in (("bshuge", 'huge_pages = "all"'),
                                ("bsorder", 'capture_order = "migrate-first"')):
            st = _g(f, "pause_qemu_events", "values", contender)
            if st:
                row(f"{what}: pause (QEMU STOP->RESUME)", st, "ms",
                    f"<= {pause_goal} ms at 1 GiB", lambda m: m <= pause_goal)
                row(f"{what}: pause seen by the guest",
                    _g(f, "pause_stopped", "values", contender), "ms",
                    f"<= {pause_goal} ms at 1 GiB", lambda m: m <= pause_goal)
        # Where the pause went, phase by phase (backstop's manifest, every snapshot of this QEMU).
        for contender, key in (("backstop", "pause_breakdown_ms"),
                               ("bshuge", "huge_pages_all_pause_breakdown_ms"),
                               ("bsorder", "migrate_first_pause_breakdown_ms")):
            phases = {}
            for r in raw["records"]:
                if r["contender"] != contender or (lab != "None" and r.get("qemu") != lab):
                    continue
                for snap in (r.get("snapshots") or {}).values():
                    for name, us in snap.get("pause_breakdown_us") or []:
                        phases.setdefault(name, []).append(us / 1e3)
            out[key] = {k: stats(v) for k, v in phases.items()}
        # Where the rollback went, phase by phase (the engine's report, every repetition), for
        # backstop's own QEMU and for a libvirt domain it adopted.
        for contender, key in (("backstop", "rollback_breakdown_ms"),
                               ("bsstandby", "standby_rollback_breakdown_ms"),
                               ("bspreload", "preload_rollback_breakdown_ms"),
                               ("bslibvirt", "libvirt_rollback_breakdown_ms")):
            rphases = {}
            for r in raw["records"]:
                if r["contender"] != contender or (lab != "None" and r.get("qemu") != lab):
                    continue
                for name, ms in (_g(r, "rollback", "phases_ms") or {}).items():
                    rphases.setdefault(name, []).append(ms)
            out[key] = {k: stats(v) for k, v in rphases.items()}
        lphases = {}
        for r in raw["records"]:
            if r["contender"] != "bslibvirt" or (lab != "None" and r.get("qemu") != lab):
                continue
            for snap in (r.get("snapshots") or {}).values():
                for name, us in snap.get("pause_breakdown_us") or []:
                    lphases.setdefault(name, []).append(us / 1e3)
        out["libvirt_pause_breakdown_ms"] = {k: stats(v) for k, v in lphases.items()}
        rb = _g(f, "rb_guest", "values", "backstop")
        sc = _g(f, "rb_guest", "values", "stopcopy")
        rb_vals = [_g(r, "rollback", "guest", "guest_running_ms") for r in raw["records"]
                   if r["contender"] == "backstop" and (lab == "None" or r.get("qemu") == lab)]
        row("rollback: request -> guest running", rb, "ms", "-", None)
        row("rollback / bare stop-and-copy restore (same QEMU)",
            _ratio_stats(rb_vals, sc and sc["median"]), "x", "<= 1.0", lambda m: m <= 1.0)
        row(f"rollback / virsh snapshot-revert (virsh on QEMU {virsh[0]})" if virsh[0]
            else "rollback / virsh snapshot-revert (virsh not in this run)",
            _ratio_stats(rb_vals, virsh[1] and virsh[1]["median"]), "x", "<= 0.1", lambda m: m <= 0.1)
        # The same, with a standby QEMU waiting for the rollback (docs/standby.md),
        # and with the target preloaded into it.
        for contender, what in (("bsstandby", "with a standby"), ("bspreload", "with a preload")):
            sb_rb = of(contender, lambda r: [_g(r, "rollback", "guest", "guest_running_ms")])
            if any(v is not None for v in sb_rb):
                row(f"{what}: rollback -> guest running", _g(f, "rb_guest", "values", contender),
                    "ms", "-", None)
                row(f"{what}: rollback / bare stop-and-copy restore",
                    _ratio_stats(sb_rb, sc and sc["median"]), "x", "<= 1.0", lambda m: m <= 1.0)
                row(f"{what}: rollback / virsh snapshot-revert",
                    _ratio_stats(sb_rb, virsh[1] and virsh[1]["median"]), "x", "<= 0.1",
                    lambda m: m <= 0.1)
        # The same rollbacks with the page cache dropped first: each side's stream from disk.
        cold_sc = _g(f, "rb_cold", "values", "stopcopy")
        for contender, what in (("backstop", "rollback"), ("bsstandby", "with a standby: rollback")):
            cold = of(contender, lambda r: [_g(r, "cold_rollback", "guest", "guest_running_ms")])
            if any(v is not None for v in cold):
                row(f"{what}, page cache dropped / the same for stop-and-copy",
                    _ratio_stats(cold, cold_sc and cold_sc["median"]), "x", "-", None)
        # The libvirt backend (a domain libvirt runs, adopted) against virsh on the
        # same domain XML and QEMU.
        lv = _g(f, "pause_qemu_events", "values", "bslibvirt")
        if lv or _g(f, "rb_guest", "values", "bslibvirt"):
            row("libvirt backend: pause per snapshot", lv, "ms", "<= 10 ms at 1 GiB", lambda m: m <= 10)
            row("libvirt backend: pause seen by the guest",
                _g(f, "pause_stopped", "values", "bslibvirt"), "ms", "<= 10 ms at 1 GiB",
                lambda m: m <= 10)
            lv_rb = [_g(r, "rollback", "guest", "guest_running_ms") for r in raw["records"]
                     if r["contender"] == "bslibvirt" and (lab == "None" or r.get("qemu") == lab)]
            row("libvirt backend: rollback -> guest running", _g(f, "rb_guest", "values", "bslibvirt"),
                "ms", "-", None)
            row("libvirt backend: rollback / virsh snapshot-revert",
                _ratio_stats(lv_rb, virsh[1] and virsh[1]["median"]), "x", "<= 0.2", lambda m: m <= 0.2)
        wd = [w for w in raw.get("watchdog") or [] if str(w.get("qemu")) == lab and "beyond_ms" in w]
        wd_err = [w["error"] for w in raw.get("watchdog") or [] if str(w.get("qemu")) == lab and w.get("error")]
        row("watchdog: expiry -> guest running, past the timeout", stats([w["beyond_ms"] for w in wd]),
            "ms", "<= 300 ms", lambda m: m <= 300)
        out["watchdog_error"] = wd_err[0] if wd_err else None
        dd = _g(f, "tput_dd", "values", "host", "median")
        # The store goal's measure: the store's ingest of a recorded stream (QEMU's own background
        # snapshot of the stop-and-copy guest on this version), each repetition against the same
        # bytes written to one file and fsynced in the same invocation (run.py's store_ingest).
        ing = [x["ratio"] for g in raw.get("store_ingest") or []
               if str(g.get("qemu")) == lab for x in g.get("reps") or []]
        row("store ingest of a recorded stream / dd (fsync)", stats(ing) if ing else None, "x",
            ">= 0.70", lambda m: m >= 0.70)
        out["store_ingest_error"] = next((g["error"] for g in raw.get("store_ingest") or []
                                          if str(g.get("qemu")) == lab and g.get("error")), None)
        # The same goal read against a live capture: stored bytes over the first snapshot's wall
        # time, which QEMU's stream rate bounds (its bare background snapshot's rate / dd, next).
        row("live capture: stored bytes / wall time / dd",
            _ratio_stats(of("backstop", rate("bytes_stored")), dd), "x", ">= 0.70",
            lambda m: m >= 0.70)
        row("  its ceiling: QEMU's bare background snapshot stream / dd",
            _ratio_stats(of("stopcopy", bg_rate), dd), "x", "-", None)
        bgw = _g(f, "wall_first", "values", "qemubg")
        row("capture wall time / QEMU's bare background snapshot",
            _ratio_stats(of("backstop", snap_value("first", "wall_ms")), bgw and bgw["median"]),
            "x", "<= 1.2", lambda m: m <= 1.2)
        rows.append(out)
    return rows


def headline_table(summary):
    m = summary["meta"]
    lines = [f"backstop per QEMU version: {m['memory_mib']} MiB guest, {m['fill_mib']} MiB data, "
             f"{m['reps']} repetition(s)" + (" [--quick]" if m.get("quick") else "")
             + f", watchdog {m.get('watchdog_reps', '-')} expiry(ies) per QEMU"
             + f", backstop's chunks named by {m.get('chunk_hash', 'sha256')}"]
    h = m.get("host") or {}
    lines.append(f"commit {m.get('git_commit') or '-'}; CPU {h.get('cpu_model') or '-'} x{h.get('nproc')}; "
                 f"kernel {h.get('kernel')}; accel {m.get('accel')}")
    for q in m.get("qemus") or []:
        lines.append(f"QEMU {q['label']}: {q['binary']} ({q['version']})"
                     + ("" if q.get("virsh", True) else "; virsh not run on it (libvirt uses the system QEMU)"))
    lines.append("cells: median [min..max] (n)")
    for v in summary["headline"]:
        lines.append("")
        lines.append(f"QEMU {v['qemu']}  [{v['size']}]")
        w = max(len(r["figure"]) for r in v["rows"]) + 2
        for r in v["rows"]:
            st = r["stats"]
            cell = "-" if not st else f"{_cell(st)} ({st['n']})"
            verdict = "" if r["meets"] is None else ("meets" if r["meets"] else "misses")
            lines.append(f"  {r['figure']:<{w}}{cell:>24} {r['unit']:<3} goal {r['goal']:<20} {verdict}")
        for key, what in (("watchdog_error", "watchdog"), ("store_ingest_error", "store ingest")):
            if v.get(key):
                lines.append(f"  {what}: {v[key]}")
        pb = v.get("pause_breakdown_ms") or {}
        if pb:
            lines.append("  pause breakdown (ms, median [min..max]): "
                         + ", ".join(f"{k} {_cell(st)}" for k, st in pb.items()))
        for key, what in (("huge_pages_all_pause_breakdown_ms", 'huge_pages = "all": pause breakdown'),
                          ("migrate_first_pause_breakdown_ms", 'capture_order = "migrate-first": pause breakdown'),
                          ("rollback_breakdown_ms", "rollback breakdown"),
                          ("standby_rollback_breakdown_ms", "with a standby: rollback breakdown"),
                          ("preload_rollback_breakdown_ms", "with a preload: rollback breakdown"),
                          ("libvirt_pause_breakdown_ms", "libvirt backend: pause breakdown"),
                          ("libvirt_rollback_breakdown_ms", "libvirt backend: rollback breakdown")):
            rb = v.get(key) or {}
            if rb:
                lines.append(f"  {what} (ms, median [min..max]): "
                             + ", ".join(f"{k} {_cell(st)}" for k, st in rb.items()))
    return "\n".join(lines) + "\n"


def table(summary):
    parts = [headline_table(summary)]
    for lab, s in summary["per_qemu"].items():
        parts.append("=" * 100 + "\n" + f"QEMU {lab}: all figures\n" + table_one(s))
    return "\n".join(parts)


def chart(summary, path):
    """One chart per QEMU version: chart.png for the first, chart-<version>.png for the others."""
    from pathlib import Path
    path = Path(path)
    drawn = False
    for i, (lab, s) in enumerate(summary["per_qemu"].items()):
        p = path if i == 0 else path.with_name(f"{path.stem}-{lab}{path.suffix}")
        drawn = chart_one(s, p) or drawn
    return drawn



# --- docs/benchmarks.md: the tables between its marker comments, redrawn from saved runs -------
#
# A block of the doc is the text between `<!-- BEGIN report:NAME -->` and `<!-- END report:NAME -->`.
# `--docs DOC FILE...` rewrites every block from the saved runs given (a bench.sh raw.json, a
# bench-many.sh JSON); `--check` renders the same and exits 1 if the doc (or a saved summary
# beside a raw file) differs, so a table edited by hand, or data without its table, fails CI.

BEGIN, END = "<!-- BEGIN report:{} -->", "<!-- END report:{} -->"


def _when(iso):
    """'2026-12-01 23:20 UTC' from an ISO timestamp (as run.py writes it)."""
    import datetime
    try:
        t = datetime.datetime.fromisoformat(str(iso))
    except ValueError:
        return str(iso)
    if t.utcoffset() is not None:
        t = t.astimezone(datetime.timezone.utc)
    return t.strftime("%Y-%m-%d %H:%M UTC")


def _load_line(samples):
    one = [x["1m"] for x in samples or [] if x]
    if not one:
        return "not recorded"
    return (f"1-minute load average {_fmt(min(one))}-{_fmt(max(one))} (median "
            f"{_fmt(statistics.median(one))}, {len(one)} samples through the run)")


def _short_commit(c):
    if not c:
        return "-"
    dirty = c.endswith("-dirty")
    return c[:7] + (" (tree modified)" if dirty else "")


def _qemu_names(meta):
    return " and ".join(q["label"] for q in meta.get("qemus") or []) or "-"


def run_source(meta, path):
    """The one line above each table: which run it comes from."""
    h = meta.get("host") or {}
    return (f"From the saved run of {_when(meta.get('started'))}, commit {_short_commit(meta.get('git_commit'))}, "
            f"{h.get('cpu_model') or '-'} x{h.get('nproc')}, kernel {h.get('kernel')}, "
            f"QEMU {_qemu_names(meta)}, {meta['memory_mib']} MiB guest, {meta['reps']} repetition(s) "
            f"(`{path}`).")


def _cell_u(st, unit, pct=False):
    """median [min..max] unit (n)."""
    if not st:
        return "-"
    if pct:
        f = (lambda x: f"{x * 100:.0f}%")
        body = f(st["median"]) if st["n"] == 1 else f"{f(st['median'])} [{f(st['min'])}..{f(st['max'])}]"
        return f"{body} ({st['n']})"
    u = {"x": "x", "ms": " ms", "MB/s": " MB/s", "MB": " MB"}.get(unit, f" {unit}")
    if st["n"] == 1:
        return f"{_fmt(st['median'])}{u} (1)"
    return f"{_fmt(st['median'])}{u} [{_fmt(st['min'])}..{_fmt(st['max'])}] ({st['n']})"


def _verdict(ok):
    return "" if ok is None else (": met" if ok else ": **not met**")


def _phases(ph):
    return ", ".join(f"{k} {_fmt(v['median'])}" for k, v in (ph or {}).items() if v) or "-"


def _md_table(head, rows):
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        out.append("| " + " | ".join(_md_cell(c) for c in r) + " |")
    return "\n".join(out)


def _md_cell(c):
    return str(c).replace("|", "\\|").replace("<= ", "≤ ").replace(">= ", "≥ ").replace("->", "→")


def docs_blocks_run(raw, path, summary=None):
    """The blocks of a bench.sh run: run (its metadata), snapshot, rollback, watchdog, store."""
    summary = summary or summarize(raw)
    meta = summary["meta"]
    labs = list(summary["per_qemu"])
    heads = {v["qemu"]: v for v in summary["headline"]}
    qhead = ["figure"] + [f"QEMU {lab}" for lab in labs] + ["goal"]
    src = run_source(meta, path)

    def hrow(lab, name):
        return next((r for r in heads[lab]["rows"] if r["figure"] == name), None)

    def from_head(name, label=None, goal=None, pct=False):
        cells = []
        any_value = False
        for lab in labs:
            r = hrow(lab, name)
            if not r or not r["stats"]:
                cells.append("-")
                continue
            any_value = True
            cells.append(_cell_u(r["stats"], r["unit"], pct) + _verdict(r["meets"]))
        g = goal if goal is not None else next((hrow(lab, name)["goal"] for lab in labs if hrow(lab, name)), "-")
        return [label or name] + cells + [g] if any_value else None

    def from_fig(key, contender, label, goal="-", scale=1.0, pct=False, ok=None):
        cells, any_value = [], False
        for lab in labs:
            st = _g(summary["per_qemu"][lab], "figures", key, "values", contender)
            if not st:
                cells.append("-")
                continue
            any_value = True
            if scale != 1.0:
                st = {k: (v * scale if k != "n" else v) for k, v in st.items()}
            unit = summary["per_qemu"][lab]["figures"][key]["unit"]
            cells.append(_cell_u(st, unit, pct) + _verdict(None if ok is None else ok(lab, st["median"])))
        return [label] + cells + [goal] if any_value else None

    def from_head_key(key, label):
        cells = [_phases(heads[lab].get(key)) for lab in labs]
        return [label] + cells + ["-"] if any(c != "-" for c in cells) else None

    blocks = {}

    # The run itself.
    h = meta.get("host") or {}
    v = meta.get("versions") or {}
    rows = [
        ["date", f"{_when(meta.get('started'))} to {_when(meta.get('finished'))}"
                 + (f" ({meta['wall_s'] / 60:.0f} min)" if meta.get("wall_s") else "")],
        ["commit", f"`{meta.get('git_commit') or '-'}`"],
        ["CPU", f"{h.get('cpu_model') or '-'}, {h.get('nproc')} cores"
                + (f", {h['mem_mib'] / 1024:.0f} GiB RAM" if h.get("mem_mib") else "")],
        ["kernel", f"{h.get('kernel')} (accelerator {meta.get('accel')})"],
    ]
    for q in meta.get("qemus") or []:
        rows.append([f"QEMU {q['label']}", f"{q['version']}" + ("" if q.get("virsh", True) else
                                                               "; virsh not run on it")])
    rows += [
        ["libvirt", v.get("libvirt") or "-"],
        ["guest", f"{meta['memory_mib']} MiB RAM, {meta['fill_mib']} MiB random data resident, writer "
                  f"rewrites {meta['dirty_mib']} MiB ({meta['dirty_pct']}% of RAM) every {meta['dirty_every_s']} s"],
        ["contenders", ", ".join(f"`{c}`" for c in meta.get("contenders") or [])],
        ["repetitions", f"{meta['reps']} per contender and QEMU; watchdog {meta.get('watchdog_reps')} "
                        f"expiries per QEMU; rollback with the page cache dropped: "
                        f"{'yes' if meta.get('cold_rollback') else 'no'}"],
        ["chunk hash", meta.get("chunk_hash") or "sha256"],
        ["load", _load_line(meta.get("load"))],
    ]
    if meta.get("note"):
        rows.append(["note", meta["note"]])
    errs = [f"{e['contender']} QEMU {lab} rep {e['rep']}: {e['error'].splitlines()[0]}"
            for lab, s in summary["per_qemu"].items() for e in s["errors"]]
    rows.append(["failed measurements", "; ".join(errs) if errs else "none"])
    blocks["run"] = f"Saved run: `{path}`.\n\n" + _md_table(["", "this run"], rows)

    def pause_goal(lab, m):
        return m <= (5 if (_major(lab) or 0) >= 9 else 12)

    snap = [
        from_head("pause (QEMU STOP->RESUME)", "backstop: guest pause per snapshot (QEMU `STOP` to `RESUME`)",
                  "<= 12 ms on 7.2, <= 5 ms on >= 9.0"),
        from_head("pause seen by the guest (its clock stopped)", "backstop: pause seen by the guest",
                  "<= 12 ms on 7.2, <= 5 ms on >= 9.0"),
        from_head_key("pause_breakdown_ms", "backstop: where the pause went, phase medians (ms)"),
        from_fig("pause_qemu_events", "bspreload", "backstop + preload: guest pause per snapshot", "as backstop",
                 ok=pause_goal),
        from_fig("pause_stopped", "stopcopy", "stop-and-copy: pause seen by the guest"),
        from_fig("pause_stopped", "virsh", "virsh snapshot-create-as: pause seen by the guest"),
        from_fig("pause_stopped", "qemubg", "QEMU's own background snapshot (no disk switch): pause seen by the guest"),
        from_head("libvirt backend: pause per snapshot", "backstop on a libvirt domain: guest pause per snapshot"),
        from_head("libvirt backend: pause seen by the guest", "backstop on a libvirt domain: pause seen by the guest"),
        from_fig("noise_stopped", "backstop", "noise floor: 'pause' measured in a quiet window"),
        from_fig("wall_first", "backstop", "backstop: first snapshot's wall time"),
        from_fig("wall_first", "qemubg", "QEMU's own background snapshot: wall time"),
        from_head("capture wall time / QEMU's bare background snapshot", "backstop / QEMU's own background snapshot, wall time"),
        from_fig("bytes_first", "backstop", "backstop: stored by the first snapshot"),
        from_fig("ratio_idle", "backstop", "backstop: stored by an idle second snapshot / first", "<= 10%",
                 pct=True, ok=lambda lab, m: m <= 0.10),
        from_fig("ratio_dirty", "backstop", "backstop: stored after 10% of RAM rewritten / first", pct=True),
    ]
    blocks["snapshot"] = src + "\n\n" + _md_table(qhead, [r for r in snap if r])

    rb = [
        from_head("rollback: request -> guest running", "backstop: request to guest running at the snapshot point"),
        from_head("rollback / bare stop-and-copy restore (same QEMU)", "backstop / stop-and-copy restore"),
        next((from_head(r["figure"], "backstop / virsh snapshot-revert", "<= 0.1")
              for lab in labs for r in heads[lab]["rows"] if r["figure"].startswith("rollback / virsh")), None),
        from_head_key("rollback_breakdown_ms", "backstop: where the rollback went, phase medians (ms)"),
        from_head("with a preload: rollback -> guest running", "backstop + preload: request to guest running"),
        from_head("with a preload: rollback / bare stop-and-copy restore", "backstop + preload / stop-and-copy restore"),
        from_head("with a preload: rollback / virsh snapshot-revert", "backstop + preload / virsh snapshot-revert"),
        from_head_key("preload_rollback_breakdown_ms", "backstop + preload: where the rollback went (ms)"),
        from_head("with a standby: rollback -> guest running", "backstop + standby: request to guest running"),
        from_head("with a standby: rollback / bare stop-and-copy restore", "backstop + standby / stop-and-copy restore"),
        from_head("libvirt backend: rollback -> guest running", "backstop on a libvirt domain: request to guest running"),
        from_head("libvirt backend: rollback / virsh snapshot-revert", "backstop on a libvirt domain / virsh snapshot-revert"),
        from_head_key("libvirt_rollback_breakdown_ms", "backstop on a libvirt domain: where the rollback went (ms)"),
        from_fig("rb_guest", "stopcopy", "stop-and-copy: restore into a fresh QEMU, to guest running"),
        from_fig("rb_guest", "virsh", "virsh snapshot-revert, to guest running"),
        from_fig("rb_probe", "virsh", "of which libvirt re-probing QEMU (a quirk of this machine)"),
        from_fig("rb_cold", "backstop", "backstop, page cache dropped first"),
        from_fig("rb_cold", "stopcopy", "stop-and-copy, page cache dropped first"),
        from_head("rollback, page cache dropped / the same for stop-and-copy",
                  "backstop / stop-and-copy, page cache dropped"),
        from_fig("orphan_reap", "host", "host: PID 1 reaps a killed orphan (libvirt's destroy waits for it)"),
    ]
    blocks["rollback"] = src + "\n\n" + _md_table(qhead, [r for r in rb if r])

    wd = [from_head("watchdog: expiry -> guest running, past the timeout",
                    "watchdog expiry to guest running, past the 4 s heartbeat timeout")]
    wderr = [f"QEMU {lab}: {heads[lab]['watchdog_error']}" for lab in labs if heads[lab].get("watchdog_error")]
    blocks["watchdog"] = src + "\n\n" + _md_table(qhead, [r for r in wd if r]) + (
        "\n\nFailed: " + "; ".join(wderr) if wderr else "")

    def ingest(lab, key):
        return stats([x[key] / MB for g in raw.get("store_ingest") or [] if str(g.get("qemu")) == lab
                      for x in g.get("reps") or [] if x.get(key)])

    def ingest_row(key, label):
        cells = [_cell_u(ingest(lab, key), "MB/s") for lab in labs]
        return [label] + cells + ["-"] if any(c != "-" for c in cells) else None

    st = [
        from_head("store ingest of a recorded stream / dd (fsync)",
                  "store ingest of a recorded stream / `dd` (fsync), per-repetition ratios"),
        ingest_row("ingest_bytes_per_s", "store ingest: cut, hash, write, publish"),
        ingest_row("dd_bytes_per_s", "`dd` of the same bytes, one file, fsync"),
        from_head("live capture: stored bytes / wall time / dd", "live capture: stored bytes / wall time / `dd`"),
        from_head("  its ceiling: QEMU's bare background snapshot stream / dd",
                  "its ceiling: QEMU's own background snapshot stream / `dd`"),
    ]
    blocks["store"] = src + "\n\n" + _md_table(qhead, [r for r in st if r])

    # Every goal of the headline, met or not, in one list: where the run falls short, plainly.
    met, missed = [], []
    for lab in labs:
        for r in heads[lab]["rows"]:
            if r["meets"] is None:
                continue
            line = (f"{r['figure'].strip()}, QEMU {lab}: {_cell_u(r['stats'], r['unit'])} against "
                    f"{r['goal']}")
            (met if r["meets"] else missed).append(_md_cell(line))
    blocks["verdicts"] = (f"Goals this run did not meet ({len(missed)}):\n\n"
                          + ("\n".join(f"- {x}" for x in missed) or "- none")
                          + f"\n\nGoals it met ({len(met)}):\n\n"
                          + ("\n".join(f"- {x}" for x in met) or "- none"))
    return blocks


def docs_blocks_many(raw, path):
    """The block of a bench-many.sh run: pause and watchdog per VM count, against one VM."""
    meta = raw.get("meta") or {}
    h = meta.get("host") or {}
    q = meta.get("qemu") or {}
    src = (f"From the saved run of {_when(meta.get('started'))}, commit {_short_commit(meta.get('git_commit'))}, "
           f"{h.get('cpu_model') or '-'} x{h.get('nproc')}, kernel {h.get('kernel')}, QEMU "
           f"{q.get('label') or q.get('version') or '-'}, {raw['memory_mib']} MiB guests, "
           f"{meta.get('rounds')} snapshot(s) per VM, {meta.get('reps')} watchdog expiries per count; "
           f"{_load_line(meta.get('load'))} (`{path}`)."
           + (f" Note: {meta['note']}." if meta.get("note") else ""))
    counts = raw["counts"]
    base = {}
    rows = []
    for n in counts:
        r = raw["runs"].get(str(n)) or {}
        ps, ws = stats(r.get("pause_ms") or []), stats(r.get("beyond_timeout_ms") or [])
        if n == counts[0]:
            base = {"p": ps and ps["median"], "w": ws and ws["median"]}

        def x(st, b):
            return f"{st['median'] / b:.2f}x" if st and b else "-"
        rows.append([str(n), _cell_u(ps, "ms"), x(ps, base["p"]), _cell_u(ws, "ms"), x(ws, base["w"])])
    top = counts[-1]
    r = raw["runs"].get(str(top)) or {}
    ps, ws = stats(r.get("pause_ms") or []), stats(r.get("beyond_timeout_ms") or [])
    if top >= 8 and ps and ws and base["p"] and base["w"]:
        ok = ps["median"] / base["p"] <= 1.5 and ws["median"] / base["w"] <= 1.5
        verdict = f"Goal, both within 1.5x of one VM's at 8 VMs: {'met' if ok else '**not met**'}."
    else:
        verdict = (f"Goal, both within 1.5x of one VM's at 8 VMs: not read, this run went up to {top} "
                   f"VM(s) (`--vms 1,4,8` does).")
    return {"many": src + "\n\n" + _md_table(
        ["VMs", "guest pause per snapshot", "x 1 VM", "watchdog: past the timeout", "x 1 VM"], rows)
        + "\n\n" + verdict}


def _summary_path(raw_path):
    from pathlib import Path
    p = Path(raw_path)
    if p.name.endswith(".raw.json"):
        return p.with_name(p.name[: -len(".raw.json")] + ".summary.json")
    return None


def docs_render(paths, doc_dir):
    """{block name: text} from every saved run given; and {summary path: its text}."""
    import json
    import os
    blocks, summaries = {}, {}
    for path in paths:
        with open(path) as fh:
            raw = json.load(fh)
        # Named from the repository's root, whatever the working directory.
        rel = os.path.relpath(os.path.abspath(path), os.path.dirname(os.path.dirname(
            os.path.abspath(__file__))))
        if "records" in raw:
            summary = summarize(raw)
            new = docs_blocks_run(raw, rel, summary)
            sp = _summary_path(path)
            if sp:
                summaries[str(sp)] = json.dumps(summary, indent=1) + "\n"
        elif "runs" in raw and "counts" in raw:
            new = docs_blocks_many(raw, rel)
        else:
            raise SystemExit(f"{path}: neither a bench.sh raw.json nor a bench-many.sh JSON")
        for k in new:
            if k in blocks:
                raise SystemExit(f"{path}: a second run for the doc's block {k!r}")
        blocks.update(new)
    return blocks, summaries


def docs_apply(text, blocks):
    """The doc with every marked block replaced; raises if a marker has no data or vice versa."""
    import re
    seen = set()

    def sub(m):
        name = m.group(1)
        if name not in blocks:
            raise SystemExit(f"the doc has a block report:{name} and no saved run renders it")
        seen.add(name)
        return f"{BEGIN.format(name)}\n{blocks[name]}\n{END.format(name)}"
    out = re.sub(r"<!-- BEGIN report:([\w-]+) -->\n.*?<!-- END report:\1 -->", sub, text, flags=re.S)
    missing = sorted(set(blocks) - seen)
    if missing:
        raise SystemExit("the doc has no block for " + ", ".join(f"report:{n}" for n in missing)
                         + f" (add {BEGIN.format(missing[0])} ... {END.format(missing[0])})")
    return out


def docs_main(doc, paths, check):
    import difflib
    from pathlib import Path
    blocks, summaries = docs_render(paths, doc)
    old = Path(doc).read_text()
    new = docs_apply(old, blocks)
    stale = []
    if new != old:
        stale.append((doc, old, new))
    for sp, text in summaries.items():
        cur = Path(sp).read_text() if Path(sp).exists() else ""
        if cur != text:
            stale.append((sp, cur, text))
    if check:
        for name, a, b in stale:
            sys.stdout.writelines(difflib.unified_diff(a.splitlines(True), b.splitlines(True),
                                                       f"{name} (committed)", f"{name} (from the data)", n=1))
        if stale:
            print(f"report: {', '.join(n for n, _, _ in stale)}: not what the saved runs "
                  f"render; to redraw: python3 bench/report.py --docs {doc} {' '.join(paths)}", file=sys.stderr)
            return 1
        return 0
    for name, _, b in stale:
        Path(name).write_text(b)
        print(f"report: rewrote {name}", file=sys.stderr)
    return 0


def strip_raw(raw):
    """A saved run fit to commit: the tracebacks of failed measurements dropped (their one-line
    error stays), which no figure is computed from."""
    raw = json.loads(json.dumps(raw))
    for r in raw.get("records") or []:
        r.pop("traceback", None)
    return raw


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(
        description="Redraw a saved run's table (and chart) from raw.json; or, with --docs, the "
                    "tables of docs/benchmarks.md from the saved runs kept beside it.",
        epilog="python3 bench/report.py --docs docs/benchmarks.md docs/benchmarks/*.raw.json "
               "[--check]")
    ap.add_argument("raw", nargs="+", help="raw.json of a run (results/<timestamp>/raw.json); with "
                    "--docs, every saved run the doc's tables come from")
    ap.add_argument("--chart", help="also draw the chart(s) into this PNG path")
    ap.add_argument("--summary", help="also write summary.json here")
    ap.add_argument("--docs", metavar="DOC", help="rewrite the report:NAME blocks of this markdown "
                    "file (and each X.summary.json beside an X.raw.json) from the saved runs")
    ap.add_argument("--check", action="store_true", help="with --docs: write nothing, exit 1 if "
                    "the doc or a summary differs from what the saved runs render")
    ap.add_argument("--save", metavar="OUT", help="write a copy of raw.json fit to commit "
                    "(tracebacks dropped) to OUT")
    a = ap.parse_args()
    if a.docs:
        sys.exit(docs_main(a.docs, a.raw, a.check))
    if a.check:
        ap.error("--check goes with --docs")
    if len(a.raw) != 1:
        ap.error("one raw.json without --docs")
    a.raw = a.raw[0]
    if a.save:
        import os
        os.makedirs(os.path.dirname(os.path.abspath(a.save)), exist_ok=True)
        with open(a.raw) as fh, open(a.save, "w") as out:
            json.dump(strip_raw(json.load(fh)), out, indent=1)
            out.write("\n")
    with open(a.raw) as fh:
        summary = summarize(json.load(fh))
    sys.stdout.write(table(summary))
    if a.summary:
        with open(a.summary, "w") as fh:
            json.dump(summary, fh, indent=1)
    if a.chart and not chart(summary, a.chart):
        print("no chart: matplotlib missing", file=sys.stderr)
