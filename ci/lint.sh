#!/usr/bin/env bash
# Format and lint gates CI applies (CONVENTIONS.md): the docs check, docs/benchmarks.md's
# tables against the saved runs they are drawn from, the dependencies' licences and sources,
# rustfmt, and clippy with warnings as errors.
set -euo pipefail
cd "$(dirname "$0")/.."
# The docs: README.md at most 250 lines, every relative link and anchor of README.md and
# docs/**/*.md resolves, every error code is in the console reference (the checker's own tests
# first). The console commands and config keys the docs name are checked after the build, by
# scripts/test.sh (`check-docs.py --verbs`).
python3 ci/check-docs-selftest.py
python3 ci/check-docs.py
# Each table between `<!-- BEGIN report:NAME -->` markers must be what bench/report.py renders
# from the raw JSON kept in docs/benchmarks/ (pure Python, no QEMU): a table edited by hand, or a
# saved run without its tables, fails here. To redraw them:
#   python3 bench/report.py --docs docs/benchmarks.md docs/benchmarks/*.raw.json
python3 -B bench/report.py --docs docs/benchmarks.md --check docs/benchmarks/*.raw.json
# Every crate the packages are built from has a licence deny.toml's allow list satisfies and comes
# from crates.io (cargo metadata and Cargo.lock only: no build, a second or two). Advisories are
# not checked: the RustSec database is on GitHub, which CI cannot reach.
python3 -B ci/check-licenses.py
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
# The libvirt backend (needs libvirt-dev: scripts/setup-libvirt.sh).
cargo clippy --workspace --all-targets --features backstopd/fault-injection,backstopd/libvirt -- -D warnings
