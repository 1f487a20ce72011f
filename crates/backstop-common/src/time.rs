//! Wall-clock time as backstop writes it everywhere: RFC 3339, UTC, milliseconds.

/// Formats a moment as `2026-11-22T22:15:41.123Z`.
pub fn rfc3339(t: ::time::OffsetDateTime) -> String {
    let fmt = ::time::macros::format_description!(
        "[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:3]Z"
    );
    t.to_offset(::time::UtcOffset::UTC)
        .format(&fmt)
        .unwrap_or_else(|_| "1970-01-01T00:00:00.000Z".into())
}

/// Now, formatted by [`rfc3339`].
pub fn now_rfc3339() -> String {
    rfc3339(::time::OffsetDateTime::now_utc())
}

/// `secs` seconds from now, formatted by [`rfc3339`].
pub fn rfc3339_in(secs: u64) -> String {
    let secs = i64::try_from(secs).unwrap_or(i64::MAX / 2);
    rfc3339(::time::OffsetDateTime::now_utc().saturating_add(::time::Duration::seconds(secs)))
}

/// Parses what [`rfc3339`] writes (or any RFC 3339 time).
pub fn parse_rfc3339(s: &str) -> Option<::time::OffsetDateTime> {
    ::time::OffsetDateTime::parse(s, &::time::format_description::well_known::Rfc3339).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_utc_with_milliseconds_and_parses_back() {
        let t = ::time::macros::datetime!(2026-11-22 22:15:41.123456 +02:00);
        assert_eq!(rfc3339(t), "2026-11-22T20:15:41.123Z");
        let back = parse_rfc3339(&rfc3339(t)).unwrap();
        assert_eq!(back.unix_timestamp(), t.unix_timestamp());
        assert!(now_rfc3339() < rfc3339_in(10));
    }
}
