//! Leases (so a VM restored elsewhere never runs twice): one object per VM,
//! `prefix/leases/<vm>.json`, names the host that runs the VM and until when. The daemon that runs
//! a VM writes it and renews it in the background every `lease_ttl_s / 3`; a clean stop deletes it.
//! A `snapshot pull --for-start` on another host is refused while a live lease names someone else.
//!
//! S3 has no transactions; what this gets from the gateway is a compare-and-swap on PUT, measured
//! on Ceph 16.2.15's RGW: `If-None-Match: *` (only if absent) and `If-Match: <etag>` (only if
//! unchanged). Every write of a lease is one of those, so two hosts cannot both take the same
//! lease object. What it cannot give: a DELETE ignores `If-Match`, so a release is read, check,
//! delete (a lease taken by another host between the read and the delete — only possible if ours
//! had expired — is deleted); and the lease says nothing about a host whose clock is wrong or
//! that keeps running a VM after failing to renew (see README: renewal failures never stop a VM).
//!
//! The decisions ([`decide`]) are pure functions of the lease read, this host's name and the
//! time; the [`LeaseKeeper`] carries them out against the bucket.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use backstop_common::{AuditEvent, ErrorCode};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use time::OffsetDateTime;

use crate::config::{is_valid_host, OffsiteConfig};
use crate::s3::{Client, PutCondition, S3Error};

/// A lease object is small; anything larger is not one of ours.
pub const LEASE_MAX_BYTES: u64 = 4096;

/// The lease object as stored (JSON).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    /// The host that runs the VM.
    pub host: String,
    pub vm: String,
    /// RFC 3339: after this the lease is dead and another host may take it over.
    pub expires_at: String,
    pub renewed_at: String,
    /// The writing daemon's session (random per start): tells one run of a host from the next.
    pub session: String,
}

impl Lease {
    /// A lease for `host` on `vm` from `now` for `ttl`.
    pub fn new(host: &str, vm: &str, session: &str, now: OffsetDateTime, ttl: Duration) -> Lease {
        let ttl = time::Duration::try_from(ttl).unwrap_or(time::Duration::MAX);
        Lease {
            host: host.into(),
            vm: vm.into(),
            expires_at: backstop_common::time::rfc3339(now.saturating_add(ttl)),
            renewed_at: backstop_common::time::rfc3339(now),
            session: session.into(),
        }
    }

    /// Parses and checks a lease object's bytes: names as in object keys, both times RFC 3339.
    pub fn parse(bytes: &[u8]) -> Result<Lease, String> {
        let l: Lease = serde_json::from_slice(bytes).map_err(|e| format!("not a lease: {e}"))?;
        if !is_valid_host(&l.host) {
            return Err(format!("host {:?} is not a host name", l.host));
        }
        if !is_valid_host(&l.vm) {
            return Err(format!("vm {:?} is not a VM name", l.vm));
        }
        for (k, v) in [("expires_at", &l.expires_at), ("renewed_at", &l.renewed_at)] {
            if backstop_common::time::parse_rfc3339(v).is_none() {
                return Err(format!("{k} {v:?} is not an RFC 3339 time"));
            }
        }
        Ok(l)
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Whether the lease still holds at `now` (an unparseable expiry never does not: it is
    /// checked at [`Lease::parse`]).
    pub fn is_live(&self, now: OffsetDateTime) -> bool {
        backstop_common::time::parse_rfc3339(&self.expires_at).is_some_and(|t| t > now)
    }

    /// Whole seconds left at `now` (0 once expired).
    pub fn seconds_left(&self, now: OffsetDateTime) -> i64 {
        backstop_common::time::parse_rfc3339(&self.expires_at)
            .map(|t| (t - now).whole_seconds().max(0))
            .unwrap_or(0)
    }
}

/// What the bucket holds under a VM's lease key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Current {
    Absent,
    Lease {
        lease: Lease,
        etag: String,
    },
    /// An object that is not a lease (damaged, or written by something else).
    Unreadable {
        etag: String,
        error: String,
    },
}

/// What a host may do with a VM's lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Write our lease under this precondition; `taken_over` is the expired lease of another
    /// host it replaces.
    Take {
        condition: PutCondition,
        taken_over: Option<Lease>,
    },
    /// Another host holds it (live, or expired but this caller may not take it over).
    HeldElsewhere { holder: Lease },
    /// The object is not a lease: refused until a person removes it.
    Unreadable { error: String },
}

/// Who may write the lease: absent → anyone (`If-None-Match: *`); ours (this host, any session:
/// a restarted daemon renews its own) → renew; another host's live lease → nobody; another
/// host's expired lease → only an explicit takeover (`snapshot pull --for-start`); the
/// background renewer never takes over a lease it did not hold.
pub fn decide(
    current: &Current,
    me: &str,
    now: OffsetDateTime,
    take_over_expired: bool,
) -> Decision {
    match current {
        Current::Absent => Decision::Take {
            condition: PutCondition::Absent,
            taken_over: None,
        },
        Current::Lease { lease, etag } if lease.host == me => Decision::Take {
            condition: PutCondition::ETag(etag.clone()),
            taken_over: None,
        },
        Current::Lease { lease, etag } if take_over_expired && !lease.is_live(now) => {
            Decision::Take {
                condition: PutCondition::ETag(etag.clone()),
                taken_over: Some(lease.clone()),
            }
        }
        Current::Lease { lease, .. } => Decision::HeldElsewhere {
            holder: lease.clone(),
        },
        Current::Unreadable { error, .. } => Decision::Unreadable {
            error: error.clone(),
        },
    }
}

/// The one line of a refused `pull --for-start`.
pub fn held_message(vm: &str, holder: &Lease, now: OffsetDateTime) -> String {
    if holder.is_live(now) {
        format!(
            "VM {vm} runs on host {}: its lease is live until {} ({} s left); nothing pulled or changed",
            holder.host,
            holder.expires_at,
            holder.seconds_left(now)
        )
    } else {
        format!(
            "VM {vm}'s lease names host {} (expired at {}); nothing pulled or changed",
            holder.host, holder.expires_at
        )
    }
}

/// A refused or failed lease operation: a code and one line.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct LeaseError {
    pub code: ErrorCode,
    pub message: String,
}

fn s3_err(e: S3Error) -> LeaseError {
    LeaseError {
        code: ErrorCode::OffsiteUnreachable,
        message: e.to_string(),
    }
}

/// This VM's lease key.
pub fn key(cfg: &OffsiteConfig, vm: &str) -> String {
    cfg.key(&format!("leases/{vm}.json"))
}

/// Reads what the bucket holds under `vm`'s lease key.
pub fn read(cfg: &OffsiteConfig, client: &Client, vm: &str) -> Result<Current, S3Error> {
    Ok(match client.get_with_etag(&key(cfg, vm), LEASE_MAX_BYTES) {
        Ok(None) => Current::Absent,
        Ok(Some((bytes, etag))) => match Lease::parse(&bytes) {
            Ok(lease) => Current::Lease { lease, etag },
            Err(error) => Current::Unreadable { etag, error },
        },
        Err(S3Error::TooLarge { .. }) => Current::Unreadable {
            etag: String::new(),
            error: format!("larger than {LEASE_MAX_BYTES} bytes"),
        },
        Err(e) => return Err(e),
    })
}

/// One VM's lease as this daemon sees it (for `status`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LeaseView {
    pub vm: String,
    /// `held` (this host), `held_elsewhere`, `unreadable`, `renew_failing`.
    pub state: String,
    /// The host the lease names (this one when held).
    pub holder: Option<String>,
    pub expires_at: Option<String>,
    pub last_error: Option<String>,
    /// Wall time of the last successful write, milliseconds.
    pub last_write_ms: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Held,
    HeldElsewhere,
    Unreadable,
    RenewFailing,
}

impl State {
    fn as_str(self) -> &'static str {
        match self {
            State::Held => "held",
            State::HeldElsewhere => "held_elsewhere",
            State::Unreadable => "unreadable",
            State::RenewFailing => "renew_failing",
        }
    }
}

#[derive(Debug, Clone)]
struct VmLease {
    state: State,
    /// Our last write's ETag while held: the next renewal is one `If-Match` PUT.
    etag: Option<String>,
    holder: Option<String>,
    expires_at: Option<String>,
    last_error: Option<String>,
    last_write_ms: Option<u64>,
}

/// Journals a daemon event (`fields` carries `vm` and `result`).
pub type LeaseJournalFn = Box<dyn Fn(AuditEvent, Value) + Send + Sync>;
/// The names of the VMs this daemon runs now.
pub type VmsFn = Box<dyn Fn() -> Vec<String> + Send + Sync>;

struct Inner {
    cfg: OffsiteConfig,
    client: Client,
    ttl: Duration,
    session: String,
    vms: VmsFn,
    journal: LeaseJournalFn,
    leases: Mutex<BTreeMap<String, VmLease>>,
    /// Serialises writes of lease objects between the renewer and a pull-for-start.
    op: Mutex<()>,
    /// VMs being added here (`vm add --from-snapshot`): their lease is taken before their actor
    /// runs, so the renewer keeps (renews) it rather than releasing a lease of a VM it does
    /// not see running yet.
    starting: Mutex<std::collections::BTreeSet<String>>,
    stop: AtomicBool,
}

/// Writes and renews the leases of the VMs this daemon runs (cheap to clone).
#[derive(Clone)]
pub struct LeaseKeeper {
    inner: Arc<Inner>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl LeaseKeeper {
    /// Starts the renewer thread: every `ttl / 3`, each running VM's lease is taken (absent) or
    /// renewed (ours); a VM no longer run here has its lease released.
    pub fn start(
        cfg: OffsiteConfig,
        vms: VmsFn,
        journal: LeaseJournalFn,
    ) -> Result<LeaseKeeper, String> {
        let ttl = Duration::from_secs(cfg.lease_ttl_s);
        // A renewal that hangs must not outlive the lease it renews.
        let client = Client::new(&cfg, (ttl / 3).max(Duration::from_secs(1)));
        let mut rnd = [0u8; 8];
        getrandom::fill(&mut rnd).map_err(|e| format!("session id: {e}"))?;
        let keeper = LeaseKeeper {
            inner: Arc::new(Inner {
                cfg,
                client,
                ttl,
                session: hex::encode(rnd),
                vms,
                journal,
                leases: Mutex::new(BTreeMap::new()),
                op: Mutex::new(()),
                starting: Mutex::new(Default::default()),
                stop: AtomicBool::new(false),
            }),
        };
        let run = keeper.clone();
        std::thread::Builder::new()
            .name("offsite-lease".into())
            .spawn(move || run.run_loop())
            .map_err(|e| format!("spawn the lease renewer: {e}"))?;
        Ok(keeper)
    }

    fn run_loop(&self) {
        let period = (self.inner.ttl / 3).max(Duration::from_millis(500));
        // On a fresh gateway the bucket may not exist before the first upload makes it.
        let mut bucket_ok = false;
        while !self.inner.stop.load(Ordering::SeqCst) {
            let started = Instant::now();
            let mut vms = (self.inner.vms)();
            vms.extend(
                lock(&self.inner.starting)
                    .iter()
                    .filter(|v| !vms.contains(v))
                    .cloned()
                    .collect::<Vec<_>>(),
            );
            if !bucket_ok && !vms.is_empty() {
                bucket_ok = self.inner.client.ensure_bucket().is_ok();
            }
            for vm in &vms {
                if self.inner.stop.load(Ordering::SeqCst) {
                    return;
                }
                self.renew(vm);
            }
            let gone: Vec<String> = lock(&self.inner.leases)
                .keys()
                .filter(|k| !vms.contains(k))
                .cloned()
                .collect();
            for vm in gone {
                self.release(&vm);
            }
            while started.elapsed() < period && !self.inner.stop.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }

    fn now() -> OffsetDateTime {
        OffsetDateTime::now_utc()
    }

    /// One renewal pass for `vm`: never takes over another host's lease.
    fn renew(&self, vm: &str) {
        let _op = lock(&self.inner.op);
        // A clean stop sets the flag before it releases (under `op`): no renewal after it.
        if self.inner.stop.load(Ordering::SeqCst) {
            return;
        }
        let known = lock(&self.inner.leases).get(vm).cloned();
        // Held with a known ETag: one compare-and-swap PUT. Anything else (a 412, an error): read.
        if let Some(VmLease {
            state: State::Held,
            etag: Some(etag),
            ..
        }) = &known
        {
            let lease = self.lease_for(vm);
            let t = Instant::now();
            match self.inner.client.put_if(
                &key(&self.inner.cfg, vm),
                &lease.to_bytes(),
                &PutCondition::ETag(etag.clone()),
            ) {
                Ok(etag) => return self.set_held(vm, &lease, etag, t, None),
                Err(e) if e.is_precondition_failed() => {}
                Err(e) => return self.set_failing(vm, &e.to_string()),
            }
        }
        let current = match read(&self.inner.cfg, &self.inner.client, vm) {
            Ok(c) => c,
            Err(e) => return self.set_failing(vm, &e.to_string()),
        };
        match decide(&current, &self.inner.cfg.host, Self::now(), false) {
            Decision::Take { condition, .. } => {
                let lease = self.lease_for(vm);
                let t = Instant::now();
                match self.inner.client.put_if(
                    &key(&self.inner.cfg, vm),
                    &lease.to_bytes(),
                    &condition,
                ) {
                    Ok(etag) => self.set_held(vm, &lease, etag, t, None),
                    // Another host wrote between our read and our PUT: the next pass reads it.
                    Err(e) if e.is_precondition_failed() => {}
                    Err(e) => self.set_failing(vm, &e.to_string()),
                }
            }
            Decision::HeldElsewhere { holder } => self.set_elsewhere(vm, &holder),
            Decision::Unreadable { error } => self.set_unreadable(vm, &error),
        }
    }

    fn lease_for(&self, vm: &str) -> Lease {
        Lease::new(
            &self.inner.cfg.host,
            vm,
            &self.inner.session,
            Self::now(),
            self.inner.ttl,
        )
    }

    fn set_held(
        &self,
        vm: &str,
        lease: &Lease,
        etag: String,
        started: Instant,
        taken_over: Option<&Lease>,
    ) {
        let ms = started.elapsed().as_millis() as u64;
        let before = self.update(vm, |l| {
            l.state = State::Held;
            l.etag = Some(etag);
            l.holder = Some(lease.host.clone());
            l.expires_at = Some(lease.expires_at.clone());
            l.last_error = None;
            l.last_write_ms = Some(ms);
        });
        if before != Some(State::Held) || taken_over.is_some() {
            tracing::info!(vm, host = %lease.host, expires_at = %lease.expires_at, ms, "offsite lease acquired");
            (self.inner.journal)(
                AuditEvent::OffsiteLeaseAcquired,
                json!({"vm": vm, "host": lease.host, "expires_at": lease.expires_at,
                    "ttl_s": self.inner.ttl.as_secs(),
                    "taken_over_from": taken_over.map(|t| json!({"host": t.host, "expires_at": t.expires_at})),
                    "write_ms": ms, "result": "ok"}),
            );
        } else {
            tracing::debug!(vm, expires_at = %lease.expires_at, ms, "offsite lease renewed");
        }
    }

    fn set_failing(&self, vm: &str, error: &str) {
        let before = self.update(vm, |l| {
            // Whatever it was, we do not know now; `expires_at` still says until when our last
            // write (if any) holds.
            l.state = State::RenewFailing;
            l.etag = None;
            l.last_error = Some(error.to_string());
        });
        tracing::warn!(vm, error, "offsite lease not written");
        if before != Some(State::RenewFailing) {
            (self.inner.journal)(
                AuditEvent::OffsiteLeaseRenewFailed,
                json!({"vm": vm, "code": ErrorCode::OffsiteUnreachable.as_str(), "error": error,
                    "result": "failed"}),
            );
        }
    }

    fn set_elsewhere(&self, vm: &str, holder: &Lease) {
        let mut changed = false;
        self.update(vm, |l| {
            changed = l.state != State::HeldElsewhere || l.holder.as_deref() != Some(&holder.host);
            l.state = State::HeldElsewhere;
            l.etag = None;
            l.holder = Some(holder.host.clone());
            l.expires_at = Some(holder.expires_at.clone());
            l.last_error = None;
        });
        if changed {
            tracing::warn!(vm, holder = %holder.host, expires_at = %holder.expires_at,
                "offsite lease held by another host: not taken");
            (self.inner.journal)(
                AuditEvent::OffsiteLeaseHeldElsewhere,
                json!({"vm": vm, "holder": holder.host, "expires_at": holder.expires_at,
                    "result": "refused"}),
            );
        }
    }

    fn set_unreadable(&self, vm: &str, error: &str) {
        let before = self.update(vm, |l| {
            l.state = State::Unreadable;
            l.etag = None;
            l.holder = None;
            l.last_error = Some(error.to_string());
        });
        if before != Some(State::Unreadable) {
            (self.inner.journal)(
                AuditEvent::OffsiteLeaseRenewFailed,
                json!({"vm": vm, "code": ErrorCode::OffsiteLeaseHeld.as_str(),
                    "error": format!("the lease object is not a lease: {error}"), "result": "failed"}),
            );
        }
    }

    /// Applies `f` to `vm`'s entry (made if missing); returns the state before.
    fn update(&self, vm: &str, f: impl FnOnce(&mut VmLease)) -> Option<State> {
        let mut leases = lock(&self.inner.leases);
        let before = leases.get(vm).map(|l| l.state);
        let entry = leases.entry(vm.to_string()).or_insert(VmLease {
            state: State::RenewFailing,
            etag: None,
            holder: None,
            expires_at: None,
            last_error: None,
            last_write_ms: None,
        });
        f(entry);
        before
    }

    /// Before a pull for start: refused with `ERR_OFFSITE_LEASE_HELD` while another host's live
    /// lease (or an object that is not a lease) is there. Writes nothing.
    pub fn check_for_start(&self, vm: &str) -> Result<(), LeaseError> {
        let current = read(&self.inner.cfg, &self.inner.client, vm).map_err(s3_err)?;
        match decide(&current, &self.inner.cfg.host, Self::now(), true) {
            Decision::Take { .. } => Ok(()),
            Decision::HeldElsewhere { holder } => Err(LeaseError {
                code: ErrorCode::OffsiteLeaseHeld,
                message: held_message(vm, &holder, Self::now()),
            }),
            Decision::Unreadable { error } => Err(unreadable(vm, &error)),
        }
    }

    /// Takes `vm`'s lease for a start here: absent, ours, or another host's *expired* lease
    /// (taken over: returned). One compare-and-swap PUT; a host that wrote in between wins and
    /// this is refused.
    pub fn acquire_for_start(&self, vm: &str) -> Result<(Lease, Option<Lease>), LeaseError> {
        let _op = lock(&self.inner.op);
        let current = read(&self.inner.cfg, &self.inner.client, vm).map_err(s3_err)?;
        match decide(&current, &self.inner.cfg.host, Self::now(), true) {
            Decision::Take {
                condition,
                taken_over,
            } => {
                let lease = self.lease_for(vm);
                let t = Instant::now();
                match self.inner.client.put_if(
                    &key(&self.inner.cfg, vm),
                    &lease.to_bytes(),
                    &condition,
                ) {
                    Ok(etag) => {
                        // Journaled as acquired even if the renewer already held it: the pull
                        // for start is the operator's act.
                        self.update(vm, |l| l.state = State::RenewFailing);
                        self.set_held(vm, &lease, etag, t, taken_over.as_ref());
                        Ok((lease, taken_over))
                    }
                    Err(e) if e.is_precondition_failed() => {
                        let now = Self::now();
                        let msg = match read(&self.inner.cfg, &self.inner.client, vm) {
                            Ok(Current::Lease { lease, .. }) => held_message(vm, &lease, now),
                            _ => format!(
                                "VM {vm}'s lease changed while it was being taken; nothing changed"
                            ),
                        };
                        Err(LeaseError {
                            code: ErrorCode::OffsiteLeaseHeld,
                            message: msg,
                        })
                    }
                    Err(e) => Err(s3_err(e)),
                }
            }
            Decision::HeldElsewhere { holder } => Err(LeaseError {
                code: ErrorCode::OffsiteLeaseHeld,
                message: held_message(vm, &holder, Self::now()),
            }),
            Decision::Unreadable { error } => Err(unreadable(vm, &error)),
        }
    }

    /// `vm` is being added here and does not run yet: its lease (taken with
    /// [`Self::acquire_for_start`]) is renewed, not released, until [`Self::end_start`].
    pub fn begin_start(&self, vm: &str) {
        lock(&self.inner.starting).insert(vm.to_string());
    }

    /// The add of `vm` is over: from now on the lease follows whether the VM runs here.
    pub fn end_start(&self, vm: &str) {
        lock(&self.inner.starting).remove(vm);
    }

    /// Deletes `vm`'s lease if it is still ours (read, check, delete: DELETE has no
    /// precondition on RGW 16) and forgets it. Journaled when one was deleted.
    pub fn release(&self, vm: &str) {
        let _op = lock(&self.inner.op);
        let was = lock(&self.inner.leases).remove(vm);
        if was.as_ref().map(|l| l.state) != Some(State::Held) {
            return;
        }
        let ours = match read(&self.inner.cfg, &self.inner.client, vm) {
            Ok(Current::Lease { lease, .. }) => lease.host == self.inner.cfg.host,
            Ok(_) => false,
            Err(e) => {
                tracing::warn!(vm, error = %e, "offsite lease not released: it expires by itself");
                return;
            }
        };
        if !ours {
            return;
        }
        match self.inner.client.delete(&key(&self.inner.cfg, vm)) {
            Ok(()) => {
                tracing::info!(vm, "offsite lease released");
                (self.inner.journal)(
                    AuditEvent::OffsiteLeaseReleased,
                    json!({"vm": vm, "host": self.inner.cfg.host, "result": "ok"}),
                );
            }
            Err(e) => {
                tracing::warn!(vm, error = %e, "offsite lease not released: it expires by itself")
            }
        }
    }

    /// A clean stop: the renewer ends, then every lease held here is released.
    pub fn release_all(&self) {
        self.inner.stop.store(true, Ordering::SeqCst);
        let vms: Vec<String> = lock(&self.inner.leases).keys().cloned().collect();
        for vm in vms {
            self.release(&vm);
        }
    }

    pub fn views(&self) -> Vec<LeaseView> {
        lock(&self.inner.leases)
            .iter()
            .map(|(vm, l)| LeaseView {
                vm: vm.clone(),
                state: l.state.as_str().into(),
                holder: l.holder.clone(),
                expires_at: l.expires_at.clone(),
                last_error: l.last_error.clone(),
                last_write_ms: l.last_write_ms,
            })
            .collect()
    }

    pub fn ttl(&self) -> Duration {
        self.inner.ttl
    }
}

fn unreadable(vm: &str, error: &str) -> LeaseError {
    LeaseError {
        code: ErrorCode::OffsiteLeaseHeld,
        message: format!(
            "VM {vm}'s lease object is not a lease ({error}): refused until a person removes it; nothing pulled or changed"
        ),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use time::macros::datetime;

    use super::*;

    const NOW: OffsetDateTime = datetime!(2026-11-25 07:00:00 UTC);

    fn lease(host: &str, expires_at: &str) -> Lease {
        Lease {
            host: host.into(),
            vm: "web".into(),
            expires_at: expires_at.into(),
            renewed_at: "2026-11-25T06:59:00.000Z".into(),
            session: "s1".into(),
        }
    }

    fn current(l: Lease) -> Current {
        Current::Lease {
            lease: l,
            etag: "e1".into(),
        }
    }

    #[test]
    fn a_lease_round_trips_and_expires_after_its_ttl() {
        let l = Lease::new("host-a", "web", "s", NOW, Duration::from_secs(60));
        assert_eq!(l.expires_at, "2026-11-25T07:01:00.000Z");
        assert_eq!(l.renewed_at, "2026-11-25T07:00:00.000Z");
        assert_eq!(Lease::parse(&l.to_bytes()).unwrap(), l);
        assert!(l.is_live(NOW));
        assert_eq!(l.seconds_left(NOW), 60);
        assert!(l.is_live(NOW + time::Duration::seconds(59)));
        assert!(!l.is_live(NOW + time::Duration::seconds(60)));
        assert_eq!(l.seconds_left(NOW + time::Duration::seconds(90)), 0);
    }

    #[test]
    fn damaged_leases_are_refused_in_one_line() {
        let good = lease("host-a", "2026-11-25T07:01:00Z");
        let mut bad_host = good.clone();
        bad_host.host = "a/b".into();
        let mut bad_time = good.clone();
        bad_time.expires_at = "tomorrow".into();
        let mut bad_vm = good.clone();
        bad_vm.vm = String::new();
        for b in [
            b"{".to_vec(),
            b"{\"host\":\"a\"}".to_vec(),
            bad_host.to_bytes(),
            bad_time.to_bytes(),
            bad_vm.to_bytes(),
        ] {
            let e = Lease::parse(&b).unwrap_err();
            assert!(!e.contains('\n'), "{e}");
        }
    }

    #[test]
    fn an_absent_lease_is_taken_only_if_still_absent() {
        for takeover in [false, true] {
            assert_eq!(
                decide(&Current::Absent, "host-b", NOW, takeover),
                Decision::Take {
                    condition: PutCondition::Absent,
                    taken_over: None
                }
            );
        }
    }

    #[test]
    fn our_own_lease_is_renewed_live_or_expired_from_any_session() {
        for exp in ["2026-11-25T07:01:00Z", "2026-11-25T06:00:00Z"] {
            assert_eq!(
                decide(&current(lease("host-a", exp)), "host-a", NOW, false),
                Decision::Take {
                    condition: PutCondition::ETag("e1".into()),
                    taken_over: None
                }
            );
        }
    }

    #[test]
    fn a_live_lease_of_another_host_is_never_taken() {
        let l = lease("host-a", "2026-11-25T07:00:00.001Z");
        for takeover in [false, true] {
            assert_eq!(
                decide(&current(l.clone()), "host-b", NOW, takeover),
                Decision::HeldElsewhere { holder: l.clone() }
            );
        }
        let m = held_message("web", &l, NOW);
        assert!(
            m.contains("host-a") && m.contains("2026-11-25T07:00:00.001Z"),
            "{m}"
        );
    }

    #[test]
    fn an_expired_lease_of_another_host_is_taken_over_only_when_asked() {
        // Expiry is exclusive: at expires_at the lease is dead.
        let l = lease("host-a", "2026-11-25T07:00:00Z");
        assert_eq!(
            decide(&current(l.clone()), "host-b", NOW, false),
            Decision::HeldElsewhere { holder: l.clone() }
        );
        assert_eq!(
            decide(&current(l.clone()), "host-b", NOW, true),
            Decision::Take {
                condition: PutCondition::ETag("e1".into()),
                taken_over: Some(l)
            }
        );
    }

    #[test]
    fn an_object_that_is_not_a_lease_is_refused_to_everyone() {
        let c = Current::Unreadable {
            etag: "e".into(),
            error: "not a lease".into(),
        };
        for takeover in [false, true] {
            assert!(matches!(
                decide(&c, "host-a", NOW, takeover),
                Decision::Unreadable { .. }
            ));
        }
        let e = unreadable("web", "x");
        assert_eq!(e.code.as_str(), "ERR_OFFSITE_LEASE_HELD");
    }
}
