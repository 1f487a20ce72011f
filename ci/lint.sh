#!/usr/bin/env bash
# Format and lint gates CI applies (CONVENTIONS.md): rustfmt, and clippy with warnings as errors.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
