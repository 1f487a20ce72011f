#!/usr/bin/env python3
"""Run a workspace's test binaries side by side, under a budget of test threads.

`cargo test` runs its test binaries one after another. Most of ours are single end-to-end tests
that boot one TCG guest and then mostly wait on it (a heartbeat's timeout, a writer's period, a
snapshot's upload), so one of them leaves half of a 2-core machine idle for minutes. This runs the
binaries cargo built, several at once, and keeps what `cargo test` guarantees:

  * the tests of one binary run in one process, as cargo runs them (some share a fixture or a
    process-wide lock: replay.rs, libvirt.rs), with `--test-threads` set to the slots it holds
    (an --alone binary: as many as --threads-per-binary);
  * every binary runs to the end (`--no-fail-fast`), and the run fails if any test failed;
  * each binary's output is printed whole when it ends, never interleaved with another's.

A pass runs binaries again under other settings, in the same pool (no second build, no second
tail): `--pass "qemu10 BACKSTOP_QEMU=/path rollback integrity -- filter"` runs the targets named
(test targets or crates' unit tests by target name) with that environment and those test filters,
each labelled with the pass's tag.

Scheduling: a binary holds min(its test count, --threads-per-binary) slots of --slots, a
--one-thread binary one (libvirt.rs: each test holds the userfaultfd sysctl's lock from start to
end, so a second thread only waited on the first while holding a slot). An --alone binary holds
every slot: nothing runs beside it, as under `cargo test` (offsite.rs: one of its checks failed
once with other tests beside it, unexplained). Binaries named together in an --exclusive group
never run at the same time (they share a host daemon one of them restarts: libvirtd). The --alone
binaries start first, then the longest, by the durations the last run on this checkout recorded
in target/test-times.json; on a fresh checkout the --first hint orders them.
Order only changes how long the run takes, never what it checks.

Usage: run-tests.py [options] [--pass "TAG [NAME=VALUE]... TARGET... [-- FILTER...]"]...
                    -- <cargo test arguments> [-- <test binary arguments>]
"""

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def log(msg):
    print(f"run-tests: {msg}", file=sys.stderr, flush=True)


def die(msg):
    log(f"error: {msg}")
    sys.exit(2)


class Binary:
    def __init__(self, label, name, exe, cwd, env, args, tests, slots):
        self.label = label
        self.name = name  # the target's: what --first and --exclusive speak of
        self.exe = exe
        self.cwd = cwd
        self.env = env
        self.args = args
        self.tests = tests
        self.slots = slots
        self.seconds = None
        self.ok = None


def parse_pass(spec):
    """`TAG [NAME=VALUE]... TARGET... [-- FILTER...]` -> (tag, env, targets, filters)."""
    words = shlex.split(spec)
    filters = []
    if "--" in words:
        i = words.index("--")
        words, filters = words[:i], words[i + 1 :]
    if not words:
        die(f"--pass {spec!r}: no tag")
    tag, env, targets = words[0], {}, []
    for w in words[1:]:
        if "=" in w:
            k, v = w.split("=", 1)
            env[k] = v
        else:
            targets.append(w)
    if not targets:
        die(f"--pass {spec!r}: names no test target")
    return tag, env, targets, filters


def split_args(argv):
    """Options before the first `--`; cargo's arguments after it; the binaries' after the next."""
    if "--" not in argv:
        return argv, [], []
    i = argv.index("--")
    rest = argv[i + 1 :]
    if "--" in rest:
        j = rest.index("--")
        return argv[:i], rest[:j], rest[j + 1 :]
    return argv[:i], rest, []


def build(cargo_args):
    """Builds the test binaries: (label, target name, executable, package dir) for each."""
    cmd = ["cargo", "test", *cargo_args, "--no-run", "--message-format=json-render-diagnostics"]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        die(f"{' '.join(cmd)} failed (exit {proc.returncode})")
    found = []
    for line in proc.stdout.splitlines():
        try:
            msg = json.loads(line)
        except json.JSONDecodeError:
            continue
        if msg.get("reason") != "compiler-artifact" or not msg.get("executable"):
            continue
        if not msg.get("profile", {}).get("test"):
            continue
        target = msg["target"]
        pkg_dir = str(Path(msg["manifest_path"]).parent)
        pkg = package_name(msg["package_id"])
        kind = target["kind"][0]
        if kind == "test":
            label = f"{pkg} --test {target['name']}"
        else:
            label = f"{pkg} {kind} {target['name']}"
        found.append((label, target["name"], msg["executable"], pkg_dir))
    return found


def package_name(package_id):
    """The name in a package id: `path+file:///…/tests#backstop-e2e@0.1.0` and, where the name
    is the directory's, `path+file:///…/backstop-libvirt#0.1.0` (cargo ≥ 1.77), or the older
    `backstop-e2e 0.1.0 (…)`."""
    if "#" in package_id:
        url, frag = package_id.rsplit("#", 1)
        if "@" in frag:
            return frag.split("@", 1)[0]
        return url.rstrip("/").rsplit("/", 1)[-1]
    return package_id.split(" ", 1)[0]


def count_tests(exe, cwd, bin_args):
    out = subprocess.run(
        [exe, "--list", "--format", "terse", *bin_args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    if out.returncode != 0:
        die(f"{exe} --list failed: {out.stderr.strip()}")
    return sum(1 for l in out.stdout.splitlines() if l.endswith(": test"))


def main():
    opts_argv, cargo_args, bin_args = split_args(sys.argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=int(os.environ.get("BACKSTOP_TEST_SLOTS", "4")),
                    help="test threads running at once, all binaries together "
                         "(default: $BACKSTOP_TEST_SLOTS or 4)")
    ap.add_argument("--threads-per-binary", type=int, default=2,
                    help="the most test threads one binary gets (default 2)")
    ap.add_argument("--exclusive", action="append", default=[], metavar="A,B,...",
                    help="test targets that never run at the same time as each other")
    ap.add_argument("--alone", default="", metavar="A,B,...",
                    help="targets that run with no other binary beside them (all slots held)")
    ap.add_argument("--one-thread", default="", metavar="A,B,...",
                    help="targets whose tests take turns on a lock of their own: one thread, "
                         "one slot (more would only hold slots idle)")
    ap.add_argument("--first", default="", metavar="A,B,...",
                    help="targets to start first when no recorded durations exist")
    ap.add_argument("--pass", dest="passes", action="append", default=[], metavar="SPEC",
                    help="run TARGETs again with NAME=VALUE set and FILTERs passed, labelled TAG")
    ap.add_argument("--times", default="target/test-times.json",
                    help="where durations are read from and recorded")
    opts = ap.parse_args(opts_argv)
    if opts.slots < 1 or opts.threads_per_binary < 1:
        die("--slots and --threads-per-binary must be at least 1")

    alone = {t for t in opts.alone.split(",") if t}
    one_thread = {t for t in opts.one_thread.split(",") if t}
    built = build(cargo_args)
    jobs = [("", {}, None, bin_args)] + [parse_pass(p) for p in opts.passes]
    binaries = []
    for tag, env, targets, args in jobs:
        if targets is not None:
            unknown = set(targets) - {name for _, name, _, _ in built}
            if unknown:
                die(f"pass {tag}: no such test target: {', '.join(sorted(unknown))}")
        for label, name, exe, cwd in built:
            if targets is not None and name not in targets:
                continue
            n = count_tests(exe, cwd, args)
            if n == 0:
                if targets is not None:
                    die(f"pass {tag}: {label} has no test matching {args}")
                continue
            slots = min(n, opts.threads_per_binary, opts.slots)
            if name in one_thread:
                slots = 1
            if name in alone:
                slots = opts.slots
            full = f"{label} @{tag}" if tag else label
            binaries.append(Binary(full, name, exe, cwd, env, args, n, slots))
    if not binaries:
        die("no test binary has a test to run")

    try:
        recorded = json.loads(Path(opts.times).read_text())
    except (OSError, ValueError):
        recorded = {}
    first = [t for t in opts.first.split(",") if t]

    # --alone binaries first, while nothing else runs: one next in line behind a long binary
    # held every other slot idle until that one ended (with recorded durations, libvirt.rs's
    # 235 s ran by itself before offsite.rs).
    def expected(b):
        if b.name in alone:
            return (0, 0)
        if b.label in recorded:
            return (1, -float(recorded[b.label]))
        if b.name in first:
            return (2, first.index(b.name))
        return (3, -b.tests)

    pending = sorted(binaries, key=expected)
    groups = [set(g.split(",")) for g in opts.exclusive]
    running = {}  # Binary -> (Popen, log file, start)
    total_start = time.monotonic()
    log(f"{len(pending)} test binaries, {sum(b.tests for b in pending)} tests, "
        f"{opts.slots} slots ({opts.threads_per_binary} per binary at most)")

    def blocked(b):
        for g in groups:
            if b.name in g and any(r.name in g for r in running):
                return True
        return False

    def start(b):
        out = tempfile.TemporaryFile(mode="w+")
        env = dict(os.environ, CARGO_MANIFEST_DIR=b.cwd, **b.env)
        threads = min(b.slots, b.tests, opts.threads_per_binary)
        p = subprocess.Popen(
            [b.exe, f"--test-threads={threads}", *b.args],
            cwd=b.cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
        )
        running[b] = (p, out, time.monotonic())
        log(f"start {b.label} ({b.tests} tests, {threads} threads{', alone' if b.name in alone else ''})")

    # Interrupted (Ctrl-C, a CI timeout): the running test binaries are ended too, as `cargo test`
    # ends its one, instead of running on unattended.
    def on_signal(signum, frame):
        for p, _, _ in running.values():
            p.terminate()
        log(f"interrupted (signal {signum}): ended {len(running)} running test binaries")
        sys.exit(128 + signum)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    failed = []
    while pending or running:
        # Start, in order, every binary that fits; one that does not fit (or is excluded) waits
        # without holding back smaller ones behind it. An --alone binary next in line is waited
        # for: nothing new starts until the running ones have ended, or 1-slot binaries would
        # keep it waiting to the end of the run.
        for b in list(pending):
            free = opts.slots - sum(r.slots for r in running)
            if b.slots <= free and not blocked(b):
                pending.remove(b)
                start(b)
            elif b.name in alone and not blocked(b):
                break
        ended = [b for b, (p, _, _) in running.items() if p.poll() is not None]
        if not ended:
            time.sleep(0.2)
        for b in ended:
            p, out, t0 = running.pop(b)
            b.seconds = time.monotonic() - t0
            b.ok = p.returncode == 0
            out.seek(0)
            settings = " ".join(f"{k}={v}" for k, v in b.env.items())
            sys.stdout.write(f"\n     Running {b.label} ({settings + ' ' if settings else ''}{b.exe})\n")
            sys.stdout.write(out.read())
            sys.stdout.flush()
            out.close()
            status = "ok" if b.ok else f"FAILED (exit {p.returncode})"
            log(f"done {b.label}: {status} in {b.seconds:.1f} s")
            if not b.ok:
                failed.append(b)

    wall = time.monotonic() - total_start
    busy = sum(b.seconds for b in binaries)
    print(f"\nrun-tests: durations (longest first), {wall:.0f} s wall for {busy:.0f} s of binaries:",
          file=sys.stderr)
    for b in sorted(binaries, key=lambda b: -b.seconds):
        print(f"  {b.seconds:7.1f} s  {b.tests:3d} tests  {'ok  ' if b.ok else 'FAIL'}  {b.label}",
              file=sys.stderr)
    # Only a run's own binaries are updated: a partial run keeps the others' figures.
    recorded.update({b.label: round(b.seconds, 1) for b in binaries})
    try:
        Path(opts.times).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.times).write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")
    except OSError as e:
        log(f"warning: durations not recorded in {opts.times}: {e}")
    if failed:
        log(f"{len(failed)} test binaries failed: {', '.join(b.label for b in failed)}")
        sys.exit(1)
    log("all test binaries passed")


if __name__ == "__main__":
    main()
