//! Snapshot names: what a person calls a snapshot (`snapshot create --name`), usable wherever a
//! snapshot id is.
//!
//! The rule: 1 to 63 characters of `[A-Za-z0-9._-]`, the first a letter or digit, and not made
//! of the lower-case hex digits `0-9a-f` alone. Such a name could be read as a snapshot id or an
//! id prefix (`cafe`, `2026`); refusing it keeps every word a person types meaning one thing.
//! A name is unique among the VM's live (not yet pruned or deleted) snapshots; once its snapshot
//! is gone the name may be given again.

/// Longest name.
pub const SNAPSHOT_NAME_MAX_LEN: usize = 63;

/// Checks `name` against the rule above; the error says what is wrong, in one line.
pub fn check_snapshot_name(name: &str) -> Result<(), String> {
    let bytes = name.as_bytes();
    let Some(first) = bytes.first() else {
        return Err("a snapshot name must not be empty".into());
    };
    if bytes.len() > SNAPSHOT_NAME_MAX_LEN {
        return Err(format!(
            "a snapshot name is at most {SNAPSHOT_NAME_MAX_LEN} characters"
        ));
    }
    if !first.is_ascii_alphanumeric() {
        return Err("a snapshot name starts with a letter or a digit".into());
    }
    if let Some(bad) = bytes
        .iter()
        .find(|b| !(b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-')))
    {
        let shown = name
            .chars()
            .find(|c| c.len_utf8() > 1 || *c as u32 == u32::from(*bad))
            .unwrap_or('?');
        return Err(format!(
            "a snapshot name has only letters, digits, '.', '_' and '-' (not {shown:?})"
        ));
    }
    if bytes
        .iter()
        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b))
    {
        return Err(format!(
            "{name:?} reads as a snapshot id or id prefix (only 0-9 and a-f): a name needs another character"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn good_names_pass() {
        for good in [
            "v1",
            "before-upgrade",
            "Release_2026.11",
            "A",
            "0day",
            "x",
            "deadbeefX",
            "ABC",
            &"n".repeat(63),
        ] {
            assert_eq!(check_snapshot_name(good), Ok(()), "{good}");
        }
    }

    #[test]
    fn bad_names_are_refused_with_a_reason() {
        for (bad, says) in [
            ("", "empty"),
            ("-x", "starts with"),
            (".hidden", "starts with"),
            ("_x", "starts with"),
            ("a b", "' '"),
            ("a/b", "'/'"),
            ("naïve", "'ï'"),
            ("x\n", "'\\n'"),
            ("cafe", "reads as a snapshot id"),
            ("2026", "reads as a snapshot id"),
            ("0123456789abcdef0123456789abcdef", "reads as a snapshot id"),
            (&"n".repeat(64), "at most 63"),
        ] {
            let err = check_snapshot_name(bad).unwrap_err();
            assert!(err.contains(says), "{bad:?}: {err}");
            assert!(!err.contains('\n') || bad.contains('\n') && !err.contains("\n\n"));
        }
    }
}
