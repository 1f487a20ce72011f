//! What the console prints. Every function here is pure: data in, text out.

use std::fmt::Write as _;

use backstop_common::time::parse_rfc3339;
use backstop_control::{
    ActionView, AuditVerifyReport, DevicesView, DriftReport, DriftView, HypervisorDevicesView,
    Progress, PruneView, ReloadReport, ReplayReport, Request, Response, RollbackReport,
    SnapshotSummary, SnapshotView, StatusView, VerifyReport, VmSummary,
};
use serde_json::{json, Value};
use time::format_description::BorrowedFormatItem;
use time::macros::format_description;

/// Characters of a snapshot id shown in tables.
pub const SHORT_ID_LEN: usize = 12;

/// Audit entry fields that hold the chain itself, not news for a person.
const CHAIN_FIELDS: [&str; 8] = [
    "prev",
    "prev_hash",
    "hash",
    "entry_hash",
    "mac",
    "hmac",
    "sig",
    "signature",
];
const SEQ_FIELDS: [&str; 1] = ["seq"];
const TIME_FIELDS: [&str; 4] = ["ts", "timestamp", "time", "at"];
const EVENT_FIELDS: [&str; 3] = ["event", "event_type", "type"];
/// The journal's object of per-event data (`{seq, ts, event, fields, prev, hash, mac}`).
const NESTED_FIELDS: &str = "fields";

/// How much of a long answer a person sees: `snapshot show` prints a summary unless asked for
/// the whole manifest (`--full`). JSON output is always whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Detail {
    Summary,
    Full,
}

/// [`human`], with `snapshot show` cut to its summary unless `detail` is [`Detail::Full`].
pub fn human_at(request: &Request, response: &Response, detail: Detail) -> String {
    match (request, response, detail) {
        (
            Request::SnapshotShow { .. } | Request::SnapshotCurrent,
            Response::Snapshot(view),
            Detail::Summary,
        ) => snapshot_summary_text(view),
        _ => human(request, response),
    }
}

/// The human rendering of a successful response, newline-terminated, whole (`snapshot show`
/// with its manifest). `request` tells a created snapshot from a shown one (both come back as
/// [`Response::Snapshot`]).
pub fn human(request: &Request, response: &Response) -> String {
    match response {
        Response::Status(status) => status_text(status),
        Response::Snapshot(view) => match request {
            Request::SnapshotCreate { .. } => created_text(view),
            _ => snapshot_text(view),
        },
        Response::SnapshotList { snapshots } => list_text(snapshots),
        Response::Verified(report) => verified_text(report),
        Response::SnapshotPulled(p) => {
            let mut text = format!(
                "snapshot {} published here: {}'s {} verified (ed25519 signature, every chunk and layer), {} fetched in {} ms\n",
                clean(&p.snapshot_id),
                clean(&p.from),
                clean(&p.remote_snapshot_id),
                human_bytes(p.bytes_fetched),
                p.total_ms
            );
            if let Some(s) = &p.started {
                text.push_str(&format!(
                    "lease taken until {}{}; VM started from it (epoch {}, {} ms)\n",
                    clean(&s.lease_expires_at),
                    s.taken_over_from
                        .as_deref()
                        .map(|h| format!(" (taken over from {}'s expired lease)", clean(h)))
                        .unwrap_or_default(),
                    s.rollback.epoch,
                    s.rollback.total_ms
                ));
            }
            text
        }
        Response::OffsiteGc(r) => offsite_gc_text(r),
        Response::RolledBack(report) => rolled_back_text(report),
        Response::HaltCleared {
            epoch,
            restored_from,
        } => match restored_from {
            Some(id) => format!("halt cleared; epoch {epoch}; restored from {}\n", clean(id)),
            None => format!("halt cleared; epoch {epoch}; no verified snapshot, VM cold-booted\n"),
        },
        Response::AuditEntries { entries } => audit_entries_text(entries),
        Response::AuditVerified(report) => audit_verified_text(report),
        Response::Replayed(report) => replay_text(report),
        Response::SnapshotTree { nodes, current } => tree_text(nodes, current.as_deref()),
        Response::Events {
            delivered,
            last_seq,
        } => {
            let seqs: Vec<String> = last_seq
                .iter()
                .map(|(vm, s)| format!("{} seq {s}", clean(vm)))
                .collect();
            format!("{delivered} event(s); caught up at {}\n", seqs.join(", "))
        }
        Response::Devices(view) => devices_text(view),
        Response::Action(view) => action_text(view),
        Response::Actions { actions } => actions_text(actions),
        Response::Pruned(view) => pruned_text(view),
        Response::Vms { vms } => vms_text(vms),
        Response::Drift(report) => drift_text(report),
        Response::Reloaded(r) => reloaded_text(r),
        Response::VmAdded(r) => vm_added_text(r),
        Response::VmReset(r) => vm_reset_text(r),
        Response::VmChecked(r) => vm_check_text(r),
        Response::SnapshotDeleted(d) => format!(
            "snapshot {}{} deleted: {} chunk(s) and {} disk layer(s) freed\n",
            clean(&d.snapshot_id),
            named(d.name.as_deref()),
            d.chunks_removed,
            d.layers_removed
        ),
    }
}

/// ` (NAME)` after an id, for a named snapshot; nothing for an unnamed one.
fn named(name: Option<&str>) -> String {
    name.map_or_else(String::new, |n| format!(" ({})", clean(n)))
}

/// `action begin` / `action end`: one line, plus the rollback line of a failed action.
fn action_text(a: &ActionView) -> String {
    let snapshot = match (&a.snapshot_id, a.snapshot_taken) {
        (Some(id), true) => format!("pre-action snapshot {} taken", clean(id)),
        (Some(id), false) => format!("no snapshot required; bounded by snapshot {}", clean(id)),
        (None, _) => "no snapshot".to_string(),
    };
    let mut text = format!(
        "action {} {}: {} (tier {}, {}, risk {})\n",
        clean(&a.action_id),
        clean(&a.state),
        snapshot,
        a.tier,
        clean(&a.action_kind),
        clean(&a.risk_level)
    );
    if let Some(r) = &a.rollback {
        text.push_str(&rolled_back_text(r));
    }
    text
}

fn actions_text(actions: &[ActionView]) -> String {
    if actions.is_empty() {
        return "no open actions\n".to_string();
    }
    let rows: Vec<Vec<String>> = actions
        .iter()
        .map(|a| {
            vec![
                clean(&a.action_id),
                a.tier.to_string(),
                clean(&a.action_kind),
                clean(&a.risk_level),
                a.snapshot_id
                    .as_deref()
                    .map_or_else(|| "-".into(), short_id),
                short_time(&a.opened_at),
                clean(&a.opened_by),
            ]
        })
        .collect();
    table(
        &["ACTION", "TIER", "KIND", "RISK", "SNAPSHOT", "OPENED", "BY"],
        &rows,
    )
}

/// `vm add`: the file written, how the VM started, and its line of `vms`.
fn vm_added_text(r: &backstop_control::VmAddReport) -> String {
    let mut text = format!("VM file {} written\n", clean(&r.file));
    if let Some(p) = &r.from_snapshot {
        let _ = writeln!(
            text,
            "snapshot {} published here: {}'s {} verified, {} fetched in {} ms",
            clean(&p.snapshot_id),
            clean(&p.from),
            clean(&p.remote_snapshot_id),
            human_bytes(p.bytes_fetched),
            p.fetch_ms
        );
        let _ = writeln!(
            text,
            "lease taken until {}{}; VM started from it ({} ms)",
            clean(&p.lease_expires_at),
            p.taken_over_from
                .as_deref()
                .map(|h| format!(" (taken over from {}'s expired lease)", clean(h)))
                .unwrap_or_default(),
            p.start_ms
        );
    }
    text.push_str(&vms_text(std::slice::from_ref(&r.vm)));
    text
}

fn vm_check_text(r: &backstop_control::VmCheckReport) -> String {
    let mut text = if r.problems.is_empty() {
        format!("vm {} ({}): ready\n", clean(&r.vm), clean(&r.backend))
    } else {
        format!(
            "vm {} ({}): {} to fix\n",
            clean(&r.vm),
            clean(&r.backend),
            r.problems.len()
        )
    };
    for p in &r.problems {
        let _ = writeln!(text, "  problem: {}", clean(p));
    }
    for n in &r.notes {
        let _ = writeln!(text, "  {}", clean(n));
    }
    text
}

fn vm_reset_text(r: &backstop_control::VmResetReport) -> String {
    let head = match (r.old_head_seq, &r.old_head_hash) {
        (Some(seq), Some(hash)) => format!("seq {seq}, hash {}", clean(hash)),
        _ => "no whole entry".to_string(),
    };
    let mut text = format!(
        "state moved aside as evidence: {}\nnew chain started after the old head ({head})\n",
        clean(&r.evidence)
    );
    text.push_str(&vms_text(std::slice::from_ref(&r.vm)));
    text
}

fn reloaded_text(r: &ReloadReport) -> String {
    let list = |v: &[String]| {
        if v.is_empty() {
            "-".to_string()
        } else {
            v.iter().map(|n| clean(n)).collect::<Vec<_>>().join(", ")
        }
    };
    let mut text = format!(
        "added: {}\nremoved: {}\nchanged, not applied: {}\n",
        list(&r.added),
        list(&r.removed),
        list(&r.changed_not_applied)
    );
    if !r.applied.is_empty() {
        let _ = writeln!(
            text,
            "changed and applied (restarted from a final snapshot, or re-attached): {}",
            list(&r.applied)
        );
    }
    for (name, why) in &r.not_applied_why {
        let _ = writeln!(text, "not applied {}: {}", clean(name), clean(why));
    }
    for (name, why) in &r.refused {
        let _ = writeln!(text, "refused {}: {}", clean(name), clean(why));
    }
    text
}

/// `backstop vms`: one line per VM; ages in seconds, `-` where there is none.
fn vms_text(vms: &[VmSummary]) -> String {
    if vms.is_empty() {
        return "no VMs\n".into();
    }
    let mut text = format!(
        "{:<20} {:<8} {:<16} {:>5} {:>9} {:>12} {:>10}  {:<22} {:<12} {}\n",
        "NAME",
        "BACKEND",
        "STATE",
        "EPOCH",
        "SNAPSHOTS",
        "NEWEST AGE",
        "HEARTBEAT",
        "LAST ROLLBACK",
        "LINKS",
        "DEVICES"
    );
    let now = time::OffsetDateTime::now_utc();
    for v in vms {
        let newest = v
            .newest_snapshot_at
            .as_deref()
            .and_then(parse_rfc3339)
            .map(|t| format!("{}s", (now - t).whole_seconds().max(0)))
            .unwrap_or_else(|| "-".into());
        let heartbeat = v
            .heartbeat_age_ms
            .map(|ms| format!("{:.1}s", ms as f64 / 1000.0))
            .unwrap_or_else(|| "-".into());
        // "42s ago in 1.3s": how long ago it completed and how long it took.
        let last_rollback = v
            .last_rollback
            .as_ref()
            .map(|r| {
                let ago = parse_rfc3339(&r.at)
                    .map(|t| format!("{}s ago", (now - t).whole_seconds().max(0)))
                    .unwrap_or_else(|| "?".into());
                format!("{ago} in {:.1}s", r.duration_ms as f64 / 1000.0)
            })
            .unwrap_or_else(|| "-".into());
        let links = if v.links.is_empty() {
            "-".to_string()
        } else {
            v.links
                .iter()
                .map(|l| {
                    let up = match l.up {
                        Some(true) => "up",
                        Some(false) => "down",
                        None => "?",
                    };
                    format!("{}:{up}", clean(&l.nic))
                })
                .collect::<Vec<_>>()
                .join(",")
        };
        let devices = if v.granted_devices.is_empty() {
            "-".to_string()
        } else {
            v.granted_devices
                .iter()
                .map(|d| clean(d))
                .collect::<Vec<_>>()
                .join(",")
        };
        let _ = writeln!(
            text,
            "{:<20} {:<8} {:<16} {:>5} {:>9} {:>12} {:>10}  {:<22} {:<12} {}",
            clean(&v.name),
            clean(&v.backend),
            clean(&v.state),
            v.epoch,
            v.snapshots,
            newest,
            heartbeat,
            last_rollback,
            links,
            devices
        );
        if let Some(r) = &v.reason {
            let _ = writeln!(text, "  {}: {}", clean(&v.name), clean(r));
        }
    }
    text
}

fn pruned_text(p: &PruneView) -> String {
    let mut text = format!(
        "pruned {} snapshot(s), kept {}; {} chunk(s) and {} disk layer(s) removed\n",
        p.removed.len(),
        p.kept.len(),
        p.chunks_removed,
        p.layers_removed
    );
    for r in &p.removed {
        let _ = writeln!(
            text,
            "  removed {}: {}",
            short_id(&r.snapshot_id),
            clean(&r.reason)
        );
    }
    for k in &p.kept {
        let reasons: Vec<String> = k.reasons.iter().map(|r| clean(r)).collect();
        let _ = writeln!(
            text,
            "  kept    {}: {}",
            short_id(&k.snapshot_id),
            reasons.join("; ")
        );
    }
    text
}

/// `--json`: the response as one pretty-printed JSON document, newline-terminated (`events`:
/// one compact line, after its notification lines, so the whole output is JSON lines).
pub fn json(response: &Response) -> String {
    let encoded = match response {
        Response::Events { .. } => serde_json::to_string(response),
        _ => serde_json::to_string_pretty(response),
    };
    let mut text = encoded.unwrap_or_else(|e| {
        error_json("ERR_CONSOLE_ENCODE", &format!("encoding the response: {e}"))
    });
    if !text.ends_with('\n') {
        text.push('\n');
    }
    text
}

/// `--json` on failure: `{"error":{"code":..,"message":..}}`, pretty-printed, newline-terminated.
pub fn error_json(code: &str, message: &str) -> String {
    let doc = json!({ "error": { "code": code, "message": message } });
    let mut text = serde_json::to_string_pretty(&doc).unwrap_or_default();
    text.push('\n');
    text
}

/// The one stderr line of a failure: `backstop: <CODE>: <message>`.
pub fn error_line(code: &str, message: &str) -> String {
    format!("backstop: {}: {}\n", clean(code), clean(message))
}

/// A progress line when stderr is not a terminal: `backstop: <step>: <message>`.
pub fn progress_line(progress: &Progress) -> String {
    format!("backstop: {}\n", progress_text(progress))
}

/// Step, message and bytes of a progress report, on one line.
pub fn progress_text(progress: &Progress) -> String {
    let mut text = format!("{}: {}", clean(&progress.step), clean(&progress.message));
    if let Some(bytes) = progress.bytes {
        let _ = write!(text, " ({})", human_bytes(bytes));
    }
    text
}

fn status_text(s: &StatusView) -> String {
    let mut rows = vec![
        ("vm", clean(&s.vm)),
        ("state", clean(&s.state)),
        ("epoch", s.epoch.to_string()),
        ("backend", clean(&s.backend)),
        ("accel", clean(&s.accel)),
        (
            "pid",
            s.pid.map_or_else(|| "-".to_string(), |pid| pid.to_string()),
        ),
        ("snapshots", s.snapshots.to_string()),
        (
            "newest snapshot",
            s.newest_snapshot.as_deref().map_or_else(
                || "-".into(),
                |id| format!("{}{}", clean(id), named(s.newest_snapshot_name.as_deref())),
            ),
        ),
        ("session", clean(&s.session_id)),
    ];
    if s.guest_paused {
        rows.push((
            "guest",
            "paused (halt clear --paused): `backstop resume --reason R` continues it".into(),
        ));
    }
    if let Some(n) = &s.not_running {
        rows.push((
            "not running",
            format!("{}: {}", clean(&n.code), clean(&n.reason)),
        ));
    }
    if let Some(w) = &s.waiting_for_baseline {
        rows.push((
            "start",
            format!(
                "not started since {} ({}): {}",
                clean(&w.since),
                clean(&w.code),
                clean(&w.reason)
            ),
        ));
    }
    if let Some(why) = &s.guest_paused_outside {
        rows.push((
            "guest",
            format!(
                "{}: no heartbeat is expected until it runs again",
                clean(why)
            ),
        ));
    }
    rows.extend(live_rows(s));
    if let Some(o) = &s.offsite {
        let mut line = format!(
            "{} pending, {} uploaded to {}/{} as {}",
            o.pending,
            o.uploaded,
            clean(&o.endpoint),
            clean(&o.bucket),
            clean(&o.host)
        );
        if let Some(u) = &o.uploading {
            line.push_str(&format!("; uploading {}", clean(u)));
        }
        if let Some(e) = &o.last_error {
            line.push_str(&format!("; last error: {}", clean(e)));
        }
        if o.lagging {
            line.push_str(&format!(
                "; LAGGING: the oldest has waited {} s (threshold {} s)",
                o.oldest_pending_s.unwrap_or(0),
                o.lag_threshold_s
            ));
        }
        rows.push(("offsite", line));
        for l in &o.leases {
            let mut line = format!("{}: {}", clean(&l.vm), clean(&l.state));
            if let Some(h) = &l.holder {
                line.push_str(&format!(" by {}", clean(h)));
            }
            if let Some(e) = &l.expires_at {
                line.push_str(&format!(" until {}", clean(e)));
            }
            if let Some(e) = &l.last_error {
                line.push_str(&format!("; last error: {}", clean(e)));
            }
            rows.push(("lease", line));
        }
    }
    for (k, v) in &s.backend_details {
        let v = match v {
            serde_json::Value::String(t) => t.clone(),
            other => other.to_string(),
        };
        rows.push((k.as_str(), clean(&v)));
    }
    if let Some(halt) = &s.halted {
        rows.push(("halted since", clean(&halt.since)));
        rows.push(("halt code", clean(&halt.code)));
        rows.push(("halt reason", clean(&halt.reason)));
    }
    if s.drift_open > 0 {
        rows.push(("drift open", s.drift_open.to_string()));
    }
    let mut text = key_values(&rows);
    if !s.drift.is_empty() {
        text.push_str(&drift_table(&s.drift, false));
    }
    text
}

/// Drift rows: invariant, node, severity, how found, when, and (resolved) how it ended.
fn drift_table(drifts: &[DriftView], resolved: bool) -> String {
    let mut header = vec!["INVARIANT", "NODE", "SEVERITY", "FOUND BY", "DETECTED"];
    if resolved {
        header.extend(["RESOLVED", "RESOLUTION"]);
    } else {
        header.push("DETAILS");
    }
    let rows: Vec<Vec<String>> = drifts
        .iter()
        .map(|d| {
            let mut row = vec![
                clean(&d.invariant_id),
                clean(&d.node_id),
                clean(&d.severity),
                clean(&d.drift_type),
                short_time(&d.detected_at),
            ];
            if resolved {
                row.push(
                    d.resolved_at
                        .as_deref()
                        .map_or_else(|| "-".into(), short_time),
                );
                row.push(d.resolution.as_deref().map_or_else(|| "-".into(), clean));
            } else {
                row.push(clean(&d.details));
            }
            row
        })
        .collect();
    table(&header, &rows)
}

fn drift_text(r: &DriftReport) -> String {
    let mut text = format!("vm {}: ", clean(&r.vm));
    if r.open.is_empty() {
        text.push_str("no open drift\n");
    } else {
        let _ = writeln!(text, "{} open drift", r.open.len());
        text.push_str(&drift_table(&r.open, false));
    }
    if !r.resolved.is_empty() {
        text.push_str("\nrecently resolved:\n");
        text.push_str(&drift_table(&r.resolved, true));
    }
    if !r.unusable_snapshots.is_empty() {
        let ids: Vec<String> = r.unusable_snapshots.iter().map(|i| short_id(i)).collect();
        let _ = writeln!(text, "\nsnapshots marked unusable: {}", ids.join(", "));
    }
    let _ = writeln!(
        text,
        "\nlast reconciliation pass: {}\ninvariants:",
        r.last_reconcile_at
            .as_deref()
            .map_or_else(|| "not yet".into(), short_time)
    );
    let rows: Vec<Vec<String>> = r
        .invariants
        .iter()
        .map(|i| {
            vec![
                clean(&i.invariant_id),
                clean(&i.severity),
                clean(&i.coverage),
                clean(&i.action),
            ]
        })
        .collect();
    text.push_str(&table(
        &["INVARIANT", "SEVERITY", "COVERAGE", "ON DRIFT"],
        &rows,
    ));
    text
}

/// The live view's rows, each only when it has something to say (a fresh daemon's VM shows
/// none of the rollback rows).
fn live_rows(s: &StatusView) -> Vec<(&'static str, String)> {
    let mut rows = Vec::new();
    if let Some(pause_us) = s.newest_snapshot_pause_us {
        rows.push(("newest pause", human_pause(pause_us)));
    }
    if s.store_bytes > 0 {
        rows.push(("stored", human_bytes(s.store_bytes)));
    }
    if let Some(age_ms) = s.heartbeat_age_ms {
        rows.push(("heartbeat", format!("{:.1} s ago", age_ms as f64 / 1000.0)));
    }
    if let Some(r) = &s.last_rollback {
        rows.push((
            "last rollback",
            format!(
                "{} at {} ({}, {}, {} ms)",
                clean(&r.snapshot_id),
                clean(&r.at),
                clean(&r.trigger),
                clean(&r.rollback_type),
                r.duration_ms
            ),
        ));
    }
    if !s.rollbacks_by_trigger.is_empty() {
        let by: Vec<String> = s
            .rollbacks_by_trigger
            .iter()
            .map(|(t, n)| format!("{} {n}", clean(t)))
            .collect();
        rows.push(("rollbacks", by.join(", ")));
    }
    if s.halts > 0 {
        rows.push(("halts", s.halts.to_string()));
    }
    if !s.links.is_empty() {
        let links: Vec<String> = s
            .links
            .iter()
            .map(|l| {
                let state = match l.up {
                    Some(true) => "up",
                    Some(false) => "down",
                    None => "unknown",
                };
                format!("{} {state}", clean(&l.nic))
            })
            .collect();
        rows.push(("links", links.join(", ")));
    }
    if !s.granted_devices.is_empty() {
        let ids: Vec<String> = s.granted_devices.iter().map(|d| clean(d)).collect();
        rows.push(("granted", ids.join(", ")));
    }
    rows
}

fn created_text(view: &SnapshotView) -> String {
    let s = &view.summary;
    format!(
        "snapshot {}{} created: guest paused {}, capture {} ms, stored {}\n",
        clean(&s.snapshot_id),
        named(s.name.as_deref()),
        human_pause(s.pause_us),
        view.capture_ms,
        human_bytes(s.bytes_stored)
    )
}

/// `snapshot show` without `--full`: the summary, and what the manifest holds in numbers.
fn snapshot_summary_text(view: &SnapshotView) -> String {
    let count = |key: &str| view.manifest[key].as_array().map_or(0, Vec::len);
    let mut text = snapshot_rows(view);
    text.push_str(&format!(
        "manifest: {} checksums, {} payloads, epoch {} (--full prints it whole)\n",
        count("checksums"),
        count("payload_refs"),
        view.manifest["epoch"]
            .as_u64()
            .map_or_else(|| "-".to_string(), |e| e.to_string())
    ));
    text
}

/// `snapshot show --full` (and [`human`]): the summary and the whole manifest.
fn snapshot_text(view: &SnapshotView) -> String {
    let mut text = snapshot_rows(view);
    text.push_str("manifest:\n");
    // Pretty JSON escapes every control character, so the manifest is safe to print as is.
    text.push_str(&serde_json::to_string_pretty(&view.manifest).unwrap_or_default());
    text.push('\n');
    text
}

fn snapshot_rows(view: &SnapshotView) -> String {
    let s = &view.summary;
    let mut rows = vec![("snapshot", clean(&s.snapshot_id))];
    if let Some(name) = &s.name {
        rows.push(("name", clean(name)));
    }
    rows.extend([
        (
            "created",
            format!("{} by {}", clean(&s.created_at), clean(&s.created_by)),
        ),
        ("scope", clean(&s.scope)),
        (
            "schema",
            format!(
                "{}, index {}",
                clean(&s.schema_version),
                clean(&s.index_version)
            ),
        ),
        ("reason", clean(&s.reason)),
        ("pause", pause_with_breakdown(s.pause_us, &view.manifest)),
        ("capture", format!("{} ms", view.capture_ms)),
        ("stored", human_bytes(s.bytes_stored)),
    ]);
    // A forensic snapshot says whether it kept the abandoned RAM (and so can be restored with
    // `rollback --to ID --include-forensic`), or why not.
    if let Some(f) = view.manifest["capture"].get("forensic") {
        let ram = match (f["ram"].as_bool(), f["ram_reason"].as_str()) {
            (Some(true), _) => "true (restorable with rollback --include-forensic)".to_string(),
            (_, Some(why)) => format!("false ({})", clean(why)),
            _ => "false".to_string(),
        };
        rows.push(("ram", ram));
    }
    if s.current {
        rows.push(("current", "yes: the running VM descends from it".into()));
    }
    key_values(&rows)
}

fn list_text(snapshots: &[SnapshotSummary]) -> String {
    if snapshots.is_empty() {
        return "no snapshots\n".to_string();
    }
    let any_current = snapshots.iter().any(|s| s.current);
    // A NAME column only when some snapshot has a name (unnamed lists look as they did).
    let any_named = snapshots.iter().any(|s| s.name.is_some());
    // An OFFSITE column only when the daemon replicates.
    let any_offsite = snapshots.iter().any(|s| s.replication.is_some());
    let mut header = vec![
        if any_current { "  ID" } else { "ID" },
        "CREATED",
        "BY",
        "TRIGGER",
        "SCOPE",
        "PAUSE",
        "STORED",
        "LINE",
        "REASON",
    ];
    let mut right_aligned = vec![false, false, false, false, false, true, true, false, false];
    if any_named {
        header.insert(1, "NAME");
        right_aligned.insert(1, false);
    }
    if any_offsite {
        let at = header.len() - 1;
        header.insert(at, "OFFSITE");
        right_aligned.insert(at, false);
    }
    let rows: Vec<Vec<String>> = snapshots
        .iter()
        .map(|s| {
            let line = match (&s.unusable, &s.rolled_back) {
                // Drift detection found it failing: listed, never a rollback target.
                (Some(_), _) => "UNUSABLE".to_string(),
                // spec/004 soft rollback: still listed, marked, with where the VM went.
                (None, Some(m)) => format!("rolled back → {}", short_id(&m.rollback_to)),
                (None, None) => "current".to_string(),
            };
            let mut row = vec![
                // `git branch` style: `*` before the snapshot the running VM descends from.
                match (any_current, s.current) {
                    (false, _) => short_id(&s.snapshot_id),
                    (true, true) => format!("* {}", short_id(&s.snapshot_id)),
                    (true, false) => format!("  {}", short_id(&s.snapshot_id)),
                },
                short_time(&s.created_at),
                clean(&s.created_by),
                if s.trigger.is_empty() {
                    "-".to_string()
                } else {
                    clean(&s.trigger)
                },
                clean(&s.scope),
                human_pause(s.pause_us),
                human_bytes(s.bytes_stored),
                line,
                clean(&s.reason),
            ];
            if any_named {
                row.insert(1, s.name.as_deref().map_or_else(|| "-".into(), clean));
            }
            if any_offsite {
                let at = row.len() - 1;
                row.insert(
                    at,
                    s.replication
                        .as_ref()
                        .map_or_else(|| "-".into(), |r| clean(&r.state)),
                );
            }
            row
        })
        .collect();
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in &rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let mut text = String::new();
    let header: Vec<String> = header.into_iter().map(String::from).collect();
    for row in std::iter::once(&header).chain(&rows) {
        let mut line = String::new();
        for (i, cell) in row.iter().enumerate() {
            if i > 0 {
                line.push_str("  ");
            }
            let pad = widths[i].saturating_sub(cell.chars().count());
            let last = i == row.len() - 1;
            if right_aligned[i] {
                line.push_str(&" ".repeat(pad));
                line.push_str(cell);
            } else {
                line.push_str(cell);
                if !last {
                    line.push_str(&" ".repeat(pad));
                }
            }
        }
        text.push_str(line.trim_end());
        text.push('\n');
    }
    text
}

fn verified_text(r: &VerifyReport) -> String {
    format!(
        "snapshot {} verified: {} chunks, {} bytes, {} disk layers\n",
        clean(&r.snapshot_id),
        r.chunks_checked,
        r.bytes_checked,
        r.disk_layers_checked
    )
}

fn rolled_back_text(r: &RollbackReport) -> String {
    if let Some(first) = &r.repeat_of {
        return format!(
            "repeated trigger: nothing done now; the first one (trace {}) rolled back to {} ({}, {}); epoch {}\n",
            clean(first),
            clean(&r.snapshot_id),
            clean(&r.rollback_type),
            clean(&r.trigger),
            r.epoch
        );
    }
    let revoked = if r.revoked.is_empty() {
        "none".to_string()
    } else {
        r.revoked
            .iter()
            .map(|s| clean(s))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let skipped = if r.skipped.is_empty() {
        "none".to_string()
    } else {
        r.skipped
            .iter()
            .map(|s| format!("{} ({})", clean(&s.snapshot_id), clean(&s.code)))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut text = format!(
        "rolled back to {} ({}, {}) in {} ms, restore {} ms; epoch {}; revoked: {}; skipped: {}\n",
        clean(&r.snapshot_id),
        clean(&r.rollback_type),
        clean(&r.trigger),
        r.total_ms,
        r.restore_ms,
        r.epoch,
        revoked,
        skipped
    );
    if !r.phases.is_empty() {
        let phases: Vec<String> = r
            .phases
            .iter()
            .map(|p| format!("{} {} ms", clean(&p.phase), p.ms))
            .collect();
        let _ = writeln!(text, "phases: {}", phases.join(", "));
    }
    text
}

fn audit_entries_text(entries: &[Value]) -> String {
    if entries.is_empty() {
        return "no audit entries\n".to_string();
    }
    entries.iter().map(|e| audit_entry_line(e) + "\n").collect()
}

/// `seq ts event key=val ...`: the event's `fields` flattened (keys sorted), the chain's own
/// fields (`prev`, `hash`, `mac`) left out.
fn audit_entry_line(entry: &Value) -> String {
    let Some(fields) = entry.as_object() else {
        return clean(&entry.to_string());
    };
    let first = |names: &[&str]| {
        names
            .iter()
            .find_map(|n| fields.get(*n))
            .map_or_else(|| "-".to_string(), bare_value)
    };
    let mut parts = vec![
        first(&SEQ_FIELDS),
        first(&TIME_FIELDS),
        first(&EVENT_FIELDS),
    ];
    let taken = |name: &str| {
        CHAIN_FIELDS.contains(&name)
            || SEQ_FIELDS.iter().find(|n| fields.contains_key(**n)) == Some(&name)
            || TIME_FIELDS.iter().find(|n| fields.contains_key(**n)) == Some(&name)
            || EVENT_FIELDS.iter().find(|n| fields.contains_key(**n)) == Some(&name)
    };
    for (key, value) in fields {
        match value {
            // The journal keeps an event's own data in `fields`: show it flat.
            Value::Object(inner) if key == NESTED_FIELDS => {
                for (key, value) in inner {
                    parts.push(format!("{}={}", clean(key), quoted_value(value)));
                }
            }
            _ if taken(key) => {}
            _ => parts.push(format!("{}={}", clean(key), quoted_value(value))),
        }
    }
    parts.join(" ")
}

/// `device grant|revoke|list`: what changed, what the grantee needs, the table of configured
/// devices, and the hypervisor's own view.
fn devices_text(v: &DevicesView) -> String {
    let mut text = String::new();
    for line in &v.changed {
        let _ = writeln!(text, "{}", clean(line));
    }
    for a in &v.access {
        let _ = writeln!(
            text,
            "{}: {} password {}",
            clean(&a.id),
            clean(&a.how),
            clean(&a.secret)
        );
    }
    if v.devices.is_empty() {
        text.push_str("no devices configured\n");
    } else {
        let rows: Vec<Vec<String>> = v
            .devices
            .iter()
            .map(|d| {
                let g = d.grant.as_ref();
                vec![
                    clean(&d.id),
                    clean(&d.class),
                    clean(&d.source),
                    g.map_or_else(|| "-".into(), |g| clean(&g.state)),
                    g.map_or_else(|| "-".into(), |g| short_time(&g.expires_at)),
                    g.map_or_else(|| "-".into(), |g| short_id(&g.pre_action_snapshot)),
                    format!("{} s", d.max_lease_s),
                ]
            })
            .collect();
        text.push_str(&table(
            &[
                "ID",
                "CLASS",
                "SOURCE",
                "STATE",
                "EXPIRES",
                "AFTER SNAPSHOT",
                "MAX LEASE",
            ],
            &rows,
        ));
    }
    match &v.hypervisor {
        Some(h) => text.push_str(&hypervisor_text(h)),
        None => text.push_str("hypervisor view: unavailable (no VM running)\n"),
    }
    text
}

fn hypervisor_text(h: &HypervisorDevicesView) -> String {
    let list = |items: Vec<String>| {
        if items.is_empty() {
            "none".to_string()
        } else {
            items.join(", ")
        }
    };
    let devices = list(
        h.peripherals
            .iter()
            .map(|p| {
                let mark = if p.grantable { " GRANTED" } else { "" };
                format!("{} ({}){mark}", clean(&p.id), clean(&p.device_type))
            })
            .collect(),
    );
    let pci = list(
        h.pci
            .iter()
            .map(|f| {
                let id = if f.qdev_id.is_empty() {
                    String::new()
                } else {
                    format!(" {}", clean(&f.qdev_id))
                };
                format!(
                    "{} {:04x}:{:04x}{id}",
                    clean(&f.address),
                    f.vendor_id,
                    f.device_id
                )
            })
            .collect(),
    );
    let usb = list(
        h.usb
            .iter()
            .map(|u| {
                format!(
                    "port {} {} ({})",
                    clean(&u.port),
                    clean(&u.product),
                    clean(&u.id)
                )
            })
            .collect(),
    );
    let display = match &h.display {
        Some(d) => format!(
            "vnc {}, auth {}, {} client(s)",
            clean(&d.service),
            clean(&d.auth),
            d.clients
        ),
        None => "none".into(),
    };
    let links = list(
        h.links
            .iter()
            .map(|l| {
                let state = match l.up {
                    Some(true) => "up",
                    Some(false) => "down",
                    None => "unknown",
                };
                format!("{} {state}", clean(&l.nic))
            })
            .collect(),
    );
    let blockers = list(h.migration_blockers.iter().map(|b| clean(b)).collect());
    let mut text = "hypervisor view:\n".to_string();
    for (k, v) in [
        ("devices", devices),
        ("pci", pci),
        ("usb", usb),
        ("display", display),
        ("links", links),
        ("migration blockers", blockers),
    ] {
        let _ = writeln!(text, "  {:<19} {v}", format!("{k}:"));
    }
    text
}

/// A left-aligned table with two spaces between columns, no trailing spaces.
fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let header: Vec<String> = header.iter().map(|h| h.to_string()).collect();
    let mut text = String::new();
    for row in std::iter::once(&header).chain(rows) {
        let mut line = String::new();
        for (i, cell) in row.iter().enumerate() {
            if i > 0 {
                line.push_str("  ");
            }
            line.push_str(cell);
            line.push_str(&" ".repeat(widths[i].saturating_sub(cell.chars().count())));
        }
        text.push_str(line.trim_end());
        text.push('\n');
    }
    text
}

fn audit_verified_text(r: &AuditVerifyReport) -> String {
    match &r.first_bad {
        None => format!("audit chain OK: {} entries\n", r.entries),
        Some(fault) => {
            let seq = fault
                .seq
                .map_or_else(|| "unknown".to_string(), |s| s.to_string());
            format!(
                "audit chain BROKEN at line {} (seq {}): {}\n",
                fault.line,
                seq,
                clean(&fault.reason)
            )
        }
    }
}

/// `snapshot tree`: each snapshot under its parent, oldest first, the current position marked.
fn tree_text(nodes: &[backstop_control::TreeNode], current: Option<&str>) -> String {
    if nodes.is_empty() {
        return "no snapshots yet\n".into();
    }
    let ids: std::collections::BTreeSet<&str> =
        nodes.iter().map(|n| n.snapshot_id.as_str()).collect();
    // A node whose parent is unknown or not listed is drawn as a root.
    let is_root =
        |n: &backstop_control::TreeNode| n.parent.as_deref().is_none_or(|p| !ids.contains(p));
    let mut out = String::new();
    let roots: Vec<&backstop_control::TreeNode> = nodes.iter().filter(|n| is_root(n)).collect();
    let mut stack: Vec<(&backstop_control::TreeNode, String, bool)> = roots
        .iter()
        .rev()
        .enumerate()
        .map(|(i, n)| (*n, String::new(), i == 0))
        .collect();
    while let Some((n, prefix, last)) = stack.pop() {
        let branch = if prefix.is_empty() && is_root(n) {
            ""
        } else if last {
            "└─ "
        } else {
            "├─ "
        };
        let mut tags = Vec::new();
        if current == Some(n.snapshot_id.as_str()) {
            tags.push("◀ current".to_string());
        }
        if n.rolled_back {
            tags.push("rolled back".into());
        }
        if n.state != "present" {
            tags.push(n.state.clone());
        }
        if !n.parent_known {
            tags.push("lineage not recorded".into());
        }
        let _ = writeln!(
            out,
            "{prefix}{branch}{}{}  epoch {}  {}  {}{}",
            clean(&n.snapshot_id),
            named(n.name.as_deref()),
            n.epoch,
            clean(&n.created_at),
            clean(&n.reason),
            if tags.is_empty() {
                String::new()
            } else {
                format!("  [{}]", tags.join(", "))
            }
        );
        let children: Vec<&backstop_control::TreeNode> = nodes
            .iter()
            .filter(|c| c.parent.as_deref() == Some(n.snapshot_id.as_str()) && !is_root(c))
            .collect();
        let child_prefix = if branch.is_empty() {
            prefix.clone()
        } else {
            format!("{prefix}{}", if last { "   " } else { "│  " })
        };
        for (i, c) in children.iter().enumerate().rev() {
            stack.push((c, child_prefix.clone(), i == children.len() - 1));
        }
    }
    if current.is_none() {
        out.push_str("(the running VM was cold-booted: it descends from no snapshot yet)\n");
    }
    out
}

/// One notification of `events`: a JSON line, or a line for a person.
pub fn notification_line(n: &backstop_control::Notification, json: bool) -> String {
    if json {
        return format!("{}\n", serde_json::to_string(n).unwrap_or_default());
    }
    let mut details = String::new();
    if let Value::Object(m) = &n.details {
        for (k, v) in m {
            if k != "trace_id" {
                let _ = write!(details, " {k}={}", bare_value(v));
            }
        }
    }
    format!(
        "{:>6}  {}  {}  {}  {}{details}\n",
        n.seq,
        clean(&n.ts),
        clean(&n.vm),
        n.event,
        n.snapshot_id
            .as_deref()
            .map(clean)
            .unwrap_or_else(|| "-".into()),
    )
}

fn replay_text(r: &ReplayReport) -> String {
    let mut t = String::new();
    let badge = if r.authoritative {
        "authoritative"
    } else {
        "NON-AUTHORITATIVE"
    };
    match &r.code {
        None => {
            let _ = writeln!(
                t,
                "replay OK ({} mode, {badge}): {}; seq {}..{}",
                r.mode,
                clean(&r.detail),
                r.from_seq,
                r.through_seq
            );
        }
        Some(code) => {
            let at = r
                .stopped_at_seq
                .map_or_else(String::new, |s| format!(" at seq {s}"));
            let _ = writeln!(
                t,
                "replay FAILED {code}{at} ({} mode): {}",
                r.mode,
                clean(&r.detail)
            );
        }
    }
    for d in &r.divergences {
        let forced = d
            .forced_by
            .as_deref()
            .map_or_else(String::new, |by| format!(" (forced past by {})", clean(by)));
        let _ = writeln!(
            t,
            "  divergence {} in {} at seq {}{forced}: {}",
            d.digest,
            d.decision,
            d.at_seq,
            clean(&d.diff)
        );
    }
    if r.code.as_deref() == Some("REPLAY_DIVERGENCE") {
        if let Some(d) = r.divergences.last() {
            let _ = writeln!(
                t,
                "  to continue past it: a reviewer runs `backstop review sign --key KEY --divergence {} --reviewer NAME > token.json`, then `audit replay --force-continue --reviewer-token token.json`",
                d.digest
            );
        }
    }
    for c in &r.live_calls {
        let _ = writeln!(t, "  live call: {}", clean(c));
    }
    for w in &r.non_authoritative_because {
        let _ = writeln!(t, "  not authoritative: {}", clean(w));
    }
    if let Some(s) = &r.sandbox {
        let _ = writeln!(t, "  sandbox: {}", clean(&s.to_string()));
    }
    let _ = writeln!(t, "  recorded as REPLAY_RESULT seq {}", r.result_seq);
    t
}

/// A value as a word: strings without quotes, everything else as compact JSON.
fn bare_value(value: &Value) -> String {
    match value {
        Value::String(s) => clean(s),
        other => other.to_string(),
    }
}

/// A value for `key=value`: strings quoted (JSON-escaped) only when they need it.
fn quoted_value(value: &Value) -> String {
    match value {
        Value::String(s)
            if !s.is_empty()
                && !s
                    .chars()
                    .any(|c| c.is_whitespace() || c.is_control() || c == '"' || c == '=') =>
        {
            s.clone()
        }
        other => other.to_string(),
    }
}

fn key_values(rows: &[(&str, String)]) -> String {
    let width = rows.iter().map(|(key, _)| key.len() + 1).max().unwrap_or(0);
    rows.iter()
        .map(|(key, value)| format!("{:<width$}  {value}\n", format!("{key}:")))
        .collect()
}

/// The first [`SHORT_ID_LEN`] characters of an id.
pub fn short_id(id: &str) -> String {
    clean(&id.chars().take(SHORT_ID_LEN).collect::<String>())
}

/// How the console shows a time: `YYYY-MM-DD HH:MM:SS`, UTC (`--before` takes it back).
pub const SHORT_TIME: &[BorrowedFormatItem<'static>] =
    format_description!("[year]-[month]-[day] [hour]:[minute]:[second]");

/// An RFC 3339 time as [`SHORT_TIME`]; anything else as given.
pub fn short_time(rfc3339: &str) -> String {
    parse_rfc3339(rfc3339)
        .and_then(|t| t.to_offset(time::UtcOffset::UTC).format(SHORT_TIME).ok())
        .unwrap_or_else(|| clean(rfc3339))
}

/// Bytes in IEC units: `512 B`, `1.5 KiB`, `3.2 GiB`.
pub fn human_bytes(bytes: u64) -> String {
    bytesize::ByteSize::b(bytes).display().iec().to_string()
}

/// A guest pause: `850us`, `3.2ms`, `1.25s`.
/// The pause and where it went, from the manifest's `capture.pause_breakdown_us` (a list of
/// `[phase, µs]`): `3.2ms: stop 410 µs, switch 95 µs, …`. Just the pause when the manifest has
/// no breakdown (older manifests, the KVM backend, a guest that was paused).
fn pause_with_breakdown(pause_us: u64, manifest: &Value) -> String {
    let parts: Vec<String> = manifest
        .pointer("/capture/pause_breakdown_us")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|p| {
            let name = p.get(0)?.as_str()?;
            let us = p.get(1)?.as_u64()?;
            Some(format!("{} {us} µs", clean(name)))
        })
        .collect();
    if parts.is_empty() {
        human_pause(pause_us)
    } else {
        format!("{}: {}", human_pause(pause_us), parts.join(", "))
    }
}

pub fn human_pause(pause_us: u64) -> String {
    if pause_us < 1_000 {
        format!("{pause_us}us")
    } else if pause_us < 1_000_000 {
        format!("{:.1}ms", pause_us as f64 / 1e3)
    } else {
        format!("{:.2}s", pause_us as f64 / 1e6)
    }
}

/// Makes text safe for one terminal line: control characters are shown escaped, never obeyed.
pub fn clean(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// `offsite gc`: one line per pruned snapshot, then the totals.
fn offsite_gc_text(r: &backstop_control::OffsiteGcReport) -> String {
    let (verb, prefix) = if r.dry_run {
        ("would delete", "dry run: ")
    } else {
        ("deleted", "")
    };
    let mut out = String::new();
    for p in &r.snapshots_pruned {
        out.push_str(&format!(
            "{prefix}{verb} {}'s snapshot {} ({}: {} objects, {})\n",
            clean(&r.host),
            clean(&p.snapshot_id),
            clean(&p.reason),
            p.objects,
            human_bytes(p.bytes)
        ));
    }
    out.push_str(&format!(
        "{prefix}{} snapshots pruned, {} kept; {verb} {} unreferenced chunks/layers ({}); {} referenced, {} unreferenced within the grace period kept; {} ms\n",
        r.snapshots_pruned.len(),
        r.snapshots_kept,
        r.objects_swept,
        human_bytes(r.bytes_swept),
        r.objects_referenced,
        r.objects_in_grace,
        r.total_ms
    ));
    out
}

#[cfg(test)]
mod tests {
    use backstop_control::{AuditFault, HaltView, RollbackArgs, SkippedSnapshot};

    use super::*;

    fn summary(id: &str, reason: &str) -> SnapshotSummary {
        SnapshotSummary {
            snapshot_id: id.into(),
            name: None,
            created_at: "2026-05-01T12:00:03.5Z".into(),
            created_by: "console".into(),
            schema_version: "1.0".into(),
            index_version: "1".into(),
            scope: "full".into(),
            reason: reason.into(),
            pause_us: 3_200,
            bytes_stored: 1536,
            trigger: "console".into(),
            rolled_back: None,
            current: false,
            unusable: None,
            replication: None,
        }
    }

    fn status(halted: Option<HaltView>) -> StatusView {
        StatusView {
            vm: "guest".into(),
            state: "running".into(),
            epoch: 3,
            backend: "qemu".into(),
            accel: "tcg".into(),
            pid: Some(4321),
            snapshots: 2,
            newest_snapshot: Some("abcdef0123456789".into()),
            halted,
            session_id: "sess-1".into(),
            newest_snapshot_at: None,
            heartbeat_age_ms: None,
            backend_details: Default::default(),
            ..Default::default()
        }
    }

    fn drift(node: &str, resolved: bool) -> DriftView {
        DriftView {
            invariant_id: "device.set".into(),
            node_id: node.into(),
            severity: "CRITICAL".into(),
            drift_type: "active_reconciliation".into(),
            details: "the hypervisor holds device rogue".into(),
            detected_at: "2026-11-24T20:59:06.621Z".into(),
            resolved_at: resolved.then(|| "2026-11-24T20:59:07.070Z".into()),
            resolution: resolved.then(|| "emergency rollback to abc".into()),
        }
    }

    #[test]
    fn status_counts_and_lists_open_drift_only_when_there_is_some() {
        let mut s = status(None);
        let quiet = human(&Request::Status, &Response::Status(s.clone()));
        assert!(!quiet.contains("drift"), "{quiet}");
        s.drift_open = 1;
        s.drift = vec![drift("rogue-kbd", false)];
        let text = human(&Request::Status, &Response::Status(s));
        assert!(text.contains("drift open:"), "{text}");
        assert!(text.contains("INVARIANT"), "{text}");
        assert!(
            text.lines().any(|l| l.starts_with("device.set")
                && l.contains("rogue-kbd")
                && l.contains("CRITICAL")),
            "{text}"
        );
    }

    #[test]
    fn drift_lists_open_resolved_unusable_and_coverage() {
        let report = DriftReport {
            vm: "web1".into(),
            open: vec![],
            resolved: vec![drift("rogue-kbd", true)],
            invariants: vec![backstop_control::InvariantView {
                invariant_id: "disk.active_layer".into(),
                severity: "HIGH".into(),
                what: "w".into(),
                action: "record".into(),
                coverage: "not checked: libvirt owns the block graph".into(),
            }],
            last_reconcile_at: None,
            unusable_snapshots: vec!["0123456789abcdef0123456789abcdef".into()],
        };
        let text = human(&Request::DriftList, &Response::Drift(report));
        assert!(text.starts_with("vm web1: no open drift\n"), "{text}");
        assert!(text.contains("recently resolved:"), "{text}");
        assert!(text.contains("emergency rollback to abc"), "{text}");
        assert!(
            text.contains("snapshots marked unusable: 0123456789ab"),
            "{text}"
        );
        assert!(text.contains("last reconciliation pass: not yet"), "{text}");
        assert!(
            text.contains("not checked: libvirt owns the block graph"),
            "{text}"
        );
    }

    #[test]
    fn status_shows_each_lease_with_its_holder_and_expiry() {
        let mut s = status(None);
        s.offsite = Some(backstop_control::OffsiteView {
            host: "host-b".into(),
            endpoint: "http://127.0.0.1:7480".into(),
            bucket: "fleet".into(),
            leases: vec![backstop_control::LeaseView {
                vm: "guest".into(),
                state: "held_elsewhere".into(),
                holder: Some("host-a".into()),
                expires_at: Some("2026-11-25T07:00:00.000Z".into()),
                last_error: None,
                last_write_ms: None,
            }],
            ..Default::default()
        });
        let text = human(&Request::Status, &Response::Status(s));
        assert!(
            text.lines().any(|l| l.starts_with("lease:")
                && l.ends_with("guest: held_elsewhere by host-a until 2026-11-25T07:00:00.000Z")),
            "{text}"
        );
    }

    #[test]
    fn a_lagging_replication_says_so_in_status() {
        let mut s = status(None);
        s.offsite = Some(backstop_control::OffsiteView {
            host: "host-a".into(),
            pending: 2,
            last_error: Some("ERR_OFFSITE_DENIED: PUT x: HTTP 403: SignatureDoesNotMatch".into()),
            oldest_pending_s: Some(700),
            lagging: true,
            lag_threshold_s: 600,
            ..Default::default()
        });
        let t = status_text(&s);
        let line = t.lines().find(|l| l.starts_with("offsite")).unwrap();
        assert!(line.contains("last error: ERR_OFFSITE_DENIED"), "{line}");
        assert!(
            line.contains("LAGGING: the oldest has waited 700 s (threshold 600 s)"),
            "{line}"
        );
        s.offsite.as_mut().unwrap().lagging = false;
        assert!(!status_text(&s).contains("LAGGING"));
    }

    #[test]
    fn status_is_aligned_key_values() {
        let text = human(&Request::Status, &Response::Status(status(None)));
        assert_eq!(
            text,
            "vm:               guest\n\
             state:            running\n\
             epoch:            3\n\
             backend:          qemu\n\
             accel:            tcg\n\
             pid:              4321\n\
             snapshots:        2\n\
             newest snapshot:  abcdef0123456789\n\
             session:          sess-1\n"
        );
    }

    #[test]
    fn the_live_view_rows_show_what_is_known() {
        let mut view = status(None);
        view.heartbeat_age_ms = Some(1_250);
        view.newest_snapshot_pause_us = Some(3_100);
        view.store_bytes = 3 << 20;
        view.last_rollback = Some(backstop_control::LastRollbackView {
            snapshot_id: "abcdef0123456789".into(),
            at: "2026-11-24T20:00:05.000Z".into(),
            trigger: "force_rollback".into(),
            rollback_type: "emergency".into(),
            duration_ms: 812,
        });
        view.rollbacks_by_trigger = [("force_rollback".to_string(), 1)].into_iter().collect();
        view.links = vec![
            backstop_control::LinkView {
                nic: "net0".into(),
                up: Some(false),
            },
            backstop_control::LinkView {
                nic: "net1".into(),
                up: None,
            },
        ];
        view.granted_devices = vec!["cam".into()];
        let text = human(&Request::Status, &Response::Status(view));
        for row in [
            "heartbeat:        1.2 s ago\n",
            "last rollback:    abcdef0123456789 at 2026-11-24T20:00:05.000Z (force_rollback, emergency, 812 ms)\n",
            "rollbacks:        force_rollback 1\n",
            "links:            net0 down, net1 unknown\n",
            "granted:          cam\n",
        ] {
            assert!(text.contains(row), "{row:?} not in:\n{text}");
        }
        assert!(text.contains("newest pause:"), "{text}");
        assert!(text.contains("stored:"), "{text}");
    }

    #[test]
    fn a_halted_status_says_why() {
        let halt = HaltView {
            reason: "restore failed".into(),
            code: "ERR_ROLLBACK_RESTORE".into(),
            since: "2026-05-01T12:00:00Z".into(),
        };
        let mut view = status(Some(halt));
        view.state = "halted".into();
        view.pid = None;
        let text = human(&Request::Status, &Response::Status(view));
        assert!(text.contains("state:            halted\n"), "{text}");
        assert!(text.contains("pid:              -\n"), "{text}");
        assert!(
            text.contains("halt code:        ERR_ROLLBACK_RESTORE\n"),
            "{text}"
        );
        assert!(
            text.contains("halt reason:      restore failed\n"),
            "{text}"
        );
    }

    #[test]
    fn the_snapshot_list_is_a_table_with_short_ids() {
        let mut big = summary("0123456789abcdef0123", "before update");
        big.bytes_stored = 3 * 1024 * 1024 * 1024 + 200 * 1024 * 1024;
        big.pause_us = 1_250_000;
        big.rolled_back = Some(Box::new(backstop_control::RolledBackMark {
            at: "2026-05-01T13:00:00Z".into(),
            rollback_to: "ffff0000ffff0000".into(),
            rollback_type: "session".into(),
        }));
        let list = Response::SnapshotList {
            snapshots: vec![summary("ffff0000ffff0000", "x"), big],
        };
        let text = human(&Request::SnapshotList, &list);
        assert_eq!(
            text,
            "ID            CREATED              BY       TRIGGER  SCOPE  PAUSE   STORED  LINE                        REASON\n\
             ffff0000ffff  2026-05-01 12:00:03  console  console  full   3.2ms  1.5 KiB  current                     x\n\
             0123456789ab  2026-05-01 12:00:03  console  console  full   1.25s  3.2 GiB  rolled back → ffff0000ffff  before update\n"
        );
        let empty = Response::SnapshotList { snapshots: vec![] };
        assert_eq!(human(&Request::SnapshotList, &empty), "no snapshots\n");
    }

    #[test]
    fn the_snapshot_the_vm_descends_from_is_starred() {
        let mut now = summary("ffff0000ffff0000", "x");
        now.current = true;
        let list = Response::SnapshotList {
            snapshots: vec![summary("0123456789abcdef0123", "older"), now],
        };
        let text = human(&Request::SnapshotList, &list);
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].starts_with("  ID            CREATED"), "{text}");
        assert!(lines[1].starts_with("  0123456789ab  2026-05-01"), "{text}");
        assert!(lines[2].starts_with("* ffff0000ffff  2026-05-01"), "{text}");
    }

    #[test]
    fn snapshot_show_is_a_summary_unless_full() {
        let view = SnapshotView {
            summary: summary("abc", "r"),
            manifest: json!({"snapshot_id": "abc", "checksums": ["x", "y"],
                             "payload_refs": [{}], "epoch": 4}),
            capture_ms: 2100,
        };
        let req = Request::SnapshotShow { id: "abc".into() };
        let response = Response::Snapshot(view);
        let brief = human_at(&req, &response, Detail::Summary);
        assert!(brief.starts_with("snapshot:  abc\n"), "{brief}");
        assert!(brief.contains("capture:   2100 ms\n"), "{brief}");
        assert!(
            brief
                .ends_with("manifest: 2 checksums, 1 payloads, epoch 4 (--full prints it whole)\n"),
            "{brief}"
        );
        assert!(!brief.contains("\"checksums\""), "{brief}");
        let full = human_at(&req, &response, Detail::Full);
        assert_eq!(full, human(&req, &response));
        assert!(full.contains("manifest:\n{\n"), "{full}");
        // Only `snapshot show` has a summary: every other answer is the same at any detail.
        let list = Response::SnapshotList { snapshots: vec![] };
        assert_eq!(
            human_at(&Request::SnapshotList, &list, Detail::Summary),
            human(&Request::SnapshotList, &list)
        );
    }

    #[test]
    fn snapshot_show_prints_summary_and_pretty_manifest() {
        let view = SnapshotView {
            summary: summary("abc", "r"),
            manifest: json!({"snapshot_id": "abc", "checksums": ["x"]}),
            capture_ms: 2100,
        };
        let text = human(
            &Request::SnapshotShow { id: "abc".into() },
            &Response::Snapshot(view),
        );
        assert!(text.starts_with("snapshot:  abc\n"), "{text}");
        assert!(
            text.contains("created:   2026-05-01T12:00:03.5Z by console\n"),
            "{text}"
        );
        assert!(text.contains("capture:   2100 ms\n"), "{text}");
        assert!(
            text.contains("manifest:\n{\n  \"checksums\": [\n    \"x\"\n  ],\n"),
            "{text}"
        );
    }

    #[test]
    fn snapshot_show_says_whether_a_forensic_snapshot_kept_ram() {
        let req = Request::SnapshotShow { id: "abc".into() };
        let show = |capture: serde_json::Value| {
            human(
                &req,
                &Response::Snapshot(SnapshotView {
                    summary: summary("abc", "r"),
                    manifest: json!({"snapshot_id": "abc", "capture": capture}),
                    capture_ms: 1,
                }),
            )
        };
        let with = show(json!({"forensic": {"ram": true, "disks": 1}}));
        assert!(
            with.contains("ram:")
                && with.contains("true (restorable with rollback --include-forensic)"),
            "{with}"
        );
        let without = show(
            json!({"forensic": {"ram": false, "ram_reason": "not kept for watchdog rollbacks"}}),
        );
        assert!(
            without.contains("false (not kept for watchdog rollbacks)"),
            "{without}"
        );
        // Other snapshots show no such row.
        assert!(!show(json!({"pause_us": 1})).contains("ram:"));
    }

    #[test]
    fn snapshot_show_prints_the_pause_breakdown() {
        let mut sum = summary("abc", "r");
        sum.pause_us = 3_200;
        let manifest = json!({"snapshot_id": "abc", "capture": {"pause_us": 3_200,
            "pause_breakdown_us": [["stop", 410], ["switch", 95], ["migrate", 700],
                                   ["setup", 300], ["tracking", 1_100], ["resume", 595]]}});
        let view = SnapshotView {
            summary: sum.clone(),
            manifest,
            capture_ms: 2100,
        };
        let req = Request::SnapshotShow { id: "abc".into() };
        let text = human(&req, &Response::Snapshot(view));
        assert!(
            text.contains(
                "pause:     3.2ms: stop 410 µs, switch 95 µs, migrate 700 µs, setup 300 µs, \
                 tracking 1100 µs, resume 595 µs\n"
            ),
            "{text}"
        );
        // The manifest (and so --json) carries it as recorded.
        assert!(text.contains("\"pause_breakdown_us\": [\n"), "{text}");
        // No breakdown (an older manifest, the KVM backend): the pause alone.
        for manifest in [
            json!({"snapshot_id": "abc", "capture": {"pause_us": 3_200}}),
            json!({"capture": {"pause_breakdown_us": []}}),
            json!({"capture": {"pause_breakdown_us": [["x"], 5, null]}}),
        ] {
            let view = SnapshotView {
                summary: sum.clone(),
                manifest,
                capture_ms: 2100,
            };
            let text = human(&req, &Response::Snapshot(view));
            assert!(text.contains("pause:     3.2ms\n"), "{text}");
        }
        // A phase name is printed clean.
        let view = SnapshotView {
            summary: sum,
            manifest: json!({"capture": {"pause_breakdown_us": [["st\u{1b}[2Jop", 1]]}}),
            capture_ms: 1,
        };
        let text = human(&req, &Response::Snapshot(view));
        assert!(
            text.contains("pause:     3.2ms: st\\u{1b}[2Jop 1 µs\n"),
            "{text}"
        );
    }

    #[test]
    fn snapshot_create_prints_one_line() {
        let view = SnapshotView {
            summary: summary("abc", "r"),
            manifest: json!({}),
            capture_ms: 2100,
        };
        let req = Request::SnapshotCreate {
            reason: "r".into(),
            name: None,
        };
        assert_eq!(
            human(&req, &Response::Snapshot(view)),
            "snapshot abc created: guest paused 3.2ms, capture 2100 ms, stored 1.5 KiB\n"
        );
    }

    #[test]
    fn verify_prints_what_was_checked() {
        let report = VerifyReport {
            snapshot_id: "abc".into(),
            chunks_checked: 12,
            bytes_checked: 123_456,
            disk_layers_checked: 2,
        };
        assert_eq!(
            human(
                &Request::SnapshotVerify { id: "abc".into() },
                &Response::Verified(report)
            ),
            "snapshot abc verified: 12 chunks, 123456 bytes, 2 disk layers\n"
        );
    }

    #[test]
    fn rollback_prints_timing_epoch_revocations_and_skips() {
        let mut report = RollbackReport {
            snapshot_id: "abc".into(),
            rollback_type: "session".into(),
            trigger: "console".into(),
            epoch: 7,
            skipped: vec![],
            revoked: vec![],
            total_ms: 812,
            restore_ms: 250,
            phases: Vec::new(),
            repeat_of: None,
            forensic_snapshot_id: None,
        };
        let req = Request::Rollback(RollbackArgs {
            to: None,
            reason: "r".into(),
            emergency: false,
            rollback_type: None,
            before: None,
            reviewer_token: None,
            allow_newer_minor: false,
            include_forensic: false,
        });
        assert_eq!(
            human(&req, &Response::RolledBack(report.clone())),
            "rolled back to abc (session, console) in 812 ms, restore 250 ms; epoch 7; \
             revoked: none; skipped: none\n"
        );
        report.revoked = vec!["usb:cam0".into(), "net:link".into()];
        report.skipped = vec![SkippedSnapshot {
            snapshot_id: "def".into(),
            code: "ERR_SNAPSHOT_INTEGRITY_CHECK_FAILED".into(),
        }];
        let text = human(&req, &Response::RolledBack(report));
        assert!(
            text.ends_with(
                "revoked: usb:cam0, net:link; skipped: def (ERR_SNAPSHOT_INTEGRITY_CHECK_FAILED)\n"
            ),
            "{text}"
        );
    }

    #[test]
    fn halt_clear_says_where_the_vm_came_from() {
        let req = Request::HaltClear { reason: "r".into() };
        let restored = Response::HaltCleared {
            epoch: 4,
            restored_from: Some("abc".into()),
        };
        assert_eq!(
            human(&req, &restored),
            "halt cleared; epoch 4; restored from abc\n"
        );
        let cold = Response::HaltCleared {
            epoch: 4,
            restored_from: None,
        };
        assert!(human(&req, &cold).contains("cold-booted"));
    }

    #[test]
    fn audit_entries_are_one_line_each_without_chain_fields() {
        let entries = vec![
            json!({
                "seq": 41, "ts": "2026-05-01T12:00:00Z", "event": "rollback.completed",
                "fields": {"snapshot_id": "abc", "result": "ok", "reason": "bad update", "epoch": 7},
                "prev": "00", "hash": "11", "mac": "22"
            }),
            json!({"seq": 42, "timestamp": "t", "event_type": "halt.cleared"}),
            json!("not an object"),
        ];
        let text = human(
            &Request::AuditTail { count: 3 },
            &Response::AuditEntries { entries },
        );
        assert_eq!(
            text,
            "41 2026-05-01T12:00:00Z rollback.completed epoch=7 reason=\"bad update\" \
             result=ok snapshot_id=abc\n\
             42 t halt.cleared\n\
             \"not an object\"\n"
        );
        let none = Response::AuditEntries { entries: vec![] };
        assert_eq!(
            human(&Request::AuditTail { count: 3 }, &none),
            "no audit entries\n"
        );
    }

    #[test]
    fn audit_verify_says_ok_or_where_it_broke() {
        let ok = AuditVerifyReport {
            entries: 42,
            first_bad: None,
        };
        assert_eq!(
            human(&Request::AuditVerify, &Response::AuditVerified(ok)),
            "audit chain OK: 42 entries\n"
        );
        let fault = |seq| AuditFault {
            line: 7,
            seq,
            reason: "hash mismatch".into(),
        };
        let bad = AuditVerifyReport {
            entries: 42,
            first_bad: Some(fault(Some(6))),
        };
        assert_eq!(
            human(&Request::AuditVerify, &Response::AuditVerified(bad)),
            "audit chain BROKEN at line 7 (seq 6): hash mismatch\n"
        );
        let unreadable = AuditVerifyReport {
            entries: 6,
            first_bad: Some(fault(None)),
        };
        assert!(
            human(&Request::AuditVerify, &Response::AuditVerified(unreadable))
                .contains("(seq unknown)")
        );
    }

    #[test]
    fn devices_show_changes_access_grants_and_the_hypervisor_view() {
        use backstop_control::{
            DeviceAccessView, DeviceView, DisplayView, GrantView, LinkView, PciFunctionView,
            PeripheralView, UsbDeviceView,
        };
        let view = DevicesView {
            devices: vec![
                DeviceView {
                    id: "tablet".into(),
                    class: "usb".into(),
                    source: "qemu usb-tablet".into(),
                    max_lease_s: 600,
                    grant: Some(GrantView {
                        state: "granted".into(),
                        granted_at: "2026-05-01T12:00:00.000Z".into(),
                        granted_by: "console:uid=0".into(),
                        lease_s: 60,
                        expires_at: "2026-05-01T12:01:00.000Z".into(),
                        pre_action_snapshot: "0123456789abcdef".into(),
                        migration_blockers: vec![],
                    }),
                },
                DeviceView {
                    id: "screen".into(),
                    class: "display".into(),
                    source: "vnc".into(),
                    max_lease_s: 60,
                    grant: None,
                },
            ],
            changed: vec![
                "granted tablet (qemu usb-tablet): device_add usb-tablet id=grant-tablet".into(),
            ],
            access: vec![DeviceAccessView {
                id: "screen".into(),
                how: "vnc unix:/run/v.sock".into(),
                secret: "abcdefgh".into(),
            }],
            hypervisor: Some(HypervisorDevicesView {
                peripherals: vec![PeripheralView {
                    id: "grant-tablet".into(),
                    device_type: "usb-tablet".into(),
                    grantable: true,
                }],
                pci: vec![PciFunctionView {
                    address: "00:01.0".into(),
                    vendor_id: 0x1b36,
                    device_id: 0xd,
                    class: 0x0c03,
                    qdev_id: "usb".into(),
                }],
                usb: vec![UsbDeviceView {
                    port: "1".into(),
                    product: "QEMU USB Tablet".into(),
                    id: "grant-tablet".into(),
                }],
                display: Some(DisplayView {
                    enabled: true,
                    auth: "vnc".into(),
                    clients: 0,
                    service: "/run/v.sock".into(),
                }),
                links: vec![LinkView {
                    nic: "net0".into(),
                    up: Some(false),
                }],
                migration_blockers: vec![],
            }),
        };
        let text = human(&Request::DeviceList, &Response::Devices(view));
        assert_eq!(
            text,
            "granted tablet (qemu usb-tablet): device_add usb-tablet id=grant-tablet\n\
             screen: vnc unix:/run/v.sock password abcdefgh\n\
             ID      CLASS    SOURCE           STATE    EXPIRES              AFTER SNAPSHOT  MAX LEASE\n\
             tablet  usb      qemu usb-tablet  granted  2026-05-01 12:01:00  0123456789ab    600 s\n\
             screen  display  vnc              -        -                    -               60 s\n\
             hypervisor view:\n\
             \x20 devices:            grant-tablet (usb-tablet) GRANTED\n\
             \x20 pci:                00:01.0 1b36:000d usb\n\
             \x20 usb:                port 1 QEMU USB Tablet (grant-tablet)\n\
             \x20 display:            vnc /run/v.sock, auth vnc, 0 client(s)\n\
             \x20 links:              net0 down\n\
             \x20 migration blockers: none\n"
        );
        let empty = DevicesView {
            devices: vec![],
            changed: vec![],
            access: vec![],
            hypervisor: None,
        };
        assert_eq!(
            human(&Request::DeviceList, &Response::Devices(empty)),
            "no devices configured\nhypervisor view: unavailable (no VM running)\n"
        );
    }

    #[test]
    fn actions_and_prune_results_read_as_sentences_and_tables() {
        let mut a = ActionView {
            action_id: "pkg-42".into(),
            state: "open".into(),
            tier: 2,
            action_kind: "package_install".into(),
            risk_level: "HIGH".into(),
            snapshot_id: Some("0123456789abcdef".into()),
            snapshot_taken: true,
            opened_at: "2026-05-01T12:00:00.000Z".into(),
            opened_by: "policy:uid=0".into(),
            rollback: None,
        };
        let req = Request::ActionList;
        assert_eq!(
            human(&req, &Response::Action(a.clone())),
            "action pkg-42 open: pre-action snapshot 0123456789abcdef taken \
             (tier 2, package_install, risk HIGH)\n"
        );
        assert_eq!(
            human(&req, &Response::Actions { actions: vec![a.clone()] }),
            "ACTION  TIER  KIND             RISK  SNAPSHOT      OPENED               BY\n\
             pkg-42  2     package_install  HIGH  0123456789ab  2026-05-01 12:00:00  policy:uid=0\n"
        );
        assert_eq!(
            human(&req, &Response::Actions { actions: vec![] }),
            "no open actions\n"
        );
        a.state = "rolled_back".into();
        a.rollback = Some(Box::new(RollbackReport {
            snapshot_id: "0123456789abcdef".into(),
            rollback_type: "micro".into(),
            trigger: "action_failed".into(),
            epoch: 2,
            skipped: vec![],
            revoked: vec![],
            total_ms: 900,
            restore_ms: 200,
            phases: Vec::new(),
            repeat_of: None,
            forensic_snapshot_id: None,
        }));
        let text = human(&req, &Response::Action(a));
        assert!(text.starts_with("action pkg-42 rolled_back: "), "{text}");
        assert!(
            text.contains("\nrolled back to 0123456789abcdef (micro, action_failed)"),
            "{text}"
        );
        let p = PruneView {
            removed: vec![backstop_control::PrunedSnapshot {
                snapshot_id: "aaaa0000aaaa0000".into(),
                reason: "beyond retention (last 1, 0 hourly, 0 daily)".into(),
            }],
            kept: vec![backstop_control::KeptSnapshot {
                snapshot_id: "bbbb0000bbbb0000".into(),
                reasons: vec!["protected: the newest verified snapshot".into()],
            }],
            chunks_removed: 3,
            layers_removed: 1,
        };
        assert_eq!(
            human(&Request::SnapshotPrune, &Response::Pruned(p)),
            "pruned 1 snapshot(s), kept 1; 3 chunk(s) and 1 disk layer(s) removed\n\
             \x20 removed aaaa0000aaaa: beyond retention (last 1, 0 hourly, 0 daily)\n\
             \x20 kept    bbbb0000bbbb: protected: the newest verified snapshot\n"
        );
    }

    #[test]
    fn json_is_the_response_and_errors_have_their_own_shape() {
        let resp = Response::HaltCleared {
            epoch: 4,
            restored_from: None,
        };
        let parsed: Response = serde_json::from_str(&json(&resp)).unwrap();
        assert_eq!(parsed, resp);
        let err: Value = serde_json::from_str(&error_json("ERR_VM_HALTED", "halted")).unwrap();
        assert_eq!(
            err,
            json!({"error": {"code": "ERR_VM_HALTED", "message": "halted"}})
        );
    }

    #[test]
    fn errors_and_progress_are_single_lines_that_cannot_drive_the_terminal() {
        assert_eq!(
            error_line("ERR_X", "two\nlines\x1b[2J"),
            "backstop: ERR_X: two\\nlines\\u{1b}[2J\n"
        );
        let p = Progress {
            step: "capture".into(),
            message: "writing RAM".into(),
            bytes: Some(2048),
        };
        assert_eq!(
            progress_line(&p),
            "backstop: capture: writing RAM (2.0 KiB)\n"
        );
        let p = Progress {
            step: "verify".into(),
            message: "signature".into(),
            bytes: None,
        };
        assert_eq!(progress_line(&p), "backstop: verify: signature\n");
    }

    #[test]
    fn units_are_readable() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(1023), "1023 B");
        assert_eq!(human_bytes(1024), "1.0 KiB");
        assert_eq!(human_bytes(5 * 1024 * 1024), "5.0 MiB");
        assert_eq!(human_bytes(u64::MAX), "16.0 EiB");
        assert_eq!(human_pause(850), "850us");
        assert_eq!(human_pause(3_200), "3.2ms");
        assert_eq!(human_pause(2_500_000), "2.50s");
        assert_eq!(short_id("0123456789abcdef"), "0123456789ab");
        assert_eq!(short_id("abc"), "abc");
        assert_eq!(
            short_time("2026-05-01T14:00:03+02:00"),
            "2026-05-01 12:00:03"
        );
        assert_eq!(short_time("yesterday"), "yesterday");
    }

    /// The unit changes at 1024 of the smaller one, one decimal, as the hand-written function
    /// before bytesize printed them (compared on 5.4 million values when it was replaced).
    #[test]
    fn byte_counts_change_unit_at_1024_with_one_decimal() {
        for (bytes, shown) in [
            (1_126, "1.1 KiB"),
            (1_536, "1.5 KiB"),
            (1_048_575, "1024.0 KiB"),
            (1_048_576, "1.0 MiB"),
            (1_073_741_823, "1024.0 MiB"),
            (3_435_973_837, "3.2 GiB"),
            (1 << 40, "1.0 TiB"),
            (1 << 60, "1.0 EiB"),
        ] {
            assert_eq!(human_bytes(bytes), shown, "{bytes}");
        }
    }

    #[test]
    fn vms_shows_the_last_rollback_links_and_devices_on_the_vms_line() {
        let at = time::OffsetDateTime::now_utc() - time::Duration::seconds(42);
        let vm = VmSummary {
            name: "web1".into(),
            backend: "qemu".into(),
            state: "running".into(),
            epoch: 3,
            snapshots: 4,
            newest_snapshot_at: None,
            heartbeat_age_ms: Some(200),
            reason: None,
            last_rollback: Some(backstop_control::LastRollbackView {
                snapshot_id: "0123456789abcdef0123456789abcdef".into(),
                at: backstop_common::time::rfc3339(at),
                trigger: "watchdog".into(),
                rollback_type: "emergency".into(),
                duration_ms: 1_340,
            }),
            links: vec![
                backstop_control::LinkView {
                    nic: "net0".into(),
                    up: Some(false),
                },
                backstop_control::LinkView {
                    nic: "net1\x1b[2J".into(),
                    up: None,
                },
            ],
            granted_devices: vec!["usb0".into()],
        };
        let text = human(&Request::Vms, &Response::Vms { vms: vec![vm] });
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2, "{text}");
        assert!(lines[0].contains("LAST ROLLBACK") && lines[0].contains("LINKS"));
        let row = lines[1];
        assert!(row.contains("in 1.3s"), "{row}");
        assert!(row.contains("s ago"), "{row}");
        assert!(row.contains("net0:down,"), "{row}");
        assert!(row.ends_with("usb0"), "{row}");
        assert!(
            !row.contains('\x1b'),
            "a NIC name cannot drive the terminal: {row}"
        );
    }

    #[test]
    fn offsite_gc_says_what_went_or_would_go() {
        let mut r = backstop_control::OffsiteGcReport {
            host: "host-a".into(),
            dry_run: true,
            snapshots_pruned: vec![backstop_control::OffsitePruned {
                snapshot_id: "ab".repeat(16),
                reason: "retention".into(),
                objects: 4,
                bytes: 2048,
            }],
            snapshots_kept: 2,
            objects_referenced: 10,
            objects_in_grace: 1,
            objects_swept: 3,
            bytes_swept: 3 * 1024 * 1024,
            total_ms: 12,
        };
        let req = Request::OffsiteGc { dry_run: true };
        let t = human(&req, &Response::OffsiteGc(r.clone()));
        assert!(
            t.starts_with("dry run: would delete host-a's snapshot abab"),
            "{t}"
        );
        assert!(
            t.contains("would delete 3 unreferenced chunks/layers"),
            "{t}"
        );
        r.dry_run = false;
        let t = human(&req, &Response::OffsiteGc(r));
        assert!(
            t.contains("deleted 3 unreferenced") && !t.contains("dry run"),
            "{t}"
        );
        assert_eq!(t.lines().count(), 2);
    }

    #[test]
    fn vms_and_reload_are_one_line_each_and_say_why_a_vm_does_not_run() {
        let vms = vec![
            VmSummary {
                name: "web1".into(),
                backend: "qemu".into(),
                state: "running".into(),
                epoch: 2,
                snapshots: 3,
                newest_snapshot_at: None,
                heartbeat_age_ms: Some(1500),
                reason: None,
                last_rollback: None,
                links: Vec::new(),
                granted_devices: Vec::new(),
            },
            VmSummary {
                name: "bad".into(),
                backend: String::new(),
                state: "config_invalid".into(),
                epoch: 0,
                snapshots: 0,
                newest_snapshot_at: None,
                heartbeat_age_ms: None,
                reason: Some("ERR_CONFIG_INVALID: line\n2".into()),
                last_rollback: None,
                links: Vec::new(),
                granted_devices: Vec::new(),
            },
        ];
        let text = human(&Request::Vms, &Response::Vms { vms });
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 4, "{text}");
        assert!(lines[0].starts_with("NAME"));
        assert!(
            lines[1].starts_with("web1")
                && lines[1].contains("running")
                && lines[1].contains("1.5s")
        );
        assert!(lines[2].starts_with("bad") && lines[2].contains("config_invalid"));
        assert_eq!(lines[3], "  bad: ERR_CONFIG_INVALID: line\\n2");
        assert_eq!(
            human(&Request::Vms, &Response::Vms { vms: vec![] }),
            "no VMs\n"
        );
        let r = ReloadReport {
            added: vec!["d".into()],
            removed: vec![],
            changed_not_applied: vec!["a".into()],
            not_applied_why: vec![],
            applied: vec![],
            refused: vec![("x".into(), "bad file".into())],
        };
        assert_eq!(
            human(&Request::Reload, &Response::Reloaded(r.clone())),
            "added: d\nremoved: -\nchanged, not applied: a\nrefused x: bad file\n"
        );
        // Why a change is not applied is said, one line per VM, before the refusals.
        let why = ReloadReport {
            not_applied_why: vec![("a".into(), "vm.libvirt.domain changed".into())],
            ..r
        };
        assert_eq!(
            human(&Request::Reload, &Response::Reloaded(why)),
            "added: d\nremoved: -\nchanged, not applied: a\nnot applied a: vm.libvirt.domain changed\nrefused x: bad file\n"
        );
    }

    #[test]
    fn vm_add_says_where_the_file_went_and_how_the_vm_started() {
        let vm = VmSummary {
            name: "web".into(),
            backend: "qemu".into(),
            state: "running".into(),
            epoch: 1,
            snapshots: 1,
            newest_snapshot_at: None,
            heartbeat_age_ms: None,
            reason: None,
            last_rollback: None,
            links: Vec::new(),
            granted_devices: Vec::new(),
        };
        let mut r = backstop_control::VmAddReport {
            vm,
            file: "/etc/backstop/vms.d/web.toml".into(),
            from_snapshot: None,
            total_ms: 900,
        };
        let ask = Request::VmAdd {
            file_name: "web.toml".into(),
            text: String::new(),
            from_snapshot: None,
            from: None,
        };
        let plain = human(&ask, &Response::VmAdded(r.clone()));
        assert!(
            plain.starts_with("VM file /etc/backstop/vms.d/web.toml written\n"),
            "{plain}"
        );
        assert!(
            plain.contains("web") && plain.contains("running"),
            "{plain}"
        );
        r.from_snapshot = Some(backstop_control::AddedFromSnapshot {
            snapshot_id: "b".repeat(32),
            from: "host-a".into(),
            remote_snapshot_id: "a".repeat(32),
            bytes_fetched: 78 << 20,
            fetch_ms: 9000,
            lease_expires_at: "2026-11-25T08:00:00Z".into(),
            taken_over_from: None,
            lease_ms: 4,
            start_ms: 400,
        });
        let text = human(&ask, &Response::VmAdded(r));
        assert!(text.contains("host-a's aaaa"), "{text}");
        assert!(
            text.contains("lease taken until 2026-11-25T08:00:00Z; VM started from it (400 ms)"),
            "{text}"
        );
    }

    #[test]
    fn names_show_where_snapshots_are_named_and_nowhere_else() {
        let mut named = summary("aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", "r1");
        named.name = Some("before-upgrade".into());
        named.current = true;
        let plain = summary("bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb", "r2");
        // Unnamed lists keep their columns; a named one gains NAME after ID.
        let without = human(
            &Request::SnapshotList,
            &Response::SnapshotList {
                snapshots: vec![plain.clone()],
            },
        );
        assert!(!without.contains("NAME"), "{without}");
        let with = human(
            &Request::SnapshotList,
            &Response::SnapshotList {
                snapshots: vec![named.clone(), plain.clone()],
            },
        );
        let lines: Vec<&str> = with.lines().collect();
        assert!(lines[0].starts_with("  ID            NAME"), "{with}");
        assert!(
            lines[1].starts_with("* aaaaaaaaaaaa  before-upgrade"),
            "{with}"
        );
        assert!(lines[2].starts_with("  bbbbbbbbbbbb  -"), "{with}");
        let view = SnapshotView {
            summary: named.clone(),
            manifest: json!({}),
            capture_ms: 1,
        };
        let shown = human_at(
            &Request::SnapshotShow { id: "x".into() },
            &Response::Snapshot(view.clone()),
            Detail::Summary,
        );
        assert!(shown.contains("\nname:      before-upgrade\n"), "{shown}");
        let created = human(
            &Request::SnapshotCreate {
                reason: "r".into(),
                name: Some("before-upgrade".into()),
            },
            &Response::Snapshot(view),
        );
        assert!(
            created
                .starts_with("snapshot aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa (before-upgrade) created"),
            "{created}"
        );
        let deleted = human(
            &Request::SnapshotDelete {
                id: "v1".into(),
                reason: "r".into(),
            },
            &Response::SnapshotDeleted(backstop_control::DeleteView {
                snapshot_id: "cc".into(),
                name: Some("v1".into()),
                reason: "r".into(),
                chunks_removed: 4,
                layers_removed: 1,
            }),
        );
        assert_eq!(
            deleted,
            "snapshot cc (v1) deleted: 4 chunk(s) and 1 disk layer(s) freed\n"
        );
        let status = StatusView {
            newest_snapshot: Some("cc".into()),
            newest_snapshot_name: Some("v1".into()),
            ..StatusView::default()
        };
        assert!(
            status_text(&status).contains("cc (v1)\n"),
            "{}",
            status_text(&status)
        );
    }
}
