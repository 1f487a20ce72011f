//! Shared helpers of the /dev/kvm tests.
#![allow(dead_code, clippy::unwrap_used)] // test helpers: a failure is a test failure

use std::path::Path;
use std::time::Duration;

use backstop_integrity::HostKey;
use backstop_kvm::{GuestProgramConfig, KvmVm, KvmVmConfig, TickReport};

/// Whether the test can run; says so loudly when it cannot, and fails under
/// `BACKSTOP_REQUIRE_E2E=1` (CI, where /dev/kvm must be there).
pub fn kvm_or_skip(test: &str) -> bool {
    if backstop_kvm::kvm_available() {
        return true;
    }
    if std::env::var("BACKSTOP_REQUIRE_E2E").as_deref() == Ok("1") {
        panic!("{test}: /dev/kvm is not available and BACKSTOP_REQUIRE_E2E=1");
    }
    eprintln!("SKIPPED {test}: /dev/kvm is not available");
    false
}

pub fn key() -> HostKey {
    HostKey::from_bytes([0x42; 32])
}

/// A small guest: `pages_per_tick` pages a tick over `span_pages` pages, fast ticks.
pub fn config(mem_size_mib: u64, vcpus: u32, pages_per_tick: u32, span_pages: u32) -> KvmVmConfig {
    KvmVmConfig {
        mem_size_mib,
        vcpus,
        irqchip: true,
        program: GuestProgramConfig {
            dirty_pages_per_tick: pages_per_tick,
            dirty_span_pages: span_pages,
            tick_delay_loops: 2_000,
            ..GuestProgramConfig::default()
        },
    }
}

pub const WAIT: Duration = Duration::from_secs(30);

/// Runs the guest until it reported `n` more ticks than it had, then pauses it.
pub fn run_ticks(vm: &mut KvmVm, n: usize) -> Vec<TickReport> {
    let have = vm.tick_reports().len();
    vm.resume();
    let reports = vm
        .wait_for_ticks(WAIT, |r| r.len() >= have + n)
        .unwrap_or_else(|| {
            panic!(
                "guest did not report {n} ticks; serial: {:?}",
                String::from_utf8_lossy(&vm.serial_output())
            )
        });
    vm.pause().unwrap();
    reports
}

/// Copies a snapshot directory (files stay 0400).
pub fn copy_snapshot(from: &Path, to: &Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let dst = to.join(entry.file_name());
        std::fs::copy(entry.path(), &dst).unwrap();
        std::fs::set_permissions(&dst, std::fs::Permissions::from_mode(0o400)).unwrap();
    }
}

/// Rewrites a read-only file.
pub fn rewrite(path: &Path, bytes: &[u8]) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
    std::fs::write(path, bytes).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o400)).unwrap();
}
