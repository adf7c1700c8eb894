//! The §10 recovery formula of an MRO plan literally (inclusion–exclusion over the group
//! blocks): the oracle that [`lazarus_planner::recovery::mro_closed_form`] is checked against
//! (`tests/recovery.rs`). Test support only: it lives under `tests/oracles/`, outside the
//! library, and is compiled into the test with `#[path]`. Not for production use: it takes
//! `2^G` terms for `G` blocks, and their cancellation loses precision.

use lazarus_planner::recovery::binomial;

/// The §10 formula literally: `Σ_{J⊆blocks} (−1)^{|J|} C(N − Σ_{i∈J} L_i, R) / C(N, R)`.
/// Exponential in the number of blocks (at most 24 here); kept as the oracle of the closed form.
pub fn mro_inclusion_exclusion(block_sizes: &[usize], nodes: usize, failed: usize) -> f64 {
    assert!(block_sizes.len() <= 24, "too many blocks for 2^G terms");
    let alive = nodes.saturating_sub(failed);
    let total = binomial(nodes, alive);
    let g = block_sizes.len();
    let mut p = 0.0;
    for subset in 0u32..(1 << g) {
        let removed: usize = (0..g)
            .filter(|i| subset >> i & 1 == 1)
            .map(|i| block_sizes[i])
            .sum();
        let sign = if subset.count_ones() % 2 == 0 {
            1.0
        } else {
            -1.0
        };
        if removed <= nodes {
            p += sign * binomial(nodes - removed, alive) / total;
        }
    }
    p
}
