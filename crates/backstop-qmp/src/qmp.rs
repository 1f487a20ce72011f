//! A small, strict QMP client: replies matched by `id`, events queued. A command may be written
//! before the one ahead of it is answered ([`Qmp::execute_batch`], [`Qmp::write_command`]).
//!
//! QEMU is trusted more than the guest, but its replies are still parsed strictly and bounded:
//! a line longer than [`MAX_QMP_LINE`] or a reply that is not a JSON object is a protocol error,
//! never a panic or an unbounded buffer.

use std::collections::VecDeque;
use std::io::{IoSlice, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags, UnixAddr};
use serde_json::{json, Map, Value};

use backstop_hypervisor::{BackendError, Result};

/// Largest QMP line accepted (query-pci on a big machine is a few hundred KiB).
pub const MAX_QMP_LINE: usize = 8 << 20;

/// A QMP event with QEMU's own timestamp.
#[derive(Debug, Clone, PartialEq)]
pub struct QmpEvent {
    pub name: String,
    pub data: Value,
    /// QEMU's timestamp, microseconds since the Unix epoch.
    pub timestamp_us: u64,
}

impl QmpEvent {
    /// The `status` of a `MIGRATION` event (`None` for any other event).
    pub fn migration_status(&self) -> Option<&str> {
        if self.name != "MIGRATION" {
            return None;
        }
        self.data.get("status").and_then(Value::as_str)
    }

    /// Whether this is the `MIGRATION` event that ends a migration (`completed`, `failed`,
    /// `cancelled`).
    pub fn ends_migration(&self) -> bool {
        matches!(
            self.migration_status(),
            Some("completed" | "failed" | "cancelled")
        )
    }
}

/// How many events a QEMU may send before its greeting (see [`Qmp::read_greeting`]); the
/// start of a VM sends one or two.
const MAX_EVENTS_BEFORE_GREETING: usize = 16;

pub struct Qmp {
    stream: UnixStream,
    buf: Vec<u8>,
    events: VecDeque<QmpEvent>,
    next_id: u64,
    /// An answer read while waiting for an event ([`Qmp::event_before_answer`]), kept for the
    /// [`Qmp::await_answer`] that asks for it.
    answer_ahead: Option<(u64, Value)>,
}

impl Qmp {
    /// Connects (retrying until `timeout`, QEMU creates the socket shortly after it starts),
    /// reads the greeting and negotiates capabilities. `exited` is asked between tries: once it
    /// names how QEMU ended, retrying is pointless and the connect fails at once with that.
    pub fn connect(
        path: &Path,
        timeout: Duration,
        mut exited: impl FnMut() -> Option<String>,
    ) -> Result<Qmp> {
        let deadline = Instant::now() + timeout;
        let stream = loop {
            match UnixStream::connect(path) {
                Ok(s) => break s,
                Err(e) if Instant::now() < deadline => {
                    if let Some(how) = exited() {
                        return Err(BackendError::Launch(format!(
                            "QEMU {how} before its monitor socket appeared ({e})"
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(source) => {
                    return Err(BackendError::Io {
                        step: "qmp connect",
                        source,
                    })
                }
            }
        };
        let mut qmp = Qmp {
            stream,
            buf: Vec::with_capacity(4096),
            events: VecDeque::new(),
            next_id: 1,
            answer_ahead: None,
        };
        qmp.read_greeting(timeout)?;
        qmp.execute("qmp_capabilities", None, timeout)?;
        Ok(qmp)
    }

    /// Reads QEMU's greeting. A QEMU that starts running while the client connects may send an
    /// event first: its monitor emits events to a connection it has not greeted yet (seen by
    /// the bench's client in CI: QEMU 7.2's `RESUME` of its own start before the greeting). Up to
    /// [`MAX_EVENTS_BEFORE_GREETING`] such events are queued like any other; anything else
    /// before the greeting is a protocol error.
    fn read_greeting(&mut self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            let msg = self.read_message("qmp greeting", remaining)?;
            if is_greeting(&msg) {
                return Ok(());
            }
            match parse_event(&msg) {
                Some(ev) if self.events.len() < MAX_EVENTS_BEFORE_GREETING => {
                    self.events.push_back(ev)
                }
                _ => {
                    return Err(BackendError::Protocol {
                        step: "qmp greeting",
                        detail: truncate(&msg.to_string()),
                    })
                }
            }
        }
    }

    /// Runs one command and returns its `return` value. A QMP `error` becomes
    /// [`BackendError::Command`] carrying QEMU's description.
    pub fn execute(
        &mut self,
        command: &'static str,
        args: Option<Value>,
        timeout: Duration,
    ) -> Result<Value> {
        self.execute_with_fd(command, args, None, timeout)
    }

    /// Like [`Qmp::execute`], passing `fd` to QEMU with SCM_RIGHTS in the same message
    /// (what `getfd` and `add-fd` expect).
    pub fn execute_with_fd(
        &mut self,
        command: &'static str,
        args: Option<Value>,
        fd: Option<RawFd>,
        timeout: Duration,
    ) -> Result<Value> {
        let id = self.send_command(command, args, fd)?;
        self.await_answer(command, id, timeout)
    }

    /// Writes all of `commands` before reading any answer, so QEMU runs them back to back
    /// with no round trip between them; returns each one's result, in order, with when its
    /// answer was read. A command after one that could not be written is not sent (its result
    /// says so); every command that was sent is waited for, so no answer is left to be taken
    /// for a later command's.
    pub fn execute_batch(
        &mut self,
        commands: Vec<(&'static str, Option<Value>)>,
        timeout: Duration,
    ) -> Vec<(Result<Value>, Instant)> {
        let mut sent = Vec::with_capacity(commands.len());
        let mut unsent = false;
        for (command, args) in commands {
            let id = if unsent {
                Err(BackendError::Command {
                    step: command,
                    message: "not sent".into(),
                })
            } else {
                self.send_command(command, args, None)
            };
            unsent |= id.is_err();
            sent.push((command, id));
        }
        sent.into_iter()
            .map(|(command, id)| {
                let reply = id.and_then(|id| self.await_answer(command, id, timeout));
                (reply, Instant::now())
            })
            .collect()
    }

    /// Writes one command and returns its id without waiting for its answer: [`Qmp::await_answer`]
    /// takes the answer later. For a step that acts on what QEMU reports while it still runs the
    /// command ([`Qmp::event_before_answer`]).
    pub fn write_command(&mut self, command: &'static str, args: Option<Value>) -> Result<u64> {
        self.send_command(command, args, None)
    }

    /// With command `id` written and not yet answered: reads until an event for which `pred`
    /// holds (`true`; it is queued, last) or the command's answer (`false`; kept for
    /// [`Qmp::await_answer`]), whichever QEMU sends first. Already queued events count.
    pub fn event_before_answer(
        &mut self,
        command: &'static str,
        id: u64,
        timeout: Duration,
        mut pred: impl FnMut(&QmpEvent) -> bool,
    ) -> Result<bool> {
        if self.events.iter().any(&mut pred) {
            return Ok(true);
        }
        let deadline = Instant::now() + timeout;
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                return Err(BackendError::Timeout {
                    step: command,
                    timeout,
                });
            }
            let msg = self.read_message(command, remaining)?;
            if let Some(ev) = parse_event(&msg) {
                let hit = pred(&ev);
                self.events.push_back(ev);
                if hit {
                    return Ok(true);
                }
            } else if msg.get("id").and_then(Value::as_u64) == Some(id) {
                self.answer_ahead = Some((id, msg));
                return Ok(false);
            }
            // Any other message is an answer to an earlier, timed-out command: dropped, as
            // `await_answer` does.
        }
    }

    /// Writes one command; returns its id.
    fn send_command(
        &mut self,
        command: &'static str,
        args: Option<Value>,
        fd: Option<RawFd>,
    ) -> Result<u64> {
        let id = self.next_id;
        self.next_id += 1;
        let mut msg = Map::new();
        msg.insert("execute".into(), Value::String(command.into()));
        if let Some(args) = args {
            msg.insert("arguments".into(), args);
        }
        msg.insert("id".into(), json!(id));
        let mut line = Value::Object(msg).to_string().into_bytes();
        line.push(b'\n');
        self.send(command, &line, fd)?;
        Ok(id)
    }

    /// Reads until the answer to command `id` (events are queued on the way), or takes the one
    /// [`Qmp::event_before_answer`] read ahead. The second half of [`Qmp::write_command`].
    pub fn await_answer(
        &mut self,
        command: &'static str,
        id: u64,
        timeout: Duration,
    ) -> Result<Value> {
        let deadline = Instant::now() + timeout;
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            let ahead = self.answer_ahead.take_if(|(ahead, _)| *ahead == id);
            if remaining.is_zero() && ahead.is_none() {
                return Err(BackendError::Timeout {
                    step: command,
                    timeout,
                });
            }
            let msg = match ahead {
                Some((_, msg)) => msg,
                None => self.read_message(command, remaining)?,
            };
            match classify(msg, id) {
                Message::Event(ev) => self.events.push_back(ev),
                // A reply to some earlier, timed-out command: drop it.
                Message::OtherReply => {}
                Message::Return(ret) => return Ok(ret),
                Message::Error(desc) => {
                    return Err(BackendError::Command {
                        step: command,
                        message: desc,
                    })
                }
                Message::Unknown(detail) => {
                    return Err(BackendError::Protocol {
                        step: command,
                        detail,
                    })
                }
            }
        }
    }

    fn send(&mut self, step: &'static str, bytes: &[u8], fd: Option<RawFd>) -> Result<()> {
        match fd {
            None => self
                .stream
                .write_all(bytes)
                .map_err(|source| BackendError::Io { step, source }),
            Some(fd) => {
                let fds = [fd];
                let cmsg = [ControlMessage::ScmRights(&fds)];
                let iov = [IoSlice::new(bytes)];
                let sent = sendmsg::<UnixAddr>(
                    self.stream.as_raw_fd(),
                    &iov,
                    &cmsg,
                    MsgFlags::empty(),
                    None,
                )
                .map_err(|e| BackendError::Io {
                    step,
                    source: e.into(),
                })?;
                if sent != bytes.len() {
                    // The fd went with the first byte; the rest is plain data.
                    self.stream
                        .write_all(&bytes[sent..])
                        .map_err(|source| BackendError::Io { step, source })?;
                }
                Ok(())
            }
        }
    }

    /// Waits for an event named `name` (checking queued ones first) and removes it from the queue.
    pub fn wait_event(
        &mut self,
        name: &str,
        timeout: Duration,
        step: &'static str,
    ) -> Result<QmpEvent> {
        self.wait_event_matching(step, timeout, |e| e.name == name)
    }

    /// The first already queued event for which `pred` holds, left in the queue.
    pub fn queued_event(&self, pred: impl FnMut(&&QmpEvent) -> bool) -> Option<&QmpEvent> {
        self.events.iter().find(pred)
    }

    /// The queued events, in the order they arrived.
    pub fn queued(&self) -> impl Iterator<Item = &QmpEvent> {
        self.events.iter()
    }

    /// Waits for the first event for which `pred` holds.
    pub fn wait_event_matching(
        &mut self,
        step: &'static str,
        timeout: Duration,
        mut pred: impl FnMut(&QmpEvent) -> bool,
    ) -> Result<QmpEvent> {
        if let Some(pos) = self.events.iter().position(&mut pred) {
            return Ok(self.events.remove(pos).unwrap_or_else(|| unreachable!()));
        }
        let deadline = Instant::now() + timeout;
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                return Err(BackendError::Timeout { step, timeout });
            }
            let msg = self.read_message(step, remaining)?;
            if let Some(ev) = parse_event(&msg) {
                if pred(&ev) {
                    return Ok(ev);
                }
                self.events.push_back(ev);
            }
        }
    }

    /// Waits for the next event, for a client that only listens (sends no commands after the
    /// handshake): anything that is not an event is skipped, and nothing is queued.
    pub fn next_event(&mut self, step: &'static str, timeout: Duration) -> Result<QmpEvent> {
        if let Some(ev) = self.events.pop_front() {
            return Ok(ev);
        }
        let deadline = Instant::now() + timeout;
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                return Err(BackendError::Timeout { step, timeout });
            }
            if let Some(ev) = parse_event(&self.read_message(step, remaining)?) {
                return Ok(ev);
            }
        }
    }

    /// A second handle on the monitor's connection (to shut it down from another thread).
    pub fn stream_handle(&self) -> std::io::Result<UnixStream> {
        self.stream.try_clone()
    }

    /// Reads whatever events are already waiting, without blocking for long.
    pub fn drain_events(&mut self) -> Result<Vec<QmpEvent>> {
        loop {
            match self.read_message("qmp events", Duration::from_millis(1)) {
                Ok(msg) => {
                    self.queue_if_event(&msg);
                }
                Err(BackendError::Timeout { .. }) => break,
                Err(e) => return Err(e),
            }
        }
        Ok(self.events.drain(..).collect())
    }

    /// Reads whatever events are already waiting and drops the queued ones `stale` selects,
    /// keeping the others for their consumers.
    pub fn discard_events(&mut self, mut stale: impl FnMut(&QmpEvent) -> bool) -> Result<()> {
        loop {
            match self.read_message("qmp events", Duration::from_millis(1)) {
                Ok(msg) => {
                    self.queue_if_event(&msg);
                }
                Err(BackendError::Timeout { .. }) => break,
                Err(e) => return Err(e),
            }
        }
        self.events.retain(|e| !stale(e));
        Ok(())
    }

    fn queue_if_event(&mut self, msg: &Value) -> bool {
        match parse_event(msg) {
            Some(ev) => {
                self.events.push_back(ev);
                true
            }
            None => false,
        }
    }

    /// Reads one complete JSON line. A partial line stays buffered across timeouts.
    fn read_message(&mut self, step: &'static str, timeout: Duration) -> Result<Value> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(pos) = self.buf.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.buf.drain(..=pos).collect();
                match parse_line(&line) {
                    Ok(None) => continue,
                    Ok(Some(value)) => return Ok(value),
                    Err(detail) => return Err(BackendError::Protocol { step, detail }),
                }
            }
            if self.buf.len() > MAX_QMP_LINE {
                return Err(BackendError::Protocol {
                    step,
                    detail: format!("line over {MAX_QMP_LINE} bytes"),
                });
            }
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                return Err(BackendError::Timeout { step, timeout });
            }
            self.stream
                .set_read_timeout(Some(remaining))
                .map_err(|source| BackendError::Io { step, source })?;
            let mut chunk = [0u8; 16 * 1024];
            match self.stream.read(&mut chunk) {
                Ok(0) => {
                    return Err(BackendError::Io {
                        step,
                        source: std::io::Error::new(
                            std::io::ErrorKind::UnexpectedEof,
                            "QEMU closed the QMP socket",
                        ),
                    })
                }
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    return Err(BackendError::Timeout { step, timeout });
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(source) => return Err(BackendError::Io { step, source }),
            }
        }
    }
}

/// Decodes one line QEMU sent (its `\r\n` may still be on it): `Ok(None)` for a blank line,
/// the JSON object otherwise. Anything else — not UTF-8, not JSON, not an object — is the
/// protocol error's detail. Any bytes give a value or an error, never a panic.
pub fn parse_line(line: &[u8]) -> std::result::Result<Option<Value>, String> {
    let text = std::str::from_utf8(line)
        .map_err(|_| "reply is not UTF-8".to_string())?
        .trim();
    if text.is_empty() {
        return Ok(None);
    }
    let value: Value = serde_json::from_str(text).map_err(|e| format!("bad JSON: {e}"))?;
    if !value.is_object() {
        return Err("reply is not an object".into());
    }
    Ok(Some(value))
}

/// Whether `msg` is QEMU's greeting (`{"QMP": {...}}`).
pub fn is_greeting(msg: &Value) -> bool {
    msg.get("QMP").is_some()
}

/// What one message means to a client waiting for the reply to command `id`.
#[derive(Debug, Clone, PartialEq)]
pub enum Message {
    /// An event, queued for whoever waits for it.
    Event(QmpEvent),
    /// A reply to another command (an earlier one that timed out).
    OtherReply,
    /// The command's `return` value.
    Return(Value),
    /// The command failed: QEMU's description.
    Error(String),
    /// The reply to `id` but neither `return` nor `error`: the protocol error's detail.
    Unknown(String),
}

/// Classifies a message read while waiting for the reply to command `id`.
pub fn classify(mut msg: Value, id: u64) -> Message {
    if let Some(ev) = parse_event(&msg) {
        return Message::Event(ev);
    }
    if msg.get("id").and_then(Value::as_u64) != Some(id) {
        return Message::OtherReply;
    }
    if let Some(ret) = msg.get_mut("return") {
        return Message::Return(ret.take());
    }
    if let Some(err) = msg.get("error") {
        let desc = err
            .get("desc")
            .and_then(Value::as_str)
            .unwrap_or("unknown error");
        return Message::Error(desc.to_string());
    }
    Message::Unknown(truncate(&msg.to_string()))
}

/// Parses `{"event": .., "data": .., "timestamp": {"seconds": s, "microseconds": us}}`.
pub fn parse_event(msg: &Value) -> Option<QmpEvent> {
    let name = msg.get("event")?.as_str()?.to_string();
    let ts = msg.get("timestamp");
    let secs = ts
        .and_then(|t| t.get("seconds"))
        .and_then(Value::as_u64)
        .unwrap_or(0);
    let us = ts
        .and_then(|t| t.get("microseconds"))
        .and_then(Value::as_u64)
        .unwrap_or(0);
    Some(QmpEvent {
        name,
        data: msg.get("data").cloned().unwrap_or(Value::Null),
        timestamp_us: secs.saturating_mul(1_000_000).saturating_add(us),
    })
}

fn truncate(s: &str) -> String {
    s.chars().take(200).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kept inputs of a fuzz target, replayed by stable `cargo test`.
    use backstop_common::fuzz_corpus::inputs as fuzz_inputs;

    /// A client on one end of a socket pair (a fake QEMU on the other), past the greeting.
    fn peer(stream: UnixStream) -> Qmp {
        Qmp {
            stream,
            buf: Vec::new(),
            events: VecDeque::new(),
            next_id: 1,
            answer_ahead: None,
        }
    }

    #[test]
    fn lines_decode_to_objects_or_name_what_is_wrong() {
        assert_eq!(parse_line(b"\r\n"), Ok(None));
        assert_eq!(parse_line(b"{}\r\n"), Ok(Some(json!({}))));
        assert_eq!(parse_line(b"\xff\n").unwrap_err(), "reply is not UTF-8");
        assert_eq!(parse_line(b"[1]\n").unwrap_err(), "reply is not an object");
        assert!(parse_line(b"{\n").unwrap_err().starts_with("bad JSON"));
    }

    #[test]
    fn messages_are_classified_for_the_command_waited_for() {
        let stop = json!({"event": "STOP", "id": 7});
        assert!(matches!(classify(stop, 7), Message::Event(e) if e.name == "STOP"));
        assert_eq!(
            classify(json!({"return": {}, "id": 6}), 7),
            Message::OtherReply
        );
        assert_eq!(classify(json!({"return": 5}), 7), Message::OtherReply);
        assert_eq!(
            classify(json!({"return": [1], "id": 7}), 7),
            Message::Return(json!([1]))
        );
        assert_eq!(
            classify(json!({"error": {"desc": "nope"}, "id": 7}), 7),
            Message::Error("nope".into())
        );
        assert_eq!(
            classify(json!({"error": 1, "id": 7}), 7),
            Message::Error("unknown error".into())
        );
        let Message::Unknown(detail) = classify(json!({"id": 7, "x": "y".repeat(500)}), 7) else {
            panic!("not unknown");
        };
        assert_eq!(detail.chars().count(), 200);
        assert!(is_greeting(&json!({"QMP": {}})) && !is_greeting(&json!({"qmp": {}})));
    }

    /// The fuzz target `qmp_line`'s inputs (byte 0: the id waited for, then QMP lines): never a
    /// panic; what decodes is an object, classified as an event exactly when it is one.
    #[test]
    fn fuzz_inputs_replay() {
        for (name, bytes) in fuzz_inputs("qmp_line") {
            let Some((&id, lines)) = bytes.split_first() else {
                continue;
            };
            for line in lines.split_inclusive(|&b| b == b'\n') {
                let Ok(Some(value)) = parse_line(line) else {
                    continue;
                };
                let _ = crate::QemuVersion::from_query(&value);
                let _ = crate::version::write_tracking_on(&value);
                if let Some(ret) = value.get("return") {
                    let _ = crate::version::write_tracking_on(ret);
                }
                let event = parse_event(&value);
                let is_event = matches!(classify(value, u64::from(id)), Message::Event(_));
                assert_eq!(is_event, event.is_some(), "{name}");
            }
        }
    }

    #[test]
    fn events_carry_qemu_timestamps() {
        let v: Value = serde_json::from_str(
            r#"{"event":"STOP","timestamp":{"seconds":10,"microseconds":250}}"#,
        )
        .unwrap();
        let e = parse_event(&v).unwrap();
        assert_eq!(e.name, "STOP");
        assert_eq!(e.timestamp_us, 10_000_250);
        assert!(parse_event(&serde_json::json!({"return":{}})).is_none());
    }

    /// A fake QMP peer on a socketpair: checks framing, id matching, event queuing and errors.
    #[test]
    fn replies_are_matched_by_id_and_events_queued() {
        let (a, mut b) = UnixStream::pair().unwrap();
        let server = std::thread::spawn(move || {
            b.write_all(b"{\"QMP\":{\"version\":{}}}\r\n").unwrap();
            let mut r = std::io::BufReader::new(b.try_clone().unwrap());
            let mut line = String::new();
            use std::io::BufRead;
            r.read_line(&mut line).unwrap(); // qmp_capabilities id 1
            b.write_all(b"{\"return\":{},\"id\":1}\r\n").unwrap();
            line.clear();
            r.read_line(&mut line).unwrap(); // stop id 2
            b.write_all(b"{\"event\":\"STOP\",\"timestamp\":{\"seconds\":1,\"microseconds\":2}}\r\n{\"return\":{},\"id\":2}\r\n").unwrap();
            line.clear();
            r.read_line(&mut line).unwrap(); // bogus id 3
            b.write_all(b"{\"error\":{\"class\":\"GenericError\",\"desc\":\"nope\"},\"id\":3}\r\n")
                .unwrap();
            line.clear();
            r.read_line(&mut line).unwrap(); // id 4: huge junk then nothing
            b.write_all(b"[1,2]\r\n").unwrap();
        });
        let mut q = peer(a);
        let g = q.read_message("greeting", Duration::from_secs(5)).unwrap();
        assert!(g.get("QMP").is_some());
        q.execute("qmp_capabilities", None, Duration::from_secs(5))
            .unwrap();
        q.execute("stop", None, Duration::from_secs(5)).unwrap();
        let ev = q
            .wait_event("STOP", Duration::from_secs(1), "test")
            .unwrap();
        assert_eq!(ev.timestamp_us, 1_000_002);
        let err = q
            .execute("bogus", None, Duration::from_secs(5))
            .unwrap_err();
        assert!(err.to_string().contains("nope"), "{err}");
        let err = q.execute("junk", None, Duration::from_secs(5)).unwrap_err();
        assert!(matches!(err, BackendError::Protocol { .. }), "{err}");
        server.join().unwrap();
    }

    /// A batch is written whole before any answer is read (the peer answers only once it has
    /// all three), and each command gets its own answer, an error in the middle included.
    #[test]
    fn a_batch_is_written_before_any_answer_and_each_command_gets_its_own() {
        let (a, mut b) = UnixStream::pair().unwrap();
        let server = std::thread::spawn(move || {
            use std::io::BufRead;
            let mut r = std::io::BufReader::new(b.try_clone().unwrap());
            let mut lines = Vec::new();
            for _ in 0..3 {
                let mut line = String::new();
                r.read_line(&mut line).unwrap();
                lines.push(serde_json::from_str::<Value>(&line).unwrap());
            }
            b.write_all(
                b"{\"return\":{},\"id\":1}\r\n{\"event\":\"STOP\",\"timestamp\":{\"seconds\":1,\"microseconds\":0}}\r\n\
                  {\"error\":{\"class\":\"GenericError\",\"desc\":\"no node\"},\"id\":2}\r\n\
                  {\"return\":{\"x\":3},\"id\":3}\r\n",
            )
            .unwrap();
            lines
        });
        let mut q = peer(a);
        let replies = q.execute_batch(
            vec![
                ("stop", None),
                ("transaction", Some(json!({"actions": []}))),
                ("migrate", Some(json!({"uri": "fd:x"}))),
            ],
            Duration::from_secs(5),
        );
        let sent = server.join().unwrap();
        let names: Vec<_> = sent.iter().map(|m| m["execute"].clone()).collect();
        assert_eq!(
            names,
            [json!("stop"), json!("transaction"), json!("migrate")]
        );
        assert_eq!(sent[2]["arguments"]["uri"], "fd:x");
        assert_eq!(replies.len(), 3);
        assert!(replies[0].0.is_ok());
        let err = replies[1].0.as_ref().unwrap_err().to_string();
        assert!(
            err.contains("no node") && err.contains("transaction"),
            "{err}"
        );
        assert_eq!(replies[2].0.as_ref().unwrap(), &json!({"x": 3}));
        assert!(replies[0].1 <= replies[1].1 && replies[1].1 <= replies[2].1);
        assert!(q.queued().any(|e| e.name == "STOP"), "the event is kept");
    }

    /// A command written ahead of its answer: the event QEMU sends while it runs the command is
    /// seen before the answer (the peer answers `stop` only once the next command came, as
    /// QEMU's monitor may), and an answer that comes first is kept for `await_answer`.
    #[test]
    fn an_event_seen_before_its_commands_answer_lets_the_next_command_go_first() {
        let (a, mut b) = UnixStream::pair().unwrap();
        let server = std::thread::spawn(move || {
            use std::io::BufRead;
            let mut r = std::io::BufReader::new(b.try_clone().unwrap());
            let mut read = || {
                let mut line = String::new();
                r.read_line(&mut line).unwrap();
                serde_json::from_str::<Value>(&line).unwrap()
            };
            let stop = read();
            b.write_all(
                b"{\"event\":\"STOP\",\"timestamp\":{\"seconds\":1,\"microseconds\":0}}\r\n",
            )
            .unwrap();
            // No answer to `stop` until the switch has been written.
            let switch = read();
            b.write_all(b"{\"return\":{},\"id\":1}\r\n{\"return\":{\"s\":1},\"id\":2}\r\n")
                .unwrap();
            // `cont`: answered before its RESUME.
            let cont = read();
            b.write_all(b"{\"return\":{},\"id\":3}\r\n{\"event\":\"RESUME\",\"timestamp\":{\"seconds\":2,\"microseconds\":0}}\r\n")
                .unwrap();
            [stop, switch, cont].map(|m| m["execute"].clone())
        });
        let mut q = peer(a);
        let t = Duration::from_secs(5);
        let stop = q.write_command("stop", None).unwrap();
        assert!(q
            .event_before_answer("stop", stop, t, |e| e.name == "STOP")
            .unwrap());
        let switch = q.write_command("transaction", None).unwrap();
        assert_eq!(q.await_answer("stop", stop, t).unwrap(), json!({}));
        assert_eq!(
            q.await_answer("transaction", switch, t).unwrap(),
            json!({"s": 1})
        );
        // The answer first: kept, and the event still comes afterwards.
        let cont = q.write_command("cont", None).unwrap();
        assert!(!q
            .event_before_answer("cont", cont, t, |e| e.name == "RESUME")
            .unwrap());
        assert_eq!(q.await_answer("cont", cont, t).unwrap(), json!({}));
        q.wait_event("RESUME", t, "test").unwrap();
        assert_eq!(
            server.join().unwrap(),
            [json!("stop"), json!("transaction"), json!("cont")]
        );
        assert!(q.queued().any(|e| e.name == "STOP"), "the event is kept");
    }

    /// A fake QEMU on a listening socket at `path` that writes `lines` to its first client,
    /// then answers `qmp_capabilities`.
    fn fake_qemu(path: &Path, lines: Vec<String>) -> std::thread::JoinHandle<()> {
        let listener = std::os::unix::net::UnixListener::bind(path).unwrap();
        std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            for l in lines {
                // A client that gave up early closed its end: nothing more to write.
                let _ = s.write_all(format!("{l}\n").as_bytes());
            }
            let mut line = String::new();
            let _ = std::io::BufRead::read_line(
                &mut std::io::BufReader::new(s.try_clone().unwrap()),
                &mut line,
            );
            let _ = s.write_all(b"{\"return\": {}, \"id\": 1}\n");
        })
    }

    #[test]
    fn an_event_before_the_greeting_is_kept_and_the_greeting_still_read() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("qmp.sock");
        let resume = r#"{"timestamp": {"seconds": 1, "microseconds": 2}, "event": "RESUME"}"#;
        let greeting = r#"{"QMP": {"version": {}, "capabilities": []}}"#;
        let server = fake_qemu(&path, vec![resume.into(), greeting.into()]);
        let q = Qmp::connect(&path, Duration::from_secs(10), || None).unwrap();
        server.join().unwrap();
        let queued: Vec<_> = q
            .queued()
            .map(|e| (e.name.clone(), e.timestamp_us))
            .collect();
        assert_eq!(queued, [("RESUME".to_string(), 1_000_002)]);
    }

    #[test]
    fn anything_else_before_the_greeting_is_refused_in_one_line() {
        let d = tempfile::tempdir().unwrap();
        for (i, (first, named)) in [
            (r#"{"return": {}}"#, "return"),
            // More events than a starting QEMU sends.
            (r#"{"event": "RESUME"}"#, "RESUME"),
        ]
        .into_iter()
        .enumerate()
        {
            let path = d.path().join(format!("qmp-{i}.sock"));
            let n = if i == 0 {
                1
            } else {
                MAX_EVENTS_BEFORE_GREETING + 1
            };
            let server = fake_qemu(&path, vec![first.to_string(); n]);
            let err = Qmp::connect(&path, Duration::from_secs(10), || None)
                .err()
                .unwrap()
                .to_string();
            drop(server);
            assert!(err.contains("qmp greeting"), "{err}");
            assert!(err.contains(named), "{err}");
            assert!(!err.contains('\n'), "{err}");
        }
    }

    #[test]
    fn connect_stops_retrying_once_qemu_exited() {
        let d = tempfile::tempdir().unwrap();
        let mut asked = 0;
        let started = std::time::Instant::now();
        let err = Qmp::connect(&d.path().join("qmp.sock"), Duration::from_secs(30), || {
            asked += 1;
            (asked >= 3).then(|| "exited (exit status: 1)".to_string())
        })
        .err()
        .unwrap();
        assert!(err.to_string().contains("exited (exit status: 1)"), "{err}");
        assert_eq!(asked, 3, "asked between tries until it said so");
        // Not the 30 s of retrying a dead QEMU's socket.
        assert!(started.elapsed() < Duration::from_secs(10));
    }
}
