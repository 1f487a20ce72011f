#!/usr/bin/env python3
"""Does a live pre-copy migration on this QEMU lose pages the guest writes? (libvirt `precopy`)

QEMU before 9.0, under TCG, clears the migration's dirty bits after each bitmap sync without
making the vCPUs' TLB entries notice (fixed upstream by 03bfc2188f, "physmem: Fix migration
dirty bitmap coherency with TCG memory access"), so a page written again through a cached entry
is not sent again. backstop's libvirt backend therefore pauses the guest for the whole copy on
such a QEMU (crates/backstop-libvirt/src/precopy.rs, `CopyPlan`). This script shows the loss, and
that a paused copy does not have it, with nothing of backstop in the way:

- a guest whose /init is bench/precopy_probe/memcheck.c (built here with `gcc -static`; the
  kernel is the test guest's, scripts/build-guest.sh), which rewrites 32 pages in a tight loop
  and reports any page that lost a write;
- `--reps` times: boot it, let it run 1 s, `migrate` it into a file (`live`: the guest runs;
  `paused`: `stop` first) with a 1 ms downtime limit and 64 MiB/s (so the copy needs more than
  one pass while the guest runs), then load the file into a fresh QEMU, `cont`, and read the
  guest's console for 4 s.

Prints one line per repetition and "reps with lost pages: K of N".

    python3 bench/precopy_probe.py --qemu /usr/bin/qemu-system-x86_64 --mode live --reps 4

Measured on this machine (TCG): QEMU 7.2.22 live 4 of 4 lost pages, paused 0 of 3; QEMU 10.0.2
live 0 of 4.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import qmp as qmplib  # noqa: E402

HERE = Path(__file__).resolve().parent


def build_initrd(work):
    """The memcheck binary as the only file of a gzip'd newc initramfs."""
    root = work / "root"
    root.mkdir()
    subprocess.run(["gcc", "-O1", "-static", "-o", str(root / "init"),
                    str(HERE / "precopy_probe" / "memcheck.c")], check=True)
    cpio = subprocess.run(["cpio", "-o", "-H", "newc", "--quiet"], cwd=root, input=b"init\n",
                          capture_output=True, check=True).stdout
    initrd = work / "initrd.gz"
    initrd.write_bytes(subprocess.run(["gzip", "-c"], input=cpio, capture_output=True,
                                      check=True).stdout)
    return initrd


class Guest:
    def __init__(self, qemu, kernel, initrd, work, tag, incoming=False):
        self.log = work / f"{tag}.log"
        self.log.unlink(missing_ok=True)
        sock = work / f"{tag}.qmp"
        sock.unlink(missing_ok=True)
        args = [qemu, "-machine", "q35,accel=tcg", "-m", "256", "-nographic", "-nodefaults",
                "-no-reboot", "-kernel", str(kernel), "-initrd", str(initrd),
                "-append", "console=ttyS0 quiet panic=-1", "-serial", f"file:{self.log}",
                "-qmp", f"unix:{sock},server=on,wait=off"]
        if incoming:
            args += ["-incoming", "defer"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.q = qmplib.QMP(str(sock))

    def console(self):
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def wait_console(self, text, timeout):
        deadline = time.monotonic() + timeout
        while text not in self.console():
            if time.monotonic() > deadline:
                raise SystemExit(f"the guest never printed {text!r}:\n{self.console()}")
            time.sleep(0.1)

    def wait_migration(self, timeout=300):
        deadline = time.monotonic() + timeout
        while True:
            m = self.q.execute("query-migrate")
            if m.get("status") in ("completed", "failed", "cancelled"):
                return m
            if time.monotonic() > deadline:
                raise SystemExit(f"the migration did not end in {timeout} s: {m}")
            time.sleep(0.02)

    def end(self):
        self.q.close()
        self.proc.kill()
        self.proc.wait()


def rep(n, a, kernel, initrd, work):
    image = work / "state.bin"
    src = Guest(a.qemu, kernel, initrd, work, "src")
    try:
        src.wait_console("MEMCHECK sweep=", 120)
        time.sleep(1)
        if a.mode == "paused":
            src.q.execute("stop")
        src.q.execute("migrate-set-parameters", {"downtime-limit": 1, "max-bandwidth": 64 << 20})
        src.q.execute("migrate", {"uri": f"exec:cat > {image}"})
        m = src.wait_migration()
    finally:
        src.end()
    if m.get("status") != "completed":
        raise SystemExit(f"rep {n}: the migration ended {m}")
    dst = Guest(a.qemu, kernel, initrd, work, "dst", incoming=True)
    try:
        dst.q.execute("migrate-incoming", {"uri": f"exec:cat {image}"})
        loaded = dst.wait_migration()
        if loaded.get("status") != "completed":
            raise SystemExit(f"rep {n}: the load ended {loaded}")
        before = len(dst.console())
        dst.q.execute("cont")
        time.sleep(4)
        after = dst.console()[before:].splitlines()
    finally:
        dst.end()
    lost = [line for line in after if "lost page" in line]
    alive = [line for line in after if "sweep=" in line]
    if not alive:
        raise SystemExit(f"rep {n}: the restored guest printed nothing:\n{after}")
    ram = m.get("ram", {})
    print(f"rep {n}: {a.mode}, {ram.get('dirty-sync-count')} bitmap syncs, "
          f"{ram.get('transferred', 0) / 1e6:.0f} MB sent; restored guest: "
          f"{len(lost)} lost-page lines {lost[:2]}, last {alive[-1].strip()!r}", flush=True)
    return bool(lost)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--qemu", default="qemu-system-x86_64")
    p.add_argument("--mode", choices=["live", "paused"], default="live")
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--guest-dir", default=os.environ.get(
        "BACKSTOP_GUEST_DIR", str(Path.home() / ".cache/backstop/guest")),
        help="the test guest (its vmlinuz): scripts/build-guest.sh")
    a = p.parse_args()
    kernel = Path(a.guest_dir) / "vmlinuz"
    if not kernel.exists():
        raise SystemExit(f"no {kernel}: run scripts/build-guest.sh")
    work = Path(tempfile.mkdtemp(prefix="precopy-probe-"))
    try:
        initrd = build_initrd(work)
        version = subprocess.run([a.qemu, "--version"], capture_output=True, text=True,
                                 check=True).stdout.splitlines()[0]
        print(f"{version}, TCG, {a.mode} copy, {a.reps} repetitions", flush=True)
        lost = sum(rep(n, a, kernel, initrd, work) for n in range(a.reps))
        print(f"reps with lost pages: {lost} of {a.reps}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
