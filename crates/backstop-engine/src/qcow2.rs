//! Empty qcow2 overlays written directly (a rollback's `overlays` phase, on its critical path).
//!
//! `qemu-img create -f qcow2 -b B -F F` took 15-40 ms per disk on the rollback's path, nearly all
//! of it starting the process. An empty overlay is four clusters of fixed content, written here
//! the way qemu-img 7.2 lays it out (qcow2 version 3, 64 KiB clusters, 16-bit refcounts):
//!
//! | cluster | offset    | content |
//! |---------|-----------|---------|
//! | 0       | 0x00000   | header (112 bytes), the backing format extension, the end of extensions, the backing file name |
//! | 1       | 0x10000   | refcount table: one entry, the refcount block at 0x20000 |
//! | 2       | 0x20000   | refcount block: clusters 0-3 referenced once |
//! | 3       | 0x30000   | L1 table, all zero (nothing allocated: every read goes to the backing file) |
//!
//! Anything outside what this covers (an L1 table longer than a cluster, i.e. a disk over
//! 4 TiB; a backing file name longer than fits, or relative — qemu-img resolves those against
//! the overlay's directory; a backing format other than qcow2 or raw, whose size this does not
//! read) goes to `qemu-img create`. The unit tests compare the file byte for byte with `qemu-img
//! create`'s own (but for where the backing name sits), check it with `qemu-img check`, read and
//! write through it with `qemu-io`; every end-to-end rollback and capture uses it.

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

const CLUSTER: u64 = 1 << 16;
const HEADER_LEN: usize = 112;
/// Offsets of the refcount table, the refcount block and the L1 table.
const REFTABLE: u64 = CLUSTER;
const REFBLOCK: u64 = 2 * CLUSTER;
const L1: u64 = 3 * CLUSTER;
/// Guest bytes one L1 entry maps (an L2 table of 8192 entries of 64 KiB clusters).
const L1_ENTRY_SPAN: u64 = CLUSTER * (CLUSTER / 8);
const BACKING_FORMAT_EXT: u32 = 0xe279_2aca;

/// The bytes of cluster 0 of an empty overlay over `backing` (format `backing_fmt`) of
/// `size` bytes, and the file's length (up to the end of its L1 table); `None` where this writer
/// does not apply (see the module doc).
pub(crate) fn overlay_header(
    size: u64,
    backing: &[u8],
    backing_fmt: &str,
) -> Option<(Vec<u8>, u64)> {
    // QEMU sizes block devices in 512-byte sectors: qemu-img rounds a size up to one.
    let size = size.checked_next_multiple_of(512)?;
    let l1_size = size.div_ceil(L1_ENTRY_SPAN);
    if l1_size * 8 > CLUSTER || backing.is_empty() || backing_fmt.is_empty() {
        return None;
    }
    let mut h = Vec::with_capacity(1024);
    let be32 = |h: &mut Vec<u8>, v: u32| h.extend_from_slice(&v.to_be_bytes());
    let be64 = |h: &mut Vec<u8>, v: u64| h.extend_from_slice(&v.to_be_bytes());
    // Extensions first, to know where the backing file name goes.
    let mut ext = Vec::new();
    be32(&mut ext, BACKING_FORMAT_EXT);
    be32(&mut ext, backing_fmt.len() as u32);
    ext.extend_from_slice(backing_fmt.as_bytes());
    ext.resize(ext.len().next_multiple_of(8), 0);
    ext.extend_from_slice(&[0u8; 8]); // end of extensions
    let backing_offset = (HEADER_LEN + ext.len()) as u64;
    if backing_offset as usize + backing.len() > 1023 {
        // qcow2 keeps the name within the first cluster; QEMU caps it at 1023 bytes.
        return None;
    }
    h.extend_from_slice(b"QFI\xfb");
    be32(&mut h, 3); // version
    be64(&mut h, backing_offset);
    be32(&mut h, backing.len() as u32);
    be32(&mut h, 16); // cluster_bits
    be64(&mut h, size);
    be32(&mut h, 0); // crypt_method
    be32(&mut h, l1_size as u32);
    be64(&mut h, L1);
    be64(&mut h, REFTABLE);
    be32(&mut h, 1); // refcount_table_clusters
    be32(&mut h, 0); // nb_snapshots
    be64(&mut h, 0); // snapshots_offset
    be64(&mut h, 0); // incompatible_features
    be64(&mut h, 0); // compatible_features
    be64(&mut h, 0); // autoclear_features
    be32(&mut h, 4); // refcount_order: 16-bit refcounts
    be32(&mut h, HEADER_LEN as u32);
    h.push(0); // compression_type: zlib
    h.resize(HEADER_LEN, 0);
    h.extend_from_slice(&ext);
    h.extend_from_slice(backing);
    // The L1 table is zeros: the file's length covers it (a hole).
    Some((h, L1 + l1_size.max(1) * 8))
}

/// The virtual size of `backing` as format `fmt` sees it, for the formats this reads: qcow2
/// (its header's size field) and raw (the file's length). `None` otherwise.
pub(crate) fn backing_size(backing: &Path, fmt: &str) -> Option<u64> {
    if !backing.is_absolute() {
        return None;
    }
    let mut f = File::open(backing).ok()?;
    match fmt {
        "raw" => f.metadata().ok().map(|m| m.len()),
        "qcow2" => {
            let mut h = [0u8; 32];
            f.read_exact(&mut h).ok()?;
            (h[..4] == *b"QFI\xfb")
                .then(|| u64::from_be_bytes(h[24..32].try_into().unwrap_or([0; 8])))
        }
        _ => None,
    }
}

/// Writes an empty overlay at `path` (which must not exist) over `backing`; `Ok(false)` where
/// this writer does not apply and `qemu-img` should make it. A failure removes what it wrote.
pub(crate) fn create_overlay(
    path: &Path,
    backing: &Path,
    backing_fmt: &str,
    size: u64,
) -> std::io::Result<bool> {
    use std::os::unix::ffi::OsStrExt;
    if !backing.is_absolute() {
        return Ok(false);
    }
    let Some((header, len)) = overlay_header(size, backing.as_os_str().as_bytes(), backing_fmt)
    else {
        return Ok(false);
    };
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .open(path)?;
    let written = (|| {
        file.write_all_at(&header, 0)?;
        file.write_all_at(&REFBLOCK.to_be_bytes(), REFTABLE)?;
        file.write_all_at(&[0, 1, 0, 1, 0, 1, 0, 1], REFBLOCK)?;
        file.set_len(len)
    })();
    if let Err(e) = written {
        drop(file);
        let _ = std::fs::remove_file(path);
        return Err(e);
    }
    Ok(true)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // a test may panic on what it sets up itself
mod tests {
    use std::process::Command;

    use super::*;

    fn have(tool: &str) -> bool {
        let ok = Command::new(tool)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success());
        if !ok {
            eprintln!("SKIP: {tool} not installed (apt-get install qemu-utils)");
        }
        ok
    }

    fn run(tool: &str, args: &[&str]) -> String {
        let out = Command::new(tool).args(args).output().unwrap();
        assert!(
            out.status.success(),
            "{tool} {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The header's fields, read back by offset as the qcow2 spec places them.
    #[test]
    fn the_header_fields_are_qcow2_v3_with_the_backing_file_and_format() {
        let (h, len) = overlay_header(1 << 30, b"/tmp/b.qcow2", "qcow2").unwrap();
        assert_eq!(len, L1 + 16);
        let be32 = |o: usize| u32::from_be_bytes(h[o..o + 4].try_into().unwrap());
        let be64 = |o: usize| u64::from_be_bytes(h[o..o + 8].try_into().unwrap());
        assert_eq!(&h[..4], b"QFI\xfb");
        assert_eq!(be32(4), 3);
        let (off, len) = (be64(8) as usize, be32(16) as usize);
        assert_eq!(&h[off..off + len], b"/tmp/b.qcow2");
        assert_eq!((be32(20), be64(24)), (16, 1 << 30));
        assert_eq!(
            (be32(36), be64(40), be64(48), be32(56)),
            (2, L1, REFTABLE, 1)
        );
        assert_eq!((be32(96), be32(100)), (4, 112));
        assert_eq!((be32(112), be32(116)), (BACKING_FORMAT_EXT, 5));
        assert_eq!(&h[120..128], b"qcow2\0\0\0");
        assert_eq!(&h[128..136], &[0u8; 8]);
        // Past 4 TiB the L1 table needs a second cluster: left to qemu-img.
        assert!(overlay_header(4 << 40, b"/b", "qcow2").is_some());
        assert!(overlay_header((4 << 40) + 1, b"/b", "qcow2").is_none());
        assert!(overlay_header(1 << 30, &[b'x'; 1000], "qcow2").is_none());
    }

    /// The file is laid out as `qemu-img create -f qcow2 -u -F qcow2 -b B O SIZE` lays it out:
    /// the same 112-byte header but for where the backing name sits (qemu-img adds an optional
    /// feature-name table before it), the same backing format extension, refcount table,
    /// refcount block and L1 table, and the same length.
    #[test]
    fn the_layout_is_qemu_imgs_own() {
        if !have("qemu-img") {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().join("base.qcow2");
        for size in [1u64 << 30, 3 << 30, (5 << 30) + 12345] {
            let (ours, theirs) = (dir.path().join("ours"), dir.path().join("theirs"));
            let _ = std::fs::remove_file(&ours);
            let _ = std::fs::remove_file(&theirs);
            let size_arg = size.to_string();
            run(
                "qemu-img",
                &[
                    "create",
                    "-q",
                    "-f",
                    "qcow2",
                    "-u",
                    "-F",
                    "qcow2",
                    "-b",
                    base.to_str().unwrap(),
                    theirs.to_str().unwrap(),
                    &size_arg,
                ],
            );
            assert!(create_overlay(&ours, &base, "qcow2", size).unwrap());
            let (a, b) = (
                std::fs::read(&ours).unwrap(),
                std::fs::read(&theirs).unwrap(),
            );
            assert_eq!(a.len(), b.len(), "size {size}");
            // The header, but for backing_file_offset (bytes 8..16).
            assert_eq!(a[..8], b[..8]);
            assert_eq!(a[16..HEADER_LEN], b[16..HEADER_LEN], "size {size}");
            // The backing format extension comes first in both.
            assert_eq!(
                a[HEADER_LEN..HEADER_LEN + 16],
                b[HEADER_LEN..HEADER_LEN + 16]
            );
            // Both name the same backing file, each where its header says.
            let name = |h: &[u8]| {
                let off = u64::from_be_bytes(h[8..16].try_into().unwrap()) as usize;
                let len = u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize;
                h[off..off + len].to_vec()
            };
            assert_eq!(name(&a), name(&b));
            // Clusters 1 to 3 (refcount table, refcount block, L1 table) are identical.
            let tail = CLUSTER as usize;
            assert_eq!(a[tail..], b[tail..], "size {size}");
        }
    }

    /// The overlays QEMU's own tools accept: `qemu-img check` finds no error or leak, `info`
    /// shows the backing file, its format and its size; reads through the overlay see the
    /// backing file's bytes and writes land in the overlay alone, after which `check` still
    /// passes. For a qcow2 and a raw backing file.
    #[test]
    fn qemu_img_and_qemu_io_accept_the_overlays() {
        if !have("qemu-img") || !have("qemu-io") {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        for fmt in ["qcow2", "raw"] {
            let base = dir.path().join(format!("base.{fmt}"));
            let base_s = base.to_str().unwrap();
            run("qemu-img", &["create", "-q", "-f", fmt, base_s, "3G"]);
            run(
                "qemu-io",
                &["-f", fmt, "-c", "write -P 0xab 1M 64k", base_s],
            );
            let size = backing_size(&base, fmt).unwrap();
            assert_eq!(size, 3 << 30);
            let top = dir.path().join(format!("top-{fmt}.qcow2"));
            assert!(create_overlay(&top, &base, fmt, size).unwrap());
            let top_s = top.to_str().unwrap();
            run("qemu-img", &["check", "-q", top_s]);
            let info: serde_json::Value =
                serde_json::from_str(&run("qemu-img", &["info", "--output=json", top_s])).unwrap();
            assert_eq!(info["format"], "qcow2");
            assert_eq!(info["virtual-size"], 3u64 << 30);
            assert_eq!(info["backing-filename"], base_s);
            assert_eq!(info["backing-filename-format"], fmt);
            run(
                "qemu-io",
                &["-f", "qcow2", "-c", "read -P 0xab 1M 64k", top_s],
            );
            run(
                "qemu-io",
                &["-f", "qcow2", "-c", "write -P 0xcd 2M 128k", top_s],
            );
            run(
                "qemu-io",
                &["-f", "qcow2", "-c", "read -P 0xcd 2M 128k", top_s],
            );
            run("qemu-io", &["-f", fmt, "-c", "read -P 0 2M 128k", base_s]);
            run("qemu-img", &["check", "-q", top_s]);
            // It never replaces a file.
            assert_eq!(
                create_overlay(&top, &base, fmt, size).unwrap_err().kind(),
                std::io::ErrorKind::AlreadyExists
            );
        }
        assert_eq!(backing_size(&dir.path().join("base.qcow2"), "vmdk"), None);
        assert_eq!(backing_size(&dir.path().join("absent"), "raw"), None);
        assert_eq!(backing_size(Path::new("base.qcow2"), "qcow2"), None);
        let rel = dir.path().join("rel.qcow2");
        assert!(!create_overlay(&rel, Path::new("base.qcow2"), "qcow2", 1 << 30).unwrap());
        assert!(!rel.exists());
    }
}
