//! Guest RAM: its layout in guest-physical space, anonymous or copy-on-write file-backed
//! mappings, and page bitmaps.
//!
//! The *memory image* is guest RAM with the MMIO gap squeezed out: region after region, in
//! guest-physical order. A full snapshot's memory file is exactly the image, so restoring maps it
//! `MAP_PRIVATE` region by region instead of reading it. "Page n" always means page n of the image.

use std::fs::File;
use std::num::NonZeroUsize;

use serde::{Deserialize, Serialize};
use vm_memory::bitmap::AtomicBitmap;
use vm_memory::{FileOffset, GuestAddress, GuestRegionMmap, MmapRegion};

pub use vm_memory::GuestMemoryMmap;

/// Guest page size (x86-64 base pages).
pub const PAGE_SIZE: usize = 4096;
const PAGE_SIZE_NZ: NonZeroUsize = match NonZeroUsize::new(PAGE_SIZE) {
    Some(n) => n,
    None => panic!("page size is not zero"),
};
/// Guest RAM stops here and resumes at [`MMIO_GAP_END`] (LAPIC, IOAPIC and friends live between).
pub const MMIO_GAP_START: u64 = 3 << 30;
/// First guest-physical address above the MMIO gap.
pub const MMIO_GAP_END: u64 = 4 << 30;
/// Smallest guest the built-in program fits in.
pub const MIN_MEM_SIZE_MIB: u64 = 2;
/// Largest guest accepted (a sanity bound, not a KVM limit).
pub const MAX_MEM_SIZE_MIB: u64 = 1 << 20;

/// Guest memory with a per-region bitmap of the pages the VMM itself wrote.
pub type GuestMem = GuestMemoryMmap<AtomicBitmap>;

/// One guest RAM region (one KVM memory slot).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegionSpec {
    pub gpa: u64,
    pub size: u64,
    /// Where the region starts in the memory image.
    pub image_offset: u64,
}

impl RegionSpec {
    pub fn first_page(&self) -> u64 {
        self.image_offset / PAGE_SIZE as u64
    }
    pub fn pages(&self) -> u64 {
        self.size / PAGE_SIZE as u64
    }
}

/// Where guest RAM lives: below [`MMIO_GAP_START`], the rest from [`MMIO_GAP_END`] up.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemoryLayout {
    pub regions: Vec<RegionSpec>,
}

#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    #[error(
        "guest memory of {mem_size_mib} MiB is outside {MIN_MEM_SIZE_MIB}..={MAX_MEM_SIZE_MIB} MiB"
    )]
    Size { mem_size_mib: u64 },
    #[error("memory layout is invalid: {0}")]
    Layout(String),
    #[error("mmap of guest region at {gpa:#x} ({size} bytes): {detail}")]
    Map { gpa: u64, size: u64, detail: String },
    #[error("overlay of pages {first_page}+{pages}: {source}")]
    Overlay {
        first_page: u64,
        pages: u64,
        source: std::io::Error,
    },
    #[error("guest memory access at {gpa:#x}: {detail}")]
    Access { gpa: u64, detail: String },
}

impl MemoryLayout {
    /// The standard layout for `mem_size_mib` MiB of RAM.
    pub fn for_size(mem_size_mib: u64) -> Result<Self, MemoryError> {
        if !(MIN_MEM_SIZE_MIB..=MAX_MEM_SIZE_MIB).contains(&mem_size_mib) {
            return Err(MemoryError::Size { mem_size_mib });
        }
        let total = mem_size_mib << 20;
        let low = total.min(MMIO_GAP_START);
        let mut regions = vec![RegionSpec {
            gpa: 0,
            size: low,
            image_offset: 0,
        }];
        if total > low {
            regions.push(RegionSpec {
                gpa: MMIO_GAP_END,
                size: total - low,
                image_offset: low,
            });
        }
        Ok(Self { regions })
    }

    /// Checks a layout read from a snapshot: page aligned, ordered, contiguous in the image,
    /// not overlapping in guest-physical space, within the size bounds.
    pub fn validate(&self) -> Result<(), MemoryError> {
        let bad = |why: String| Err(MemoryError::Layout(why));
        if self.regions.is_empty() || self.regions.len() > 8 {
            return bad(format!("{} regions", self.regions.len()));
        }
        let mut image_end = 0u64;
        let mut gpa_end = 0u64;
        for r in &self.regions {
            let page = PAGE_SIZE as u64;
            if r.size == 0 || r.gpa % page != 0 || r.size % page != 0 {
                return bad(format!(
                    "region {:#x}+{:#x} not page aligned",
                    r.gpa, r.size
                ));
            }
            if r.image_offset != image_end || r.gpa < gpa_end {
                return bad(format!("region {:#x} out of order", r.gpa));
            }
            gpa_end = match r.gpa.checked_add(r.size) {
                Some(end) if end <= (1 << 46) => end,
                _ => return bad(format!("region {:#x}+{:#x} too high", r.gpa, r.size)),
            };
            image_end += r.size;
        }
        let mib = image_end >> 20;
        if !(MIN_MEM_SIZE_MIB..=MAX_MEM_SIZE_MIB).contains(&mib) {
            return Err(MemoryError::Size { mem_size_mib: mib });
        }
        Ok(())
    }

    /// Bytes of guest RAM (the image size).
    pub fn total_bytes(&self) -> u64 {
        self.regions.iter().map(|r| r.size).sum()
    }

    /// Pages of guest RAM.
    pub fn total_pages(&self) -> u64 {
        self.total_bytes() / PAGE_SIZE as u64
    }

    /// Guest-physical address of image page `page`.
    pub fn gpa_of_page(&self, page: u64) -> Option<u64> {
        let offset = page.checked_mul(PAGE_SIZE as u64)?;
        self.regions
            .iter()
            .find(|r| (r.image_offset..r.image_offset + r.size).contains(&offset))
            .map(|r| r.gpa + (offset - r.image_offset))
    }

    /// Image page holding guest-physical address `gpa`.
    pub fn page_of_gpa(&self, gpa: u64) -> Option<u64> {
        self.regions
            .iter()
            .find(|r| (r.gpa..r.gpa + r.size).contains(&gpa))
            .map(|r| (r.image_offset + (gpa - r.gpa)) / PAGE_SIZE as u64)
    }

    /// Region index holding image page `page`.
    pub fn region_of_page(&self, page: u64) -> Option<usize> {
        self.regions
            .iter()
            .position(|r| (r.first_page()..r.first_page() + r.pages()).contains(&page))
    }
}

fn build_region(
    spec: &RegionSpec,
    file: Option<&File>,
) -> Result<GuestRegionMmap<AtomicBitmap>, MemoryError> {
    let map_err = |detail: String| MemoryError::Map {
        gpa: spec.gpa,
        size: spec.size,
        detail,
    };
    let size = usize::try_from(spec.size).map_err(|e| map_err(e.to_string()))?;
    let bitmap = AtomicBitmap::new(size, PAGE_SIZE_NZ);
    let builder = vm_memory::mmap::MmapRegionBuilder::new_with_bitmap(size, bitmap)
        .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE);
    let builder = match file {
        Some(file) => {
            let file = file.try_clone().map_err(|e| map_err(e.to_string()))?;
            builder
                .with_file_offset(FileOffset::new(file, spec.image_offset))
                .with_mmap_flags(libc::MAP_PRIVATE | libc::MAP_NORESERVE)
        }
        None => {
            builder.with_mmap_flags(libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE)
        }
    };
    let region = builder.build().map_err(|e| map_err(e.to_string()))?;
    GuestRegionMmap::new(region, GuestAddress(spec.gpa))
        .ok_or_else(|| map_err("region wraps the address space".into()))
}

fn collect(layout: &MemoryLayout, file: Option<&File>) -> Result<GuestMem, MemoryError> {
    layout.validate()?;
    let regions = layout
        .regions
        .iter()
        .map(|spec| build_region(spec, file))
        .collect::<Result<Vec<_>, _>>()?;
    GuestMemoryMmap::from_regions(regions).map_err(|e| MemoryError::Layout(e.to_string()))
}

/// Fresh zeroed guest RAM (anonymous, private, not reserved up front).
pub fn anonymous(layout: &MemoryLayout) -> Result<GuestMem, MemoryError> {
    collect(layout, None)
}

/// Guest RAM mapped copy-on-write from a memory image file: nothing is read now; pages fault in
/// from the file when touched, and the guest's writes go to private copies, never to the file.
pub fn from_image(layout: &MemoryLayout, image: &File) -> Result<GuestMem, MemoryError> {
    collect(layout, Some(image))
}

/// Host address of the start of region `index`.
pub fn region_host_addr(mem: &GuestMem, index: usize) -> Option<*mut u8> {
    use vm_memory::GuestMemoryBackend;
    mem.iter().nth(index).map(|r| MmapRegion::as_ptr(r))
}

/// Maps `pages` pages of `file` starting at byte `file_offset` over image pages
/// `first_page..first_page + pages`, copy-on-write, replacing what was mapped there.
///
/// The run must lie inside one region, `file_offset` must be page aligned, and no vCPU may run
/// on this memory while it is remapped (callers overlay before creating vCPUs).
pub fn overlay_pages(
    mem: &GuestMem,
    layout: &MemoryLayout,
    first_page: u64,
    pages: u64,
    file: &File,
    file_offset: u64,
) -> Result<(), MemoryError> {
    use std::os::fd::AsRawFd;
    let fail = |detail: &str| MemoryError::Overlay {
        first_page,
        pages,
        source: std::io::Error::new(std::io::ErrorKind::InvalidInput, detail.to_string()),
    };
    let index = layout
        .region_of_page(first_page)
        .ok_or_else(|| fail("page outside guest memory"))?;
    let spec = &layout.regions[index];
    if pages == 0
        || first_page + pages > spec.first_page() + spec.pages()
        || !file_offset.is_multiple_of(PAGE_SIZE as u64)
    {
        return Err(fail("run crosses a region or is unaligned"));
    }
    let base = region_host_addr(mem, index).ok_or_else(|| fail("no such region"))?;
    let offset_in_region = (first_page - spec.first_page()) as usize * PAGE_SIZE;
    let len = pages as usize * PAGE_SIZE;
    let offset = libc::off_t::try_from(file_offset).map_err(|_| fail("file offset too large"))?;
    // SAFETY: `base + offset_in_region .. + len` lies inside region `index`'s mapping, which
    // `mem` owns and keeps mapped until it is dropped (checked above against the layout the
    // mapping was built from). MAP_FIXED replaces those pages in place with a private
    // copy-on-write mapping of the same size and protection, so every pointer into the region
    // stays valid. No Rust reference to these bytes exists (guest memory is only reached through
    // volatile accessors) and, per this function's contract, no vCPU runs on it.
    let addr = unsafe {
        libc::mmap(
            base.add(offset_in_region).cast(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_FIXED | libc::MAP_NORESERVE,
            file.as_raw_fd(),
            offset,
        )
    };
    if addr == libc::MAP_FAILED {
        return Err(MemoryError::Overlay {
            first_page,
            pages,
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// Takes and clears the bitmap of pages the VMM wrote through `mem`, as image pages.
pub fn take_vmm_dirty(mem: &GuestMem, layout: &MemoryLayout, into: &mut PageBitmap) {
    use vm_memory::GuestMemoryBackend;
    for (region, spec) in mem.iter().zip(&layout.regions) {
        let words = MmapRegion::bitmap(region).get_and_reset();
        into.or_words_at(spec.first_page(), &words, spec.pages());
    }
}

/// Reads `buf.len()` bytes of guest memory at image offset `image_offset` (never across a region
/// end; callers read page-sized pieces).
pub fn read_image(
    mem: &GuestMem,
    layout: &MemoryLayout,
    image_offset: u64,
    buf: &mut [u8],
) -> Result<(), MemoryError> {
    use vm_memory::Bytes;
    let page = image_offset / PAGE_SIZE as u64;
    let gpa = layout
        .gpa_of_page(page)
        .map(|g| g + image_offset % PAGE_SIZE as u64)
        .ok_or(MemoryError::Access {
            gpa: image_offset,
            detail: "outside the image".into(),
        })?;
    mem.read_slice(buf, GuestAddress(gpa))
        .map_err(|e| MemoryError::Access {
            gpa,
            detail: e.to_string(),
        })
}

/// One bit per image page.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageBitmap {
    words: Vec<u64>,
    pages: u64,
}

impl PageBitmap {
    pub fn new(pages: u64) -> Self {
        Self {
            words: vec![0; pages.div_ceil(64) as usize],
            pages,
        }
    }

    pub fn pages(&self) -> u64 {
        self.pages
    }

    pub fn set(&mut self, page: u64) {
        if page < self.pages {
            self.words[(page / 64) as usize] |= 1 << (page % 64);
        }
    }

    pub fn get(&self, page: u64) -> bool {
        page < self.pages && self.words[(page / 64) as usize] >> (page % 64) & 1 == 1
    }

    pub fn count(&self) -> u64 {
        self.words.iter().map(|w| u64::from(w.count_ones())).sum()
    }

    /// ORs a slot-relative bitmap (`words`, `pages` bits long) in at image page `first_page`.
    pub fn or_words_at(&mut self, first_page: u64, words: &[u64], pages: u64) {
        for (i, &word) in words.iter().enumerate() {
            let mut w = word;
            while w != 0 {
                let bit = u64::from(w.trailing_zeros());
                w &= w - 1;
                let rel = i as u64 * 64 + bit;
                if rel < pages {
                    self.set(first_page + rel);
                }
            }
        }
    }

    /// Set pages in ascending order.
    pub fn iter(&self) -> impl Iterator<Item = u64> + '_ {
        self.words.iter().enumerate().flat_map(|(i, &word)| {
            let mut w = word;
            std::iter::from_fn(move || {
                if w == 0 {
                    return None;
                }
                let bit = u64::from(w.trailing_zeros());
                w &= w - 1;
                Some(i as u64 * 64 + bit)
            })
        })
    }

    /// Every page set.
    pub fn fill(&mut self) {
        for page in 0..self.pages {
            self.set(page);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::Bytes;

    #[test]
    fn layouts_split_at_the_mmio_gap() {
        let small = MemoryLayout::for_size(256).unwrap();
        assert_eq!(small.regions.len(), 1);
        assert_eq!(small.total_bytes(), 256 << 20);
        let big = MemoryLayout::for_size(4096).unwrap();
        assert_eq!(big.regions.len(), 2);
        assert_eq!(big.regions[1].gpa, MMIO_GAP_END);
        assert_eq!(big.regions[1].size, 1 << 30);
        assert_eq!(big.regions[1].image_offset, 3 << 30);
        big.validate().unwrap();
        let last = big.total_pages() - 1;
        assert_eq!(big.gpa_of_page(last), Some(MMIO_GAP_END + (1 << 30) - 4096));
        assert_eq!(big.page_of_gpa(MMIO_GAP_END), Some((3 << 30) / 4096));
        assert_eq!(big.page_of_gpa(MMIO_GAP_START), None);
        assert_eq!(big.region_of_page(last), Some(1));
        assert!(MemoryLayout::for_size(1).is_err());
    }

    #[test]
    fn invalid_layouts_are_refused() {
        let mut l = MemoryLayout::for_size(16).unwrap();
        l.regions[0].size += 1;
        assert!(l.validate().is_err());
        let mut l = MemoryLayout::for_size(4096).unwrap();
        l.regions[1].image_offset = 0;
        assert!(l.validate().is_err());
        assert!(MemoryLayout { regions: vec![] }.validate().is_err());
    }

    #[test]
    fn vmm_writes_are_tracked_and_reset_on_take() {
        let layout = MemoryLayout::for_size(4).unwrap();
        let mem = anonymous(&layout).unwrap();
        mem.write_slice(&[1, 2, 3], GuestAddress(0x3000 - 1))
            .unwrap();
        let mut dirty = PageBitmap::new(layout.total_pages());
        take_vmm_dirty(&mem, &layout, &mut dirty);
        assert_eq!(dirty.iter().collect::<Vec<_>>(), vec![2, 3]);
        let mut again = PageBitmap::new(layout.total_pages());
        take_vmm_dirty(&mem, &layout, &mut again);
        assert_eq!(again.count(), 0);
    }

    #[test]
    fn image_mapping_is_copy_on_write_and_overlay_replaces_pages() {
        use std::io::Write;
        let layout = MemoryLayout::for_size(2).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("image");
        let mut image = vec![0u8; layout.total_bytes() as usize];
        image[4096] = 0xaa;
        std::fs::write(&path, &image).unwrap();
        let file = File::open(&path).unwrap();
        let mem = from_image(&layout, &file).unwrap();
        let mut b = [0u8; 1];
        read_image(&mem, &layout, 4096, &mut b).unwrap();
        assert_eq!(b[0], 0xaa);
        mem.write_slice(&[0xbb], GuestAddress(4096)).unwrap();
        assert_eq!(
            std::fs::read(&path).unwrap()[4096],
            0xaa,
            "the file never changes"
        );

        let overlay_path = dir.path().join("overlay");
        let mut overlay = std::fs::File::create(&overlay_path).unwrap();
        overlay.write_all(&[0x11; 4096]).unwrap();
        overlay.write_all(&[0x22; 4096]).unwrap();
        drop(overlay);
        let overlay = File::open(&overlay_path).unwrap();
        overlay_pages(&mem, &layout, 5, 1, &overlay, 4096).unwrap();
        read_image(&mem, &layout, 5 * 4096 + 17, &mut b).unwrap();
        assert_eq!(b[0], 0x22);
        read_image(&mem, &layout, 4 * 4096, &mut b).unwrap();
        assert_eq!(b[0], 0);
        assert!(overlay_pages(&mem, &layout, 511, 2, &overlay, 0).is_err());
        assert!(overlay_pages(&mem, &layout, 1, 1, &overlay, 7).is_err());
    }

    #[test]
    fn page_bitmap_ops() {
        let mut b = PageBitmap::new(130);
        b.set(0);
        b.set(64);
        b.set(129);
        b.set(500);
        assert_eq!(b.iter().collect::<Vec<_>>(), vec![0, 64, 129]);
        assert_eq!(b.count(), 3);
        let mut c = PageBitmap::new(130);
        c.or_words_at(100, &[0b101, u64::MAX], 3);
        assert_eq!(c.iter().collect::<Vec<_>>(), vec![100, 102]);
    }
}
