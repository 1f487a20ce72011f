#!/usr/bin/env python3
"""A synthetic QEMU 7.2 migration stream of a 1 GiB guest for store_ingest: 60% zero
pages, 25% random, 15% compressible (text-like), in 64 KiB runs; the layout stream_chunks.rs
parses. Deterministic layout (seed 21), random page contents.

    python3 bench/synthetic_stream.py /var/tmp/stream.bin   # 435 MB
"""
import os, random, struct, sys
out = sys.argv[1]
mem = 1 << 30
random.seed(21)
words = [os.urandom(random.randint(2, 9)).hex().encode() for _ in range(2000)]
def text_page():
    b = bytearray()
    while len(b) < 4096:
        b += random.choice(words) + b" "
    return bytes(b[:4096])
with open(out, "wb") as f:
    f.write(struct.pack(">II", 0x5145564D, 3))
    f.write(b"\x07" + struct.pack(">I", 0) + b"config")  # some preamble noise
    f.write(b"\x01" + struct.pack(">I", 2) + b"\x03ram" + struct.pack(">II", 0, 4))
    f.write(struct.pack(">Q", mem | 0x04) + b"\x06pc.ram" + struct.pack(">Q", mem))
    first = True
    idstr = b"\x06pc.ram"
    for g in range(mem // 65536):
        r = random.random()
        kind = "zero" if r < 0.60 else ("rand" if r < 0.85 else "text")
        for p in range(16):
            addr = g * 65536 + p * 4096
            cont = 0 if first else 0x20
            hdr = lambda fl: struct.pack(">Q", addr | fl | cont) + (idstr if first else b"")
            if kind == "zero":
                f.write(hdr(0x02) + b"\x00")
            elif kind == "rand":
                f.write(hdr(0x08) + os.urandom(4096))
            else:
                f.write(hdr(0x08) + text_page())
            first = False
    f.write(struct.pack(">Q", 0x10))
    f.write(b"\x03" + struct.pack(">I", 2))
    f.write(os.urandom(300000))  # device state
    f.write(b"\x00")
