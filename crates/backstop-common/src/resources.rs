//! Resource exhaustion is not evidence: a snapshot that cannot be read because the host ran out
//! of descriptors or memory is not a bad snapshot. Callers that would otherwise conclude
//! something from a failure (skip a snapshot as corrupt, HALT a VM) ask [`exhaustion`] first.

use std::error::Error;

/// The errno values that say "the host is short of something now", not "this data is bad".
const EXHAUSTION: [i32; 5] = [
    24,  // EMFILE: this process's descriptor limit
    23,  // ENFILE: the system's
    12,  // ENOMEM
    11,  // EAGAIN (thread or memory limits in fork/clone, non-blocking I/O)
    105, // ENOBUFS
];

/// The first error in `err`'s source chain (itself included) that is an I/O error of resource
/// exhaustion, if any.
pub fn exhaustion<'a>(err: &'a (dyn Error + 'static)) -> Option<&'a std::io::Error> {
    let mut next: Option<&(dyn Error + 'static)> = Some(err);
    while let Some(e) = next {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            if io.raw_os_error().is_some_and(|n| EXHAUSTION.contains(&n)) {
                return Some(io);
            }
        }
        next = e.source();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Wrapped(std::io::Error);
    impl std::fmt::Display for Wrapped {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "cannot read chunk: {}", self.0)
        }
    }
    impl Error for Wrapped {
        fn source(&self) -> Option<&(dyn Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn exhaustion_is_found_through_the_chain_and_corruption_is_not_exhaustion() {
        let emfile = Wrapped(std::io::Error::from_raw_os_error(24));
        assert_eq!(exhaustion(&emfile).and_then(|e| e.raw_os_error()), Some(24));
        let enoent = Wrapped(std::io::Error::from_raw_os_error(2));
        assert!(exhaustion(&enoent).is_none());
        let eio = std::io::Error::from_raw_os_error(5);
        assert!(exhaustion(&eio).is_none());
        let enomem = std::io::Error::from_raw_os_error(12);
        assert!(exhaustion(&enomem).is_some());
    }
}
