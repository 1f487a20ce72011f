//! The host side of VFIO PCI passthrough, through sysfs.
//!
//! A PCI device handed to a guest is bound to `vfio-pci` on the host while the grant lasts, and
//! given back to its own host driver when the grant ends — by revocation, lease expiry or any
//! rollback. Giving it back is four writes, in this order:
//!
//! 1. `<dev>/driver/unbind` ← address: detach it from `vfio-pci` (no user is left: the hypervisor
//!    process that held it has ended, or released it);
//! 2. `<dev>/reset` ← `1`: a function reset while no driver touches it, so nothing the guest left
//!    in the device (memory, DMA setup, firmware state) reaches the host driver;
//! 3. `<dev>/driver_override` ← host driver: only that driver may claim it now (and never
//!    `vfio-pci` by accident);
//! 4. `bus/pci/drivers_probe` ← address: the host driver binds it;
//!
//! then the `driver` link is read back until it names the host driver. Every step is bounded in
//! time and names itself in its error; a caller inside a rollback turns any error into HALTED.
//!
//! Everything goes through a sysfs root ([`Sysfs::new`]) so tests run on a fake tree
//! ([`fake`], feature `fake-sysfs`). This crate must never decide *when* to bind or release: the
//! engine does. It never writes outside `<root>/bus/pci/`, and only to a device named by a
//! validated PCI address.

use backstop_common::ErrorCode;
#[cfg(any(test, feature = "fake-sysfs"))]
pub mod fake;

use std::fmt;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The host driver a passthrough device is bound to while a guest holds it.
pub const VFIO_DRIVER: &str = "vfio-pci";

/// Where sysfs is mounted on a real host.
pub const HOST_SYSFS: &str = "/sys";

/// How long a step may take (a sysfs write, or the kernel binding a driver) by default.
pub const DEFAULT_SETTLE: Duration = Duration::from_secs(5);

/// A PCI address in sysfs form, `dddd:bb:dd.f` (lowercase hex), validated: it is the only
/// part of a sysfs path that comes from config.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PciAddress(String);

impl PciAddress {
    pub fn parse(text: &str) -> Result<PciAddress, VfioError> {
        let bad = || VfioError::InvalidAddress(text.to_string());
        let b = text.as_bytes();
        let hex = |s: &[u8]| {
            s.iter()
                .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(c))
        };
        if b.len() != 12 || b[4] != b':' || b[7] != b':' || b[10] != b'.' {
            return Err(bad());
        }
        if !hex(&b[0..4]) || !hex(&b[5..7]) || !hex(&b[8..10]) || !(b'0'..=b'7').contains(&b[11]) {
            return Err(bad());
        }
        // Device numbers stop at 0x1f.
        if b[8] > b'1' {
            return Err(bad());
        }
        Ok(PciAddress(text.to_string()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for PciAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A kernel driver name as it appears under `bus/pci/drivers/`.
pub fn valid_driver_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name != "."
        && name != ".."
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
}

/// One write this crate made, relative to the sysfs root (for the audit journal).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SysfsWrite {
    pub file: String,
    pub value: String,
}

impl fmt::Display for SysfsWrite {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} <- {}", self.file, self.value)
    }
}

/// What giving a device back to its host driver did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Release {
    pub address: PciAddress,
    /// The driver the device was bound to before (normally `vfio-pci`), if any.
    pub was_bound_to: Option<String>,
    /// The device was already on its host driver with no override to `vfio-pci`: nothing
    /// was written.
    pub already_released: bool,
    pub writes: Vec<SysfsWrite>,
}

impl Release {
    /// One line for the journal: `vfio 0000:01:00.0: unbound from vfio-pci, reset, bound to nvidia`.
    pub fn summary(&self, host_driver: &str) -> String {
        if self.already_released {
            return format!("vfio {}: on host driver {host_driver}", self.address);
        }
        let from = match &self.was_bound_to {
            Some(d) => format!("unbound from {d}, "),
            None => String::new(),
        };
        format!(
            "vfio {}: {from}reset, rebound to {host_driver}",
            self.address
        )
    }
}

#[derive(Debug, thiserror::Error)]
pub enum VfioError {
    #[error("invalid PCI address {0:?} (want dddd:bb:dd.f, lowercase hex)")]
    InvalidAddress(String),
    #[error("invalid driver name {0:?}")]
    InvalidDriver(String),
    #[error("PCI device {address} not found at {}", path.display())]
    NoDevice { address: String, path: PathBuf },
    #[error("{step}: write {value:?} to {}: {source}", path.display())]
    Write {
        step: &'static str,
        path: PathBuf,
        value: String,
        source: std::io::Error,
    },
    #[error("{step}: write {value:?} to {} did not finish within {timeout:?}", path.display())]
    WriteTimeout {
        step: &'static str,
        path: PathBuf,
        value: String,
        timeout: Duration,
    },
    #[error("{step}: read {}: {source}", path.display())]
    Read {
        step: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{step}: {address} is bound to {found} after {waited:?}, expected {expected}", found = found.as_deref().unwrap_or("no driver"))]
    WrongDriver {
        step: &'static str,
        address: String,
        expected: String,
        found: Option<String>,
        waited: Duration,
    },
    #[error("driver_override: {address} reads {found:?} after writing {expected:?}")]
    OverrideMismatch {
        address: String,
        expected: String,
        found: String,
    },
}

impl VfioError {
    /// Stable code for the console and the journal.
    pub fn code(&self) -> ErrorCode {
        match self {
            VfioError::InvalidAddress(_) | VfioError::InvalidDriver(_) => ErrorCode::VfioConfig,
            _ => ErrorCode::VfioSysfs,
        }
    }
}

/// sysfs, rooted somewhere (`/sys` on a host, a temporary tree in tests).
#[derive(Debug, Clone)]
pub struct Sysfs {
    root: PathBuf,
    settle: Duration,
}

impl Sysfs {
    pub fn new(root: impl Into<PathBuf>) -> Sysfs {
        Sysfs {
            root: root.into(),
            settle: DEFAULT_SETTLE,
        }
    }

    /// The bound on each step.
    pub fn with_settle(mut self, settle: Duration) -> Sysfs {
        self.settle = settle;
        self
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    fn device_dir(&self, a: &PciAddress) -> PathBuf {
        self.root.join("bus/pci/devices").join(a.as_str())
    }

    fn rel(&self, p: &Path) -> String {
        p.strip_prefix(&self.root)
            .unwrap_or(p)
            .display()
            .to_string()
    }

    fn existing_device(&self, a: &PciAddress) -> Result<PathBuf, VfioError> {
        let dir = self.device_dir(a);
        if dir.is_dir() {
            Ok(dir)
        } else {
            Err(VfioError::NoDevice {
                address: a.to_string(),
                path: dir,
            })
        }
    }

    /// The driver the device is bound to now, if any.
    pub fn driver(&self, a: &PciAddress) -> Result<Option<String>, VfioError> {
        let dir = self.existing_device(a)?;
        let link = dir.join("driver");
        match std::fs::read_link(&link) {
            Ok(target) => Ok(target.file_name().map(|n| n.to_string_lossy().into_owned())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(VfioError::Read {
                step: "read driver",
                path: link,
                source,
            }),
        }
    }

    /// `driver_override` as the kernel reports it (`None` when unset).
    pub fn driver_override(&self, a: &PciAddress) -> Result<Option<String>, VfioError> {
        let path = self.existing_device(a)?.join("driver_override");
        let text = std::fs::read_to_string(&path).map_err(|source| VfioError::Read {
            step: "read driver_override",
            path: path.clone(),
            source,
        })?;
        let v = text.trim();
        Ok(if v.is_empty() || v == "(null)" {
            None
        } else {
            Some(v.to_string())
        })
    }

    /// Hands a device to `vfio-pci` for a grant: unbind from the host driver, override to
    /// `vfio-pci`, probe, and check the binding.
    pub fn bind_to_vfio(&self, a: &PciAddress) -> Result<Vec<SysfsWrite>, VfioError> {
        let dir = self.existing_device(a)?;
        let mut writes = Vec::new();
        let current = self.driver(a)?;
        if current.as_deref() == Some(VFIO_DRIVER) {
            return Ok(writes);
        }
        if let Some(d) = &current {
            self.write(
                &mut writes,
                "unbind",
                &dir.join("driver/unbind"),
                a.as_str(),
            )?;
            self.wait_driver(a, "unbind", None, Some(d))?;
        }
        self.set_override(&mut writes, a, &dir, VFIO_DRIVER)?;
        self.write(
            &mut writes,
            "drivers_probe",
            &self.root.join("bus/pci/drivers_probe"),
            a.as_str(),
        )?;
        self.wait_driver(a, "verify", Some(VFIO_DRIVER), None)?;
        Ok(writes)
    }

    /// Gives a device back to `host_driver`: unbind, function reset, driver_override, probe,
    /// verify (see the crate docs for why in this order). Idempotent: a device already on its
    /// host driver, with no override to `vfio-pci`, is left alone.
    pub fn release_to_host(&self, a: &PciAddress, host_driver: &str) -> Result<Release, VfioError> {
        if !valid_driver_name(host_driver) || host_driver == VFIO_DRIVER {
            return Err(VfioError::InvalidDriver(host_driver.to_string()));
        }
        let dir = self.existing_device(a)?;
        let current = self.driver(a)?;
        let mut release = Release {
            address: a.clone(),
            was_bound_to: current.clone(),
            already_released: false,
            writes: Vec::new(),
        };
        if current.as_deref() == Some(host_driver)
            && self.driver_override(a)?.as_deref() != Some(VFIO_DRIVER)
        {
            release.already_released = true;
            return Ok(release);
        }
        let w = &mut release.writes;
        // 1. Detach from whatever holds it (vfio-pci, normally).
        if let Some(d) = &current {
            self.write(w, "unbind", &dir.join("driver/unbind"), a.as_str())?;
            self.wait_driver(a, "unbind", None, Some(d))?;
        }
        // 2. Reset while no driver touches it.
        self.write(w, "reset", &dir.join("reset"), "1")?;
        // 3. Only the host driver may claim it.
        self.set_override(w, a, &dir, host_driver)?;
        // 4. Let it bind, and check that it did.
        self.write(
            w,
            "drivers_probe",
            &self.root.join("bus/pci/drivers_probe"),
            a.as_str(),
        )?;
        self.wait_driver(a, "verify", Some(host_driver), None)?;
        Ok(release)
    }

    fn set_override(
        &self,
        writes: &mut Vec<SysfsWrite>,
        a: &PciAddress,
        dir: &Path,
        driver: &str,
    ) -> Result<(), VfioError> {
        self.write(
            writes,
            "driver_override",
            &dir.join("driver_override"),
            driver,
        )?;
        let found = self.driver_override(a)?;
        if found.as_deref() != Some(driver) {
            return Err(VfioError::OverrideMismatch {
                address: a.to_string(),
                expected: driver.to_string(),
                found: found.unwrap_or_default(),
            });
        }
        Ok(())
    }

    /// Waits until the device's driver is `want` (`None`: unbound) — or, with `away_from`,
    /// until it is no longer that driver.
    fn wait_driver(
        &self,
        a: &PciAddress,
        step: &'static str,
        want: Option<&str>,
        away_from: Option<&str>,
    ) -> Result<(), VfioError> {
        let started = Instant::now();
        loop {
            let now = self.driver(a)?;
            let done = match away_from {
                Some(old) => now.as_deref() != Some(old),
                None => now.as_deref() == want,
            };
            if done {
                return Ok(());
            }
            if started.elapsed() >= self.settle {
                return Err(VfioError::WrongDriver {
                    step,
                    address: a.to_string(),
                    expected: want.unwrap_or("no driver").to_string(),
                    found: now,
                    waited: started.elapsed(),
                });
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Writes one sysfs attribute (never creating a file), bounded in time: a write into a
    /// driver that hangs in the kernel fails the step instead of hanging the caller.
    fn write(
        &self,
        writes: &mut Vec<SysfsWrite>,
        step: &'static str,
        path: &Path,
        value: &str,
    ) -> Result<(), VfioError> {
        tracing::debug!(step, path = %path.display(), value, "sysfs write");
        let (tx, rx) = mpsc::channel();
        let (p, v) = (path.to_path_buf(), value.to_string());
        let spawned = std::thread::Builder::new()
            .name("sysfs-write".into())
            .spawn(move || {
                let r = std::fs::OpenOptions::new()
                    .write(true)
                    .truncate(true)
                    .open(&p)
                    .and_then(|mut f| f.write_all(v.as_bytes()));
                let _ = tx.send(r);
            });
        let result = match spawned {
            Ok(_) => rx
                .recv_timeout(self.settle)
                .map_err(|_| VfioError::WriteTimeout {
                    step,
                    path: path.to_path_buf(),
                    value: value.to_string(),
                    timeout: self.settle,
                })?,
            Err(e) => Err(e),
        };
        result.map_err(|source| VfioError::Write {
            step,
            path: path.to_path_buf(),
            value: value.to_string(),
            source,
        })?;
        writes.push(SysfsWrite {
            file: self.rel(path),
            value: value.to_string(),
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests;
