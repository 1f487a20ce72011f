//! The NICs of an adopted domain on a real network: the domain's `<interface type='ethernet'>`
//! is a tap the test made (libvirt opens it, `managed='no'`) on a bridge whose other port leads
//! into a private network namespace holding the host-side peer (10.78.N.1). libvirt's QEMU
//! runs in the host's namespace, so the tap and the bridge are there; the peer, its address and
//! everything the guest can reach are in the namespace.
//!
//! Every rollback takes each link down (spec/000 §8); `device grant IFACE` (MAC, target device
//! or alias) raises it, leased and journaled, `device revoke` lowers it, and with
//! `vm.links_after_rollback = "up"` the links come back by themselves after a rollback. Each
//! step is checked as libvirt reports it (`virsh domif-getlink`), as the guest sees it (its own
//! pings of the peer, on its serial console) and from the peer's side (pings of the guest).

use super::*;

/// A bridge in the host namespace with the domain's tap on it, and a veth pair from it into a
/// network namespace where the peer has 10.78.`net`.1/24. Removed on drop.
struct PeerNet {
    ns: String,
    bridge: String,
    tap: String,
    veth: String,
    net: u8,
}

impl PeerNet {
    fn make(tag: char, net: u8) -> PeerNet {
        let pid = std::process::id();
        let p = PeerNet {
            ns: format!("bslv{tag}{pid}"),
            bridge: format!("blb{tag}{pid}"),
            tap: format!("blt{tag}{pid}"),
            veth: format!("blv{tag}{pid}"),
            net,
        };
        let peer_end = format!("blp{tag}{pid}");
        let peer_addr = format!("10.78.{net}.1/24");
        let steps: Vec<Vec<&str>> = vec![
            vec!["link", "add", &p.bridge, "type", "bridge"],
            vec!["link", "set", &p.bridge, "up"],
            vec!["tuntap", "add", "dev", &p.tap, "mode", "tap"],
            vec!["link", "set", &p.tap, "master", &p.bridge],
            vec!["link", "set", &p.tap, "up"],
            vec!["netns", "add", &p.ns],
            vec![
                "link", "add", &p.veth, "type", "veth", "peer", "name", &peer_end,
            ],
            vec!["link", "set", &peer_end, "netns", &p.ns],
            vec!["link", "set", &p.veth, "master", &p.bridge],
            vec!["link", "set", &p.veth, "up"],
            vec!["-n", &p.ns, "link", "set", "lo", "up"],
            vec!["-n", &p.ns, "addr", "add", &peer_addr, "dev", &peer_end],
            vec!["-n", &p.ns, "link", "set", &peer_end, "up"],
        ];
        for s in &steps {
            let o = Command::new("ip").args(s).output().unwrap();
            assert!(
                o.status.success(),
                "ip {s:?} (needs root and iproute2): {}",
                String::from_utf8_lossy(&o.stderr)
            );
        }
        p
    }

    fn guest_ip(&self) -> String {
        format!("10.78.{}.2", self.net)
    }

    /// The `<interface>` for the domain, with the kernel flags that make the guest put its
    /// address on it and ping the peer every 2 s (`scripts/guest/init`).
    fn domain_edit(&self, mac: &str) -> impl Fn(String) -> String + '_ {
        let iface = format!(
            "<interface type='ethernet'><mac address='{mac}'/><target dev='{}' managed='no'/><model type='virtio'/></interface>\n    <watchdog",
            self.tap
        );
        let flags = format!(
            "no_timer_check backstop.ip={}/24 backstop.ping=10.78.{}.1</cmdline>",
            self.guest_ip(),
            self.net
        );
        move |x: String| {
            x.replace("<watchdog", &iface)
                .replace("no_timer_check</cmdline>", &flags)
        }
    }

    /// One ping from the peer to the guest.
    fn peer_reaches_guest(&self) -> bool {
        Command::new("ip")
            .args(["netns", "exec", &self.ns, "busybox", "ping", "-c1", "-W1"])
            .arg(self.guest_ip())
            .output()
            .is_ok_and(|o| o.status.success())
    }
}

impl Drop for PeerNet {
    fn drop(&mut self) {
        for dev in [&self.veth, &self.tap, &self.bridge] {
            let _ = Command::new("ip").args(["link", "del", dev]).output();
        }
        let _ = Command::new("ip").args(["netns", "del", &self.ns]).output();
    }
}

/// `virsh domif-getlink`: `up` or `down`.
fn domif_link(dom: &TestDomain, iface: &str) -> String {
    let out = virsh_text(&["domif-getlink", &dom.name, iface]);
    out.split_whitespace()
        .last()
        .unwrap_or_default()
        .to_string()
}

/// Waits for `line` on the guest's serial console after byte `from`.
fn wait_guest_says(dom: &TestDomain, from: usize, line: &str, within: Duration) {
    let end = Instant::now() + within;
    loop {
        let s = dom.serial();
        if s.get(from.min(s.len())..).unwrap_or("").contains(line) {
            return;
        }
        assert!(
            Instant::now() < end,
            "guest never said {line:?} after byte {from}: serial:\n{s}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn wait_true(what: &str, within: Duration, mut pred: impl FnMut() -> bool) {
    let end = Instant::now() + within;
    while !pred() {
        assert!(Instant::now() < end, "{what}: not within {within:?}");
        std::thread::sleep(Duration::from_millis(300));
    }
}

/// The NIC's link as `status` shows it.
fn status_link(d: &Daemon, mac: &str) -> Value {
    let st = d.status();
    st["links"]
        .as_array()
        .and_then(|l| l.iter().find(|l| l["nic"] == mac))
        .map(|l| l["up"].clone())
        .unwrap_or(Value::Null)
}

fn fails_with(d: &Daemon, args: &[&str], code: &str) -> String {
    let out = d.cli(args);
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        !out.status.success(),
        "backstop {args:?} should have failed with {code}: {stdout}"
    );
    let doc: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(doc["error"]["code"], code, "{stdout}");
    let message = doc["error"]["message"].as_str().unwrap_or("").to_string();
    assert!(!message.contains('\n'), "{message}");
    message
}

fn revoked_list(rb: &Value) -> Vec<String> {
    rb["revoked"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_str().unwrap().to_string())
        .collect()
}

fn with_vm_key(config: String, line: &str) -> String {
    config.replace(
        "backend = \"libvirt\"",
        &format!("backend = \"libvirt\"\n{line}"),
    )
}

#[test]
fn libvirt_links_after_rollback_up_raises_the_domains_nic_and_the_guest_reaches_its_peer() {
    let test =
        "libvirt_links_after_rollback_up_raises_the_domains_nic_and_the_guest_reaches_its_peer";
    if skip_unless_libvirt(test) {
        return;
    }
    let _libvirtd = libvirtd_shared();
    let _uffd = Uffd::set("1");
    let mac = "52:54:00:b5:01:01";
    let net = PeerNet::make('u', 1);
    let dom = TestDomain::start("bs-e2e-nicup", &net.domain_edit(mac));
    wait_guest_says(&dom, 0, "BACKSTOP ping ok", BOOT);
    let (name, l2) = (dom.name.clone(), dom.layers());
    let mut d = Daemon::prepare_custom(
        "lv-nicup",
        &move |s: &Path, r: &Path| {
            with_vm_key(
                config(s, r, &name, "", &l2),
                "links_after_rollback = \"up\"",
            )
        },
        &[],
    );
    d.launch();
    d.wait_journal(STEP, "baseline snapshot", |e| {
        e["event"] == "snapshot.create.completed"
    });
    assert_eq!(status_link(&d, mac), Value::Bool(true));

    // The snapshot holds a guest whose last ping failed (an operator pulled the cable), so a
    // "ping ok" after the rollback is the restored guest reaching its peer, nothing older.
    virsh_text(&["domif-setlink", &dom.name, &net.tap, "down"]);
    let pulled = dom.serial().len();
    wait_guest_says(&dom, pulled, "BACKSTOP ping failed", STEP);
    let snap = d.ok(&["snapshot", "create", "--reason", "test: cable pulled"]);
    let id = snap["summary"]["snapshot_id"].as_str().unwrap().to_string();

    let from = dom.serial().len();
    let rb = d.ok(&["rollback", "--to", &id, "--reason", "test: links come back"]);
    let revoked = revoked_list(&rb);
    eprintln!("rollback revoked: {revoked:?}");
    // Taken down like every rollback's, then raised again: both on the record.
    assert!(
        revoked
            .iter()
            .any(|r| r == "network links down in the restored VM"),
        "{revoked:?}"
    );
    assert!(
        revoked
            .iter()
            .any(|r| r == &format!("{mac}: link up again (vm.links_after_rollback = \"up\")")),
        "{revoked:?}"
    );
    let completed = d.wait_journal(STEP, "rollback.completed", |e| {
        e["event"] == "rollback.completed"
    });
    assert!(
        completed["fields"]["revoked"]
            .to_string()
            .contains(&format!("{mac}: link up again")),
        "{completed}"
    );
    // libvirt says up, by either name; the restored guest reaches its peer, and the peer it.
    assert_eq!(domif_link(&dom, &net.tap), "up");
    assert_eq!(domif_link(&dom, mac), "up");
    assert_eq!(status_link(&d, mac), Value::Bool(true));
    wait_guest_says(&dom, from, "BACKSTOP ping ok", STEP);
    wait_true("the peer reaches the restored guest", STEP, || {
        net.peer_reaches_guest()
    });
    // Not a grant: nothing to revoke, and snapshots are not deferred.
    assert!(d.status()["granted_devices"]
        .as_array()
        .is_none_or(|g| g.is_empty()));
    d.ok(&[
        "snapshot",
        "create",
        "--reason",
        "test: network up, not deferred",
    ]);
    // The operator's persistent definition never gains a link state.
    assert!(!virsh_text(&["dumpxml", "--inactive", &dom.name]).contains("<link state"));
    d.ok(&["audit", "verify"]);
    d.kill9();
}

#[test]
fn libvirt_a_domains_nic_is_down_after_a_rollback_until_granted_and_a_revoke_takes_it_down() {
    let test =
        "libvirt_a_domains_nic_is_down_after_a_rollback_until_granted_and_a_revoke_takes_it_down";
    if skip_unless_libvirt(test) {
        return;
    }
    let _libvirtd = libvirtd_shared();
    let _uffd = Uffd::set("1");
    let mac = "52:54:00:b5:02:01";
    let net = PeerNet::make('g', 2);
    let dom = TestDomain::start("bs-e2e-nicgrant", &net.domain_edit(mac));
    wait_guest_says(&dom, 0, "BACKSTOP ping ok", BOOT);
    let (name, l2) = (dom.name.clone(), dom.layers());
    let mut d = Daemon::prepare_custom(
        "lv-nicgrant",
        &move |s: &Path, r: &Path| config(s, r, &name, "", &l2),
        &[],
    );
    d.launch();
    d.wait_journal(STEP, "baseline snapshot", |e| {
        e["event"] == "snapshot.create.completed"
    });
    // The domain's NIC is a grantable network device, under its MAC.
    let list = d.ok(&["device", "list"]);
    let nic = list["devices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["id"] == mac)
        .unwrap_or_else(|| panic!("no device {mac}: {list}"))
        .clone();
    assert_eq!(nic["class"], "network", "{nic}");
    assert_eq!(nic["source"], format!("nic {mac}"), "{nic}");
    assert!(nic["grant"].is_null(), "{nic}");

    // Bad input: one line with a code, nothing changed.
    let msg = fails_with(
        &d,
        &["device", "grant", "eth9", "--reason", "t"],
        "ERR_DEVICE_NOT_CONFIGURED",
    );
    assert!(msg.contains("eth9"), "{msg}");
    fails_with(
        &d,
        &["device", "grant", "52:54:00:b5:02:99", "--reason", "t"],
        "ERR_DEVICE_NOT_CONFIGURED",
    );
    fails_with(
        &d,
        &["device", "revoke", &net.tap, "--reason", "t"],
        "ERR_DEVICE_NOT_GRANTED",
    );
    assert_eq!(domif_link(&dom, &net.tap), "up");
    let j = d.journal();
    assert!(events(&j, "device.granted").is_empty());
    assert!(events(&j, "device.grant.refused").is_empty());
    assert!(events(&j, "device.revoked").is_empty());

    // A rollback takes the link down, and it stays down.
    let from = dom.serial().len();
    let rb = d.ok(&["rollback", "--reason", "test: revoke the network"]);
    assert!(
        revoked_list(&rb)
            .iter()
            .any(|r| r == "network links down in the restored VM"),
        "{rb}"
    );
    assert_eq!(domif_link(&dom, &net.tap), "down");
    assert_eq!(domif_link(&dom, mac), "down");
    assert_eq!(status_link(&d, mac), Value::Bool(false));
    wait_guest_says(&dom, from, "BACKSTOP ping failed", STEP);
    assert!(
        !net.peer_reaches_guest(),
        "the peer reaches the guest after the rollback"
    );

    // Granted by its target device: up, leased, journaled after its pre-action snapshot.
    let again = dom.serial().len();
    let g = d.ok(&[
        "device",
        "grant",
        &net.tap,
        "--lease",
        "10m",
        "--reason",
        "test: network back",
    ]);
    let line = g["changed"][0].as_str().unwrap().to_string();
    eprintln!("grant: {line}");
    assert_eq!(
        line,
        format!(
            "granted {mac} (nic {mac}): link up {mac} ({}) (live only)",
            net.tap
        ),
        "{g}"
    );
    let granted = g["devices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["id"] == mac)
        .unwrap()["grant"]
        .clone();
    assert_eq!(granted["lease_s"], 600, "{g}");
    assert_eq!(domif_link(&dom, &net.tap), "up");
    assert_eq!(status_link(&d, mac), Value::Bool(true));
    wait_guest_says(&dom, again, "BACKSTOP ping ok", STEP);
    wait_true("the peer reaches the guest after the grant", STEP, || {
        net.peer_reaches_guest()
    });
    let j = d.journal();
    let ev = events(&j, "device.granted");
    assert_eq!(ev.len(), 1, "{ev:?}");
    let f = &ev[0]["fields"];
    assert_eq!(f["device_id"], mac, "{f}");
    assert_eq!(f["class"], "network", "{f}");
    assert_eq!(f["lease_s"], 600, "{f}");
    assert_eq!(f["snapshot_id"], granted["pre_action_snapshot"], "{f}");
    let pre = d.ok(&["snapshot", "show", f["snapshot_id"].as_str().unwrap()]);
    assert_eq!(pre["manifest"]["trigger"], "pre_action", "{pre}");
    // Network access adds no device: snapshots go on.
    d.ok(&[
        "snapshot",
        "create",
        "--reason",
        "test: network granted, not deferred",
    ]);
    // Granted twice is refused by any of its names.
    fails_with(
        &d,
        &["device", "grant", &mac.to_uppercase(), "--reason", "t"],
        "ERR_DEVICE_ALREADY_GRANTED",
    );

    // Revoked by its MAC in another case: down again.
    let cut = dom.serial().len();
    let r = d.ok(&[
        "device",
        "revoke",
        &mac.to_uppercase(),
        "--reason",
        "test: done with it",
    ]);
    let line = r["changed"][0].as_str().unwrap().to_string();
    eprintln!("revoke: {line}");
    assert_eq!(
        line,
        format!("revoked {mac}: link down {mac} ({}) (live only)", net.tap),
        "{r}"
    );
    assert_eq!(domif_link(&dom, &net.tap), "down");
    assert_eq!(status_link(&d, mac), Value::Bool(false));
    wait_guest_says(&dom, cut, "BACKSTOP ping failed", STEP);
    assert!(
        !net.peer_reaches_guest(),
        "the peer reaches the guest after the revoke"
    );
    let j = d.journal();
    let ev = events(&j, "device.revoked");
    assert_eq!(ev.len(), 1, "{ev:?}");
    assert_eq!(ev[0]["fields"]["device_id"], mac);
    assert!(ev[0]["fields"]["detail"]
        .as_str()
        .unwrap()
        .starts_with("link down"));

    // Granted again (by libvirt's alias for it), then a rollback ends the grant: down again.
    let alias = {
        let live = virsh_text(&["dumpxml", &dom.name]);
        let nics = backstop_libvirt::interface_xml::interfaces(&live).unwrap();
        nics[0].alias.clone().unwrap()
    };
    d.ok(&["device", "grant", &alias, "--reason", "test: once more"]);
    assert_eq!(domif_link(&dom, &net.tap), "up");
    d.ok(&["rollback", "--reason", "test: and away again"]);
    assert_eq!(domif_link(&dom, &net.tap), "down");
    let j = d.journal();
    assert!(
        events(&j, "device.revoked")
            .iter()
            .any(|e| e["fields"]["device_id"] == mac && e["fields"]["cause"] == "rollback"),
        "no device.revoked of {mac} by the rollback"
    );
    assert!(d.status()["granted_devices"]
        .as_array()
        .is_none_or(|g| g.is_empty()));
    assert!(!virsh_text(&["dumpxml", "--inactive", &dom.name]).contains("<link state"));
    d.ok(&["audit", "verify"]);
    d.kill9();
}
