//! Recovery under GPU, node and rack failures (`gpu_failures`): against brute force on small
//! clusters, against the node-level methods where they must agree, and the ordering "a GPU
//! failure never hurts more than a node failure".

use lazarus_planner::gpu_failures::{
    MixedFailureModel, MixedFailures, gpu_critical_sets, gpu_recovery,
};
use lazarus_planner::place::{LayerPlacement, PlacePolicy, place};
use lazarus_planner::recovery::{exact, recovery_auto};
use lazarus_planner::{AllocPolicy, allocate};
use proptest::prelude::*;

/// One layer per load vector: Eq. 1 allocation with `f`, then `policy`.
fn plan(
    loads: &[Vec<u64>],
    nodes: usize,
    slots: usize,
    f: usize,
    policy: PlacePolicy,
) -> Vec<LayerPlacement> {
    loads
        .iter()
        .map(|l| {
            let a = allocate(AllocPolicy::Lazarus, l, nodes * slots, f).unwrap();
            place(policy, &a.replicas, nodes, slots).unwrap()
        })
        .collect()
}

/// Visits every `k`-subset of `0..n` as a bitmask (n ≤ 20 here).
fn subsets(n: usize, k: usize, mut f: impl FnMut(u64)) {
    for m in 0u64..(1 << n) {
        if m.count_ones() as usize == k {
            f(m);
        }
    }
}

/// Exact probability of a mixed draw by listing every node subset × GPU subset (rack-free).
fn brute_mixed(layers: &[LayerPlacement], g: usize, f: MixedFailures) -> f64 {
    let nodes = layers[0].nodes();
    let sets = gpu_critical_sets(layers, g, nodes * g).unwrap();
    let masks: Vec<u64> = sets
        .iter()
        .map(|s| s.iter().fold(0u64, |m, &u| m | 1 << u))
        .collect();
    let (mut ok, mut all) = (0u64, 0u64);
    subsets(nodes, f.nodes, |nm| {
        let mut node_gpus = 0u64;
        for n in 0..nodes {
            if nm >> n & 1 == 1 {
                node_gpus |= ((1u64 << g) - 1) << (n * g);
            }
        }
        subsets(nodes * g, f.gpus, |gm| {
            let dead = node_gpus | gm;
            all += 1;
            if masks.iter().all(|&s| s & !dead != 0) {
                ok += 1;
            }
        });
    });
    ok as f64 / all as f64
}

fn loads_strategy() -> impl Strategy<Value = Vec<Vec<u64>>> {
    prop::collection::vec(prop::collection::vec(1u64..1000, 5), 1..3)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// One GPU per node: GPU failures are node failures.
    #[test]
    fn one_gpu_per_node_is_node_failure(
        loads in loads_strategy(),
        nodes in 3usize..9,
        k in 0usize..4,
        seed in any::<u64>(),
    ) {
        let k = k.min(nodes);
        let layers = plan(&loads, nodes, 4, 2, PlacePolicy::Random { seed });
        let a = gpu_recovery(&layers, 1, k, 1).unwrap();
        let b = recovery_auto(&layers, k, 1).unwrap();
        prop_assert!(a.trials.is_none() && b.trials.is_none());
        prop_assert!((a.probability - b.probability).abs() < 1e-12, "{a:?} vs {b:?}");
    }

    /// Exact GPU-failure recovery equals brute force over all GPU subsets, and is never below
    /// the node-failure probability for the same count.
    #[test]
    fn gpu_recovery_is_exact_and_no_worse_than_nodes(
        loads in loads_strategy(),
        nodes in 3usize..6,
        g in prop::sample::select(vec![2usize, 4]),
        k in 1usize..4,
        mro in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let policy = if mro { PlacePolicy::Mro } else { PlacePolicy::Random { seed } };
        let layers = plan(&loads, nodes, 4, 2, policy);
        let k = k.min(nodes);
        let got = gpu_recovery(&layers, g, k, 7).unwrap();
        prop_assert!(got.trials.is_none());
        let want = brute_mixed(&layers, g, MixedFailures { gpus: k, ..Default::default() });
        prop_assert!((got.probability - want).abs() < 1e-12, "{} vs {want}", got.probability);
        let node = exact(&layers, k).unwrap();
        prop_assert!(got.probability >= node - 1e-12, "gpu {} < node {node}", got.probability);
    }
}

/// The mixed sampler agrees with brute force on a mix of node and GPU failures (within 5
/// standard errors), and with the node methods when only nodes fail.
#[test]
fn mixed_monte_carlo_matches_brute_force() {
    let loads = vec![
        vec![5u64, 900, 40, 300, 7, 60],
        vec![100, 100, 100, 100, 100, 100],
    ];
    let layers = plan(&loads, 5, 4, 2, PlacePolicy::Mro);
    let trials = 200_000u64;
    for f in [
        MixedFailures {
            gpus: 2,
            nodes: 1,
            racks: 0,
        },
        MixedFailures {
            gpus: 3,
            nodes: 0,
            racks: 0,
        },
        MixedFailures {
            gpus: 0,
            nodes: 2,
            racks: 0,
        },
        MixedFailures {
            gpus: 1,
            nodes: 2,
            racks: 0,
        },
    ] {
        let want = brute_mixed(&layers, 2, f);
        let m = MixedFailureModel::new(&layers, 2, None, f).unwrap();
        let got = m.monte_carlo(trials, 3).unwrap();
        let se = (want * (1.0 - want) / trials as f64).sqrt().max(1e-9);
        assert!(
            (got.probability - want).abs() < 5.0 * se + 1e-12,
            "{f:?}: mc {} vs exact {want}",
            got.probability
        );
        if f.gpus == 0 {
            let node = exact(&layers, f.nodes).unwrap();
            assert!((want - node).abs() < 1e-12);
        }
        // Same seed, same estimate.
        assert_eq!(got, m.monte_carlo(trials, 3).unwrap());
    }
}

/// A rack failure is the failure of its nodes: racks of one node are nodes, and racks of
/// two nodes that hold both replicas of an expert lose it.
#[test]
fn rack_failures_are_their_nodes() {
    let loads = vec![vec![10u64, 10, 10, 10, 10, 10, 10, 10]];
    let layers = plan(&loads, 8, 2, 2, PlacePolicy::Mro);
    let singleton: Vec<usize> = (0..8).collect();
    let by_rack = MixedFailureModel::new(
        &layers,
        2,
        Some(&singleton),
        MixedFailures {
            racks: 2,
            ..Default::default()
        },
    )
    .unwrap()
    .monte_carlo(100_000, 5)
    .unwrap();
    let by_node = exact(&layers, 2).unwrap();
    let se = (by_node * (1.0 - by_node) / 1e5).sqrt().max(1e-9);
    assert!((by_rack.probability - by_node).abs() < 5.0 * se);
    // MRO puts each expert's two replicas on a pair of neighbouring nodes; racks that are
    // those pairs make one rack failure fatal, racks that split them do not.
    let grid = layers[0].grid();
    let pair_of = |n: usize| grid[n].to_vec();
    assert_eq!(pair_of(0), pair_of(1), "MRO block of two nodes");
    let aligned: Vec<usize> = (0..8).map(|n| n / 2).collect();
    let split: Vec<usize> = (0..8).map(|n| n % 4).collect();
    let one_rack = MixedFailures {
        racks: 1,
        ..Default::default()
    };
    let p = |racks: &[usize]| {
        MixedFailureModel::new(&layers, 2, Some(racks), one_rack)
            .unwrap()
            .monte_carlo(20_000, 1)
            .unwrap()
            .probability
    };
    assert_eq!(p(&aligned), 0.0);
    assert_eq!(p(&split), 1.0);
}

/// At scale: 2,048 nodes x 8 GPUs, 58 layers of 256 experts, f = 2. Any 8 GPU failures
/// are survived far more often than any 8 node failures.
#[test]
fn gpu_failures_at_2048_nodes() {
    let experts = 256;
    let loads: Vec<Vec<u64>> = (0..4)
        .map(|l| {
            (0..experts as u64)
                .map(|e| 1 + (e * 7919 + l * 104_729) % 5000)
                .collect()
        })
        .collect();
    let layers = plan(&loads, 2048, 32, 2, PlacePolicy::Mro);
    let gpu = gpu_recovery(&layers, 8, 8, 1).unwrap();
    let node = recovery_auto(&layers, 8, 1).unwrap();
    assert!(gpu.probability >= node.probability, "{gpu:?} vs {node:?}");
    assert!(gpu.probability > 0.999, "{gpu:?}");
}
