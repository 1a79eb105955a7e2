#!/usr/bin/env bash
# The test suite: builds the binaries the end-to-end tests start as real processes, then runs
# every test of the workspace. Works on a fresh machine with rustup (adds the wasm target that
# policy components are built for).
set -euo pipefail
cd "$(dirname "$0")/.."
rustup target add wasm32-unknown-unknown >/dev/null 2>&1 || rustup target add wasm32-unknown-unknown
cargo build --workspace --bins
cargo test --workspace "$@"
