//! Property: a random sequence of snapshot creates, rollbacks (soft: newer snapshots marked
//! rolled back) and prunes under random retention policies never leaves a kept snapshot
//! unverifiable, never removes a protected one (the newest verified, an "open action"'s
//! snapshot), and never deletes a disk layer that a kept snapshot or the running chain uses.
//!
//! The store is real (chunks, indexes, signed manifests, fsyncs); the payloads are small fake
//! RAM streams that share content, and the disk layers are small files chained the way the
//! engine chains qcow2 overlays (base, then one frozen layer per snapshot interval).
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use backstop_integrity::HostKey;
use backstop_store::{
    plan_retention, remove_layers, Candidate, ListEntry, ManifestInput, RetentionPolicy, Store,
    VerifyOptions,
};
use proptest::prelude::*;
use serde_json::json;
use time::OffsetDateTime;

#[derive(Debug, Clone)]
enum Op {
    /// A snapshot whose RAM stream is `len` bytes of pseudo-random stream `seed` (streams with
    /// the same seed share their prefix, so their chunks dedup).
    Create {
        seed: u8,
        len: u32,
    },
    /// Roll back to the `pick`-th (modulo) listed snapshot.
    Rollback {
        pick: u8,
    },
    /// Open an action whose pre-action snapshot is the `pick`-th listed one (it is protected).
    OpenAction {
        pick: u8,
    },
    CloseActions,
    Prune {
        keep_last: u8,
        hourly: u8,
        daily: u8,
        grace_s: u8,
        later_s: u16,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..3, 1u32..700_000).prop_map(|(seed, len)| Op::Create { seed, len }),
        2 => any::<u8>().prop_map(|pick| Op::Rollback { pick }),
        1 => any::<u8>().prop_map(|pick| Op::OpenAction { pick }),
        1 => Just(Op::CloseActions),
        3 => (0u8..4, 0u8..3, 0u8..3, 0u8..3, 0u16..4000).prop_map(
            |(keep_last, hourly, daily, grace_s, later_s)| Op::Prune {
                keep_last, hourly, daily, grace_s, later_s
            }
        ),
    ]
}

fn stream(seed: u8, len: u32) -> Vec<u8> {
    let mut state = (u64::from(seed) + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len as usize + 8);
    while out.len() < len as usize {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        out.extend_from_slice(&state.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes());
    }
    out.truncate(len as usize);
    out
}

/// The engine's side of the world, in miniature.
struct World {
    _dir: tempfile::TempDir,
    store: Store,
    disks: PathBuf,
    /// The running VM's chain: base first, writable top last.
    chain: Vec<PathBuf>,
    next_layer: u64,
    /// Rolled-back marks (kept outside the store, as the engine keeps them).
    marks: BTreeMap<String, OffsetDateTime>,
    /// Pre-action snapshots of open actions.
    open: BTreeSet<String>,
    /// Each snapshot's chain as published.
    chains: BTreeMap<String, Vec<PathBuf>>,
}

impl World {
    fn new() -> World {
        let dir = tempfile::tempdir().unwrap();
        let (store, _) =
            Store::open(&dir.path().join("store"), HostKey::from_bytes([3; 32])).unwrap();
        let disks = dir.path().join("disks");
        std::fs::create_dir_all(disks.join("data")).unwrap();
        let base = dir.path().join("base.img");
        std::fs::write(&base, stream(9, 5000)).unwrap();
        let mut w = World {
            _dir: dir,
            store,
            disks,
            chain: vec![base],
            next_layer: 0,
            marks: BTreeMap::new(),
            open: BTreeSet::new(),
            chains: BTreeMap::new(),
        };
        let top = w.new_layer();
        w.chain.push(top);
        w
    }

    fn new_layer(&mut self) -> PathBuf {
        self.next_layer += 1;
        let p = self
            .disks
            .join(format!("data/{:06}.qcow2", self.next_layer));
        std::fs::write(
            &p,
            stream((self.next_layer % 200) as u8, 300 + self.next_layer as u32),
        )
        .unwrap();
        p
    }

    fn listed(&self) -> Vec<String> {
        self.store
            .list()
            .unwrap()
            .iter()
            .map(|e| e.snapshot_id().to_string())
            .collect()
    }

    fn create(&mut self, seed: u8, len: u32) {
        // Freeze the top layer: the snapshot's chain is the running chain; the VM goes on in a
        // new overlay.
        let frozen = self.chain.clone();
        let mut b = self.store.begin().unwrap();
        b.write_chunked(
            "vmstate",
            "ram+device",
            &mut stream(seed, len).as_slice(),
            &mut |_| {},
        )
        .unwrap();
        b.add_disk_chain("data", &frozen).unwrap();
        let m = b
            .publish(ManifestInput {
                created_by: "prop".into(),
                reason: "prop".into(),
                scope: "full".into(),
                vm: "vm".into(),
                trigger: "schedule".into(),
                epoch: 0,
                config_fingerprint: "fp".into(),
                capture: json!({}),
                lineage: None,
                name: None,
            })
            .unwrap();
        self.chains.insert(m.snapshot_id, frozen);
        let top = self.new_layer();
        self.chain.push(top);
    }

    fn rollback(&mut self, pick: u8, now: OffsetDateTime) {
        let ids = self.listed();
        if ids.is_empty() {
            return;
        }
        let i = pick as usize % ids.len();
        let target = &ids[i];
        self.store
            .verify(target, &VerifyOptions::default())
            .unwrap();
        for newer in &ids[i + 1..] {
            self.marks.entry(newer.clone()).or_insert(now);
        }
        let mut chain = self.chains[target].clone();
        chain.push(self.new_layer());
        self.chain = chain;
    }

    /// The newest snapshot of the current line that verifies (the engine's emergency target).
    fn newest_verified(&self) -> Option<String> {
        self.listed()
            .into_iter()
            .rev()
            .filter(|id| !self.marks.contains_key(id))
            .find(|id| self.store.verify(id, &VerifyOptions::default()).is_ok())
    }

    fn prune(&mut self, policy: &RetentionPolicy, now: OffsetDateTime) {
        let newest = self.newest_verified();
        let candidates: Vec<Candidate> = self
            .store
            .list()
            .unwrap()
            .into_iter()
            .map(|e| {
                let id = e.snapshot_id().to_string();
                let created_at = match &e {
                    ListEntry::Valid(m) => OffsetDateTime::parse(
                        &m.created_at,
                        &time::format_description::well_known::Rfc3339,
                    )
                    .ok(),
                    ListEntry::Corrupt { .. } => None,
                };
                let protected = if newest.as_deref() == Some(id.as_str()) {
                    Some("newest verified".to_string())
                } else if self.open.contains(&id) {
                    Some("open action".to_string())
                } else {
                    None
                };
                Candidate {
                    rolled_back_at: self.marks.get(&id).copied(),
                    snapshot_id: id,
                    created_at,
                    protected,
                }
            })
            .collect();
        let plan = plan_retention(policy, &candidates, now);
        let report = self.store.remove_snapshots(&plan.remove_ids()).unwrap();
        for (id, _) in &report.removed {
            self.marks.remove(id);
            self.chains.remove(id);
        }
        let keep: BTreeSet<PathBuf> = self.chain.iter().cloned().collect();
        remove_layers(&report.unreferenced_layers, &keep, &self.disks).unwrap();
    }

    fn check(&self, protected_before: &BTreeSet<String>) {
        let ids = self.listed();
        for id in &ids {
            if let Err(e) = self.store.verify(id, &VerifyOptions::default()) {
                panic!("kept snapshot {id} does not verify: {e}");
            }
        }
        for id in protected_before {
            assert!(ids.contains(id), "protected snapshot {id} was removed");
        }
        for l in &self.chain {
            assert!(
                l.exists(),
                "a layer of the running chain was deleted: {}",
                l.display()
            );
        }
    }
}

fn files_under(dir: &Path) -> usize {
    std::fs::read_dir(dir)
        .map(|r| {
            r.flatten()
                .map(|e| {
                    if e.path().is_dir() {
                        files_under(&e.path())
                    } else {
                        1
                    }
                })
                .sum()
        })
        .unwrap_or(0)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn pruning_never_leaves_a_kept_snapshot_unverifiable(ops in proptest::collection::vec(op(), 1..18)) {
        let mut w = World::new();
        let t0 = OffsetDateTime::now_utc();
        let mut clock = t0;
        for op in ops {
            let protected: BTreeSet<String> =
                w.open.iter().cloned().chain(w.newest_verified()).collect();
            match op {
                Op::Create { seed, len } => w.create(seed, len),
                Op::Rollback { pick } => w.rollback(pick, clock),
                Op::OpenAction { pick } => {
                    let ids = w.listed();
                    if !ids.is_empty() {
                        w.open.insert(ids[pick as usize % ids.len()].clone());
                    }
                }
                Op::CloseActions => w.open.clear(),
                Op::Prune { keep_last, hourly, daily, grace_s, later_s } => {
                    clock += time::Duration::seconds(i64::from(later_s));
                    let policy = RetentionPolicy {
                        keep_last: u32::from(keep_last),
                        hourly: u32::from(hourly),
                        daily: u32::from(daily),
                        keep_rolled_back_s: u64::from(grace_s) * 1000,
                    };
                    w.prune(&policy, clock);
                }
            }
            w.check(&protected);
        }
        // A full prune down to the protected minimum still leaves everything kept verifiable,
        // and the chunk store holds no more than the kept snapshots need.
        w.open.clear();
        let strict = RetentionPolicy { keep_last: 0, hourly: 0, daily: 0, keep_rolled_back_s: 0 };
        w.prune(&strict, clock + time::Duration::days(1));
        w.check(&w.newest_verified().into_iter().collect());
        let left = w.listed();
        prop_assert!(left.len() <= 1, "only the newest verified may be left: {left:?}");
        let chunks = files_under(&w.store.root().join("chunks"));
        let needed: usize = left
            .iter()
            .map(|id| {
                let v = w.store.verify(id, &VerifyOptions::default()).unwrap();
                v.report.chunks_checked as usize
            })
            .sum();
        prop_assert_eq!(chunks, needed, "unreferenced chunks were left behind");
    }
}
