#!/usr/bin/env python3
"""Writes the seed corpus fuzz/corpus/<target>/ from the formats' own unit-test examples.

Run from anywhere: `python3 fuzz/make_corpus.py`. The seeds are small valid inputs (plus a few
near misses); the fuzzer mutates from there. Canonical JSON is spec/003 section 4 (sorted keys,
no whitespace, non-integers with 9 decimals), as backstop-integrity writes it.
"""
import hashlib
import hmac
import json
import os
import struct

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")


def canonical(v):
    if isinstance(v, dict):
        return "{" + ",".join(json.dumps(k) + ":" + canonical(v[k]) for k in sorted(v)) + "}"
    if isinstance(v, list):
        return "[" + ",".join(canonical(x) for x in v) + "]"
    if isinstance(v, bool) or v is None or isinstance(v, int) or isinstance(v, str):
        return json.dumps(v)
    return "%.9f" % v


def write(target, name, data):
    d = os.path.join(ROOT, target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


# control_envelope: request lines from backstop-control's unit tests.
for i, line in enumerate([
    '{"op":"status"}',
    '{"op":"snapshot_list","version":2,"vm":"web1"}',
    '{"op":"vms","version":2}',
    '{"op":"snapshot_create","reason":"before upgrade","version":2,"vm":"web1"}',
    '{"op":"rollback","to":"ab","reason":"x","emergency":true}',
    '{"op":"rollback","to":"0123456789abcdef0123456789abcdef","reason":"r","rollback_type":"session",'
    '"reviewer_token":{"snapshot_id":"0123456789abcdef0123456789abcdef","reviewer":"alice",'
    '"expires_at":"2026-05-01T12:00:00Z","hmac":"' + "ab" * 32 + '"},"allow_newer_minor":true}',
    '{"op":"device_grant","ids":["tablet","mic"],"lease_s":60,"reason":"r"}',
    '{"op":"trigger","kind":"FORCE_ROLLBACK","reason":"policy","action_ids":["a1"]}',
    '{"op":"action_begin","descriptor":{"action_id":"a1","kind":"package_install"}}',
    '{"op":"action_end","action_id":"a","result":"failed","reason":"it broke"}',
    '{"op":"audit_tail","count":20}',
    '{"op":"status","version":3}',
]):
    write("control_envelope", "seed-%02d" % i, line + "\n")

# qmp_line: byte 0 is the id being waited for, then QMP lines as QEMU sends them.
write("qmp_line", "greeting", b"\x01" + b'{"QMP":{"version":{"qemu":{"micro":0,"minor":2,"major":7},'
      b'"package":""},"capabilities":["oob"]}}\r\n{"return":{},"id":1}\r\n')
write("qmp_line", "event-then-reply", b"\x02" + b'{"event":"STOP","timestamp":{"seconds":1,"microseconds":2}}\r\n'
      b'{"return":{},"id":2}\r\n')
write("qmp_line", "error", b"\x03" + b'{"error":{"class":"GenericError","desc":"nope"},"id":3}\r\n[1,2]\r\n')
write("qmp_line", "query-version", b"\x04" + b'{"return":{"qemu":{"major":10,"minor":0,"micro":2},"package":""},"id":4}\r\n')
write("qmp_line", "query-migrate", b"\x05" + b'{"return":{"status":"active","ram":{"normal":12,"duplicate":3}},"id":5}\r\n'
      b'{"event":"MIGRATION","data":{"status":"completed"},"timestamp":{"seconds":1700000000,"microseconds":999999}}\n')

# guest_line: byte 0 seeds the chunking, then what a guest sends.
write("guest_line", "heartbeats", b"\x07HB 1\nHB 2\nHB 18446744073709551615\n")
write("guest_line", "junk", b"\x2aHB 1\ngarbage\x00\xff\nHB -1\n HB 1\nHB 18446744073709551616\nHB 12")
write("guest_line", "long", b"\x03HB " + b"7" * 70 + b"\nHB 5\n" + b"x" * 63 + b"\n")

# qga_reply: byte 0 seeds the chunking, then what qemu-ga (or a hostile guest) answers.
write("qga_reply", "pongs", b"\x07" + b'{"return": {}, "id": "bs-1"}\n{"return": {}, "id": "bs-2"}\n'
      b'{"error": {"class": "CommandNotFound", "desc": "x"}, "id": "bs-time-3"}\n')
write("qga_reply", "junk", b"\x2a" + b'{"return": {}}\n{"return": {"a": 1}, "id": "bs-1"}\n\xff\xff{\n'
      b'{"return": {}, "id": "bs-1", "x": 0}\n[1,2]\n{"return": {}, "id": "' + b"9" * 40 + b'"}\n')
write("qga_reply", "long", b"\x03" + b"{" * 600 + b'\n{"return": {}, "id": "bs-5"}\n' + b" " * 511 + b"\n")

# host_line: byte 0 seeds the chunking, then what the host sends backstop-agent.
write("host_line", "epochs", b"\x07EPOCH 1\nEPOCH 18446744073709551615\nEPOCH 3")
write("host_line", "junk", b"\x2aEPOCH -1\nEPOCH 18446744073709551616\n epoch 2\nEPOCH 1 \n\xff\x00\n" + b"9" * 90 + b"\nEPOCH 4\n")

# manifest: the sealed sample of backstop-store's manifest unit tests; byte 0 is the options.
manifest = {
    "snapshot_id": "",
    "created_at": "2026-01-02T03:04:05.678Z",
    "created_by": "tester",
    "schema_version": "1.0",
    "index_version": "1.0",
    "scope": "full",
    "reason": "unit test",
    "checksums": [
        {"ref": "vmstate.index", "sha256": "1" * 64, "crc32": "00000001"},
        {"ref": "disk:root/base.qcow2", "sha256": "2" * 64, "crc32": "00000002"},
    ],
    "payload_refs": [
        {"name": "vmstate", "kind": "ram+device", "index": "vmstate.index", "layers": [],
         "total_bytes": 100, "new_bytes": 40, "chunks": 2},
        {"name": "disk:root", "kind": "disk-layer-chain", "index": None,
         "layers": [{"path": "/var/lib/vm/base.qcow2", "bytes": 7, "sha256": "2" * 64, "crc32": "00000002"}],
         "total_bytes": 7, "new_bytes": 0, "chunks": 0},
    ],
    "vm": "vm1",
    "trigger": "console",
    "epoch": 3,
    "config_fingerprint": "fp",
    "capture": {"pause_us": 3000, "ratio": 0.25},
    "bytes_stored": 40,
}
manifest["snapshot_id"] = hashlib.sha256(canonical(manifest).encode()).hexdigest()[:32]
write("manifest", "sealed", b"\x00" + canonical(manifest).encode())
newer = dict(manifest, schema_version="1.3", snapshot_id="")
newer["snapshot_id"] = hashlib.sha256(canonical(newer).encode()).hexdigest()[:32]
write("manifest", "newer-minor", b"\x01" + canonical(newer).encode())
write("manifest", "not-object", b"\x00[1,2,3]")

# chunk_index: the sample of backstop-store's index unit tests.
index = {"chunks": [{"sha256": "a" * 64, "crc32": "0123abcd", "len": 10},
                    {"sha256": "b" * 64, "crc32": "ffffffff", "len": 5}], "total_bytes": 15}
write("chunk_index", "sample", canonical(index))
write("chunk_index", "empty", canonical({"chunks": [], "total_bytes": 0}))
write("chunk_index", "bad-total", canonical(dict(index, total_bytes=16)))

# journal_line: a sealed entry as backstop-journal's unit tests make it (key [3; 32]).
def entry(seq, event, fields, prev):
    e = {"event": event, "fields": fields, "prev": prev, "seq": seq, "ts": "2026-11-22T10:00:00.123Z"}
    e["hash"] = hashlib.sha256(canonical(e).encode()).hexdigest()
    e["mac"] = hmac.new(bytes([3] * 32), e["hash"].encode(), hashlib.sha256).hexdigest()
    return e

e1 = entry(1, "vm.started", {"snapshot_id": "s1", "n": 2}, "0" * 64)
e2 = entry(2, "snapshot.created", {"f": 0.1, "list": [1, 2, 3], "nested": {"a": None}}, e1["hash"])
write("journal_line", "entry-1", canonical(e1))
write("journal_line", "entry-2", canonical(e2))
write("journal_line", "spaced", canonical(e1).replace(":", ": ", 1))
write("journal_line", "seq-0", canonical(dict(e1, seq=0)))

# stream_cutter: byte 0 picks the page size (0: 512 B), byte 1 seeds the read sizes, then a
# small QEMU 7.2 migration stream shaped like the unit tests' synthetic one.
def stream(page):
    sid = struct.pack(">I", 2)
    b = b"QEVM\x00\x00\x00\x03\x07\x00\x00\x00\x0cpc-i440fx-7.2"
    b += b"\x01" + sid + b"\x03ram" + struct.pack(">II", 0, 4)
    total = 16 * page
    b += struct.pack(">Q", total | 0x04)
    b += bytes([6]) + b"pc.ram" + struct.pack(">Q", total)
    b += struct.pack(">Q", 0x10) + b"\x7e" + sid
    b += b"\x03" + sid
    for i in range(16):
        flags = (0x08 if i % 3 else 0x02) | (0x20 if i else 0)
        b += struct.pack(">Q", i * page | flags)
        if not i:
            b += bytes([6]) + b"pc.ram"
        b += bytes([i]) * page if flags & 0x08 else b"\x00"
    b += struct.pack(">Q", 0x10) + b"\x7e" + sid
    b += b"\x04device state" * 8
    return b

write("stream_cutter", "ram-512", b"\x00\x05" + stream(512))
write("stream_cutter", "ram-1k-pieces", b"\x01\x33" + stream(1024))
write("stream_cutter", "no-ram-section", b"\x00\x01QEVM\x00\x00\x00\x03" + b"\xab" * 300)
