//! One guardian per VM, host-wide: a claim is an exclusive `flock` on
//! `<claims dir>/<key>` (the claims dir is [`HOST_CLAIMS_DIR`] on every daemon, whatever its
//! state dir), held for as long as the VM is guarded.
//!
//! The lock, not the file, is the claim: it belongs to the open file, so a second VM file of
//! the same daemon conflicts with the first exactly as a second daemon does, and it ends when
//! its holder ends, however it ends (a `kill -9` included). The file holds who claimed it
//! (daemon pid, state dir, VM name, host, since) so a refusal can name the first guardian, and
//! so a claim left by a holder that is gone (lock free, file written) is taken over knowingly:
//! the caller journals what it found. Nothing here ever deletes a claim file.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use nix::fcntl::{Flock, FlockArg};
use serde::{Deserialize, Serialize};

/// Where every daemon on the host keeps its claims.
pub const HOST_CLAIMS_DIR: &str = "/run/backstop/claims";

/// Who holds a claim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Guardian {
    /// The VM's name in the daemon that guards it.
    pub vm: String,
    /// That daemon's pid.
    pub pid: u32,
    /// Its state directory.
    pub state_dir: String,
    /// The host's name.
    pub host: String,
    /// When the claim was taken (RFC 3339).
    pub since: String,
}

impl Guardian {
    /// This process guarding `vm` with `state_dir`, from now.
    pub fn this_daemon(vm: &str, state_dir: &Path) -> Guardian {
        Guardian {
            vm: vm.to_string(),
            pid: std::process::id(),
            state_dir: state_dir.display().to_string(),
            host: host_name(),
            since: backstop_common::time::now_rfc3339(),
        }
    }

    /// `vm 'db1' of backstopd pid 812 (state dir /var/lib/backstop) on host h1 since T`.
    pub fn describe(&self) -> String {
        format!(
            "vm '{}' of backstopd pid {} (state dir {}) on host {} since {}",
            self.vm, self.pid, self.state_dir, self.host, self.since
        )
    }
}

/// The host's name (`/proc/sys/kernel/hostname`), or `unknown`.
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown".into())
}

/// A claim could not be taken; nothing was changed.
#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    /// Another guardian holds it now.
    #[error("{what} is guarded already by {}; nothing was changed", holder.as_ref().map_or_else(|| "another guardian (a VM that reads it as its base image, or a backstopd whose claim is being written)".to_string(), |g| g.describe()))]
    Held {
        what: String,
        holder: Option<Box<Guardian>>,
    },
    /// The key cannot name a file.
    #[error("claim key {0:?} is not a plain file name")]
    BadKey(String),
    #[error("claim {step} {}: {source}", path.display())]
    Io {
        step: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
}

/// A held claim: released when dropped (the lock ends with the file).
#[derive(Debug)]
pub struct Claim {
    /// Held for the claim's life: the lock ends with it.
    lock: Flock<File>,
    path: PathBuf,
    /// Held with [`Claim::share`]: the record in the file is not this holder's.
    shared: bool,
    /// A guardian whose claim was found with its lock free (it is gone): taken over.
    pub taken_over: Option<Guardian>,
}

impl Claim {
    /// Claims `key` (a domain's UUID, say) in `dir` for `me`; `what` names the VM in a refusal
    /// (`domain 1f0c…`).
    pub fn take(dir: &Path, key: &str, what: &str, me: &Guardian) -> Result<Claim, ClaimError> {
        let (mut lock, path) = Self::lock(dir, key, what, FlockArg::LockExclusiveNonblock)?;
        let io = |step: &'static str, path: &Path| {
            let path = path.to_path_buf();
            move |source| ClaimError::Io { step, path, source }
        };
        let taken_over = read_guardian(&mut lock);
        let record = serde_json::to_vec(me).map_err(|e| ClaimError::Io {
            step: "encode",
            path: path.clone(),
            source: e.into(),
        })?;
        (|| {
            lock.set_len(0)?;
            lock.rewind()?;
            lock.write_all(&record)?;
            lock.sync_all()
        })()
        .map_err(io("write", &path))?;
        Ok(Claim {
            lock,
            path,
            shared: false,
            taken_over,
        })
    }

    /// A shared claim: any number of guardians may hold `key` this way at once (a disk image
    /// several VMs read as their base), none while one holds it with [`Claim::take`], which
    /// is in turn refused while any shared holder lives. A shared claim writes no record (the
    /// file holds the exclusive holder's, or nothing).
    pub fn share(dir: &Path, key: &str, what: &str) -> Result<Claim, ClaimError> {
        let (lock, path) = Self::lock(dir, key, what, FlockArg::LockSharedNonblock)?;
        Ok(Claim {
            lock,
            path,
            shared: true,
            taken_over: None,
        })
    }

    fn lock(
        dir: &Path,
        key: &str,
        what: &str,
        how: FlockArg,
    ) -> Result<(Flock<File>, PathBuf), ClaimError> {
        let plain = !key.is_empty()
            && key
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
            && !key.starts_with('.');
        if !plain {
            return Err(ClaimError::BadKey(key.into()));
        }
        let io = |step: &'static str, path: &Path| {
            let path = path.to_path_buf();
            move |source| ClaimError::Io { step, path, source }
        };
        {
            use std::os::unix::fs::DirBuilderExt;
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(io("create dir", dir))?;
        }
        let path = dir.join(key);
        // Never truncated on open: a holder's record stays readable to whoever is refused.
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
            .map_err(io("open", &path))?;
        let lock = match Flock::lock(file, how) {
            Ok(l) => l,
            Err((mut file, nix::errno::Errno::EWOULDBLOCK)) => {
                return Err(ClaimError::Held {
                    what: what.into(),
                    holder: read_guardian(&mut file).map(Box::new),
                })
            }
            Err((_, e)) => {
                return Err(ClaimError::Io {
                    step: "lock",
                    path,
                    source: e.into(),
                })
            }
        };
        // The lock was free: whoever wrote the file (if anyone) no longer holds it.
        Ok((lock, path))
    }

    pub fn release(self) {
        if !self.shared {
            let _ = self.lock.set_len(0).and_then(|()| self.lock.sync_all());
        }
    }

    /// The claim file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// The guardian a claim file names, if it names one whole (bounded read: 4 KiB).
fn read_guardian(file: &mut File) -> Option<Guardian> {
    let mut buf = Vec::new();
    file.rewind().ok()?;
    file.take(4096).read_to_end(&mut buf).ok()?;
    serde_json::from_slice(&buf).ok()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // a test may panic on what it sets up itself
mod tests {
    use super::*;

    fn me(vm: &str) -> Guardian {
        Guardian::this_daemon(vm, Path::new("/var/lib/backstop"))
    }

    #[test]
    fn a_second_claim_is_refused_naming_the_first_until_it_is_released() {
        let d = tempfile::tempdir().unwrap();
        let first = Claim::take(d.path(), "uuid-1", "domain uuid-1", &me("db1")).unwrap();
        assert!(first.taken_over.is_none());
        // Same process, another open: refused (as a second VM file of one daemon is).
        let err = Claim::take(d.path(), "uuid-1", "domain uuid-1", &me("typo")).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.starts_with("domain uuid-1 is guarded already by vm 'db1' of backstopd pid"),
            "{msg}"
        );
        assert!(matches!(err, ClaimError::Held { holder: Some(ref g), .. } if g.vm == "db1"));
        // Another key is another VM.
        let other = Claim::take(d.path(), "uuid-2", "domain uuid-2", &me("web")).unwrap();
        drop(other);
        // Dropped (as by a crash): the next claim takes it over, knowing who held it.
        drop(first);
        let again = Claim::take(d.path(), "uuid-1", "domain uuid-1", &me("db1")).unwrap();
        assert_eq!(
            again.taken_over.as_ref().map(|g| g.vm.as_str()),
            Some("db1")
        );
        assert!(again.path().exists());
        // Released on purpose (a clean stop): nobody to take over from.
        again.release();
        let clean = Claim::take(d.path(), "uuid-1", "domain uuid-1", &me("db1")).unwrap();
        assert!(clean.taken_over.is_none());
    }

    #[test]
    fn shared_claims_coexist_and_exclude_an_exclusive_one_both_ways() {
        let d = tempfile::tempdir().unwrap();
        let a = Claim::share(d.path(), "disk-1", "disk image /i").unwrap();
        let b = Claim::share(d.path(), "disk-1", "disk image /i").unwrap();
        // A writer while readers hold it: refused, and the file is not written.
        let err = Claim::take(d.path(), "disk-1", "disk image /i", &me("w")).unwrap_err();
        assert!(
            matches!(err, ClaimError::Held { holder: None, .. }),
            "{err}"
        );
        assert!(
            err.to_string().contains("reads it as its base image"),
            "{err}"
        );
        assert_eq!(std::fs::read(d.path().join("disk-1")).unwrap(), b"");
        a.release();
        drop(b);
        // The readers gone: the writer takes it, and a reader is refused naming the writer.
        let w = Claim::take(d.path(), "disk-1", "disk image /i", &me("w")).unwrap();
        let err = Claim::share(d.path(), "disk-1", "disk image /i").unwrap_err();
        assert!(
            matches!(err, ClaimError::Held { holder: Some(ref g), .. } if g.vm == "w"),
            "{err}"
        );
        // A reader's release never empties the writer's record.
        drop(w);
        Claim::share(d.path(), "disk-1", "disk image /i")
            .unwrap()
            .release();
        let again = Claim::take(d.path(), "disk-1", "disk image /i", &me("w2")).unwrap();
        assert_eq!(again.taken_over.map(|g| g.vm), Some("w".into()));
    }

    #[test]
    fn a_claim_held_by_another_process_is_refused_and_freed_when_it_dies() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("uuid-3");
        std::fs::write(
            &path,
            serde_json::to_vec(&Guardian {
                vm: "other".into(),
                pid: 1,
                state_dir: "/srv/b".into(),
                host: "h".into(),
                since: "2026-01-01T00:00:00Z".into(),
            })
            .unwrap(),
        )
        .unwrap();
        // A second daemon holding the lock (flock(1) in its own process): it says when it has it.
        // (-F: flock execs the command itself, so killing it ends the lock's only holder.)
        let mut holder = std::process::Command::new("flock")
            .args(["-x", "-F"])
            .arg(&path)
            .args(["-c", "echo locked; exec sleep 30"])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(holder.stdout.take().unwrap()),
            &mut line,
        )
        .unwrap();
        assert_eq!(line.trim(), "locked");
        let err = Claim::take(d.path(), "uuid-3", "domain uuid-3", &me("db1")).unwrap_err();
        assert!(err.to_string().contains("vm 'other'"), "{err}");
        // The record is intact after a refusal.
        assert!(std::fs::read_to_string(&path)
            .unwrap()
            .contains("\"other\""));
        holder.kill().unwrap();
        holder.wait().unwrap();
        let c = Claim::take(d.path(), "uuid-3", "domain uuid-3", &me("db1")).unwrap();
        assert_eq!(c.taken_over.unwrap().vm, "other");
        assert!(std::fs::read_to_string(&path).unwrap().contains("\"db1\""));
    }

    #[test]
    fn keys_that_are_not_plain_names_are_refused_and_nothing_is_made() {
        let d = tempfile::tempdir().unwrap();
        for key in ["", "../x", "a/b", ".hidden"] {
            let err = Claim::take(d.path(), key, "x", &me("v")).unwrap_err();
            assert!(matches!(err, ClaimError::BadKey(_)), "{key}: {err}");
        }
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 0);
    }
}
