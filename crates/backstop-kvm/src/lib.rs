//! backstop's embedded KVM backend: a micro-VMM built on `kvm-ioctls` and `vm-memory` that owns
//! every byte of its guest's state, so it can snapshot it completely (vCPU, VM, device state and
//! memory), store only the pages dirtied since the previous snapshot, and restore by mapping the
//! memory file copy-on-write instead of reading it.
//!
//! It runs one small VM per [`KvmVm`]: guest RAM with KVM dirty logging, the in-kernel irqchip
//! and PIT where KVM has them, vCPU threads, and a device model on I/O ports only (serial,
//! heartbeat, exit, epoch). [`KvmBackend`] puts it behind the engine's
//! [`backstop_hypervisor::VmBackend`] contract.
//!
//! What it must never do: use a state file that has not passed its signature, format and
//! checksum checks (all before any VM is created); map a memory file that is writable or differs
//! from what the signed state records; write to a snapshot file after it was published; resume a
//! guest the engine paused, or one being restored, on its own initiative; let the guest reach
//! anything but the four I/O devices (no MMIO device, no host file, no passthrough).

pub mod backend;
pub mod config;
pub mod devices;
pub mod format;
pub mod guest;
pub mod memory;
pub mod snapshot;
pub mod state;
mod vcpu;
pub mod vm;

pub use backend::KvmBackend;
pub use config::KvmConfig;
pub use format::StateFileError;
pub use guest::{GuestProgramConfig, TickReport};
pub use memory::MemoryLayout;
pub use snapshot::{
    config_fingerprint, CaptureError, CaptureSummary, MemoryCheck, RestoreError, RestoreOptions,
    RestoreSummary, SnapshotChain, SnapshotKind, SnapshotMeta,
};
pub use vcpu::VcpuStop;
pub use vm::{vms_created, KvmVm, KvmVmConfig, Lineage, StopRecord, VmError};

/// Whether `/dev/kvm` can be opened by this process.
pub fn kvm_available() -> bool {
    kvm_ioctls::Kvm::new().is_ok()
}
