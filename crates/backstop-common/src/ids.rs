//! Random ids (trace, session, build): 128 bits, lowercase hex.

/// A fresh 32-hex-digit id.
pub fn random_id() -> String {
    let mut b = [0u8; 16];
    // getrandom only fails without an entropy source; fall back to time so ids stay unique.
    if getrandom::fill(&mut b).is_err() {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        b = t.to_le_bytes();
    }
    hex::encode(b)
}

/// Where an actor gets its ids: [`SeededIds`] in production (a random seed, journaled, so
/// `audit replay` can check every id's provenance), a counter in tests.
pub trait IdSource: Send + Sync {
    fn next_id(&self) -> String;
    /// The seed the ids derive from, when they derive from one (journaled at session start).
    fn seed(&self) -> Option<String> {
        None
    }
}

/// Ids derived from a seed (spec/003 §5): id number `k` (from 0) is the first 32 hex digits of
/// sha256 of `"<seed>:<k>"`. The seed is fresh per session and journaled; the ids are as
/// unguessable as random ones to anyone who has not read the journal.
#[derive(Debug)]
pub struct SeededIds {
    seed: String,
    next: std::sync::atomic::AtomicU64,
}

impl SeededIds {
    /// A fresh random seed.
    pub fn fresh() -> SeededIds {
        SeededIds::with_seed(random_id())
    }

    pub fn with_seed(seed: String) -> SeededIds {
        SeededIds {
            seed,
            next: std::sync::atomic::AtomicU64::new(0),
        }
    }
}

/// Id number `k` of the seeded sequence `seed`.
pub fn seeded_id(seed: &str, k: u64) -> String {
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(format!("{seed}:{k}").as_bytes());
    hex::encode(&digest[..16])
}

impl IdSource for SeededIds {
    fn next_id(&self) -> String {
        let k = self.next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        seeded_id(&self.seed, k)
    }
    fn seed(&self) -> Option<String> {
        Some(self.seed.clone())
    }
}

/// Ids from the OS's random source.
#[derive(Debug, Default, Clone, Copy)]
pub struct RandomIds;

impl IdSource for RandomIds {
    fn next_id(&self) -> String {
        random_id()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_hex_and_distinct() {
        let a = RandomIds.next_id();
        let b = random_id();
        assert_eq!(a.len(), 32);
        assert!(a.bytes().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
    }

    #[test]
    fn seeded_ids_follow_their_seed() {
        let ids = SeededIds::with_seed("s1".into());
        let (a, b) = (ids.next_id(), ids.next_id());
        assert_eq!(a, seeded_id("s1", 0));
        assert_eq!(b, seeded_id("s1", 1));
        assert_ne!(a, b);
        assert_eq!(a.len(), 32);
        assert_ne!(seeded_id("s2", 0), a);
        assert_eq!(ids.seed().as_deref(), Some("s1"));
    }
}
