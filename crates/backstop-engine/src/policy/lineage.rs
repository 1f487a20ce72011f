//! Lineage (spec/004): every snapshot names its parent — the snapshot the captured VM descended
//! from — and the epoch it was taken in, so the VM's history is a tree. A rollback to X leaves
//! behind exactly X's descendants on the line it abandons (marked rolled back, kept, listed);
//! other lines are never touched.
//!
//! The parents are kept twice: in each manifest (signed, immutable) and in the lineage book
//! `<state_dir>/policy/lineage.json`, which is never pruned, so a chain stays walkable after
//! retention removed a snapshot in the middle of it. Snapshots taken before lineage was
//! recorded have no parent anywhere: for them, creation order decides (listed after the target
//! = left behind), as it did before.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// One snapshot's place in the tree.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Node {
    pub parent: Option<String>,
    pub epoch: u64,
    /// RFC 3339.
    pub created_at: String,
}

/// What is known of a snapshot's parent: `None` — nothing recorded (before lineage);
/// `Some(None)` — a root (first after a cold boot); `Some(Some(p))` — `p`.
pub type ParentOf<'a> = dyn Fn(&str) -> Option<Option<String>> + 'a;

/// Longest ancestry walked (a cycle cannot be written, but a hand-edited book could hold one).
const MAX_DEPTH: usize = 100_000;

/// Whether `id` descends from `ancestor` (strictly). Unknown ancestry is `None`.
pub fn descends(id: &str, ancestor: &str, parent_of: &ParentOf) -> Option<bool> {
    let mut cur = id.to_string();
    for _ in 0..MAX_DEPTH {
        match parent_of(&cur)? {
            None => return Some(false),
            Some(p) if p == ancestor => return Some(true),
            Some(p) => cur = p,
        }
    }
    None
}

/// The snapshots a rollback to `target` leaves behind, of those listed after it (creation
/// order): its descendants; one of unknown ancestry counts as left behind (the rule before
/// lineage). Pure: the engine and `audit replay` both call it.
pub fn left_behind(target: &str, listed_after: &[String], parent_of: &ParentOf) -> Vec<String> {
    listed_after
        .iter()
        .filter(|id| descends(id, target, parent_of).unwrap_or(true))
        .cloned()
        .collect()
}

/// The lineage book: every snapshot ever published, by id.
pub type Book = BTreeMap<String, Node>;

#[cfg(test)]
mod tests {
    use super::*;

    fn book(edges: &[(&str, Option<&str>)]) -> BTreeMap<String, Option<String>> {
        edges
            .iter()
            .map(|(c, p)| (c.to_string(), p.map(str::to_string)))
            .collect()
    }

    #[test]
    fn only_descendants_of_the_target_are_left_behind() {
        // a ─ b ─ c          (line 1, abandoned by a rollback to a)
        //  └─ d ─ e          (line 2)
        let b = book(&[
            ("a", None),
            ("b", Some("a")),
            ("c", Some("b")),
            ("d", Some("a")),
            ("e", Some("d")),
        ]);
        let parent_of = |id: &str| b.get(id).cloned();
        let after_b: Vec<String> = ["c", "d", "e"].map(String::from).to_vec();
        assert_eq!(left_behind("b", &after_b, &parent_of), ["c"]);
        let after_a: Vec<String> = ["b", "c", "d", "e"].map(String::from).to_vec();
        assert_eq!(left_behind("a", &after_a, &parent_of), ["b", "c", "d", "e"]);
        assert_eq!(left_behind("d", &["e".to_string()], &parent_of), ["e"]);
        assert_eq!(descends("e", "b", &parent_of), Some(false));
    }

    #[test]
    fn unknown_ancestry_falls_back_to_creation_order_and_a_new_root_is_never_left_behind() {
        let b = book(&[("a", None), ("r", None)]);
        let parent_of = |id: &str| b.get(id).cloned();
        let after: Vec<String> = ["legacy", "r"].map(String::from).to_vec();
        assert_eq!(left_behind("a", &after, &parent_of), ["legacy"]);
    }

    #[test]
    fn a_cycle_in_a_hand_edited_book_ends() {
        let b = book(&[("x", Some("y")), ("y", Some("x"))]);
        let parent_of = |id: &str| b.get(id).cloned();
        assert_eq!(descends("x", "z", &parent_of), None);
    }
}
