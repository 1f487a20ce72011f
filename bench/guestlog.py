"""Follows a guest's serial log as it grows and timestamps each line on arrival (host clock).

QEMU writes the guest's serial output to a file byte by byte as the guest sends it, so the
moment a line's newline lands in the file is when the guest printed it, to within the
wake-up latency of this thread (inotify where available, else a 0.5 ms poll).
"""

import ctypes
import os
import re
import select
import threading
import time

IN_MODIFY = 0x00000002

STALL_RE = re.compile(rb"BACKSTOP stall seq=(\d+) t_us=(\d+) max_us=(\d+)")
TICK_RE = re.compile(rb"BACKSTOP tick ram=(\d+) disk=(\d+)")


class Line:
    __slots__ = ("t", "text")

    def __init__(self, t, text):
        self.t = t  # time.monotonic() at arrival
        self.text = text  # bytes, without the newline


class SerialFollower:
    def __init__(self, path, from_start=False):
        self.path = path
        self.lines = []
        self.lock = threading.Lock()
        self.stop_flag = False
        self.offset = 0 if from_start else (os.path.getsize(path) if os.path.exists(path) else 0)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _inotify(self):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
            if fd < 0:
                return None
            if libc.inotify_add_watch(fd, self.path.encode(), IN_MODIFY) < 0:
                os.close(fd)
                return None
            return fd
        except (OSError, AttributeError):
            return None

    def _run(self):
        while not os.path.exists(self.path):
            if self.stop_flag:
                return
            time.sleep(0.01)
        ino = self._inotify()
        f = open(self.path, "rb", buffering=0)
        f.seek(self.offset)
        partial = b""
        try:
            while not self.stop_flag:
                data = f.read(1 << 20)
                now = time.monotonic()
                if data:
                    partial += data
                    if b"\n" in partial:
                        *full, partial = partial.split(b"\n")
                        with self.lock:
                            for text in full:
                                self.lines.append(Line(now, text.rstrip(b"\r")))
                    continue
                if ino is not None:
                    r, _, _ = select.select([ino], [], [], 0.05)
                    if r:
                        try:
                            os.read(ino, 65536)
                        except BlockingIOError:
                            pass
                else:
                    time.sleep(0.0005)
        finally:
            f.close()
            if ino is not None:
                os.close(ino)

    def snapshot(self):
        with self.lock:
            return list(self.lines)

    def count(self):
        with self.lock:
            return len(self.lines)

    def since(self, index):
        with self.lock:
            return self.lines[index:]

    def wait_for(self, pattern, start_index=0, timeout=120.0, what=None, alive=None):
        """Waits for a line matching `pattern` (bytes regex) at or after start_index.
        Returns (index, Line, match). `alive()`, checked every second, returns why the guest
        is gone (or None while it runs): waiting on a dead guest fails at once."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        next_check = time.monotonic() + 1.0
        i = start_index
        while True:
            with self.lock:
                n = len(self.lines)
                while i < n:
                    m = rx.search(self.lines[i].text)
                    if m:
                        return i, self.lines[i], m
                    i += 1
            if alive and time.monotonic() > next_check:
                next_check = time.monotonic() + 1.0
                gone = alive()
                if gone:
                    raise RuntimeError(f"waiting for {what or pattern!r}: {gone}")
            if time.monotonic() > deadline:
                tail = b"\n".join(l.text for l in self.snapshot()[-8:]).decode(errors="replace")
                raise TimeoutError(
                    f"{what or pattern!r} not seen on the serial console within {timeout:.0f} s;"
                    f" last lines:\n{tail}"
                )
            time.sleep(0.01)

    def close(self):
        self.stop_flag = True
        self.thread.join(timeout=2)


def stall_lines(lines):
    """(arrival, seq, t_us, max_us) for each stall-meter line."""
    out = []
    for ln in lines:
        m = STALL_RE.search(ln.text)
        if m:
            out.append((ln.t, int(m.group(1)), int(m.group(2)), int(m.group(3))))
    return out


def ticks(lines):
    out = []
    for ln in lines:
        m = TICK_RE.search(ln.text)
        if m:
            out.append((ln.t, int(m.group(1)), int(m.group(2))))
    return out
