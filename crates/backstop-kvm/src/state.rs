//! vCPU and VM state: what KVM holds for a paused VM, captured with the `KVM_GET_*` ioctls,
//! stored as state-file sections and put back with the `KVM_SET_*` ioctls.
//!
//! Every piece is stored as the kernel's own struct bytes (x86-64, little-endian), checked for
//! exact length on decode. Save and restore orders follow Firecracker's (`mp_state` first on save
//! because reading it flushes pending events; CPUID before everything on restore because MSRs
//! and XSAVE are checked against it).

use kvm_bindings::{
    kvm_clock_data, kvm_cpuid_entry2, kvm_debugregs, kvm_fpu, kvm_irqchip, kvm_lapic_state,
    kvm_mp_state, kvm_msr_entry, kvm_pit_state2, kvm_regs, kvm_sregs, kvm_vcpu_events, kvm_xcrs,
    kvm_xsave, CpuId, Msrs, KVM_MAX_CPUID_ENTRIES, KVM_MAX_MSR_ENTRIES,
};
use kvm_ioctls::{VcpuFd, VmFd};
use zerocopy::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

use crate::format::{
    decode_array, decode_exact, StateFileError, StateFileWriter, VerifiedStateFile,
};

/// Section tags of the state file. Per-vCPU sections carry the vCPU index; irqchip sections the
/// chip id (0 PIC master, 1 PIC slave, 2 IOAPIC); all others index 0.
pub mod tag {
    pub const META: u32 = 0x01;
    pub const DEVICES: u32 = 0x02;
    pub const VM_CLOCK: u32 = 0x03;
    pub const IRQCHIP: u32 = 0x04;
    pub const PIT2: u32 = 0x05;
    pub const CPUID: u32 = 0x10;
    pub const REGS: u32 = 0x11;
    pub const SREGS: u32 = 0x12;
    pub const FPU: u32 = 0x13;
    pub const XSAVE: u32 = 0x14;
    pub const XCRS: u32 = 0x15;
    pub const DEBUGREGS: u32 = 0x16;
    pub const MSRS: u32 = 0x17;
    pub const LAPIC: u32 = 0x18;
    pub const EVENTS: u32 = 0x19;
    pub const MP_STATE: u32 = 0x1a;

    /// A readable name for a tag (reports and test messages).
    pub fn name(tag: u32) -> &'static str {
        match tag {
            META => "meta",
            DEVICES => "devices",
            VM_CLOCK => "clock",
            IRQCHIP => "irqchip",
            PIT2 => "pit2",
            CPUID => "cpuid",
            REGS => "regs",
            SREGS => "sregs",
            FPU => "fpu",
            XSAVE => "xsave",
            XCRS => "xcrs",
            DEBUGREGS => "debugregs",
            MSRS => "msrs",
            LAPIC => "lapic",
            EVENTS => "vcpu_events",
            MP_STATE => "mp_state",
            _ => "unknown",
        }
    }
}

/// A KVM ioctl that failed while saving or loading state.
#[derive(Debug, thiserror::Error)]
#[error("{step}: {source}")]
pub struct IoctlError {
    pub step: &'static str,
    #[source]
    pub source: kvm_ioctls::Error,
}

fn ioctl<T>(step: &'static str, r: Result<T, kvm_ioctls::Error>) -> Result<T, IoctlError> {
    r.map_err(|source| IoctlError { step, source })
}

/// `kvm_fpu` as stored (the bindings give it no byte-level traits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct FpuRecord {
    pub fpr: [[u8; 16]; 8],
    pub fcw: U16,
    pub fsw: U16,
    pub ftwx: u8,
    pub pad1: u8,
    pub last_opcode: U16,
    pub last_ip: U64,
    pub last_dp: U64,
    pub xmm: [[u8; 16]; 16],
    pub mxcsr: U32,
    pub pad2: U32,
}

impl From<&kvm_fpu> for FpuRecord {
    fn from(f: &kvm_fpu) -> Self {
        Self {
            fpr: f.fpr,
            fcw: U16::new(f.fcw),
            fsw: U16::new(f.fsw),
            ftwx: f.ftwx,
            pad1: f.pad1,
            last_opcode: U16::new(f.last_opcode),
            last_ip: U64::new(f.last_ip),
            last_dp: U64::new(f.last_dp),
            xmm: f.xmm,
            mxcsr: U32::new(f.mxcsr),
            pad2: U32::new(f.pad2),
        }
    }
}

impl From<&FpuRecord> for kvm_fpu {
    fn from(f: &FpuRecord) -> Self {
        Self {
            fpr: f.fpr,
            fcw: f.fcw.get(),
            fsw: f.fsw.get(),
            ftwx: f.ftwx,
            pad1: f.pad1,
            last_opcode: f.last_opcode.get(),
            last_ip: f.last_ip.get(),
            last_dp: f.last_dp.get(),
            xmm: f.xmm,
            mxcsr: f.mxcsr.get(),
            pad2: f.pad2.get(),
        }
    }
}

/// What this host's KVM offers for vCPU state, decided once per VM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VcpuCaps {
    /// `KVM_GET/SET_XSAVE` with the legacy 4 KiB area (the host needs no more).
    pub xsave: bool,
    pub xcrs: bool,
    /// LAPIC state exists only with the in-kernel irqchip.
    pub lapic: bool,
    /// MSRs from `KVM_GET_MSR_INDEX_LIST` that this vCPU can both read and write back.
    pub msr_indices: Vec<u32>,
}

/// Everything KVM holds for one vCPU.
pub struct VcpuState {
    pub cpuid: Vec<kvm_cpuid_entry2>,
    pub mp_state: kvm_mp_state,
    pub regs: kvm_regs,
    pub sregs: kvm_sregs,
    pub fpu: FpuRecord,
    pub xsave: Option<kvm_xsave>,
    pub xcrs: Option<kvm_xcrs>,
    pub debugregs: kvm_debugregs,
    pub lapic: Option<kvm_lapic_state>,
    pub msrs: Vec<kvm_msr_entry>,
    pub events: kvm_vcpu_events,
}

impl std::fmt::Debug for VcpuState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VcpuState")
            .field("rip", &self.regs.rip)
            .field("msrs", &self.msrs.len())
            .field("cpuid_entries", &self.cpuid.len())
            .finish_non_exhaustive()
    }
}

/// Reads MSRs in batches; an index the vCPU refuses is skipped (and reported by omission).
pub fn read_msrs(fd: &VcpuFd, indices: &[u32]) -> Result<Vec<kvm_msr_entry>, IoctlError> {
    let mut out = Vec::with_capacity(indices.len());
    let mut pos = 0;
    while pos < indices.len() {
        let batch = &indices[pos..(pos + KVM_MAX_MSR_ENTRIES).min(indices.len())];
        let entries: Vec<kvm_msr_entry> = batch
            .iter()
            .map(|&index| kvm_msr_entry {
                index,
                ..Default::default()
            })
            .collect();
        let mut msrs = ioctl(
            "msrs: build",
            Msrs::from_entries(&entries).map_err(fam_error),
        )?;
        let read = ioctl("KVM_GET_MSRS", fd.get_msrs(&mut msrs))?.min(batch.len());
        out.extend_from_slice(&msrs.as_slice()[..read]);
        pos += read;
        if read < batch.len() {
            pos += 1; // KVM stopped at this index: skip it
        }
    }
    Ok(out)
}

fn fam_error<E>(_: E) -> kvm_ioctls::Error {
    kvm_ioctls::Error::new(libc::E2BIG)
}

/// Writes MSRs; every one must be accepted.
fn write_msrs(fd: &VcpuFd, entries: &[kvm_msr_entry]) -> Result<(), IoctlError> {
    for batch in entries.chunks(KVM_MAX_MSR_ENTRIES) {
        let msrs = ioctl("msrs: build", Msrs::from_entries(batch).map_err(fam_error))?;
        let written = ioctl("KVM_SET_MSRS", fd.set_msrs(&msrs))?;
        if written != batch.len() {
            return Err(IoctlError {
                step: "KVM_SET_MSRS (an MSR was refused)",
                source: kvm_ioctls::Error::new(libc::EINVAL),
            });
        }
    }
    Ok(())
}

/// The MSRs of `candidates` this vCPU can read and write back unchanged: probed one by one so a
/// refused index cannot hide the others.
pub fn probe_msrs(fd: &VcpuFd, candidates: &[u32]) -> Vec<u32> {
    candidates
        .iter()
        .copied()
        .filter(|&index| {
            let Ok(read) = read_msrs(fd, &[index]) else {
                return false;
            };
            read.len() == 1 && write_msrs(fd, &read).is_ok()
        })
        .collect()
}

impl VcpuState {
    /// Saves a paused vCPU.
    pub fn capture(fd: &VcpuFd, caps: &VcpuCaps) -> Result<Self, IoctlError> {
        let mp_state = ioctl("KVM_GET_MP_STATE", fd.get_mp_state())?;
        let cpuid = ioctl("KVM_GET_CPUID2", fd.get_cpuid2(KVM_MAX_CPUID_ENTRIES))?;
        let regs = ioctl("KVM_GET_REGS", fd.get_regs())?;
        let sregs = ioctl("KVM_GET_SREGS", fd.get_sregs())?;
        let fpu = FpuRecord::from(&ioctl("KVM_GET_FPU", fd.get_fpu())?);
        let xsave = if caps.xsave {
            Some(ioctl("KVM_GET_XSAVE", fd.get_xsave())?)
        } else {
            None
        };
        let xcrs = if caps.xcrs {
            Some(ioctl("KVM_GET_XCRS", fd.get_xcrs())?)
        } else {
            None
        };
        let debugregs = ioctl("KVM_GET_DEBUGREGS", fd.get_debug_regs())?;
        let lapic = if caps.lapic {
            Some(ioctl("KVM_GET_LAPIC", fd.get_lapic())?)
        } else {
            None
        };
        let msrs = read_msrs(fd, &caps.msr_indices)?;
        let events = ioctl("KVM_GET_VCPU_EVENTS", fd.get_vcpu_events())?;
        Ok(Self {
            cpuid: cpuid.as_slice().to_vec(),
            mp_state,
            regs,
            sregs,
            fpu,
            xsave,
            xcrs,
            debugregs,
            lapic,
            msrs,
            events,
        })
    }

    /// Loads this state into a freshly created vCPU.
    pub fn apply(&self, fd: &VcpuFd) -> Result<(), IoctlError> {
        let cpuid = ioctl(
            "cpuid: build",
            CpuId::from_entries(&self.cpuid).map_err(fam_error),
        )?;
        ioctl("KVM_SET_CPUID2", fd.set_cpuid2(&cpuid))?;
        write_msrs(fd, &self.msrs)?;
        ioctl("KVM_SET_SREGS", fd.set_sregs(&self.sregs))?;
        ioctl("KVM_SET_REGS", fd.set_regs(&self.regs))?;
        ioctl("KVM_SET_FPU", fd.set_fpu(&kvm_fpu::from(&self.fpu)))?;
        if let Some(xsave) = &self.xsave {
            // SAFETY: `xsave` is the legacy 4 KiB `kvm_xsave`. It is only captured when KVM
            // reports an XSAVE area of at most 4 KiB (`VcpuCaps::xsave`), and this process
            // enables no dynamic XSTATE features, so KVM reads no byte past the struct.
            ioctl("KVM_SET_XSAVE", unsafe { fd.set_xsave(xsave) })?;
        }
        if let Some(xcrs) = &self.xcrs {
            ioctl("KVM_SET_XCRS", fd.set_xcrs(xcrs))?;
        }
        ioctl("KVM_SET_DEBUGREGS", fd.set_debug_regs(&self.debugregs))?;
        if let Some(lapic) = &self.lapic {
            ioctl("KVM_SET_LAPIC", fd.set_lapic(lapic))?;
        }
        ioctl("KVM_SET_MP_STATE", fd.set_mp_state(self.mp_state))?;
        ioctl("KVM_SET_VCPU_EVENTS", fd.set_vcpu_events(&self.events))?;
        Ok(())
    }

    /// Adds this vCPU's sections to a state file.
    pub fn write_sections(&self, index: u32, w: &mut StateFileWriter) {
        w.push(tag::CPUID, index, self.cpuid.as_slice().as_bytes().to_vec());
        w.push(tag::MP_STATE, index, self.mp_state.as_bytes().to_vec());
        w.push(tag::REGS, index, self.regs.as_bytes().to_vec());
        w.push(tag::SREGS, index, self.sregs.as_bytes().to_vec());
        w.push(tag::FPU, index, self.fpu.as_bytes().to_vec());
        if let Some(x) = &self.xsave {
            w.push(tag::XSAVE, index, x.as_bytes().to_vec());
        }
        if let Some(x) = &self.xcrs {
            w.push(tag::XCRS, index, x.as_bytes().to_vec());
        }
        w.push(tag::DEBUGREGS, index, self.debugregs.as_bytes().to_vec());
        if let Some(l) = &self.lapic {
            w.push(tag::LAPIC, index, l.as_bytes().to_vec());
        }
        w.push(tag::MSRS, index, self.msrs.as_slice().as_bytes().to_vec());
        w.push(tag::EVENTS, index, self.events.as_bytes().to_vec());
    }

    /// Reads vCPU `index` back; `lapic` says whether the VM had an in-kernel irqchip.
    pub fn read_sections(
        file: &VerifiedStateFile,
        index: u32,
        lapic: bool,
    ) -> Result<Self, StateFileError> {
        let cpuid = decode_array(file.require(tag::CPUID, index, "cpuid")?, "cpuid")?;
        let msrs: Vec<kvm_msr_entry> =
            decode_array(file.require(tag::MSRS, index, "msrs")?, "msrs")?;
        if cpuid.len() > KVM_MAX_CPUID_ENTRIES {
            return Err(StateFileError::Malformed("too many cpuid entries".into()));
        }
        let lapic = if lapic {
            Some(decode_exact(
                file.require(tag::LAPIC, index, "lapic")?,
                "lapic",
            )?)
        } else {
            None
        };
        Ok(Self {
            cpuid,
            mp_state: decode_exact(file.require(tag::MP_STATE, index, "mp_state")?, "mp_state")?,
            regs: decode_exact(file.require(tag::REGS, index, "regs")?, "regs")?,
            sregs: decode_exact(file.require(tag::SREGS, index, "sregs")?, "sregs")?,
            fpu: decode_exact(file.require(tag::FPU, index, "fpu")?, "fpu")?,
            xsave: file
                .section(tag::XSAVE, index)
                .map(|b| decode_exact(b, "xsave"))
                .transpose()?,
            xcrs: file
                .section(tag::XCRS, index)
                .map(|b| decode_exact(b, "xcrs"))
                .transpose()?,
            debugregs: decode_exact(
                file.require(tag::DEBUGREGS, index, "debugregs")?,
                "debugregs",
            )?,
            lapic,
            msrs,
            events: decode_exact(
                file.require(tag::EVENTS, index, "vcpu_events")?,
                "vcpu_events",
            )?,
        })
    }
}

/// Everything KVM holds for the VM as a whole.
pub struct VmState {
    pub clock: kvm_clock_data,
    /// PIC master, PIC slave, IOAPIC (with the in-kernel irqchip only).
    pub irqchips: Option<[kvm_irqchip; 3]>,
    pub pit: Option<kvm_pit_state2>,
}

impl std::fmt::Debug for VmState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VmState")
            .field("clock_ns", &self.clock.clock)
            .field("irqchip", &self.irqchips.is_some())
            .field("pit", &self.pit.is_some())
            .finish()
    }
}

impl VmState {
    /// Saves the VM-wide state of a paused VM.
    pub fn capture(vm: &VmFd, irqchip: bool) -> Result<Self, IoctlError> {
        let clock = ioctl("KVM_GET_CLOCK", vm.get_clock())?;
        let (irqchips, pit) = if irqchip {
            let mut chips = [kvm_irqchip::default(); 3];
            for (id, chip) in chips.iter_mut().enumerate() {
                chip.chip_id = id as u32;
                ioctl("KVM_GET_IRQCHIP", vm.get_irqchip(chip))?;
            }
            (Some(chips), Some(ioctl("KVM_GET_PIT2", vm.get_pit2())?))
        } else {
            (None, None)
        };
        Ok(Self {
            clock,
            irqchips,
            pit,
        })
    }

    /// Loads this state into a VM whose irqchip and PIT exist (created before its vCPUs).
    pub fn apply(&self, vm: &VmFd) -> Result<(), IoctlError> {
        if let Some(pit) = &self.pit {
            ioctl("KVM_SET_PIT2", vm.set_pit2(pit))?;
        }
        if let Some(chips) = &self.irqchips {
            for chip in chips {
                ioctl("KVM_SET_IRQCHIP", vm.set_irqchip(chip))?;
            }
        }
        // The guest's clock resumes from the captured time: no KVM_CLOCK_REALTIME adjustment.
        let clock = kvm_clock_data {
            clock: self.clock.clock,
            ..Default::default()
        };
        ioctl("KVM_SET_CLOCK", vm.set_clock(&clock))?;
        Ok(())
    }

    pub fn write_sections(&self, w: &mut StateFileWriter) {
        w.push(tag::VM_CLOCK, 0, self.clock.as_bytes().to_vec());
        if let Some(chips) = &self.irqchips {
            for (id, chip) in chips.iter().enumerate() {
                w.push(tag::IRQCHIP, id as u32, chip.as_bytes().to_vec());
            }
        }
        if let Some(pit) = &self.pit {
            w.push(tag::PIT2, 0, pit.as_bytes().to_vec());
        }
    }

    pub fn read_sections(file: &VerifiedStateFile, irqchip: bool) -> Result<Self, StateFileError> {
        let clock = decode_exact(file.require(tag::VM_CLOCK, 0, "clock")?, "clock")?;
        let (irqchips, pit) = if irqchip {
            let mut chips = [kvm_irqchip::default(); 3];
            for (id, chip) in chips.iter_mut().enumerate() {
                *chip = decode_exact(file.require(tag::IRQCHIP, id as u32, "irqchip")?, "irqchip")?;
                if chip.chip_id != id as u32 {
                    return Err(StateFileError::Malformed(format!(
                        "irqchip section {id} holds chip {}",
                        chip.chip_id
                    )));
                }
            }
            (
                Some(chips),
                Some(decode_exact(file.require(tag::PIT2, 0, "pit2")?, "pit2")?),
            )
        } else {
            (None, None)
        };
        Ok(Self {
            clock,
            irqchips,
            pit,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fpu_record_round_trips_every_field() {
        let mut f = kvm_fpu {
            fcw: 0x37f,
            fsw: 1,
            ftwx: 2,
            pad1: 3,
            last_opcode: 4,
            last_ip: 5,
            last_dp: 6,
            mxcsr: 0x1f80,
            pad2: 7,
            ..Default::default()
        };
        f.fpr[3][5] = 9;
        f.xmm[15][15] = 10;
        let rec = FpuRecord::from(&f);
        assert_eq!(
            std::mem::size_of::<FpuRecord>(),
            std::mem::size_of::<kvm_fpu>()
        );
        let back = kvm_fpu::from(&FpuRecord::read_from_bytes(rec.as_bytes()).unwrap());
        assert_eq!(back, f);
    }

    #[test]
    fn tag_names_are_distinct() {
        let tags = [
            tag::META,
            tag::DEVICES,
            tag::VM_CLOCK,
            tag::IRQCHIP,
            tag::PIT2,
            tag::CPUID,
            tag::REGS,
            tag::SREGS,
            tag::FPU,
            tag::XSAVE,
            tag::XCRS,
            tag::DEBUGREGS,
            tag::MSRS,
            tag::LAPIC,
            tag::EVENTS,
            tag::MP_STATE,
        ];
        let names: std::collections::BTreeSet<_> = tags.iter().map(|&t| tag::name(t)).collect();
        assert_eq!(names.len(), tags.len());
    }
}
