//! The control socket's request line: what `Connection::read_envelope` does with the bytes of
//! one line (`Envelope::decode`), then what the daemon does with the hostile parts of the
//! decoded request (the reviewer token of a rollback goes to `evidence::verify`).
//!
//! Asserts: any bytes give an envelope or an error; an accepted envelope is within its bounds
//! (version 1..=PROTOCOL_VERSION, a VM name of 1..=64 bytes) and re-encodes to a line that
//! decodes to the same envelope.
#![no_main]

use backstop_control::{
    evidence, Envelope, Request, RollbackArgs, MAX_LINE_BYTES, PROTOCOL_VERSION,
};
use backstop_integrity::HostKey;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The server hands `decode` one line without its newline, at most MAX_LINE_BYTES long.
    let line = data.split(|&b| b == b'\n').next().unwrap_or_default();
    let line = &line[..line.len().min(MAX_LINE_BYTES)];
    let Ok(envelope) = Envelope::decode(line) else {
        return;
    };
    assert!((1..=PROTOCOL_VERSION).contains(&envelope.version));
    if let Some(vm) = &envelope.vm {
        assert!(!vm.is_empty() && vm.len() <= 64, "vm name {vm:?}");
    }
    let _ = envelope.request.name();

    let encoded = envelope.encode().expect("an accepted envelope encodes");
    let again = Envelope::decode(&encoded).expect("a re-encoded envelope decodes");
    assert_eq!(again, envelope);

    if let Request::Rollback(RollbackArgs {
        reviewer_token: Some(token),
        to,
        ..
    }) = &envelope.request
    {
        let key = HostKey::from_bytes([7; 32]);
        let snapshot = to.as_deref().unwrap_or("0123456789abcdef0123456789abcdef");
        let _ = evidence::verify(&key, token, snapshot, time::OffsetDateTime::UNIX_EPOCH);
    }
});
