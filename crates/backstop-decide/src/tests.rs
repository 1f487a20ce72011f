//! One test per rule: each fails if its rule is taken out.

use super::*;

fn live<'a>(snaps: &'a [(&'a str, Option<&'a str>)]) -> Vec<LiveSnapshot<'a>> {
    snaps
        .iter()
        .map(|(id, name)| LiveSnapshot { id, name: *name })
        .collect()
}

fn found(id: &str, by: ResolvedBy) -> Resolved {
    Resolved::Found { id: id.into(), by }
}

#[test]
fn resolve_an_exact_id_before_the_prefixes_it_is_one_of() {
    let l = live(&[("ab", None), ("abc", None)]);
    assert_eq!(resolve("ab", &l), found("ab", ResolvedBy::Id));
}

#[test]
fn resolve_a_name_before_a_prefix() {
    let l = live(&[("ab12", None), ("ff00", Some("ab"))]);
    assert_eq!(resolve("ab", &l), found("ff00", ResolvedBy::Name));
}

#[test]
fn resolve_a_unique_prefix() {
    let l = live(&[("ab12", None), ("cd34", Some("gold"))]);
    assert_eq!(resolve("cd", &l), found("cd34", ResolvedBy::Prefix));
    assert_eq!(resolve("gold", &l), found("cd34", ResolvedBy::Name));
}

#[test]
fn resolve_tells_ambiguous_from_not_found() {
    let l = live(&[
        ("ab1", None),
        ("ab2", None),
        ("c1", Some("x")),
        ("c2", Some("x")),
    ]);
    assert_eq!(
        resolve("ab", &l),
        Resolved::Ambiguous {
            by: ResolvedBy::Prefix,
            matches: vec!["ab1".into(), "ab2".into()],
        }
    );
    // Two live snapshots of one name: ambiguous, not the first of them.
    assert_eq!(
        resolve("x", &l),
        Resolved::Ambiguous {
            by: ResolvedBy::Name,
            matches: vec!["c1".into(), "c2".into()],
        }
    );
    assert_eq!(resolve("ff", &l), Resolved::NotFound);
}

#[test]
fn resolve_never_takes_the_empty_string_for_a_prefix() {
    assert_eq!(resolve("", &live(&[("ab", None)])), Resolved::NotFound);
}

/// A verifier over fixed outcomes that records every call, in order.
#[derive(Default)]
struct Script {
    passes: Vec<&'static str>,
    calls: Vec<String>,
    newer: Vec<Candidate>,
    newer_asked: bool,
    evidence: Option<&'static str>,
    evidence_asked: Option<Need>,
}

impl Script {
    fn passing(passes: &[&'static str]) -> Script {
        Script {
            passes: passes.to_vec(),
            ..Script::default()
        }
    }
}

impl Verifier for Script {
    type Error = String;
    fn verifies(&mut self, id: &str) -> Result<bool, String> {
        self.calls.push(format!("verify {id}"));
        if id == "boom" {
            return Err("store unreadable".into());
        }
        Ok(self.passes.contains(&id))
    }
    fn passed_over(&mut self, id: &str) -> Result<(), String> {
        self.calls.push(format!("passed over {id}"));
        Ok(())
    }
}

impl GateInputs for Script {
    fn newer(&mut self) -> Result<Vec<Candidate>, String> {
        self.newer_asked = true;
        Ok(self.newer.clone())
    }
    fn evidence(&mut self, need: &Need) -> Result<Evidence, String> {
        self.evidence_asked = Some(need.clone());
        self.evidence
            .map(|r| Evidence {
                reviewer: r.into(),
                expires_at: None,
            })
            .ok_or_else(|| "no reviewer token".into())
    }
}

fn unhealthy(id: &str) -> Candidate {
    Candidate {
        healthy: false,
        ..Candidate::new(id)
    }
}

fn at(id: &str, created_at: &str) -> Candidate {
    Candidate {
        created_at: Some(created_at.into()),
        ..Candidate::new(id)
    }
}

fn choose(cands: &[Candidate], before: Option<&str>, s: &mut Script) -> Choice {
    choose_target(cands, before, s).unwrap()
}

#[test]
fn choose_the_newest_that_verifies_recording_what_did_not() {
    let mut s = Script::passing(&["b", "a"]);
    let c = choose(
        &[
            Candidate::new("c"),
            Candidate::new("b"),
            Candidate::new("a"),
        ],
        None,
        &mut s,
    );
    assert_eq!(c.target.as_deref(), Some("b"));
    assert_eq!(
        c.skipped,
        vec![Skipped {
            id: "c".into(),
            why: SkipReason::DidNotVerify
        }]
    );
    assert_eq!(s.calls, ["verify c", "verify b"], "a is never looked at");
    let mut s = Script::passing(&[]);
    assert_eq!(choose(&[Candidate::new("a")], None, &mut s).target, None);
}

#[test]
fn choose_a_healthy_guest_first_and_an_unhealthy_one_only_when_none_verifies() {
    // u is newer and verifies, but was taken while the guest was unhealthy.
    let cands = [unhealthy("u"), Candidate::new("h")];
    let mut s = Script::passing(&["u", "h"]);
    let c = choose(&cands, None, &mut s);
    assert_eq!(c.target.as_deref(), Some("h"));
    assert!(!c.unhealthy_fallback);
    assert_eq!(s.calls, ["passed over u", "verify h"]);
    assert_eq!(
        c.skipped,
        vec![Skipped {
            id: "u".into(),
            why: SkipReason::GuestUnhealthy
        }]
    );
    // h does not verify: u after all, in a second pass.
    let mut s = Script::passing(&["u"]);
    let c = choose(&cands, None, &mut s);
    assert_eq!(c.target.as_deref(), Some("u"));
    assert!(c.unhealthy_fallback);
    assert_eq!(s.calls, ["passed over u", "verify h", "verify u"]);
}

#[test]
fn choose_never_a_marked_forensic_or_unusable_snapshot() {
    let flags: [fn(&mut Candidate); 3] = [
        |c| c.marked = true,
        |c| c.forensic = true,
        |c| c.unusable = true,
    ];
    for set in flags {
        let mut newest = Candidate::new("n");
        set(&mut newest);
        let mut s = Script::passing(&["n", "o"]);
        let c = choose(&[newest.clone(), Candidate::new("o")], None, &mut s);
        assert_eq!(c.target.as_deref(), Some("o"), "{newest:?}");
        assert_eq!(s.calls, ["verify o"], "{newest:?} is not even verified");
    }
}

#[test]
fn choose_only_what_was_created_strictly_before_the_bound() {
    let bound = "2026-05-01T12:00:00.000Z";
    let cands = [
        at("after", "2026-05-01T12:00:01.000Z"),
        at("same", bound),
        Candidate::new("unknown"),
        at("before", "2026-05-01T11:59:59.999Z"),
    ];
    let mut s = Script::passing(&["after", "same", "unknown", "before"]);
    assert_eq!(
        choose(&cands, Some(bound), &mut s).target.as_deref(),
        Some("before")
    );
    assert_eq!(s.calls, ["verify before"]);
    // Without a bound, the newest.
    let mut s = Script::passing(&["after", "before"]);
    assert_eq!(
        choose(&cands, None, &mut s).target.as_deref(),
        Some("after")
    );
}

#[test]
fn choose_tries_an_unreadable_manifest_whatever_the_bound() {
    let unreadable = Candidate {
        unreadable: true,
        ..Candidate::new("bad")
    };
    let mut s = Script::passing(&["ok"]);
    let c = choose(
        &[unreadable, at("ok", "2026-01-01T00:00:00Z")],
        Some("2026-05-01T00:00:00Z"),
        &mut s,
    );
    assert_eq!(c.target.as_deref(), Some("ok"));
    assert_eq!(
        s.calls,
        ["verify bad", "verify ok"],
        "its failure is recorded"
    );
}

#[test]
fn choose_stops_at_the_first_error() {
    let mut s = Script::passing(&["a"]);
    let r = choose_target(&[Candidate::new("boom"), Candidate::new("a")], None, &mut s);
    assert_eq!(r, Err("store unreadable".to_string()));
}

#[test]
fn a_closure_is_a_verifier() {
    let mut seen = Vec::new();
    let mut v = |id: &str| -> Result<bool, ()> {
        seen.push(id.to_string());
        Ok(id == "a")
    };
    let c = choose_target(&[Candidate::new("b"), Candidate::new("a")], None, &mut v);
    assert_eq!(c.map(|c| c.target), Ok(Some("a".into())));
    assert_eq!(seen, ["b", "a"]);
}

fn governed() -> GateInput {
    GateInput {
        governed: true,
        bounded: true,
        target_age_s: Some(60),
        temporal_bound_s: Some(3600),
        target_marked: false,
    }
}

fn gate(input: GateInput, s: &mut Script) -> GateDecision {
    restore_gate(&input, s).unwrap()
}

#[test]
fn gate_overrides_an_ungoverned_rollback_without_looking() {
    let mut s = Script {
        newer: vec![Candidate::new("n")],
        passes: vec!["n"],
        ..Script::default()
    };
    let input = GateInput {
        governed: false,
        target_marked: true,
        ..governed()
    };
    assert_eq!(gate(input, &mut s), GateDecision::Override);
    assert!(!s.newer_asked && s.calls.is_empty() && s.evidence_asked.is_none());
}

#[test]
fn gate_allows_the_newest_verified_without_evidence() {
    // A newer snapshot exists but does not verify; another verifies but is marked.
    let mut s = Script {
        newer: vec![
            Candidate {
                marked: true,
                ..Candidate::new("m")
            },
            Candidate::new("x"),
        ],
        passes: vec!["m"],
        ..Script::default()
    };
    let d = gate(governed(), &mut s);
    assert_eq!(d, GateDecision::Allow);
    assert_eq!(d.as_str(), "allow");
    assert_eq!(s.calls, ["verify x"]);
    assert!(s.evidence_asked.is_none());
}

#[test]
fn gate_blocks_an_older_target_without_evidence_and_allows_it_with() {
    let newer = vec![Candidate::new("n2"), Candidate::new("n1")];
    let mut s = Script {
        newer: newer.clone(),
        passes: vec!["n2", "n1"],
        ..Script::default()
    };
    let d = gate(governed(), &mut s);
    let need = Need::NotNewest { newer: "n2".into() };
    assert_eq!(
        d,
        GateDecision::Block {
            need: need.clone(),
            refused: "no reviewer token".into()
        }
    );
    assert_eq!(d.as_str(), "block");
    assert_eq!(s.calls, ["verify n2"], "verified only until one verifies");
    let mut s = Script {
        newer,
        passes: vec!["n1"],
        evidence: Some("alice"),
        ..Script::default()
    };
    let d = gate(governed(), &mut s);
    assert_eq!(
        d,
        GateDecision::Approved {
            need: Need::NotNewest { newer: "n1".into() },
            evidence: Evidence {
                reviewer: "alice".into(),
                expires_at: None
            }
        }
    );
    assert_eq!(d.as_str(), "allow");
}

#[test]
fn gate_needs_evidence_for_a_marked_target_without_listing() {
    let mut s = Script::default();
    let input = GateInput {
        target_marked: true,
        ..governed()
    };
    assert!(matches!(
        gate(input, &mut s),
        GateDecision::Block {
            need: Need::RolledBack,
            ..
        }
    ));
    assert!(!s.newer_asked);
}

#[test]
fn gate_the_temporal_bound_needs_evidence_even_without_governance() {
    let old = GateInput {
        governed: false,
        target_age_s: Some(3601),
        ..governed()
    };
    let mut s = Script::default();
    assert_eq!(
        gate(old, &mut s),
        GateDecision::Block {
            need: Need::BeyondBound,
            refused: "no reviewer token".into()
        }
    );
    assert_eq!(s.evidence_asked, Some(Need::BeyondBound));
    let mut s = Script {
        evidence: Some("bob"),
        ..Script::default()
    };
    assert!(matches!(
        gate(old, &mut s),
        GateDecision::Approved {
            need: Need::BeyondBound,
            ..
        }
    ));
    // Not bounded (a host trigger): the bound does not apply.
    let unbounded = GateInput {
        bounded: false,
        ..old
    };
    assert_eq!(
        gate(unbounded, &mut Script::default()),
        GateDecision::Override
    );
    // At the bound, or not known: not beyond.
    for (age, bound) in [(Some(3600), Some(3600)), (None, Some(1)), (Some(9), None)] {
        let at_bound = GateInput {
            target_age_s: age,
            temporal_bound_s: bound,
            ..old
        };
        assert_eq!(
            gate(at_bound, &mut Script::default()),
            GateDecision::Override
        );
    }
}

#[test]
fn gate_hands_back_an_error_of_its_inputs() {
    let mut s = Script {
        newer: vec![Candidate::new("boom")],
        ..Script::default()
    };
    assert_eq!(
        restore_gate(&governed(), &mut s),
        Err("store unreadable".to_string())
    );
}

#[test]
fn created_before_is_strict_compares_instants_and_refuses_the_unreadable() {
    assert!(created_before(
        "2026-05-01T11:59:59Z",
        "2026-05-01T12:00:00Z"
    ));
    assert!(!created_before(
        "2026-05-01T12:00:00Z",
        "2026-05-01T12:00:00.000Z"
    ));
    // 13:00 at +02:00 is 11:00 UTC.
    assert!(created_before(
        "2026-05-01T13:00:00+02:00",
        "2026-05-01T12:00:00Z"
    ));
    assert!(!created_before("yesterday", "2026-05-01T12:00:00Z"));
    assert!(!created_before("2026-05-01T11:00:00Z", "later"));
}
