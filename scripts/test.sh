#!/usr/bin/env bash
# The test suite: builds the binaries the end-to-end tests start as real processes, runs every
# test of the workspace, then the fuzz driver for a bounded time. Works on a fresh machine with rustup (adds the wasm target that
# policy components are built for).
set -euo pipefail
cd "$(dirname "$0")/.."
rustup target add wasm32-unknown-unknown >/dev/null 2>&1 || rustup target add wasm32-unknown-unknown
cargo build --workspace --bins
# End-to-end clients use same-host shared memory by default; the suite runs again on QUIC.
cargo test --workspace "$@"
KVPOOL_TEST_TRANSPORT=quic cargo test -p kvpool-tests "$@"
# The in-tree fuzz driver over the decoder and the request handler: 2 x 5 million inputs, bounded
# in time (KVPOOL_FUZZ_SECONDS, default 300); any panic or protocol violation fails the run.
# Skipped when the call names tests to run.
if [ $# -eq 0 ]; then
  cargo run -p kvpool-fuzz -- --threads 2 --inputs "${KVPOOL_FUZZ_INPUTS:-5000000}" --seconds "${KVPOOL_FUZZ_SECONDS:-300}"
fi
