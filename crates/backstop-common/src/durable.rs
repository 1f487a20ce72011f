//! Files that must survive a crash: written to a temp name, fsynced, renamed into place, and the
//! directory fsynced, so a reader sees the old content or the new, never a torn one.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// fsyncs a directory, so the names created, renamed or removed in it are durable.
pub fn fsync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

/// The directory holding `path` (`.` for a bare name).
fn parent_of(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// Replaces `path` with `bytes` atomically and durably (mode 0600).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = parent_of(path);
    fs::create_dir_all(dir)?;
    let tmp = dir.join(format!(
        ".{}.tmp",
        path.file_name()
            .map(|n| n.to_string_lossy())
            .unwrap_or_default()
    ));
    {
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
    }
    fs::rename(&tmp, path)?;
    fsync_dir(dir)
}

/// Removes `path` durably; a file already gone is fine.
pub fn remove_durably(path: &Path) -> std::io::Result<()> {
    match fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    }
    fsync_dir(parent_of(path))
}

/// Renames `from` to `to` and fsyncs the directories of both.
pub fn rename_durably(from: &Path, to: &Path) -> std::io::Result<()> {
    fs::rename(from, to)?;
    fsync_dir(parent_of(to))?;
    if parent_of(from) != parent_of(to) {
        fsync_dir(parent_of(from))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn write_then_replace_then_remove() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("sub/rec.json");
        write_atomic(&p, b"one").unwrap();
        write_atomic(&p, b"two").unwrap();
        assert_eq!(fs::read(&p).unwrap(), b"two");
        assert_eq!(
            fs::read_dir(p.parent().unwrap()).unwrap().count(),
            1,
            "no temp file left"
        );
        rename_durably(&p, &d.path().join("moved.json")).unwrap();
        assert!(!p.exists());
        let m = d.path().join("moved.json");
        remove_durably(&m).unwrap();
        remove_durably(&m).unwrap();
        assert!(!m.exists());
    }
}
