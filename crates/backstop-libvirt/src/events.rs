//! libvirt's domain events for the adopted domain: lifecycle (stopped, crashed, suspended by
//! the watchdog), the watchdog's own event, and `DEVICE_REMOVED`.
//!
//! They make supervision prompt, never the only source of truth: each event wakes the VM's
//! actor, which then reads the domain's state as it does at every tick (level-triggered), so an
//! event lost (a full queue, a dead connection before the reconnect) hides nothing; an event
//! only names what happened. `DEVICE_REMOVED` ends the bounded wait of a revocation (the live
//! XML is polled in the same bound as a fallback).
//!
//! The numbers below are libvirt's public ABI (`virDomainEventType` and friends); with the
//! `libvirt` feature they are checked against `virt-sys` at compile time. The parsing here is
//! pure (unit tested without libvirt); registering callbacks needs the feature.

/// What libvirt told us about the domain, as parsed on libvirt's event thread.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DomainEvent {
    /// `VIR_DOMAIN_EVENT_ID_LIFECYCLE`: `event` is a `virDomainEventType`, `detail` its
    /// per-type detail.
    Lifecycle { event: i32, detail: i32 },
    /// `VIR_DOMAIN_EVENT_ID_WATCHDOG`: the emulated watchdog fired; `action` is what libvirt
    /// did (`virDomainEventWatchdogAction`).
    Watchdog { action: i32 },
    /// `VIR_DOMAIN_EVENT_ID_DEVICE_REMOVED`: the device with this alias left the domain.
    DeviceRemoved { alias: String },
}

pub const EVENT_STARTED: i32 = 2;
pub const EVENT_SUSPENDED: i32 = 3;
pub const EVENT_RESUMED: i32 = 4;
pub const EVENT_STOPPED: i32 = 5;
pub const EVENT_SHUTDOWN: i32 = 6;
pub const EVENT_CRASHED: i32 = 8;
pub const STOPPED_SHUTDOWN: i32 = 0;
pub const STOPPED_DESTROYED: i32 = 1;
pub const SUSPENDED_WATCHDOG: i32 = 3;

const EVENT_NAMES: &[&str] = &[
    "defined",
    "undefined",
    "started",
    "suspended",
    "resumed",
    "stopped",
    "shutdown",
    "pmsuspended",
    "crashed",
];
const STOPPED_DETAILS: &[&str] = &[
    "shutdown",
    "destroyed",
    "crashed",
    "migrated",
    "saved",
    "failed",
    "from-snapshot",
    "recreated",
];
const SUSPENDED_DETAILS: &[&str] = &[
    "paused",
    "migrated",
    "ioerror",
    "watchdog",
    "restored",
    "from-snapshot",
    "api-error",
    "postcopy",
    "postcopy-failed",
    "guest-shutdown",
];
const WATCHDOG_ACTIONS: &[&str] = &[
    "none",
    "pause",
    "reset",
    "poweroff",
    "shutdown",
    "debug",
    "inject-nmi",
];

fn name_of(table: &[&str], v: i32) -> String {
    usize::try_from(v)
        .ok()
        .and_then(|i| table.get(i))
        .map_or_else(|| format!("unknown({v})"), |s| (*s).to_string())
}

/// The name of a watchdog action (`pause`, `reset`, …).
pub fn watchdog_action(action: i32) -> String {
    name_of(WATCHDOG_ACTIONS, action)
}

/// What supervision makes of an event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Stopped on purpose by someone else (`virsh destroy`, `virsh shutdown`, the guest
    /// powering off): HALTED.
    EndedOutside(String),
    /// Ended otherwise (crashed, failed): an emergency rollback.
    Exited(String),
    /// The watchdog fired, with libvirt's action.
    Watchdog(String),
    /// Nothing supervision acts on (started, resumed, our own pauses, a device removed).
    Nothing,
}

impl DomainEvent {
    /// `stopped (destroyed)`, `watchdog (pause)`, `device-removed ua-backstop-tablet`.
    pub fn describe(&self) -> String {
        match self {
            DomainEvent::Lifecycle { event, detail } => {
                let detail = match *event {
                    EVENT_STOPPED => name_of(STOPPED_DETAILS, *detail),
                    EVENT_SUSPENDED => name_of(SUSPENDED_DETAILS, *detail),
                    _ => detail.to_string(),
                };
                format!("{} ({detail})", name_of(EVENT_NAMES, *event))
            }
            DomainEvent::Watchdog { action } => format!("watchdog ({})", watchdog_action(*action)),
            DomainEvent::DeviceRemoved { alias } => format!("device-removed {alias}"),
        }
    }

    pub fn verdict(&self) -> Verdict {
        let what = || format!("libvirt event: {}", self.describe());
        match self {
            DomainEvent::Lifecycle {
                event: EVENT_STOPPED,
                detail: STOPPED_SHUTDOWN | STOPPED_DESTROYED,
            } => Verdict::EndedOutside(what()),
            DomainEvent::Lifecycle {
                event: EVENT_STOPPED | EVENT_CRASHED,
                ..
            } => Verdict::Exited(what()),
            DomainEvent::Lifecycle {
                event: EVENT_SUSPENDED,
                detail: SUSPENDED_WATCHDOG,
            } => Verdict::Watchdog("pause".into()),
            DomainEvent::Watchdog { action } => Verdict::Watchdog(watchdog_action(*action)),
            _ => Verdict::Nothing,
        }
    }

    /// Whether the VM's actor should look now: a verdict to act on, or a device let go of (a
    /// revocation waiting for it finishes at once).
    pub fn wakes(&self) -> bool {
        matches!(self, DomainEvent::DeviceRemoved { .. }) || self.verdict() != Verdict::Nothing
    }
}

/// The alias of a `DEVICE_REMOVED` event, as libvirt passed it (bytes of a C string): 1-128
/// bytes of `[A-Za-z0-9_.:-]`. Anything else is dropped: it cannot name a device backstop
/// waits for.
pub fn parse_device_alias(raw: &[u8]) -> Option<String> {
    let ok = (1..=128).contains(&raw.len())
        && raw
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || b"_.:-".contains(b));
    ok.then(|| String::from_utf8_lossy(raw).into_owned())
}

#[cfg(feature = "libvirt")]
pub(crate) use feed::{ensure_event_loop, Feed};

#[cfg(feature = "libvirt")]
mod feed {
    //! The callbacks: registered per domain on a connection, run on libvirt's event thread,
    //! they push into a bounded channel the backend drains and wake the actor.

    use std::collections::VecDeque;
    use std::ffi::CStr;
    use std::os::raw::{c_char, c_int, c_void};
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
    use std::sync::{Arc, Mutex, OnceLock};
    use std::time::Duration;

    use backstop_hypervisor::EventWaker;
    use tracing::{info, warn};
    use virt::connect::Connect;
    use virt::domain::Domain;
    use virt::sys;

    use super::*;

    // The ABI numbers above are libvirt's.
    const _: () = {
        assert!(EVENT_STARTED as u32 == sys::VIR_DOMAIN_EVENT_STARTED);
        assert!(EVENT_SUSPENDED as u32 == sys::VIR_DOMAIN_EVENT_SUSPENDED);
        assert!(EVENT_RESUMED as u32 == sys::VIR_DOMAIN_EVENT_RESUMED);
        assert!(EVENT_STOPPED as u32 == sys::VIR_DOMAIN_EVENT_STOPPED);
        assert!(EVENT_SHUTDOWN as u32 == sys::VIR_DOMAIN_EVENT_SHUTDOWN);
        assert!(EVENT_CRASHED as u32 == sys::VIR_DOMAIN_EVENT_CRASHED);
        assert!(STOPPED_SHUTDOWN as u32 == sys::VIR_DOMAIN_EVENT_STOPPED_SHUTDOWN);
        assert!(STOPPED_DESTROYED as u32 == sys::VIR_DOMAIN_EVENT_STOPPED_DESTROYED);
        assert!(SUSPENDED_WATCHDOG as u32 == sys::VIR_DOMAIN_EVENT_SUSPENDED_WATCHDOG);
        assert!(sys::VIR_DOMAIN_EVENT_WATCHDOG_PAUSE == 1);
        assert!(sys::VIR_DOMAIN_EVENT_WATCHDOG_INJECTNMI == 6);
    };

    /// Events held before the backend drains them; more are dropped (and counted): the state
    /// poll still sees what they would have said.
    const QUEUE: usize = 256;

    /// libvirt's default event loop, registered once per process before the first connection
    /// is opened, and run on its own thread (`libvirt-events`) for the life of the process.
    /// `false`: it could not be set up; supervision then polls only.
    pub(crate) fn ensure_event_loop() -> bool {
        static LOOP: OnceLock<bool> = OnceLock::new();
        *LOOP.get_or_init(|| {
            if let Err(e) = virt::event::event_register_default_impl() {
                warn!(error = %e, "libvirt event loop not registered: domain events unused, state polled");
                return false;
            }
            let spawned = std::thread::Builder::new()
                .name("libvirt-events".into())
                .spawn(|| loop {
                    if let Err(e) = virt::event::event_run_default_impl() {
                        warn!(error = %e, "libvirt event loop iteration failed");
                        std::thread::sleep(Duration::from_millis(100));
                    }
                });
            match spawned {
                Ok(_) => true,
                Err(e) => {
                    warn!(error = %e, "libvirt event thread not started: state polled only");
                    false
                }
            }
        })
    }

    /// What the callbacks share with the backend.
    struct Sink {
        tx: SyncSender<DomainEvent>,
        waker: Mutex<Option<EventWaker>>,
        dropped: AtomicU64,
        received: AtomicU64,
    }

    impl Sink {
        fn deliver(&self, ev: DomainEvent) {
            let wakes = ev.wakes();
            self.received.fetch_add(1, Ordering::Relaxed);
            match self.tx.try_send(ev) {
                Ok(()) => {}
                Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                    self.dropped.fetch_add(1, Ordering::Relaxed);
                }
            }
            if wakes {
                let waker = match self.waker.lock() {
                    Ok(g) => g.clone(),
                    Err(p) => p.into_inner().clone(),
                };
                if let Some(w) = waker {
                    w();
                }
            }
        }
    }

    /// The domain's events as the backend reads them.
    pub(crate) struct Feed {
        rx: Receiver<DomainEvent>,
        sink: Arc<Sink>,
        reg: Option<Registration>,
        /// Read while waiting for something else; handed out first.
        held: VecDeque<DomainEvent>,
    }

    impl Feed {
        pub(crate) fn new() -> Feed {
            let (tx, rx) = mpsc::sync_channel(QUEUE);
            Feed {
                rx,
                sink: Arc::new(Sink {
                    tx,
                    waker: Mutex::new(None),
                    dropped: AtomicU64::new(0),
                    received: AtomicU64::new(0),
                }),
                reg: None,
                held: VecDeque::new(),
            }
        }

        pub(crate) fn set_waker(&self, waker: EventWaker) {
            match self.sink.waker.lock() {
                Ok(mut g) => *g = Some(waker),
                Err(p) => *p.into_inner() = Some(waker),
            }
        }

        /// Registers the callbacks for `dom` on `conn` (again after a reconnect: the old
        /// registration is dropped first). On failure supervision polls only.
        pub(crate) fn register(&mut self, conn: &Connect, dom: &Domain) {
            self.reg = None;
            if !ensure_event_loop() {
                return;
            }
            match Registration::new(conn, dom, &self.sink) {
                Ok(r) => {
                    info!(callbacks = r.ids.len(), "libvirt domain events registered");
                    self.reg = Some(r);
                }
                Err(e) => {
                    warn!(error = %e, "libvirt domain events not registered: state polled only")
                }
            }
        }

        pub(crate) fn unregister(&mut self) {
            self.reg = None;
        }

        pub(crate) fn registered(&self) -> bool {
            self.reg.is_some()
        }

        /// Next event, waiting at most `wait` (zero: only what is there).
        pub(crate) fn next(&mut self, wait: Duration) -> Option<DomainEvent> {
            if let Some(e) = self.held.pop_front() {
                return Some(e);
            }
            if wait.is_zero() {
                return self.rx.try_recv().ok();
            }
            self.rx.recv_timeout(wait).ok()
        }

        /// Puts back an event read while waiting for another.
        pub(crate) fn hold(&mut self, ev: DomainEvent) {
            if self.held.len() < QUEUE {
                self.held.push_back(ev);
            }
        }

        /// Forgets everything queued (the instance they were about ended).
        pub(crate) fn clear(&mut self) {
            self.held.clear();
            while self.rx.try_recv().is_ok() {}
        }

        /// (received, dropped) since the backend started.
        pub(crate) fn counts(&self) -> (u64, u64) {
            (
                self.sink.received.load(Ordering::Relaxed),
                self.sink.dropped.load(Ordering::Relaxed),
            )
        }
    }

    /// Callbacks registered on one connection; deregistered on drop.
    struct Registration {
        conn: Connect,
        ids: Vec<c_int>,
    }

    impl Registration {
        fn new(conn: &Connect, dom: &Domain, sink: &Arc<Sink>) -> Result<Registration, String> {
            let mut reg = Registration {
                conn: conn.clone(),
                ids: Vec::new(),
            };
            // SAFETY: (each transmute) libvirt calls a callback registered for an event id
            // with that id's own signature (`VIR_DOMAIN_EVENT_CALLBACK` casts the same way in
            // C); each function below has exactly the signature libvirt documents for its id.
            let callbacks: [(u32, sys::virConnectDomainEventGenericCallback); 3] = unsafe {
                [
                    (
                        sys::VIR_DOMAIN_EVENT_ID_LIFECYCLE,
                        Some(std::mem::transmute::<
                            unsafe extern "C" fn(
                                sys::virConnectPtr,
                                sys::virDomainPtr,
                                c_int,
                                c_int,
                                *mut c_void,
                            ),
                            unsafe extern "C" fn(
                                sys::virConnectPtr,
                                sys::virDomainPtr,
                                *mut c_void,
                            ),
                        >(on_lifecycle)),
                    ),
                    (
                        sys::VIR_DOMAIN_EVENT_ID_WATCHDOG,
                        Some(std::mem::transmute::<
                            unsafe extern "C" fn(
                                sys::virConnectPtr,
                                sys::virDomainPtr,
                                c_int,
                                *mut c_void,
                            ),
                            unsafe extern "C" fn(
                                sys::virConnectPtr,
                                sys::virDomainPtr,
                                *mut c_void,
                            ),
                        >(on_watchdog)),
                    ),
                    (
                        sys::VIR_DOMAIN_EVENT_ID_DEVICE_REMOVED,
                        Some(std::mem::transmute::<
                            unsafe extern "C" fn(
                                sys::virConnectPtr,
                                sys::virDomainPtr,
                                *const c_char,
                                *mut c_void,
                            ),
                            unsafe extern "C" fn(
                                sys::virConnectPtr,
                                sys::virDomainPtr,
                                *mut c_void,
                            ),
                        >(on_device_removed)),
                    ),
                ]
            };
            for (id, cb) in callbacks {
                let opaque = Arc::into_raw(Arc::clone(sink)) as *mut c_void;
                // SAFETY: `conn` and `dom` hold references to a live connection and domain for
                // the call; `cb` matches `id` (above); `opaque` is one strong count of the
                // `Sink`, released exactly once by `free_sink` when libvirt drops the callback
                // (on deregistration or when the connection is closed), or below if the
                // registration fails (then libvirt does not call `free_sink`).
                let rc = unsafe {
                    sys::virConnectDomainEventRegisterAny(
                        conn.as_ptr(),
                        dom.as_ptr(),
                        id as c_int,
                        cb,
                        opaque,
                        Some(free_sink),
                    )
                };
                if rc < 0 {
                    // SAFETY: libvirt refused it and keeps no copy: the count is ours to drop.
                    unsafe { drop(Arc::from_raw(opaque as *const Sink)) };
                    return Err(format!(
                        "event id {id}: {}",
                        virt::error::Error::last_error()
                    ));
                }
                reg.ids.push(rc);
            }
            Ok(reg)
        }
    }

    impl Drop for Registration {
        fn drop(&mut self) {
            for id in self.ids.drain(..) {
                // SAFETY: `conn` is a live reference to the connection `id` was registered on;
                // deregistering an id once is what the API expects (on a dead connection it
                // fails, and libvirt frees the callback when the connection is closed).
                unsafe { sys::virConnectDomainEventDeregisterAny(self.conn.as_ptr(), id) };
            }
        }
    }

    /// # Safety
    /// `opaque` is a pointer made by `Arc::into_raw` for one registration (see
    /// `Registration::new`), valid until `free_sink` runs.
    unsafe fn sink<'a>(opaque: *mut c_void) -> Option<&'a Sink> {
        // SAFETY: as documented above; libvirt never calls a callback after its free callback.
        unsafe { (opaque as *const Sink).as_ref() }
    }

    unsafe extern "C" fn free_sink(opaque: *mut c_void) {
        if !opaque.is_null() {
            // SAFETY: libvirt calls this once per registration, with the pointer made by
            // `Arc::into_raw` in `Registration::new`: the strong count it owned is released.
            unsafe { drop(Arc::from_raw(opaque as *const Sink)) };
        }
    }

    unsafe extern "C" fn on_lifecycle(
        _conn: sys::virConnectPtr,
        _dom: sys::virDomainPtr,
        event: c_int,
        detail: c_int,
        opaque: *mut c_void,
    ) {
        let _ = std::panic::catch_unwind(|| {
            // SAFETY: see `sink`.
            if let Some(s) = unsafe { sink(opaque) } {
                s.deliver(DomainEvent::Lifecycle { event, detail });
            }
        });
    }

    unsafe extern "C" fn on_watchdog(
        _conn: sys::virConnectPtr,
        _dom: sys::virDomainPtr,
        action: c_int,
        opaque: *mut c_void,
    ) {
        let _ = std::panic::catch_unwind(|| {
            // SAFETY: see `sink`.
            if let Some(s) = unsafe { sink(opaque) } {
                s.deliver(DomainEvent::Watchdog { action });
            }
        });
    }

    unsafe extern "C" fn on_device_removed(
        _conn: sys::virConnectPtr,
        _dom: sys::virDomainPtr,
        alias: *const c_char,
        opaque: *mut c_void,
    ) {
        let _ = std::panic::catch_unwind(|| {
            if alias.is_null() {
                return;
            }
            // SAFETY: libvirt passes a NUL-terminated string valid for the callback's duration;
            // it is copied before returning.
            let raw = unsafe { CStr::from_ptr(alias) }.to_bytes();
            // SAFETY: see `sink`.
            if let (Some(alias), Some(s)) = (parse_device_alias(raw), unsafe { sink(opaque) }) {
                s.deliver(DomainEvent::DeviceRemoved { alias });
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_removed_aliases_are_parsed_strictly() {
        assert_eq!(
            parse_device_alias(b"ua-backstop-tablet").as_deref(),
            Some("ua-backstop-tablet")
        );
        assert_eq!(parse_device_alias(b"hostdev0").as_deref(), Some("hostdev0"));
        assert_eq!(parse_device_alias(b"net0.1:x").as_deref(), Some("net0.1:x"));
        for bad in [
            &b""[..],
            b"a b",
            b"ua-x\n",
            b"<alias>",
            b"caf\xc3\xa9",
            b"\xff\xfe",
            &[b'a'; 129][..],
        ] {
            assert_eq!(parse_device_alias(bad), None, "{bad:?}");
        }
        assert!(parse_device_alias(&[b'a'; 128]).is_some());
    }

    #[test]
    fn events_become_verdicts() {
        let ev = |event, detail| DomainEvent::Lifecycle { event, detail };
        assert_eq!(
            ev(EVENT_STOPPED, STOPPED_DESTROYED).verdict(),
            Verdict::EndedOutside("libvirt event: stopped (destroyed)".into())
        );
        assert!(matches!(
            ev(EVENT_STOPPED, STOPPED_SHUTDOWN).verdict(),
            Verdict::EndedOutside(_)
        ));
        assert_eq!(
            ev(EVENT_STOPPED, 2).verdict(),
            Verdict::Exited("libvirt event: stopped (crashed)".into())
        );
        assert!(matches!(ev(EVENT_CRASHED, 0).verdict(), Verdict::Exited(_)));
        assert_eq!(
            ev(EVENT_SUSPENDED, SUSPENDED_WATCHDOG).verdict(),
            Verdict::Watchdog("pause".into())
        );
        assert_eq!(ev(EVENT_SUSPENDED, 0).verdict(), Verdict::Nothing);
        assert_eq!(ev(EVENT_RESUMED, 0).verdict(), Verdict::Nothing);
        assert_eq!(ev(EVENT_STARTED, 0).verdict(), Verdict::Nothing);
        assert_eq!(
            DomainEvent::Watchdog { action: 2 }.verdict(),
            Verdict::Watchdog("reset".into())
        );
        assert_eq!(
            DomainEvent::Watchdog { action: 99 }.describe(),
            "watchdog (unknown(99))"
        );
        assert_eq!(ev(-1, 0).describe(), "unknown(-1) (0)");
        let removed = DomainEvent::DeviceRemoved {
            alias: "ua-backstop-tablet".into(),
        };
        assert_eq!(removed.verdict(), Verdict::Nothing);
        assert!(removed.wakes());
        assert!(!ev(EVENT_RESUMED, 0).wakes() && !ev(EVENT_SUSPENDED, 0).wakes());
        assert!(ev(EVENT_STOPPED, STOPPED_DESTROYED).wakes());
    }
}
