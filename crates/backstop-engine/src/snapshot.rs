//! The snapshot coordinator: one instant across RAM, device state and every captured disk.
//!
//! Order matters. The backend pauses the guest, switches every captured disk to a new overlay
//! and starts the RAM/device capture in one pause; the engine records the new chains durably
//! at once (so a crash leaves it pointing at the layers QEMU really writes), freezes the old top
//! layers, streams the state into the store, and publishes last. Until the publish renames the
//! build directory into place the snapshot does not exist.

use std::io::Read;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use serde_json::{json, Value};
use tracing::{info, warn};

use backstop_hypervisor::{BackendError, DiskSwitch, StreamLayout};
use backstop_journal::events;
use backstop_qemu::MigrationChunker;
use backstop_store::{Manifest, ManifestInput};

use crate::engine::{Ctx, Engine, Fault};
use crate::error::EngineError;
use crate::state::Transition;

/// The capture stream, abandoned as soon as a host trigger is waiting: a rollback overrides a
/// snapshot in flight, which is then never published.
struct Preemptible<'a> {
    inner: &'a mut dyn Read,
    preempt: &'a AtomicBool,
    read: u64,
    /// Fault injection: behave like a store that stalls once 1 MiB has been read.
    stall: Option<std::time::Duration>,
}

impl Read for Preemptible<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.read >= 1 << 20 {
            if let Some(d) = self.stall.take() {
                let until = Instant::now() + d;
                while Instant::now() < until && !self.preempt.load(Ordering::SeqCst) {
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
            }
        }
        if self.preempt.load(Ordering::SeqCst) {
            // Not `Interrupted`: std's read loops retry that kind forever.
            return Err(std::io::Error::other(
                "snapshot abandoned: a host trigger overrides it",
            ));
        }
        let n = self.inner.read(buf)?;
        self.read += n as u64;
        Ok(n)
    }
}

impl Engine {
    pub(crate) fn create_snapshot(
        &mut self,
        ctx: &mut Ctx,
        reason: &str,
        trigger: &str,
    ) -> Result<Manifest, EngineError> {
        // A VM holding a granted device cannot be snapshotted (see devices.rs): deferred.
        self.defer_snapshot_while_granted(ctx, reason, trigger)?;
        self.state = self.state.transition(Transition::BeginSnapshot)?;
        self.publish();
        let sid = self.session_id.clone();
        self.journal(events::SNAPSHOT_CREATE_REQUESTED, json!({
            "snapshot_id": Value::Null, "session_id": sid, "trace_id": ctx.trace_id, "result": "pending",
            "reason": reason, "trigger": trigger, "created_by": ctx.caller.label(), "scope": "full",
        }))?;
        let outcome = self.capture_and_publish(ctx, reason, trigger).map_err(|e| {
            if self.preempt.load(Ordering::SeqCst) {
                EngineError::Abandoned
            } else {
                e
            }
        });
        self.state = self.state.transition(Transition::EndSnapshot)?;
        match outcome {
            Ok(m) => {
                self.journal(events::SNAPSHOT_CREATE_COMPLETED, json!({
                    "snapshot_id": m.snapshot_id, "session_id": sid, "trace_id": ctx.trace_id, "result": "ok",
                    "pause_us": m.capture.get("pause_us"), "bytes_stored": m.bytes_stored,
                }))?;
                Ok(m)
            }
            Err(e) => {
                self.journal(events::SNAPSHOT_CREATE_FAILED, json!({
                    "snapshot_id": Value::Null, "session_id": sid, "trace_id": ctx.trace_id, "result": "failed",
                    "code": e.code(), "error": e.to_string(),
                }))?;
                Err(e)
            }
        }
    }

    fn capture_and_publish(
        &mut self,
        ctx: &mut Ctx,
        reason: &str,
        trigger: &str,
    ) -> Result<Manifest, EngineError> {
        let started = Instant::now();
        let mut builder = self
            .store
            .begin()
            .map_err(|source| EngineError::SnapshotStore {
                step: "begin",
                source,
            })?;
        let captured: Vec<(String, PathBuf)> = self
            .attachments()
            .into_iter()
            .filter(|d| d.captured)
            .map(|d| (d.id, d.active))
            .collect();
        // The new top layers are created before the pause, so that inside it QEMU only
        // switches its block graph (creating a qcow2 file there cost ~15-30 ms of pause).
        ctx.step("capture", "creating the new disk overlays", None);
        let mut switches = Vec::new();
        let created = (|| {
            for (id, active) in &captured {
                let new_active = self.next_layer(id);
                switches.push(DiskSwitch {
                    id: id.clone(),
                    new_active: new_active.clone(),
                });
                let size = self.layers.virtual_size(active)?;
                self.layers
                    .create_overlay_on_active(&new_active, active, size)?;
            }
            Ok(())
        })();
        let remove_created = |switches: &[DiskSwitch]| {
            for sw in switches {
                let _ = std::fs::remove_file(&sw.new_active);
            }
        };
        if let Err(e) = created {
            remove_created(&switches);
            return Err(e);
        }
        ctx.step(
            "capture",
            "pausing the guest, switching disks, starting the RAM capture",
            None,
        );
        let stream = match self.backend.begin_capture(&switches) {
            Ok(stream) => stream,
            Err(BackendError::CaptureAfterSwitch(source)) => {
                // The guest writes the new overlays now: they join the chains, and the layers
                // below them are immutable from here like any frozen layer (no snapshot of
                // their own: the next snapshot's chain includes them).
                for (_, old_active) in &captured {
                    self.layers.freeze(old_active)?;
                }
                for sw in &switches {
                    self.vm
                        .chains
                        .entry(sw.id.clone())
                        .or_default()
                        .push(sw.new_active.clone());
                }
                self.save_vm()?;
                return Err(EngineError::SnapshotBackend {
                    step: "start capture",
                    source: *source,
                });
            }
            Err(source) => {
                remove_created(&switches);
                return Err(EngineError::SnapshotBackend {
                    step: "start capture",
                    source,
                });
            }
        };
        // The snapshot's disk chains are the chains up to the layers that were just frozen.
        let mut snapshot_chains = Vec::new();
        for sw in &switches {
            let chain = self.vm.chains.entry(sw.id.clone()).or_default();
            snapshot_chains.push((sw.id.clone(), chain.clone()));
            chain.push(sw.new_active.clone());
        }
        self.save_vm()?;
        let mut reader = stream.reader;
        let result = (|| {
            for (_, layer) in &stream.frozen_layers {
                self.layers.freeze(layer)?;
            }
            let preempt = std::sync::Arc::clone(&self.preempt);
            let stall = match (self.fault, trigger == "baseline") {
                (Some(Fault::StallCapture(secs)), false) => {
                    ctx.step(
                        "capture",
                        format!("fault injection: the store stalls {secs} s after 1 MiB"),
                        None,
                    );
                    Some(std::time::Duration::from_secs(secs))
                }
                _ => None,
            };
            let mut reader = Preemptible {
                inner: &mut reader,
                preempt: &preempt,
                read: 0,
                stall,
            };
            let progress = &mut *ctx.progress;
            let mut on_chunk = |bytes| {
                progress(backstop_control::Progress {
                    step: "capture".into(),
                    message: "storing RAM and device state".into(),
                    bytes: Some(bytes),
                });
            };
            let (payload, chunking) = match stream.layout {
                StreamLayout::Opaque => {
                    let p =
                        builder.write_chunked("vmstate", "ram+device", &mut reader, &mut on_chunk);
                    (p, json!({"method": "content-defined"}))
                }
                StreamLayout::QemuMigration { page_size } => {
                    let mut chunker = MigrationChunker::new(&mut reader, page_size);
                    let p =
                        builder.write_chunks("vmstate", "ram+device", &mut chunker, &mut on_chunk);
                    let r = chunker.report();
                    if let Some(why) = &r.fallback {
                        warn!(reason = %why, "RAM stream not understood: the rest was cut content-defined");
                    }
                    (
                        p,
                        json!({
                            "method": "qemu-page-records", "page_records": r.page_records,
                            "record_chunks": r.record_chunks, "content_defined_chunks": r.cdc_chunks,
                            "fallback": r.fallback,
                        }),
                    )
                }
            };
            let payload = payload.map_err(|source| EngineError::SnapshotStore {
                step: "store state",
                source,
            })?;
            let report =
                self.backend
                    .finish_capture()
                    .map_err(|source| EngineError::SnapshotBackend {
                        step: "finish capture",
                        source,
                    })?;
            ctx.step("verify", "checksumming the frozen disk layers", None);
            for (id, chain) in &snapshot_chains {
                builder
                    .add_disk_chain(id, chain)
                    .map_err(|source| EngineError::SnapshotStore {
                        step: "record disk layers",
                        source,
                    })?;
            }
            let capture_ms = started.elapsed().as_millis() as u64;
            let capture = json!({
                "backend": self.backend.kind(), "accel": self.backend.accel(),
                "pause_us": report.pause_us, "downtime_ms": report.downtime_ms, "state_bytes": report.state_bytes,
                "capture_ms": capture_ms, "vmstate_bytes": payload.total_bytes, "chunking": chunking,
            });
            ctx.step("publish", "signing and publishing the manifest", None);
            let m = builder
                .publish(ManifestInput {
                    created_by: ctx.caller.label(),
                    reason: reason.to_string(),
                    scope: "full".into(),
                    vm: self.cfg.vm.name.clone(),
                    trigger: trigger.to_string(),
                    epoch: self.vm.epoch,
                    config_fingerprint: self.backend.config_fingerprint(),
                    capture,
                })
                .map_err(|source| EngineError::SnapshotStore {
                    step: "publish",
                    source,
                })?;
            info!(snapshot_id = %m.snapshot_id, pause_us = report.pause_us, capture_ms, bytes_stored = m.bytes_stored, "snapshot published");
            Ok(m)
        })();
        if result.is_err() {
            drop(reader);
            self.backend.abort_capture();
        }
        result
    }
}
