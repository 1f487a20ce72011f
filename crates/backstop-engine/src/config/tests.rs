use super::*;

#[test]
fn the_embedded_default_config_loads() {
    let cfg = Config::parse(DEFAULT_CONFIG).unwrap();
    assert_eq!(cfg.vm.name, "demo");
    assert!(cfg
        .vm
        .disks
        .iter()
        .any(|d| d.snapshot == DiskSnapshotMode::Exclude));
    assert_eq!(cfg.daemon.console_uids, vec![0]);
}

#[test]
fn the_shipped_kvm_config_loads_and_its_table_is_strict() {
    let text = include_str!("../../../../vmm-config/kvm.toml");
    let cfg = Config::parse(text).unwrap();
    assert_eq!(cfg.vm.backend, "kvm");
    assert!(cfg.kvm_backend.is_some());
    let err = Config::parse(&text.replace("[kvm]\n", "[kvm]\ncolour = 1\n")).unwrap_err();
    assert!(err.to_string().contains("colour"), "{err}");
    let err = Config::parse(&text.replace("backend = \"kvm\"", "backend = \"xen\"")).unwrap_err();
    assert!(err.to_string().contains("vm.backend"), "{err}");
}

#[test]
fn keys_that_would_disable_safety_are_refused_by_name() {
    let text = DEFAULT_CONFIG.replace("[rollback]", "[rollback]\nenabled = false");
    let err = Config::parse(&text).unwrap_err();
    assert_eq!(err.to_string(), "config: `rollback.enabled`: snapshots, rollback and the watchdog cannot be disabled (spec/000 §1)");
}

#[test]
fn a_watchdog_timeout_of_zero_or_absurd_is_refused_by_name() {
    for bad in ["0", "1", "100000"] {
        let text = DEFAULT_CONFIG.replace(
            "heartbeat_timeout_s = 10",
            &format!("heartbeat_timeout_s = {bad}"),
        );
        let err = Config::parse(&text).unwrap_err().to_string();
        assert!(err.contains("watchdog.heartbeat_timeout_s"), "{bad}: {err}");
    }
    let text = DEFAULT_CONFIG.replace(
        "heartbeat_timeout_s = 10",
        "heartbeat_timeout_s = 10\nwatchdog_enabled = false",
    );
    assert!(Config::parse(&text)
        .unwrap_err()
        .to_string()
        .contains("watchdog.watchdog_enabled"));
}

#[test]
fn the_wedge_limit_defaults_to_a_minute_and_cannot_be_lifted() {
    assert_eq!(
        Config::parse(DEFAULT_CONFIG)
            .unwrap()
            .daemon
            .actor_silence_limit_secs,
        60
    );
    let with = |v: &str| {
        DEFAULT_CONFIG.replace(
            "[vm]\n",
            &format!("actor_silence_limit_secs = {v}\n\n[vm]\n"),
        )
    };
    assert_eq!(
        Config::parse(&with("20"))
            .unwrap()
            .daemon
            .actor_silence_limit_secs,
        20
    );
    for bad in ["0", "4", "601", "100000"] {
        let err = Config::parse(&with(bad)).unwrap_err().to_string();
        assert!(
            err.contains("daemon.actor_silence_limit_secs"),
            "{bad}: {err}"
        );
    }
}

#[test]
fn unknown_keys_and_bad_values_are_refused() {
    let err = Config::parse(
        &DEFAULT_CONFIG.replace("memory_mib = 256", "memory_mib = 256\ncolour = \"red\""),
    )
    .unwrap_err();
    assert!(err.to_string().contains("colour"), "{err}");
    let err =
        Config::parse(&DEFAULT_CONFIG.replace("memory_mib = 256", "memory_mib = 1")).unwrap_err();
    assert!(err.to_string().contains("vm.memory_mib"), "{err}");
    let err = Config::parse(&DEFAULT_CONFIG.replace("name = \"demo\"", "name = \"Demo VM\""))
        .unwrap_err();
    assert!(err.to_string().contains("vm.name"), "{err}");
}

#[test]
fn env_vars_expand_and_missing_ones_are_named() {
    std::env::set_var("BACKSTOP_TEST_DIR_X", "/x");
    assert_eq!(
        expand_path("k", Path::new("${BACKSTOP_TEST_DIR_X}/a")).unwrap(),
        PathBuf::from("/x/a")
    );
    let err = expand_path("vm.kernel", Path::new("${BACKSTOP_NOPE_NOT_SET}/a")).unwrap_err();
    assert!(err.to_string().contains("BACKSTOP_NOPE_NOT_SET"));
}

const LIBVIRT: &str = r#"
[daemon]
state_dir = "/tmp/s"
run_dir = "/tmp/r"

[vm]
name = "web1"
backend = "libvirt"

[vm.libvirt]
uri = "qemu:///system"
domain = "web1"
"#;

#[test]
fn libvirt_tables_parse_strictly() {
    let parsed = Config::parse(LIBVIRT);
    if !backstop_libvirt::AVAILABLE {
        let err = parsed.unwrap_err().to_string();
        assert!(err.contains("without the libvirt backend"), "{err}");
        return;
    }
    let cfg = parsed.unwrap();
    let l = cfg.vm.libvirt.as_ref().unwrap();
    assert_eq!(l.uri, "qemu:///system");
    assert_eq!(l.domain.as_deref(), Some("web1"));
    assert_eq!(
        cfg.layers_dir(),
        PathBuf::from("/var/lib/libvirt/images/backstop/web1")
    );
    for (text, key) in [
        (
            LIBVIRT.replace("domain = \"web1\"", "colour = \"red\""),
            "colour",
        ),
        (LIBVIRT.replace("domain = \"web1\"", ""), "vm.libvirt"),
        (
            LIBVIRT.replace("domain = \"web1\"", "uuid = \"not-a-uuid\""),
            "vm.libvirt.uuid",
        ),
        (
            LIBVIRT.replace("uri = \"qemu:///system\"", "uri = \" \""),
            "vm.libvirt.uri",
        ),
        (
            LIBVIRT.replace(
                "backend = \"libvirt\"",
                "backend = \"libvirt\"\nmemory_mib = 512",
            ),
            "vm.memory_mib",
        ),
        (
            LIBVIRT.replace(
                "backend = \"libvirt\"",
                "backend = \"libvirt\"\nkernel = \"/boot/vmlinuz\"",
            ),
            "vm.kernel",
        ),
        (
            LIBVIRT.replace("[vm.libvirt]", "[vm.libvirt]\nlayers_dir = \"rel\""),
            "vm.libvirt.layers_dir",
        ),
        (LIBVIRT.replace("uri = ", "#"), "uri"),
        (
            LIBVIRT.replace("[vm.libvirt]", "[vm.libvirt]\ncapture = \"live\""),
            "capture",
        ),
    ] {
        let err = Config::parse(&text).unwrap_err().to_string();
        assert!(err.contains(key), "{key}: {err}");
    }
    let uuid = LIBVIRT.replace(
        "domain = \"web1\"",
        "uuid = \"3bab8fae-2197-4426-a436-3db1bd3f0eb5\"",
    );
    assert!(Config::parse(&uuid).is_ok());
    assert_eq!(
        l.capture,
        backstop_libvirt::CaptureMode::Background,
        "the default"
    );
    for (text, mode) in [
        ("precopy", backstop_libvirt::CaptureMode::Precopy),
        ("auto", backstop_libvirt::CaptureMode::Auto),
        ("background", backstop_libvirt::CaptureMode::Background),
    ] {
        let c = Config::parse(&LIBVIRT.replace(
            "[vm.libvirt]",
            &format!("[vm.libvirt]\ncapture = \"{text}\""),
        ))
        .unwrap();
        assert_eq!(c.vm.libvirt.unwrap().capture, mode, "{text}");
    }
    let err = Config::parse(
        &LIBVIRT.replace("backend = \"libvirt\"", "memory_mib = 256\nkernel = \"/k\""),
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("vm.libvirt"),
        "a [vm.libvirt] table needs backend = libvirt: {err}"
    );
}

#[test]
fn the_heartbeat_source_is_backstops_agent_or_qemu_ga_and_never_off() {
    use backstop_hypervisor::HeartbeatSource;
    assert_eq!(
        Config::parse(DEFAULT_CONFIG).unwrap().vm.heartbeat,
        HeartbeatSource::BackstopAgent
    );
    let with = |v: &str| {
        DEFAULT_CONFIG.replace(
            "memory_mib = 256",
            &format!("memory_mib = 256\nheartbeat = {v}"),
        )
    };
    assert_eq!(
        Config::parse(&with("\"qemu-ga\"")).unwrap().vm.heartbeat,
        HeartbeatSource::QemuGa
    );
    for bad in ["\"off\"", "\"none\"", "false", "\"qga\""] {
        let err = Config::parse(&with(bad)).unwrap_err().to_string();
        assert!(err.contains("heartbeat"), "{bad}: {err}");
    }
    let kvm = include_str!("../../../../vmm-config/kvm.toml").replace(
        "\nbackend = \"kvm\"",
        "\nbackend = \"kvm\"\nheartbeat = \"qemu-ga\"",
    );
    let err = Config::parse(&kvm).unwrap_err().to_string();
    assert!(err.contains("vm.heartbeat"), "{err}");
}

#[test]
fn firmware_cpu_disk_boot_and_tap_nics_are_checked_by_name() {
    let with = |extra: &str| {
        DEFAULT_CONFIG.replace("memory_mib = 256", &format!("memory_mib = 256\n{extra}"))
    };
    let cfg = Config::parse(&with("firmware = \"ovmf\"\ncpu = \"max,pmu=off\"\ntap_nics = [{ id = \"lan\", ifname = \"bs-tap0\" }]")).unwrap();
    assert_eq!(cfg.vm.firmware, Firmware::Ovmf);
    assert_eq!(
        cfg.vm.ovmf_code,
        PathBuf::from("/usr/share/OVMF/OVMF_CODE_4M.fd")
    );
    for (extra, key) in [
        ("firmware = \"coreboot\"", "firmware"),
        ("cpu = \"max -device evil\"", "vm.cpu"),
        ("cpu = \"\"", "vm.cpu"),
        (
            "tap_nics = [{ id = \"net0\", ifname = \"bs-tap0\" }]",
            "vm.tap_nics[0].id",
        ),
        (
            "tap_nics = [{ id = \"lan\", ifname = \"a-name-far-too-long\" }]",
            "vm.tap_nics[0].ifname",
        ),
        (
            "tap_nics = [{ id = \"lan\", ifname = \"x y\" }]",
            "vm.tap_nics[0].ifname",
        ),
        ("tap_nics = [{ id = \"lan\" }]", "ifname"),
    ] {
        let err = Config::parse(&with(extra)).unwrap_err().to_string();
        assert!(err.contains(key), "{extra}: {err}");
    }
    // The variable store's disk id is reserved under OVMF.
    let text = with("firmware = \"ovmf\"").replace("id = \"scratch\"", "id = \"uefi-vars\"");
    assert!(Config::parse(&text)
        .unwrap_err()
        .to_string()
        .contains("uefi-vars"));
    // Files: a missing firmware image or tap device is one line at load, naming the key.
    let files_error = |extra: &str| {
        let mut cfg = Config::parse(&with(extra)).unwrap();
        // Everything else present: programs found on PATH, no kernel or disk to look for.
        cfg.vm.qemu_binary = "sh".into();
        cfg.vm.qemu_img = "sh".into();
        cfg.vm.kernel = PathBuf::new();
        cfg.vm.disks.clear();
        cfg.check_files().unwrap_err().to_string()
    };
    let err = files_error("firmware = \"ovmf\"\novmf_code = \"/nonexistent/CODE.fd\"");
    assert!(
        err.contains("vm.ovmf_code") && err.contains("does not exist"),
        "{err}"
    );
    let err = files_error("tap_nics = [{ id = \"lan\", ifname = \"bs-nosuch0\" }]");
    assert!(
        err.contains("vm.tap_nics[0].ifname") && err.contains("bs-nosuch0"),
        "{err}"
    );
    // Disk boot: no kernel, then no initrd or append either.
    let diskboot = DEFAULT_CONFIG.replace("kernel = ", "# kernel = ");
    let err = Config::parse(&diskboot).unwrap_err().to_string();
    assert!(err.contains("vm.initrd"), "{err}");
}

#[test]
fn the_temporal_bound_defaults_to_seven_days_and_cannot_be_turned_off() {
    let cfg = Config::parse(DEFAULT_CONFIG).unwrap();
    assert_eq!(cfg.restore_gate.max_target_age_s(), 7 * 24 * 3600);
    for (line, key) in [
        (
            "max_target_age_hours = 0",
            "restore_gate.max_target_age_hours",
        ),
        (
            "max_target_age_hours = 100000",
            "restore_gate.max_target_age_hours",
        ),
        (
            "max_target_age_seconds = 1",
            "restore_gate.max_target_age_seconds",
        ),
    ] {
        let text = DEFAULT_CONFIG.replace("[restore_gate]\n", &format!("[restore_gate]\n{line}\n"));
        let err = Config::parse(&text).unwrap_err().to_string();
        assert!(err.contains(key), "{line}: {err}");
    }
    let text = DEFAULT_CONFIG.replace(
        "[restore_gate]\n",
        "[restore_gate]\nmax_target_age_seconds = 30\n",
    );
    assert_eq!(
        Config::parse(&text)
            .unwrap()
            .restore_gate
            .max_target_age_s(),
        30
    );
}

#[test]
fn the_metrics_endpoint_is_off_by_default_and_local_only() {
    let cfg = Config::parse(DEFAULT_CONFIG).unwrap();
    assert_eq!(cfg.daemon.metrics_endpoint().unwrap(), None);
    for (value, want) in [
        (
            "unix:/run/backstop/metrics.sock",
            MetricsEndpoint::Unix("/run/backstop/metrics.sock".into()),
        ),
        (
            "127.0.0.1:9464",
            MetricsEndpoint::Tcp("127.0.0.1:9464".parse().unwrap()),
        ),
        (
            "[::1]:9464",
            MetricsEndpoint::Tcp("[::1]:9464".parse().unwrap()),
        ),
        (
            "localhost:9464",
            MetricsEndpoint::Tcp("127.0.0.1:9464".parse().unwrap()),
        ),
        (
            "127.0.0.2:1",
            MetricsEndpoint::Tcp("127.0.0.2:1".parse().unwrap()),
        ),
    ] {
        assert_eq!(parse_metrics_endpoint(value).unwrap(), want, "{value}");
    }
    for (value, says) in [
        ("0.0.0.0:9464", "not a loopback address"),
        ("192.168.1.10:9464", "not a loopback address"),
        ("[::]:9464", "not a loopback address"),
        ("unix:metrics.sock", "absolute path"),
        ("localhost:http", "not a number"),
        ("example.org:9464", "neither unix:/PATH"),
        ("", "neither unix:/PATH"),
    ] {
        let e = parse_metrics_endpoint(value).unwrap_err();
        let text = e.to_string();
        assert_eq!(e.code(), ErrorCode::ConfigInvalid);
        assert!(text.contains("`daemon.metrics`"), "{value}: {text}");
        assert!(text.contains(says), "{value}: {text}");
        assert!(!text.contains('\n'), "one line: {text}");
    }
    // A whole daemon file with a non-local address is refused before anything starts.
    let text = DEFAULT_CONFIG.replace("[daemon]\n", "[daemon]\nmetrics = \"0.0.0.0:9464\"\n");
    let e = crate::HostConfig::parse(&text).unwrap_err();
    assert!(e.to_string().contains("daemon.metrics"), "{e}");
}

#[test]
fn the_drift_table_has_defaults_bounds_and_no_stranger_keys() {
    let cfg = Config::parse(DEFAULT_CONFIG).unwrap();
    assert_eq!(cfg.drift.reconcile_minutes, 5.0);
    assert_eq!(cfg.drift.reverify_days, 7);
    assert_eq!(cfg.drift.period(), std::time::Duration::from_secs(300));
    let with = |table: &str| DEFAULT_CONFIG.replace("[drift]", &format!("[drift]\n{table}\n"));
    let cfg = Config::parse(&with("reconcile_minutes = 0.1\nreverify_days = 2")).unwrap();
    assert_eq!(cfg.drift.period(), std::time::Duration::from_secs(6));
    assert_eq!(cfg.drift.reverify_days, 2);
    let cfg = Config::parse(&with("reconcile_minutes = 10")).unwrap();
    assert_eq!(cfg.drift.period(), std::time::Duration::from_secs(600));
    for (table, key) in [
        ("reconcile_minutes = 0", "drift.reconcile_minutes"),
        ("reconcile_minutes = 0.01", "drift.reconcile_minutes"),
        ("reconcile_minutes = 5000", "drift.reconcile_minutes"),
        ("reverify_days = 0", "drift.reverify_days"),
        ("reverify_days = 1000", "drift.reverify_days"),
    ] {
        let err = Config::parse(&with(table)).unwrap_err();
        assert!(
            err.to_string().starts_with(&format!("config: `{key}`:")),
            "{table}: {err}"
        );
    }
    let err = Config::parse(&with("colour = 1")).unwrap_err();
    assert!(err.to_string().contains("colour"), "{err}");
    let err = Config::parse(&with("reconcile_minutes = \"soon\"")).unwrap_err();
    assert!(err.to_string().starts_with("config:"), "{err}");
    // Detection cannot be turned off.
    let err = Config::parse(&with("enabled = false")).unwrap_err();
    assert!(err.to_string().contains("drift.enabled"), "{err}");
}

#[test]
fn a_libvirt_vm_refuses_every_vm_key_it_would_ignore_and_keeps_those_it_uses() {
    if !backstop_libvirt::AVAILABLE {
        return;
    }
    let with = |extra: &str| {
        LIBVIRT.replace(
            "backend = \"libvirt\"",
            &format!("backend = \"libvirt\"\n{extra}"),
        )
    };
    // Named at all is refused, a value equal to the default too: it would do nothing.
    for (line, key, says) in [
        ("accel = \"kvm\"", "vm.accel", "<domain type="),
        ("accel = \"auto\"", "vm.accel", "<domain type="),
        (
            "qemu_binary = \"/usr/bin/qemu-system-x86_64\"",
            "vm.qemu_binary",
            "<emulator>",
        ),
        ("machine = \"q35\"", "vm.machine", "machine="),
        ("vcpus = 4", "vm.vcpus", "<vcpu>"),
        ("vcpus = 1", "vm.vcpus", "<vcpu>"),
        (
            "ovmf_code = \"/usr/share/OVMF/OVMF_CODE.fd\"",
            "vm.ovmf_code",
            "<loader>",
        ),
        (
            "ovmf_vars_template = \"/x/VARS.fd\"",
            "vm.ovmf_vars_template",
            "<nvram>",
        ),
        ("nics = [\"net0\"]", "vm.nics", "domain's own XML"),
        (
            "tap_nics = [{ id = \"lan\", ifname = \"tap0\" }]",
            "vm.tap_nics",
            "qemu backend only",
        ),
        (
            "watchdog_device = true",
            "vm.watchdog_device",
            "domain's own XML",
        ),
        (
            "heartbeat = \"qemu-ga\"",
            "vm.heartbeat",
            "qemu backend only",
        ),
        ("firmware = \"ovmf\"", "vm.firmware", "qemu backend only"),
        ("cpu = \"max\"", "vm.cpu", "qemu backend only"),
    ] {
        let err = Config::parse(&with(line)).unwrap_err();
        assert_eq!(
            err.code(),
            backstop_common::ErrorCode::ConfigInvalid,
            "{line}"
        );
        let err = err.to_string();
        assert!(err.contains(&format!("`{key}`")), "{line}: {err}");
        assert!(err.contains(says), "{line}: {err}");
        assert!(!err.contains('\n'), "{line}: {err}");
    }
    // What the libvirt backend does use stays accepted.
    let cfg = Config::parse(&with(
        "links_after_rollback = \"up\"\nhuge_pages = \"resident\"\nqemu_img = \"qemu-img\"",
    ))
    .unwrap();
    assert_eq!(cfg.vm.links_after_rollback, LinksAfterRollback::Up);
    // The same keys are the qemu backend's own (the default file has accel and vcpus).
    let qemu = DEFAULT_CONFIG.replace("memory_mib = 256", "memory_mib = 256\nmachine = \"q35\"");
    Config::parse(&qemu).unwrap();
}

#[test]
fn links_after_rollback_is_down_unless_a_person_says_up() {
    let with = |extra: &str| {
        DEFAULT_CONFIG.replace("memory_mib = 256", &format!("memory_mib = 256\n{extra}"))
    };
    let cfg = Config::parse(DEFAULT_CONFIG).unwrap();
    assert_eq!(cfg.vm.links_after_rollback, LinksAfterRollback::Down);
    let cfg = Config::parse(&with("links_after_rollback = \"up\"")).unwrap();
    assert_eq!(cfg.vm.links_after_rollback, LinksAfterRollback::Up);
    for bad in ["\"sideways\"", "true", "\"UP\""] {
        let err = Config::parse(&with(&format!("links_after_rollback = {bad}")))
            .unwrap_err()
            .to_string();
        assert!(err.contains("links_after_rollback"), "{bad}: {err}");
    }
}

#[test]
fn huge_pages_are_regathered_where_resident_unless_all_is_asked_for() {
    use backstop_qemu::huge_pages::HugePages;
    let with = |extra: &str| {
        DEFAULT_CONFIG.replace("memory_mib = 256", &format!("memory_mib = 256\n{extra}"))
    };
    let cfg = Config::parse(DEFAULT_CONFIG).unwrap();
    assert_eq!(cfg.vm.huge_pages, HugePages::Resident);
    let cfg = Config::parse(&with("huge_pages = \"all\"")).unwrap();
    assert_eq!(cfg.vm.huge_pages, HugePages::All);
    let cfg = Config::parse(&with("huge_pages = \"resident\"")).unwrap();
    assert_eq!(cfg.vm.huge_pages, HugePages::Resident);
    for bad in ["\"some\"", "true", "\"ALL\"", "2"] {
        let err = Config::parse(&with(&format!("huge_pages = {bad}")))
            .unwrap_err()
            .to_string();
        assert!(err.contains("huge_pages"), "{bad}: {err}");
    }
}

#[test]
fn the_capture_order_is_auto_unless_set_and_qemu_only() {
    use backstop_qemu::version::CaptureOrder;
    let with = |extra: &str| {
        DEFAULT_CONFIG.replace("memory_mib = 256", &format!("memory_mib = 256\n{extra}"))
    };
    assert_eq!(
        Config::parse(DEFAULT_CONFIG).unwrap().vm.capture_order,
        CaptureOrder::Auto
    );
    for (value, order) in [
        ("auto", CaptureOrder::Auto),
        ("migrate-first", CaptureOrder::MigrateFirst),
        ("stop-first", CaptureOrder::StopFirst),
    ] {
        let cfg = Config::parse(&with(&format!("capture_order = \"{value}\""))).unwrap();
        assert_eq!(cfg.vm.capture_order, order);
        assert_eq!(order.as_str(), value);
    }
    for bad in ["\"migrate_first\"", "\"Auto\"", "true", "1"] {
        let err = Config::parse(&with(&format!("capture_order = {bad}")))
            .unwrap_err()
            .to_string();
        assert!(err.contains("capture_order"), "{bad}: {err}");
    }
    if backstop_libvirt::AVAILABLE {
        let on_libvirt = LIBVIRT.replace(
            "backend = \"libvirt\"",
            "backend = \"libvirt\"\ncapture_order = \"migrate-first\"",
        );
        let err = Config::parse(&on_libvirt).unwrap_err().to_string();
        assert!(
            err.contains("vm.capture_order") && err.contains("qemu backend only"),
            "{err}"
        );
        assert!(!err.contains('\n'), "{err}");
        let auto = LIBVIRT.replace(
            "backend = \"libvirt\"",
            "backend = \"libvirt\"\ncapture_order = \"auto\"",
        );
        Config::parse(&auto).unwrap();
    }
}

#[test]
fn libvirt_devices_are_one_checked_device_element() {
    if !backstop_libvirt::AVAILABLE {
        return;
    }
    let with = |device: &str| {
        format!("{LIBVIRT}\n[[devices]]\nid = \"tablet\"\nclass = \"usb\"\nmax_lease_s = 600\n{device}\n")
    };
    let cfg = Config::parse(&with(
        r#"libvirt = { xml = "<input type='tablet' bus='usb'/>" }"#,
    ))
    .unwrap();
    let d = &cfg.devices[0];
    assert_eq!(d.source(), "libvirt <input>");
    assert_eq!(
        d.grant_spec().kind,
        backstop_hypervisor::GrantKind::LibvirtXml {
            element: "input".into(),
            xml: "<input type='tablet' bus='usb'/>".into()
        }
    );
    assert!(d.grant_spec().adds_device());
    assert_eq!(d.host_claim(), None);
    // A multi-line hostdev is fine too.
    Config::parse(&with(
        "libvirt = { xml = '''\n<hostdev mode='subsystem' type='usb' managed='yes'>\n  <source><vendor id='0x0781'/><product id='0x5567'/></source>\n</hostdev>''' }",
    ))
    .unwrap();
    for (device, key, says) in [
        (
            r#"libvirt = { xml = "<interface type='user'/>" }"#,
            "devices[0].libvirt.xml",
            "not a device backstop grants",
        ),
        (
            r#"libvirt = { xml = "<input type='tablet'" }"#,
            "devices[0].libvirt.xml",
            "does not parse",
        ),
        (
            r#"libvirt = { xml = "<input/><input/>" }"#,
            "devices[0].libvirt.xml",
            "does not parse",
        ),
        (
            r#"libvirt = { xml = "<input type='tablet' bus='usb'><alias name='ua-x'/></input>" }"#,
            "devices[0].libvirt.xml",
            "alias",
        ),
        (
            r#"libvirt = { xml = "<input/>", colour = "red" }"#,
            "colour",
            "unknown field",
        ),
        (
            r#"qemu = { driver = "usb-tablet" }"#,
            "devices[0].libvirt",
            "given as libvirt XML",
        ),
        (
            "libvirt = { xml = \"<input type='tablet' bus='usb'/>\" }\nqemu = { driver = \"usb-tablet\" }",
            "devices[0].libvirt",
            "its XML alone",
        ),
    ] {
        let err = Config::parse(&with(device)).unwrap_err();
        let text = err.to_string();
        assert!(text.contains(key) && text.contains(says), "{device}: {text}");
        assert!(
            key == "colour" || text.contains("device tablet"),
            "names the device: {text}"
        );
        assert!(!text.contains('\n'), "one line: {text}");
        assert_eq!(err.code().to_string(), "ERR_CONFIG_INVALID");
    }
    let display = with(r#"libvirt = { xml = "<input type='tablet' bus='usb'/>" }"#)
        .replace("class = \"usb\"", "class = \"display\"");
    assert!(Config::parse(&display)
        .unwrap_err()
        .to_string()
        .contains("class usb, gpu or audio"));
    // The QEMU backend has no use for libvirt XML.
    let qemu = with(r#"libvirt = { xml = "<input type='tablet' bus='usb'/>" }"#)
        .replace(
            "backend = \"libvirt\"",
            "backend = \"qemu\"\nkernel = \"/k\"\nmemory_mib = 256",
        )
        .replace(
            "[vm.libvirt]\nuri = \"qemu:///system\"\ndomain = \"web1\"\n",
            "",
        );
    let err = Config::parse(&qemu).unwrap_err().to_string();
    assert!(
        err.contains("devices[0].libvirt") && err.contains("only for backend"),
        "{err}"
    );
}

#[test]
fn the_forensic_ram_keys_default_and_refuse_bad_values_by_name() {
    let cfg = Config::parse(DEFAULT_CONFIG).unwrap();
    assert_eq!(
        cfg.rollback.forensic_ram_budget(),
        std::time::Duration::from_secs(5)
    );
    assert_eq!(
        cfg.rollback.forensic_ram_for,
        vec!["console", "policy", "emergency", "watchdog"]
    );
    assert_eq!(cfg.retention.keep_forensic_hours, 72);
    let with = |keys: &str| DEFAULT_CONFIG.replace("[rollback]", &format!("[rollback]\n{keys}"));
    let cfg = Config::parse(&with(
        "forensic_ram_budget = \"750ms\"\nforensic_ram_for = []",
    ))
    .unwrap();
    assert_eq!(
        cfg.rollback.forensic_ram_budget(),
        std::time::Duration::from_millis(750)
    );
    assert!(cfg.rollback.forensic_ram_for.is_empty());
    for (keys, key) in [
        (
            "forensic_ram_budget = \"soon\"",
            "rollback.forensic_ram_budget",
        ),
        (
            "forensic_ram_budget = \"0s\"",
            "rollback.forensic_ram_budget",
        ),
        (
            "forensic_ram_budget = \"1h\"",
            "rollback.forensic_ram_budget",
        ),
        (
            "forensic_ram_for = [\"console\", \"sometimes\"]",
            "rollback.forensic_ram_for[1]",
        ),
    ] {
        let err = Config::parse(&with(keys)).unwrap_err().to_string();
        assert!(err.contains(key), "{keys}: {err}");
        assert!(!err.contains('\n'), "{err}");
    }
    // A number is not a duration: refused by serde with the key's name.
    let err = Config::parse(&with("forensic_ram_budget = 5"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("forensic_ram_budget"), "{err}");
}

/// The default config without its disk that snapshots exclude (a standby refuses one).
fn default_without_the_excluded_disk() -> String {
    let start = DEFAULT_CONFIG
        .find("[[vm.disks]]\nid = \"scratch\"")
        .unwrap();
    let end = DEFAULT_CONFIG[start..].find("[rollback]").unwrap() + start;
    format!("{}{}", &DEFAULT_CONFIG[..start], &DEFAULT_CONFIG[end..])
}

#[test]
fn a_standby_is_off_by_default_and_refused_where_a_second_qemu_cannot_work() {
    let cfg = Config::parse(DEFAULT_CONFIG).unwrap();
    assert!(!cfg.rollback.standby);
    // The default config excludes a disk from snapshots: both QEMUs would open it.
    let standby = |text: &str| text.replace("[rollback]", "[rollback]\nstandby = true");
    let err = Config::parse(&standby(DEFAULT_CONFIG))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("rollback.standby") && err.contains("exclude"),
        "{err}"
    );
    // Without it, a standby is accepted.
    let captured_only = default_without_the_excluded_disk();
    assert!(
        Config::parse(&standby(&captured_only))
            .unwrap()
            .rollback
            .standby
    );
    let with_vm = |extra: &str| {
        standby(&captured_only).replace("memory_mib = 256", &format!("memory_mib = 256\n{extra}"))
    };
    for (extra, why) in [
        ("tap_nics = [{ id = \"lan\", ifname = \"bs-tap0\" }]", "tap"),
        ("firmware = \"ovmf\"", "ovmf"),
    ] {
        let err = Config::parse(&with_vm(extra)).unwrap_err().to_string();
        assert!(
            err.contains("rollback.standby") && err.contains(why),
            "{extra}: {err}"
        );
        assert!(!err.contains('\n'), "{err}");
    }
}

#[test]
fn a_preload_is_off_by_default_and_needs_a_standby() {
    let cfg = Config::parse(DEFAULT_CONFIG).unwrap();
    assert!(!cfg.rollback.preload);
    let err = Config::parse(&DEFAULT_CONFIG.replace("[rollback]", "[rollback]\npreload = true"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("rollback.preload") && err.contains("rollback.standby = true"),
        "{err}"
    );
    assert!(!err.contains('\n'), "{err}");
    let captured_only = default_without_the_excluded_disk();
    let both = captured_only.replace("[rollback]", "[rollback]\nstandby = true\npreload = true");
    let cfg = Config::parse(&both).unwrap();
    assert!(cfg.rollback.standby && cfg.rollback.preload);
}

#[test]
fn the_chunk_hash_is_sha256_unless_blake3_is_asked_for_and_nothing_else() {
    use backstop_store::ChunkHash;
    // The shipped configs set it (below); without the key it is sha256.
    let without = DEFAULT_CONFIG.replace("\nchunk_hash = \"blake3\"", "\n");
    assert_eq!(
        Config::parse(&without).unwrap().daemon.chunk_hash,
        ChunkHash::Sha256
    );
    let with = |v: &str| without.replace("[daemon]\n", &format!("[daemon]\nchunk_hash = {v}\n"));
    assert_eq!(
        Config::parse(&with("\"blake3\""))
            .unwrap()
            .daemon
            .chunk_hash,
        ChunkHash::Blake3
    );
    for bad in ["\"md5\"", "\"BLAKE3\"", "3"] {
        let err = Config::parse(&with(bad)).unwrap_err().to_string();
        assert!(err.contains("chunk_hash"), "{bad}: {err}");
        assert!(!err.contains('\n'), "one line: {err}");
    }
}

/// What a new install runs (the demo's embedded config and the packaged daemon file) names
/// chunks by BLAKE3; the built-in default stays sha256 for configs written before it.
#[test]
fn the_shipped_configs_name_chunks_by_blake3() {
    use backstop_store::ChunkHash;
    assert_eq!(
        Config::parse(DEFAULT_CONFIG).unwrap().daemon.chunk_hash,
        ChunkHash::Blake3
    );
    let packaged = include_str!("../../../../vmm-config/backstopd.toml");
    assert!(packaged.contains("\nchunk_hash = \"blake3\""), "{packaged}");
}

/// Root is the console and nothing else by default: a policy engine is a principal of its own.
#[test]
fn no_policy_principal_by_default() {
    let cfg = Config::parse(DEFAULT_CONFIG).unwrap();
    assert_eq!(cfg.daemon.console_uids, vec![0]);
    assert_eq!(cfg.daemon.policy_uids, Vec::<u32>::new());
    assert_eq!(cfg.daemon.policy_gids, Vec::<u32>::new());
    let bare = DEFAULT_CONFIG.replace("console_uids = [0]", "");
    let cfg = Config::parse(&bare).unwrap();
    assert_eq!(
        (cfg.daemon.console_uids, cfg.daemon.policy_uids),
        (vec![0], vec![])
    );
}

/// A uid or gid that would be both a console and a policy engine is refused in one line naming
/// both keys, whether the daemon file holds a VM or only names a VM directory.
#[test]
fn a_principal_in_both_roles_is_refused_naming_both_keys() {
    let with = |lines: &str| {
        DEFAULT_CONFIG.replace(
            "console_uids = [0]",
            &format!("console_uids = [0, 1000]\n{lines}"),
        )
    };
    let err = Config::parse(&with("policy_uids = [990, 1000]")).unwrap_err();
    assert_eq!(
        err.to_string(),
        "config: `daemon.policy_uids`: uid 1000 in both daemon.console_uids and daemon.policy_uids: the policy engine must be a principal of its own (only a person at the console clears HALTED or resumes a guest); remove it from daemon.policy_uids"
    );
    let err = Config::parse(&with("policy_uids = [0, 1000]")).unwrap_err();
    assert!(
        err.to_string()
            .contains("uids 0, 1000 in both daemon.console_uids and daemon.policy_uids"),
        "{err}"
    );
    let err = Config::parse(&with("console_gids = [50, 60]\npolicy_gids = [60]")).unwrap_err();
    assert_eq!(
        err.to_string(),
        "config: `daemon.policy_gids`: gid 60 in both daemon.console_gids and daemon.policy_gids: the policy engine must be a principal of its own (only a person at the console clears HALTED or resumes a guest); remove it from daemon.policy_gids"
    );
    assert!(!err.to_string().contains('\n'));
    // Distinct principals load.
    let cfg = Config::parse(&with("policy_uids = [990]\npolicy_gids = [990]")).unwrap();
    assert_eq!(cfg.daemon.policy_uids, vec![990]);

    // A daemon file without a VM of its own is checked the same.
    let dir = tempfile::tempdir().unwrap();
    let daemon_only = |extra: &str| {
        format!(
            "[daemon]\nstate_dir = \"/var/lib/backstop\"\nrun_dir = \"/run/backstop\"\nvms_dir = \"{}\"\n{extra}\n",
            dir.path().display()
        )
    };
    let err = crate::host::HostConfig::parse(&daemon_only("policy_uids = [0]")).unwrap_err();
    assert!(
        err.to_string()
            .starts_with("config: `daemon.policy_uids`: uid 0 in both daemon.console_uids and daemon.policy_uids"),
        "{err}"
    );
    let err = crate::host::HostConfig::parse(&daemon_only("console_uids = []")).unwrap_err();
    assert!(err.to_string().contains("daemon.console_uids"), "{err}");
    crate::host::HostConfig::parse(&daemon_only("policy_uids = [990]")).unwrap();
}
