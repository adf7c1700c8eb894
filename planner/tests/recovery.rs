//! Recovery-probability golden vectors (the MRO closed form by inclusion–exclusion over
//! the group blocks, checked by brute force; paper Figs. 4 and 5) and the optimality
//! of MRO against brute force over all placements of tiny clusters.

// The §10 formula literally, a test oracle kept outside the library (see `tests/oracles/`).
#[path = "oracles/mro_inclusion_exclusion.rs"]
mod mro_inclusion_exclusion;
use mro_inclusion_exclusion::mro_inclusion_exclusion;

use lazarus_planner::place::{LayerPlacement, PlacePolicy, mro_structure, place};
use lazarus_planner::recovery::{
    exact, exact_counts, exact_domains, exact_small_k, monte_carlo, mro_closed_form,
};
use lazarus_planner::{AllocPolicy, allocate};
use proptest::prelude::*;

fn grid(nodes: &[&[u32]], experts: usize) -> LayerPlacement {
    LayerPlacement::from_grid(nodes.iter().map(|n| n.to_vec()).collect(), experts, None).unwrap()
}

#[test]
fn section10_table_closed_form_and_enumeration() {
    // r = [2×15, 30], N = 10, c = 6: three MRO blocks of two nodes.
    let mut r = vec![2usize; 15];
    r.push(30);
    let p = place(PlacePolicy::Mro, &r, 10, 6).unwrap();
    let blocks = mro_structure(&r, 10, 6).block_sizes;
    assert_eq!(blocks, vec![2, 2, 2]);
    let table = [
        (0, 1.0),
        (1, 1.0),
        (2, 0.9333),
        (3, 0.8),
        (4, 0.6143),
        (5, 0.4048),
        (6, 0.2095),
    ];
    for (k, want) in table {
        let closed = mro_closed_form(&blocks, 10, k);
        let ie = mro_inclusion_exclusion(&blocks, 10, k);
        let enumerated = exact(std::slice::from_ref(&p), k).unwrap();
        assert!(
            (closed - want).abs() < 5e-5,
            "k={k}: closed {closed} vs {want}"
        );
        assert!((ie - closed).abs() < 1e-12);
        assert!((enumerated - closed).abs() < 1e-12, "k={k}");
    }
}

/// The closed form equals the §10 inclusion–exclusion for small block sets, every `n` and `k`.
#[test]
fn closed_form_matches_inclusion_exclusion() {
    for blocks in [
        vec![2, 2, 2],
        vec![1, 3],
        vec![2, 3],
        vec![4],
        vec![1, 1, 1, 1],
    ] {
        for n in blocks.iter().sum::<usize>()..12 {
            for k in 0..=n {
                let a = mro_closed_form(&blocks, n, k);
                let b = mro_inclusion_exclusion(&blocks, n, k);
                assert!((a - b).abs() < 1e-12, "{blocks:?} n={n} k={k}: {a} vs {b}");
            }
        }
    }
}

#[test]
fn figure4_plan_b_is_7_of_10_and_plan_a_5_of_10() {
    // 4 experts, 5 nodes, 4 slots, 3 nodes fail. Plan B = MRO with r_1 = 2.
    let b = place(PlacePolicy::Mro, &[2, 4, 6, 8], 5, 4).unwrap();
    assert_eq!(exact_counts(&[b], 3).unwrap(), (7, 10));
    // Plan A recovers only for the surviving pairs (1,2), (1,3), (1,4), (2,4), (2,5) (1-based):
    // expert node sets {1,2}, {2,3,4}, {1,4,5}, all (0-based below).
    let a = grid(
        &[
            &[0, 2, 3, 3],
            &[0, 1, 3, 3],
            &[1, 3, 3, 3],
            &[1, 2, 3, 3],
            &[2, 3, 3, 3],
        ],
        4,
    );
    assert_eq!(exact_counts(&[a], 3).unwrap(), (5, 10));
}

#[test]
fn figure5_case_i_fails_4_of_10_case_ii_7_of_10() {
    // r = [2,2,3,3], c = 2, N = 5, k = 3 (two survivors).
    // Case I (MRO): groups {0,1} on nodes {0,1} and {2,3} on nodes {2,3,4}.
    let case_i = place(PlacePolicy::Mro, &[2, 2, 3, 3], 5, 2).unwrap();
    assert_eq!(mro_structure(&[2, 2, 3, 3], 5, 2).block_sizes, vec![2, 3]);
    assert_eq!(exact_counts(&[case_i], 3).unwrap(), (6, 10));
    assert!((1.0 - mro_closed_form(&[2, 3], 5, 3) - 0.4).abs() < 1e-12);
    // Case II: expert 1's nodes overlap expert 0's only partly ({0,1} vs {1,2}).
    let case_ii = grid(&[&[0, 2], &[0, 1], &[1, 3], &[2, 3], &[2, 3]], 4);
    assert_eq!(exact_counts(&[case_ii], 3).unwrap(), (3, 10));
}

#[test]
fn below_f_failures_always_recover() {
    let loads = [1u64, 1, 1, 1, 2, 4, 10, 20];
    let a = allocate(AllocPolicy::Lazarus, &loads, 60, 2).unwrap();
    for policy in [PlacePolicy::Mro, PlacePolicy::Spread] {
        let p = place(policy, &a.replicas, 10, 6).unwrap();
        assert_eq!(exact(std::slice::from_ref(&p), 0).unwrap(), 1.0);
        assert_eq!(exact(&[p], 1).unwrap(), 1.0, "{policy}");
    }
}

#[test]
fn exact_n32_k6_is_fast_enough_to_test() {
    // The benchmark measures this properly; here only correctness against the closed form.
    let loads: Vec<u64> = (1..=64).map(|x| x * x).collect();
    let a = allocate(AllocPolicy::Lazarus, &loads, 32 * 8, 2).unwrap();
    let p = place(PlacePolicy::Mro, &a.replicas, 32, 8).unwrap();
    let blocks = mro_structure(&a.replicas, 32, 8).block_sizes;
    let e = exact(std::slice::from_ref(&p), 6).unwrap();
    assert!((e - mro_closed_form(&blocks, 32, 6)).abs() < 1e-12);
}

#[test]
fn monte_carlo_agrees_with_exact_and_is_seeded() {
    let mut r = vec![2usize; 15];
    r.push(30);
    let p = place(PlacePolicy::Mro, &r, 10, 6).unwrap();
    let want = exact(std::slice::from_ref(&p), 4).unwrap();
    let mc = monte_carlo(std::slice::from_ref(&p), None, 4, 20_000, 42).unwrap();
    assert!(
        mc.ci_low.unwrap() <= want && want <= mc.ci_high.unwrap(),
        "{mc:?} vs {want}"
    );
    assert_eq!(mc, monte_carlo(&[p], None, 4, 20_000, 42).unwrap());
}

#[test]
fn domain_mode_counts_rack_failures() {
    // 6 nodes in 3 racks of 2; MRO blocks {0,1},{2,3},{4,5}.
    let mut r = vec![2usize; 6];
    r.push(6);
    let p = place(PlacePolicy::Mro, &r, 6, 3).unwrap();
    let racks_aligned = [0, 0, 1, 1, 2, 2]; // each block inside one rack: any rack kills a block
    let racks_striped = [0, 1, 2, 0, 1, 2]; // each block spans two racks
    assert_eq!(
        exact_domains(std::slice::from_ref(&p), &racks_aligned, 1).unwrap(),
        0.0
    );
    assert_eq!(
        exact_domains(std::slice::from_ref(&p), &racks_striped, 1).unwrap(),
        1.0
    );
    let mc = monte_carlo(std::slice::from_ref(&p), Some(&racks_striped), 2, 5000, 1).unwrap();
    let ex = exact_domains(&[p], &racks_striped, 2).unwrap();
    assert!(mc.ci_low.unwrap() <= ex && ex <= mc.ci_high.unwrap());
}

#[test]
fn too_many_failures_is_an_error() {
    let p = place(PlacePolicy::Mro, &[1, 1], 2, 1).unwrap();
    assert!(exact(std::slice::from_ref(&p), 3).is_err());
    assert!(monte_carlo(&[p], None, 3, 10, 0).is_err());
}

// ---------------------------------------------------------------------------------------------
// Brute force over all placements.

/// All multisets of `c` experts out of `e`, as sorted vectors.
fn node_types(e: u32, c: usize) -> Vec<Vec<u32>> {
    fn rec(e: u32, c: usize, start: u32, cur: &mut Vec<u32>, out: &mut Vec<Vec<u32>>) {
        if cur.len() == c {
            out.push(cur.clone());
            return;
        }
        for x in start..e {
            cur.push(x);
            rec(e, c, x, cur, out);
            cur.pop();
        }
    }
    let mut out = Vec::new();
    rec(e, c, 0, &mut Vec::new(), &mut out);
    out
}

/// Best exact recovery count per k over every placement honouring `r` (nodes are
/// interchangeable, so node types are enumerated as non-decreasing sequences).
fn brute_force_best(r: &[usize], nodes: usize, c: usize) -> Vec<u64> {
    let types = node_types(r.len() as u32, c);
    let mut best = vec![0u64; nodes + 1];
    let mut seq: Vec<usize> = Vec::new();
    let mut left = r.to_vec();
    fn rec(
        types: &[Vec<u32>],
        nodes: usize,
        e: usize,
        seq: &mut Vec<usize>,
        left: &mut Vec<usize>,
        best: &mut [u64],
    ) {
        if seq.len() == nodes {
            let grid: Vec<Vec<u32>> = seq.iter().map(|&t| types[t].clone()).collect();
            let p = LayerPlacement::from_grid(grid, e, None).unwrap();
            for (k, b) in best.iter_mut().enumerate() {
                let (ok, _) = exact_counts(std::slice::from_ref(&p), k).unwrap();
                *b = (*b).max(ok);
            }
            return;
        }
        let start = seq.last().copied().unwrap_or(0);
        for t in start..types.len() {
            if types[t].iter().all(|&x| left[x as usize] > 0) {
                // Check multiplicity, not just presence.
                let mut ok = true;
                for &x in &types[t] {
                    if left[x as usize] == 0 {
                        ok = false;
                    }
                    left[x as usize] = left[x as usize].wrapping_sub(1);
                }
                if ok && left.iter().all(|&v| v < usize::MAX / 2) {
                    seq.push(t);
                    rec(types, nodes, e, seq, left, best);
                    seq.pop();
                }
                for &x in &types[t] {
                    left[x as usize] = left[x as usize].wrapping_add(1);
                }
            }
        }
    }
    rec(&types, nodes, r.len(), &mut seq, &mut left, &mut best);
    best
}

/// All replica vectors with each entry ≥ 1 summing to `total`, non-decreasing (rank order).
fn replica_vectors(e: usize, total: usize) -> Vec<Vec<usize>> {
    fn rec(e: usize, total: usize, min: usize, cur: &mut Vec<usize>, out: &mut Vec<Vec<usize>>) {
        if cur.len() == e {
            if total == 0 {
                out.push(cur.clone());
            }
            return;
        }
        let remaining = e - cur.len();
        for x in min..=total {
            if x * remaining > total {
                break;
            }
            cur.push(x);
            rec(e, total - x, x, cur, out);
            cur.pop();
        }
    }
    let mut out = Vec::new();
    rec(e, total, 1, &mut Vec::new(), &mut out);
    out
}

#[test]
fn mro_is_optimal_against_all_placements_of_tiny_clusters() {
    let mut checked = 0;
    let mut counterexamples = Vec::new();
    for nodes in 1..=5usize {
        for c in 1..=3usize {
            for e in 1..=4usize {
                if e > nodes * c {
                    continue;
                }
                for r in replica_vectors(e, nodes * c) {
                    let best = brute_force_best(&r, nodes, c);
                    let mro = place(PlacePolicy::Mro, &r, nodes, c).unwrap();
                    let st = mro_structure(&r, nodes, c);
                    for (k, &b) in best.iter().enumerate() {
                        let (ok, _) = exact_counts(std::slice::from_ref(&mro), k).unwrap();
                        assert!(ok <= b);
                        if ok < b {
                            counterexamples.push((nodes, c, r.clone(), k, ok, b, st.truncated));
                        }
                    }
                    checked += 1;
                }
            }
        }
    }
    for c in &counterexamples {
        eprintln!(
            "MRO below optimum: N={} c={} r={:?} k={}: {} vs best {} (truncated: {})",
            c.0, c.1, c.2, c.3, c.4, c.5, c.6
        );
    }
    eprintln!(
        "checked {checked} replica vectors, {} sub-optimal (r, k) points",
        counterexamples.len()
    );
    // Theorem 1 holds whenever the last MRO block is not truncated by N; every counterexample
    // found is a truncated one (see `theorem1_fails_when_last_block_is_truncated`).
    assert!(checked > 150);
    assert!(
        counterexamples.iter().all(|c| c.6),
        "untruncated MRO was beaten"
    );
}

#[test]
fn theorem1_fails_when_last_block_is_truncated() {
    // N = 3, c = 2, r = [2,2,2]: MRO puts experts 0,1 on nodes {0,1} and expert 2 (block cut to
    // one node) twice on node 2, so losing node 2 is fatal: P(k=1) = 2/3. Yet the cyclic plan
    // {0,1},{1,2},{2,0} keeps every expert on two nodes: P(k=1) = 1.
    let r = [2, 2, 2];
    let st = mro_structure(&r, 3, 2);
    assert!(st.truncated && st.spread_fallback);
    let paper = grid(&[&[0, 1], &[0, 1], &[2, 2]], 3);
    assert_eq!(exact_counts(&[paper], 1).unwrap(), (2, 3));
    let cyclic = grid(&[&[0, 1], &[1, 2], &[0, 2]], 3);
    assert_eq!(exact_counts(&[cyclic], 1).unwrap(), (3, 3));
    // Our guard falls back to spread, which is the cyclic plan here.
    let ours = place(PlacePolicy::Mro, &r, 3, 2).unwrap();
    assert_eq!(exact_counts(&[ours], 1).unwrap(), (3, 3));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// MRO recovers at least as often as spread and compact for every k, on random loads.
    #[test]
    fn mro_dominates_spread_and_compact(
        nodes in 2usize..=10,
        c in 1usize..=5,
        f in 1usize..=3,
        raw in prop::collection::vec(0u64..1000, 1..=12),
        skew in 0u32..3,
    ) {
        let e = raw.len().min(nodes * c);
        let loads: Vec<u64> = raw[..e].iter().map(|x| x.pow(skew + 1)).collect();
        let a = allocate(AllocPolicy::Lazarus, &loads, nodes * c, f).unwrap();
        let mro = place(PlacePolicy::Mro, &a.replicas, nodes, c).unwrap();
        let st = mro_structure(&a.replicas, nodes, c);
        let truncated = st.truncated;
        let spread = place(PlacePolicy::Spread, &a.replicas, nodes, c).unwrap();
        let compact = place(PlacePolicy::Compact, &a.replicas, nodes, c).unwrap();
        for k in 0..=nodes {
            let pm = exact(std::slice::from_ref(&mro), k).unwrap();
            let ps = exact(std::slice::from_ref(&spread), k).unwrap();
            let pc = exact(std::slice::from_ref(&compact), k).unwrap();
            prop_assert!(truncated || pm >= ps - 1e-12, "k={} mro {} < spread {}", k, pm, ps);
            prop_assert!(truncated || pm >= pc - 1e-12, "k={} mro {} < compact {}", k, pm, pc);
            // The closed form is exact for every MRO plan, truncated or not.
            if !st.spread_fallback {
                prop_assert!((mro_closed_form(&st.block_sizes, nodes, k) - pm).abs() < 1e-9);
            }
        }
        // Fewer than f_eff failures never lose an expert under MRO (the guard keeps this
        // true in truncated cases too) nor under spread.
        for k in 0..a.f_effective.min(nodes) {
            prop_assert_eq!(exact(std::slice::from_ref(&mro), k).unwrap(), 1.0);
            prop_assert_eq!(exact(std::slice::from_ref(&spread), k).unwrap(), 1.0);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// The small-k lister agrees with full enumeration on every placement policy.
    #[test]
    fn small_k_matches_exact(
        nodes in 2usize..=9,
        c in 1usize..=4,
        f in 1usize..=3,
        raw in prop::collection::vec(1u64..1000, 1..=10),
        seed in any::<u64>(),
    ) {
        let e = raw.len().min(nodes * c);
        let a = allocate(AllocPolicy::Lazarus, &raw[..e], nodes * c, f).unwrap();
        for policy in [PlacePolicy::Mro, PlacePolicy::Spread, PlacePolicy::Compact, PlacePolicy::Random { seed }] {
            let p = place(policy, &a.replicas, nodes, c).unwrap();
            for k in 0..=nodes.min(3) {
                let want = exact(std::slice::from_ref(&p), k).unwrap();
                let got = exact_small_k(std::slice::from_ref(&p), k).unwrap();
                prop_assert!((want - got).abs() < 1e-12, "{} k={}: {} vs {}", policy, k, got, want);
            }
        }
    }
}
