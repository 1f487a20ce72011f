#!/usr/bin/env bash
# Format and lint gates CI applies (CONVENTIONS.md): the docs check, rustfmt, and clippy with
# warnings as errors.
set -euo pipefail
cd "$(dirname "$0")/.."
# The docs: README.md at most 250 lines, every relative link and anchor of README.md and
# docs/**/*.md resolves (the checker's own tests first). The console commands and config keys
# the docs name are checked after the build, by scripts/test.sh (`check-docs.py --verbs`).
python3 ci/check-docs-selftest.py
python3 ci/check-docs.py
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
# The libvirt backend (needs libvirt-dev: scripts/setup-libvirt.sh).
cargo clippy --workspace --all-targets --features backstopd/fault-injection,backstopd/libvirt -- -D warnings
