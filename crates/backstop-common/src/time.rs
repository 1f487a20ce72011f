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

    /// Leap days exist exactly in leap years (every 4th, not every 100th, every 400th), and the
    /// day after one is 1 March.
    #[test]
    fn leap_days_round_trip_and_impossible_dates_are_refused() {
        for leap in ["2024-02-29T12:00:00.000Z", "2000-02-29T00:00:00.000Z"] {
            let t = parse_rfc3339(leap).unwrap();
            assert_eq!(rfc3339(t), leap);
            let next = t + ::time::Duration::days(1);
            assert_eq!(&rfc3339(next)[..10], &leap.replace("02-29", "03-01")[..10]);
        }
        for bad in [
            "2025-02-29T00:00:00Z",
            "2100-02-29T00:00:00Z",
            "2026-04-31T00:00:00Z",
            "2026-13-01T00:00:00Z",
            "2026-05-01T24:00:00Z",
        ] {
            assert_eq!(parse_rfc3339(bad), None, "{bad}");
        }
    }

    #[test]
    fn offsets_become_utc_and_the_year_rolls_over() {
        let t = parse_rfc3339("2026-12-31T23:30:00.5-01:00").unwrap();
        assert_eq!(rfc3339(t), "2027-01-01T00:30:00.500Z");
        let t = parse_rfc3339("2027-01-01T00:59:59.999+01:00").unwrap();
        assert_eq!(rfc3339(t), "2026-12-31T23:59:59.999Z");
        // Below a millisecond is cut, never rounded up into the next second.
        let t = parse_rfc3339("2026-05-01T12:00:00.9999999Z").unwrap();
        assert_eq!(rfc3339(t), "2026-05-01T12:00:00.999Z");
    }

    /// The epoch and the times either side of it: what the journal writes is read back to the
    /// millisecond.
    #[test]
    fn times_around_the_epoch_round_trip() {
        let epoch = ::time::OffsetDateTime::UNIX_EPOCH;
        assert_eq!(rfc3339(epoch), "1970-01-01T00:00:00.000Z");
        for ms in [-86_400_001i64, -1, 0, 1, 951_782_400_000, 4_102_444_799_999] {
            let t = epoch + ::time::Duration::milliseconds(ms);
            let back = parse_rfc3339(&rfc3339(t)).unwrap();
            assert_eq!(back, t, "{ms}");
        }
        assert_eq!(
            rfc3339(epoch - ::time::Duration::milliseconds(1)),
            "1969-12-31T23:59:59.999Z"
        );
    }

    /// Only RFC 3339: no bare dates, no space for the `T`, no missing zone, nothing trailing.
    #[test]
    fn what_is_not_rfc_3339_is_refused() {
        for bad in [
            "",
            "2026-05-01",
            "2026-05-01 12:00:03",
            "2026-05-01T12:00:03",
            "2026-05-01T12:00:03Z trailing",
            "2026-5-1T12:00:03Z",
            "yesterday",
        ] {
            assert_eq!(parse_rfc3339(bad), None, "{bad:?}");
        }
        assert_eq!(
            rfc3339(parse_rfc3339("2026-05-01t12:00:03z").unwrap()),
            "2026-05-01T12:00:03.000Z"
        );
    }

    #[test]
    fn a_moment_far_ahead_saturates_instead_of_overflowing() {
        let far = parse_rfc3339(&rfc3339_in(u64::MAX)).unwrap();
        assert!(far > ::time::OffsetDateTime::now_utc() + ::time::Duration::days(365 * 1000));
    }
}
