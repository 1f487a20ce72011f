#!/usr/bin/env python3
"""The floor of backstop's snapshot pause on a QEMU, without backstop: a bare QMP client drives
the order backstop's capture uses on QEMU >= 9.0 and times each step.

One QEMU runs the bench guest (the same command line as bench/run.py's contenders) until its
fill is done; then, `--reps` times: `stop` -> `migrate` (background-snapshot into a pipe this
script drains) -> `query-migrate` polled until RAM pages are counted (write tracking is on) ->
`cont`. With `--switch` the disk is switched to a fresh overlay inside each pause as backstop
does (created and opened before `stop`, `blockdev-snapshot` after it); without, it is a lower
bound for that order.
Prints per snapshot the host-side steps and QEMU's own event times (STOP, MIGRATION setup/active,
RESUME: the guest's pause is STOP -> RESUME), then the medians.

On QEMU 7.2/8.x QEMU resumes the guest by itself after the snapshot's setup; the script still
sends `cont`, which is then a no-op (the STOP -> RESUME pause is still QEMU's own).

Each line also shows how much of the guest's RAM is mapped in huge pages before that snapshot
(`AnonHugePages` of QEMU's guest RAM mapping): QEMU's background snapshot splits them all, and
the next snapshot's write protection then walks 512 times as many entries. With `--collapse`
the script collapses them again before each snapshot as backstop does after each capture
(`process_madvise(MADV_COLLAPSE)` over the whole mapping here, which also fills never-touched
ranges; backstop collapses only wholly resident ranges, crates/backstop-qmp/src/huge_pages.rs).

With `--early-stop MS` the order is the one backstop uses on QEMU >= 9.0 once it learnt a lead:
`migrate` on the running guest, `stop` MS later (a STOP after QEMU's `active` is reported as
lost). With `--trace FILE` QEMU logs its own migration trace points with timestamps: the
pre-fault of guest RAM, the state setup, its stop, the device-state save per device, the
write-protection start.

    python3 bench/pause_probe.py --qemu QEMU10 --memory-mib 1024 --fill-mib 400 --reps 5
"""

import argparse
import fcntl
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import contenders as C  # noqa: E402
import qmp as qmplib  # noqa: E402

F_SETPIPE_SZ = 1031
# QEMU's trace points along a background snapshot's start, in the order they fire.
TRACE_POINTS = ["migrate_set_state", "savevm_state_header", "savevm_state_setup",
                "migration_thread_setup_complete", "vmstate_downtime_checkpoint",
                "savevm_state_complete_precopy", "ram_write_tracking_ramblock_start",
                "savevm_section_start", "savevm_section_end"]
SYS_PIDFD_OPEN, SYS_PROCESS_MADVISE, MADV_COLLAPSE = 434, 440, 25


def guest_ram(pid, size):
    """QEMU's guest RAM mapping (the anonymous private one of at least `size` bytes) from its
    smaps: (start, end, resident bytes, huge-mapped bytes)."""
    found, cur = None, None
    for line in open(f"/proc/{pid}/smaps"):
        f = line.split()
        if len(f) >= 5 and "-" in f[0] and ":" in f[3] and len(f[1]) == 4:
            a, b = (int(x, 16) for x in f[0].split("-"))
            cur = [a, b, 0, 0] if len(f) == 5 and f[1] == "rw-p" and b - a >= size else None
            if cur:
                found = cur
        elif cur is not None and f and f[0] in ("Rss:", "AnonHugePages:"):
            cur[2 if f[0] == "Rss:" else 3] = int(f[1]) * 1024
    return found


def collapse(pid, start, length):
    """process_madvise(MADV_COLLAPSE) over [start, start+length) of `pid`; ms taken."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)

    class IoVec(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
    pidfd = libc.syscall(SYS_PIDFD_OPEN, pid, 0)
    if pidfd < 0:
        raise OSError(ctypes.get_errno(), "pidfd_open")
    t = time.monotonic()
    try:
        iov = IoVec(start, length)
        if libc.syscall(SYS_PROCESS_MADVISE, pidfd, ctypes.byref(iov), 1, MADV_COLLAPSE, 0) < 0:
            err = ctypes.get_errno()
            if err != 11:  # EAGAIN: some range busy; the rest was done
                raise OSError(err, "process_madvise(MADV_COLLAPSE)")
    finally:
        os.close(pidfd)
    return (time.monotonic() - t) * 1e3


class Disk:
    """With --switch: the disk's active layer and node, switched to a fresh overlay inside the
    pause as backstop does (created and opened before `stop`, `blockdev-snapshot` after it)."""

    def __init__(self, path, node):
        self.path, self.node, self.base, self.n = Path(path), node, node, 0

    def prepare(self, q):
        self.n += 1
        new = self.path.parent / f"layer-{self.n}.qcow2"
        size = json.loads(C.run(["qemu-img", "info", "-U", "--output=json", str(self.path)]).stdout)["virtual-size"]
        C.run(["qemu-img", "create", "-q", "-f", "qcow2", "-u", "-F", "qcow2", "-b", str(self.path), str(new),
               str(size)])
        node = f"{self.base}-{self.n}"
        q.execute("blockdev-add", {"driver": "qcow2", "node-name": node, "backing": None,
                                   "file": {"driver": "file", "filename": str(new)}})
        return new, node

    def switch_command(self, prepared):
        """The `transaction` that switches to `prepared`, as (command, arguments); from here on
        the disk's active layer is the new one."""
        new, node = prepared
        command = ("transaction", {"actions": [
            {"type": "blockdev-snapshot", "data": {"node": self.node, "overlay": node}}]})
        self.path, self.node = new, node
        return command

    def switch(self, q, prepared):
        q.execute(*self.switch_command(prepared))


def bg_thread(pid, timeout=1.0):
    """The tid of QEMU's background-snapshot thread (needs `-name ...,debug-threads=on`; QEMU 7.2
    names it `bg_snapshot`, 10.0 `mig/snapshot`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                if open(f"/proc/{pid}/task/{tid}/comm").read().strip() in ("bg_snapshot", "mig/snapshot"):
                    return int(tid)
            except OSError:
                pass
    print("warning: no snapshot thread among", sorted({open(f"/proc/{pid}/task/{t}/comm").read().strip()
                                                for t in os.listdir(f"/proc/{pid}/task")}), flush=True)
    return None


def cpu_ns(pid, tid):
    try:
        return int(open(f"/proc/{pid}/task/{tid}/schedstat").read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def active_seen(q):
    """Whether QEMU's MIGRATION `active` (or later) arrived, reading without blocking long."""
    if any(e.get("event") == "MIGRATION" and e["data"]["status"] != "setup" for e in q.events):
        return True
    try:
        q.sock.settimeout(0.0001)
        r = q._read()
        if "event" in r:
            q.events.append(r)
    except (TimeoutError, OSError, qmplib.QMPError):
        pass
    return any(e.get("event") == "MIGRATION" and e["data"]["status"] != "setup" for e in q.events)


def open_capture(q):
    """A pipe for the next capture: its write end handed to QEMU as fd `probe`, its read end
    drained by a thread; waits until QEMU >= 9.0 let go of the previous migration's yank
    instance (a `migrate` before that is refused). Returns (read fd, draining thread)."""
    r, w = os.pipe()
    fcntl.fcntl(w, F_SETPIPE_SZ, 1 << 20)
    try:
        q.execute("getfd", {"fdname": "probe"}, fd=w)
    finally:
        os.close(w)

    def drain():
        while os.read(r, 1 << 20):
            pass

    reader = threading.Thread(target=drain)
    reader.start()
    while any(i.get("type") == "migration" for i in q.execute("query-yank")):
        time.sleep(0.001)
    return r, reader


def switched_in_time(q):
    """Right after the disk switch's answer: whether it came before any RESUME (printing when
    not). On 7.2/8.x QEMU resumes the guest itself once its write tracking is on, and QEMU
    answers and emits in the order things happen: a RESUME already read let the guest write
    the old layer after the RAM instant (backstop discards such a capture and takes it again)."""
    if any(e.get("event") == "RESUME" for e in q.events):
        print("  late: QEMU resumed the guest before the disk switch answered", flush=True)
        return False
    return True


def snapshot_cpu(q, pid, disk, target_ns, fraction):
    """`migrate` first; `stop` once QEMU's snapshot thread has used `fraction` of `target_ns`
    of CPU (its pre-fault of guest RAM is pure CPU work, so its progress shows there whatever
    the host's load). Returns (CPU ns the thread had used when `active` arrived, won, events)."""
    r, reader = open_capture(q)
    prepared = disk.prepare(q) if disk else None
    q.execute("migrate", {"uri": "fd:probe"})
    tid = bg_thread(pid)
    stopped, last = False, 0
    while not active_seen(q):
        last = cpu_ns(pid, tid) or last
        if not stopped and target_ns and last >= fraction * target_ns:
            q.sock.settimeout(30)
            q.execute("stop")
            stopped = True
    q.sock.settimeout(30)
    won = False
    if stopped:
        order = [e for e in q.events if e.get("event") == "STOP"
                 or (e.get("event") == "MIGRATION" and e["data"]["status"] == "active")]
        won = bool(order) and order[0]["event"] == "STOP"
        if disk and won:
            disk.switch(q, prepared)
            switched_in_time(q)
    else:
        q.execute("stop")
        if disk:
            disk.switch(q, prepared)
    while True:
        info = q.execute("query-migrate")
        ram = info.get("ram") or {}
        if info.get("status") == "completed" or ram.get("normal", 0) > 0 or ram.get("duplicate", 0) > 0:
            break
    q.execute("cont")
    q.wait_event(qmplib.migrate_status("completed", "failed", "cancelled"), timeout=600)
    reader.join()
    os.close(r)
    events = [e for e in q.events if e.get("event") in ("STOP", "RESUME", "MIGRATION")]
    q.events = []
    return last, won, events


def snapshot_qemu_stops(q, disk):
    """`migrate` on the running guest and no `stop` of ours: QEMU stops the guest itself at the
    end of its setup and resumes it after its device save and write-protection start. The disk
    switch is written the moment QEMU's STOP arrives, so that QEMU reads it while its snapshot
    thread still holds the big lock. Disks and RAM share one instant only if the switch ran
    before QEMU's resume: QEMU answers and emits in the order things happen, so the switch's
    answer must come before RESUME. Returns (switch answered before RESUME, QEMU events)."""
    r, reader = open_capture(q)
    prepared = disk.prepare(q) if disk else None
    q.execute("migrate", {"uri": "fd:probe"})
    stop = q.wait_event(qmplib.name_is("STOP"), timeout=30)
    in_time = None
    if disk:
        command, args = disk.switch_command(prepared)
        q.send(command, args)
        q.answer(command)
        in_time = switched_in_time(q)
    ev = q.wait_event(qmplib.migrate_status("completed", "failed", "cancelled"), timeout=600)
    reader.join()
    os.close(r)
    if ev["data"]["status"] != "completed":
        raise C.BenchError(f"background snapshot {ev['data']['status']}")
    events = sorted([stop] + [e for e in q.events if e.get("event") in ("STOP", "RESUME", "MIGRATION")],
                    key=qmplib.event_us)
    q.events = []
    return in_time, events


def boost_thread(pid, nice):
    """Renices QEMU's snapshot thread (found by name) to `nice`; returns its tid or None."""
    tid = bg_thread(pid, timeout=0.05)
    if tid:
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    return tid


def snapshot_once(q, disk=None, early_ms=None, boost=None, batch=None):
    """One capture in backstop's order; returns (host step times in ms, QEMU events). With
    `boost` = (QEMU's pid, nice), QEMU's snapshot thread is reniced right after `migrate`. With
    `batch`, `stop`, the disk switch and `migrate` are written in one go (`stop` first only):
    "switch-first" in that order, "switch-last" with the switch behind `migrate` (QEMU's setup
    then runs beside the switch; on 7.2/8.x a switch answered after RESUME is reported late)."""
    r, reader = open_capture(q)
    prepared = disk.prepare(q) if disk else None
    if early_ms is None and batch:
        t0 = time.monotonic()
        commands = [("stop", None)]
        switch = [disk.switch_command(prepared)] if disk else []
        if batch == "switch-last":
            commands += [("migrate", {"uri": "fd:probe"})] + switch
        else:
            commands += switch + [("migrate", {"uri": "fd:probe"})]
        q.execute_batch(commands)
        if batch == "switch-last" and disk:
            switched_in_time(q)
        t1 = t2 = time.monotonic()
    elif early_ms is None:
        t0 = time.monotonic()
        q.execute("stop")
        if disk:
            disk.switch(q, prepared)
        t1 = time.monotonic()
        q.execute("migrate", {"uri": "fd:probe"})
        if boost:
            boost_thread(*boost)
        t2 = time.monotonic()
    else:
        # `migrate` on the running guest; QEMU pre-faults its RAM without the big lock, then
        # stops the guest itself. Our `stop` goes in `early_ms` later: if its STOP comes before
        # QEMU's MIGRATION `active`, QEMU's own stop found the guest already stopped (on >= 9.0
        # it then leaves it stopped), and the disk switch still happens inside one pause.
        t1 = time.monotonic()
        q.execute("migrate", {"uri": "fd:probe"})
        if boost:
            boost_thread(*boost)
        t2 = time.monotonic()
        time.sleep(max(0.0, early_ms / 1e3 - (t2 - t1)))
        t0 = time.monotonic()
        q.execute("stop")
        order = [e for e in q.events if e.get("event") == "STOP"
                 or (e.get("event") == "MIGRATION" and e["data"]["status"] == "active")]
        won = bool(order) and order[0]["event"] == "STOP"
        if disk and won:
            disk.switch(q, prepared)
            switched_in_time(q)
        if not won:
            print(f"  lost: QEMU's stop came first (events {[e['event'] for e in order]})", flush=True)
    while True:
        info = q.execute("query-migrate")
        ram = info.get("ram") or {}
        if info.get("status") == "completed" or ram.get("normal", 0) > 0 or ram.get("duplicate", 0) > 0:
            break
        if info.get("status") not in ("setup", "active"):
            raise C.BenchError(f"background snapshot {info.get('status')}: {info.get('error-desc')}")
    t3 = time.monotonic()
    q.execute("cont")
    t4 = time.monotonic()
    ev = q.wait_event(qmplib.migrate_status("completed", "failed", "cancelled"), timeout=600)
    reader.join()
    os.close(r)
    if ev["data"]["status"] != "completed":
        raise C.BenchError(f"background snapshot {ev['data']['status']}")
    events = [e for e in q.events if e.get("event") in ("STOP", "RESUME", "MIGRATION")]
    q.events = []
    if early_ms is not None:
        t1 = t0  # the migrate went in before the stop
    host = {"stop+switch" if disk else "stop": (t1 - t0) * 1e3, "migrate": (t2 - t1) * 1e3, "until_tracking": (t3 - t2) * 1e3,
            "cont": (t4 - t3) * 1e3, "total": (t4 - t0) * 1e3}
    return host, events


def event_marks(events):
    """QEMU's events of one snapshot as `NAME[/status]@ms` from the first, and the guest's pause
    (the first STOP to the first RESUME after it, in ms; None without both)."""
    base = qmplib.event_us(events[0]) if events else 0
    marks = " ".join(e["event"] + ("/" + e["data"]["status"] if e["event"] == "MIGRATION" else "")
                     + f"@{(qmplib.event_us(e) - base) / 1e3:.2f}" for e in events)
    stops = [qmplib.event_us(e) for e in events if e["event"] == "STOP"]
    resumes = [qmplib.event_us(e) for e in events if e["event"] == "RESUME"]
    pause = (resumes[0] - stops[0]) / 1e3 if stops and resumes else None
    return marks, pause


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--qemu", required=True)
    ap.add_argument("--memory-mib", type=int, default=1024)
    ap.add_argument("--fill-mib", type=int, default=400)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--switch", action="store_true",
                    help="switch the disk to a fresh overlay inside each pause, as backstop does")
    ap.add_argument("--collapse", action="store_true",
                    help="collapse the guest RAM's huge pages again before each snapshot")
    ap.add_argument("--trace", metavar="FILE",
                    help="log QEMU's own migration trace points (with timestamps) into FILE, to split"
                         " its setup into the RAM pre-fault, the state setup, the stop and the write protection")
    ap.add_argument("--cpu-stop", type=float, metavar="FRACTION",
                    help="send `stop` once QEMU's snapshot thread used FRACTION of the CPU time its"
                         " setup took in the snapshots before (the first snapshot: after `active`)")
    ap.add_argument("--machine-opt", metavar="KEY=VALUE",
                    help="append a property to -machine (e.g. suppress-vmdesc=on)")
    ap.add_argument("--boost", type=int, metavar="NICE",
                    help="renice QEMU's snapshot thread to NICE (e.g. -10) right after `migrate`, "
                         "so that its setup runs at its CPU speed on a loaded host")
    ap.add_argument("--early-stop", type=float, metavar="MS",
                    help="send `migrate` on the running guest and `stop` MS later (QEMU >= 9.0: QEMU"
                         " pre-faults RAM meanwhile, outside the pause)")
    ap.add_argument("--batch", choices=["off", "on", "alternate", "switch-last", "alternate-order"],
                    default="off",
                    help="`stop` first: write `stop`, the disk switch and `migrate` in one go, as "
                         "backstop does (alternate: every other snapshot, to compare "
                         "both in one run: prints STOP -> MIGRATION setup per mode); switch-last: "
                         "`stop`, `migrate`, then the switch, in one go; alternate-order: every other "
                         "snapshot switch-last, to compare both orders in one run")
    ap.add_argument("--qemu-stops", action="store_true",
                    help="send `migrate` on the running guest and no `stop`: QEMU stops and resumes"
                         " the guest itself; with --switch the disk switch is written when QEMU's"
                         " STOP arrives (prints whether it ran before QEMU's RESUME)")
    ap.add_argument("--guest-dir", default=os.environ.get("BACKSTOP_GUEST_DIR")
                    or os.path.expanduser("~/.cache/backstop/guest"))
    a = ap.parse_args()
    if a.fill_mib + 64 > a.memory_mib * 0.8:
        ap.error("--fill-mib leaves the guest too little RAM")
    env = type("Env", (), {})()
    env.qemu, env.accel, env.memory_mib = a.qemu, "tcg", a.memory_mib
    env.guest = Path(a.guest_dir)
    env.append = (f"console=ttyS0 quiet panic=-1 backstop.fill_mib={a.fill_mib}"
                  " backstop.dirty_mib=1 backstop.dirty_every=100000")
    work = Path(tempfile.mkdtemp(prefix="pause-probe-", dir="/var/tmp"))
    proc = None
    try:
        disk = work / "disk.qcow2"
        C.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(env.guest / "disk-base.qcow2"),
               "-F", "qcow2", str(disk)])
        qmp_path, serial = work / "qmp.sock", work / "serial.log"
        args = C.qemu_args(env, "probe", disk, "disk-data", serial, work / "agent.sock", qmp_path,
                           work / "qemu.pid")
        if a.cpu_stop or a.boost is not None:
            args[args.index("-name") + 1] += ",debug-threads=on"
        if a.machine_opt:
            i = args.index("-machine") + 1
            args[i] += "," + a.machine_opt
        if a.trace:
            for ev in TRACE_POINTS:
                args += ["-trace", ev]
            args += ["-msg", "timestamp=on", "-D", a.trace]
        proc = subprocess.Popen(args,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        q = qmplib.QMP(str(qmp_path))
        q.execute("migrate-set-capabilities", {"capabilities": [
            {"capability": "events", "state": True},
            {"capability": "background-snapshot", "state": True}]})
        deadline = time.monotonic() + 600
        while b"BACKSTOP fill mib" not in (serial.read_bytes() if serial.exists() else b""):
            if time.monotonic() > deadline or proc.poll() is not None:
                raise C.BenchError("the guest did not finish its fill")
            time.sleep(0.5)
        time.sleep(2)
        pauses, rows, cpu_hist, by_mode, pause_by_mode = [], [], [], {}, {}
        disk_state = Disk(disk, "disk-data") if a.switch else None
        for rep in range(a.reps):
            ram = guest_ram(proc.pid, a.memory_mib << 20)
            thp = f"huge {ram[3] >> 20}/{ram[2] >> 20} MiB resident" if ram else "no guest RAM mapping found"
            # As backstop does, after a snapshot (before the first there is nothing split, and
            # never-touched ranges have no page table yet: the kernel refuses those).
            if a.collapse and ram and rep > 0:
                ms = collapse(proc.pid, ram[0], ram[1] - ram[0])
                after = guest_ram(proc.pid, a.memory_mib << 20)
                thp += f", collapsed in {ms:.0f} ms -> {after[3] >> 20}/{after[2] >> 20} MiB"
            if a.cpu_stop:
                target = min(cpu_hist) if cpu_hist else None
                # QEMU's own pid (a wrapper script may have started it).
                qemu_pid = int((work / "qemu.pid").read_text().strip())
                used, won, events = snapshot_cpu(q, qemu_pid, disk_state, target, a.cpu_stop)
                cpu_hist.append(used)
                marks, pause = event_marks(events)
                pauses.append(pause)
                print(f"snapshot {rep + 1}: thread CPU at active {used / 1e6:.2f} ms, target "
                      f"{(target or 0) / 1e6:.2f} ms, {'won' if won else 'stop after active'}, pause {pause:.2f} ms"
                      f" | {marks} | {thp}", flush=True)
                time.sleep(2)
                continue
            if a.qemu_stops:
                in_time, events = snapshot_qemu_stops(q, disk_state)
                marks, pause = event_marks(events)
                pauses.append(pause)
                verdict = {None: "no switch", True: "switch before RESUME", False: "LATE: switch after RESUME"}
                print(f"snapshot {rep + 1}: pause {pause:.2f} ms, {verdict[in_time]} | {marks} | {thp}",
                      flush=True)
                time.sleep(2)
                continue
            boost = None
            if a.boost is not None:
                boost = (int((work / "qemu.pid").read_text().strip()), a.boost)
            batched = {"on": "switch-first", "switch-last": "switch-last",
                       "alternate": "switch-first" if rep % 2 == 1 else None,
                       "alternate-order": "switch-last" if rep % 2 == 1 else "switch-first",
                       }.get(a.batch)
            host, events = snapshot_once(q, disk_state, a.early_stop, boost, batched)
            base = qmplib.event_us(events[0]) if events else 0
            setup = [e for e in events if e["event"] == "MIGRATION" and e["data"]["status"] == "setup"]
            if events and setup and events[0]["event"] == "STOP":
                # From the pause's start to QEMU starting on `migrate`: what the order costs.
                host["stop_to_migrate_setup"] = (qmplib.event_us(setup[0]) - base) / 1e3
                by_mode.setdefault(f"batched, {batched}" if batched else "one by one", []).append(
                    host["stop_to_migrate_setup"])
            marks, pause = event_marks(events)
            if pause is not None:
                pauses.append(pause)
                if rep > 0:  # the first snapshot builds page tables: 2-3x the later ones
                    pause_by_mode.setdefault(batched or "one by one", []).append(pauses[-1])
            rows.append(host)
            print(f"snapshot {rep + 1}: " + ", ".join(f"{k} {v:.2f}" for k, v in host.items())
                  + f" ms | QEMU events (ms): {marks} | before it: {thp}", flush=True)
            time.sleep(2)
        if a.cpu_stop or a.qemu_stops:
            print(f"guest pause STOP->RESUME: first {pauses[0]:.2f} ms, later ones median "
                  f"{statistics.median(pauses[1:] or pauses):.2f} ms")
            q.execute("quit")
            return
        for mode, v in by_mode.items():
            print(f"STOP -> MIGRATION setup, {mode}: median {statistics.median(v):.3f} ms "
                  f"[{min(v):.3f}..{max(v):.3f}] over {len(v)}")
        if len(pause_by_mode) > 1:
            for mode, v in pause_by_mode.items():
                print(f"guest pause STOP->RESUME after the first, {mode}: median {statistics.median(v):.2f} ms "
                      f"[{min(v):.2f}..{max(v):.2f}] over {len(v)}")
        med = {k: statistics.median(r[k] for r in rows if k in r) for k in rows[0]}
        later = pauses[1:] or pauses
        print(f"guest pause STOP->RESUME: first {pauses[0]:.2f} ms, later ones median {statistics.median(later):.2f} ms"
              + (" (huge pages collapsed before each)" if a.collapse else ""))
        print(f"QEMU {a.qemu}, {a.memory_mib} MiB, {a.fill_mib} MiB resident, {a.reps} snapshot(s); medians (ms): "
              + ", ".join(f"{k} {v:.2f}" for k, v in med.items())
              + (f"; guest pause STOP->RESUME {statistics.median(pauses):.2f}" if pauses else ""))
        q.execute("quit")
    finally:
        if proc:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
