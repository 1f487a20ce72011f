"""The three contenders, each driving the same guest through the same steps:

- backstop: backstopd + the `backstop` console (live snapshot, verified rollback);
- virsh: libvirt's internal snapshot of a running domain (`snapshot-create-as`, `snapshot-revert`);
- stop-and-copy: a plain QEMU, `stop` + disk overlay + `migrate` to a file + `cont`, and its
  restore into a fresh QEMU (`-incoming defer`).

Every contender boots the guest with the same kernel, initrd, command line, memory, CPU count,
accelerator and device kinds (virtio disk on a qcow2 overlay of the same base, virtio-serial
agent port, i6300esb, user-mode NIC), so what differs is only how it snapshots and restores.
"""

import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import qmp as qmplib
from guestlog import SerialFollower

LIBVIRT_URI = "qemu:///system"


class BenchError(Exception):
    pass


def run(cmd, timeout=600, check=True, **kw):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and p.returncode != 0:
        raise BenchError(
            f"{' '.join(map(str, cmd))} failed ({p.returncode}): {p.stderr.strip() or p.stdout.strip()}"
        )
    return p


def allocated(path):
    """Bytes a file occupies on disk."""
    try:
        return os.stat(path).st_blocks * 512
    except FileNotFoundError:
        return 0


def pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is as good as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def kill_pid(pid, grace=10.0):
    """SIGTERM, then SIGKILL after `grace` seconds; only ever one pid we started."""
    if not pid or not pid_alive(pid):
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return
        time.sleep(0.05)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def qemu_pids_using(marker):
    """QEMU processes whose command line mentions `marker` (our private work dir)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ")
        except OSError:
            continue
        if b"qemu-system" in cmd and marker.encode() in cmd:
            out.append(int(d))
    return out


class Contender:
    name = "?"
    label = "?"

    def __init__(self, env, rep):
        self.env = env
        self.rep = rep
        # One directory per QEMU version too (every contender runs once per version).
        self.dir = env.work / f"{self.name}-{getattr(env, 'qemu_label', 'qemu')}-{rep}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.serial = None

    # Subclasses: start(), ready(), snapshot(kind) -> dict, rollback(snap) -> dict, stop().
    def ready(self):
        pass

    def gone(self):
        """Why the guest is not running (None while it is)."""
        return None

    def close_serial(self):
        if self.serial:
            self.serial.close()

    def notes(self):
        return {}


# ---------------------------------------------------------------------------------------------
class Backstop(Contender):
    name = "backstop"
    label = "backstop"

    def __init__(self, env, rep):
        super().__init__(env, rep)
        # Unix socket paths are limited to 108 bytes: keep the run dir short.
        self.run_dir = Path(f"/tmp/bsb-{os.getpid()}-{rep}")
        self.state = self.dir / "state"
        self.proc = None
        self.log = self.dir / "backstopd.log"

    def cli(self, *args, timeout=900):
        p = subprocess.run(
            [str(self.env.backstop), "--socket", str(self.run_dir / "control.sock"), "--json", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        try:
            doc = json.loads(p.stdout) if p.stdout.strip() else {}
        except json.JSONDecodeError:
            doc = {}
        if p.returncode != 0:
            raise BenchError(
                f"backstop {' '.join(args)} failed ({p.returncode}): {p.stderr.strip()} {p.stdout.strip()}\n"
                f"daemon log tail:\n{self.log_tail()}"
            )
        return doc

    def log_tail(self, n=20):
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def start(self):
        e = self.env
        shutil.rmtree(self.run_dir, ignore_errors=True)
        cfg = self.daemon_table() + f"""
[vm]
name = "bench"
qemu_binary = "{e.qemu}"
accel = "{e.accel}"
memory_mib = {e.memory_mib}
vcpus = 1
kernel = "{e.guest}/vmlinuz"
initrd = "{e.guest}/initrd.img"
append = "{e.append}"
nics = ["net0"]
watchdog_device = true
{self.vm_extra()}
[[vm.disks]]
id = "data"
path = "{e.guest}/disk-base.qcow2"
format = "qcow2"
snapshot = "capture"
"""
        self.serial = SerialFollower(str(self.state / "bench-serial.log"), from_start=True)
        self.launch(cfg)

    def vm_extra(self):
        """Extra keys of the `[vm]` table (none: backstop's defaults)."""
        return ""

    def daemon_table(self):
        # Like for like: the peers keep nothing of the state a rollback abandons, so backstop's
        # default of saving the abandoned VM's RAM beside the restore (it competes for
        # the CPUs: +100-170 ms at 256 MiB on 2 cores, tests/forensic_ram.rs prints both) is off.
        return f"""# written by bench/ for one repetition
[daemon]
state_dir = "{self.state}"
run_dir = "{self.run_dir}"
chunk_hash = "{getattr(self.env, 'chunk_hash', 'blake3')}"

[rollback]
forensic_ram_for = []
"""

    def launch(self, cfg):
        """Writes the config, starts backstopd on it and waits until its console answers."""
        e = self.env
        conf = self.dir / "backstop.toml"
        conf.write_text(cfg)
        # BENCH_BACKSTOP_LOG (e.g. "info,backstop_qemu=debug"): the daemon's log filter, for a
        # run that is traced rather than measured.
        env = dict(os.environ, BACKSTOP_LOG=os.environ.get("BENCH_BACKSTOP_LOG", "info"))
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [str(e.backstopd), "--config", str(conf)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=env,
            )
        deadline = time.monotonic() + 180
        while True:
            if self.proc.poll() is not None:
                raise BenchError(f"backstopd exited ({self.proc.returncode}):\n{self.log_tail()}")
            if (self.run_dir / "control.sock").exists():
                p = subprocess.run(
                    [str(e.backstop), "--socket", str(self.run_dir / "control.sock"), "--json", "status"],
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
                if p.returncode == 0:
                    break
            if time.monotonic() > deadline:
                raise BenchError(f"backstopd did not come up:\n{self.log_tail()}")
            time.sleep(0.1)

    def gone(self):
        if self.proc and self.proc.poll() is not None:
            return f"backstopd exited ({self.proc.returncode}):\n{self.log_tail()}"
        return None

    def ready(self):
        # The daemon takes a baseline snapshot after boot; wait until it is published so it does
        # not overlap a measurement.
        deadline = time.monotonic() + 600
        while True:
            snaps = self.cli("snapshot", "list").get("snapshots", [])
            if snaps:
                self.baseline = snaps[0]
                return
            if time.monotonic() > deadline:
                raise BenchError("no baseline snapshot after 600 s")
            time.sleep(0.5)

    def snapshot(self, kind):
        t0 = time.monotonic()
        v = self.cli("snapshot", "create", "--reason", f"bench: {kind}")
        t1 = time.monotonic()
        cap = (v.get("manifest") or {}).get("capture") or {}
        s = v.get("summary", {})
        # On QEMU >= 9.0: the lead the next capture uses, the setup times it is learnt from and
        # the races lost so far (after the capture, off its clock).
        mf = (self.cli("status").get("backend_details") or {}).get("capture_migrate_first")
        return {
            "capture_migrate_first": mf,
            "kind": kind,
            "id": s.get("snapshot_id"),
            "t_req": t0,
            "t_done": t1,
            "wall_ms": (t1 - t0) * 1e3,
            "bytes_stored": s.get("bytes_stored"),
            "logical_bytes": cap.get("vmstate_bytes"),
            "capture_ms": v.get("capture_ms") or cap.get("capture_ms"),
            "qemu_pause_ms": (s.get("pause_us") or 0) / 1e3,
            "qemu_downtime_ms": cap.get("downtime_ms"),
            "pause_breakdown_us": cap.get("pause_breakdown_us"),
        }

    def rollback(self, snap):
        t0 = time.monotonic()
        r = self.cli("rollback", "--to", snap["id"], "--reason", "bench: rollback")
        t1 = time.monotonic()
        return {
            "t_req": t0,
            "t_done": t1,
            "cmd_ms": (t1 - t0) * 1e3,
            "reported_total_ms": r.get("total_ms"),
            "reported_restore_ms": r.get("restore_ms"),
            # Where backstop's own time went (choose, gate, revoke, end, overlays, launch,
            # load, check, resume), as the engine journals it.
            "phases_ms": {p["phase"]: p["ms"] for p in r.get("phases") or []},
        }

    def notes(self):
        return {"baseline_bytes_stored": (getattr(self, "baseline", None) or {}).get("bytes_stored")}

    def stop(self):
        qemu_pid = None
        try:
            qemu_pid = int((self.run_dir / "bench" / "qemu.pid").read_text().strip())
        except (OSError, ValueError):
            pass
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        # QEMU dies with the daemon (PR_SET_PDEATHSIG); make sure.
        if qemu_pid:
            kill_pid(qemu_pid, grace=5)
        for pid in qemu_pids_using(str(self.state)):
            kill_pid(pid, grace=5)
        self.close_serial()
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def discard(self):
        shutil.rmtree(self.state, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
def heartbeat_expiries(entries, timeout_s):
    """(detect_ms, restore_ms) of each heartbeat-watchdog rollback in a VM's journal `entries`:
    how long past the timeout the silence was noticed (from the `rollback.initiated` reason,
    "no valid heartbeat for N ms ...") and the engine's total_ms of the restore that followed
    (the last restores, paired in order). bench-many.py uses it too."""
    init = [e for e in entries if e["event"] == "rollback.initiated"
            and e["fields"].get("trigger") == "watchdog_timeout"]
    done = [e for e in entries if e["event"] == "snapshot.restore.completed"]
    n = min(len(init), len(done))
    rows = []
    for i in range(n):
        silent = int(init[i]["fields"]["reason"].split("for ")[1].split(" ms")[0])
        rows.append((silent - timeout_s * 1000, done[-(n - i)]["fields"]["total_ms"]))
    return rows


def watchdog_expiries(env, reps, timeout_s=4, hb_stop_at=12):
    """Watchdog expiry -> guest running (as scripts/bench-watchdog.sh): backstopd on `env.qemu`
    with a heartbeat timeout, one snapshot while the agent is alive, then the guest's agent falls
    silent at uptime `hb_stop_at` s (again after every restore). Per expiry, from the audit
    journal: detect_ms (silence noticed past the timeout), restore_ms (the engine's total_ms,
    rollback request -> guest resumed), beyond_ms = detect + restore."""
    work = Path(tempfile.mkdtemp(prefix=f"wd-{env.qemu_label}-", dir=env.work))
    run_dir = Path(f"/tmp/bsw-{os.getpid()}")
    shutil.rmtree(run_dir, ignore_errors=True)
    conf = work / "c.toml"
    conf.write_text(f"""# written by bench/ for the watchdog measurement
[daemon]
state_dir = "{work / 'state'}"
run_dir = "{run_dir}"
[vm]
name = "bench"
qemu_binary = "{env.qemu}"
accel = "{env.accel}"
memory_mib = 256
kernel = "{env.guest}/vmlinuz"
initrd = "{env.guest}/initrd.img"
append = "console=ttyS0 quiet panic=-1 no_timer_check backstop.hb_stop_at={hb_stop_at}"
[[vm.disks]]
id = "data"
path = "{env.guest}/disk-base.qcow2"
[watchdog]
heartbeat_timeout_s = {timeout_s}
boot_grace_s = 60
""")
    log = open(work / "backstopd.log", "ab")
    proc = subprocess.Popen([str(env.backstopd), "--config", str(conf)], stdin=subprocess.DEVNULL,
                            stdout=log, stderr=log, env=dict(os.environ, BACKSTOP_LOG="info"))
    rows = []

    def cli(*args):
        return subprocess.run([str(env.backstop), "--socket", str(run_dir / "control.sock"), *args],
                              capture_output=True, text=True, timeout=300)

    try:
        deadline = time.monotonic() + 180
        while cli("status").returncode != 0:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise BenchError("watchdog: backstopd did not come up")
            time.sleep(0.2)
        serial = work / "state" / "bench-serial.log"
        while b"BACKSTOP tick ram=3 " not in (serial.read_bytes() if serial.exists() else b""):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise BenchError("watchdog: the guest did not tick")
            time.sleep(0.2)
        if cli("snapshot", "create", "--reason", "bench: agent alive").returncode != 0:
            raise BenchError("watchdog: snapshot failed")
        journal = work / "state" / "audit" / "journal.jsonl"
        deadline = time.monotonic() + 60 * reps + 60
        while len(rows) < reps and time.monotonic() < deadline:
            entries = [json.loads(l) for l in journal.read_text().splitlines() if l.strip()]
            for i, (detect, total) in enumerate(heartbeat_expiries(entries, timeout_s)):
                if i < len(rows) or len(rows) >= reps:
                    continue
                rows.append({"qemu": env.qemu_label, "rep": i, "timeout_s": timeout_s,
                             "detect_ms": detect, "restore_ms": total, "beyond_ms": detect + total})
            time.sleep(0.5)
        if len(rows) < reps:
            raise BenchError(f"watchdog: {len(rows)} of {reps} expiries seen")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
        for pid in qemu_pids_using(str(work)):
            kill_pid(pid, grace=5)
        shutil.rmtree(run_dir, ignore_errors=True)
    return rows


# ---------------------------------------------------------------------------------------------
def recorded_stream(env, label):
    """Where the newest plain background snapshot taken on QEMU `label` is kept for the run."""
    return env.work / f"recorded-{label}.vmstate"


def qemu_args(env, name, disk, node, serial, agent_sock, qmp_sock, pidfile, incoming=False):
    """The same command line backstop's QEMU backend builds (crates/backstop-qemu cmdline.rs)."""
    a = [
        env.qemu,
        "-name", name,
        "-machine", f"q35,accel={env.accel}",
        "-m", str(env.memory_mib),
        "-smp", "1",
        "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
        "-kernel", f"{env.guest}/vmlinuz",
        "-initrd", f"{env.guest}/initrd.img",
        "-append", env.append,
        "-chardev", f"file,id=serial0,path={serial},append=on",
        "-serial", "chardev:serial0",
        "-device", "virtio-serial-pci,id=vser0",
        "-chardev", f"socket,id=agent0,path={agent_sock},server=on,wait=off",
        "-device", "virtserialport,bus=vser0.0,chardev=agent0,name=org.backstop.agent.0",
        "-blockdev", f"driver=qcow2,node-name={node},file.driver=file,file.filename={disk}",
        "-device", f"virtio-blk-pci,drive={node},id=dev-data",
        "-device", "i6300esb,id=watchdog0",
        "-netdev", "user,id=net-net0,restrict=on",
        "-device", "virtio-net-pci,netdev=net-net0,id=nic-net0",
        "-qmp", f"unix:{qmp_sock},server=on,wait=off",
        "-pidfile", str(pidfile),
    ]
    if incoming:
        a += ["-incoming", "defer", "-S"]
    return a


def settle_runstate(q, timeout=10.0):
    """QEMU announces MIGRATION completed before it leaves the finish-migrate run state, and
    `cont` is refused until it has: wait for that (milliseconds). Returns the run state."""
    deadline = time.monotonic() + timeout
    while True:
        st = q.execute("query-status").get("status")
        if st != "finish-migrate" or time.monotonic() > deadline:
            return st
        time.sleep(0.001)


class StopCopy(Contender):
    name = "stopcopy"
    label = "QEMU stop-and-copy"

    def __init__(self, env, rep):
        super().__init__(env, rep)
        self.run_dir = Path(f"/tmp/bsq-{os.getpid()}-{rep}")
        self.proc = None
        self.q = None
        self.k = 0
        self.restores = 0

    def _launch(self, disk, incoming):
        shutil.rmtree(self.run_dir, ignore_errors=True)
        self.run_dir.mkdir(mode=0o700, parents=True)
        args = qemu_args(
            self.env, "bench", disk, "disk-data", self.serial_path,
            self.run_dir / "agent.sock", self.run_dir / "qmp.sock", self.run_dir / "qemu.pid",
            incoming=incoming,
        )
        log = open(self.dir / "qemu.log", "ab")
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        log.close()
        self.q = qmplib.QMP(str(self.run_dir / "qmp.sock"), timeout=60)
        self.q.execute(
            "migrate-set-capabilities",
            {"capabilities": [{"capability": "events", "state": True}]},
        )
        # QEMU's 128 MiB/s default would make the peer look slower than it is (DESIGN.md).
        self.q.execute("migrate-set-parameters", {"max-bandwidth": 16 << 30})
        self.q.execute("watchdog-set-action", {"action": "pause"})

    def gone(self):
        if self.proc and self.proc.poll() is not None:
            try:
                tail = (self.dir / "qemu.log").read_text(errors="replace")[-800:]
            except OSError:
                tail = ""
            return f"QEMU exited ({self.proc.returncode}): {tail}"
        return None

    def start(self):
        self.serial_path = self.dir / "serial.log"
        self.active = self.dir / "layer-0.qcow2"
        run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", f"{self.env.guest}/disk-base.qcow2",
             "-F", "qcow2", str(self.active)])
        self.node = "disk-data"
        self.serial = SerialFollower(str(self.serial_path), from_start=True)
        self._launch(self.active, incoming=False)

    def snapshot(self, kind):
        self.k += 1
        state = self.dir / f"state-{self.k}.vmstate"
        new_layer = self.dir / f"layer-{self.k}.qcow2"
        new_node = f"disk-data-{self.k}"
        fd = os.open(state, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        q = self.q
        t0 = time.monotonic()
        try:
            q.execute("getfd", {"fdname": "bench-save"}, fd=fd)
        finally:
            os.close(fd)
        q.execute("stop")
        stop_ev = q.wait_event(qmplib.name_is("STOP"))
        t_tx = time.monotonic()
        q.execute("transaction", {"actions": [{
            "type": "blockdev-snapshot-sync",
            "data": {"node-name": self.node, "snapshot-file": str(new_layer),
                     "snapshot-node-name": new_node, "format": "qcow2", "mode": "absolute-paths"},
        }]})
        tx_ms = (time.monotonic() - t_tx) * 1e3
        q.execute("migrate", {"uri": "fd:bench-save"})
        ev = q.wait_event(qmplib.migrate_status("completed", "failed", "cancelled"), timeout=900)
        info = q.execute("query-migrate")
        settle_runstate(q)
        q.execute("cont")
        resume_ev = q.wait_event(qmplib.name_is("RESUME"))
        t_resumed = time.monotonic()
        if ev["data"]["status"] != "completed":
            raise BenchError(f"stop-and-copy migrate {ev['data']['status']}: {info.get('error-desc')}")
        # A snapshot is not one until it is on disk: fsync the state file and the frozen layer.
        for p in (state, self.active):
            f = os.open(p, os.O_RDONLY)
            try:
                os.fsync(f)
            finally:
                os.close(f)
        t1 = time.monotonic()
        frozen = self.active
        self.active, self.node = new_layer, new_node
        size = os.path.getsize(state)
        return {
            "kind": kind,
            "id": str(state),
            "frozen_layer": str(frozen),
            "t_req": t0,
            "t_done": t1,
            "wall_ms": (t1 - t0) * 1e3,
            "stop_to_cont_ms": (t_resumed - t0) * 1e3,
            "disk_switch_ms": tx_ms,
            "bytes_stored": allocated(state) + allocated(frozen),
            "logical_bytes": size,
            "capture_ms": info.get("total-time"),
            "qemu_pause_ms": (qmplib.event_us(resume_ev) - qmplib.event_us(stop_ev)) / 1e3,
            "qemu_downtime_ms": info.get("downtime"),
        }

    def background_snapshot(self):
        """QEMU's own live snapshot (`background-snapshot`, what backstop builds on) into a
        plain file, no store: its pause and its stream rate, for comparison."""
        state = self.dir / "bgsnap.vmstate"
        q = self.q
        q.execute("migrate-set-capabilities", {"capabilities": [
            {"capability": "background-snapshot", "state": True}]})
        fd = os.open(state, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        t0 = time.monotonic()
        try:
            q.execute("getfd", {"fdname": "bench-bg"}, fd=fd)
        finally:
            os.close(fd)
        q.execute("migrate", {"uri": "fd:bench-bg"})
        ev = q.wait_event(qmplib.migrate_status("completed", "failed", "cancelled"), timeout=900)
        t1 = time.monotonic()
        info = q.execute("query-migrate")
        stops = [e for e in q.events if e.get("event") in ("STOP", "RESUME")]
        q.events = [e for e in q.events if e not in stops]
        q.execute("migrate-set-capabilities", {"capabilities": [
            {"capability": "background-snapshot", "state": False}]})
        if settle_runstate(q) in ("paused", "postmigrate"):
            q.execute("cont")
        size = os.path.getsize(state)
        if ev["data"]["status"] != "completed":
            state.unlink()
            raise BenchError(f"background snapshot {ev['data']['status']}: {info.get('error-desc')}")
        # Kept (one per QEMU version, the newest) for the store's ingest of a recorded stream
        # (run.py's store_ingest); the work dir goes at the end of the run.
        os.replace(state, recorded_stream(self.env, getattr(self.env, "qemu_label", "qemu")))
        pause = None
        st = next((e for e in stops if e["event"] == "STOP"), None)
        rs = next((e for e in stops if e["event"] == "RESUME"), None)
        if st and rs:
            pause = (qmplib.event_us(rs) - qmplib.event_us(st)) / 1e3
        return {
            "kind": "bgsnap",
            "t_req": t0,
            "t_done": t1,
            "wall_ms": (t1 - t0) * 1e3,
            "logical_bytes": size,
            "capture_ms": info.get("total-time"),
            "qemu_pause_ms": pause,
            "qemu_downtime_ms": info.get("downtime"),
        }

    def rollback(self, snap):
        self.restores += 1
        layer = self.dir / f"restore-{self.restores}.qcow2"
        t0 = time.monotonic()
        # Revoke everything the way backstop does: the old process ends.
        self._end_qemu()
        run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", snap["frozen_layer"], "-F", "qcow2",
             str(layer)])
        self._launch(layer, incoming=True)
        t_launched = time.monotonic()
        fd = os.open(snap["id"], os.O_RDONLY)
        try:
            self.q.execute("getfd", {"fdname": "bench-load"}, fd=fd)
        finally:
            os.close(fd)
        self.q.execute("migrate-incoming", {"uri": "fd:bench-load"})
        ev = self.q.wait_event(qmplib.migrate_status("completed", "failed", "cancelled"), timeout=900)
        if ev["data"]["status"] != "completed":
            raise BenchError(f"stop-and-copy restore {ev['data']['status']}")
        t_loaded = time.monotonic()
        self.q.execute("cont")
        t1 = time.monotonic()
        self.active, self.node = layer, "disk-data"
        return {
            "t_req": t0,
            "t_done": t1,
            "cmd_ms": (t1 - t0) * 1e3,
            "reported_restore_ms": (t_loaded - t_launched) * 1e3,
        }

    def _end_qemu(self):
        if self.q:
            try:
                self.q.execute("quit", timeout=5)
            except (qmplib.QMPError, OSError):
                pass
            self.q.close()
            self.q = None
        if self.proc:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None

    def stop(self):
        try:
            self._end_qemu()
        finally:
            for pid in qemu_pids_using(str(self.dir)):
                kill_pid(pid, grace=5)
            self.close_serial()
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def discard(self):
        for p in self.dir.glob("*.vmstate"):
            p.unlink()
        for p in self.dir.glob("*.qcow2"):
            p.unlink()


# ---------------------------------------------------------------------------------------------
class ProbeWatch:
    """Watches for libvirt's QEMU capability probes (`qemu-system-* -machine none,accel=...`
    with a `qmp-*` monitor dir) while a virsh command runs. libvirt re-probes when it thinks its
    cached capabilities are stale; on this kind of machine (/dev/kvm 0600, paravirtual kvm_pvm)
    it decides so at every QEMU start, which lands inside `snapshot-revert`."""

    def __init__(self):
        self.seen = {}
        self.stop_flag = False
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self.stop_flag:
            now = time.monotonic()
            for d in os.listdir("/proc"):
                if not d.isdigit():
                    continue
                try:
                    with open(f"/proc/{d}/cmdline", "rb") as f:
                        cmd = f.read()
                except OSError:
                    continue
                if b"qemu-system" in cmd and b"-machine\0none," in cmd and b"/qmp-" in cmd:
                    first, _ = self.seen.get(d, (now, now))
                    self.seen[d] = (first, now)
            time.sleep(0.01)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop_flag = True
        self.thread.join(timeout=2)

    def report(self):
        if not self.seen:
            return {"probes": 0, "probe_span_ms": 0.0}
        firsts = [a for a, _ in self.seen.values()]
        lasts = [b for _, b in self.seen.values()]
        return {"probes": len(self.seen), "probe_span_ms": (max(lasts) - min(firsts)) * 1e3}


def domain_xml(env, name, disk, serial_path, agent_sock):
    """The libvirt domain of the bench guest (virsh's contender, and the one backstop adopts):
    the same kernel, command line, memory and device kinds as the other contenders."""
    e = env
    dom_type = "kvm" if e.accel == "kvm" else "qemu"
    return f"""<domain type='{dom_type}'>
  <name>{name}</name>
  <memory unit='MiB'>{e.memory_mib}</memory>
  <vcpu>1</vcpu>
  <os>
    <type arch='x86_64' machine='q35'>hvm</type>
    <kernel>{e.guest}/vmlinuz</kernel>
    <initrd>{e.guest}/initrd.img</initrd>
    <cmdline>{e.append}</cmdline>
  </os>
  <features><acpi/><apic/></features>
  <on_poweroff>destroy</on_poweroff>
  <on_reboot>destroy</on_reboot>
  <on_crash>destroy</on_crash>
  <devices>
    <emulator>{e.qemu}</emulator>
    <disk type='file' device='disk'>
      <driver name='qemu' type='qcow2'/>
      <source file='{disk}'/>
      <target dev='vda' bus='virtio'/>
    </disk>
    <serial type='file'>
      <source path='{serial_path}' append='on'/>
      <target port='0'/>
    </serial>
    <channel type='unix'>
      <source mode='bind' path='{agent_sock}'/>
      <target type='virtio' name='org.backstop.agent.0'/>
    </channel>
    <interface type='user'>
      <model type='virtio'/>
    </interface>
    <watchdog model='i6300esb' action='pause'/>
    <controller type='usb' model='none'/>
    <memballoon model='none'/>
  </devices>
  <!-- QEMU as root, files left as they are: the guest lives under root's cache. -->
  <seclabel type='static' model='dac' relabel='no'><label>+0:+0</label></seclabel>
</domain>
"""


class Virsh(Contender):
    """One persistent domain per run (libvirt's `define` re-probes QEMU here and takes a minute
    or more): each repetition gets a fresh disk overlay and serial log at the same paths, a
    fresh start, and its snapshots' metadata removed at the end."""

    name = "virsh"
    label = "virsh (libvirt internal)"
    defined = {}  # run work dir -> domain name

    def __init__(self, env, rep):
        Contender.__init__(self, env, rep)
        self.dir = env.work / "virsh"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.domain = f"bsbench-{os.getpid()}"
        self.disk = self.dir / "disk.qcow2"
        self.serial_path = self.dir / "serial.log"
        self.agent_sock = self.dir / "agent.sock"
        self.snapshots = []

    @staticmethod
    def virsh(*args, timeout=900, check=True):
        return run(["virsh", "-q", "-c", LIBVIRT_URI, *args], timeout=timeout, check=check)

    def _define(self):
        xml = domain_xml(self.env, self.domain, self.disk, self.serial_path, self.agent_sock)
        (self.dir / "domain.xml").write_text(xml)
        t0 = time.monotonic()
        self.virsh("define", str(self.dir / "domain.xml"))
        Virsh.defined[str(self.env.work)] = self.domain
        return (time.monotonic() - t0) * 1e3

    def start(self):
        os.chmod(self.dir, 0o755)
        if str(self.env.work) not in Virsh.defined:
            self.define_ms = self._define()
        for p in (self.disk, self.serial_path):
            p.unlink(missing_ok=True)
        run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", f"{self.env.guest}/disk-base.qcow2",
             "-F", "qcow2", str(self.disk)])
        self.serial = SerialFollower(str(self.serial_path), from_start=True)
        with ProbeWatch() as w:
            t0 = time.monotonic()
            self.virsh("start", self.domain)
            self.start_ms = (time.monotonic() - t0) * 1e3
        self.start_probe = w.report()

    def gone(self):
        p = self.virsh("domstate", self.domain, check=False, timeout=60)
        state = p.stdout.strip()
        if p.returncode != 0 or state not in ("running", "paused"):
            log = Path("/var/log/libvirt/qemu") / f"{self.domain}.log"
            try:
                tail = log.read_text(errors="replace")[-800:]
            except OSError:
                tail = ""
            return f"domain is {state or p.stderr.strip()}: {tail}"
        return None

    def snapshot(self, kind):
        before = allocated(self.disk)
        with ProbeWatch() as w:
            t0 = time.monotonic()
            self.virsh("snapshot-create-as", self.domain, kind)
            t1 = time.monotonic()
        self.snapshots.append(kind)
        grown = allocated(self.disk) - before
        return {
            "kind": kind,
            "id": kind,
            "t_req": t0,
            "t_done": t1,
            "wall_ms": (t1 - t0) * 1e3,
            "bytes_stored": grown,
            "logical_bytes": None,
            "capture_ms": None,
            # Internal snapshots pause the guest for the whole save; QEMU reports no downtime.
            "qemu_pause_ms": None,
            "qemu_downtime_ms": None,
            **w.report(),
        }

    def rollback(self, snap):
        with ProbeWatch() as w:
            t0 = time.monotonic()
            self.virsh("snapshot-revert", self.domain, snap["id"])
            t1 = time.monotonic()
        return {"t_req": t0, "t_done": t1, "cmd_ms": (t1 - t0) * 1e3, **w.report()}

    def notes(self):
        return {"define_ms": getattr(self, "define_ms", None), "start_ms": getattr(self, "start_ms", None),
                "start_probe": getattr(self, "start_probe", None)}

    def stop(self):
        try:
            self.virsh("destroy", self.domain, check=False, timeout=120)
            for name in self.snapshots:
                self.virsh("snapshot-delete", self.domain, name, "--metadata", check=False, timeout=60)
        finally:
            for pid in qemu_pids_using(str(self.dir)):
                kill_pid(pid, grace=5)
            self.close_serial()

    def discard(self):
        for p in self.dir.glob("*.qcow2"):
            p.unlink()

    @classmethod
    def finish(cls, env):
        """End of the run: undefine the domain (and any snapshot metadata left)."""
        name = cls.defined.pop(str(env.work), None)
        if name:
            cls.virsh("destroy", name, check=False, timeout=120)
            cls.virsh("undefine", name, "--snapshots-metadata", check=False, timeout=120)


class BackstopLibvirt(Backstop):
    """backstopd guarding a libvirt domain it adopts: the virsh contender's domain
    XML, defined and started with virsh, then `backend = "libvirt"` — libvirt's disk-only
    snapshot plus QEMU's background snapshot, restore through libvirt keeping name and UUID.
    A fresh domain per repetition (a restore redefines it onto backstop's layers)."""

    name = "bslibvirt"
    label = "backstop on libvirt"

    def __init__(self, env, rep):
        Backstop.__init__(self, env, rep)
        self.domain = f"bsbench-lv-{os.getpid()}-{rep}"
        self.vdir = self.dir / "domain"
        self.disk = self.vdir / "disk.qcow2"
        self.serial_path = self.vdir / "serial.log"

    def start(self):
        shutil.rmtree(self.run_dir, ignore_errors=True)
        self.vdir.mkdir(parents=True, exist_ok=True)
        for d in (self.env.work, self.dir, self.vdir):
            os.chmod(d, 0o755)
        run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", f"{self.env.guest}/disk-base.qcow2",
             "-F", "qcow2", str(self.disk)])
        xml = domain_xml(self.env, self.domain, self.disk, self.serial_path, self.vdir / "agent.sock")
        (self.vdir / "domain.xml").write_text(xml)
        Virsh.virsh("define", str(self.vdir / "domain.xml"))
        self.serial = SerialFollower(str(self.serial_path), from_start=True)
        Virsh.virsh("start", self.domain)
        self.launch(self.daemon_table() + f"""
[vm]
name = "bench"
backend = "libvirt"

[vm.libvirt]
uri = "{LIBVIRT_URI}"
domain = "{self.domain}"
layers_dir = "{self.vdir / 'layers'}"
""")

    def gone(self):
        why = Backstop.gone(self)
        if why:
            return why
        p = Virsh.virsh("domstate", self.domain, check=False, timeout=60)
        if p.returncode != 0 or p.stdout.strip() not in ("running", "paused"):
            return f"domain is {p.stdout.strip() or p.stderr.strip()}"
        return None

    def stop(self):
        try:
            if self.proc and self.proc.poll() is None:
                # A clean stop leaves the adopted domain running: it is ended below.
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        finally:
            Virsh.virsh("destroy", self.domain, check=False, timeout=120)
            Virsh.virsh("undefine", self.domain, check=False, timeout=120)
            for pid in qemu_pids_using(str(self.vdir)):
                kill_pid(pid, grace=5)
            self.close_serial()
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def discard(self):
        shutil.rmtree(self.state, ignore_errors=True)
        shutil.rmtree(self.vdir, ignore_errors=True)


class BackstopStandby(Backstop):
    """backstopd with `[rollback] standby = true` (docs/standby.md): a standby QEMU,
    its RAM preallocated, waits beside the VM and a rollback restores into it. Everything else
    as the backstop contender."""

    name = "bsstandby"
    label = "backstop + standby"

    def __init__(self, env, rep):
        Backstop.__init__(self, env, rep)
        self.run_dir = Path(f"/tmp/bss-{os.getpid()}-{rep}")

    def daemon_table(self):
        return Backstop.daemon_table(self) + "standby = true\n"

    def ready(self):
        # The standby starts after the boot's baseline snapshot: the rollback should find it.
        deadline = time.monotonic() + 120
        while not qemu_pids_using(f"{self.run_dir}/bench/standby/"):
            if time.monotonic() > deadline:
                raise BenchError("no standby QEMU within 120 s")
            time.sleep(0.2)
        Backstop.ready(self)


class BackstopPreload(BackstopStandby):
    """backstopd with `[rollback] standby = true` and `preload = true`
    (docs/standby.md "Preloaded"): each new snapshot is loaded into the standby ahead of time, so
    the rollback to it skips the load. Its rollback waits (up to 60 s, recorded as
    `preload_wait_ms`) until `status` says the target is loaded: a snapshot is taken minutes
    before a rollback on a real host, and here the bench asks a few seconds after it."""

    name = "bspreload"
    label = "backstop + preload"

    def __init__(self, env, rep):
        BackstopStandby.__init__(self, env, rep)
        self.run_dir = Path(f"/tmp/bsp-{os.getpid()}-{rep}")

    def daemon_table(self):
        return BackstopStandby.daemon_table(self) + "preload = true\n"

    def rollback(self, snap):
        t0 = time.monotonic()
        while True:
            p = (self.cli("status").get("backend_details") or {}).get("standby_preload") or {}
            if p.get("snapshot_id") == snap["id"] and p.get("state") == "loaded":
                break
            if time.monotonic() - t0 > 60:
                raise BenchError(f"the standby was not preloaded with {snap['id']} within 60 s: {p}")
            time.sleep(0.1)
        waited = (time.monotonic() - t0) * 1e3
        r = BackstopStandby.rollback(self, snap)
        r["preload_wait_ms"] = waited
        return r


class BackstopHugeAll(Backstop):
    """backstopd with `vm.huge_pages = "all"` (crates/backstop-qmp/src/huge_pages.rs):
    after each snapshot the guest's whole RAM is mapped huge again, the never-written ranges too,
    so the next snapshot's write protection walks 512 entries per GiB instead of 262144. The
    guest's whole RAM is then resident. Everything else as the backstop contender."""

    name = "bshuge"
    label = "backstop, huge_pages all"

    def __init__(self, env, rep):
        Backstop.__init__(self, env, rep)
        self.run_dir = Path(f"/tmp/bsh-{os.getpid()}-{rep}")

    def vm_extra(self):
        return 'huge_pages = "all"\n'


class BackstopMigrateFirst(Backstop):
    """backstopd with `vm.capture_order = "migrate-first"` (crates/backstop-qemu/src/
    version.rs): on QEMU 7.2/8.x too, `migrate` goes in before `stop` with the lead learnt from
    QEMU's setup times, so QEMU's pre-fault of guest RAM runs while the guest still runs; a capture
    whose disk switch came after QEMU's own resume is discarded and taken again. On >= 9.0 that is
    what the backstop contender does already (run.py skips this one there)."""

    name = "bsorder"
    label = "backstop, migrate first"

    def __init__(self, env, rep):
        Backstop.__init__(self, env, rep)
        self.run_dir = Path(f"/tmp/bso-{os.getpid()}-{rep}")

    def vm_extra(self):
        return 'capture_order = "migrate-first"\n'


CONTENDERS = {c.name: c for c in (Backstop, BackstopLibvirt, BackstopStandby, BackstopPreload,
                                  BackstopHugeAll, BackstopMigrateFirst, Virsh, StopCopy)}
