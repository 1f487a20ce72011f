//! Off-host replication: every published snapshot of this daemon's VMs is uploaded in the
//! background to an S3-compatible object store (Ceph's RADOS Gateway is the one the tests run), and
//! another host of the fleet can pull it back, verify it and publish it into its own store.
//!
//! What it must never do: make a snapshot or a rollback wait on the network (the uploader only
//! reads published, immutable files, on its own threads); trust a remote byte before checking
//! it (a pulled manifest's ed25519 signature is checked against the fleet trust file before the
//! manifest is decoded, every chunk and layer against the signed digests before anything is
//! published); or publish half a snapshot (a pull stages everything first, then publishes through
//! the store's own atomic rename).
//!
//! Bucket layout under `prefix/`:
//!
//! ```text
//! chunks/<sha256>                               content-addressed chunks (shared by all hosts)
//! layers/<sha256>                               disk layers, content-addressed the same way
//! hosts/<host>/snapshots/<id>/<payload>.index   chunk indexes
//! hosts/<host>/snapshots/<id>/manifest.json     the manifest as published (uploaded after all
//!                                               of the above)
//! hosts/<host>/snapshots/<id>/manifest.ed25519  its signature, uploaded last: a manifest
//!                                               without one is not there yet
//! leases/<vm>.json                              the host that runs the VM, until when
//!                                               (see [`lease`])
//! ```
//!
//! Remote retention and GC of the bucket: [`retention`]; one host per VM: [`lease`].

pub mod config;
pub mod keys;
pub mod lease;
pub mod pull;
pub mod queue;
pub mod retention;
pub mod s3;
pub mod tls;
pub mod upload;

pub use config::{Credentials, OffsiteConfig};
pub use keys::{HostSigningKey, TrustFile};
pub use queue::{Entry, EntryState, Queue};
pub use upload::{Uploader, VmStore};
