#![allow(clippy::unwrap_used)] // helpers outside #[test] fns: a failure is a test failure
mod common;

use common::*;

#[test]
fn guest_runs_and_reports_ticks() {
    if !kvm_or_skip("guest_runs_and_reports_ticks") {
        return;
    }
    let mut vm = backstop_kvm::KvmVm::create(config(16, 1, 8, 64)).unwrap();
    let t = std::time::Instant::now();
    let reports = run_ticks(&mut vm, 5);
    eprintln!("5 ticks in {:?}: {reports:?}", t.elapsed());
    for (i, r) in reports.iter().enumerate() {
        assert_eq!(r.tick, i as u32 + 1);
        assert_eq!(r.writes, r.tick * 8);
    }
    assert!(vm.heartbeat_counts().0 >= 5);
}
