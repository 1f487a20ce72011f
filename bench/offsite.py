#!/usr/bin/env python3
"""Off-host replication figures: backstop's upload against a plain PUT loop of the
same bytes to the same gateway, and the time from `snapshot pull` on another host to its guest
running there.

One run, on a throwaway single-host Ceph cluster (scripts/ceph-cluster.sh: one monitor, one
memstore OSD, one RADOS Gateway on a loopback port):

  host A    backstopd with `[offsite]`, a guest of --memory-mib that keeps --fill-mib MiB of
            random data resident; after the fill and after the baseline snapshot has been
            replicated, a console snapshot. Figure: its upload (`snapshot.replicated`: bytes
            and `upload_ms`, the uploader's own clock) as MB/s.
  peers     the chunk and layer files that snapshot added to A's store (the bytes it had to
            send), PUT one object each to another prefix of the same bucket: SigV4 signed with
            the payload's sha256 (as `aws s3 cp` does), keep-alive connections, on 1 thread and
            on as many threads as backstop's `max_concurrent_uploads` (4). If `aws` is on PATH,
            `aws s3 cp --recursive` of the same files too.
            Then an idle second snapshot: the bytes its upload sends, against the first's.
  host B    a second backstopd (its own state dir, the same VM shape, already running its own
            guest): `snapshot pull ID --from host-a`, then `rollback --to` the pulled snapshot.
            Figure: pull + rollback = request to B's guest running at A's point.

Prints a table (median [min..max] over --reps) with each peer's MB/s as a ratio to backstop's;
with --out FILE, the raw figures as JSON. Asserts nothing; exits non-zero only when a figure
could not be measured. Everything it starts (daemons, QEMUs, the cluster) is stopped and its
directories removed.
"""

import argparse
import concurrent.futures
import datetime
import hashlib
import hmac
import http.client
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUCKET = "bench"


def log(msg):
    print(f"bench-offsite: {msg}", file=sys.stderr, flush=True)


class BenchError(Exception):
    pass


# ---------------------------------------------------------------------------------------------
# A minimal S3 client for the peer: SigV4 over http.client, one keep-alive connection per thread.
class S3:
    def __init__(self, endpoint, access, secret, region):
        u = urllib.parse.urlparse(endpoint)
        self.host = u.netloc
        self.access, self.secret, self.region = access, secret, region
        self.local = threading.local()

    def _conn(self):
        c = getattr(self.local, "conn", None)
        if c is None:
            c = http.client.HTTPConnection(self.host, timeout=120)
            self.local.conn = c
        return c

    def _sign(self, method, path, payload_hash):
        now = datetime.datetime.now(datetime.timezone.utc)
        amz_date = now.strftime("%Y%m%dT%H%M%SZ")
        day = amz_date[:8]
        headers = {"host": self.host, "x-amz-content-sha256": payload_hash, "x-amz-date": amz_date}
        names = sorted(headers)
        canonical = "\n".join([
            method, urllib.parse.quote(path, safe="/-_.~"), "",
            "".join(f"{k}:{headers[k]}\n" for k in names), ";".join(names), payload_hash,
        ])
        scope = f"{day}/{self.region}/s3/aws4_request"
        to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope,
                             hashlib.sha256(canonical.encode()).hexdigest()])
        key = ("AWS4" + self.secret).encode()
        for part in (day, self.region, "s3", "aws4_request"):
            key = hmac.new(key, part.encode(), hashlib.sha256).digest()
        sig = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
        headers["authorization"] = (f"AWS4-HMAC-SHA256 Credential={self.access}/{scope}, "
                                    f"SignedHeaders={';'.join(names)}, Signature={sig}")
        return headers

    def request(self, method, path, body=b""):
        headers = self._sign(method, path, hashlib.sha256(body).hexdigest())
        for attempt in range(3):
            c = self._conn()
            try:
                c.request(method, path, body=body, headers=headers)
                r = c.getresponse()
                data = r.read()
                if r.status >= 300 and not (method == "PUT" and path.count("/") == 1 and r.status == 409):
                    raise BenchError(f"{method} {path}: HTTP {r.status} {data[:200]!r}")
                return r.status
            except (http.client.HTTPException, OSError):
                c.close()
                self.local.conn = None
                if attempt == 2:
                    raise
        return None

    def put_file(self, key, path):
        return self.request("PUT", f"/{BUCKET}/{key}", Path(path).read_bytes())


def put_loop(s3, files, prefix, threads):
    """PUTs every file as one object; returns (seconds, bytes)."""
    t0 = time.monotonic()
    total = 0

    def one(f):
        s3.put_file(f"{prefix}/{f.name}", f)
        return f.stat().st_size

    if threads == 1:
        for f in files:
            total += one(f)
    else:
        with concurrent.futures.ThreadPoolExecutor(threads) as ex:
            total = sum(ex.map(one, files))
    return time.monotonic() - t0, total


def aws_cp(env, files, prefix, workdir):
    """`aws s3 cp --recursive` of the same files (hard links in one directory)."""
    d = Path(workdir) / f"aws-{prefix.replace('/', '-')}"
    d.mkdir()
    for f in files:
        os.link(f, d / f.name)
    t0 = time.monotonic()
    p = subprocess.run(
        ["aws", "--endpoint-url", env["S3_ENDPOINT"], "s3", "cp", "--recursive", "--only-show-errors",
         str(d), f"s3://{BUCKET}/{prefix}/"],
        capture_output=True, text=True, timeout=1800,
        env=dict(os.environ, AWS_ACCESS_KEY_ID=env["S3_ACCESS_KEY"],
                 AWS_SECRET_ACCESS_KEY=env["S3_SECRET_KEY"], AWS_DEFAULT_REGION=env["S3_REGION"]),
    )
    secs = time.monotonic() - t0
    shutil.rmtree(d, ignore_errors=True)
    if p.returncode != 0:
        raise BenchError(f"aws s3 cp failed: {p.stderr.strip()[:300]}")
    return secs


# ---------------------------------------------------------------------------------------------
class Host:
    """One backstopd standing for one host of the fleet."""

    def __init__(self, args, work, host, cluster, creds, trust, fill):
        self.args, self.host = args, host
        self.dir = Path(work) / host
        self.state = self.dir / "state"
        self.run = Path(f"/tmp/bso-{os.getpid()}-{host}")
        shutil.rmtree(self.run, ignore_errors=True)
        self.dir.mkdir(parents=True)
        g = args.guest
        append = (f"console=ttyS0 quiet panic=-1 no_timer_check backstop.bench=1 "
                  f"backstop.fill_mib={fill}")
        cfg = f"""# written by bench/offsite.py
[daemon]
state_dir = "{self.state}"
run_dir = "{self.run}"

[rollback]
forensic_ram_for = []

[offsite]
endpoint = "{cluster['S3_ENDPOINT']}"
bucket = "{BUCKET}"
prefix = "fleet"
host = "{host}"
credentials_file = "{creds}"
trust_file = "{trust}"
max_concurrent_uploads = {args.threads}

[vm]
name = "bench"
qemu_binary = "{args.qemu}"
accel = "auto"
memory_mib = {args.memory_mib}
vcpus = 1
kernel = "{g}/vmlinuz"
initrd = "{g}/initrd.img"
append = "{append}"

[[vm.disks]]
id = "data"
path = "{g}/disk-base.qcow2"
format = "qcow2"
snapshot = "capture"
"""
        conf = self.dir / "backstop.toml"
        conf.write_text(cfg)
        self.log = self.dir / "backstopd.log"
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [str(Path(args.bin_dir) / "backstopd"), "--config", str(conf)],
                stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                env=dict(os.environ, BACKSTOP_LOG="info"),
            )
        deadline = time.monotonic() + 180
        while True:
            if self.proc.poll() is not None:
                raise BenchError(f"{host}: backstopd exited ({self.proc.returncode}):\n{self.tail()}")
            if (self.run / "control.sock").exists():
                try:
                    self.cli("status")
                    break
                except BenchError:
                    pass
            if time.monotonic() > deadline:
                raise BenchError(f"{host}: backstopd did not come up:\n{self.tail()}")
            time.sleep(0.2)

    def tail(self, n=20):
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def cli(self, *args, timeout=1800):
        p = subprocess.run(
            [str(Path(self.args.bin_dir) / "backstop"), "--socket", str(self.run / "control.sock"),
             "--json", *args],
            capture_output=True, text=True, timeout=timeout,
        )
        if p.returncode != 0:
            raise BenchError(f"{self.host}: backstop {' '.join(args)} failed ({p.returncode}): "
                             f"{p.stderr.strip()} {p.stdout.strip()}")
        return json.loads(p.stdout) if p.stdout.strip() else {}

    def public_key(self):
        return (self.state / "keys" / "host-ed25519.pub").read_text().strip()

    def serial(self):
        for f in self.state.rglob("*serial*.log"):
            return f.read_text(errors="replace")
        return ""

    def journal(self):
        out = []
        for f in self.state.rglob("*.jsonl"):
            for line in f.read_text(errors="replace").splitlines():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
        return out

    def wait(self, what, pred, timeout):
        deadline = time.monotonic() + timeout
        while True:
            v = pred()
            if v:
                return v
            if self.proc.poll() is not None:
                raise BenchError(f"{self.host}: backstopd exited while waiting for {what}:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise BenchError(f"{self.host}: no {what} after {timeout} s:\n{self.tail()}")
            time.sleep(0.25)

    def snapshots(self):
        return self.cli("snapshot", "list").get("snapshots", [])

    def chunk_files(self):
        """Every file of the store's chunk and layer directories: path -> size."""
        out = {}
        for d in ("chunks", "layers"):
            for root in self.state.rglob(d):
                if root.is_dir():
                    for f in root.rglob("*"):
                        if f.is_file():
                            out[f] = f.stat().st_size
        return out

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.run, ignore_errors=True)


def replicated(host, snapshot_id):
    for e in host.journal():
        if e.get("event") == "snapshot.replicated" and e.get("snapshot_id") == snapshot_id:
            return e
        f = e.get("fields") or {}
        if e.get("event") == "snapshot.replicated" and f.get("snapshot_id") == snapshot_id:
            return e
    return None


def one_rep(args, cluster, work, rep, s3):
    keys = Path(work) / f"keys-{rep}"
    keys.mkdir()
    creds = keys / "credentials"
    creds.write_text(f'access_key_id = "{cluster["S3_ACCESS_KEY"]}"\n'
                     f'secret_access_key = "{cluster["S3_SECRET_KEY"]}"\n')
    creds.chmod(0o600)
    trust = keys / "fleet-trust.toml"
    trust.write_text("[hosts]\n")
    hosts = []
    try:
        a = Host(args, work, f"host-a{rep}", cluster, creds, trust, args.fill_mib)
        hosts.append(a)
        b = Host(args, work, f"host-b{rep}", cluster, creds, trust, 0)
        hosts.append(b)
        trust.write_text("[hosts]\n" + "".join(f'{h.host} = "{h.public_key()}"\n' for h in hosts))
        a.wait("the guest's fill", lambda: "BACKSTOP fill mib=" in a.serial(), 600)
        a.wait("a baseline snapshot", a.snapshots, 600)
        a.wait("the baseline's upload", lambda: a.cli("status").get("offsite", {}).get("pending") == 0
               and all((s.get("replication") or {}).get("state") == "uploaded" for s in a.snapshots()), 900)
        before = a.chunk_files()
        snap = a.cli("snapshot", "create", "--reason", "bench: offsite")
        sid = snap["summary"]["snapshot_id"]
        e = a.wait("the snapshot's upload", lambda: replicated(a, sid), 1800)
        f = e.get("fields") or {}
        up_bytes, up_ms = f.get("bytes_uploaded"), f.get("upload_ms")
        added = sorted(p for p in a.chunk_files() if p not in before)
        added_bytes = sum(p.stat().st_size for p in added)
        log(f"rep {rep}: backstop uploaded {up_bytes} bytes in {up_ms} ms; the store added "
            f"{len(added)} files, {added_bytes} bytes")
        r = {"rep": rep, "snapshot_id": sid, "backstop_bytes": up_bytes, "backstop_ms": up_ms,
             "backstop_objects": f.get("objects_uploaded"), "peer_files": len(added),
             "peer_bytes": added_bytes}
        secs, _ = put_loop(s3, added, f"peer-seq-{rep}", 1)
        r["put_loop_1_ms"] = secs * 1e3
        secs, _ = put_loop(s3, added, f"peer-par-{rep}", args.threads)
        r[f"put_loop_{args.threads}_ms"] = secs * 1e3
        if shutil.which("aws"):
            r["aws_cp_ms"] = aws_cp(cluster, added, f"peer-aws-{rep}", work) * 1e3
        # The idle guest's second snapshot: what replication sends for it (remote dedup).
        snap2 = a.cli("snapshot", "create", "--reason", "bench: offsite, idle second")
        sid2 = snap2["summary"]["snapshot_id"]
        f2 = (a.wait("the second snapshot's upload", lambda: replicated(a, sid2), 1800).get("fields") or {})
        r.update({"idle_second_bytes": f2.get("bytes_uploaded"), "idle_second_ms": f2.get("upload_ms")})
        log(f"rep {rep}: idle second snapshot uploaded {f2.get('bytes_uploaded')} bytes")
        # Host B: pull, then start from it. Host A is stopped first (the case a pull is for: A
        # is gone), so A's guest does not compete for the CPUs with B's pull.
        if args.stop_a:
            a.stop()
        t0 = time.monotonic()
        pulled = b.cli("snapshot", "pull", sid, "--from", a.host)
        t1 = time.monotonic()
        b.cli("rollback", "--to", pulled["snapshot_id"], "--reason", "bench: start from host A")
        t2 = time.monotonic()
        r.update({"pull_ms": (t1 - t0) * 1e3, "pull_bytes": pulled.get("bytes_fetched"),
                  "rollback_ms": (t2 - t1) * 1e3, "pull_to_running_ms": (t2 - t0) * 1e3})
        log(f"rep {rep}: {json.dumps(r)}")
        return r
    finally:
        for h in hosts:
            h.stop()


def fmt(values, unit=""):
    v = [x for x in values if x is not None]
    if not v:
        return "-"
    return f"{statistics.median(v):.1f}{unit} [{min(v):.1f}..{max(v):.1f}] (n={len(v)})"


def report(records, threads):
    def mbps(nbytes, ms):
        return nbytes / 1e6 / (ms / 1e3) if nbytes and ms else None

    rows = []
    bs = [mbps(r["backstop_bytes"], r["backstop_ms"]) for r in records]
    rows.append(("backstop replication (MB/s)", fmt(bs), ""))
    peers = [("plain PUT loop, 1 thread", "put_loop_1_ms"),
             (f"plain PUT loop, {threads} threads", f"put_loop_{threads}_ms"),
             ("aws s3 cp --recursive", "aws_cp_ms")]
    for label, key in peers:
        vals = [mbps(r["peer_bytes"], r.get(key)) for r in records]
        if not any(vals):
            continue
        ratios = [b / p for b, p in zip(bs, vals) if b and p]
        rows.append((f"{label} (MB/s)", fmt(vals), f"backstop = {statistics.median(ratios):.2f}x" if ratios else ""))
    rows.append(("bytes backstop sent / store added", fmt([r["backstop_bytes"] / 1e6 for r in records], " MB"),
                 fmt([r["peer_bytes"] / 1e6 for r in records], " MB")))
    rows.append(("idle second snapshot uploaded / first's", fmt([100.0 * r["idle_second_bytes"] / r["backstop_bytes"]
                                                                  for r in records if r.get("idle_second_bytes")], " %"), ""))
    rows.append(("pull on host B (ms)", fmt([r["pull_ms"] for r in records]), ""))
    rows.append(("rollback to it on B (ms)", fmt([r["rollback_ms"] for r in records]), ""))
    rows.append(("pull -> guest running on B (ms)", fmt([r["pull_to_running_ms"] for r in records]), ""))
    w = max(len(r[0]) for r in rows)
    return "\n".join(f"{a:<{w}}  {b:<36} {c}" for a, b, c in rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--guest", required=True, help="test guest directory (scripts/setup.sh prints it)")
    ap.add_argument("--qemu", default="qemu-system-x86_64")
    ap.add_argument("--memory-mib", type=int, default=1024, help="guest RAM (default 1024)")
    ap.add_argument("--fill-mib", type=int, default=400, help="random data resident in A's guest (default 400)")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--threads", type=int, default=4, help="backstop's max_concurrent_uploads and the parallel peer's threads")
    ap.add_argument("--bin-dir", default=str(ROOT / "target" / "release"))
    ap.add_argument("--out", help="write the raw figures here (JSON)")
    ap.add_argument("--keep-a-running", dest="stop_a", action="store_false",
                    help="leave host A and its guest running during B's pull (default: stopped first)")
    ap.add_argument("--keep", action="store_true", help="leave the work directory (daemon logs, state) in /var/tmp")
    args = ap.parse_args()

    work = tempfile.mkdtemp(prefix="bsoffsite-", dir="/var/tmp")
    cluster_dir = Path(work) / "ceph"
    records = []
    try:
        p = subprocess.run([str(ROOT / "scripts" / "ceph-cluster.sh"), "start", str(cluster_dir)],
                           capture_output=True, text=True, timeout=300)
        if p.returncode != 0:
            raise BenchError(f"ceph-cluster.sh start failed: {p.stderr.strip()[-500:]}")
        cluster = dict(l.split("=", 1) for l in p.stdout.splitlines() if "=" in l)
        s3 = S3(cluster["S3_ENDPOINT"], cluster["S3_ACCESS_KEY"], cluster["S3_SECRET_KEY"], cluster["S3_REGION"])
        s3.request("PUT", f"/{BUCKET}")
        for rep in range(args.reps):
            records.append(one_rep(args, cluster, work, rep, s3))
    finally:
        subprocess.run([str(ROOT / "scripts" / "ceph-cluster.sh"), "stop", str(cluster_dir)],
                       capture_output=True, timeout=300)
        if args.keep:
            log(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(f"off-host replication: guest {args.memory_mib} MiB, {args.fill_mib} MiB resident random data, "
          f"{args.reps} rep(s), one gateway on loopback (memstore OSD)")
    print(report(records, args.threads))
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "records": records}, indent=2))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as e:
        log(f"error: {e}")
        sys.exit(1)
