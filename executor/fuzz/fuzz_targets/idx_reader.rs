//! Feeds arbitrary bytes as a Megatron-LM `.idx` (and a small `.bin`) to the indexed-dataset
//! reader. Validation must never panic, and whatever validates must read back every sequence,
//! document and token without panicking either (bad token ids are errors, not panics).
//!
//! Layout of an input: byte 0 picks the mode and the `.bin` length — bit 7 set prepends a valid
//! magic and version so the fuzzer starts past the header, bits 0..6 are the `.bin` length (taken
//! from the bytes that follow, clamped) — and the rest is the `.idx`.
//!
//! Run from `executor/`: `cargo +nightly fuzz run idx_reader` (needs `cargo install cargo-fuzz`).
//! Without cargo-fuzz, `cargo check` in `executor/fuzz/` type-checks it.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[allow(dead_code, unused_imports)]
#[path = "../../src/dataset/mod.rs"]
mod dataset;

use dataset::{IDX_MAGIC, IndexedDataset, TokenDataset};

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let bin_len = usize::from(mode & 0x7f).min(rest.len());
    let (bin, idx) = rest.split_at(bin_len);
    let mut idx_bytes = Vec::with_capacity(idx.len() + 17);
    if mode & 0x80 != 0 {
        idx_bytes.extend_from_slice(IDX_MAGIC);
        idx_bytes.extend_from_slice(&1u64.to_le_bytes());
    }
    idx_bytes.extend_from_slice(idx);
    let Ok(d) = IndexedDataset::from_memory("fuzz", idx_bytes, bin.to_vec(), None) else {
        return;
    };
    let d = TokenDataset::Indexed(d);
    let n = d.num_tokens();
    assert!(n > 0, "an opened dataset has tokens");
    for s in 0..d.num_sequences() {
        let r = d
            .sequence(s)
            .expect("every sequence of an opened dataset exists");
        let _ = d.tokens(r);
    }
    for k in 0..d.num_documents() {
        let r = d
            .document(k)
            .expect("every document of an opened dataset exists");
        assert!(r.start <= r.end && r.end <= n);
    }
    let _ = d.window(0, 1);
    let _ = d.max_token_id();
    let _ = d.check_vocab(7);
});
