//! After each background snapshot the guest's RAM is mapped in huge pages again, for the next
//! snapshot's pause. QEMU's background snapshot lifts its write protection page by page and so
//! splits every huge page of guest RAM it saves; the next snapshot's write protection, inside the
//! guest's pause, then walks 512 times as many entries (crates/backstop-qmp/src/huge_pages.rs has
//! the measurements). backstop collapses them again once a capture is over. Runs against every QEMU
//! the tests are given (`BACKSTOP_QEMU`; scripts/test.sh runs it on 7.2 and 10.0).
#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use backstop_e2e::{qemu_guest_ram as guest_ram, skip_unless_ready, wait_guest_ram_huge, Daemon};

const BOOT: Duration = Duration::from_secs(90);
const STEP: Duration = Duration::from_secs(60);
/// How long the collapse may take after a snapshot answered: ~0.5 ms per huge page here, a few
/// hundred ms for the test guest; generous for a loaded CI machine.
const REGATHER: Duration = Duration::from_secs(30);

#[test]
fn guest_ram_is_mapped_huge_again_after_each_snapshot() {
    let test = "guest_ram_is_mapped_huge_again_after_each_snapshot";
    if skip_unless_ready(test) {
        return;
    }
    if backstop_e2e::skip_unless_huge_pages(test) {
        return;
    }
    let d = Daemon::start("huge-pages");
    d.wait_tick(0, 2, BOOT);
    let pid = d.status()["pid"].as_u64().unwrap();
    let (size, rss, huge) = guest_ram(pid);
    eprintln!(
        "after boot: guest RAM mapping {} MiB, resident {} MiB, huge {} MiB",
        size >> 20,
        rss >> 20,
        huge >> 20
    );
    assert!(
        size >= 256 << 20,
        "no guest RAM mapping found in QEMU's smaps: {size}"
    );
    // The daemon's own baseline snapshot after boot, then two more: it holds snapshot after
    // snapshot.
    let t0 = Instant::now();
    while d.ok(&["snapshot", "list"])["snapshots"]
        .as_array()
        .is_none_or(|s| s.is_empty())
    {
        assert!(t0.elapsed() < STEP, "no baseline snapshot");
        std::thread::sleep(Duration::from_millis(200));
    }
    for i in 0..3 {
        if i > 0 {
            let top = d.last_tick().unwrap().ram;
            d.wait_tick(0, top + 1, STEP);
            d.ok(&["snapshot", "create", "--reason", &format!("huge pages {i}")]);
        }
        let (rss, huge, took) = wait_guest_ram_huge(pid, REGATHER);
        eprintln!(
            "snapshot {i}: resident {} MiB, huge {} MiB again after {} ms",
            rss >> 20,
            huge >> 20,
            took.as_millis()
        );
        assert!(
            huge * 2 >= rss && rss > 0,
            "snapshot {i}: the guest RAM's huge pages were not collapsed again within {REGATHER:?}: \
             resident {rss}, huge {huge}; log:\n{}",
            backstop_e2e::tail(&d.log(), 20)
        );
    }
    // The same QEMU all along, still running its guest.
    assert_eq!(d.status()["pid"].as_u64().unwrap(), pid);
    let top = d.last_tick().unwrap().ram;
    d.wait_tick(0, top + 1, STEP);
}

/// `vm.huge_pages = "all"`: after each snapshot the guest's whole RAM is mapped huge again, the
/// ranges the guest never wrote too (QEMU's pre-fault maps the shared zero page there page by
/// page, and the next snapshot's write protection would walk every one of those entries inside
/// the pause: crates/backstop-qmp/src/huge_pages.rs). The default (`resident`) leaves those
/// ranges alone: the test guest's mapping is then far from wholly huge. On QEMU < 9.0 the
/// pre-fault is inside the pause, where a wholly resident RAM makes it longer: there `all`
/// falls back to `resident`, and says so.
#[test]
fn with_huge_pages_all_the_whole_guest_ram_is_mapped_huge_after_each_snapshot() {
    let test = "with_huge_pages_all_the_whole_guest_ram_is_mapped_huge_after_each_snapshot";
    if skip_unless_ready(test) {
        return;
    }
    if backstop_e2e::skip_unless_huge_pages(test) {
        return;
    }
    let d = Daemon::start_opts(
        "huge-all",
        &backstop_e2e::Options {
            extra_vm: "huge_pages = \"all\"",
            ..Default::default()
        },
    );
    d.wait_tick(0, 2, BOOT);
    let status = d.status();
    let pid = status["pid"].as_u64().unwrap();
    if backstop_e2e::qemu_version().0 < 9 {
        assert_eq!(
            status["backend_details"]["huge_pages"], "resident",
            "QEMU < 9.0: `all` falls back to `resident`: {status}"
        );
        assert!(
            d.log().contains("needs QEMU 9.0 or later"),
            "the fallback is said in the log:\n{}",
            backstop_e2e::tail(&d.log(), 20)
        );
        let top = d.last_tick().unwrap().ram;
        d.wait_tick(0, top + 1, STEP);
        d.ok(&["snapshot", "create", "--reason", "huge pages all, old QEMU"]);
        wait_guest_ram_huge(pid, REGATHER);
        std::thread::sleep(Duration::from_secs(2));
        let (size, rss, _) = guest_ram(pid);
        assert!(
            rss * 2 < size,
            "QEMU < 9.0: never-written RAM must not be filled: mapping {size}, resident {rss}"
        );
        return;
    }
    assert_eq!(
        status["backend_details"]["huge_pages"], "all",
        "status --json names the mode: {status}"
    );
    let t0 = Instant::now();
    while d.ok(&["snapshot", "list"])["snapshots"]
        .as_array()
        .is_none_or(|s| s.is_empty())
    {
        assert!(t0.elapsed() < STEP, "no baseline snapshot");
        std::thread::sleep(Duration::from_millis(200));
    }
    for i in 0..3 {
        if i > 0 {
            let top = d.last_tick().unwrap().ram;
            d.wait_tick(0, top + 1, STEP);
            d.ok(&[
                "snapshot",
                "create",
                "--reason",
                &format!("huge pages all {i}"),
            ]);
        }
        let t = Instant::now();
        let (size, rss, huge) = loop {
            let (size, rss, huge) = guest_ram(pid);
            if huge * 10 >= size * 9 || t.elapsed() > REGATHER {
                break (size, rss, huge);
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        eprintln!(
            "snapshot {i}: mapping {} MiB, resident {} MiB, huge {} MiB after {} ms",
            size >> 20,
            rss >> 20,
            huge >> 20,
            t.elapsed().as_millis()
        );
        assert!(
            huge * 10 >= size * 9,
            "snapshot {i}: with huge_pages = \"all\" at least 90% of the guest RAM mapping \
             should be huge within {REGATHER:?}: mapping {size}, resident {rss}, huge {huge}; \
             log:\n{}",
            backstop_e2e::tail(&d.log(), 20)
        );
    }
    assert_eq!(d.status()["pid"].as_u64().unwrap(), pid);
    let top = d.last_tick().unwrap().ram;
    d.wait_tick(0, top + 1, STEP);
}

/// The default leaves never-written guest RAM alone: QEMU's resident memory does not grow to
/// the guest's size (the test guest touches well under half of its 256 MiB).
#[test]
fn by_default_never_written_guest_ram_is_not_filled() {
    let test = "by_default_never_written_guest_ram_is_not_filled";
    if skip_unless_ready(test) {
        return;
    }
    if backstop_e2e::skip_unless_huge_pages(test) {
        return;
    }
    let d = Daemon::start("huge-default");
    d.wait_tick(0, 2, BOOT);
    let status = d.status();
    let pid = status["pid"].as_u64().unwrap();
    assert_eq!(
        status["backend_details"]["huge_pages"], "resident",
        "{status}"
    );
    let top = d.last_tick().unwrap().ram;
    d.wait_tick(0, top + 1, STEP);
    d.ok(&["snapshot", "create", "--reason", "huge pages default"]);
    let (rss, huge, _) = wait_guest_ram_huge(pid, REGATHER);
    // Give a pass that would fill the rest every chance to have done it.
    std::thread::sleep(Duration::from_secs(2));
    let (size, rss_after, huge_after) = guest_ram(pid);
    eprintln!(
        "mapping {} MiB, resident {} -> {} MiB, huge {} -> {} MiB",
        size >> 20,
        rss >> 20,
        rss_after >> 20,
        huge >> 20,
        huge_after >> 20
    );
    assert!(
        rss_after * 2 < size,
        "the default must not make the guest's whole RAM resident: mapping {size}, resident \
         {rss_after}"
    );
}

/// Memory the guest writes for the first time after a snapshot lands in ranges QEMU's pre-fault
/// mapped page by page, so it is mapped small too; backstop's pass keeps looking every few
/// seconds (`huge_pages::REPEAT`) and maps it huge again before the next snapshot needs it
/// (traced on QEMU 10: 430 MiB mapped small paused the next snapshot 22-32 ms, against 12-17 ms
/// once collapsed). The guest fills 96 MiB of a tmpfs 45 s after boot, after the daemon's
/// baseline snapshot; no snapshot is taken after it. khugepaged alone collapses ~16 MiB per 10 s
/// here, so the 64 MiB asked for within 20 s are the pass's.
#[test]
fn memory_the_guest_writes_after_a_snapshot_is_mapped_huge_before_the_next() {
    let test = "memory_the_guest_writes_after_a_snapshot_is_mapped_huge_before_the_next";
    if skip_unless_ready(test) {
        return;
    }
    if backstop_e2e::skip_unless_huge_pages(test) {
        return;
    }
    const FILL_MIB: u64 = 96;
    let d = Daemon::start_opts(
        "huge-fill",
        &backstop_e2e::Options {
            guest_flags: "backstop.fill_mib=96 backstop.fill_after=45",
            ..Default::default()
        },
    );
    d.wait_tick(0, 2, BOOT);
    let pid = d.status()["pid"].as_u64().unwrap();
    let t0 = Instant::now();
    while d.ok(&["snapshot", "list"])["snapshots"]
        .as_array()
        .is_none_or(|s| s.is_empty())
    {
        assert!(t0.elapsed() < STEP, "no baseline snapshot");
        std::thread::sleep(Duration::from_millis(200));
    }
    let (rss0, huge0, _) = wait_guest_ram_huge(pid, REGATHER);
    assert!(
        !d.serial().contains("BACKSTOP fill mib="),
        "the guest filled its memory before the baseline snapshot's pass was over: this test \
         needs a later backstop.fill_after"
    );
    let at = d.wait_serial(0, "BACKSTOP fill mib=", Duration::from_secs(180));
    let filled = Instant::now();
    eprintln!(
        "before the fill: resident {} MiB, huge {} MiB; fill line at serial byte {at}",
        rss0 >> 20,
        huge0 >> 20
    );
    let want = huge0 + (64 << 20);
    let (mut rss, mut huge) = (0, 0);
    while filled.elapsed() < Duration::from_secs(20) {
        (_, rss, huge) = guest_ram(pid);
        if huge >= want {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!(
        "{} ms after the fill: resident {} MiB, huge {} MiB",
        filled.elapsed().as_millis(),
        rss >> 20,
        huge >> 20
    );
    assert!(
        rss >= rss0 + ((FILL_MIB - 16) << 20),
        "the guest's fill should have made {FILL_MIB} MiB more resident: {} -> {} MiB",
        rss0 >> 20,
        rss >> 20
    );
    assert!(
        huge >= want,
        "within 20 s of the guest's fill, at least 64 MiB more of its RAM should be mapped huge \
         again: huge {} -> {} MiB (resident {} MiB); log:\n{}",
        huge0 >> 20,
        huge >> 20,
        rss >> 20,
        backstop_e2e::tail(&d.log(), 20)
    );
    assert_eq!(
        d.ok(&["snapshot", "list"])["snapshots"]
            .as_array()
            .map(Vec::len),
        Some(1),
        "no snapshot after the baseline: the collapse must be the running pass's"
    );
    assert_eq!(d.status()["pid"].as_u64().unwrap(), pid);
}
