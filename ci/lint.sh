#!/usr/bin/env bash
# Format and lint gates CI applies (CONVENTIONS.md): rustfmt, and clippy with warnings as errors.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
# The libvirt backend (needs libvirt-dev: scripts/setup-libvirt.sh).
cargo clippy --workspace --all-targets --features backstopd/fault-injection,backstopd/libvirt -- -D warnings
