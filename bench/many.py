#!/usr/bin/env python3
"""Many VMs in one daemon: does guarding more VMs slow any one of them?

For each VM count N it runs backstopd (release build) with N small test guests from a vms_dir,
`max_concurrent_captures = 1`, twice:

  pause run     every VM takes `--rounds` console snapshots, all VMs at once (one console
                client per VM); figure: the guest pause of each snapshot (`pause_us` of
                `snapshot.create.completed`, QEMU's own STOP -> RESUME).
  watchdog run  VM v1's agent falls silent at guest uptime `--silent-at` s (again after each
                restore), while v2..vN snapshot in a loop; figure: how far past the heartbeat
                timeout v1 runs again at its snapshot point (noticed late + rollback total_ms),
                as scripts/bench-watchdog.sh measures it for one VM.

Prints a table per N with median [min..max] and the ratio to N = 1; the goal is
both figures within 1.5x of one VM's at 8 VMs. Asserts nothing; exits non-zero only if a run
could not be measured at all. Raw figures go to --out (JSON) when given.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import hostinfo
from contenders import heartbeat_expiries

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def log(msg):
    print(f"bench-many: {msg}", file=sys.stderr, flush=True)


class Daemon:
    """One backstopd over a vms_dir of `names`, with per-VM extra kernel arguments."""

    def __init__(self, args, names, append_extra, extra_daemon=""):
        self.args = args
        self.names = names
        self.work = tempfile.mkdtemp(prefix="bsmany-", dir="/var/tmp")
        # The control socket's path must stay short (sun_path).
        self.run = f"/tmp/bsm-{os.getpid()}-{len(names)}"
        shutil.rmtree(self.run, ignore_errors=True)
        vms_dir = os.path.join(self.work, "vms.d")
        os.makedirs(vms_dir)
        g = args.guest
        for n in names:
            with open(os.path.join(vms_dir, f"{n}.toml"), "w") as f:
                f.write(
                    f"""[vm]
name = "{n}"
qemu_binary = "{args.qemu}"
accel = "auto"
memory_mib = {args.memory}
kernel = "{g}/vmlinuz"
initrd = "{g}/initrd.img"
append = "console=ttyS0 quiet panic=-1 no_timer_check {append_extra.get(n, '')}"
watchdog_device = true

[[vm.disks]]
id = "data"
path = "{g}/disk-base.qcow2"
snapshot = "capture"

[watchdog]
heartbeat_timeout_s = {args.timeout}
boot_grace_s = 120
"""
                )
        self.config = os.path.join(self.work, "backstopd.toml")
        with open(self.config, "w") as f:
            f.write(
                f"""[daemon]
state_dir = "{self.work}/state"
run_dir = "{self.run}"
vms_dir = "{vms_dir}"
max_concurrent_captures = 1
min_free_mib = 64
{extra_daemon}
"""
            )
        self.log_path = os.path.join(self.work, "backstopd.log")
        with open(self.log_path, "w") as out:
            self.proc = subprocess.Popen(
                [os.path.join(args.bin, "backstopd"), "--config", self.config],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        deadline = time.time() + 60 + 30 * len(names)
        while True:
            r = self.cli(None, "vms")
            if r is not None and all(
                v["state"] == "running" for v in r.get("vms", [])
            ) and len(r.get("vms", [])) == len(names):
                break
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"daemon did not bring up {len(names)} VMs; log {self.log_path}")
            time.sleep(0.5)
        for n in names:
            self.wait_tick(n, 3)

    def cli(self, vm, *argv):
        cmd = [os.path.join(self.args.bin, "backstop"), "--socket", f"{self.run}/control.sock", "--json"]
        if vm:
            cmd += ["--vm", vm]
        p = subprocess.run(cmd + list(argv), capture_output=True, text=True)
        if p.returncode != 0:
            return None
        try:
            return json.loads(p.stdout)
        except ValueError:
            return None

    def serial(self, vm):
        try:
            with open(f"{self.work}/state/vms/{vm}/{vm}-serial.log", errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def wait_tick(self, vm, n, timeout=300):
        deadline = time.time() + timeout
        while f"BACKSTOP tick ram={n} " not in self.serial(vm):
            if time.time() > deadline:
                raise RuntimeError(f"{vm} printed no tick {n}")
            time.sleep(0.3)

    def journal(self, vm):
        try:
            with open(f"{self.work}/state/vms/{vm}/audit/journal.jsonl") as f:
                return [json.loads(line) for line in f if line.strip()]
        except (OSError, ValueError):
            return []

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.work, ignore_errors=True)
        shutil.rmtree(self.run, ignore_errors=True)


def snapshot_loop(d, vm, rounds, stop):
    """Console snapshots of `vm`, one after the other, `rounds` times or until `stop` is set."""
    done = 0
    while (rounds is None or done < rounds) and not stop.is_set():
        d.cli(vm, "snapshot", "create", "--reason", "bench-many")
        done += 1


def pauses_ms(d, vms):
    """Guest pause of every non-baseline snapshot of `vms`, in ms."""
    out = []
    for vm in vms:
        completed = [e for e in d.journal(vm) if e["event"] == "snapshot.create.completed"]
        for e in completed[1:]:  # the first is the baseline, taken alone at start
            us = e["fields"].get("pause_us")
            if isinstance(us, (int, float)):
                out.append(us / 1000.0)
    return out


def pause_run(args, n):
    names = [f"v{i}" for i in range(1, n + 1)]
    d = Daemon(args, names, {})
    try:
        stop = threading.Event()
        threads = [threading.Thread(target=snapshot_loop, args=(d, vm, args.rounds, stop)) for vm in names]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return pauses_ms(d, names)
    finally:
        d.stop()


def watchdog_run(args, n):
    names = [f"v{i}" for i in range(1, n + 1)]
    d = Daemon(args, names, {"v1": f"backstop.hb_stop_at={args.silent_at}"})
    try:
        stop = threading.Event()
        threads = [threading.Thread(target=snapshot_loop, args=(d, vm, None, stop)) for vm in names[1:]]
        for t in threads:
            t.start()
        rows = []
        deadline = time.time() + args.reps * (args.silent_at + args.timeout + 60) + 60
        while len(rows) < args.reps and time.time() < deadline:
            rows = [detect + total for detect, total in heartbeat_expiries(d.journal("v1"), args.timeout)]
            time.sleep(0.5)
        rows = rows[: args.reps]
        stop.set()
        for t in threads:
            t.join()
        return rows, pauses_ms(d, names[1:])
    finally:
        d.stop()


def summary(xs):
    if not xs:
        return "n/a", None
    m = statistics.median(xs)
    return f"{m:.1f} [{min(xs):.1f}..{max(xs):.1f}] n={len(xs)}", m


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vms", default="1,4,8", help="VM counts (default 1,4,8)")
    ap.add_argument("--rounds", type=int, default=3, help="snapshots per VM in the pause run")
    ap.add_argument("--reps", type=int, default=2, help="watchdog expiries per run (the storm guard HALTs a VM after 3 in 10 min)")
    ap.add_argument("--memory", type=int, default=128, help="MiB per guest")
    ap.add_argument("--timeout", type=int, default=4, help="heartbeat timeout, s")
    ap.add_argument("--silent-at", type=int, default=15, help="guest uptime at which v1's agent falls silent, s")
    ap.add_argument("--bin", default=os.path.join(os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target")), "release"))
    ap.add_argument("--guest", required=True)
    ap.add_argument("--qemu", default="qemu-system-x86_64")
    ap.add_argument("--out", help="write the raw figures here (JSON)")
    ap.add_argument("--note", help="a line about the machine kept in the JSON (e.g. what else ran on it)")
    args = ap.parse_args()

    counts = [int(x) for x in args.vms.split(",")]
    qemu_first, qemu_ver = hostinfo.qemu_version(args.qemu)
    raw = {"counts": counts, "memory_mib": args.memory, "heartbeat_timeout_s": args.timeout, "runs": {},
           "meta": {"started": hostinfo.now(), "rounds": args.rounds,
                    "reps": args.reps, "git_commit": hostinfo.git_commit(ROOT),
                    "host": hostinfo.host(), "qemu": {"binary": args.qemu, "version": qemu_first,
                                                      "label": qemu_ver},
                    "load": [hostinfo.loadavg()], "note": args.note}}
    failed = False
    for n in counts:
        log(f"{n} VM(s): pause run ({args.rounds} snapshots each, all at once)")
        try:
            pauses = pause_run(args, n)
        except RuntimeError as e:
            log(f"{n} VM(s): pause run failed: {e}")
            pauses, failed = [], True
        log(f"{n} VM(s): watchdog run ({args.reps} expiries of v1 while the others snapshot)")
        try:
            beyond, busy_pauses = watchdog_run(args, n)
        except RuntimeError as e:
            log(f"{n} VM(s): watchdog run failed: {e}")
            beyond, busy_pauses, failed = [], [], True
        if not pauses or not beyond:
            failed = True
        raw["runs"][str(n)] = {"pause_ms": pauses, "beyond_timeout_ms": beyond, "pause_during_rollbacks_ms": busy_pauses}
        raw["meta"]["load"].append(hostinfo.loadavg())
    raw["meta"]["finished"] = hostinfo.now()

    print(f"\nmany VMs, one daemon ({args.memory} MiB guests, max_concurrent_captures = 1, TCG on {os.cpu_count()} cores)")
    print(f"{'VMs':>4}  {'guest pause per snapshot, ms':<34} {'x 1 VM':>7}  {'watchdog: beyond timeout, ms':<34} {'x 1 VM':>7}")
    base_p = base_w = None
    for n in counts:
        r = raw["runs"][str(n)]
        ps, pm = summary(r["pause_ms"])
        ws, wm = summary(r["beyond_timeout_ms"])
        if n == counts[0]:
            base_p, base_w = pm, wm
        ratio = lambda m, b: f"{m / b:.2f}x" if m is not None and b else "n/a"
        print(f"{n:>4}  {ps:<34} {ratio(pm, base_p):>7}  {ws:<34} {ratio(wm, base_w):>7}")
    print("goal: at 8 VMs both within 1.5x of 1 VM's figure")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(raw, f, indent=1)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
