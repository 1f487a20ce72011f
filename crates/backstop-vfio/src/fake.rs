//! A fake sysfs tree with a fake kernel behind it, for tests (feature `fake-sysfs`).
//!
//! The tree has the files the real one has (`bus/pci/devices/<addr>/{driver,driver_override,
//! reset}`, `bus/pci/drivers/<name>/unbind`, `bus/pci/drivers_probe`) as regular files and
//! symlinks. A thread watches them with inotify and acts as the kernel would on each write:
//! `unbind` removes the `driver` link, `drivers_probe` binds the device to its
//! `driver_override`. Every write is logged in the order the kernel saw it, with the driver the
//! device was bound to at that moment, so a test can check the order and that the reset came
//! while no driver held the device.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify, WatchDescriptor};

/// One write the fake kernel saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelEvent {
    /// Relative to the root: `bus/pci/devices/0000:01:00.0/reset`, `bus/pci/drivers/vfio-pci/unbind`.
    pub file: String,
    pub value: String,
    /// The driver the device concerned was bound to when the kernel handled the write.
    pub bound_to: Option<String>,
}

#[derive(Debug)]
enum Watched {
    Unbind { driver: String },
    Probe,
    Reset { addr: String },
    Override { addr: String },
}

struct Shared {
    root: PathBuf,
    inotify: Inotify,
    watches: Mutex<HashMap<WatchDescriptor, Watched>>,
    log: Mutex<Vec<KernelEvent>>,
    bind_on_probe: AtomicBool,
    stop: AtomicBool,
}

pub struct FakeSysfs {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl FakeSysfs {
    /// Creates the tree under `root` with the given drivers loaded, and starts the kernel.
    pub fn new(root: &Path, drivers: &[&str]) -> io::Result<FakeSysfs> {
        std::fs::create_dir_all(root.join("bus/pci/devices"))?;
        std::fs::write(root.join("bus/pci/drivers_probe"), "")?;
        let inotify = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC)?;
        let shared = Arc::new(Shared {
            root: root.to_path_buf(),
            inotify,
            watches: Mutex::new(HashMap::new()),
            log: Mutex::new(Vec::new()),
            bind_on_probe: AtomicBool::new(true),
            stop: AtomicBool::new(false),
        });
        shared.watch(&root.join("bus/pci/drivers_probe"), Watched::Probe)?;
        for d in drivers {
            shared.load_driver(d)?;
        }
        let kernel_side = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("fake-kernel".into())
            .spawn(move || kernel(&kernel_side))?;
        Ok(FakeSysfs {
            shared,
            thread: Some(thread),
        })
    }

    pub fn root(&self) -> &Path {
        &self.shared.root
    }

    /// Adds `bus/pci/drivers/<name>/` (as if its module were loaded).
    pub fn load_driver(&self, name: &str) -> io::Result<()> {
        self.shared.load_driver(name)
    }

    /// Adds a PCI device, bound to `driver` (if any), with `driver_override` set (if any).
    pub fn add_device(
        &self,
        addr: &str,
        driver: Option<&str>,
        driver_override: Option<&str>,
    ) -> io::Result<()> {
        let dir = self.device_dir(addr);
        std::fs::create_dir_all(&dir)?;
        std::fs::write(
            dir.join("driver_override"),
            format!("{}\n", driver_override.unwrap_or("(null)")),
        )?;
        std::fs::write(dir.join("reset"), "")?;
        if let Some(d) = driver {
            std::os::unix::fs::symlink(
                self.shared.root.join("bus/pci/drivers").join(d),
                dir.join("driver"),
            )?;
        }
        self.shared.watch(
            &dir.join("reset"),
            Watched::Reset {
                addr: addr.to_string(),
            },
        )?;
        self.shared.watch(
            &dir.join("driver_override"),
            Watched::Override {
                addr: addr.to_string(),
            },
        )
    }

    /// Takes one attribute away (a device without a reset method has no `reset`).
    pub fn remove_attribute(&self, addr: &str, name: &str) -> io::Result<()> {
        std::fs::remove_file(self.device_dir(addr).join(name))
    }

    /// Whether `drivers_probe` binds anything (false: the host driver refuses the device).
    pub fn set_bind_on_probe(&self, bind: bool) {
        self.shared.bind_on_probe.store(bind, Ordering::SeqCst);
    }

    /// The driver the device is bound to now.
    pub fn driver(&self, addr: &str) -> Option<String> {
        self.shared.driver(addr)
    }

    /// Every write the kernel handled so far, in order.
    pub fn events(&self) -> Vec<KernelEvent> {
        self.shared.log.lock().unwrap().clone()
    }

    /// Waits until the kernel has handled `n` writes (it runs on its own thread).
    pub fn wait_events(&self, n: usize, timeout: Duration) -> Vec<KernelEvent> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let ev = self.events();
            if ev.len() >= n || std::time::Instant::now() >= deadline {
                return ev;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn device_dir(&self, addr: &str) -> PathBuf {
        self.shared.root.join("bus/pci/devices").join(addr)
    }
}

impl Drop for FakeSysfs {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Shared {
    fn load_driver(&self, name: &str) -> io::Result<()> {
        let dir = self.root.join("bus/pci/drivers").join(name);
        std::fs::create_dir_all(&dir)?;
        std::fs::write(dir.join("bind"), "")?;
        std::fs::write(dir.join("unbind"), "")?;
        self.watch(
            &dir.join("unbind"),
            Watched::Unbind {
                driver: name.to_string(),
            },
        )
    }

    fn watch(&self, path: &Path, what: Watched) -> io::Result<()> {
        let wd = self
            .inotify
            .add_watch(path, AddWatchFlags::IN_CLOSE_WRITE)?;
        self.watches.lock().unwrap().insert(wd, what);
        Ok(())
    }

    fn device_dir(&self, addr: &str) -> PathBuf {
        self.root.join("bus/pci/devices").join(addr)
    }

    fn driver(&self, addr: &str) -> Option<String> {
        std::fs::read_link(self.device_dir(addr).join("driver"))
            .ok()
            .and_then(|t| t.file_name().map(|n| n.to_string_lossy().into_owned()))
    }

    fn rel(&self, p: &Path) -> String {
        p.strip_prefix(&self.root)
            .unwrap_or(p)
            .display()
            .to_string()
    }
}

fn kernel(s: &Shared) {
    while !s.stop.load(Ordering::SeqCst) {
        let events = match s.inotify.read_events() {
            Ok(ev) => ev,
            Err(_) => {
                std::thread::sleep(Duration::from_millis(1));
                continue;
            }
        };
        for ev in events {
            // A removed file's watch ends with IN_IGNORED: not a write.
            if !ev.mask.contains(AddWatchFlags::IN_CLOSE_WRITE) {
                continue;
            }
            let watches = s.watches.lock().unwrap();
            let Some(what) = watches.get(&ev.wd) else {
                continue;
            };
            handle(s, what);
        }
    }
}

fn handle(s: &Shared, what: &Watched) {
    let read = |p: &Path| {
        std::fs::read_to_string(p)
            .unwrap_or_default()
            .trim()
            .to_string()
    };
    let (file, value, addr) = match what {
        Watched::Unbind { driver } => {
            let f = s.root.join("bus/pci/drivers").join(driver).join("unbind");
            let v = read(&f);
            (f, v.clone(), v)
        }
        Watched::Probe => {
            let f = s.root.join("bus/pci/drivers_probe");
            let v = read(&f);
            (f, v.clone(), v)
        }
        Watched::Reset { addr } => {
            let f = s.device_dir(addr).join("reset");
            (f.clone(), read(&f), addr.clone())
        }
        Watched::Override { addr } => {
            let f = s.device_dir(addr).join("driver_override");
            (f.clone(), read(&f), addr.clone())
        }
    };
    let bound_to = s.driver(&addr);
    s.log.lock().unwrap().push(KernelEvent {
        file: s.rel(&file),
        value: value.clone(),
        bound_to: bound_to.clone(),
    });
    let dev = s.device_dir(&addr);
    match what {
        Watched::Unbind { driver } if bound_to.as_deref() == Some(driver) => {
            let _ = std::fs::remove_file(dev.join("driver"));
        }
        Watched::Probe if bound_to.is_none() && s.bind_on_probe.load(Ordering::SeqCst) => {
            let ov = read(&dev.join("driver_override"));
            let target = s.root.join("bus/pci/drivers").join(&ov);
            if !ov.is_empty() && ov != "(null)" && target.is_dir() {
                let _ = std::os::unix::fs::symlink(target, dev.join("driver"));
            }
        }
        _ => {}
    }
}
