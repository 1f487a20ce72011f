//! backstopd's TOML config: parsed strictly (unknown keys are errors), validated at load, with
//! `${VAR}` expansion in paths. Nothing here can turn snapshots, rollback or the watchdog off:
//! such keys do not exist, and a config that tries is refused naming the key.

use backstop_common::ErrorCode;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// The config the demo runs on, embedded in the binary.
pub const DEFAULT_CONFIG: &str = include_str!("../../../../vmm-config/default.toml");

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config: {0}")]
    Parse(String),
    #[error("config: `{key}`: {message}")]
    Invalid { key: String, message: String },
}

impl ConfigError {
    pub fn code(&self) -> ErrorCode {
        ErrorCode::ConfigInvalid
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub daemon: DaemonConfig,
    pub vm: VmConfig,
    #[serde(default)]
    pub rollback: RollbackConfig,
    #[serde(default)]
    pub watchdog: WatchdogConfig,
    /// Scheduled snapshots (`[snapshots]`): always on; only the interval is configurable.
    #[serde(default)]
    pub snapshots: crate::policy::SnapshotsConfig,
    /// Which snapshots are kept (`[retention]`).
    #[serde(default)]
    pub retention: crate::policy::RetentionConfig,
    /// Reviewer evidence for console restores (`[restore_gate]`).
    #[serde(default)]
    pub restore_gate: crate::policy::RestoreGateConfig,
    /// Drift detection (`[drift]`): the reconciliation period and the re-verification window.
    /// Detection itself is always on.
    #[serde(default)]
    pub drift: DriftConfig,
    /// What may be granted to the guest (`[[devices]]`); nothing else can be.
    #[serde(default)]
    pub devices: Vec<crate::devices::DeviceConfig>,
    /// The embedded KVM backend's own table (`vm.backend = "kvm"`), parsed strictly by
    /// `backstop-kvm` at load; see vmm-config/kvm.toml.
    #[serde(default)]
    pub kvm: Option<toml::Table>,
    /// Off-host replication (`[offsite]`): a daemon-wide table of the daemon file, parsed strictly
    /// by `backstop-offsite` in `backstopd`; the engine only lets it through.
    #[serde(default)]
    pub offsite: Option<toml::Table>,
    /// The KVM backend's parsed settings (`None` for QEMU).
    #[serde(skip)]
    pub kvm_backend: Option<backstop_kvm::config::KvmConfigFile>,
    /// A VM whose single-VM state was moved into `vms/NAME/` keeps its disk layers in the old
    /// `state_dir/disks` (manifests and overlays name them by path): set at start, never read
    /// from a file (see `crate::migrate`).
    #[serde(skip)]
    pub pinned_layers_dir: Option<PathBuf>,
}

/// Drift detection (spec/002 §3, docs/drift.md). Always on; only its pace is configurable.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DriftConfig {
    /// Minutes between two active reconciliation passes (a fraction is allowed: tests use a
    /// few seconds).
    #[serde(default = "default_reconcile_minutes")]
    pub reconcile_minutes: f64,
    /// Every chunk of every usable snapshot is re-read at least once within this many days,
    /// the work spread over the passes.
    #[serde(default = "default_reverify_days")]
    pub reverify_days: u64,
}

impl Default for DriftConfig {
    fn default() -> Self {
        Self {
            reconcile_minutes: default_reconcile_minutes(),
            reverify_days: default_reverify_days(),
        }
    }
}

impl DriftConfig {
    /// The pass period (validated at load to lie within [`RECONCILE_MINUTES`]).
    pub fn period(&self) -> std::time::Duration {
        std::time::Duration::from_secs_f64(self.reconcile_minutes.max(0.0) * 60.0)
    }
}

fn default_reconcile_minutes() -> f64 {
    5.0
}

fn default_reverify_days() -> u64 {
    7
}

/// Bounds of `drift.reconcile_minutes`: from 3 s (tests) to a day.
pub const RECONCILE_MINUTES: std::ops::RangeInclusive<f64> = 0.05..=1440.0;
/// Bounds of `drift.reverify_days`.
pub const REVERIFY_DAYS: std::ops::RangeInclusive<u64> = 1..=365;

/// The heartbeat watchdog. It is always on; only its timeout is configurable, within bounds.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WatchdogConfig {
    /// Silence from the guest agent longer than this is an expiry → emergency rollback.
    #[serde(default = "default_hb_timeout")]
    pub heartbeat_timeout_s: u64,
    /// Until a VM instance's first valid heartbeat (its guest is still booting), the allowed
    /// silence is this instead. A guest that never sends one still expires.
    #[serde(default = "default_boot_grace")]
    pub boot_grace_s: u64,
    /// A guest whose last heartbeat is at most this old is healthy (default 3 s, at most the
    /// timeout): a snapshot records the guest's health at capture, a scheduled snapshot of an
    /// unhealthy guest is deferred, and a rollback prefers snapshots of a healthy guest.
    #[serde(default)]
    pub healthy_within_s: Option<u64>,
}

impl WatchdogConfig {
    /// The heartbeat age up to which the guest counts as healthy.
    pub fn healthy_within(&self) -> std::time::Duration {
        std::time::Duration::from_secs(
            self.healthy_within_s
                .unwrap_or(DEFAULT_HEALTHY_WITHIN_S)
                .min(self.heartbeat_timeout_s),
        )
    }
}

/// Default of `watchdog.healthy_within_s`: three missed one-second heartbeats.
pub const DEFAULT_HEALTHY_WITHIN_S: u64 = 3;

impl Default for WatchdogConfig {
    fn default() -> Self {
        Self {
            heartbeat_timeout_s: default_hb_timeout(),
            boot_grace_s: default_boot_grace(),
            healthy_within_s: None,
        }
    }
}

fn default_boot_grace() -> u64 {
    60
}

fn default_hb_timeout() -> u64 {
    10
}

/// Below this a slow guest would be rolled back for being slow, not for being dead.
pub const MIN_HEARTBEAT_TIMEOUT_S: u64 = 2;
/// Above this the watchdog would be disabled in all but name.
pub const MAX_HEARTBEAT_TIMEOUT_S: u64 = 3600;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DaemonConfig {
    /// Store, journal, disk layers and durable VM records.
    pub state_dir: PathBuf,
    /// Control socket and QEMU's sockets (the directory is made 0700).
    pub run_dir: PathBuf,
    /// HMAC key for manifests and the journal; created 0600 on first start; never in the store.
    pub key_path: Option<PathBuf>,
    /// People at the console: every request, `halt clear` and `resume` included.
    #[serde(default = "root_only")]
    pub console_uids: Vec<u32>,
    /// The host policy engine: triggers, snapshots, rollbacks and reads, never what only a
    /// person may decide. None by default: root is the console, and a policy engine gets a
    /// user of its own. A uid in both lists is refused at load ([`DaemonConfig::check_roles`]).
    #[serde(default)]
    pub policy_uids: Vec<u32>,
    /// Peers whose (primary) gid is listed are consoles / policy engines too.
    #[serde(default)]
    pub console_gids: Vec<u32>,
    #[serde(default)]
    pub policy_gids: Vec<u32>,
    /// The group that may reach the control socket (a name or a gid): the run directory becomes
    /// 0710 and the socket 0660 of that group. Default: none (root only, 0700/0600). Reaching
    /// the socket is not using it: the uid/gid lists still decide.
    pub socket_group: Option<GroupRef>,
    /// A directory of VM files (`NAME.toml`, one VM each: `[vm]` and its tables, no
    /// `[daemon]`). Optional: a daemon file with its own `[vm]` guards that one VM.
    pub vms_dir: Option<PathBuf>,
    /// At most this many snapshots capture at once across the VMs (rollbacks never wait).
    #[serde(default = "one_capture")]
    pub max_concurrent_captures: u32,
    /// Below this much free space in a VM's state directory a snapshot is refused
    /// (`ERR_SNAPSHOT_NO_SPACE`); the VM keeps running.
    #[serde(default = "default_min_free_mib")]
    pub min_free_mib: u64,
    /// Each VM's serial console log is rotated (`<vm>-serial.log.1`) before it grows past this:
    /// a guest printing nonstop can take at most twice this on the state filesystem.
    #[serde(default = "default_serial_log_max_kib")]
    pub serial_log_max_kib: u64,
    /// The hash that names the chunks of new snapshots: `"sha256"` (default: what every store
    /// before it holds, dedup continues across the upgrade) or `"blake3"` (~4x faster to hash:
    /// captures and full verifications spend less CPU; index version 1.1, which older backstop
    /// builds refuse to restore). Existing snapshots keep the hash they were written with and are
    /// read and verified with it.
    #[serde(default)]
    pub chunk_hash: backstop_store::ChunkHash,
    /// A capture whose store takes no state for this long (its buffer full) is abandoned, so a
    /// slow disk cannot keep the guest stalled (`ERR_SNAPSHOT_STALLED`).
    #[serde(default = "default_max_capture_stall_ms")]
    pub max_capture_stall_ms: u64,
    /// A VM's actor that shows no sign of life for this long is wedged: the supervisor ends its
    /// guest and HALTs that VM alone (`ERR_VM_ACTOR_WEDGED`); the others run on. Every tick and
    /// every step of a long operation is a sign of life, so a healthy actor is never near it.
    #[serde(default = "default_actor_silence_limit_secs")]
    pub actor_silence_limit_secs: u64,
    /// Where the OpenMetrics endpoint (`GET /metrics`) listens: `"unix:/path.sock"` or a
    /// loopback `"127.0.0.1:PORT"` / `"[::1]:PORT"` / `"localhost:PORT"`. Off when absent. See
    /// [`DaemonConfig::metrics_endpoint`]: any other address is refused at load.
    pub metrics: Option<String>,
}

/// Where the metrics endpoint listens (`daemon.metrics`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MetricsEndpoint {
    /// A Unix stream socket at this path.
    Unix(PathBuf),
    /// A loopback TCP address.
    Tcp(std::net::SocketAddr),
}

impl std::fmt::Display for MetricsEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MetricsEndpoint::Unix(p) => write!(f, "unix:{}", p.display()),
            MetricsEndpoint::Tcp(a) => write!(f, "{a}"),
        }
    }
}

/// Reads `daemon.metrics`: the metrics tell every VM's state, so they are served on this host
/// only (a Unix socket or a loopback address), never to the network.
pub fn parse_metrics_endpoint(value: &str) -> Result<MetricsEndpoint, ConfigError> {
    let bad = |message: String| ConfigError::Invalid {
        key: "daemon.metrics".into(),
        message,
    };
    if let Some(path) = value.strip_prefix("unix:") {
        let path = load::expand_path("daemon.metrics", Path::new(path))?;
        if !path.is_absolute() {
            return Err(bad(format!(
                "{value:?}: a Unix socket needs an absolute path (unix:/run/backstop/metrics.sock)"
            )));
        }
        return Ok(MetricsEndpoint::Unix(path));
    }
    let addr: std::net::SocketAddr = match value.strip_prefix("localhost:") {
        Some(port) => port
            .parse::<u16>()
            .map(|p| std::net::SocketAddr::from(([127, 0, 0, 1], p)))
            .map_err(|_| bad(format!("{value:?}: the port is not a number 0-65535")))?,
        None => value.parse().map_err(|_| {
            bad(format!(
                "{value:?} is neither unix:/PATH nor a loopback ADDRESS:PORT (127.0.0.1:9464)"
            ))
        })?,
    };
    if !addr.ip().is_loopback() {
        return Err(bad(format!(
            "{value:?} is not a loopback address: metrics are served on this host only \
             (127.0.0.1:PORT, [::1]:PORT or unix:/PATH)"
        )));
    }
    Ok(MetricsEndpoint::Tcp(addr))
}

/// A group by name or by number.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum GroupRef {
    Gid(u32),
    Name(String),
}

impl DaemonConfig {
    /// The gid of `socket_group`, looked up by name where it is one.
    pub fn socket_gid(&self) -> Result<Option<u32>, ConfigError> {
        match &self.socket_group {
            None => Ok(None),
            Some(GroupRef::Gid(g)) => Ok(Some(*g)),
            Some(GroupRef::Name(name)) => match nix::unistd::Group::from_name(name) {
                Ok(Some(g)) => Ok(Some(g.gid.as_raw())),
                Ok(None) => Err(ConfigError::Invalid {
                    key: "daemon.socket_group".into(),
                    message: format!("no group named {name:?} on this host"),
                }),
                Err(e) => Err(ConfigError::Invalid {
                    key: "daemon.socket_group".into(),
                    message: format!("cannot look up group {name:?}: {e}"),
                }),
            },
        }
    }

    /// The console and the policy engine are separate principals: a uid (or gid) in both
    /// lists would let the policy engine clear HALTED and continue a paused guest, which only
    /// a person may do, and is refused naming both keys. The console needs at least one uid.
    pub fn check_roles(&self) -> Result<(), ConfigError> {
        if self.console_uids.is_empty() {
            return Err(ConfigError::Invalid {
                key: "daemon.console_uids".into(),
                message: "at least one uid must be allowed on the console".into(),
            });
        }
        let both = |console: &[u32], policy: &[u32]| -> Vec<String> {
            let mut ids: Vec<u32> = console
                .iter()
                .filter(|id| policy.contains(id))
                .copied()
                .collect();
            ids.sort_unstable();
            ids.dedup();
            ids.iter().map(u32::to_string).collect()
        };
        for (what, console_key, policy_key, ids) in [
            (
                "uid",
                "daemon.console_uids",
                "daemon.policy_uids",
                both(&self.console_uids, &self.policy_uids),
            ),
            (
                "gid",
                "daemon.console_gids",
                "daemon.policy_gids",
                both(&self.console_gids, &self.policy_gids),
            ),
        ] {
            if !ids.is_empty() {
                let plural = if ids.len() == 1 { "" } else { "s" };
                return Err(ConfigError::Invalid {
                    key: policy_key.into(),
                    message: format!(
                        "{what}{plural} {} in both {console_key} and {policy_key}: the policy engine must be a principal of its own (only a person at the console clears HALTED or resumes a guest); remove {} from {policy_key}",
                        ids.join(", "),
                        if ids.len() == 1 { "it" } else { "them" },
                    ),
                });
            }
        }
        Ok(())
    }

    /// The metrics endpoint, if `daemon.metrics` asks for one.
    pub fn metrics_endpoint(&self) -> Result<Option<MetricsEndpoint>, ConfigError> {
        self.metrics
            .as_deref()
            .map(parse_metrics_endpoint)
            .transpose()
    }

    /// The host key (`key_path`, or `<state_dir>/keys/host.key`).
    pub fn key_path(&self) -> PathBuf {
        self.key_path
            .clone()
            .unwrap_or_else(|| self.state_dir.join("keys/host.key"))
    }

    pub fn socket_path(&self) -> PathBuf {
        self.run_dir.join("control.sock")
    }

    /// `${VAR}` expansion in the daemon's paths.
    pub(crate) fn expand(&mut self) -> Result<(), ConfigError> {
        self.state_dir = expand_path("daemon.state_dir", &self.state_dir)?;
        self.run_dir = expand_path("daemon.run_dir", &self.run_dir)?;
        if let Some(k) = &self.key_path {
            self.key_path = Some(expand_path("daemon.key_path", k)?);
        }
        if let Some(v) = &self.vms_dir {
            self.vms_dir = Some(expand_path("daemon.vms_dir", v)?);
        }
        Ok(())
    }
}

/// A config file's text.
pub(crate) fn read_config(path: &Path) -> Result<String, ConfigError> {
    std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.into(),
        source,
    })
}

fn one_capture() -> u32 {
    1
}

fn default_max_capture_stall_ms() -> u64 {
    2000
}

fn default_actor_silence_limit_secs() -> u64 {
    60
}

/// The wedge limit's bounds: below 5 s a slow fsync could pass for a wedge; above 10 min a
/// wedged VM would go unguarded (its watchdog does not run) for too long.
pub const ACTOR_SILENCE_LIMIT_SECS: std::ops::RangeInclusive<u64> = 5..=600;

fn default_serial_log_max_kib() -> u64 {
    8 << 10
}

/// The serial log's bound: below it a guest's boot would hardly fit, above it the console
/// could take a real share of a small state filesystem.
pub const SERIAL_LOG_MAX_KIB: std::ops::RangeInclusive<u64> = 64..=1 << 20;

fn default_min_free_mib() -> u64 {
    256
}

fn root_only() -> Vec<u32> {
    vec![0]
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AccelChoice {
    Auto,
    Tcg,
    Kvm,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmConfig {
    pub name: String,
    #[serde(default = "default_backend")]
    pub backend: String,
    #[serde(default = "default_accel")]
    pub accel: AccelChoice,
    #[serde(default = "default_qemu")]
    pub qemu_binary: PathBuf,
    #[serde(default = "default_qemu_img")]
    pub qemu_img: PathBuf,
    #[serde(default = "default_machine")]
    pub machine: String,
    /// Guest RAM (qemu and kvm backends; a libvirt domain has its own).
    #[serde(default)]
    pub memory_mib: u64,
    #[serde(default = "one")]
    pub vcpus: u32,
    /// The guest kernel (QEMU backend; the KVM backend runs its built-in program).
    #[serde(default)]
    pub kernel: PathBuf,
    pub initrd: Option<PathBuf>,
    #[serde(default)]
    pub append: String,
    #[serde(default)]
    pub nics: Vec<String>,
    /// What a rollback leaves of the guest's network: `down` (default: every NIC's link stays
    /// down until a person runs `device grant NIC`) or `up` (the links come back as soon as the
    /// restored guest runs; the rollback's record says so). Passthrough devices never come back
    /// by themselves.
    #[serde(default)]
    pub links_after_rollback: LinksAfterRollback,
    #[serde(default)]
    pub watchdog_device: bool,
    /// Where heartbeats come from: `backstop-agent` (default: `HB <n>` lines on
    /// `org.backstop.agent.0`) or `qemu-ga` (pongs of the stock QEMU guest agent on
    /// `org.qemu.guest_agent.0`, which this adds to the VM). QEMU backend only.
    #[serde(default)]
    pub heartbeat: backstop_hypervisor::HeartbeatSource,
    /// `seabios` (QEMU's default BIOS) or `ovmf` (UEFI: its variable store is captured with the
    /// VM like a disk, see `crate::firmware`). QEMU backend only.
    #[serde(default)]
    pub firmware: Firmware,
    /// OVMF's code image (read-only), for `firmware = "ovmf"`.
    #[serde(default = "default_ovmf_code")]
    pub ovmf_code: PathBuf,
    /// The variable store every new VM's own copy starts from, for `firmware = "ovmf"`.
    #[serde(default = "default_ovmf_vars")]
    pub ovmf_vars_template: PathBuf,
    /// QEMU's `-cpu` model (and options), e.g. `max` or `host`; QEMU's default when unset.
    pub cpu: Option<String>,
    /// Extra NICs on host tap devices (a bridge the operator made), beside `nics`.
    #[serde(default)]
    pub tap_nics: Vec<TapNic>,
    #[serde(default)]
    pub disks: Vec<DiskConfig>,
    /// After each snapshot backstop maps the guest's RAM with huge pages again (a snapshot
    /// splits them; the next one's pause grows with the number of small ones): `resident`
    /// (default) only ranges the guest has written, so QEMU's memory never grows; `all` every
    /// range, the never-written ones too: the guest's whole RAM becomes resident (as with
    /// QEMU's `-mem-prealloc`), and the write-protection start inside the pause is ~4 ms shorter
    /// at 1 GiB (README). `all` applies to the QEMU backend on QEMU ≥ 9.0 only; on
    /// 7.2/8.x and for a libvirt domain it falls back to `resident` with a warning.
    #[serde(default)]
    pub huge_pages: backstop_qemu::huge_pages::HugePages,
    /// Whether a capture may send `migrate` before `stop`, so that QEMU's setup (it reads one
    /// byte of every page of guest RAM: ~10-25 ms at 1 GiB) runs while the guest still runs
    /// and only the rest is inside the pause: `auto` (default) on QEMU ≥ 9.0 only,
    /// `migrate-first` on 7.2/8.x too (where QEMU resumes the guest itself, so a capture
    /// whose disk switch came after that resume is discarded and taken again, `stop` first),
    /// `stop-first` never. The lead is learnt per QEMU (README, "`migrate` before `stop`").
    /// QEMU backend.
    #[serde(default)]
    pub capture_order: backstop_qemu::version::CaptureOrder,
    /// `backend = "libvirt"`: the running libvirt domain to adopt (`[vm.libvirt]`).
    pub libvirt: Option<LibvirtSection>,
}

/// `[vm.libvirt]`: which running domain to adopt, over which connection.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LibvirtSection {
    /// `qemu:///system` (a local connection: the capture stream's fd is passed over it).
    pub uri: String,
    /// The domain's name, or
    pub domain: Option<String>,
    /// its UUID (both given: they must name the same domain).
    pub uuid: Option<String>,
    /// Where the disk layers (and restore images) go: a directory libvirt's QEMU user can
    /// traverse, unlike the 0700 state directory. Default `/var/lib/libvirt/images/backstop/<vm>`.
    pub layers_dir: Option<PathBuf>,
    /// How RAM is captured: `background` (default; needs `vm.unprivileged_userfaultfd=1`),
    /// `precopy` (live pre-copy, pause at switchover) or `auto`.
    #[serde(default)]
    pub capture: backstop_libvirt::CaptureMode,
    /// What a start after a crash of backstopd (no clean stop) does with the domain that ran
    /// on unwatched meanwhile: `rollback` (default) to the newest verified snapshot, or
    /// `reattach` as it runs when it is still the domain last guarded (same UUID, QEMU
    /// process and block graph), else the rollback.
    #[serde(default)]
    pub after_crash: AfterCrash,
    /// Where heartbeats come from: `auto` (default: backstop's agent where the domain has its
    /// channel, else the QEMU guest agent), `backstop-agent`, or `qemu-ga` (the stock agent,
    /// pinged through libvirt: nothing of backstop's in the guest).
    #[serde(default)]
    pub heartbeat: backstop_libvirt::LibvirtHeartbeat,
}

/// `[vm.libvirt] after_crash`: what the next start does with an adopted domain that ran on
/// while no backstopd watched it (kill -9, OOM, a power cut of the daemon alone).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AfterCrash {
    /// Whatever it did unwatched is not trusted: back to the newest verified snapshot.
    #[default]
    Rollback,
    /// Guarded again as it runs when the domain found is the one last guarded; anything
    /// else takes the rollback.
    Reattach,
}

impl VmConfig {
    /// Every NIC's id: the user-mode ones (`nics`), then those on host taps (`tap_nics`). All
    /// are taken down on every rollback, and each can be granted again.
    pub fn all_nics(&self) -> Vec<String> {
        self.nics
            .iter()
            .cloned()
            .chain(self.tap_nics.iter().map(|t| t.id.clone()))
            .collect()
    }
}

impl Config {
    /// Where the disk layers live: the state directory, or for a libvirt domain a directory
    /// its unprivileged QEMU can reach.
    pub fn layers_dir(&self) -> PathBuf {
        match &self.vm.libvirt {
            Some(l) => l.layers_dir.clone().unwrap_or_else(|| {
                PathBuf::from("/var/lib/libvirt/images/backstop").join(&self.vm.name)
            }),
            None => self
                .pinned_layers_dir
                .clone()
                .unwrap_or_else(|| self.daemon.state_dir.join("disks")),
        }
    }
}

fn default_backend() -> String {
    "qemu".into()
}
fn default_accel() -> AccelChoice {
    AccelChoice::Auto
}
fn default_qemu() -> PathBuf {
    "qemu-system-x86_64".into()
}
fn default_qemu_img() -> PathBuf {
    "qemu-img".into()
}
/// `vm.links_after_rollback`: whether NIC links come back by themselves after a rollback.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LinksAfterRollback {
    #[default]
    Down,
    Up,
}

/// The VM's firmware.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Firmware {
    #[default]
    Seabios,
    Ovmf,
}

/// A NIC on a host tap device (`-netdev tap,ifname=…,script=no`): the tap must exist and be
/// attached to its bridge before the VM starts; backstop never configures host networking.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TapNic {
    pub id: String,
    pub ifname: String,
}

fn default_ovmf_code() -> PathBuf {
    "/usr/share/OVMF/OVMF_CODE_4M.fd".into()
}
fn default_ovmf_vars() -> PathBuf {
    "/usr/share/OVMF/OVMF_VARS_4M.fd".into()
}

fn default_machine() -> String {
    "q35".into()
}
fn one() -> u32 {
    1
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DiskSnapshotMode {
    /// Captured by every snapshot and reverted by every rollback.
    Capture,
    /// State that must survive rollback: never captured, never reverted.
    Exclude,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskConfig {
    pub id: String,
    /// For a captured disk: the base image, never written (layers go on top).
    /// For an excluded disk: the image the guest writes directly (qcow2).
    pub path: PathBuf,
    #[serde(default = "qcow2")]
    pub format: String,
    #[serde(default = "capture")]
    pub snapshot: DiskSnapshotMode,
    /// Create an empty image of this size at start when `path` does not exist (excluded disks).
    pub create_size_mib: Option<u64>,
}

fn qcow2() -> String {
    "qcow2".into()
}
fn capture() -> DiskSnapshotMode {
    DiskSnapshotMode::Capture
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RollbackConfig {
    /// How long a guest gets to release a device before the process ends anyway.
    #[serde(default = "default_revoke_ms")]
    pub revoke_timeout_ms: u64,
    /// How long the RAM and device state of the VM a rollback abandons may take to save into
    /// its forensic snapshot (`"5s"`, `"800ms"`; 1 ms to 10 min). Saved beside the restore,
    /// not before it; past the budget the save is cancelled and the forensic snapshot keeps
    /// the disks alone (`ram: false` with the reason).
    #[serde(default = "default_forensic_ram_budget")]
    pub forensic_ram_budget: String,
    /// Which rollbacks keep that RAM: any of `console` (a person's non-emergency rollback),
    /// `policy` (the policy engine's and host triggers' non-emergency ones), `emergency` (every
    /// emergency rollback but the watchdog's) and `watchdog` (heartbeat or device watchdog
    /// expiry). Default: all four, each bounded by `forensic_ram_budget`; a VM whose QEMU no
    /// longer answers has no RAM to save, and its forensic snapshot says why. `[]` keeps none.
    #[serde(default = "default_forensic_ram_for")]
    pub forensic_ram_for: Vec<String>,
    /// Keep a standby QEMU for this VM (`docs/standby.md`): started after each boot and
    /// rollback, paused and waiting for state with its guest RAM already allocated, it takes
    /// the place of the fresh QEMU a rollback would launch. Costs a second guest-sized
    /// allocation. QEMU backend only, and not with VFIO devices, tap NICs, disks snapshots
    /// exclude, or UEFI firmware.
    #[serde(default)]
    pub standby: bool,
    /// With `standby`: keep the newest snapshot a rollback would choose already loaded into
    /// the standby (`docs/standby.md`, "Preloaded"), so a rollback to it skips the load. Costs
    /// a state load (CPU and the snapshot's reads) after every snapshot.
    #[serde(default)]
    pub preload: bool,
}

impl Default for RollbackConfig {
    fn default() -> Self {
        Self {
            revoke_timeout_ms: default_revoke_ms(),
            forensic_ram_budget: default_forensic_ram_budget(),
            forensic_ram_for: default_forensic_ram_for(),
            standby: false,
            preload: false,
        }
    }
}

impl RollbackConfig {
    /// `forensic_ram_budget`, parsed (checked at load: a bad one never gets here).
    pub fn forensic_ram_budget(&self) -> std::time::Duration {
        crate::forensic::parse_ram_budget(&self.forensic_ram_budget)
            .unwrap_or(std::time::Duration::from_secs(5))
    }
}

fn default_forensic_ram_budget() -> String {
    "5s".into()
}

/// Every kind: the abandoned RAM is the evidence of what the guest was doing (spec/004), most of
/// all when something went wrong enough for an emergency or the watchdog; the budget bounds
/// what it costs, and it is saved beside the restore, not before it.
fn default_forensic_ram_for() -> Vec<String> {
    ["console", "policy", "emergency", "watchdog"]
        .map(String::from)
        .to_vec()
}

fn default_revoke_ms() -> u64 {
    2_000
}

mod load;
pub(crate) use load::{expand_path, one_line};

#[cfg(test)]
mod tests;
