"""backstop's benchmark against its peers, in one run, on the same guest.

Run it through scripts/bench.sh, which installs what it needs and builds backstop first.
Each repetition boots a fresh guest per contender (so every "first" snapshot is a first), with
~fill MiB of random data resident, a stall meter and a writer that dirties 10% of RAM in bursts,
and drives it through the same steps:

    boot, fill         the guest writes its random data, then its writer sleeps `every` s
    quiet window       2 s with nothing happening: the noise floor of every guest-side figure
    first              snapshot
    idle               snapshot again, guest idle since (the writer still asleep)
    dirty              after the writer's next burst (10% of RAM rewritten): snapshot
    busy               as the writer's next burst starts: snapshot while it writes
    rollback           to "busy" (the newest); timed until the restored guest speaks on its console
    cold rollback      to "busy" again, the page cache dropped first (root; --no-cold-rollback
                       skips it): the stream read from the disk, as for a snapshot taken long ago

Contenders are interleaved within each repetition so that drift on the host hits all alike.
Every contender runs once per QEMU version (--qemu; scripts/bench.sh passes the system QEMU and
the QEMU 10 wrapper), except virsh, which runs on the system QEMU libvirt is packaged with. After
the repetitions, the watchdog's expiry -> guest running is measured per QEMU version. raw.json
records the git commit, CPU model, kernel and every QEMU version; `python3 bench/report.py
raw.json` redraws the table from it.
"""

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.dont_write_bytecode = True  # no __pycache__ in the tree
sys.path.insert(0, str(Path(__file__).resolve().parent))

import contenders as C  # noqa: E402
import hostinfo  # noqa: E402
from hostinfo import git_commit, qemu_version  # noqa: E402
import measure  # noqa: E402
import report  # noqa: E402

SETTLE_S = measure.AFTER_SETTLE_S + measure.SIDE_S + 0.2  # lines needed after an event


class Env:
    pass


def log(msg):
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def detect_accel():
    """As backstop's accel = "auto": TCG where /dev/kvm is missing or is the paravirtual kvm_pvm."""
    if not os.path.exists("/dev/kvm") or os.path.exists("/sys/module/kvm_pvm"):
        return "tcg"
    return "kvm"


def dd_throughput(directory, mib):
    """`dd if=/dev/zero of=X bs=1M count=N conv=fsync` on the given filesystem: bytes/s."""
    target = Path(directory) / "dd-test.bin"
    try:
        p = subprocess.run(
            ["dd", "if=/dev/zero", f"of={target}", "bs=1M", f"count={mib}", "conv=fsync"],
            capture_output=True, text=True, timeout=600, check=True,
        )
    finally:
        target.unlink(missing_ok=True)
    m = re.search(r"^(\d+) bytes .* copied, ([\d.]+) s", p.stderr, re.M)
    if not m:
        raise C.BenchError(f"cannot parse dd's report: {p.stderr.strip()}")
    return {"bytes": int(m.group(1)), "seconds": float(m.group(2)),
            "bytes_per_s": int(m.group(1)) / float(m.group(2))}


def chunk_files_throughput(directory, mib, chunk=1 << 20):
    """The store's write pattern without the store: `mib` files of 1 MiB (the store's average
    chunk), each written to a temp name, fsynced and renamed, then the directory fsynced."""
    d = Path(directory) / "chunk-test"
    d.mkdir(exist_ok=True)
    buf = bytearray(os.urandom(chunk))
    t0 = time.monotonic()
    try:
        for i in range(mib):
            buf[:8] = i.to_bytes(8, "little")
            tmp, final = d / f".tmp-{i}", d / f"{i:08d}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, buf)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, final)
        dfd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        secs = time.monotonic() - t0
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return {"bytes": mib * chunk, "seconds": secs, "bytes_per_s": mib * chunk / secs}


def orphan_reap_ms():
    """How long this host's PID 1 takes to reap a killed orphan. A libvirt domain's QEMU is one
    (libvirtd double-forks it), and `virDomainDestroy` waits until its pid is gone, zombie
    included: on this sandbox (PID 1 `process_api`) that is ~1.2-1.6 s after SIGKILL, on a host
    whose PID 1 is systemd a few ms. The libvirt backend's rollback `end` phase is mostly this."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        grandchild = os.fork()
        if grandchild == 0:
            time.sleep(60)
            os._exit(0)
        os.write(w, str(grandchild).encode())
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    orphan = int(os.read(r, 32))
    os.close(r)
    time.sleep(0.1)
    t0 = time.monotonic()
    os.kill(orphan, signal.SIGKILL)
    deadline = t0 + 30
    while os.path.exists(f"/proc/{orphan}") and time.monotonic() < deadline:
        time.sleep(0.001)
    return {"ms": (time.monotonic() - t0) * 1e3}


def sha256_throughput(mib=256):
    """SHA-256 on one core of this host (Python's hashlib, OpenSSL): what hashing each chunk costs."""
    import hashlib
    buf = os.urandom(1 << 20)
    h = hashlib.sha256()
    t0 = time.monotonic()
    for _ in range(mib):
        h.update(buf)
    secs = time.monotonic() - t0
    return {"bytes": mib << 20, "seconds": secs, "bytes_per_s": (mib << 20) / secs}


def drop_page_cache():
    """Writes dirty pages out and drops the clean ones from the page cache (root only); None
    once done, else why not."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
    except OSError as e:
        return f"cannot drop the page cache: {e}"
    return None


def qemu_major(label):
    """The major version in a QEMU label ("7.2.22" -> 7); 0 when the label is no version."""
    try:
        return int(str(label).split(".")[0])
    except ValueError:
        return 0


def rollback_and_wait(c, busy):
    """Rolls `c` back to its snapshot `busy` and waits (up to 120 s) until the restored guest's
    first workload tick is on the console, so the figures after it see a running guest."""
    rb = c.rollback(busy)
    rb["to"] = "busy"
    deadline = time.monotonic() + 120
    while True:
        v = measure.rollback_view(c.serial.snapshot(), rb["t_req"], busy["t_req"])
        if "first_tick_ms" in v or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    time.sleep(1.0)
    return rb


def run_rep(cls, env, rep):
    c = cls(env, rep)
    rec = {"contender": c.name, "qemu": env.qemu_label, "rep": rep, "snapshots": {}, "error": None}
    t_start = time.monotonic()
    try:
        log(f"[{c.name} qemu {env.qemu_label} rep {rep + 1}] boot")
        c.start()
        i_fill, line, m = c.serial.wait_for(rb"BACKSTOP fill mib=\d+ ms=(\d+)", timeout=600, what="guest fill",
                                      alive=c.gone)
        rec["fill_guest_ms"] = int(m.group(1))
        rec["boot_to_filled_s"] = line.t - t_start
        c.ready()

        # Everything from here is paced by the guest's writer: a burst of dirty_mib every
        # dirty_every seconds, the first one dirty_every seconds after the fill. Right after
        # the fill or a burst there is a quiet interval for the noise window, "first" and "idle".
        if time.monotonic() - line.t < 3.0:
            i = i_fill
        else:
            start = c.serial.count()
            i, _, _ = c.serial.wait_for(rb"BACKSTOP dirty end n=", start_index=start,
                                        timeout=env.dirty_every * 3 + 120, what="writer burst",
                                        alive=c.gone)
        # Noise floor: a quiet window shaped like an event, with nothing in it.
        time.sleep(measure.SIDE_S + 0.2)
        q0 = time.monotonic()
        time.sleep(2.0)
        q1 = time.monotonic()
        time.sleep(SETTLE_S)
        rec["quiet"] = {"t_req": q0, "t_done": q1}

        log(f"[{c.name} qemu {env.qemu_label} rep {rep + 1}] snapshots")
        first = c.snapshot("first")
        rec["snapshots"]["first"] = first
        time.sleep(SETTLE_S)
        idle = c.snapshot("idle")
        rec["snapshots"]["idle"] = idle
        # Idle means the writer did not run between the two (nor in the quiet window).
        n_lines = [ln for ln in c.serial.snapshot() if q0 - measure.SIDE_S <= ln.t <= idle["t_done"]]
        if any(b"BACKSTOP dirty begin" in ln.text for ln in n_lines):
            idle["contaminated"] = "the writer ran between first and idle (raise --dirty-every)"
            log(f"[{c.name} qemu {env.qemu_label} rep {rep + 1}] warning: {idle['contaminated']}")
        time.sleep(SETTLE_S)
        if hasattr(c, "background_snapshot"):
            rec["bgsnap"] = c.background_snapshot()
            time.sleep(SETTLE_S)
        j, _, _ = c.serial.wait_for(rb"BACKSTOP dirty end n=", start_index=i + 1,
                                    timeout=env.dirty_every * 3 + 120, what="writer burst",
                                    alive=c.gone)
        time.sleep(0.2)
        dirty = c.snapshot("dirty")
        rec["snapshots"]["dirty"] = dirty
        c.serial.wait_for(rb"BACKSTOP dirty begin n=", start_index=j,
                          timeout=env.dirty_every * 3 + 120, what="next writer burst",
                          alive=c.gone)
        busy = c.snapshot("busy")
        rec["snapshots"]["busy"] = busy
        time.sleep(SETTLE_S)

        # To the newest snapshot: the rollback every contender offers without more ado (backstop
        # asks reviewer evidence for an older one, which is a policy step, not a restore cost).
        log(f"[{c.name} qemu {env.qemu_label} rep {rep + 1}] rollback")
        rec["rollback"] = rollback_and_wait(c, busy)

        # The same rollback again with the page cache dropped: a snapshot's stream read from the
        # disk, as on a host where it was taken long enough ago (virsh is left out: its revert
        # is not the comparison, and takes seconds).
        # A preloaded standby reads nothing at its rollback: it is left out too.
        if env.cold_rollback and c.name not in ("virsh", "bspreload"):
            time.sleep(SETTLE_S)
            why = drop_page_cache()
            if why:
                rec["cold_rollback"] = {"error": why}
            else:
                log(f"[{c.name} qemu {env.qemu_label} rep {rep + 1}] rollback, page cache dropped")
                rec["cold_rollback"] = rollback_and_wait(c, busy)
    except Exception as e:  # noqa: BLE001 - recorded, the run goes on with the other contenders
        rec["error"] = f"{type(e).__name__}: {e}"
        log(f"[{c.name} qemu {env.qemu_label} rep {rep + 1}] FAILED: {rec['error']}")
        rec["traceback"] = traceback.format_exc()
    finally:
        lines = c.serial.snapshot() if c.serial else []
        try:
            c.stop()
        except Exception as e:  # noqa: BLE001
            rec["error"] = (rec["error"] or "") + f"; cleanup: {e}"
        rec.update(c.notes())
        # Guest-side figures, from the lines as they arrived.
        if "quiet" in rec:
            rec["quiet"]["guest"] = measure.snapshot_view(lines, rec["quiet"]["t_req"], rec["quiet"]["t_done"])
        for s in list(rec["snapshots"].values()) + ([rec["bgsnap"]] if "bgsnap" in rec else []):
            s["guest"] = measure.snapshot_view(lines, s["t_req"], s["t_done"])
        for key in ("rollback", "cold_rollback"):
            if "t_req" in (rec.get(key) or {}):
                rec[key]["guest"] = measure.rollback_view(
                    lines, rec[key]["t_req"], rec["snapshots"]["busy"]["t_req"])
        rec["wall_s"] = time.monotonic() - t_start
        if env.keep_logs:
            keep = env.results / "logs" / f"{c.name}-{env.qemu_label}-{rep + 1}"
            keep.mkdir(parents=True, exist_ok=True)
            (keep / "serial.log").write_bytes(b"\n".join(ln.text for ln in lines) + b"\n")
            for f in ("backstopd.log", "qemu.log", "domain.xml", "backstop.toml"):
                if (c.dir / f).exists():
                    shutil.copy(c.dir / f, keep / f)
        c.discard()
    return rec


def store_ingest(env, label, reps=3):
    """`store_ingest --json` on the stream recorded on QEMU `label` (None if there is none: the
    stop-and-copy contender did not run there); a failure is recorded, not raised."""
    stream = C.recorded_stream(env, label)
    if not stream.exists():
        return None
    if not env.store_ingest.exists():
        return {"error": f"{env.store_ingest} missing (cargo build --release -p backstop-engine "
                         "--example store_ingest)"}
    cmd = [str(env.store_ingest), str(stream), str(env.work), str(reps),
           "--chunk-hash", env.chunk_hash, "--json"]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except subprocess.SubprocessError as e:
        return {"error": f"store_ingest: {e}"}
    if p.returncode != 0:
        return {"error": f"store_ingest exited {p.returncode}: {p.stderr.strip()[-300:]}"}
    try:
        r = json.loads(p.stdout)
    except ValueError:
        return {"error": f"store_ingest printed no JSON: {p.stdout[-200:]!r}"}
    log(f"[store ingest qemu {label}] recorded stream {r['bytes'] / 1e6:.0f} MB: "
        + ", ".join(f"{x['ingest_bytes_per_s'] / 1e6:.0f}/{x['dd_bytes_per_s'] / 1e6:.0f} MB/s"
                    for x in r["reps"]) + " (store/dd)")
    return r


def libvirt_leftovers(prefix):
    p = subprocess.run(["virsh", "-q", "-c", C.LIBVIRT_URI, "list", "--all", "--name"],
                       capture_output=True, text=True)
    return [n for n in p.stdout.split() if n.startswith(prefix)]


def main(argv=None):
    ap = argparse.ArgumentParser(prog="bench.sh", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="one repetition, 256 MiB guest, 100 MiB of data (CI)")
    ap.add_argument("--reps", type=int, help="repetitions of every measurement (default 5; 1 with --quick)")
    ap.add_argument("--memory-mib", type=int, help="guest RAM (default 1024; 256 with --quick)")
    ap.add_argument("--fill-mib", type=int, help="random data kept resident in the guest (default 400; 100 with --quick)")
    ap.add_argument("--dirty-pct", type=int, default=10, help="share of guest RAM the writer rewrites per burst (default 10)")
    ap.add_argument("--dirty-every", type=int, help="seconds between writer bursts (default 25; 15 with --quick)")
    ap.add_argument("--contenders",
                    help="comma-separated subset of backstop,bsstandby (backstop with a standby "
                         "QEMU),bspreload (the same, the snapshot preloaded into it),bshuge "
                         "(backstop with vm.huge_pages = \"all\"),bsorder (backstop with "
                         "vm.capture_order = \"migrate-first\", QEMU < 9.0 only),bslibvirt "
                         "(backstop guarding a libvirt domain),virsh,stopcopy "
                         "(default: all; --quick leaves bsstandby, bspreload, bshuge and bsorder out)")
    ap.add_argument("--qemu", action="append", metavar="BINARY",
                    help="a QEMU to run every contender on (repeat for several; default: the "
                         "system qemu-system-x86_64 and $BENCH_QEMU10, which scripts/bench.sh sets "
                         "to the QEMU 10 wrapper scripts/setup.sh prints)")
    ap.add_argument("--virsh-all-qemus", action="store_true",
                    help="run the virsh contender on every --qemu (default: the first only, the "
                         "system QEMU libvirt is packaged with)")
    ap.add_argument("--watchdog-reps", type=int,
                    help="watchdog expiries per QEMU (default --reps; 0 skips the measurement)")
    ap.add_argument("--accel", choices=["auto", "tcg", "kvm"], default="auto",
                    help="accelerator for every contender (auto: as backstop's accel=auto)")
    ap.add_argument("--results", help="results directory (default results/<timestamp>)")
    ap.add_argument("--workdir", help="where guests, stores and images live during the run "
                    "(default a fresh dir under /var/tmp; dd is measured there)")
    ap.add_argument("--no-cold-rollback", dest="cold_rollback", action="store_false",
                    help="skip the second rollback per repetition, made with the page cache dropped")
    ap.add_argument("--keep-logs", action="store_true", help="copy serial and daemon logs into the results")
    ap.add_argument("--chunk-hash", choices=["blake3", "sha256"], default="blake3",
                    help="backstop's [daemon] chunk_hash (default blake3, what the shipped configs set)")
    ap.add_argument("--note", help="a line about the machine kept in raw.json (e.g. what else ran on it)")
    ap.add_argument("--guest-dir", default=os.environ.get("BACKSTOP_GUEST_DIR") or
                    str(Path.home() / ".cache/backstop/guest"))
    # cargo puts binaries under $CARGO_TARGET_DIR when it is set, else ./target.
    target = os.environ.get("CARGO_TARGET_DIR") or str(Path(__file__).resolve().parent.parent / "target")
    ap.add_argument("--bin-dir", default=str(Path(target) / "release"))
    a = ap.parse_args(argv)

    env = Env()
    env.quick = a.quick
    env.reps = a.reps or (1 if a.quick else 5)
    env.memory_mib = a.memory_mib or (256 if a.quick else 1024)
    env.fill_mib = a.fill_mib or (100 if a.quick else 400)
    env.dirty_mib = max(1, round(env.memory_mib * a.dirty_pct / 100))
    env.dirty_pct = a.dirty_pct
    env.dirty_every = a.dirty_every or (15 if a.quick else 25)
    env.accel = detect_accel() if a.accel == "auto" else a.accel
    env.guest = Path(a.guest_dir).resolve()
    env.backstopd = Path(a.bin_dir) / "backstopd"
    env.backstop = Path(a.bin_dir) / "backstop"
    env.store_ingest = Path(a.bin_dir) / "examples" / "store_ingest"
    system_qemu = shutil.which("qemu-system-x86_64") or "/usr/bin/qemu-system-x86_64"
    binaries = a.qemu or [system_qemu] + ([os.environ["BENCH_QEMU10"]]
                                          if os.environ.get("BENCH_QEMU10") else [])
    env.qemus = []
    for b in binaries:
        first, ver = qemu_version(b)
        if not first:
            ap.error(f"{b} --version failed")
        label = ver or Path(b).name
        if any(q["label"] == label for q in env.qemus):
            continue
        env.qemus.append({"label": label, "binary": b, "version": first,
                          "virsh": a.virsh_all_qemus or not env.qemus})
    env.qemu, env.qemu_label = env.qemus[0]["binary"], env.qemus[0]["label"]
    env.watchdog_reps = env.reps if a.watchdog_reps is None else a.watchdog_reps
    env.keep_logs = a.keep_logs
    env.cold_rollback = a.cold_rollback
    env.chunk_hash = a.chunk_hash
    env.append = (
        "console=ttyS0 quiet panic=-1 backstop.stallmeter=1"
        f" backstop.fill_mib={env.fill_mib} backstop.dirty_mib={env.dirty_mib}"
        f" backstop.dirty_every={env.dirty_every}"
    )
    contenders = a.contenders or ("backstop,bslibvirt,virsh,stopcopy" if a.quick
                                  else "backstop,bsstandby,bspreload,bshuge,bsorder,bslibvirt,virsh,stopcopy")
    names = [n.strip() for n in contenders.split(",") if n.strip()]
    for n in names:
        if n not in C.CONTENDERS:
            ap.error(f"unknown contender {n!r}")
    if env.fill_mib + 64 > env.memory_mib * 0.8:
        ap.error("--fill-mib leaves the guest too little RAM")
    for f in ("vmlinuz", "initrd.img", "disk-base.qcow2"):
        if not (env.guest / f).exists():
            ap.error(f"guest file {env.guest / f} missing (scripts/setup.sh builds it)")
    if {"backstop", "bsstandby", "bspreload", "bshuge", "bsorder", "bslibvirt"} & set(names) and not env.backstopd.exists():
        ap.error(f"{env.backstopd} missing (cargo build --release -p backstopd -p backstop-cli)")

    t_run = time.monotonic()
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    root = Path(__file__).resolve().parent.parent
    env.results = Path(a.results) if a.results else root / "results" / stamp
    env.results.mkdir(parents=True, exist_ok=True)
    if a.workdir:
        Path(a.workdir).mkdir(parents=True, exist_ok=True)
    env.work = Path(tempfile.mkdtemp(prefix="backstop-bench-", dir=a.workdir or "/var/tmp"))
    os.chmod(env.work, 0o755)

    meta = {
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "quick": env.quick, "reps": env.reps, "memory_mib": env.memory_mib,
        "fill_mib": env.fill_mib, "dirty_mib": env.dirty_mib, "dirty_pct": env.dirty_pct,
        "dirty_every_s": env.dirty_every, "accel": env.accel, "contenders": names,
        "append": env.append, "workdir": str(env.work), "chunk_hash": env.chunk_hash,
        "host": hostinfo.host(),
        # The machine may run other work beside the bench: the load, sampled as the run goes
        # (at the start, after each measurement, at the end), says how much.
        "load": [hostinfo.loadavg()],
        "note": a.note,
        "git_commit": git_commit(root),
        "qemus": env.qemus,
        "watchdog_reps": env.watchdog_reps,
        "cold_rollback": env.cold_rollback,
        "versions": {},
    }
    for key, cmd in (("qemu", [env.qemu, "--version"]), ("libvirt", ["virsh", "--version"]),
                     ("backstop", [str(env.backstop), "--version"])):
        try:
            meta["versions"][key] = subprocess.run(cmd, capture_output=True, text=True,
                                                   timeout=30).stdout.splitlines()[0]
        except (OSError, IndexError, subprocess.SubprocessError):
            meta["versions"][key] = None
    try:
        meta["guest"] = dict(l.split("=", 1) for l in (env.guest / "stamp").read_text().splitlines()[1:] if "=" in l)
    except OSError:
        meta["guest"] = {}

    log(f"{env.reps} repetition(s), {env.memory_mib} MiB guest, {env.fill_mib} MiB data, "
        f"writer {env.dirty_mib} MiB every {env.dirty_every} s, accel {env.accel}; "
        f"results in {env.results}; work dir {env.work}")

    # A SIGTERM (CI timeout) still cleans up: turn it into an exception.
    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_term)

    records, host, watchdog, ingest = [], [], [], []

    def save():
        meta["load"].append(hostinfo.loadavg())
        raw = {"meta": meta, "records": records, "host": host, "watchdog": watchdog,
               "store_ingest": ingest}
        (env.results / "raw.json").write_text(json.dumps(raw, indent=1, default=str))

    interrupted = False
    try:
        for rep in range(env.reps):
            # Versions and contenders interleaved within each repetition: host drift hits all.
            for q in env.qemus:
                env.qemu, env.qemu_label = q["binary"], q["label"]
                for n in names:
                    if n in ("virsh", "bslibvirt") and not q["virsh"]:
                        continue
                    # On >= 9.0 `migrate` goes first by default: bsorder would be backstop again.
                    if n == "bsorder" and qemu_major(q["label"]) >= 9:
                        continue
                    records.append(run_rep(C.CONTENDERS[n], env, rep))
                    save()
            # The physical limit, on the filesystem the store and images lived on, in this run.
            first = next((r["snapshots"].get("first") for r in records[::-1]
                          if r["contender"] == "backstop" and r["snapshots"].get("first")), None)
            mib = max(64, round(((first or {}).get("bytes_stored") or env.fill_mib << 20) / (1 << 20)))
            try:
                r = {"dd": dd_throughput(env.work, mib),
                     "chunk_files": chunk_files_throughput(env.work, mib),
                     "sha256": sha256_throughput()}
                log("host, same filesystem: " + ", ".join(
                    f"{k} {v['bytes_per_s'] / 1e6:.0f} MB/s" for k, v in r.items()))
                r["orphan_reap"] = orphan_reap_ms()
                log(f"host: PID 1 reaped a killed orphan after {r['orphan_reap']['ms']:.0f} ms")
                host.append(r)
            except (C.BenchError, subprocess.SubprocessError, OSError) as e:
                log(f"host throughput measurement failed: {e}")
            # The store's ingest of a recorded stream (the store goal's measure), apart from QEMU's
            # pace: the stream the stop-and-copy guest's plain background snapshot wrote on
            # each QEMU, cut, hashed, written and published into a fresh store here, against
            # the same bytes written to one file and fsynced, in the same invocation.
            for q in env.qemus:
                row = store_ingest(env, q["label"])
                if row:
                    row.update(qemu=q["label"], rep=rep)
                    ingest.append(row)
                    save()
        # Watchdog expiry -> guest running, per QEMU (its own small guest, as bench-watchdog.sh).
        if "backstop" in names and env.watchdog_reps > 0:
            for q in env.qemus:
                env.qemu, env.qemu_label = q["binary"], q["label"]
                log(f"[watchdog qemu {q['label']}] {env.watchdog_reps} expiries")
                try:
                    rows = C.watchdog_expiries(env, env.watchdog_reps)
                    watchdog.extend(rows)
                    log(f"[watchdog qemu {q['label']}] beyond the timeout: "
                        + ", ".join(f"{r['beyond_ms']} ms" for r in rows))
                except (C.BenchError, subprocess.SubprocessError, OSError, ValueError, KeyError) as e:
                    watchdog.append({"qemu": q["label"], "error": f"{type(e).__name__}: {e}"})
                    log(f"[watchdog qemu {q['label']}] FAILED: {e}")
                save()
    except KeyboardInterrupt:
        interrupted = True
        log("interrupted; cleaning up")
    finally:
        try:
            C.Virsh.finish(env)
        except (C.BenchError, subprocess.SubprocessError, OSError) as e:
            log(f"undefining the libvirt domain: {e}")
        shutil.rmtree(env.work, ignore_errors=True)
        left = libvirt_leftovers(f"bsbench-{os.getpid()}")
        for d in left:
            subprocess.run(["virsh", "-q", "-c", C.LIBVIRT_URI, "destroy", d], capture_output=True)
            subprocess.run(["virsh", "-q", "-c", C.LIBVIRT_URI, "undefine", d, "--snapshots-metadata"],
                           capture_output=True)
        stray = C.qemu_pids_using(str(env.work))
        for pid in stray:
            C.kill_pid(pid)
        if left or stray:
            log(f"cleaned up leftovers: domains {left}, qemu pids {stray}")

    meta["finished"] = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    meta["wall_s"] = round(time.monotonic() - t_run, 1)
    meta["load"].append(hostinfo.loadavg())
    raw = {"meta": meta, "records": records, "host": host, "watchdog": watchdog,
           "store_ingest": ingest}
    (env.results / "raw.json").write_text(json.dumps(raw, indent=1, default=str))
    summary = report.summarize(raw)
    (env.results / "summary.json").write_text(json.dumps(summary, indent=1))
    text = report.table(summary)
    (env.results / "table.txt").write_text(text)
    print(text)
    chart = report.chart(summary, env.results / "chart.png")
    log(f"wrote {env.results}/summary.json, raw.json, table.txt" + (", chart.png" if chart else
                                                                     " (no chart: matplotlib missing)"))
    failed = [f"{r['contender']} qemu {r.get('qemu')} rep {r['rep'] + 1}: {r['error']}"
              for r in records if r.get("error")]
    failed += [f"watchdog qemu {w['qemu']}: {w['error']}" for w in watchdog if w.get("error")]
    failed += [f"store ingest qemu {g['qemu']}: {g['error']}" for g in ingest if g.get("error")]
    if failed or interrupted:
        for f in failed:
            log(f"FAILED {f}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
