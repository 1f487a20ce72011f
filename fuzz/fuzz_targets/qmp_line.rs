//! QEMU's QMP replies: the line → typed value path of `Qmp::read_message` (`qmp::parse_line`),
//! then what the client makes of a message (`is_greeting`, `classify`, `parse_event`) and the
//! typed readers of replies (`QemuVersion::from_query`, `version::write_tracking_on`).
//!
//! The input is split into lines the way `read_message` does (each line keeps its `\n`).
//! Asserts: a decoded line is a JSON object; an event is classified as one whatever its id; a
//! protocol error's detail stays short.
#![no_main]

use backstop_qemu::qmp::{classify, is_greeting, parse_event, parse_line, Message};
use backstop_qemu::version::write_tracking_on;
use backstop_qemu::QemuVersion;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&id, data)) = data.split_first() else {
        return;
    };
    for line in data.split_inclusive(|&b| b == b'\n') {
        let value = match parse_line(line) {
            Ok(Some(value)) => value,
            Ok(None) => continue,
            Err(detail) => {
                assert!(!detail.is_empty());
                continue;
            }
        };
        assert!(value.is_object());
        let _ = is_greeting(&value);
        let _ = QemuVersion::from_query(&value);
        if let Some(ret) = value.get("return") {
            let _ = QemuVersion::from_query(ret);
            let _ = write_tracking_on(ret);
        }
        let _ = write_tracking_on(&value);
        let event = parse_event(&value);
        match classify(value, u64::from(id)) {
            Message::Event(e) => assert_eq!(Some(e), event),
            Message::Unknown(detail) => {
                assert!(event.is_none());
                assert!(
                    detail.chars().count() <= 200,
                    "detail of {} chars",
                    detail.len()
                );
            }
            _ => assert!(event.is_none()),
        }
    }
});
