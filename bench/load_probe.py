#!/usr/bin/env python3
"""How fast does a bare QEMU load a saved state stream, and where does its time go?

Loads one or more state streams (files) into fresh QEMUs started with `-incoming defer`, the
way backstop's restore and the stop-and-copy contender do, `--reps` times each, alternating
streams and transports so the machine's drift hits every combination alike. Prints, per stream
and transport, the load time (migrate-incoming → MIGRATION completed) as median [min..max] and
QEMU's user/system CPU time over its whole life (the load dominates it).

Transports: `file` (QEMU reads the file through `getfd`, like the stop-and-copy contender) and
`pipe` (this script writes the file into a 1 MiB pipe, like backstop's feeder).

A backstop snapshot's stream is reassembled from its store with `--store DIR --snapshot ID`
(the `vmstate` payload's chunks in index order), so it can be set beside QEMU's own streams.
The guest's command line must match the one that saved the stream: --memory-mib and the test
guest's directory are those of bench/run.py.

    python3 bench/load_probe.py --memory-mib 1024 --reps 10 a.vmstate b.vmstate
    python3 bench/load_probe.py --store STATE/store --snapshot ID --out /var/tmp/s.vmstate
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
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import contenders as C  # noqa: E402
import qmp as qmplib  # noqa: E402

F_SETPIPE_SZ = 1031


def reassemble(store, snapshot, out):
    """Writes the snapshot's vmstate payload, chunk by chunk, to `out`; returns its size."""
    index = json.loads((Path(store) / "snapshots" / snapshot / "vmstate.index").read_text())
    with open(out, "wb") as o:
        for c in index["chunks"]:
            h = c["sha256"]
            o.write((Path(store) / "chunks" / h[:2] / h).read_bytes())
    return os.path.getsize(out)


class Probe:
    def __init__(self, args):
        self.a = args
        self.work = Path(tempfile.mkdtemp(prefix="load-probe-", dir="/var/tmp"))
        self.env = type("Env", (), {})()
        self.env.qemu = args.qemu
        self.env.accel = "tcg"
        self.env.memory_mib = args.memory_mib
        self.env.guest = Path(args.guest_dir)
        self.env.append = "console=ttyS0 quiet panic=-1"
        self.base = self.work / "disk.qcow2"
        C.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b",
               str(self.env.guest / "disk-base.qcow2"), "-F", "qcow2", str(self.base)])

    def load(self, stream, transport):
        w = self.work
        qmp_path = w / "qmp.sock"
        argv = C.qemu_args(self.env, "probe", self.base, "disk-data", w / "serial.log",
                           w / "agent.sock", qmp_path, w / "qemu.pid", incoming=True)
        if self.a.prealloc:
            # Guest RAM faulted in before the load, under the RAM block name `-m` gives it
            # (pc.ram), so a stream saved by a `-m` QEMU still matches.
            i = argv.index("-m")
            del argv[i:i + 2]
            argv += ["-object", f"memory-backend-ram,id=pc.ram,size={self.env.memory_mib}M,prealloc=on",
                     "-machine", "memory-backend=pc.ram"]
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        q = qmplib.QMP(str(qmp_path))
        try:
            q.execute("migrate-set-capabilities",
                      {"capabilities": [{"capability": "events", "state": True}]})
            if transport == "file":
                fd = os.open(stream, os.O_RDONLY)
                try:
                    q.execute("getfd", {"fdname": "probe"}, fd=fd)
                finally:
                    os.close(fd)
                t0 = time.monotonic()
                q.execute("migrate-incoming", {"uri": "fd:probe"})
            else:
                r, wr = os.pipe()
                fcntl.fcntl(wr, F_SETPIPE_SZ, 1 << 20)
                try:
                    q.execute("getfd", {"fdname": "probe"}, fd=r)
                finally:
                    os.close(r)
                t0 = time.monotonic()
                q.execute("migrate-incoming", {"uri": "fd:probe"})
                with open(stream, "rb") as f:
                    while block := f.read(1 << 20):
                        os.write(wr, block)
                os.close(wr)
            ev = q.wait_event(qmplib.migrate_status("completed", "failed", "cancelled"), timeout=600)
            ms = (time.monotonic() - t0) * 1e3
            if ev["data"]["status"] != "completed":
                raise C.BenchError(f"load of {stream} {ev['data']['status']}")
            stat = Path(f"/proc/{proc.pid}/stat").read_text().split()
            tick = os.sysconf("SC_CLK_TCK")
            user_ms, sys_ms = int(stat[13]) * 1e3 / tick, int(stat[14]) * 1e3 / tick
            try:
                q.execute("quit")
            except (qmplib.QMPError, OSError):
                pass
            return ms, user_ms, sys_ms
        finally:
            q.close()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def close(self):
        shutil.rmtree(self.work, ignore_errors=True)


def fmt(xs):
    return f"{statistics.median(xs):7.0f} [{min(xs):.0f}..{max(xs):.0f}]"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("streams", nargs="*", help="state stream files to load")
    ap.add_argument("--qemu", default=shutil.which("qemu-system-x86_64") or "/usr/bin/qemu-system-x86_64")
    ap.add_argument("--memory-mib", type=int, default=1024)
    ap.add_argument("--guest-dir", default=os.environ.get("BACKSTOP_GUEST_DIR")
                    or os.path.expanduser("~/.cache/backstop/guest"))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--transports", default="file,pipe")
    ap.add_argument("--prealloc", action="store_true",
                    help="start each QEMU with its guest RAM preallocated (a standby's), load after")
    ap.add_argument("--store", help="a backstop store directory (state_dir/store or vms/NAME/store)")
    ap.add_argument("--snapshot", help="with --store: the snapshot whose stream to reassemble")
    ap.add_argument("--out", help="with --store: where to write the reassembled stream")
    a = ap.parse_args()
    if a.store:
        if not (a.snapshot and a.out):
            ap.error("--store needs --snapshot and --out")
        if not (Path(a.store) / "snapshots" / a.snapshot / "vmstate.index").is_file():
            ap.error(f"{a.store}: no snapshot {a.snapshot} with a vmstate payload")
        print(f"{a.out}: {reassemble(a.store, a.snapshot, a.out)} bytes")
        a.streams.append(a.out)
    if not a.streams:
        ap.error("no stream to load")
    for s in a.streams:
        if not os.path.isfile(s):
            ap.error(f"{s}: no such file")
    transports = [t for t in a.transports.split(",") if t]
    if any(t not in ("file", "pipe") for t in transports):
        ap.error("--transports takes file and/or pipe")
    probe = Probe(a)
    results = {}
    try:
        for rep in range(a.reps):
            for s in a.streams:
                for t in transports:
                    ms, user, sys_ = probe.load(s, t)
                    results.setdefault((s, t), []).append((ms, user, sys_))
                    print(f"rep {rep + 1} {Path(s).name} {t}: {ms:.0f} ms (qemu user {user:.0f} ms, "
                          f"system {sys_:.0f} ms)", file=sys.stderr, flush=True)
    finally:
        probe.close()
    print(f"{'stream':28} {'transport':9} {'load ms median [min..max]':28} {'qemu system ms':16}")
    for (s, t), rows in results.items():
        print(f"{Path(s).name:28} {t:9} {fmt([r[0] for r in rows]):28} {fmt([r[2] for r in rows])}")


if __name__ == "__main__":
    main()
