//! The micro-VM: guest RAM with dirty logging, in-kernel irqchip and PIT where KVM has them,
//! vCPU threads, the port-I/O device model and the built-in guest program.

use backstop_common::ErrorCode;
use std::fs::File;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvm_bindings::{
    kvm_pit_config, kvm_regs, kvm_segment, kvm_userspace_memory_region, CpuId,
    KVM_MAX_CPUID_ENTRIES, KVM_MEM_LOG_DIRTY_PAGES, KVM_PIT_SPEAKER_DUMMY,
};
use kvm_ioctls::{Cap, Kvm, VcpuFd, VmFd};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use vm_memory::{Bytes, GuestAddress};

use crate::devices::{DeviceState, Devices};
use crate::guest::{
    GuestProgramConfig, TickReport, CODE_GPA, COUNTER_PROGRAM, PARAMS_GPA, STACK_TOP_GPA,
};
use crate::memory::{self, GuestMem, MemoryError, MemoryLayout, PageBitmap, PAGE_SIZE};
use crate::state::{probe_msrs, IoctlError, VcpuCaps};
use crate::vcpu::{lock, VcpuRunner, VcpuStop};

/// Guest-physical address KVM uses for the TSS it needs on Intel (three pages below 4 GiB, inside
/// the MMIO gap, like Firecracker).
const TSS_GPA: usize = 0xfffb_d000;
/// Most vCPUs a VM may have.
pub const MAX_VCPUS: u32 = 64;

static VMS_CREATED: AtomicU64 = AtomicU64::new(0);

/// How many KVM VMs this process has created (tests use it to prove a refused restore created
/// none).
pub fn vms_created() -> u64 {
    VMS_CREATED.load(Ordering::SeqCst)
}

/// The shape of a micro-VM.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvmVmConfig {
    pub mem_size_mib: u64,
    pub vcpus: u32,
    /// Use the in-kernel irqchip and PIT when KVM offers them.
    pub irqchip: bool,
    pub program: GuestProgramConfig,
}

impl Default for KvmVmConfig {
    fn default() -> Self {
        Self {
            mem_size_mib: 64,
            vcpus: 1,
            irqchip: true,
            program: GuestProgramConfig::default(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error("cannot open /dev/kvm: {0}")]
    OpenKvm(kvm_ioctls::Error),
    #[error(transparent)]
    Ioctl(#[from] IoctlError),
    #[error(transparent)]
    Memory(#[from] MemoryError),
    #[error("invalid VM config: {0}")]
    Config(String),
    #[error("cannot start vCPU thread: {0}")]
    Thread(std::io::Error),
    #[error("vCPU {index} did not pause within {waited:?}")]
    PauseTimeout { index: u32, waited: Duration },
}

impl VmError {
    pub fn code(&self) -> ErrorCode {
        match self {
            VmError::Config(_) => ErrorCode::KvmConfigInvalid,
            _ => ErrorCode::KvmVm,
        }
    }
}

fn ioctl<T>(step: &'static str, r: Result<T, kvm_ioctls::Error>) -> Result<T, IoctlError> {
    r.map_err(|source| IoctlError { step, source })
}

/// Where a VM's dirty tracking is relative to: the last snapshot captured from it or restored
/// into it. A diff capture stores exactly the pages dirtied since then.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lineage {
    pub seq: u64,
    pub state_sha256: String,
}

/// A stop of the guest reported by a vCPU thread.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StopRecord {
    pub vcpu: u32,
    pub stop: VcpuStop,
}

/// A running or paused micro-VM.
///
/// Field order is drop order: vCPU threads end first, then the VM, then guest memory is unmapped.
pub struct KvmVm {
    pub(crate) vcpus: Vec<VcpuRunner>,
    pub(crate) vm: VmFd,
    pub(crate) memory: GuestMem,
    pub(crate) layout: MemoryLayout,
    pub(crate) devices: Arc<Mutex<Devices>>,
    pub(crate) caps: VcpuCaps,
    pub(crate) irqchip: bool,
    pub(crate) stops: Arc<Mutex<Vec<StopRecord>>>,
    pub(crate) lineage: Option<Lineage>,
    /// Pages known dirty but not yet in any snapshot (kept when a capture fails).
    pub(crate) pending_dirty: PageBitmap,
    /// Snapshot files the memory is mapped from: held open as long as the VM lives.
    pub(crate) backing_files: Vec<File>,
    pub(crate) paused: bool,
    pub(crate) config: KvmVmConfig,
}

impl std::fmt::Debug for KvmVm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvmVm")
            .field("config", &self.config)
            .field("irqchip", &self.irqchip)
            .field("paused", &self.paused)
            .field("lineage", &self.lineage)
            .finish_non_exhaustive()
    }
}

/// The VM without vCPUs: KVM handles, memory slots, irqchip, PIT.
pub(crate) struct VmShell {
    pub kvm: Kvm,
    pub vm: VmFd,
    pub irqchip: bool,
}

impl VmShell {
    /// Creates a VM over `memory` (every region a slot with dirty logging) and, when asked and
    /// available, the in-kernel irqchip and PIT.
    pub fn create(
        memory: &GuestMem,
        layout: &MemoryLayout,
        want_irqchip: bool,
    ) -> Result<Self, VmError> {
        let kvm = Kvm::new().map_err(VmError::OpenKvm)?;
        let vm = ioctl("KVM_CREATE_VM", kvm.create_vm())?;
        VMS_CREATED.fetch_add(1, Ordering::SeqCst);
        for (slot, spec) in layout.regions.iter().enumerate() {
            let host = memory::region_host_addr(memory, slot)
                .ok_or_else(|| VmError::Config(format!("memory has no region {slot}")))?;
            let region = kvm_userspace_memory_region {
                slot: slot as u32,
                flags: KVM_MEM_LOG_DIRTY_PAGES,
                guest_phys_addr: spec.gpa,
                memory_size: spec.size,
                userspace_addr: host as u64,
            };
            // SAFETY: `host .. host + spec.size` is region `slot` of `memory`, a live mapping of
            // exactly that size (built from this layout). The caller keeps `memory` alive longer
            // than the VM (`KvmVm` drops its VM before its memory), and slots never overlap
            // because the layout was validated.
            ioctl("KVM_SET_USER_MEMORY_REGION", unsafe {
                vm.set_user_memory_region(region)
            })?;
        }
        ioctl("KVM_SET_TSS_ADDR", vm.set_tss_address(TSS_GPA))?;
        let irqchip = want_irqchip
            && kvm.check_extension(Cap::Irqchip)
            && kvm.check_extension(Cap::Pit2)
            && vm.create_irq_chip().is_ok();
        if irqchip {
            let pit = kvm_pit_config {
                flags: KVM_PIT_SPEAKER_DUMMY,
                ..Default::default()
            };
            ioctl("KVM_CREATE_PIT2", vm.create_pit2(pit))?;
        }
        Ok(Self { kvm, vm, irqchip })
    }

    /// What vCPU state this KVM can save and load, probed on `probe` (a fresh vCPU).
    pub fn caps(&self, probe: &VcpuFd) -> Result<VcpuCaps, IoctlError> {
        let xsave_size = self.vm.check_extension_int(Cap::Xsave2);
        let xsave = self.kvm.check_extension(Cap::Xsave) && xsave_size <= 4096;
        let candidates = ioctl("KVM_GET_MSR_INDEX_LIST", self.kvm.get_msr_index_list())?;
        Ok(VcpuCaps {
            xsave,
            xcrs: self.kvm.check_extension(Cap::Xcrs),
            lapic: self.irqchip,
            msr_indices: probe_msrs(probe, candidates.as_slice()),
        })
    }
}

/// The host's CPUID, with vCPU `index`'s APIC id.
fn cpuid_for(kvm: &Kvm, index: u32) -> Result<CpuId, IoctlError> {
    let mut cpuid = ioctl(
        "KVM_GET_SUPPORTED_CPUID",
        kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES),
    )?;
    for entry in cpuid.as_mut_slice() {
        match entry.function {
            1 => entry.ebx = (entry.ebx & 0x00ff_ffff) | (index << 24),
            0xb | 0x1f => entry.edx = index,
            _ => {}
        }
    }
    Ok(cpuid)
}

/// Flat 32-bit protected mode, no paging, interrupts off, at the program's entry.
fn enter_program(fd: &VcpuFd) -> Result<(), IoctlError> {
    let mut sregs = ioctl("KVM_GET_SREGS", fd.get_sregs())?;
    let code = kvm_segment {
        base: 0,
        limit: 0xffff_ffff,
        selector: 0x08,
        type_: 0b1011,
        present: 1,
        dpl: 0,
        db: 1,
        s: 1,
        l: 0,
        g: 1,
        avl: 0,
        unusable: 0,
        padding: 0,
    };
    let data = kvm_segment {
        selector: 0x10,
        type_: 0b0011,
        ..code
    };
    sregs.cs = code;
    (sregs.ds, sregs.es, sregs.fs, sregs.gs, sregs.ss) = (data, data, data, data, data);
    sregs.cr0 |= 1;
    ioctl("KVM_SET_SREGS", fd.set_sregs(&sregs))?;
    let regs = kvm_regs {
        rip: CODE_GPA,
        rsp: STACK_TOP_GPA,
        rflags: 0x2,
        ..Default::default()
    };
    ioctl("KVM_SET_REGS", fd.set_regs(&regs))
}

impl KvmVmConfig {
    /// Checks the shape and the program's dirty area against the memory layout.
    pub fn validate(&self) -> Result<MemoryLayout, VmError> {
        let layout = MemoryLayout::for_size(self.mem_size_mib)?;
        if self.vcpus == 0 || self.vcpus > MAX_VCPUS {
            return Err(VmError::Config(format!(
                "vcpus = {} (1..={MAX_VCPUS})",
                self.vcpus
            )));
        }
        if self.vcpus > 1 && !self.irqchip {
            return Err(VmError::Config(
                "more than one vCPU needs the in-kernel irqchip (APs wait for SIPI)".into(),
            ));
        }
        let p = &self.program;
        let low = &layout.regions[0];
        let base = u64::from(p.dirty_base_gpa);
        let code_end = CODE_GPA + COUNTER_PROGRAM.len() as u64;
        if p.dirty_pages_per_tick > 0
            && (p.dirty_span_pages == 0
                || base % PAGE_SIZE as u64 != 0
                || base < code_end
                || p.dirty_end_gpa() > low.gpa + low.size)
        {
            return Err(VmError::Config(format!(
                "dirty area {base:#x} + {} pages must be page aligned, above {code_end:#x} and \
                 inside the {} MiB of low memory",
                p.dirty_span_pages,
                low.size >> 20
            )));
        }
        Ok(layout)
    }
}

impl KvmVm {
    /// Boots a new VM with the built-in program loaded, paused at its first instruction.
    pub fn create(config: KvmVmConfig) -> Result<Self, VmError> {
        let layout = config.validate()?;
        let memory = memory::anonymous(&layout)?;
        let shell = VmShell::create(&memory, &layout, config.irqchip)?;
        let write = |bytes: &[u8], gpa: u64| {
            memory
                .write_slice(bytes, GuestAddress(gpa))
                .map_err(|e| MemoryError::Access {
                    gpa,
                    detail: e.to_string(),
                })
        };
        write(COUNTER_PROGRAM, CODE_GPA)?;
        write(&config.program.to_param_block(), PARAMS_GPA)?;
        let mut fds = Vec::new();
        for index in 0..config.vcpus {
            let fd = ioctl("KVM_CREATE_VCPU", shell.vm.create_vcpu(u64::from(index)))?;
            ioctl(
                "KVM_SET_CPUID2",
                fd.set_cpuid2(&cpuid_for(&shell.kvm, index)?),
            )?;
            fds.push(fd);
        }
        let caps = shell.caps(&fds[0])?;
        enter_program(&fds[0])?;
        let devices = Arc::new(Mutex::new(Devices::new()));
        let mut vm = Self::assemble(shell, memory, layout, devices, caps, fds, config)?;
        vm.pending_dirty.fill();
        Ok(vm)
    }

    /// Wraps the parts into a VM with parked vCPU threads.
    pub(crate) fn assemble(
        shell: VmShell,
        memory: GuestMem,
        layout: MemoryLayout,
        devices: Arc<Mutex<Devices>>,
        caps: VcpuCaps,
        fds: Vec<VcpuFd>,
        config: KvmVmConfig,
    ) -> Result<Self, VmError> {
        let stops = Arc::new(Mutex::new(Vec::new()));
        let on_stop = {
            let stops = stops.clone();
            Arc::new(move |vcpu: u32, stop: &VcpuStop| {
                lock(&stops).push(StopRecord {
                    vcpu,
                    stop: stop.clone(),
                });
            })
        };
        let mut vcpus = Vec::new();
        for (index, fd) in fds.into_iter().enumerate() {
            let runner = VcpuRunner::spawn(index as u32, fd, devices.clone(), on_stop.clone())
                .map_err(VmError::Thread)?;
            vcpus.push(runner);
        }
        let pages = layout.total_pages();
        Ok(Self {
            vcpus,
            vm: shell.vm,
            memory,
            layout,
            devices,
            caps,
            irqchip: shell.irqchip,
            stops,
            lineage: None,
            pending_dirty: PageBitmap::new(pages),
            backing_files: Vec::new(),
            paused: true,
            config: KvmVmConfig {
                irqchip: shell.irqchip,
                ..config
            },
        })
    }

    /// Lets every vCPU run.
    pub fn resume(&mut self) {
        self.paused = false;
        for v in &self.vcpus {
            v.resume();
        }
    }

    /// Stops every vCPU and waits until none is inside `KVM_RUN`. The guest stays paused until
    /// [`resume`](Self::resume).
    pub fn pause(&mut self) -> Result<(), VmError> {
        self.paused = true;
        for v in &self.vcpus {
            v.pause().map_err(|waited| VmError::PauseTimeout {
                index: v.index(),
                waited,
            })?;
        }
        Ok(())
    }

    pub fn is_paused(&self) -> bool {
        self.paused
    }

    /// The shape this VM runs with (`irqchip` says whether KVM gave it one).
    pub fn config(&self) -> &KvmVmConfig {
        &self.config
    }

    pub fn layout(&self) -> &MemoryLayout {
        &self.layout
    }

    /// Whether the in-kernel irqchip and PIT are in use.
    pub fn has_irqchip(&self) -> bool {
        self.irqchip
    }

    /// What vCPU state is captured on this host.
    pub fn vcpu_caps(&self) -> &VcpuCaps {
        &self.caps
    }

    /// The snapshot this VM's dirty tracking is relative to.
    pub fn lineage(&self) -> Option<&Lineage> {
        self.lineage.as_ref()
    }

    /// Stops reported by vCPUs since the last call (guest exit, faults).
    pub fn take_stops(&self) -> Vec<StopRecord> {
        std::mem::take(&mut *lock(&self.stops))
    }

    /// The guest's exit status, once it wrote the exit port.
    pub fn exit_status(&self) -> Option<u8> {
        lock(&self.devices).exit_status()
    }

    /// Guest-visible device state.
    pub fn device_state(&self) -> DeviceState {
        lock(&self.devices).state()
    }

    /// Heartbeats seen by this VM instance and heartbeat writes refused.
    pub fn heartbeat_counts(&self) -> (u64, u64) {
        lock(&self.devices).heartbeat_counts()
    }

    /// When the guest last sent a heartbeat (host clock).
    pub fn last_heartbeat_at(&self) -> Option<Instant> {
        lock(&self.devices).last_heartbeat_at()
    }

    /// Announces a new rollback epoch (the guest reads it from the epoch port).
    pub fn set_epoch(&self, epoch: u64) {
        lock(&self.devices).set_epoch(epoch);
    }

    /// Serial output collected so far.
    pub fn serial_output(&self) -> Vec<u8> {
        lock(&self.devices).serial_output()
    }

    /// Removes and returns the serial output collected so far.
    pub fn take_serial_output(&self) -> Vec<u8> {
        lock(&self.devices).take_serial_output()
    }

    /// The program's tick reports in the serial output collected so far.
    pub fn tick_reports(&self) -> Vec<TickReport> {
        let out = self.serial_output();
        // Only complete lines: the guest may be in the middle of printing the last one (a
        // half-printed `W0000` would read as 0 writes).
        let complete = out
            .iter()
            .rposition(|&b| b == b'\n')
            .map_or(&out[..0], |end| &out[..end]);
        String::from_utf8_lossy(complete)
            .lines()
            .filter_map(TickReport::parse)
            .collect()
    }

    /// Waits (guest running) until `pred` holds for the tick reports, or `timeout` passes.
    pub fn wait_for_ticks(
        &self,
        timeout: Duration,
        pred: impl Fn(&[TickReport]) -> bool,
    ) -> Option<Vec<TickReport>> {
        let start = Instant::now();
        loop {
            let reports = self.tick_reports();
            if pred(&reports) {
                return Some(reports);
            }
            let guest_gone =
                self.exit_status().is_some() && self.vcpus.iter().all(|v| !v.is_running());
            if start.elapsed() > timeout || guest_gone {
                return None;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Writes guest memory from the VMM (tracked as dirty for the next diff).
    pub fn write_guest(&self, gpa: u64, bytes: &[u8]) -> Result<(), MemoryError> {
        self.memory
            .write_slice(bytes, GuestAddress(gpa))
            .map_err(|e| MemoryError::Access {
                gpa,
                detail: e.to_string(),
            })
    }

    /// Reads guest memory.
    pub fn read_guest(&self, gpa: u64, buf: &mut [u8]) -> Result<(), MemoryError> {
        self.memory
            .read_slice(buf, GuestAddress(gpa))
            .map_err(|e| MemoryError::Access {
                gpa,
                detail: e.to_string(),
            })
    }

    /// Rewrites the program's parameter block (takes effect on its next tick).
    pub fn set_program_config(&mut self, program: GuestProgramConfig) -> Result<(), VmError> {
        let config = KvmVmConfig {
            program,
            ..self.config.clone()
        };
        config.validate()?;
        self.write_guest(PARAMS_GPA, &program.to_param_block())?;
        self.config = config;
        Ok(())
    }

    /// SHA-256 of every page of guest memory, in image order (tests and tools).
    pub fn page_hashes(&self) -> Result<Vec<[u8; 32]>, MemoryError> {
        let mut page = vec![0u8; PAGE_SIZE];
        (0..self.layout.total_pages())
            .map(|p| {
                memory::read_image(&self.memory, &self.layout, p * PAGE_SIZE as u64, &mut page)?;
                Ok(Sha256::digest(&page).into())
            })
            .collect()
    }

    /// Fetches and clears KVM's dirty log and the VMM's own write bitmap, adding anything a
    /// failed capture left pending. Every page written since the previous call is in the result
    /// or in the logs of the next call: nothing is cleared without being returned.
    pub(crate) fn take_dirty(&mut self) -> Result<PageBitmap, VmError> {
        let mut dirty = std::mem::replace(
            &mut self.pending_dirty,
            PageBitmap::new(self.layout.total_pages()),
        );
        for (slot, spec) in self.layout.regions.iter().enumerate() {
            let words = ioctl(
                "KVM_GET_DIRTY_LOG",
                self.vm.get_dirty_log(slot as u32, spec.size as usize),
            )?;
            dirty.or_words_at(spec.first_page(), &words, spec.pages());
        }
        memory::take_vmm_dirty(&self.memory, &self.layout, &mut dirty);
        Ok(dirty)
    }

    /// Puts pages back as pending (a capture that took them failed).
    pub(crate) fn return_dirty(&mut self, pages: &PageBitmap) {
        for p in pages.iter() {
            self.pending_dirty.set(p);
        }
    }

    /// Ends the vCPU threads. The VM is unusable afterwards; dropping it does the same.
    pub fn shutdown(&mut self) {
        for v in &mut self.vcpus {
            v.stop();
        }
        self.paused = true;
    }
}

impl Drop for KvmVm {
    fn drop(&mut self) {
        self.shutdown();
    }
}
