//! Snapshots on disk: capture (full or diff) into a directory, verify a chain, restore a VM from
//! it with guest memory mapped copy-on-write.
//!
//! A snapshot directory holds three files, all made read-only (0400) before it is published
//! (built as `<dir>.partial`, fsynced, renamed into place, parent fsynced):
//!
//! - `state.bin`: the signed state file ([`crate::format`]): a `meta` section (canonical JSON:
//!   kind, sequence number, parent's state digest, VM shape, memory layout, and the memory file's
//!   length, mtime and SHA-256), then vCPU, VM and device sections;
//! - `state.sig`: HMAC-SHA256 (hex) of `state.bin` with the host key;
//! - `memory.img` (full: the memory image itself, sparse where pages are zero) or `memory.diff`
//!   (diff: a 64-byte header, the sorted list of image pages, then those pages, page aligned).
//!
//! A diff holds exactly the pages dirtied since its parent (KVM's dirty log plus the VMM's own
//! writes). A chain is one full snapshot followed by diffs, each naming its parent's state
//! digest; restore maps the full image and then maps each diff's page runs over it, so restore
//! time grows with the number of runs, never with guest memory size.

use backstop_common::ErrorCode;
use std::fs::{self, File, OpenOptions};
use std::io::{BufWriter, Read, Write};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use backstop_integrity::HostKey;
use kvm_ioctls::VcpuFd;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use zerocopy::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

use crate::devices::{DeviceState, Devices};
use crate::format::{
    decode_exact, StateFileError, StateFileWriter, VerifiedStateFile, STATE_FILE_MAX_BYTES,
};
use crate::memory::{self, GuestMem, MemoryError, MemoryLayout, PageBitmap, PAGE_SIZE};
use crate::state::{tag, IoctlError, VcpuCaps, VcpuState, VmState};
use crate::vm::{KvmVm, KvmVmConfig, Lineage, VmError, VmShell, MAX_VCPUS};

pub const STATE_FILE: &str = "state.bin";
pub const SIGNATURE_FILE: &str = "state.sig";
pub const FULL_MEMORY_FILE: &str = "memory.img";
pub const DIFF_MEMORY_FILE: &str = "memory.diff";
/// First eight bytes of a diff memory file.
pub const DIFF_MAGIC: [u8; 8] = *b"BSTPKVMD";
const DIFF_MAJOR: u16 = 1;
const DIFF_HEADER_LEN: u64 = 64;
/// Guest memory is copied out in pieces of this size (small enough to stay in cache while it is
/// hashed, checked for zero pages and written).
const CAPTURE_CHUNK: usize = 256 << 10;
/// Above this many page runs a diff is copied into memory instead of mapped (each mapped run is
/// one VMA; the kernel's default limit is 65530 per process).
pub const DEFAULT_MAX_OVERLAY_RUNS: usize = 8192;

/// Full image or pages dirtied since the parent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SnapshotKind {
    Full,
    Diff,
}

/// The memory file a state file vouches for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemoryFileRef {
    pub file: String,
    pub len: u64,
    pub mtime_sec: i64,
    pub mtime_nsec: i64,
    pub sha256: String,
    /// Pages stored (a full image stores every page, a diff its dirty pages).
    pub pages: u64,
}

/// The `meta` section.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotMeta {
    pub kind: SnapshotKind,
    /// 0 for a full snapshot, parent's + 1 for a diff.
    pub seq: u64,
    pub parent_state_sha256: Option<String>,
    pub config: KvmVmConfig,
    pub layout: MemoryLayout,
    pub memory: MemoryFileRef,
    pub created_unix_ms: u64,
}

#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
struct DiffHeader {
    magic: [u8; 8],
    major: U16,
    minor: U16,
    page_size: U32,
    page_count: U64,
    image_pages: U64,
    index_offset: U64,
    data_offset: U64,
    reserved: [u8; 16],
}

#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    #[error("snapshot directory {0} already exists")]
    Exists(PathBuf),
    #[error("a diff needs a parent: capture a full snapshot (or restore one) first")]
    NoParent,
    #[error("pause: {0}")]
    Pause(VmError),
    #[error("vCPU/VM state: {0}")]
    State(#[from] IoctlError),
    #[error("dirty log: {0}")]
    DirtyLog(VmError),
    #[error("guest memory: {0}")]
    Memory(#[from] MemoryError),
    #[error("{step} {path}: {source}")]
    Io {
        step: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
}

impl CaptureError {
    pub fn code(&self) -> ErrorCode {
        ErrorCode::SnapshotCaptureFailed
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    /// The snapshot directory itself is not there.
    #[error("no snapshot at {dir}")]
    Absent { dir: PathBuf },
    #[error("{path}: {source}")]
    StateFile {
        path: PathBuf,
        source: StateFileError,
    },
    #[error("{step} {path}: {source}")]
    Io {
        step: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("snapshot chain: {0}")]
    Chain(String),
    #[error("memory file {path}: {detail}")]
    MemoryFile { path: PathBuf, detail: String },
    #[error("memory layout: {0}")]
    Layout(MemoryError),
    #[error("building the VM: {0}")]
    Vm(#[from] VmError),
}

impl RestoreError {
    pub fn code(&self) -> ErrorCode {
        match self {
            RestoreError::StateFile { source, .. } => source.code(),
            // MISSING_SNAPSHOT is for a snapshot that is absent; a file missing from one that
            // is present (`Io` with NotFound) means it is not whole, so it cannot be trusted.
            RestoreError::Absent { .. } => ErrorCode::MissingSnapshot,
            RestoreError::Io { .. } | RestoreError::MemoryFile { .. } => {
                ErrorCode::SnapshotIntegrityCheckFailed
            }
            RestoreError::Chain(_) | RestoreError::Layout(_) => ErrorCode::SnapshotManifestInvalid,
            RestoreError::Vm(_) => ErrorCode::KvmRestoreFailed,
        }
    }
}

impl From<IoctlError> for RestoreError {
    fn from(e: IoctlError) -> Self {
        RestoreError::Vm(VmError::Ioctl(e))
    }
}

impl From<MemoryError> for RestoreError {
    fn from(e: MemoryError) -> Self {
        RestoreError::Vm(VmError::Memory(e))
    }
}

/// Figures of one capture.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CaptureSummary {
    pub dir: PathBuf,
    pub kind: SnapshotKind,
    pub seq: u64,
    pub state_sha256: String,
    /// How long the guest did not run for this capture.
    pub pause_us: u64,
    /// The whole capture, publication included.
    pub total_us: u64,
    /// Of the pause: reading vCPU/VM/device state.
    pub state_us: u64,
    /// Of the pause: copying guest memory out (hashed, zero pages skipped) into the file.
    pub memory_us: u64,
    /// After the guest resumed: fsync, sealing, writing the signed state file, renaming.
    pub sync_us: u64,
    /// Pages dirtied since the parent (what a diff stores).
    pub dirty_pages: u64,
    /// Pages written to the memory file (full: non-zero pages; diff: dirty pages).
    pub pages_written: u64,
    /// Bytes of guest memory covered by the memory file.
    pub memory_bytes: u64,
    /// Size of the memory file (sparse for a full image) and of the state file.
    pub memory_file_len: u64,
    pub state_file_len: u64,
}

/// How a restore checks that memory files are what the signed state file says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemoryCheck {
    /// Read-only mode, length and mtime as recorded (constant time: instant restore).
    Metadata,
    /// As `Metadata` but length and read-only mode only, plus the SHA-256 of every byte
    /// (reads the whole file: for files copied or received from elsewhere).
    Full,
}

/// Restore settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RestoreOptions {
    pub memory_check: MemoryCheck,
    pub max_overlay_runs: usize,
}

impl Default for RestoreOptions {
    fn default() -> Self {
        Self {
            memory_check: MemoryCheck::Metadata,
            max_overlay_runs: DEFAULT_MAX_OVERLAY_RUNS,
        }
    }
}

/// Figures of one restore (the VM is left paused).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RestoreSummary {
    /// Verifying every state file and checking every memory file.
    pub verify_us: u64,
    /// Mapping guest memory (image + diff overlays).
    pub map_us: u64,
    /// Creating the VM and loading vCPU/VM/device state.
    pub vm_us: u64,
    pub total_us: u64,
    pub chain_len: usize,
    pub overlay_runs: u64,
    /// Diff pages copied instead of mapped (a diff with too many runs).
    pub copied_pages: u64,
    pub memory_bytes: u64,
}

fn io_err<'a>(
    step: &'static str,
    path: &'a Path,
) -> impl FnOnce(std::io::Error) -> CaptureError + 'a {
    move |source| CaptureError::Io {
        step,
        path: path.to_path_buf(),
        source,
    }
}

fn rio_err<'a>(
    step: &'static str,
    path: &'a Path,
) -> impl FnOnce(std::io::Error) -> RestoreError + 'a {
    move |source| RestoreError::Io {
        step,
        path: path.to_path_buf(),
        source,
    }
}

fn micros(since: Instant) -> u64 {
    since.elapsed().as_micros() as u64
}

fn create_new(path: &Path) -> Result<File, CaptureError> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(io_err("create", path))
}

fn fsync_dir(path: &Path) -> std::io::Result<()> {
    backstop_common::durable::fsync_dir(path)
}

/// Makes a finished file durable and read-only; returns (len, mtime sec, mtime nsec).
fn seal(file: &File, path: &Path) -> Result<(u64, i64, i64), CaptureError> {
    file.sync_all().map_err(io_err("fsync", path))?;
    file.set_permissions(fs::Permissions::from_mode(0o400))
        .map_err(io_err("chmod 0400", path))?;
    let m = file.metadata().map_err(io_err("stat", path))?;
    Ok((m.len(), m.mtime(), m.mtime_nsec()))
}

fn is_zero_page(page: &[u8]) -> bool {
    page.chunks_exact(8).fold(0u64, |acc, c| {
        acc | u64::from_ne_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]])
    }) == 0
}

/// Writes the whole memory image (zero pages as holes); returns the pages written.
fn write_full_image(
    mem: &GuestMem,
    layout: &MemoryLayout,
    file: &File,
    path: &Path,
) -> Result<u64, CaptureError> {
    file.set_len(layout.total_bytes())
        .map_err(io_err("size", path))?;
    let mut buf = vec![0u8; CAPTURE_CHUNK];
    let mut written = 0u64;
    for spec in &layout.regions {
        let mut off = 0u64;
        while off < spec.size {
            let n = (spec.size - off).min(CAPTURE_CHUNK as u64) as usize;
            let image_off = spec.image_offset + off;
            let chunk = &mut buf[..n];
            memory::read_image(mem, layout, image_off, chunk)?;
            let mut run_start: Option<usize> = None;
            for (i, page) in chunk.chunks(PAGE_SIZE).enumerate() {
                let zero = is_zero_page(page);
                match (run_start, zero) {
                    (None, false) => run_start = Some(i),
                    (Some(s), true) => {
                        write_run(file, path, chunk, s, i, image_off)?;
                        written += (i - s) as u64;
                        run_start = None;
                    }
                    _ => {}
                }
            }
            if let Some(s) = run_start {
                let end = n.div_ceil(PAGE_SIZE);
                write_run(file, path, chunk, s, end, image_off)?;
                written += (end - s) as u64;
            }
            off += n as u64;
        }
    }
    Ok(written)
}

/// SHA-256 (hex) of a whole file, read sequentially.
fn hash_file(file: &File) -> std::io::Result<String> {
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut offset = 0u64;
    loop {
        let n = file.read_at(&mut buf, offset)?;
        if n == 0 {
            return Ok(hex::encode(hasher.finalize()));
        }
        hasher.update(&buf[..n]);
        offset += n as u64;
    }
}

fn write_run(
    file: &File,
    path: &Path,
    chunk: &[u8],
    first: usize,
    end: usize,
    image_off: u64,
) -> Result<(), CaptureError> {
    let bytes = &chunk[first * PAGE_SIZE..(end * PAGE_SIZE).min(chunk.len())];
    file.write_all_at(bytes, image_off + (first * PAGE_SIZE) as u64)
        .map_err(io_err("write", path))
}

fn diff_data_offset(page_count: u64) -> u64 {
    (DIFF_HEADER_LEN + page_count * 8).next_multiple_of(PAGE_SIZE as u64)
}

/// Writes a diff memory file holding `pages`.
fn write_diff(
    mem: &GuestMem,
    layout: &MemoryLayout,
    pages: &[u64],
    file: &File,
    path: &Path,
) -> Result<(), CaptureError> {
    let count = pages.len() as u64;
    let data_offset = diff_data_offset(count);
    let header = DiffHeader {
        magic: DIFF_MAGIC,
        major: U16::new(DIFF_MAJOR),
        minor: U16::new(0),
        page_size: U32::new(PAGE_SIZE as u32),
        page_count: U64::new(count),
        image_pages: U64::new(layout.total_pages()),
        index_offset: U64::new(DIFF_HEADER_LEN),
        data_offset: U64::new(data_offset),
        reserved: [0; 16],
    };
    let mut w = BufWriter::with_capacity(1 << 20, file);
    let result = (|| -> Result<(), CaptureError> {
        let werr = |e| CaptureError::Io {
            step: "write",
            path: path.to_path_buf(),
            source: e,
        };
        w.write_all(header.as_bytes()).map_err(werr)?;
        for &p in pages {
            w.write_all(&p.to_le_bytes()).map_err(werr)?;
        }
        let pad = data_offset - DIFF_HEADER_LEN - count * 8;
        w.write_all(&vec![0u8; pad as usize]).map_err(werr)?;
        let mut page = vec![0u8; PAGE_SIZE];
        for &p in pages {
            memory::read_image(mem, layout, p * PAGE_SIZE as u64, &mut page)?;
            w.write_all(&page).map_err(werr)?;
        }
        w.flush().map_err(werr)
    })();
    result
}

/// A diff memory file's index, checked against the image it applies to.
#[derive(Debug)]
struct DiffIndex {
    pages: Vec<u64>,
    data_offset: u64,
}

fn read_diff_index(file: &File, len: u64, image_pages: u64) -> Result<DiffIndex, String> {
    let mut raw = [0u8; DIFF_HEADER_LEN as usize];
    file.read_exact_at(&mut raw, 0)
        .map_err(|e| format!("header: {e}"))?;
    let h: DiffHeader = decode_exact(&raw, "diff header").map_err(|e| e.to_string())?;
    let count = h.page_count.get();
    if h.magic != DIFF_MAGIC
        || h.major.get() != DIFF_MAJOR
        || h.page_size.get() as usize != PAGE_SIZE
        || h.image_pages.get() != image_pages
        || count > image_pages
        || h.index_offset.get() != DIFF_HEADER_LEN
        || h.data_offset.get() != diff_data_offset(count)
        || count
            .checked_mul(PAGE_SIZE as u64)
            .and_then(|d| d.checked_add(h.data_offset.get()))
            != Some(len)
    {
        return Err("diff header does not describe this file".into());
    }
    let mut index = vec![0u8; (count * 8) as usize];
    file.read_exact_at(&mut index, DIFF_HEADER_LEN)
        .map_err(|e| format!("index: {e}"))?;
    let pages: Vec<u64> = index
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
        .collect();
    if pages.windows(2).any(|w| w[0] >= w[1]) || pages.last().is_some_and(|&p| p >= image_pages) {
        return Err("diff index is not strictly increasing inside the image".into());
    }
    Ok(DiffIndex {
        pages,
        data_offset: h.data_offset.get(),
    })
}

/// The VM-shape digest stored with snapshots and compared before a restore.
pub fn config_fingerprint(config: &KvmVmConfig) -> String {
    let shape = serde_json::json!({
        "backend": "kvm",
        "format_major": crate::format::FORMAT_MAJOR,
        "mem_size_mib": config.mem_size_mib,
        "vcpus": config.vcpus,
        "irqchip": config.irqchip,
    });
    let bytes = backstop_integrity::canonical::to_vec(&shape).unwrap_or_default();
    hex::encode(Sha256::digest(bytes))
}

fn now_unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Resumes the VM on drop if it was running when the capture began.
struct ResumeOnDrop<'a> {
    vm: &'a mut KvmVm,
    resume: bool,
}

impl Drop for ResumeOnDrop<'_> {
    fn drop(&mut self) {
        if self.resume {
            self.vm.resume();
        }
    }
}

impl KvmVm {
    /// Captures a snapshot into `dir` (which must not exist). The guest is paused for the whole
    /// capture and resumed afterwards if it was running. A diff stores the pages dirtied since
    /// this VM's last snapshot (captured or restored); dirty tracking restarts at this capture.
    pub fn capture(
        &mut self,
        dir: &Path,
        kind: SnapshotKind,
        key: &HostKey,
    ) -> Result<CaptureSummary, CaptureError> {
        self.capture_with_hook(dir, kind, key, |_| {})
    }

    /// [`capture`](Self::capture) with a hook run right after dirty tracking was reset and
    /// before memory is copied: tests use it to dirty pages "during" a capture.
    #[doc(hidden)]
    pub fn capture_with_hook(
        &mut self,
        dir: &Path,
        kind: SnapshotKind,
        key: &HostKey,
        after_dirty_reset: impl FnOnce(&mut KvmVm),
    ) -> Result<CaptureSummary, CaptureError> {
        if dir.exists() {
            return Err(CaptureError::Exists(dir.to_path_buf()));
        }
        let parent = match kind {
            SnapshotKind::Full => None,
            SnapshotKind::Diff => Some(self.lineage.clone().ok_or(CaptureError::NoParent)?),
        };
        let start = Instant::now();
        let was_running = !self.paused;
        self.pause().map_err(CaptureError::Pause)?;
        let guard = ResumeOnDrop {
            vm: self,
            resume: was_running,
        };
        let vm = &mut *guard.vm;

        // Phase 1, guest paused: state, dirty set, memory copied out into the partial directory.
        let state_start = Instant::now();
        let vcpu_states = vm
            .vcpus
            .iter()
            .map(|v| VcpuState::capture(&v.fd(), &vm.caps))
            .collect::<Result<Vec<_>, _>>()?;
        let vm_state = VmState::capture(&vm.vm, vm.irqchip)?;
        let devices = vm.device_state();
        let state_us = micros(state_start);

        let dirty = vm.take_dirty().map_err(CaptureError::DirtyLog)?;
        after_dirty_reset(vm);
        if let Err(e) = vm.pause() {
            vm.return_dirty(&dirty);
            return Err(CaptureError::Pause(e));
        }
        let memory_start = Instant::now();
        let prepared = vm.prepare_snapshot(
            dir,
            kind,
            parent.as_ref(),
            &dirty,
            &vcpu_states,
            &vm_state,
            &devices,
        );
        let memory_us = micros(memory_start);
        drop(guard);
        let pause_us = micros(start);

        // Phase 2, guest running again: the copy is complete, so its writes cannot reach it.
        let sync_start = Instant::now();
        let published = prepared.and_then(|p| p.publish(dir, key));
        let mut summary = match published {
            Ok(s) => s,
            Err(e) => {
                self.return_dirty(&dirty);
                remove_partial(&partial_dir(dir));
                return Err(e);
            }
        };
        self.lineage = Some(Lineage {
            seq: summary.seq,
            state_sha256: summary.state_sha256.clone(),
        });
        summary.sync_us = micros(sync_start);
        summary.memory_us = memory_us;
        summary.state_us = state_us;
        summary.pause_us = pause_us;
        summary.total_us = micros(start);
        summary.dirty_pages = dirty.count();
        tracing::info!(
            dir = %dir.display(),
            kind = ?summary.kind,
            seq = summary.seq,
            pause_us = summary.pause_us,
            total_us = summary.total_us,
            pages_written = summary.pages_written,
            memory_file_len = summary.memory_file_len,
            "kvm snapshot captured"
        );
        Ok(summary)
    }

    /// Writes the memory file (not yet durable) and builds the state file, guest paused.
    #[allow(clippy::too_many_arguments)]
    fn prepare_snapshot(
        &self,
        dir: &Path,
        kind: SnapshotKind,
        parent: Option<&Lineage>,
        dirty: &PageBitmap,
        vcpu_states: &[VcpuState],
        vm_state: &VmState,
        devices: &DeviceState,
    ) -> Result<PreparedSnapshot, CaptureError> {
        let tmp = partial_dir(dir);
        remove_partial(&tmp);
        fs::create_dir_all(&tmp).map_err(io_err("mkdir", &tmp))?;
        let (mem_name, mem_path, pages_written, mem_file) = match kind {
            SnapshotKind::Full => {
                let path = tmp.join(FULL_MEMORY_FILE);
                let file = create_new(&path)?;
                let written = write_full_image(&self.memory, &self.layout, &file, &path)?;
                (FULL_MEMORY_FILE, path, written, file)
            }
            SnapshotKind::Diff => {
                let path = tmp.join(DIFF_MEMORY_FILE);
                let file = create_new(&path)?;
                let pages: Vec<u64> = dirty.iter().collect();
                write_diff(&self.memory, &self.layout, &pages, &file, &path)?;
                (DIFF_MEMORY_FILE, path, pages.len() as u64, file)
            }
        };
        // mtime is final once the last byte is written (fsync and chmod leave it alone).
        let m = mem_file.metadata().map_err(io_err("stat", &mem_path))?;
        let meta = SnapshotMeta {
            kind,
            seq: parent.map_or(0, |p| p.seq + 1),
            parent_state_sha256: parent.map(|p| p.state_sha256.clone()),
            config: self.config.clone(),
            layout: self.layout.clone(),
            memory: MemoryFileRef {
                file: mem_name.to_string(),
                len: m.len(),
                mtime_sec: m.mtime(),
                mtime_nsec: m.mtime_nsec(),
                sha256: String::new(),
                pages: pages_written,
            },
            created_unix_ms: now_unix_ms(),
        };
        let mut sections = StateFileWriter::new();
        sections.push(tag::DEVICES, 0, devices.as_bytes().to_vec());
        vm_state.write_sections(&mut sections);
        for (index, state) in vcpu_states.iter().enumerate() {
            state.write_sections(index as u32, &mut sections);
        }
        Ok(PreparedSnapshot {
            tmp,
            mem_file,
            mem_path,
            sections,
            meta,
            memory_bytes: self.layout.total_bytes(),
        })
    }
}

/// A snapshot whose bytes are complete but not yet durable or published.
struct PreparedSnapshot {
    tmp: PathBuf,
    mem_file: File,
    mem_path: PathBuf,
    /// Every section but `meta`, which needs the memory file's digest.
    sections: StateFileWriter,
    meta: SnapshotMeta,
    memory_bytes: u64,
}

impl PreparedSnapshot {
    /// Hash, fsync and seal the memory file, write and seal the state file and its signature,
    /// fsync, rename the directory into place, fsync the parent.
    fn publish(mut self, dir: &Path, key: &HostKey) -> Result<CaptureSummary, CaptureError> {
        self.meta.memory.sha256 =
            hash_file(&self.mem_file).map_err(io_err("read back", &self.mem_path))?;
        let (len, ..) = seal(&self.mem_file, &self.mem_path)?;
        let tmp = &self.tmp;
        let meta_json =
            backstop_integrity::canonical::to_vec(&self.meta).map_err(|e| CaptureError::Io {
                step: "encode meta",
                path: tmp.clone(),
                source: std::io::Error::other(e),
            })?;
        let mut w = StateFileWriter::new();
        w.push(tag::META, 0, meta_json);
        w.append(self.sections);
        let state_bytes = w.finish();
        let state_sha256 = hex::encode(Sha256::digest(&state_bytes));
        let state_path = tmp.join(STATE_FILE);
        let mut state_file = create_new(&state_path)?;
        state_file
            .write_all(&state_bytes)
            .map_err(io_err("write", &state_path))?;
        seal(&state_file, &state_path)?;
        let sig_path = tmp.join(SIGNATURE_FILE);
        let mut sig_file = create_new(&sig_path)?;
        sig_file
            .write_all(key.sign_hex(&state_bytes).as_bytes())
            .map_err(io_err("write", &sig_path))?;
        seal(&sig_file, &sig_path)?;
        fsync_dir(tmp).map_err(io_err("fsync", tmp))?;
        fs::rename(tmp, dir).map_err(io_err("rename", dir))?;
        if let Some(parent_dir) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
            fsync_dir(parent_dir).map_err(io_err("fsync", parent_dir))?;
        }
        Ok(CaptureSummary {
            dir: dir.to_path_buf(),
            kind: self.meta.kind,
            seq: self.meta.seq,
            state_sha256,
            pause_us: 0,
            total_us: 0,
            state_us: 0,
            memory_us: 0,
            sync_us: 0,
            dirty_pages: 0,
            pages_written: self.meta.memory.pages,
            memory_bytes: self.memory_bytes,
            memory_file_len: len,
            state_file_len: state_bytes.len() as u64,
        })
    }
}

/// Removes a partial snapshot directory (its files may already be read-only).
fn remove_partial(dir: &Path) {
    if let Ok(entries) = fs::read_dir(dir) {
        for entry in entries.flatten() {
            let _ = fs::set_permissions(entry.path(), fs::Permissions::from_mode(0o600));
        }
    }
    let _ = fs::remove_dir_all(dir);
}

fn partial_dir(dir: &Path) -> PathBuf {
    let mut name = dir.file_name().unwrap_or_default().to_os_string();
    name.push(".partial");
    dir.with_file_name(name)
}

/// One verified snapshot of a chain.
#[derive(Debug)]
pub struct ChainLink {
    pub dir: PathBuf,
    pub meta: SnapshotMeta,
    pub state_sha256: String,
    state: VerifiedStateFile,
    memory_file: File,
    diff: Option<DiffIndex>,
}

impl ChainLink {
    /// The verified state file.
    pub fn state_file(&self) -> &VerifiedStateFile {
        &self.state
    }

    /// The image pages a diff stores (`None` for a full snapshot).
    pub fn diff_pages(&self) -> Option<&[u64]> {
        self.diff.as_ref().map(|d| d.pages.as_slice())
    }
}

/// Reads and verifies one snapshot's state file (signature, format, checksum, meta).
pub fn read_state_file(
    dir: &Path,
    key: &HostKey,
) -> Result<(VerifiedStateFile, SnapshotMeta), RestoreError> {
    match fs::symlink_metadata(dir) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => {
            return Err(RestoreError::Absent {
                dir: dir.to_path_buf(),
            })
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(RestoreError::Absent {
                dir: dir.to_path_buf(),
            })
        }
        Err(e) => return Err(rio_err("stat", dir)(e)),
    }
    let path = dir.join(STATE_FILE);
    let file = File::open(&path).map_err(rio_err("open", &path))?;
    let mut bytes = Vec::new();
    file.take(STATE_FILE_MAX_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(rio_err("read", &path))?;
    let sig_path = dir.join(SIGNATURE_FILE);
    let mut sig = String::new();
    File::open(&sig_path)
        .map_err(rio_err("open", &sig_path))?
        .take(1024)
        .read_to_string(&mut sig)
        .map_err(rio_err("read", &sig_path))?;
    let state_err = |source| RestoreError::StateFile {
        path: path.clone(),
        source,
    };
    let state = VerifiedStateFile::verify(bytes, &sig, key).map_err(state_err)?;
    let meta_bytes = state.require(tag::META, 0, "meta").map_err(state_err)?;
    let meta: SnapshotMeta = serde_json::from_slice(meta_bytes)
        .map_err(|e| state_err(StateFileError::Malformed(format!("meta: {e}"))))?;
    meta.layout.validate().map_err(RestoreError::Layout)?;
    let expected = meta
        .config
        .validate()
        .map_err(|e| state_err(StateFileError::Malformed(format!("meta config: {e}"))))?;
    if expected != meta.layout || meta.config.vcpus > MAX_VCPUS {
        return Err(state_err(StateFileError::Malformed(
            "meta layout does not match its config".into(),
        )));
    }
    let expected_file = match meta.kind {
        SnapshotKind::Full => FULL_MEMORY_FILE,
        SnapshotKind::Diff => DIFF_MEMORY_FILE,
    };
    if meta.memory.file != expected_file {
        return Err(state_err(StateFileError::Malformed(format!(
            "memory file {:?}",
            meta.memory.file
        ))));
    }
    Ok((state, meta))
}

fn open_memory_file(
    dir: &Path,
    meta: &SnapshotMeta,
    check: MemoryCheck,
) -> Result<File, RestoreError> {
    let path = dir.join(&meta.memory.file);
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&path)
        .map_err(rio_err("open", &path))?;
    let m = file.metadata().map_err(rio_err("stat", &path))?;
    let bad = |detail: String| RestoreError::MemoryFile {
        path: path.clone(),
        detail,
    };
    let want = &meta.memory;
    if !m.is_file() {
        return Err(bad("not a regular file".into()));
    }
    if m.mode() & 0o222 != 0 {
        return Err(bad(format!(
            "mode {:o} is writable: snapshot files must be read-only while a VM maps them",
            m.mode() & 0o7777
        )));
    }
    if m.len() != want.len {
        return Err(bad(format!("{} bytes, recorded {}", m.len(), want.len)));
    }
    match check {
        MemoryCheck::Metadata => {
            if (m.mtime(), m.mtime_nsec()) != (want.mtime_sec, want.mtime_nsec) {
                return Err(bad("modified since capture (mtime differs)".into()));
            }
        }
        MemoryCheck::Full => {
            let actual = hash_file(&file).map_err(rio_err("read", &path))?;
            if actual != want.sha256 {
                return Err(bad(format!("sha256 {actual}, recorded {}", want.sha256)));
            }
        }
    }
    Ok(file)
}

/// A verified chain: one full snapshot and its diffs, in order. Opening it touches no VM.
#[derive(Debug)]
pub struct SnapshotChain {
    links: Vec<ChainLink>,
    options: RestoreOptions,
    verify_us: u64,
}

impl SnapshotChain {
    /// Verifies every state file, the parent links, and every memory file (per
    /// `options.memory_check`).
    pub fn open(
        dirs: &[impl AsRef<Path>],
        key: &HostKey,
        options: RestoreOptions,
    ) -> Result<Self, RestoreError> {
        let start = Instant::now();
        if dirs.is_empty() {
            return Err(RestoreError::Chain("no snapshot given".into()));
        }
        let mut links: Vec<ChainLink> = Vec::with_capacity(dirs.len());
        for dir in dirs {
            let dir = dir.as_ref();
            let (state, meta) = read_state_file(dir, key)?;
            let state_sha256 = hex::encode(Sha256::digest(state.bytes()));
            match links.last() {
                None if meta.kind != SnapshotKind::Full || meta.seq != 0 => {
                    return Err(RestoreError::Chain(format!(
                        "{} is not a full snapshot: a chain starts with one",
                        dir.display()
                    )));
                }
                Some(prev) => {
                    if meta.kind != SnapshotKind::Diff
                        || meta.seq != prev.meta.seq + 1
                        || meta.parent_state_sha256.as_deref() != Some(&prev.state_sha256)
                    {
                        return Err(RestoreError::Chain(format!(
                            "{} is not the diff that follows {}",
                            dir.display(),
                            prev.dir.display()
                        )));
                    }
                    if meta.layout != prev.meta.layout
                        || meta.config.vcpus != prev.meta.config.vcpus
                        || meta.config.irqchip != prev.meta.config.irqchip
                    {
                        return Err(RestoreError::Chain(format!(
                            "{} changes the VM shape",
                            dir.display()
                        )));
                    }
                }
                None => {}
            }
            let memory_file = open_memory_file(dir, &meta, options.memory_check)?;
            let diff = match meta.kind {
                SnapshotKind::Full => None,
                SnapshotKind::Diff => Some(
                    read_diff_index(&memory_file, meta.memory.len, meta.layout.total_pages())
                        .map_err(|detail| RestoreError::MemoryFile {
                            path: dir.join(DIFF_MEMORY_FILE),
                            detail,
                        })?,
                ),
            };
            links.push(ChainLink {
                dir: dir.to_path_buf(),
                meta,
                state_sha256,
                state,
                memory_file,
                diff,
            });
        }
        Ok(Self {
            links,
            options,
            verify_us: micros(start),
        })
    }

    pub fn links(&self) -> &[ChainLink] {
        &self.links
    }

    /// The snapshot the chain restores to.
    pub fn last(&self) -> &ChainLink {
        &self.links[self.links.len() - 1]
    }
}

/// Runs of consecutive image pages within one region: (first page, pages, index of the first).
fn page_runs(pages: &[u64], layout: &MemoryLayout) -> Vec<(u64, u64, usize)> {
    let mut runs: Vec<(u64, u64, usize)> = Vec::new();
    for (i, &p) in pages.iter().enumerate() {
        if let Some(last) = runs.last_mut() {
            let same_region = layout.region_of_page(last.0) == layout.region_of_page(p);
            if last.0 + last.1 == p && same_region {
                last.1 += 1;
                continue;
            }
        }
        runs.push((p, 1, i));
    }
    runs
}

impl KvmVm {
    /// Verifies `dirs` as a chain (full snapshot first) and builds a paused VM from it. Nothing is
    /// created until every check passed.
    pub fn restore(
        dirs: &[impl AsRef<Path>],
        key: &HostKey,
        options: RestoreOptions,
    ) -> Result<(KvmVm, RestoreSummary), RestoreError> {
        let start = Instant::now();
        let chain = SnapshotChain::open(dirs, key, options)?;
        let (vm, mut summary) = Self::restore_chain(chain)?;
        summary.total_us = micros(start);
        Ok((vm, summary))
    }

    /// Builds a paused VM from a verified chain.
    pub fn restore_chain(chain: SnapshotChain) -> Result<(KvmVm, RestoreSummary), RestoreError> {
        let start = Instant::now();
        let last = chain.last();
        let layout = last.meta.layout.clone();
        let config = last.meta.config.clone();

        let map_start = Instant::now();
        let base = &chain.links[0];
        let memory = memory::from_image(&layout, &base.memory_file)?;
        let mut overlay_runs = 0u64;
        let mut copied_pages = 0u64;
        for link in &chain.links[1..] {
            let Some(diff) = &link.diff else { continue };
            let runs = page_runs(&diff.pages, &layout);
            if runs.len() <= chain.options.max_overlay_runs {
                for &(first, pages, index) in &runs {
                    let offset = diff.data_offset + (index * PAGE_SIZE) as u64;
                    memory::overlay_pages(
                        &memory,
                        &layout,
                        first,
                        pages,
                        &link.memory_file,
                        offset,
                    )?;
                }
                overlay_runs += runs.len() as u64;
            } else {
                copied_pages += copy_diff_pages(&memory, &layout, link, diff)?;
            }
        }
        // Copies went through the VMM's write tracking; they are part of the snapshot, not new.
        let mut scratch = PageBitmap::new(layout.total_pages());
        memory::take_vmm_dirty(&memory, &layout, &mut scratch);
        let map_us = micros(map_start);

        let vm_start = Instant::now();
        let shell = VmShell::create(&memory, &layout, config.irqchip)?;
        if shell.irqchip != config.irqchip {
            return Err(RestoreError::Vm(VmError::Config(
                "the snapshot needs an in-kernel irqchip this KVM does not provide".into(),
            )));
        }
        let state = &last.state;
        let state_err = |source| RestoreError::StateFile {
            path: last.dir.join(STATE_FILE),
            source,
        };
        let vm_state = VmState::read_sections(state, config.irqchip).map_err(state_err)?;
        let vcpu_states = (0..config.vcpus)
            .map(|i| VcpuState::read_sections(state, i, config.irqchip))
            .collect::<Result<Vec<_>, _>>()
            .map_err(state_err)?;
        let devices: DeviceState = decode_exact(
            state
                .require(tag::DEVICES, 0, "devices")
                .map_err(state_err)?,
            "devices",
        )
        .map_err(state_err)?;
        vm_state.apply(&shell.vm)?;
        let mut fds: Vec<VcpuFd> = Vec::new();
        for (index, vs) in vcpu_states.iter().enumerate() {
            let fd = shell
                .vm
                .create_vcpu(index as u64)
                .map_err(|source| IoctlError {
                    step: "KVM_CREATE_VCPU",
                    source,
                })?;
            vs.apply(&fd)?;
            fds.push(fd);
        }
        let caps = VcpuCaps {
            xsave: vcpu_states[0].xsave.is_some(),
            xcrs: vcpu_states[0].xcrs.is_some(),
            lapic: config.irqchip,
            msr_indices: vcpu_states[0].msrs.iter().map(|m| m.index).collect(),
        };
        let devices = Arc::new(Mutex::new(Devices::from_state(devices)));
        let lineage = Lineage {
            seq: last.meta.seq,
            state_sha256: last.state_sha256.clone(),
        };
        let mut vm = KvmVm::assemble(shell, memory, layout, devices, caps, fds, config)?;
        vm.lineage = Some(lineage);
        vm.backing_files = chain
            .links
            .iter()
            .filter_map(|l| l.memory_file.try_clone().ok())
            .collect();
        let vm_us = micros(vm_start);
        let summary = RestoreSummary {
            verify_us: chain.verify_us,
            map_us,
            vm_us,
            total_us: chain.verify_us + micros(start),
            chain_len: chain.links.len(),
            overlay_runs,
            copied_pages,
            memory_bytes: vm.layout.total_bytes(),
        };
        tracing::info!(
            chain_len = summary.chain_len,
            map_us = summary.map_us,
            vm_us = summary.vm_us,
            verify_us = summary.verify_us,
            "kvm snapshot restored (paused)"
        );
        Ok((vm, summary))
    }
}

fn copy_diff_pages(
    memory: &GuestMem,
    layout: &MemoryLayout,
    link: &ChainLink,
    diff: &DiffIndex,
) -> Result<u64, RestoreError> {
    use vm_memory::{Bytes, GuestAddress};
    let path = link.dir.join(DIFF_MEMORY_FILE);
    let mut page = vec![0u8; PAGE_SIZE];
    for (i, &p) in diff.pages.iter().enumerate() {
        link.memory_file
            .read_exact_at(&mut page, diff.data_offset + (i * PAGE_SIZE) as u64)
            .map_err(rio_err("read", &path))?;
        let gpa = layout
            .gpa_of_page(p)
            .ok_or_else(|| RestoreError::MemoryFile {
                path: path.clone(),
                detail: format!("page {p} outside guest memory"),
            })?;
        memory
            .write_slice(&page, GuestAddress(gpa))
            .map_err(|e| MemoryError::Access {
                gpa,
                detail: e.to_string(),
            })?;
    }
    Ok(diff.pages.len() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_runs_split_at_gaps_and_regions() {
        let layout = MemoryLayout::for_size(4096).unwrap();
        let edge = layout.regions[1].first_page();
        let pages = [1, 2, 3, 7, edge - 1, edge, edge + 1];
        let runs = page_runs(&pages, &layout);
        assert_eq!(
            runs,
            vec![(1, 3, 0), (7, 1, 3), (edge - 1, 1, 4), (edge, 2, 5)]
        );
    }

    #[test]
    fn zero_page_detection() {
        let mut page = vec![0u8; PAGE_SIZE];
        assert!(is_zero_page(&page));
        page[4095] = 1;
        assert!(!is_zero_page(&page));
    }

    #[test]
    fn diff_index_is_validated() {
        let dir = tempfile::tempdir().unwrap();
        let layout = MemoryLayout::for_size(2).unwrap();
        let mem = memory::anonymous(&layout).unwrap();
        let path = dir.path().join("d");
        let file = File::options()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .unwrap();
        write_diff(&mem, &layout, &[3, 9], &file, &path).unwrap();
        let len = file.metadata().unwrap().len();
        assert_eq!(len, 4096 + 2 * 4096);
        let index = read_diff_index(&file, len, layout.total_pages()).unwrap();
        assert_eq!(index.pages, vec![3, 9]);
        assert!(read_diff_index(&file, len - 1, layout.total_pages()).is_err());
        assert!(read_diff_index(&file, len, layout.total_pages() + 1).is_err());
        // Unsorted index.
        file.write_all_at(&9u64.to_le_bytes(), DIFF_HEADER_LEN)
            .unwrap();
        assert!(read_diff_index(&file, len, layout.total_pages()).is_err());
    }

    #[test]
    fn restore_error_codes() {
        let missing = RestoreError::Io {
            step: "open",
            path: "x".into(),
            source: std::io::Error::from(std::io::ErrorKind::NotFound),
        };
        assert_eq!(missing.code(), "ERR_SNAPSHOT_INTEGRITY_CHECK_FAILED");
        let absent = RestoreError::Absent { dir: "x".into() };
        assert_eq!(absent.code(), "MISSING_SNAPSHOT");
        let changed = RestoreError::MemoryFile {
            path: "x".into(),
            detail: "d".into(),
        };
        assert_eq!(changed.code(), "ERR_SNAPSHOT_INTEGRITY_CHECK_FAILED");
        assert_eq!(
            RestoreError::Chain("c".into()).code(),
            "ERR_SNAPSHOT_MANIFEST_INVALID"
        );
    }
}
