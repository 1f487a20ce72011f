//! Snapshots of a real micro-VM on /dev/kvm: state round trip, rollback, diff chains, dirty
//! tracking across a capture, copy-on-write restore.
#![allow(clippy::unwrap_used)] // helpers outside #[test] fns: a failure is a test failure

mod common;

use std::collections::BTreeSet;
use std::path::Path;

use backstop_kvm::guest::{COUNTERS_GPA, DEFAULT_DIRTY_BASE_GPA, PARAMS_GPA};
use backstop_kvm::memory::PAGE_SIZE;
use backstop_kvm::snapshot::{read_state_file, SnapshotChain};
use backstop_kvm::state::tag;
use backstop_kvm::{KvmVm, MemoryCheck, RestoreOptions, SnapshotKind};
use common::*;

const MSR_IA32_TSC: u32 = 0x10;

fn msr_entries(bytes: &[u8]) -> Vec<(u32, u64)> {
    // kvm_msr_entry: index u32, reserved u32, data u64.
    bytes
        .chunks_exact(16)
        .map(|c| {
            let index = u32::from_le_bytes(c[0..4].try_into().unwrap());
            let data = u64::from_le_bytes(c[8..16].try_into().unwrap());
            (index, data)
        })
        .collect()
}

fn guest_tick(vm: &KvmVm) -> u32 {
    guest_counter(vm, 0)
}

/// The program's counter at word `index` of its counter block (0 tick, 1 cursor, 2 writes).
fn guest_counter(vm: &KvmVm, index: u64) -> u32 {
    let mut b = [0u8; 4];
    vm.read_guest(COUNTERS_GPA + 4 * index, &mut b).unwrap();
    u32::from_le_bytes(b)
}

/// save → restore → save: every section byte-identical, except host-time stamps that are clocks
/// by definition: KVM's VM clock and the TSC MSR advance while the VM sits paused between the two
/// saves (they must agree within a second and never go backwards), and each PIT channel's
/// `count_load_time` is the host's monotonic time at which KVM (re)loaded the counter, which
/// KVM_SET_PIT2 sets to "now" (so the pause does not count against the guest's timer).
#[test]
fn every_state_piece_round_trips() {
    if !kvm_or_skip("every_state_piece_round_trips") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut vm = KvmVm::create(config(16, 2, 4, 64)).unwrap();
    run_ticks(&mut vm, 3);
    vm.write_guest(0x5000, b"device-visible marker").unwrap();
    let a = dir.path().join("a");
    vm.capture(&a, SnapshotKind::Full, &key()).unwrap();
    drop(vm);

    let (vm2, _) = KvmVm::restore(&[&a], &key(), RestoreOptions::default()).unwrap();
    let mut vm2 = vm2;
    let b = dir.path().join("b");
    vm2.capture(&b, SnapshotKind::Full, &key()).unwrap();

    let (sa, ma) = read_state_file(&a, &key()).unwrap();
    let (sb, mb) = read_state_file(&b, &key()).unwrap();
    assert_eq!(ma.memory.sha256, mb.memory.sha256, "guest memory");
    assert_eq!(ma.config, mb.config);
    assert_eq!(ma.layout, mb.layout);
    let keys_a: Vec<_> = sa.section_keys().collect();
    let keys_b: Vec<_> = sb.section_keys().collect();
    assert_eq!(keys_a, keys_b, "the same pieces are captured");
    let mut compared = BTreeSet::new();
    for (t, i) in keys_a {
        let (x, y) = (sa.section(t, i).unwrap(), sb.section(t, i).unwrap());
        compared.insert(tag::name(t));
        match t {
            tag::META => {}
            tag::VM_CLOCK => {
                let ca = u64::from_le_bytes(x[0..8].try_into().unwrap());
                let cb = u64::from_le_bytes(y[0..8].try_into().unwrap());
                assert!(cb >= ca && cb - ca < 1_000_000_000, "clock {ca} -> {cb}");
            }
            tag::PIT2 => {
                // kvm_pit_state2: 3 × kvm_pit_channel_state (24 bytes, count_load_time at 16).
                let mask = |b: &[u8]| {
                    let mut b = b.to_vec();
                    for ch in 0..3 {
                        b[ch * 24 + 16..ch * 24 + 24].fill(0);
                    }
                    b
                };
                assert_eq!(x.len(), 112);
                assert_eq!(mask(x), mask(y), "pit2 (apart from count_load_time)");
            }
            tag::MSRS => {
                let (ea, eb) = (msr_entries(x), msr_entries(y));
                assert_eq!(ea.len(), eb.len());
                for ((ia, da), (ib, db)) in ea.iter().zip(&eb) {
                    assert_eq!(ia, ib);
                    if *ia == MSR_IA32_TSC {
                        assert!(db >= da, "TSC went backwards");
                    } else {
                        assert_eq!(da, db, "vCPU {i} MSR {ia:#x}");
                    }
                }
            }
            _ => assert_eq!(x, y, "section {} of vCPU/chip {i} differs", tag::name(t)),
        }
    }
    for piece in [
        "regs",
        "sregs",
        "fpu",
        "xsave",
        "xcrs",
        "debugregs",
        "msrs",
        "lapic",
        "vcpu_events",
        "mp_state",
        "cpuid",
        "clock",
        "irqchip",
        "pit2",
        "devices",
    ] {
        assert!(
            compared.contains(piece),
            "{piece} was not captured on this host"
        );
    }
}

/// Snapshot; the guest counts on and rewrites memory; rollback; the guest's own serial reports
/// resume from the snapshot point.
#[test]
fn rollback_restores_the_guests_counters() {
    if !kvm_or_skip("rollback_restores_the_guests_counters") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let snap = dir.path().join("s");
    let mut vm = KvmVm::create(config(16, 1, 16, 128)).unwrap();
    run_ticks(&mut vm, 4);
    let at_snapshot = guest_tick(&vm);
    vm.resume();
    // The tick the guest is at inside the capture (paused there, before memory is copied):
    // the exact snapshot point. (How many ticks the guest runs between `resume` and the
    // capture's pause depends on the host's scheduling: a loaded CI host let it run 2 or more.)
    let mut in_capture = 0;
    vm.capture_with_hook(&snap, SnapshotKind::Full, &key(), |vm| {
        in_capture = guest_tick(vm)
    })
    .unwrap();
    assert!(
        !vm.is_paused(),
        "a capture resumes a guest that was running"
    );
    let later = vm
        .wait_for_ticks(WAIT, |r| r.len() as u32 >= in_capture.max(at_snapshot) + 20)
        .unwrap();
    let reached = later.last().unwrap().tick;
    drop(vm);

    let (mut restored, summary) =
        KvmVm::restore(&[&snap], &key(), RestoreOptions::default()).unwrap();
    assert!(
        restored.is_paused(),
        "a restored VM waits for an explicit resume"
    );
    let captured_tick = guest_tick(&restored);
    assert!(
        captured_tick >= at_snapshot && captured_tick == in_capture,
        "restored tick {captured_tick}: the snapshot was taken at tick {in_capture} (resumed at \
         {at_snapshot})"
    );
    restored.resume();
    let reports = restored.wait_for_ticks(WAIT, |r| r.len() >= 3).unwrap();
    let first = reports[0];
    eprintln!(
        "snapshot at tick {captured_tick}, guest reached {reached}, after rollback it reports {:?} \
         (restore {summary:?})",
        &reports[..3]
    );
    assert!(
        first.tick == captured_tick || first.tick == captured_tick + 1,
        "first report after rollback is tick {} (snapshot at {captured_tick}, reached {reached})",
        first.tick
    );
    assert!(reached > first.tick + 10);
    for pair in reports.windows(2) {
        assert_eq!(
            pair[1].tick,
            pair[0].tick + 1,
            "the guest counts on from the snapshot"
        );
    }
    assert_eq!(
        first.writes,
        first.tick * 16,
        "its write counter came back too"
    );
}

/// Full snapshot, then five diffs with the guest running in between (and one VMM write); the
/// chain restores exactly the memory of the VM at the fifth diff.
#[test]
fn diff_chain_of_five_restores_the_last_memory() {
    if !kvm_or_skip("diff_chain_of_five_restores_the_last_memory") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut vm = KvmVm::create(config(32, 1, 24, 1024)).unwrap();
    run_ticks(&mut vm, 2);
    let mut dirs = vec![dir.path().join("s0")];
    let full = vm.capture(&dirs[0], SnapshotKind::Full, &key()).unwrap();
    let mut diff_sizes = Vec::new();
    for n in 1..=5 {
        run_ticks(&mut vm, n);
        if n == 3 {
            // A page only the VMM wrote: KVM's dirty log does not see it.
            vm.write_guest(0x1ff_0000, &[n as u8; 64]).unwrap();
        }
        let d = dir.path().join(format!("s{n}"));
        let s = vm.capture(&d, SnapshotKind::Diff, &key()).unwrap();
        assert_eq!(s.seq, n as u64);
        diff_sizes.push((s.dirty_pages, s.memory_file_len));
        dirs.push(d);
    }
    assert!(vm.is_paused());
    let expected = vm.page_hashes().unwrap();
    let chain = SnapshotChain::open(&dirs, &key(), RestoreOptions::default()).unwrap();
    let vmm_page = (0x1ff_0000 / PAGE_SIZE) as u64;
    assert!(chain.links()[3].diff_pages().unwrap().contains(&vmm_page));
    drop(chain);
    let (restored, summary) = KvmVm::restore(&dirs, &key(), RestoreOptions::default()).unwrap();
    let got = restored.page_hashes().unwrap();
    let differing: Vec<usize> = (0..expected.len())
        .filter(|&i| expected[i] != got[i])
        .collect();
    assert!(
        differing.is_empty(),
        "pages differ after the chain restore: {differing:?}"
    );
    eprintln!(
        "full: {} bytes on disk for {} pages written; diffs (dirty pages, bytes): {diff_sizes:?}; \
         restore {summary:?}",
        full.memory_file_len, full.pages_written
    );
    for (dirty, len) in diff_sizes {
        assert_eq!(len, (64 + dirty * 8).next_multiple_of(4096) + dirty * 4096);
    }
    assert!(summary.overlay_runs > 0);
    // The same chain, copying instead of mapping, gives the same memory.
    let copy = RestoreOptions {
        max_overlay_runs: 0,
        ..RestoreOptions::default()
    };
    let (copied, summary) = KvmVm::restore(&dirs, &key(), copy).unwrap();
    assert!(summary.copied_pages > 0);
    assert_eq!(copied.page_hashes().unwrap(), expected);
}

/// Dirty tracking is reset inside a capture; pages the guest (and the VMM) write while that
/// capture is still going land in the next diff — none is lost.
#[test]
fn pages_dirtied_during_a_capture_are_in_the_next_diff() {
    if !kvm_or_skip("pages_dirtied_during_a_capture_are_in_the_next_diff") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let per_tick = 8u32;
    let mut vm = KvmVm::create(config(32, 1, per_tick, 4096)).unwrap();
    run_ticks(&mut vm, 2);
    let s0 = dir.path().join("s0");
    vm.capture(&s0, SnapshotKind::Full, &key()).unwrap();
    run_ticks(&mut vm, 1);

    let s1 = dir.path().join("s1");
    let mut during = (0u32, 0u32);
    let mut writes_during = (0u32, 0u32);
    let vmm_gpa = 0x80_0000u64;
    vm.capture_with_hook(&s1, SnapshotKind::Diff, &key(), |vm| {
        let before = guest_tick(vm);
        let writes_before = guest_counter(vm, 2);
        run_ticks(vm, 3);
        during = (before, guest_tick(vm));
        writes_during = (writes_before, guest_counter(vm, 2));
        vm.write_guest(vmm_gpa, b"written by the VMM during the capture")
            .unwrap();
    })
    .unwrap();
    let (before, after) = during;
    // `run_ticks` waits for 3 serial reports; the in-memory counter read before may already be
    // one ahead of the last report, so at least 2 whole ticks ran inside the capture.
    assert!(
        after >= before + 2,
        "the guest ran during the capture: {before} → {after}"
    );

    let s2 = dir.path().join("s2");
    let d2 = vm.capture(&s2, SnapshotKind::Diff, &key()).unwrap();
    let chain = SnapshotChain::open(&[&s0, &s1, &s2], &key(), RestoreOptions::default()).unwrap();
    let pages: BTreeSet<u64> = chain.links()[2]
        .diff_pages()
        .unwrap()
        .iter()
        .copied()
        .collect();
    let mut must = BTreeSet::new();
    must.insert(COUNTERS_GPA / PAGE_SIZE as u64);
    must.insert(vmm_gpa / PAGE_SIZE as u64);
    // Write number `w` hits dirty-area page `w % span`. The program bumps its tick counter
    // *before* a tick's writes and its writes counter after each write's two stores, and
    // `run_ticks` may pause it anywhere in a tick: so the writes that provably all happened inside
    // the capture are `writes_before + 1 .. writes_after` (write `writes_before` may have had both
    // its stores before the hook; a tick-based range would count writes of the last tick that the
    // pause cut short, and an unwritten page is no lost page).
    let base_page = DEFAULT_DIRTY_BASE_GPA / PAGE_SIZE as u64;
    let (writes_before, writes_after) = writes_during;
    assert!(
        writes_after >= writes_before + per_tick,
        "the guest wrote during the capture: writes {writes_before} → {writes_after}"
    );
    for w in writes_before + 1..writes_after {
        must.insert(base_page + u64::from(w % 4096));
    }
    let lost: Vec<_> = must.difference(&pages).collect();
    assert!(
        lost.is_empty(),
        "pages dirtied during the capture were lost: {lost:?}"
    );
    assert!(d2.dirty_pages >= must.len() as u64);
    drop(chain);
    let expected = vm.page_hashes().unwrap();
    let (restored, _) =
        KvmVm::restore(&[&s0, &s1, &s2], &key(), RestoreOptions::default()).unwrap();
    assert_eq!(restored.page_hashes().unwrap(), expected);
}

/// The memory file is mapped copy-on-write: the restored guest's writes never reach it, and
/// every snapshot file is read-only.
#[test]
fn restored_guest_never_writes_the_snapshot() {
    if !kvm_or_skip("restored_guest_never_writes_the_snapshot") {
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let snap = dir.path().join("s");
    let mut vm = KvmVm::create(config(16, 1, 32, 256)).unwrap();
    run_ticks(&mut vm, 2);
    vm.capture(&snap, SnapshotKind::Full, &key()).unwrap();
    drop(vm);
    for name in ["state.bin", "state.sig", "memory.img"] {
        let mode = std::fs::metadata(snap.join(name))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o400, "{name}");
    }
    let before = std::fs::read(snap.join("memory.img")).unwrap();
    let (mut restored, _) = KvmVm::restore(&[&snap], &key(), RestoreOptions::default()).unwrap();
    run_ticks(&mut restored, 10);
    restored
        .write_guest(PARAMS_GPA + 0x800, &[0xee; 16])
        .unwrap();
    assert_eq!(std::fs::read(snap.join("memory.img")).unwrap(), before);
    // And a full check (hash of every byte) still passes with the VM running on the file.
    let full = RestoreOptions {
        memory_check: MemoryCheck::Full,
        ..RestoreOptions::default()
    };
    SnapshotChain::open(&[&snap], &key(), full).unwrap();
    check_no_partial_dirs(dir.path());
}

fn check_no_partial_dirs(dir: &Path) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let name = entry.unwrap().file_name();
        assert!(
            !name.to_string_lossy().ends_with(".partial"),
            "{name:?} left behind"
        );
    }
}
