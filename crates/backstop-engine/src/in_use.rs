//! Which files a process on this host holds open: the last check before a disk layer is
//! deleted.
//!
//! A QEMU opens every layer of every disk chain it runs (the writable top and each backing
//! file), whichever daemon, VM file or person started it. Reading every process's open files
//! (`/proc/PID/fd`) right before the unlink therefore covers what no record can: a chain built
//! by a state that was reset, another daemon, a standby, or a QEMU started by hand. Where
//! `/proc` cannot be read, every candidate counts as held: nothing is deleted on a guess.

use std::collections::BTreeSet;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// The subset of `candidates` some process holds open (by file identity, so any path spelling
/// of the same file matches). Every candidate when the process table cannot be read.
pub fn held_open(candidates: &[PathBuf]) -> BTreeSet<PathBuf> {
    held_open_in(Path::new("/proc"), candidates)
}

fn held_open_in(proc_root: &Path, candidates: &[PathBuf]) -> BTreeSet<PathBuf> {
    let identity = |p: &Path| std::fs::metadata(p).ok().map(|m| (m.dev(), m.ino()));
    let wanted: Vec<(PathBuf, (u64, u64))> = candidates
        .iter()
        .filter_map(|p| identity(p).map(|id| (p.clone(), id)))
        .collect();
    if wanted.is_empty() {
        return BTreeSet::new();
    }
    let ids: BTreeSet<(u64, u64)> = wanted.iter().map(|(_, id)| *id).collect();
    let Ok(procs) = std::fs::read_dir(proc_root) else {
        tracing::warn!(
            "{} cannot be read: no layer is deleted",
            proc_root.display()
        );
        return candidates.iter().cloned().collect();
    };
    let mut open = BTreeSet::new();
    let mut seen_self = false;
    for p in procs.flatten() {
        let name = p.file_name();
        let Some(pid) = name
            .to_str()
            .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
        else {
            continue;
        };
        seen_self |= pid == std::process::id().to_string();
        // A process that ends meanwhile, or whose fds are closed to us, holds nothing we can
        // see; as root (the daemon's uid) every process's fds are readable.
        for fd in std::fs::read_dir(p.path().join("fd"))
            .into_iter()
            .flatten()
            .flatten()
        {
            if let Some(id) = identity(&fd.path()) {
                if ids.contains(&id) {
                    open.insert(id);
                }
            }
        }
    }
    if !seen_self {
        // Not a process table (or a namespaced one hiding us): a guess is not enough.
        tracing::warn!(
            "{} does not list this process: no layer is deleted",
            proc_root.display()
        );
        return candidates.iter().cloned().collect();
    }
    wanted
        .into_iter()
        .filter(|(_, id)| open.contains(id))
        .map(|(p, _)| p)
        .collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // a test may panic on what it sets up itself
mod tests {
    use super::*;

    #[test]
    fn a_file_held_open_by_another_process_is_held_and_a_closed_one_is_not() {
        let d = tempfile::tempdir().unwrap();
        let held = d.path().join("held.qcow2");
        let free = d.path().join("free.qcow2");
        std::fs::write(&held, b"x").unwrap();
        std::fs::write(&free, b"y").unwrap();
        // Another process (as a QEMU would be) keeps `held` open on its stdin.
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .stdin(std::fs::File::open(&held).unwrap())
            .spawn()
            .unwrap();
        // The same file through another spelling of its path.
        let link = d.path().join("link");
        std::os::unix::fs::symlink(d.path(), &link).unwrap();
        let via_link = link.join("held.qcow2");
        let found = held_open(&[held.clone(), free.clone(), via_link.clone()]);
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(found, [held.clone(), via_link].into_iter().collect());
        // Once the holder is gone nothing holds it.
        assert!(held_open(&[held, free]).is_empty());
    }

    #[test]
    fn an_unreadable_process_table_holds_everything() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("a.qcow2");
        std::fs::write(&f, b"x").unwrap();
        let missing = d.path().join("no-proc");
        assert_eq!(
            held_open_in(&missing, std::slice::from_ref(&f)),
            [f.clone()].into()
        );
        // A directory that is no process table (it does not list this process).
        std::fs::create_dir_all(d.path().join("fake/1/fd")).unwrap();
        assert_eq!(
            held_open_in(&d.path().join("fake"), std::slice::from_ref(&f)),
            [f].into()
        );
    }
}
