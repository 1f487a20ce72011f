//! Forensic capture (spec/004): a rollback keeps the state it abandons. Once a running VM is ended
//! (or let go of, below) and before it is restored (a VM already gone — a crash, a stop — has no
//! state to abandon), the disks it was writing — its active overlays, frozen where they are, not
//! copied — are published as a snapshot with trigger `forensic`, whose parent is where the VM
//! stood. The rollback's record names it, so the state before and after the rollback can both be
//! rebuilt.
//!
//! Within `[rollback] forensic_ram_budget` (default 5 s), and for the rollbacks
//! `[rollback] forensic_ram_for` names (default every kind: console, policy, emergency and
//! watchdog), the abandoned VM's RAM and device state are kept too. A hung guest's RAM is worth
//! most and is still there while its QEMU answers (a watchdog's pause included); a QEMU that
//! cannot be paused has none to give, and its snapshot keeps the disks with that reason. The
//! old QEMU is not ended but let go of paused and revoked
//! ([`backstop_hypervisor::VmBackend::keep_abandoned`]); a plain
//! stop-and-copy save of it streams into the store (the capture's builder: same chunks, crc,
//! signed manifest) on its own thread *while* the fresh VM launches, loads and resumes, so the
//! rollback's restore does not wait for it. The old QEMU ends when the save is done or the
//! budget runs out (then the save is cancelled and the snapshot keeps the disks alone, `ram:
//! false` with the reason). The forensic snapshot is published after the fresh VM resumed (its
//! id is its content's digest, known only then), and the rollback's record names it.
//!
//! A VM holding something only the end of its process takes back (a device the guest did not
//! release, a VFIO device to give back to the host, a tap NIC a second QEMU cannot open) is
//! ended before the restore, and its snapshot keeps no RAM; so does a backend that cannot keep two
//! instances.
//!
//! A forensic snapshot with RAM is a rollback target only when asked for by name with
//! `--include-forensic` (the guest then continues from where it was before that rollback); one
//! without RAM never is. Retention keeps forensic snapshots `[retention] keep_forensic_hours`
//! (default 72: three days), apart from the other rules.

use std::path::PathBuf;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tracing::{info, warn};

use backstop_common::{AuditEvent, RollbackType, TriggerKind};
use backstop_hypervisor::AbandonedVm;
use backstop_store::{Lineage, Manifest, ManifestInput, SnapshotBuilder};

use crate::actor::{Ctx, VmActor};
use crate::config::DiskSnapshotMode;
use crate::error::EngineError;

/// The trigger (and kind) of a forensic snapshot.
pub const FORENSIC: &str = "forensic";

/// Whether a manifest is a forensic snapshot (never a rollback target by itself).
pub fn is_forensic(m: &Manifest) -> bool {
    m.trigger == FORENSIC
}

/// Whether a forensic snapshot kept the abandoned VM's RAM and device state.
pub fn has_ram(m: &Manifest) -> bool {
    m.capture
        .get("forensic")
        .and_then(|f| f.get("ram"))
        .and_then(Value::as_bool)
        == Some(true)
        && m.payload_refs.iter().any(|p| p.name == "vmstate")
}

/// Why `m` cannot be the rollback target named, or `None` when it can: a forensic snapshot is
/// one only with `--include-forensic`, and only if it holds RAM and device state.
pub fn target_refusal(m: &Manifest, include_forensic: bool) -> Option<String> {
    if !is_forensic(m) {
        return None;
    }
    let id = &m.snapshot_id;
    match (has_ram(m), include_forensic) {
        (true, true) => None,
        (true, false) => Some(format!(
            "{id} is a forensic snapshot (the state a rollback abandoned, RAM included): kept to be examined, restored only with --include-forensic"
        )),
        (false, _) => {
            let why = m
                .capture
                .get("forensic")
                .and_then(|f| f.get("ram_reason"))
                .and_then(Value::as_str)
                .unwrap_or("its RAM was not kept");
            Some(format!(
                "{id} is a forensic snapshot without RAM state ({why}): its disks alone cannot be restored, even with --include-forensic"
            ))
        }
    }
}

/// Parses `[rollback] forensic_ram_budget`: a humantime span from 1 ms to 10 min.
pub fn parse_ram_budget(text: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(text.trim())
        .map_err(|e| format!("{text:?} is not a duration like \"5s\" or \"800ms\" ({e})"))?;
    if d < Duration::from_millis(1) || d > Duration::from_secs(600) {
        return Err(format!("{text:?} must be between 1ms and 10min"));
    }
    Ok(d)
}

/// The kinds of rollback `[rollback] forensic_ram_for` chooses among.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RamClass {
    /// A person's rollback, not an emergency.
    Console,
    /// The policy engine's or a host trigger's rollback, not an emergency.
    Policy,
    /// Any emergency rollback but the watchdog's.
    Emergency,
    /// The heartbeat watchdog or the device watchdog expired.
    Watchdog,
}

impl RamClass {
    pub fn parse(word: &str) -> Option<RamClass> {
        Some(match word {
            "console" => RamClass::Console,
            "policy" => RamClass::Policy,
            "emergency" => RamClass::Emergency,
            "watchdog" => RamClass::Watchdog,
            _ => return None,
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            RamClass::Console => "console",
            RamClass::Policy => "policy",
            RamClass::Emergency => "emergency",
            RamClass::Watchdog => "watchdog",
        }
    }

    /// Which kind of rollback this is.
    pub fn of(trigger: TriggerKind, rollback_type: RollbackType) -> RamClass {
        match (trigger, rollback_type) {
            (TriggerKind::WatchdogTimeout | TriggerKind::WatchdogDevice, _) => RamClass::Watchdog,
            (_, RollbackType::Emergency) => RamClass::Emergency,
            (TriggerKind::Console, _) => RamClass::Console,
            _ => RamClass::Policy,
        }
    }
}

/// Whether a rollback of this kind keeps the abandoned RAM (`Err`: why not, for the record).
pub fn ram_wanted(
    configured: &[String],
    trigger: TriggerKind,
    rollback_type: RollbackType,
) -> Result<(), String> {
    let class = RamClass::of(trigger, rollback_type);
    if configured.iter().any(|w| RamClass::parse(w) == Some(class)) {
        Ok(())
    } else {
        Err(format!(
            "not kept for {} rollbacks ([rollback] forensic_ram_for)",
            class.as_str()
        ))
    }
}

/// Where the abandoned VM stood, taken before the VM is replaced: its captured disks' chains
/// (the tops are the overlays it was writing), its position and its epoch.
pub(crate) struct Abandoned {
    chains: Vec<(String, Vec<PathBuf>)>,
    position: Option<String>,
    epoch: u64,
}

/// What a forensic snapshot gets of the abandoned RAM: a save in flight, or the reason none.
pub(crate) enum ForensicRam {
    Skipped(String),
    Saving(RamJob),
    /// A save already waited for (see [`RamJob::finish`]).
    Saved(RamOutcome),
}

/// A save of the abandoned VM's state on its own thread; dropping it waits for the thread
/// (bounded by the budget), which ends the abandoned VM.
pub(crate) struct RamJob {
    handle: Option<JoinHandle<RamOutcome>>,
}

pub(crate) struct RamOutcome {
    /// The builder holding the `vmstate` payload, when the save completed.
    builder: Option<SnapshotBuilder>,
    /// Facts for the manifest, or why the RAM was not kept.
    facts: Result<Value, String>,
}

impl RamJob {
    /// Starts saving `vm` into a new build of `store`, bounded by `budget`; `vm` is ended when
    /// the save completes or is cancelled.
    pub(crate) fn start(
        store: &backstop_store::Store,
        mut vm: Box<dyn AbandonedVm>,
        budget: Duration,
    ) -> Result<RamJob, String> {
        let builder = match store.begin() {
            Ok(b) => b,
            Err(e) => {
                vm.end();
                return Err(format!("the store could not begin a build: {e}"));
            }
        };
        let handle = std::thread::Builder::new()
            .name("forensic-ram".into())
            .spawn(move || save_abandoned(vm, builder, budget))
            .map_err(|e| format!("could not start the save's thread: {e}"))?;
        Ok(RamJob {
            handle: Some(handle),
        })
    }

    /// Waits for the save (at most what is left of its budget); the abandoned VM has ended.
    pub(crate) fn finish(self) -> ForensicRam {
        ForensicRam::Saved(self.wait())
    }

    fn wait(mut self) -> RamOutcome {
        match self.handle.take().map(JoinHandle::join) {
            Some(Ok(outcome)) => outcome,
            _ => RamOutcome {
                builder: None,
                facts: Err("the save's thread panicked".into()),
            },
        }
    }
}

impl Drop for RamJob {
    fn drop(&mut self) {
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// The save's thread: streams the state into `builder` while waiting (up to what is left of
/// `budget`) for QEMU to finish it; cancels it past the budget; always ends `vm`.
fn save_abandoned(
    mut vm: Box<dyn AbandonedVm>,
    mut builder: SnapshotBuilder,
    budget: Duration,
) -> RamOutcome {
    let started = Instant::now();
    let fail = |why: String| RamOutcome {
        builder: None,
        facts: Err(why),
    };
    let stream = match vm.begin_save() {
        Ok(s) => s,
        Err(e) => {
            vm.end();
            return fail(format!("the save did not start: {e}"));
        }
    };
    let (stored, finished) = std::thread::scope(|scope| {
        let builder = &mut builder;
        let ingest = scope.spawn(move || {
            let mut reader = stream.reader;
            let mut on_chunk = |_bytes: u64| {};
            match &stream.cutter {
                None => builder
                    .write_chunked("vmstate", "ram+device", &mut reader, &mut on_chunk)
                    .map(|p| (p, json!({"method": "content-defined"}))),
                Some(cutter) => {
                    let mut chunks = cutter.cut(Box::new(&mut reader));
                    let p =
                        builder.write_chunks("vmstate", "ram+device", &mut chunks, &mut on_chunk);
                    p.map(|p| (p, chunks.report()))
                }
            }
        });
        let left = budget.saturating_sub(started.elapsed());
        let finished = vm.finish_save(left.max(Duration::from_millis(1)));
        let stored = ingest
            .join()
            .unwrap_or_else(|_| Err(backstop_store::StoreError::Encode("ingest panicked".into())));
        (stored, finished)
    });
    vm.end();
    let save_ms = started.elapsed().as_millis() as u64;
    match (finished, stored) {
        (Ok(state_bytes), Ok((payload, chunking))) => RamOutcome {
            builder: Some(builder),
            facts: Ok(json!({
                "save_ms": save_ms, "state_bytes": state_bytes,
                "vmstate_bytes": payload.total_bytes, "chunking": chunking,
            })),
        },
        (Err(backstop_hypervisor::BackendError::Timeout { .. }), _) => fail(format!(
            "the save took longer than [rollback] forensic_ram_budget ({}): cancelled after {save_ms} ms",
            humantime::format_duration(budget)
        )),
        (Err(e), _) => fail(format!("the save failed: {e}")),
        (Ok(_), Err(e)) => fail(format!("the store did not take the state: {e}")),
    }
}

impl VmActor {
    /// The VM's state as it is abandoned (call before it is replaced).
    pub(crate) fn abandoned(&self) -> Abandoned {
        let chains = self
            .cfg
            .vm
            .disks
            .iter()
            .filter(|d| d.snapshot == DiskSnapshotMode::Capture)
            .filter_map(|d| self.vm.chains.get(&d.id).map(|c| (d.id.clone(), c.clone())))
            .filter(|(_, c)| !c.is_empty())
            .collect();
        Abandoned {
            chains,
            position: self.vm.position.clone(),
            epoch: self.vm.epoch,
        }
    }

    /// Publishes the abandoned state of the VM just replaced as a forensic snapshot: its disks,
    /// and its RAM when `ram` saved it. Best effort: the rollback goes on if this fails
    /// (journaled). Returns the snapshot's id.
    pub(crate) fn keep_forensic(
        &mut self,
        ctx: &mut Ctx,
        target: &str,
        origin: &Abandoned,
        ram: ForensicRam,
    ) -> Option<String> {
        match self.publish_forensic(ctx, target, origin, ram) {
            Ok(id) => id,
            Err(e) => {
                warn!(error = %e, "forensic snapshot not kept");
                let sid = self.session_id.clone();
                let _ = self.journal(AuditEvent::SnapshotCreateFailed, json!({
                    "snapshot_id": Value::Null, "session_id": sid, "trace_id": ctx.trace_id,
                    "result": "failed", "code": e.code(), "error": e.to_string(), "trigger": FORENSIC,
                }));
                None
            }
        }
    }

    fn publish_forensic(
        &mut self,
        ctx: &mut Ctx,
        target: &str,
        origin: &Abandoned,
        ram: ForensicRam,
    ) -> Result<Option<String>, EngineError> {
        let waited = Instant::now();
        let (builder, ram_facts) = match ram {
            ForensicRam::Skipped(why) => (None, Err(why)),
            ForensicRam::Saving(job) => {
                ctx.step(
                    "forensic",
                    "waiting for the abandoned VM's RAM and device state",
                    None,
                );
                let outcome = job.wait();
                (outcome.builder, outcome.facts)
            }
            ForensicRam::Saved(outcome) => (outcome.builder, outcome.facts),
        };
        let wait_ms = waited.elapsed().as_millis() as u64;
        let chains = &origin.chains;
        if chains.is_empty() && builder.is_none() {
            return Ok(None);
        }
        ctx.step(
            "forensic",
            "keeping the abandoned disks (frozen, not copied)",
            None,
        );
        let reason = format!("forensic: the state the rollback to {target} abandons");
        let sid = self.session_id.clone();
        self.journal(AuditEvent::SnapshotCreateRequested, json!({
            "snapshot_id": Value::Null, "session_id": sid, "trace_id": ctx.trace_id, "result": "pending",
            "reason": reason, "trigger": FORENSIC, "created_by": ctx.caller.label(), "scope": "full",
        }))?;
        let store_err =
            |step: &'static str| move |source| EngineError::SnapshotStore { step, source };
        let mut builder = match builder {
            Some(b) => b,
            None => self.store.begin().map_err(store_err("begin"))?,
        };
        for (id, chain) in chains {
            if let Some(top) = chain.last() {
                self.layers.freeze(top)?;
            }
            builder
                .add_disk_chain(id, chain)
                .map_err(store_err("record disk layers"))?;
        }
        let mut forensic = json!({"ram": ram_facts.is_ok(), "disks": chains.len()});
        match &ram_facts {
            Ok(facts) => {
                forensic["ram_wait_ms"] = wait_ms.into();
                if let (Value::Object(f), Value::Object(more)) = (&mut forensic, facts) {
                    f.extend(more.clone());
                }
            }
            Err(why) => forensic["ram_reason"] = why.clone().into(),
        }
        let m = builder
            .publish(ManifestInput {
                created_by: ctx.caller.label(),
                reason,
                scope: "full".into(),
                vm: self.cfg.vm.name.clone(),
                trigger: FORENSIC.into(),
                epoch: origin.epoch,
                config_fingerprint: self.backend.config_fingerprint(),
                capture: json!({"forensic": forensic, "backend": self.backend.kind(),
                    "guest_health": {"healthy": false, "why": "forensic: the state a rollback abandons"}}),
                lineage: Some(Lineage {
                    parent: origin.position.clone(),
                }),
                name: None,
            })
            .map_err(store_err("publish"))?;
        let parent = m.lineage.as_ref().and_then(|l| l.parent.clone());
        self.journal(AuditEvent::SnapshotCreateCompleted, json!({
            "snapshot_id": m.snapshot_id, "session_id": sid, "trace_id": ctx.trace_id, "result": "ok",
            "pause_us": 0, "bytes_stored": m.bytes_stored, "created_at": m.created_at,
            "manifest_sha256": crate::replay::manifest_sha256(self.store.root(), &m.snapshot_id).ok(),
            "parent": parent, "epoch": m.epoch, "healthy": false, "trigger": FORENSIC,
            "ram": ram_facts.is_ok(), "ram_reason": ram_facts.as_ref().err(),
        }))?;
        // In the lineage book, but not the VM's position: it is going elsewhere.
        self.policy.lineage.insert(
            m.snapshot_id.clone(),
            crate::policy::lineage::Node {
                parent,
                epoch: m.epoch,
                created_at: m.created_at.clone(),
            },
        );
        let _ = self.policy.save_lineage();
        match &ram_facts {
            Ok(_) => {
                info!(snapshot_id = %m.snapshot_id, wait_ms, "forensic snapshot kept, RAM included")
            }
            Err(why) => {
                info!(snapshot_id = %m.snapshot_id, ram_reason = %why, "forensic snapshot kept, disks only")
            }
        }
        Ok(Some(m.snapshot_id))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest(trigger: &str, capture: Value, payloads: &[&str]) -> Manifest {
        let refs: Vec<Value> = payloads
            .iter()
            .map(|n| {
                json!({"name": n, "kind": if n.starts_with("disk:") { "disk-layer-chain" } else { "ram+device" },
                    "index": Value::Null, "layers": [], "total_bytes": 0, "new_bytes": 0, "chunks": 0})
            })
            .collect();
        serde_json::from_value(json!({
            "snapshot_id": "0123456789abcdef0123456789abcdef", "created_at": "2026-01-01T00:00:00.000Z",
            "created_by": "console:uid=0", "schema_version": "1.0", "index_version": "1.0",
            "scope": "full", "reason": "r", "checksums": [], "payload_refs": refs, "vm": "t",
            "trigger": trigger, "epoch": 1, "config_fingerprint": "f", "capture": capture,
            "bytes_stored": 0,
        }))
        .unwrap()
    }

    #[test]
    fn a_forensic_target_needs_the_flag_and_ram() {
        let with_ram = manifest(
            FORENSIC,
            json!({"forensic": {"ram": true, "disks": 1}}),
            &["vmstate", "disk:data"],
        );
        assert!(has_ram(&with_ram));
        assert_eq!(target_refusal(&with_ram, true), None);
        let no_flag = target_refusal(&with_ram, false).unwrap();
        assert!(no_flag.contains("--include-forensic") && !no_flag.contains('\n'));

        let disks_only = manifest(
            FORENSIC,
            json!({"forensic": {"ram": false, "disks": 1, "ram_reason": "not kept for watchdog rollbacks ([rollback] forensic_ram_for)"}}),
            &["disk:data"],
        );
        assert!(!has_ram(&disks_only));
        for flag in [false, true] {
            let why = target_refusal(&disks_only, flag).unwrap();
            assert!(
                why.contains("without RAM") && why.contains("watchdog"),
                "{why}"
            );
        }
        // An older forensic snapshot (no reason recorded), and one claiming RAM without the
        // payload: never targets.
        let old = manifest(
            FORENSIC,
            json!({"forensic": {"ram": false, "disks": 1}}),
            &["disk:data"],
        );
        assert!(target_refusal(&old, true).unwrap().contains("was not kept"));
        let claims = manifest(FORENSIC, json!({"forensic": {"ram": true}}), &["disk:data"]);
        assert!(target_refusal(&claims, true).is_some());
        // Every other snapshot is not this rule's business.
        let plain = manifest("console", json!({}), &["vmstate", "disk:data"]);
        assert_eq!(target_refusal(&plain, false), None);
    }

    #[test]
    fn which_rollbacks_keep_ram() {
        use RollbackType::*;
        use TriggerKind as T;
        // By default, every kind.
        let defaults = crate::config::RollbackConfig::default().forensic_ram_for;
        for (trigger, ty) in [
            (T::Console, Session),
            (T::Policy, Session),
            (T::ActionFailed, Micro),
            (T::Console, Emergency),
            (T::ForceRollback, Emergency),
            (T::Tier0Violation, Emergency),
            (T::VmCrash, Emergency),
            (T::WatchdogTimeout, Emergency),
            (T::WatchdogDevice, Emergency),
        ] {
            assert!(
                ram_wanted(&defaults, trigger, ty).is_ok(),
                "{trigger:?} {ty:?}"
            );
        }
        // Naming some kinds leaves the others out, with the reason.
        let people_and_policy = vec!["console".to_string(), "policy".to_string()];
        for (trigger, ty, kept) in [
            (T::Console, Session, true),
            (T::Policy, Session, true),
            (T::ActionFailed, Micro, true),
            (T::SandboxContradiction, Micro, true),
            (T::Console, Emergency, false),
            (T::ForceRollback, Emergency, false),
            (T::WatchdogTimeout, Emergency, false),
            (T::WatchdogDevice, Emergency, false),
        ] {
            assert_eq!(
                ram_wanted(&people_and_policy, trigger, ty).is_ok(),
                kept,
                "{trigger:?} {ty:?}"
            );
        }
        let why = ram_wanted(&people_and_policy, T::WatchdogTimeout, Emergency).unwrap_err();
        assert!(
            why.contains("watchdog") && why.contains("forensic_ram_for"),
            "{why}"
        );
        let all: Vec<String> = ["watchdog", "emergency"].map(String::from).to_vec();
        assert!(ram_wanted(&all, T::WatchdogDevice, Emergency).is_ok());
        assert!(ram_wanted(&all, T::Console, Session).is_err());
        assert!(ram_wanted(&[], T::Console, Session).is_err());
    }

    #[test]
    fn the_budget_parses_humantime_within_bounds() {
        assert_eq!(parse_ram_budget("5s"), Ok(Duration::from_secs(5)));
        assert_eq!(parse_ram_budget("1ms"), Ok(Duration::from_millis(1)));
        assert_eq!(parse_ram_budget("10min"), Ok(Duration::from_secs(600)));
        for bad in ["", "5", "fast", "0s", "11min", "-1s"] {
            assert!(parse_ram_budget(bad).is_err(), "{bad:?}");
        }
    }
}
