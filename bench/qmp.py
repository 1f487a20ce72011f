"""A small QMP client: commands, events (with QEMU's own timestamps) and fd passing."""

import json
import os
import socket
import time


class QMPError(Exception):
    pass


class QMP:
    def __init__(self, path, timeout=30.0):
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.sock.connect(path)
                break
            except OSError:
                self.sock.close()
                if time.monotonic() > deadline:
                    raise QMPError(f"cannot connect to QMP at {path}")
                time.sleep(0.05)
        self.buf = b""
        self.events = []
        self.sock.settimeout(timeout)
        # A QEMU that starts running while we connect may send an event (its RESUME) before
        # the greeting: QEMU's monitor emits to a connection it has not greeted yet (seen once
        # in CI, stop-and-copy on QEMU 7.2). Such events are kept; anything else is an error.
        while True:
            greeting = self._read()
            if "QMP" in greeting:
                break
            if "event" not in greeting or len(self.events) >= 16:
                raise QMPError(f"unexpected greeting {greeting}")
            self.events.append(greeting)
        self.execute("qmp_capabilities")

    def _read(self):
        while b"\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise QMPError("QMP connection closed")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def execute(self, cmd, args=None, fd=None, timeout=None):
        self.send(cmd, args, fd)
        old = self.sock.gettimeout()
        if timeout is not None:
            self.sock.settimeout(timeout)
        try:
            return self.answer(cmd)
        finally:
            self.sock.settimeout(old)

    def send(self, cmd, args=None, fd=None):
        """Writes one command without reading its answer (`answer` reads it)."""
        msg = {"execute": cmd}
        if args is not None:
            msg["arguments"] = args
        data = json.dumps(msg).encode() + b"\n"
        if fd is not None:
            socket.send_fds(self.sock, [data], [fd])
        else:
            self.sock.sendall(data)

    def answer(self, cmd):
        """Reads until the next answer (events are kept), for the command `cmd` just sent."""
        while True:
            r = self._read()
            if "event" in r:
                self.events.append(r)
                continue
            if "error" in r:
                raise QMPError(f"{cmd}: {r['error'].get('desc')}")
            return r.get("return")

    def execute_batch(self, commands):
        """Writes every (command, arguments) before reading any answer, as backstop's `stop`-first
        capture does; returns the answers in order (an error answer raises, once all are read)."""
        data = b"".join(json.dumps({"execute": c, **({"arguments": a} if a is not None else {})}).encode()
                        + b"\n" for c, a in commands)
        self.sock.sendall(data)
        answers = []
        while len(answers) < len(commands):
            r = self._read()
            if "event" in r:
                self.events.append(r)
            else:
                answers.append(r)
        for (c, _), r in zip(commands, answers):
            if "error" in r:
                raise QMPError(f"{c}: {r['error'].get('desc')}")
        return [r.get("return") for r in answers]

    def wait_event(self, pred, timeout=60.0):
        """Returns (and consumes) the first event for which pred(event) holds."""
        deadline = time.monotonic() + timeout
        while True:
            for i, e in enumerate(self.events):
                if pred(e):
                    return self.events.pop(i)
            left = deadline - time.monotonic()
            if left <= 0:
                raise QMPError("timed out waiting for a QMP event")
            self.sock.settimeout(left)
            r = self._read()
            if "event" in r:
                self.events.append(r)

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass


def event_us(e):
    ts = e.get("timestamp", {})
    return ts.get("seconds", 0) * 1_000_000 + ts.get("microseconds", 0)


def name_is(*names):
    return lambda e: e.get("event") in names


def migrate_status(*statuses):
    return lambda e: e.get("event") == "MIGRATION" and e["data"].get("status") in statuses


def pipe_or_file_fd(path):
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
