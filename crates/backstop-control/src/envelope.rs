//! A request line as it travels: the protocol version, the VM it is for, and the request.
//!
//! `{"version":2,"vm":"web1","op":"snapshot_create","reason":"…"}`. Both added keys are
//! optional: a line without `version` is version 1 (one VM per daemon), a line without `vm` is
//! for the daemon's only VM (the daemon refuses it, listing the names, when it guards more than
//! one). The request itself is decoded the same in both versions: unknown ops and fields are
//! refused.

use serde::de::Error as _;
use serde_json::Value;

use crate::protocol::Request;

/// The protocol version this build speaks. 2 added `vm` and the `vms` request.
pub const PROTOCOL_VERSION: u64 = 2;

#[derive(Debug, Clone, PartialEq)]
pub struct Envelope {
    pub version: u64,
    pub vm: Option<String>,
    pub request: Request,
}

impl Envelope {
    /// A request for `vm` (or the only VM), at this build's version.
    pub fn new(vm: Option<&str>, request: Request) -> Envelope {
        Envelope {
            version: PROTOCOL_VERSION,
            vm: vm.map(str::to_string),
            request,
        }
    }

    /// The line to send (without the newline).
    pub fn encode(&self) -> Result<Vec<u8>, serde_json::Error> {
        let mut v = serde_json::to_value(&self.request)?;
        if let Value::Object(m) = &mut v {
            m.insert("version".into(), self.version.into());
            if let Some(vm) = &self.vm {
                m.insert("vm".into(), vm.clone().into());
            }
        }
        serde_json::to_vec(&v)
    }

    /// Decodes one request line strictly.
    pub fn decode(line: &[u8]) -> Result<Envelope, serde_json::Error> {
        let mut v: Value = serde_json::from_slice(line)?;
        let Value::Object(m) = &mut v else {
            return Err(serde_json::Error::custom("a request is a JSON object"));
        };
        let version = match m.remove("version") {
            None => 1,
            Some(Value::Number(n)) => n
                .as_u64()
                .filter(|v| (1..=PROTOCOL_VERSION).contains(v))
                .ok_or_else(|| {
                    serde_json::Error::custom(format!(
                        "protocol version {n} is not one this daemon speaks (1..={PROTOCOL_VERSION})"
                    ))
                })?,
            Some(_) => return Err(serde_json::Error::custom("`version` must be a number")),
        };
        let vm = match m.remove("vm") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) if !s.is_empty() && s.len() <= 64 => Some(s),
            Some(_) => {
                return Err(serde_json::Error::custom(
                    "`vm` must be a VM name (1 to 64 bytes)",
                ))
            }
        };
        let request = serde_json::from_value(v)?;
        Ok(Envelope {
            version,
            vm,
            request,
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// The kept inputs of a fuzz target, replayed by stable `cargo test`.
    use backstop_common::fuzz_corpus::inputs as fuzz_inputs;

    /// The fuzz target `control_envelope`'s inputs: never a panic, and an accepted line
    /// re-encodes to a line that decodes to the same envelope.
    #[test]
    fn fuzz_inputs_replay() {
        let mut accepted = 0;
        for (name, bytes) in fuzz_inputs("control_envelope") {
            let line = bytes.split(|&b| b == b'\n').next().unwrap_or_default();
            if let Ok(e) = Envelope::decode(line) {
                let again = Envelope::decode(&e.encode().unwrap());
                assert_eq!(again.unwrap(), e, "{name}");
                accepted += 1;
            }
        }
        assert!(accepted >= 5, "the seeds hold valid requests");
    }

    #[test]
    fn round_trip_and_old_lines_still_decode() {
        let e = Envelope::new(Some("web1"), Request::SnapshotList);
        let line = e.encode().unwrap();
        assert_eq!(Envelope::decode(&line).unwrap(), e);
        let old = Envelope::decode(br#"{"op":"status"}"#).unwrap();
        assert_eq!(
            (old.version, old.vm, old.request),
            (1, None, Request::Status)
        );
        let vms = Envelope::decode(br#"{"op":"vms","version":2}"#).unwrap();
        assert_eq!(vms.request, Request::Vms);
    }

    #[test]
    fn bad_envelopes_are_refused() {
        for bad in [
            &br#"{"op":"status","version":3}"#[..],
            br#"{"op":"status","version":"2"}"#,
            br#"{"op":"status","vm":7}"#,
            br#"{"op":"status","vm":""}"#,
            br#"{"op":"status","vmm":"a"}"#,
            br#"["op","status"]"#,
            br#"{"op":"status","x":1}"#,
        ] {
            assert!(
                Envelope::decode(bad).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }
}
