//! Re-layout baselines: DeepSeek EPLB (global, hierarchical, with the remap post-pass) and
//! FlexMoE-style incremental rounds.

use std::collections::BTreeMap;

use lazarus_planner::LayerPlacement;
use lazarus_planner::recovery;
use lazarus_planner::relayout::eplb::{
    EplbMode, eplb, eplb_hierarchical_groups, eplb_remap, replicate,
};
use lazarus_planner::relayout::flexmoe::flexmoe;
use lazarus_planner::relayout::{Evaluator, LinkModel, Topology, migration, node_view, score};
use proptest::prelude::*;
use rand::rngs::Xoshiro256PlusPlus;
use rand::seq::SliceRandom;
use rand::{RngExt, SeedableRng};

/// EPLB README example (`deepseek-ai/EPLB`): 2 layers, 12 experts.
const README_WEIGHTS: [[u64; 12]; 2] = [
    [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
    [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
];
/// The README's `phy2log` for 16 replicas, 4 groups, 2 nodes, 8 GPUs.
const README_PHY2LOG: [[u32; 16]; 2] = [
    [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
    [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
];
/// 8 GPUs in 2 nodes, 2 slots each: R = 16.
const README_TOPO: Topology = Topology {
    devices: 8,
    devices_per_node: 4,
    slots_per_device: 2,
};

fn link() -> LinkModel {
    LinkModel {
        bytes_per_token: 8192.0,
        intra_node_bytes_per_s: 300e9,
        inter_node_bytes_per_s: 25e9,
        compute_s_per_token: 2e-7,
        bytes_per_expert: 1 << 20,
    }
}

/// All tokens routed from device 0: EPLB only looks at `Σ_d traffic[d][e]`.
fn traffic_from_weights(devices: usize, w: &[u64]) -> Vec<Vec<u64>> {
    let mut t = vec![vec![0; w.len()]; devices];
    t[0] = w.to_vec();
    t
}

/// EPLB's implicit load per device: each copy serves `w_e / cnt_e`.
fn per_copy_device_loads(layout: &LayerPlacement, w: &[u64]) -> Vec<f64> {
    let cnt = layout.replicas();
    layout
        .grid()
        .iter()
        .map(|row| {
            row.iter()
                .map(|&e| w[e as usize] as f64 / cnt[e as usize] as f64)
                .sum()
        })
        .collect()
}

fn max_over_mean(x: &[f64]) -> f64 {
    let max = x.iter().copied().fold(0.0, f64::max);
    max / (x.iter().sum::<f64>() / x.len() as f64)
}

fn sorted_rows(layout: &LayerPlacement) -> Vec<Vec<u32>> {
    let mut rows: Vec<Vec<u32>> = layout
        .grid()
        .iter()
        .map(|r| {
            let mut r = r.to_vec();
            r.sort_unstable();
            r
        })
        .collect();
    rows.sort();
    rows
}

#[test]
fn eplb_reproduces_readme_example() {
    let expected_ratio = [1.21, 1.24];
    for layer in 0..2 {
        let w = &README_WEIGHTS[layer];
        let layout = eplb_hierarchical_groups(README_TOPO, w, 4).unwrap();
        let phy2log: Vec<u32> = layout.grid().cells().to_vec();
        assert_eq!(phy2log, README_PHY2LOG[layer], "layer {layer}");
        let ratio = max_over_mean(&per_copy_device_loads(&layout, w));
        assert!(
            (ratio - expected_ratio[layer]).abs() < 0.005,
            "layer {layer}: max/mean {ratio}"
        );
    }
    let layer0 = eplb_hierarchical_groups(README_TOPO, &README_WEIGHTS[0], 4).unwrap();
    assert_eq!(layer0.replicas(), vec![1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1]);
    // Hierarchical: each expert's copies stay on its group's node.
    assert!(
        node_view(README_TOPO, &layer0)
            .node_sets()
            .iter()
            .all(|s| s.len() == 1)
    );
}

#[test]
fn eplb_global_on_readme_weights() {
    for w in &README_WEIGHTS {
        let traffic = traffic_from_weights(README_TOPO.devices, w);
        let layout = eplb(README_TOPO, &traffic, 12, EplbMode::Global).unwrap();
        let (_, counts) = replicate(w, 16);
        assert_eq!(layout.replicas(), counts);
        assert_eq!(layout.nodes(), 8);
        assert!(layout.grid().iter().all(|row| row.len() == 2));
        assert!(layout.grid().iter().flatten().all(|&e| e < 12));
        // The explicit-groups entry point with one group is the same policy.
        assert_eq!(eplb_hierarchical_groups(README_TOPO, w, 1).unwrap(), layout);
        // Global replication is never worse than the per-node one at balancing copies.
        let hier = eplb_hierarchical_groups(README_TOPO, w, 4).unwrap();
        assert!(
            max_over_mean(&per_copy_device_loads(&layout, w))
                <= max_over_mean(&per_copy_device_loads(&hier, w)) + 1e-9
        );
    }
}

#[test]
fn eplb_rejects_bad_inputs() {
    let topo = Topology {
        devices: 2,
        devices_per_node: 1,
        slots_per_device: 1,
    };
    assert!(eplb(topo, &[vec![1; 3], vec![1; 3]], 3, EplbMode::Global).is_err());
    assert!(eplb(topo, &[vec![1; 2]], 2, EplbMode::Global).is_err());
    assert!(eplb(topo, &[vec![1; 2], vec![1; 3]], 2, EplbMode::Global).is_err());
    assert!(eplb(topo, &[vec![], vec![]], 0, EplbMode::Global).is_err());
    let odd = Topology {
        devices: 3,
        devices_per_node: 2,
        slots_per_device: 1,
    };
    assert!(
        eplb(
            odd,
            &[vec![1; 2], vec![1; 2], vec![1; 2]],
            2,
            EplbMode::Global
        )
        .is_err()
    );
}

#[test]
fn hierarchical_falls_back_to_global_when_experts_do_not_split() {
    let topo = Topology {
        devices: 4,
        devices_per_node: 2,
        slots_per_device: 2,
    };
    let traffic = traffic_from_weights(4, &[50, 10, 30, 7, 3]);
    let h = eplb(topo, &traffic, 5, EplbMode::Hierarchical).unwrap();
    let g = eplb(topo, &traffic, 5, EplbMode::Global).unwrap();
    assert_eq!(h, g);
}

#[test]
fn hierarchical_eplb_loses_experts_on_one_node_failure() {
    // 2 nodes × 2 devices × 2 slots, 4 experts → groups {0,1} and {2,3}, one per node.
    let topo = Topology {
        devices: 4,
        devices_per_node: 2,
        slots_per_device: 2,
    };
    let traffic = vec![
        vec![40, 5, 30, 1],
        vec![20, 10, 9, 2],
        vec![7, 3, 25, 8],
        vec![1, 1, 1, 1],
    ];
    let layout = eplb(topo, &traffic, 4, EplbMode::Hierarchical).unwrap();
    let view = node_view(topo, &layout);
    for (e, nodes) in view.node_sets().iter().enumerate() {
        assert_eq!(nodes.len(), 1, "expert {e} spans nodes {nodes:?}");
    }
    let p = recovery::exact(&[view], 1).unwrap();
    assert!(p < 1.0, "a node failure must lose experts, got P = {p}");
    // Global mode spreads the hot experts' copies and may survive; it is at least as good.
    let global = eplb(topo, &traffic, 4, EplbMode::Global).unwrap();
    assert!(recovery::exact(&[node_view(topo, &global)], 1).unwrap() >= p);
}

#[test]
fn eplb_remap_moves_fewer_states_on_a_shifted_layout() {
    // The current layout is EPLB's own, with devices rotated: remap must undo the rotation.
    let topo = README_TOPO;
    let traffic = traffic_from_weights(8, &README_WEIGHTS[0]);
    let fresh = eplb(topo, &traffic, 12, EplbMode::Global).unwrap();
    let perm: Vec<usize> = (0..8).map(|d| (d + 3) % 8).collect();
    let current = fresh.permute_nodes(&perm);
    let remapped = eplb_remap(topo, &traffic, &current, EplbMode::Global).unwrap();
    let link = link();
    assert_eq!(migration(&current, &remapped, &link).unwrap().replicas, 0);
    assert!(migration(&current, &fresh, &link).unwrap().replicas > 0);
    assert_eq!(remapped, current);
}

/// 2 nodes × 2 devices × 4 slots, 4 experts × 4 copies; expert 0 gets 90 % of the tokens.
fn skewed_case() -> (Topology, Vec<Vec<u64>>, LayerPlacement) {
    let topo = Topology {
        devices: 4,
        devices_per_node: 2,
        slots_per_device: 4,
    };
    let grid = vec![
        vec![0, 0, 1, 1],
        vec![2, 2, 3, 3],
        vec![0, 0, 1, 1],
        vec![2, 2, 3, 3],
    ];
    let current = LayerPlacement::from_grid(grid, 4, Some(&[4, 4, 4, 4])).unwrap();
    // 900 of every 1000 tokens on each device go to expert 0.
    let traffic = vec![vec![900, 34, 33, 33]; 4];
    (topo, traffic, current)
}

#[test]
fn flexmoe_improves_a_skewed_layout() {
    let (topo, traffic, current) = skewed_case();
    let link = link();
    let before = Evaluator::new(topo, link, &traffic, &current).unwrap();
    let out = flexmoe(topo, link, &traffic, &current, 10).unwrap();
    let after = Evaluator::new(topo, link, &traffic, &out).unwrap();
    let ratio = |ev: &Evaluator| {
        let l = ev.device_load();
        l.iter().copied().fold(0.0, f64::max) / l.iter().copied().fold(f64::INFINITY, f64::min)
    };
    assert!(
        ratio(&after) < ratio(&before),
        "{} !< {}",
        ratio(&after),
        ratio(&before)
    );
    assert!(after.score().step_time_s <= before.score().step_time_s);
    assert!(out.replicas()[0] > 4, "the hot expert gained copies");
    assert!(out.replicas().iter().all(|&c| c >= 1));
    // One round moves at most one copy per node.
    let one = flexmoe(topo, link, &traffic, &current, 1).unwrap();
    assert!(changed_slots(&current, &one) <= topo.nodes());
    assert_eq!(flexmoe(topo, link, &traffic, &current, 0).unwrap(), current);
}

#[test]
fn flexmoe_leaves_a_balanced_layout_alone() {
    let topo = Topology {
        devices: 4,
        devices_per_node: 2,
        slots_per_device: 2,
    };
    let current = LayerPlacement::from_grid(vec![vec![0, 1]; 4], 2, None).unwrap();
    let traffic = vec![vec![70, 30]; 4];
    assert_eq!(
        flexmoe(topo, link(), &traffic, &current, 10).unwrap(),
        current
    );
}

#[test]
fn flexmoe_rejects_a_layout_missing_an_expert() {
    let topo = Topology {
        devices: 2,
        devices_per_node: 1,
        slots_per_device: 1,
    };
    let current = LayerPlacement::from_grid(vec![vec![0], vec![0]], 2, None).unwrap();
    assert!(flexmoe(topo, link(), &[vec![1, 1], vec![1, 1]], &current, 10).is_err());
}

fn changed_slots(a: &LayerPlacement, b: &LayerPlacement) -> usize {
    a.grid()
        .iter()
        .flatten()
        .zip(b.grid().iter().flatten())
        .filter(|(x, y)| x != y)
        .count()
}

/// A random topology, expert count, traffic and current layout (every expert ≥ 1 copy).
fn instance(seed: u64) -> (Topology, usize, Vec<Vec<u64>>, LayerPlacement) {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let devices_per_node = rng.random_range(1..=4usize);
    let nodes = rng.random_range(1..=16 / devices_per_node);
    let devices = nodes * devices_per_node;
    let slots_per_device = rng.random_range(1..=4usize);
    let slots = devices * slots_per_device;
    let experts = rng.random_range(1..=slots);
    let skew = rng.random_range(0..3u32);
    let traffic: Vec<Vec<u64>> = (0..devices)
        .map(|_| {
            (0..experts)
                .map(|e| match skew {
                    0 => rng.random_range(0..1000u64),
                    1 if e == 0 => rng.random_range(5_000..20_000u64),
                    _ => rng.random_range(0..3u64) * rng.random_range(0..50u64),
                })
                .collect()
        })
        .collect();
    let mut ids: Vec<u32> = (0..experts as u32).collect();
    ids.extend((experts..slots).map(|_| rng.random_range(0..experts as u32)));
    ids.shuffle(&mut rng);
    let grid: Vec<Vec<u32>> = ids.chunks(slots_per_device).map(<[u32]>::to_vec).collect();
    let current = LayerPlacement::from_grid(grid, experts, None).unwrap();
    let topo = Topology {
        devices,
        devices_per_node,
        slots_per_device,
    };
    (topo, experts, traffic, current)
}

fn check_shape(topo: Topology, experts: usize, layout: &LayerPlacement) {
    assert_eq!(layout.nodes(), topo.devices);
    assert_eq!(layout.experts(), experts);
    assert!(
        layout
            .grid()
            .iter()
            .all(|r| r.len() == topo.slots_per_device)
    );
    assert!(
        layout
            .grid()
            .iter()
            .flatten()
            .all(|&e| (e as usize) < experts)
    );
    assert!(layout.replicas().iter().all(|&c| c >= 1));
}

fn row_multiset(layout: &LayerPlacement) -> BTreeMap<Vec<u32>, usize> {
    let mut m = BTreeMap::new();
    for r in sorted_rows(layout) {
        *m.entry(r).or_insert(0) += 1;
    }
    m
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn baselines_are_valid_layouts(seed in any::<u64>()) {
        let (topo, experts, traffic, current) = instance(seed);
        let link = link();
        let w: Vec<u64> = (0..experts).map(|e| traffic.iter().map(|r| r[e]).sum()).collect();
        for mode in [EplbMode::Global, EplbMode::Hierarchical] {
            let fresh = eplb(topo, &traffic, experts, mode).unwrap();
            check_shape(topo, experts, &fresh);
            let remapped = eplb_remap(topo, &traffic, &current, mode).unwrap();
            check_shape(topo, experts, &remapped);
            prop_assert_eq!(row_multiset(&fresh), row_multiset(&remapped));
            // Slot order inside a device is kept, too: the rows are permuted whole.
            let mut a = fresh.grid().to_vec();
            let mut b = remapped.grid().to_vec();
            a.sort();
            b.sort();
            prop_assert_eq!(a, b);
            let moved_fresh = migration(&current, &fresh, &link).unwrap().replicas;
            let moved_remap = migration(&current, &remapped, &link).unwrap().replicas;
            prop_assert!(moved_remap <= moved_fresh, "{} > {}", moved_remap, moved_fresh);
            if mode == EplbMode::Hierarchical && experts % topo.nodes() == 0 {
                prop_assert!(node_view(topo, &fresh).node_sets().iter().all(|s| s.len() == 1));
            }
        }
        // Global EPLB's counts are exactly `replicate`'s.
        let global = eplb(topo, &traffic, experts, EplbMode::Global).unwrap();
        prop_assert_eq!(global.replicas(), replicate(&w, topo.devices * topo.slots_per_device).1);

        let max_rounds = 10;
        let out = flexmoe(topo, link, &traffic, &current, max_rounds).unwrap();
        check_shape(topo, experts, &out);
        let before = score(topo, link, &traffic, &current).unwrap().step_time_s;
        let after = score(topo, link, &traffic, &out).unwrap().step_time_s;
        prop_assert!(after <= before * (1.0 + 1e-9) + 1e-15, "{} > {}", after, before);
        prop_assert!(changed_slots(&current, &out) <= max_rounds * topo.nodes());
        // Only copies move between experts; the slot structure is untouched.
        let one = flexmoe(topo, link, &traffic, &current, 1).unwrap();
        prop_assert!(changed_slots(&current, &one) <= topo.nodes());
    }
}
