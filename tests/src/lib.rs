//! Cross-crate tests of Lazarus-rs: what one crate writes and another reads, checked across the
//! boundary. This library is empty; the tests are in `tests/` (`cargo test -p lazarus-tests`,
//! also run by `cargo test --workspace`):
//!
//! * `readme_examples.rs`: every shell example of the READMEs run as written, its claimed
//!   output checked;
//! * `predict.rs`: `lzsim predict` (the simulator's library and its `lzsim` binary) on run
//!   directories recorded by `lzrun local --metrics-out` (`fixtures/run-*`) with the hardware
//!   profile `lzrun calibrate` wrote on the machine that recorded them
//!   (`fixtures/lzrun-local-hardware.toml`), and `lzrun local` run then predicted end to end.
//!
//! The tests that run a binary take `lzsim` and `lzrun` from the target directory they were
//! built into (`target/<profile>/`, as `cargo test --workspace` leaves them) and print a
//! `skipped: …` line when they are not there. Per-crate tests stay in each crate's `tests/`.
