#!/usr/bin/env python3
"""Can a standby QEMU, started before a rollback is asked for, take the target's disk chain
only at rollback time? (the "warm standby".)

What blocks a standby: the disk devices are realized at launch with a block node, but which
chain they must read is known only when the rollback chooses its target. This probe tries one
way round that, with a bare QMP client on the bench guest, and checks the guest afterwards:

  1. QEMU A boots the guest on an overlay of the guest disk; its ticks are read from the serial
     log (`BACKSTOP tick ram=N disk=D`: D is what the guest read back from its disk).
  2. A is stopped and its state saved to a file (stop-and-copy); A ends. A's overlay is frozen.
  3. Standby B was started *before* the save, like a standby would be: same command line but
     each disk device sits on a `throttle` filter node (no limits) over a `null-co` placeholder
     of the disk's size, `-incoming defer`, guest RAM optionally preallocated.
  4. "Rollback": a fresh overlay over A's frozen layer is opened (`blockdev-add`), the filter's
     child is swapped to it (`blockdev-reopen`), the placeholder removed, the state loaded
     (`migrate-incoming`), `cont`.
  5. B's guest must go on ticking where A stopped: its RAM counter the next one, what A wrote
     readable through B's chain, its new writes in the fresh overlay only.
  6. The next snapshot's disk switch (backstop's `blockdev-snapshot` transaction on the top
     qcow2 node, here under the filter) must move the guest's writes to the newer overlay.

Prints each step's time and PASS/FAIL per check; exits 1 on any FAIL.

    python3 bench/standby_probe.py [--qemu BINARY] [--memory-mib 256] [--prealloc]

KEEP=1 keeps the work directory (images, state, serial logs) and prints its path.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import contenders as C  # noqa: E402
import qmp as qmplib  # noqa: E402

TICK = re.compile(rb"BACKSTOP tick ram=(\d+) disk=(\d+)")


def ticks(serial):
    try:
        return [(int(a), int(b)) for a, b in TICK.findall(Path(serial).read_bytes())]
    except OSError:
        return []


def wait_ticks(serial, n, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        t = ticks(serial)
        if len(t) >= n:
            return t
        time.sleep(0.1)
    raise SystemExit(f"standby_probe: fewer than {n} ticks in {serial} after {timeout} s")


def allocated(img):
    info = json.loads(subprocess.run(["qemu-img", "info", "-U", "--output=json", str(img)],
                                     capture_output=True, text=True, check=True).stdout)
    return info.get("actual-size", 0)


def sector(img, k):
    """The first line of 512-byte sector `k` of image `img` (read through its backing chain)."""
    out = subprocess.run(["qemu-io", "-r", "-U", "-f", "qcow2", "-c", f"read -v {k * 512} 32", str(img)],
                         capture_output=True, text=True, check=True).stdout
    raw = bytes(int(h, 16) for line in out.splitlines() if re.match(r"^[0-9a-f]{8}:", line)
                for h in line.split(":", 1)[1].split("  ")[1].split())
    return raw.split(b"\n", 1)[0].rstrip(b"\0").decode(errors="replace")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--qemu", default=shutil.which("qemu-system-x86_64") or "/usr/bin/qemu-system-x86_64")
    ap.add_argument("--memory-mib", type=int, default=256)
    ap.add_argument("--guest-dir", default=os.environ.get("BACKSTOP_GUEST_DIR")
                    or os.path.expanduser("~/.cache/backstop/guest"))
    ap.add_argument("--prealloc", action="store_true", help="standby's guest RAM faulted in at launch")
    a = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="standby-probe-", dir="/var/tmp"))
    env = type("Env", (), {})()
    env.qemu, env.accel, env.memory_mib = a.qemu, "tcg", a.memory_mib
    env.guest = Path(a.guest_dir)
    env.append = "console=ttyS0 quiet panic=-1"
    procs, fails = [], []

    def check(ok, what):
        print(f"{'PASS' if ok else 'FAIL'}  {what}")
        if not ok:
            fails.append(what)

    def start(name, disk_args_from, extra, incoming):
        d = work / name
        d.mkdir()
        argv = C.qemu_args(env, name, disk_args_from, "disk-data", d / "serial.log", d / "agent.sock",
                           d / "qmp.sock", d / "qemu.pid", incoming=incoming)
        if extra:
            i = argv.index("-blockdev")
            del argv[i:i + 2]  # the disk's node comes from `extra` instead
            argv[i:i] = extra
        p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=open(d / "stderr", "wb"))
        procs.append(p)
        return p, qmplib.QMP(str(d / "qmp.sock")), d / "serial.log"

    try:
        base = env.guest / "disk-base.qcow2"
        vsize = json.loads(subprocess.run(["qemu-img", "info", "--output=json", str(base)],
                                          capture_output=True, text=True, check=True).stdout)["virtual-size"]
        oa, ob = work / "a.qcow2", work / "b.qcow2"
        C.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(base), "-F", "qcow2", str(oa)])

        _, qa, serial_a = start("a", oa, None, incoming=False)
        wait_ticks(serial_a, 4, 300)

        # The standby: started now, before anything is known of the rollback's target.
        standby = [
            "-object", "throttle-group,id=tg0",
            "-blockdev", f"driver=null-co,node-name=placeholder,size={vsize},read-zeroes=on",
            "-blockdev", "driver=throttle,node-name=disk-data,throttle-group=tg0,file=placeholder",
        ]
        if a.prealloc:
            standby += ["-object", f"memory-backend-ram,id=pc.ram,size={a.memory_mib}M,prealloc=on",
                        "-machine", "memory-backend=pc.ram"]
        t0 = time.monotonic()
        pb, qb, serial_b = start("b", oa, standby, incoming=True)
        qb.execute("migrate-set-capabilities", {"capabilities": [{"capability": "events", "state": True}]})
        print(f"standby launched and answering: {(time.monotonic() - t0) * 1e3:.0f} ms")

        # A: stopped, saved (stop-and-copy into a file), ended. Its overlay is frozen from here.
        qa.execute("stop")
        state = work / "state.vmstate"
        fd = os.open(state, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            qa.execute("getfd", {"fdname": "save"}, fd=fd)
        finally:
            os.close(fd)
        qa.execute("migrate-set-capabilities", {"capabilities": [{"capability": "events", "state": True}]})
        qa.execute("migrate", {"uri": "fd:save"})
        ev = qa.wait_event(qmplib.migrate_status("completed", "failed", "cancelled"), timeout=300)
        if ev["data"]["status"] != "completed":
            raise SystemExit(f"standby_probe: save {ev['data']['status']}")
        last_a = ticks(serial_a)[-1]
        qa.execute("quit")
        qa.close()
        procs[0].wait(timeout=30)
        a_size = allocated(oa)

        # The rollback, on the standby.
        t_rb = time.monotonic()
        C.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(oa), "-F", "qcow2", str(ob)])
        t1 = time.monotonic()
        qb.execute("blockdev-add", {"driver": "qcow2", "node-name": "chain-top",
                                    "file": {"driver": "file", "filename": str(ob)}})
        t2 = time.monotonic()
        qb.execute("blockdev-reopen", {"options": [{"driver": "throttle", "node-name": "disk-data",
                                                    "throttle-group": "tg0", "file": "chain-top"}]})
        qb.execute("blockdev-del", {"node-name": "placeholder"})
        t3 = time.monotonic()
        fd = os.open(state, os.O_RDONLY)
        try:
            qb.execute("getfd", {"fdname": "load"}, fd=fd)
        finally:
            os.close(fd)
        qb.execute("migrate-incoming", {"uri": "fd:load"})
        ev = qb.wait_event(qmplib.migrate_status("completed", "failed", "cancelled"), timeout=300)
        t4 = time.monotonic()
        check(ev["data"]["status"] == "completed", f"state loaded into the standby ({ev['data']['status']})")
        C.settle_runstate(qb)
        qb.execute("cont")
        t5 = time.monotonic()
        print(f"rollback on the standby: overlay {(t1 - t_rb) * 1e3:.0f} ms, open chain {(t2 - t1) * 1e3:.0f} ms, "
              f"swap {(t3 - t2) * 1e3:.1f} ms, load {(t4 - t3) * 1e3:.0f} ms, cont {(t5 - t4) * 1e3:.1f} ms, "
              f"total {(t5 - t_rb) * 1e3:.0f} ms")

        block = qb.execute("query-block")
        node = next((b.get("inserted", {}) for b in block if b.get("qdev", "").endswith("dev-data")
                     or b.get("device") == ""), {})
        print("inserted:", json.dumps({k: node.get(k) for k in ("node-name", "drv", "file", "image")})[:1500])

        got = wait_ticks(serial_b, 3, 60)
        first, third = got[0], got[2]
        check(first[0] == last_a[0] + 1,
              f"guest RAM continues: A's last tick ram={last_a[0]}, B's first ram={first[0]}")
        check(all(r == d for r, d in got),
              f"B's guest reads back what it writes: {got[:3]}")
        # The next snapshot's disk switch, as backstop's capture does it: a fresh overlay with
        # no backing opened, then one transaction of blockdev-snapshot on the top qcow2 node —
        # here under the filter, whose child it must replace.
        oc = work / "c.qcow2"
        C.run(["qemu-img", "create", "-q", "-f", "qcow2", "-u", "-b", str(ob), "-F", "qcow2", str(oc), str(vsize)])
        qb.execute("blockdev-add", {"driver": "qcow2", "node-name": "next-top", "backing": None,
                                    "file": {"driver": "file", "filename": str(oc)}})
        qb.execute("stop")
        qb.execute("transaction", {"actions": [
            {"type": "blockdev-snapshot", "data": {"node": "chain-top", "overlay": "next-top"}}]})
        n_before = len(ticks(serial_b))
        qb.execute("cont")
        after = wait_ticks(serial_b, n_before + 2, 60)[-1]
        qb.execute("quit")
        qb.close()
        pb.wait(timeout=30)
        k2 = after[0]
        check(sector(oc, k2) == str(k2) and sector(ob, k2) != str(k2),
              f"after a disk switch under the filter, tick {k2} landed in the new overlay only "
              f"(c: {sector(oc, k2)!r}, b: {sector(ob, k2)!r})")
        check(sector(oc, third[0]) == str(third[0]),
              f"the new overlay reads the older ticks through its backing (tick {third[0]})")
        check(allocated(oa) == a_size, f"A's frozen overlay unchanged ({a_size} B)")
        olds = {k: sector(ob, k) for k in range(1, last_a[0] + 1)}
        check(all(v == str(k) for k, v in olds.items()),
              f"A's writes read through B's chain (sectors 1..{last_a[0]}: {list(olds.values())})")
        k = third[0]
        check(sector(ob, k) == str(k) and sector(oa, k) != str(k),
              f"B's tick {k} landed in B's overlay only (b: {sector(ob, k)!r}, a: {sector(oa, k)!r})")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if os.environ.get("KEEP"):
            print(f"kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
