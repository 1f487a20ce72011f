//! backstop-agent: the guest end of backstop's agent channel, for guests that want backstop's own
//! channel rather than qemu-ga. It sends the host `HB <n>` once a second over the virtio-serial
//! port `org.backstop.agent.0` and, when the host says `EPOCH <n>` after a rollback, records the
//! epoch in `/run/backstop/epoch` and says so on stdout.
//!
//! The host is not trusted to send sensible bytes: what it sends is read in lines of at most
//! [`protocol::HOST_LINE_MAX`] bytes, and only `EPOCH <decimal u64>` means anything. The agent
//! must never block on the host, never buffer more than one line from it, never exit because the
//! host is absent, and never say anything about *why* a rollback happened (it is not told).
//!
//! The protocol ([`protocol`]) is pure and tested here; the binary (`main.rs`) does the I/O. It
//! must run on any guest, whatever its libc: scripts/package-agent.sh builds it static.

pub mod protocol;
