//! `audit replay --mode reexecute`: one snapshot restored into a sandbox VM — a second QEMU
//! with its own state and run directories, writable overlays of its own on the snapshot's
//! frozen layers, no tap device (NICs become user-mode, links down), no passthrough, and no
//! authority: nothing it sends is read as a heartbeat and it can trigger nothing. Its shape
//! (config fingerprint) and its first output (the serial console after resume) are checked
//! against the manifest, then it is ended and its directory removed. The report is never
//! authoritative (spec/003 §7).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use backstop_hypervisor::{BootMode, DiskAttachment};
use backstop_store::VerifyOptions;

use crate::actor::{Ctx, VmActor};
use crate::config::DiskSnapshotMode;
use crate::layers::Layers;

/// How long the sandbox guest has to say something after resume.
const FIRST_OUTPUT_WAIT: Duration = Duration::from_secs(20);
/// How much of its output the report keeps.
const FIRST_OUTPUT_BYTES: usize = 512;

impl VmActor {
    /// Restores `snapshot` (default: the newest verified of the current line) into a sandbox
    /// VM and reports what it showed. Never touches the guarded VM.
    pub(crate) fn sandbox_run(&mut self, ctx: &mut Ctx, snapshot: Option<&str>) -> Value {
        match self.sandbox_inner(ctx, snapshot) {
            Ok(v) => v,
            Err((step, e)) => json!({"ok": false, "step": step, "error": e}),
        }
    }

    fn sandbox_inner(
        &mut self,
        ctx: &mut Ctx,
        snapshot: Option<&str>,
    ) -> Result<Value, (&'static str, String)> {
        if self.cfg.vm.libvirt.is_some() || self.cfg.kvm_backend.is_some() {
            return Err((
                "choose backend",
                "reexecute runs a QEMU sandbox: the VM must use the qemu backend".into(),
            ));
        }
        let id = match snapshot {
            Some(s) => self
                .store
                .resolve(s)
                .map_err(|e| ("resolve snapshot", e.to_string()))?,
            None => self
                .newest_verified_live(ctx)
                .map_err(|e| ("choose snapshot", e.to_string()))?
                .ok_or(("choose snapshot", "no snapshot verifies".to_string()))?,
        };
        let target = self
            .store
            .verify(&id, &VerifyOptions::default())
            .map_err(|e| ("verify snapshot", format!("{}: {e}", e.code())))?;
        let dir = self.cfg.daemon.state_dir.join("replay-sandbox");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| ("sandbox dir", e.to_string()))?;
        let result = self.sandbox_in(&dir, &id, &target);
        let _ = std::fs::remove_dir_all(&dir);
        let _ = std::fs::remove_dir_all(
            self.cfg
                .daemon
                .run_dir
                .join(format!("{}-sandbox", self.cfg.vm.name)),
        );
        result
    }

    fn sandbox_in(
        &mut self,
        dir: &Path,
        id: &str,
        target: &backstop_store::VerifiedSnapshot,
    ) -> Result<Value, (&'static str, String)> {
        let mut cfg = self.cfg.clone();
        cfg.daemon.state_dir = dir.to_path_buf();
        cfg.vm.name = format!("{}-sandbox", self.cfg.vm.name);
        cfg.vm.tap_nics.clear();
        cfg.devices.clear();
        let mut backend = crate::services::backend_for(&cfg, &self.key)
            .map_err(|e| ("sandbox backend", e.to_string()))?;
        let shape_ok = backend.config_fingerprint() == target.manifest.config_fingerprint;
        if !shape_ok {
            return Ok(json!({
                "ok": false, "snapshot_id": id, "shape_matches": false,
                "error": "the sandbox's shape differs from the snapshot's config fingerprint",
            }));
        }
        let layers = Layers::new(
            dir.join("disks"),
            self.cfg.vm.qemu_img.clone(),
            Default::default(),
        );
        std::fs::create_dir_all(&layers.dir).map_err(|e| ("sandbox dir", e.to_string()))?;
        // In the config's order, as the VM had them (QEMU's device order must match the state).
        let chains: std::collections::BTreeMap<String, Vec<PathBuf>> =
            crate::rollback::manifest_chains(target)
                .into_iter()
                .collect();
        let mut disks = Vec::new();
        for d in &self.cfg.vm.disks {
            if d.snapshot == DiskSnapshotMode::Exclude {
                // The running VM's disk, written as we speak: the sandbox gets a blank disk of
                // the same size in its place (its content is in no snapshot).
                let blank = layers.dir.join(format!("{}-blank.qcow2", d.id));
                let size = virtual_size(&self.cfg.vm.qemu_img, &d.path)
                    .map_err(|e| ("excluded disk size", e))?;
                let out = std::process::Command::new(&self.cfg.vm.qemu_img)
                    .args(["create", "-q", "-f", "qcow2"])
                    .arg(&blank)
                    .arg(size.to_string())
                    .output()
                    .map_err(|e| ("blank excluded disk", e.to_string()))?;
                if !out.status.success() {
                    let why = String::from_utf8_lossy(&out.stderr).trim().to_string();
                    return Err(("blank excluded disk", why));
                }
                disks.push(DiskAttachment {
                    id: d.id.clone(),
                    active: blank,
                    captured: false,
                });
                continue;
            }
            let Some(top) = chains.get(&d.id).and_then(|c| c.last()) else {
                return Err((
                    "disk layers",
                    format!("the snapshot has no chain for disk {}", d.id),
                ));
            };
            let fmt = if chains[&d.id].len() == 1 {
                self.base_format(&d.id)
            } else {
                "qcow2".into()
            };
            let overlay = layers.dir.join(format!("{}-sandbox.qcow2", d.id));
            layers
                .create_overlay(&overlay, top, &fmt)
                .map_err(|e| ("disk overlays", e.to_string()))?;
            disks.push(DiskAttachment {
                id: d.id.clone(),
                active: overlay,
                captured: true,
            });
        }
        backend
            .launch(&disks, BootMode::Incoming)
            .map_err(|e| ("launch sandbox", e.to_string()))?;
        let loaded = (|| -> Result<u64, (&'static str, String)> {
            let mut sink = backend
                .begin_restore()
                .map_err(|e| ("start state load", e.to_string()))?;
            let mut payload = self
                .store
                .open_payload(target, "vmstate")
                .map_err(|e| ("open state", e.to_string()))?;
            let n = std::io::copy(&mut payload, &mut sink)
                .map_err(|e| ("load state", e.to_string()))?;
            sink.flush().map_err(|e| ("load state", e.to_string()))?;
            drop(sink);
            backend
                .finish_restore()
                .map_err(|e| ("check restored vm", e.to_string()))?;
            backend.resume().map_err(|e| ("resume", e.to_string()))?;
            Ok(n)
        })();
        let serial = dir.join(format!("{}-serial.log", cfg.vm.name));
        let first_output = match &loaded {
            Ok(_) => wait_output(&serial),
            Err(_) => String::new(),
        };
        let pid = backend.pid();
        let _ = backend.terminate();
        let bytes = loaded?;
        let ran = !first_output.is_empty();
        Ok(json!({
            "ok": shape_ok && ran,
            "snapshot_id": id,
            "shape_matches": shape_ok,
            "config_fingerprint": target.manifest.config_fingerprint,
            "state_bytes_loaded": bytes,
            "guest_ran": ran,
            "first_output": first_output,
            "sandbox_pid": pid,
            "isolation": ["own state and run dirs", "own disk overlays", "excluded disks blank", "no tap device, links down", "no passthrough devices", "guest channel not read"],
        }))
    }
}

use std::io::Write;

/// A disk image's virtual size in bytes, read with shared locks (`-U`): the running VM holds it.
fn virtual_size(qemu_img: &Path, image: &Path) -> Result<u64, String> {
    let out = std::process::Command::new(qemu_img)
        .args(["info", "-U", "--output=json"])
        .arg(image)
        .output()
        .map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).trim().to_string());
    }
    let v: Value = serde_json::from_slice(&out.stdout).map_err(|e| e.to_string())?;
    v.get("virtual-size")
        .and_then(Value::as_u64)
        .ok_or_else(|| "qemu-img info gave no virtual-size".to_string())
}

/// The guest's first output after resume: what the serial log gains within the wait.
fn wait_output(serial: &Path) -> String {
    let start_len = std::fs::metadata(serial).map(|m| m.len()).unwrap_or(0);
    let deadline = Instant::now() + FIRST_OUTPUT_WAIT;
    while Instant::now() < deadline {
        if let Ok(bytes) = std::fs::read(serial) {
            if bytes.len() as u64 > start_len {
                std::thread::sleep(Duration::from_millis(300));
                let bytes = std::fs::read(serial).unwrap_or(bytes);
                let new = &bytes[start_len as usize..];
                let new = &new[..new.len().min(FIRST_OUTPUT_BYTES)];
                return String::from_utf8_lossy(new).into_owned();
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    String::new()
}
