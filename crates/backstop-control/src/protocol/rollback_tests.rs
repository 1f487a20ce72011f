//! `rollback` on the wire: [`RollbackArgs`] is a newtype variant's struct inside the tagged,
//! strictly decoded request enum, so the tag must reach the variant and never the struct, and
//! the struct must refuse unknown fields itself.

use super::*;
use crate::Envelope;

fn every_field() -> RollbackArgs {
    RollbackArgs {
        to: Some("ab12".into()),
        reason: "bad update".into(),
        emergency: false,
        rollback_type: Some(RollbackType::Session),
        before: Some("2026-05-01T12:00:00Z".into()),
        reviewer_token: Some(serde_json::json!({"reviewer": "alice"})),
        allow_newer_minor: true,
        include_forensic: true,
    }
}

#[test]
fn a_rollback_request_round_trips_byte_for_byte() {
    let r = Request::Rollback(every_field());
    let line = serde_json::to_string(&r).unwrap();
    assert_eq!(
        line,
        r#"{"op":"rollback","to":"ab12","reason":"bad update","emergency":false,"rollback_type":"session","before":"2026-05-01T12:00:00Z","reviewer_token":{"reviewer":"alice"},"allow_newer_minor":true,"include_forensic":true}"#
    );
    assert_eq!(serde_json::from_str::<Request>(&line).unwrap(), r);
    // Defaults are left out, but `to` is always there (null when absent).
    let bare = Request::Rollback(RollbackArgs {
        to: None,
        reason: "r".into(),
        emergency: false,
        rollback_type: None,
        before: None,
        reviewer_token: None,
        allow_newer_minor: false,
        include_forensic: false,
    });
    let line = serde_json::to_string(&bare).unwrap();
    assert_eq!(
        line,
        r#"{"op":"rollback","to":null,"reason":"r","emergency":false}"#
    );
    assert_eq!(serde_json::from_str::<Request>(&line).unwrap(), bare);
}

#[test]
fn the_tag_is_not_an_unknown_field_wherever_it_stands() {
    // Through `Envelope::decode` too: the socket decodes from a `Value`, not from the text.
    for line in [
        r#"{"op":"rollback","reason":"r"}"#,
        r#"{"reason":"r","op":"rollback"}"#,
        r#"{"version":1,"vm":"web","reason":"r","op":"rollback"}"#,
    ] {
        let envelope = Envelope::decode(line.as_bytes()).unwrap();
        let Request::Rollback(args) = envelope.request else {
            panic!("{line} decoded as {:?}", envelope.request);
        };
        assert_eq!(args.reason, "r");
        assert_eq!(args.to, None);
    }
}

#[test]
fn an_unknown_rollback_field_is_refused_by_name() {
    for line in [
        r#"{"op":"rollback","reason":"r","scope":"guest_chosen"}"#,
        r#"{"scope":"guest_chosen","op":"rollback","reason":"r"}"#,
    ] {
        let err = serde_json::from_str::<Request>(line)
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("unknown field `scope`, expected one of `to`, `reason`"),
            "{err}"
        );
        let err = Envelope::decode(line.as_bytes()).unwrap_err().to_string();
        assert!(err.starts_with("unknown field `scope`"), "{err}");
    }
}
