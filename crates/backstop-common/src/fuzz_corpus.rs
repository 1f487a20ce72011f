//! The inputs kept for the cargo-fuzz targets in `fuzz/`: each target's seeds
//! (`fuzz/corpus/<target>/`) and the crash reproducers found (`fuzz/regressions/<target>/`), so
//! that every crate's stable `cargo test` replays the ones of its parsers. Test support only.

use std::path::Path;

/// Every kept input of fuzz target `target`, as (path, bytes). Panics when there is none (a
/// replay test that replays nothing could not fail) or a file cannot be read.
pub fn inputs(target: &str) -> Vec<(String, Vec<u8>)> {
    // Every crate lives at crates/<name>/, beside this one.
    let fuzz = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz");
    let mut inputs = Vec::new();
    for kind in ["corpus", "regressions"] {
        let Ok(dir) = std::fs::read_dir(fuzz.join(kind).join(target)) else {
            continue;
        };
        for entry in dir {
            let path = entry
                .map(|e| e.path())
                .unwrap_or_else(|e| panic!("{}: {e}", fuzz.display()));
            let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            inputs.push((path.display().to_string(), bytes));
        }
    }
    assert!(!inputs.is_empty(), "no fuzz inputs for {target}");
    inputs
}
