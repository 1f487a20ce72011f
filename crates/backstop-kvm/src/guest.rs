//! The built-in guest program: a counter that dirties pages in a known pattern.
//!
//! Source: `guest/counter.s` (GNU as syntax). The bytes below are that file assembled, one
//! instruction per line with its offset and disassembly; `guest_bytes_match_source` checks them
//! against the source whenever GNU `as` is installed. The program runs in 32-bit protected mode
//! with flat segments, no paging and interrupts off; it talks to the VMM only through I/O ports.

use serde::{Deserialize, Serialize};

/// Guest-physical address of the parameter block the VMM fills in before the first run.
pub const PARAMS_GPA: u64 = 0x1000;
/// Guest-physical address of the program's counters (`tick`, `cursor`, `writes`, u32 each).
pub const COUNTERS_GPA: u64 = 0x2000;
/// Top of the program's stack (it grows down into page 6).
pub const STACK_TOP_GPA: u64 = 0x7000;
/// Where the program is loaded and entered.
pub const CODE_GPA: u64 = 0x8000;
/// Default start of the dirty area: 1 MiB, above everything else the program uses.
pub const DEFAULT_DIRTY_BASE_GPA: u64 = 0x10_0000;
/// `BSTP`, little-endian, at offset 0 of the parameter block.
pub const PARAMS_MAGIC: u32 = 0x5054_5342;

/// Serial port (COM1 base); the program only writes THR.
pub const SERIAL_PORT_BASE: u16 = 0x3f8;
/// The program writes its tick (u32) here once per tick.
pub const HEARTBEAT_PORT: u16 = 0x510;
/// Any write ends the guest (the byte is its exit status).
pub const EXIT_PORT: u16 = 0x511;
/// Reads return the low byte of the rollback epoch the host last announced.
pub const EPOCH_PORT: u16 = 0x512;

/// What the program does each tick. Written into the parameter block at [`PARAMS_GPA`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GuestProgramConfig {
    /// Pages written per tick (0 = none).
    pub dirty_pages_per_tick: u32,
    /// Guest-physical address of the first page of the dirty area (page aligned).
    pub dirty_base_gpa: u32,
    /// Pages in the dirty area; the program cycles through them.
    pub dirty_span_pages: u32,
    /// Ticks after which the program writes the exit port (0 = run forever).
    pub max_ticks: u32,
    /// Busy-loop iterations between ticks (~2 instructions each).
    pub tick_delay_loops: u32,
}

impl Default for GuestProgramConfig {
    fn default() -> Self {
        Self {
            dirty_pages_per_tick: 16,
            dirty_base_gpa: DEFAULT_DIRTY_BASE_GPA as u32,
            dirty_span_pages: 256,
            max_ticks: 0,
            tick_delay_loops: 20_000,
        }
    }
}

impl GuestProgramConfig {
    /// The parameter block as the program reads it (six little-endian u32).
    pub fn to_param_block(&self) -> [u8; 24] {
        let words = [
            PARAMS_MAGIC,
            self.dirty_pages_per_tick,
            self.dirty_base_gpa,
            self.dirty_span_pages,
            self.max_ticks,
            self.tick_delay_loops,
        ];
        let mut out = [0u8; 24];
        for (chunk, word) in out.chunks_exact_mut(4).zip(words) {
            chunk.copy_from_slice(&word.to_le_bytes());
        }
        out
    }

    /// Guest-physical end (exclusive) of the dirty area.
    pub fn dirty_end_gpa(&self) -> u64 {
        u64::from(self.dirty_base_gpa) + u64::from(self.dirty_span_pages) * 4096
    }
}

/// One line the program printed: `T<tick> W<writes>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TickReport {
    pub tick: u32,
    pub writes: u32,
}

impl TickReport {
    /// Parses `T0000002a W000002a0`; anything else is `None`.
    pub fn parse(line: &str) -> Option<Self> {
        let (t, w) = line.trim_end().split_once(' ')?;
        let hex8 = |s: &str| {
            (s.len() == 8)
                .then(|| u32::from_str_radix(s, 16).ok())
                .flatten()
        };
        let tick = hex8(t.strip_prefix('T')?)?;
        let writes = hex8(w.strip_prefix('W')?)?;
        Some(Self { tick, writes })
    }
}

/// The program, assembled from `guest/counter.s`.
#[rustfmt::skip]
pub const COUNTER_PROGRAM: &[u8] = &[
    // start:
    0xbc, 0x00, 0x70, 0x00, 0x00,       // 0x000: mov    $0x7000,%esp
    // tick:
    0xff, 0x05, 0x00, 0x20, 0x00, 0x00, // 0x005: incl   0x2000
    0x8b, 0x0d, 0x04, 0x10, 0x00, 0x00, // 0x00b: mov    0x1004,%ecx
    0x85, 0xc9,                         // 0x011: test   %ecx,%ecx
    0x74, 0x34,                         // 0x013: je     49 <report>
    // dirty:
    0xa1, 0x04, 0x20, 0x00, 0x00,       // 0x015: mov    0x2004,%eax
    0x89, 0xc3,                         // 0x01a: mov    %eax,%ebx
    0xc1, 0xe3, 0x0c,                   // 0x01c: shl    $0xc,%ebx
    0x03, 0x1d, 0x08, 0x10, 0x00, 0x00, // 0x01f: add    0x1008,%ebx
    0x8b, 0x15, 0x00, 0x20, 0x00, 0x00, // 0x025: mov    0x2000,%edx
    0x89, 0x13,                         // 0x02b: mov    %edx,(%ebx)
    0x89, 0x43, 0x04,                   // 0x02d: mov    %eax,0x4(%ebx)
    0x40,                               // 0x030: inc    %eax
    0x3b, 0x05, 0x0c, 0x10, 0x00, 0x00, // 0x031: cmp    0x100c,%eax
    0x72, 0x02,                         // 0x037: jb     3b <dirty+0x26>
    0x31, 0xc0,                         // 0x039: xor    %eax,%eax
    0xa3, 0x04, 0x20, 0x00, 0x00,       // 0x03b: mov    %eax,0x2004
    0xff, 0x05, 0x08, 0x20, 0x00, 0x00, // 0x040: incl   0x2008
    0x49,                               // 0x046: dec    %ecx
    0x75, 0xcc,                         // 0x047: jne    15 <dirty>
    // report:
    0x66, 0xba, 0xf8, 0x03,             // 0x049: mov    $0x3f8,%dx
    0xb0, 0x54,                         // 0x04d: mov    $0x54,%al
    0xee,                               // 0x04f: out    %al,(%dx)
    0x8b, 0x1d, 0x00, 0x20, 0x00, 0x00, // 0x050: mov    0x2000,%ebx
    0xe8, 0x51, 0x00, 0x00, 0x00,       // 0x056: call   ac <hex32>
    0xb0, 0x20,                         // 0x05b: mov    $0x20,%al
    0xee,                               // 0x05d: out    %al,(%dx)
    0xb0, 0x57,                         // 0x05e: mov    $0x57,%al
    0xee,                               // 0x060: out    %al,(%dx)
    0x8b, 0x1d, 0x08, 0x20, 0x00, 0x00, // 0x061: mov    0x2008,%ebx
    0xe8, 0x40, 0x00, 0x00, 0x00,       // 0x067: call   ac <hex32>
    0xb0, 0x0a,                         // 0x06c: mov    $0xa,%al
    0xee,                               // 0x06e: out    %al,(%dx)
    0x66, 0xba, 0x10, 0x05,             // 0x06f: mov    $0x510,%dx
    0xa1, 0x00, 0x20, 0x00, 0x00,       // 0x073: mov    0x2000,%eax
    0xef,                               // 0x078: out    %eax,(%dx)
    0xa1, 0x10, 0x10, 0x00, 0x00,       // 0x079: mov    0x1010,%eax
    0x85, 0xc0,                         // 0x07e: test   %eax,%eax
    0x74, 0x14,                         // 0x080: je     96 <delay>
    0x3b, 0x05, 0x00, 0x20, 0x00, 0x00, // 0x082: cmp    0x2000,%eax
    0x77, 0x0c,                         // 0x088: ja     96 <delay>
    0x66, 0xba, 0x11, 0x05,             // 0x08a: mov    $0x511,%dx
    0x31, 0xc0,                         // 0x08e: xor    %eax,%eax
    0xee,                               // 0x090: out    %al,(%dx)
    0xe9, 0x6f, 0xff, 0xff, 0xff,       // 0x091: jmp    5 <tick>
    // delay:
    0x8b, 0x0d, 0x14, 0x10, 0x00, 0x00, // 0x096: mov    0x1014,%ecx
    0x85, 0xc9,                         // 0x09c: test   %ecx,%ecx
    0x0f, 0x84, 0x61, 0xff, 0xff, 0xff, // 0x09e: je     5 <tick>
    0x49,                               // 0x0a4: dec    %ecx
    0x75, 0xfd,                         // 0x0a5: jne    a4 <delay+0xe>
    0xe9, 0x59, 0xff, 0xff, 0xff,       // 0x0a7: jmp    5 <tick>
    // hex32:
    0xbe, 0x08, 0x00, 0x00, 0x00,       // 0x0ac: mov    $0x8,%esi
    0xc1, 0xc3, 0x04,                   // 0x0b1: rol    $0x4,%ebx
    0x88, 0xd8,                         // 0x0b4: mov    %bl,%al
    0x24, 0x0f,                         // 0x0b6: and    $0xf,%al
    0x3c, 0x0a,                         // 0x0b8: cmp    $0xa,%al
    0x72, 0x02,                         // 0x0ba: jb     be <hex32+0x12>
    0x04, 0x27,                         // 0x0bc: add    $0x27,%al
    0x04, 0x30,                         // 0x0be: add    $0x30,%al
    0xee,                               // 0x0c0: out    %al,(%dx)
    0x4e,                               // 0x0c1: dec    %esi
    0x75, 0xed,                         // 0x0c2: jne    b1 <hex32+0x5>
    0xc3,                               // 0x0c4: ret
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guest_bytes_match_source() {
        let Ok(dir) = tempfile::tempdir() else { return };
        let src = concat!(env!("CARGO_MANIFEST_DIR"), "/guest/counter.s");
        let obj = dir.path().join("counter.o");
        let bin = dir.path().join("counter.bin");
        let assembled = std::process::Command::new("as")
            .args(["--32", src, "-o"])
            .arg(&obj)
            .status();
        if !matches!(assembled, Ok(s) if s.success()) {
            eprintln!("SKIPPED guest_bytes_match_source: GNU as is not installed");
            return;
        }
        let copied = std::process::Command::new("objcopy")
            .args(["-O", "binary"])
            .arg(&obj)
            .arg(&bin)
            .status();
        assert!(matches!(copied, Ok(s) if s.success()), "objcopy failed");
        let bytes = std::fs::read(&bin).unwrap();
        assert_eq!(
            bytes.as_slice(),
            COUNTER_PROGRAM,
            "src/guest.rs is stale: re-assemble"
        );
    }

    #[test]
    fn param_block_layout() {
        let cfg = GuestProgramConfig {
            dirty_pages_per_tick: 1,
            dirty_base_gpa: 0x10_0000,
            dirty_span_pages: 3,
            max_ticks: 4,
            tick_delay_loops: 5,
        };
        let block = cfg.to_param_block();
        assert_eq!(&block[0..4], b"BSTP");
        assert_eq!(
            u32::from_le_bytes([block[4], block[5], block[6], block[7]]),
            1
        );
        assert_eq!(
            u32::from_le_bytes([block[20], block[21], block[22], block[23]]),
            5
        );
        assert_eq!(cfg.dirty_end_gpa(), 0x10_3000);
    }

    #[test]
    fn tick_report_parses_only_its_own_lines() {
        assert_eq!(
            TickReport::parse("T0000002a W000002a0\n"),
            Some(TickReport {
                tick: 42,
                writes: 672
            })
        );
        assert_eq!(TickReport::parse("hello"), None);
        assert_eq!(TickReport::parse("Tzz W1"), None);
        // A line caught half-printed is not a report of 0 writes.
        assert_eq!(TickReport::parse("T0000002a W0000"), None);
        assert_eq!(TickReport::parse("T0000002a W000002a00"), None);
    }
}
