//! The device model: everything the guest can reach, all on I/O ports.
//!
//! - a 16550-style serial port at 0x3f8 (transmit only: the host collects what the guest writes;
//!   the line status register always says "transmitter empty"; no interrupts);
//! - a heartbeat port (0x510): the guest writes a 32-bit value, the host notes it and the time;
//! - an exit port (0x511): a write ends the guest with that byte as its status;
//! - an epoch port (0x512): reads give the low byte of the rollback epoch the host announced.
//!
//! Reads of any other port return all ones and writes are ignored, like an empty ISA bus.
//! Guest-visible state (registers, counters, epoch) is [`DeviceState`]; what the host collected
//! (serial output, heartbeat times) is not guest state and is not captured.

use std::collections::VecDeque;
use std::time::Instant;

use zerocopy::little_endian::{U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

use crate::guest::{EPOCH_PORT, EXIT_PORT, HEARTBEAT_PORT, SERIAL_PORT_BASE};

/// Serial output kept by the host (older bytes are dropped).
pub const SERIAL_KEEP_BYTES: usize = 1 << 20;
const NO_EXIT: u32 = u32::MAX;
const LCR_DLAB: u8 = 0x80;
const LSR_THR_EMPTY: u8 = 0x60;
const IIR_NO_INTERRUPT: u8 = 0x01;

/// Guest-visible device state, as stored in a snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct DeviceState {
    /// Serial registers: IER, FCR, LCR, MCR, SCR, DLL, DLM, reserved.
    pub serial_regs: [u8; 8],
    pub heartbeat_count: U64,
    pub last_heartbeat: U32,
    /// Exit status written by the guest, or `u32::MAX` while it runs.
    pub exit_status: U32,
    pub epoch: U64,
    pub serial_bytes_out: U64,
}

impl Default for DeviceState {
    fn default() -> Self {
        Self {
            serial_regs: [0, 0, 0x03, 0, 0, 0x01, 0, 0],
            heartbeat_count: U64::new(0),
            last_heartbeat: U32::new(0),
            exit_status: U32::new(NO_EXIT),
            epoch: U64::new(0),
            serial_bytes_out: U64::new(0),
        }
    }
}

/// What the vCPU loop does after an I/O exit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoAction {
    Continue,
    /// The guest wrote the exit port.
    GuestExited(u8),
}

/// The device model of one VM.
#[derive(Debug)]
pub struct Devices {
    state: DeviceState,
    serial_out: VecDeque<u8>,
    last_heartbeat_at: Option<Instant>,
    /// Heartbeats seen by this instance (host-side; not guest state).
    heartbeats_seen: u64,
    /// Heartbeat writes refused (not exactly 4 bytes).
    heartbeats_rejected: u64,
}

impl Devices {
    pub fn new() -> Self {
        Self::from_state(DeviceState::default())
    }

    /// Devices as captured; host-side collections start empty.
    pub fn from_state(state: DeviceState) -> Self {
        Self {
            state,
            serial_out: VecDeque::new(),
            last_heartbeat_at: None,
            heartbeats_seen: 0,
            heartbeats_rejected: 0,
        }
    }

    pub fn state(&self) -> DeviceState {
        self.state
    }

    /// A guest `out`.
    pub fn io_out(&mut self, port: u16, data: &[u8]) -> IoAction {
        let Some(&byte) = data.first() else {
            return IoAction::Continue;
        };
        match port {
            p if (SERIAL_PORT_BASE..SERIAL_PORT_BASE + 8).contains(&p) => {
                self.serial_write((p - SERIAL_PORT_BASE) as u8, byte);
            }
            HEARTBEAT_PORT => match <[u8; 4]>::try_from(data) {
                Ok(word) => {
                    self.state.last_heartbeat = U32::new(u32::from_le_bytes(word));
                    self.state.heartbeat_count += 1;
                    self.heartbeats_seen += 1;
                    self.last_heartbeat_at = Some(Instant::now());
                }
                Err(_) => self.heartbeats_rejected += 1,
            },
            EXIT_PORT => {
                self.state.exit_status = U32::new(u32::from(byte));
                return IoAction::GuestExited(byte);
            }
            _ => {}
        }
        IoAction::Continue
    }

    /// A guest `in`.
    pub fn io_in(&mut self, port: u16, data: &mut [u8]) {
        let value = match port {
            p if (SERIAL_PORT_BASE..SERIAL_PORT_BASE + 8).contains(&p) => {
                self.serial_read((p - SERIAL_PORT_BASE) as u8)
            }
            EPOCH_PORT => self.state.epoch.get() as u8,
            _ => {
                data.fill(0xff);
                return;
            }
        };
        data.fill(0);
        if let Some(first) = data.first_mut() {
            *first = value;
        }
    }

    fn dlab(&self) -> bool {
        self.state.serial_regs[2] & LCR_DLAB != 0
    }

    fn serial_write(&mut self, offset: u8, byte: u8) {
        let regs = &mut self.state.serial_regs;
        match (offset, regs[2] & LCR_DLAB != 0) {
            (0, false) => {
                self.state.serial_bytes_out += 1;
                if self.serial_out.len() == SERIAL_KEEP_BYTES {
                    self.serial_out.pop_front();
                }
                self.serial_out.push_back(byte);
            }
            (0, true) => regs[5] = byte,
            (1, false) => regs[0] = byte & 0x0f,
            (1, true) => regs[6] = byte,
            (2, _) => regs[1] = byte,
            (3, _) => regs[2] = byte,
            (4, _) => regs[3] = byte & 0x1f,
            (7, _) => regs[4] = byte,
            _ => {}
        }
    }

    fn serial_read(&self, offset: u8) -> u8 {
        let regs = &self.state.serial_regs;
        match (offset, self.dlab()) {
            (0, false) => 0,
            (0, true) => regs[5],
            (1, false) => regs[0],
            (1, true) => regs[6],
            (2, _) => IIR_NO_INTERRUPT,
            (3, _) => regs[2],
            (4, _) => regs[3],
            (5, _) => LSR_THR_EMPTY,
            (6, _) => 0xb0,
            _ => regs[4],
        }
    }

    /// Serial output collected so far (the newest [`SERIAL_KEEP_BYTES`]).
    pub fn serial_output(&self) -> Vec<u8> {
        self.serial_out.iter().copied().collect()
    }

    /// Removes and returns the collected serial output.
    pub fn take_serial_output(&mut self) -> Vec<u8> {
        self.serial_out.drain(..).collect()
    }

    /// Heartbeats this instance saw, and heartbeat writes it refused (wrong width).
    pub fn heartbeat_counts(&self) -> (u64, u64) {
        (self.heartbeats_seen, self.heartbeats_rejected)
    }

    /// When the guest last wrote the heartbeat port (host clock).
    pub fn last_heartbeat_at(&self) -> Option<Instant> {
        self.last_heartbeat_at
    }

    /// The guest's exit status, once it wrote the exit port.
    pub fn exit_status(&self) -> Option<u8> {
        let s = self.state.exit_status.get();
        (s != NO_EXIT).then_some(s as u8)
    }

    /// Announces a new rollback epoch to the guest.
    pub fn set_epoch(&mut self, epoch: u64) {
        self.state.epoch = U64::new(epoch);
    }
}

impl Default for Devices {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serial_collects_thr_writes_only_without_dlab() {
        let mut d = Devices::new();
        d.io_out(0x3f8, b"h");
        d.io_out(0x3fb, &[0x83]); // DLAB on
        d.io_out(0x3f8, &[0x0c]); // divisor latch, not output
        d.io_out(0x3fb, &[0x03]);
        d.io_out(0x3f8, b"i");
        assert_eq!(d.serial_output(), b"hi");
        let mut lsr = [0u8; 1];
        d.io_in(0x3fd, &mut lsr);
        assert_eq!(lsr[0], LSR_THR_EMPTY);
        assert_eq!(d.state().serial_regs[5], 0x0c);
        assert_eq!(d.state().serial_bytes_out.get(), 2);
    }

    #[test]
    fn heartbeat_exit_epoch_and_unknown_ports() {
        let mut d = Devices::new();
        assert_eq!(
            d.io_out(HEARTBEAT_PORT, &7u32.to_le_bytes()),
            IoAction::Continue
        );
        assert_eq!(d.state().last_heartbeat.get(), 7);
        assert_eq!(d.state().heartbeat_count.get(), 1);
        assert!(d.last_heartbeat_at().is_some());
        d.io_out(HEARTBEAT_PORT, &[1]);
        assert_eq!(d.heartbeat_counts(), (1, 1));
        d.set_epoch(0x102);
        let mut b = [0u8; 1];
        d.io_in(EPOCH_PORT, &mut b);
        assert_eq!(b[0], 2);
        let mut w = [0u8; 2];
        d.io_in(0x60, &mut w);
        assert_eq!(w, [0xff, 0xff]);
        assert_eq!(d.exit_status(), None);
        assert_eq!(d.io_out(EXIT_PORT, &[3]), IoAction::GuestExited(3));
        assert_eq!(d.exit_status(), Some(3));
    }

    #[test]
    fn state_round_trips_through_bytes() {
        let mut d = Devices::new();
        d.io_out(HEARTBEAT_PORT, &9u32.to_le_bytes());
        d.io_out(0x3ff, &[0x5a]);
        let bytes = d.state().as_bytes().to_vec();
        let back = Devices::from_state(DeviceState::read_from_bytes(&bytes).unwrap());
        assert_eq!(back.state().as_bytes(), bytes.as_slice());
    }
}
