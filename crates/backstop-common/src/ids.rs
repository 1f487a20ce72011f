//! Random ids (trace, session, build): 128 bits, lowercase hex.

/// A fresh 32-hex-digit id.
pub fn random_id() -> String {
    let mut b = [0u8; 16];
    // getrandom only fails without an entropy source; fall back to time so ids stay unique.
    if getrandom::getrandom(&mut b).is_err() {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        b = t.to_le_bytes();
    }
    hex::encode(b)
}

/// Where an actor gets its ids: [`RandomIds`] in production, a counter in tests so a run can be
/// replayed.
pub trait IdSource: Send + Sync {
    fn next_id(&self) -> String;
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
}
