//! Re-layout policies: constraints always hold, migration accounting equals the transfers,
//! LAER's objective never increases after an accepted action, and the schedule's hysteresis.

use lazarus_planner::recovery::exact_small_k;
use lazarus_planner::relayout::laer::{Action, LaerParams, decision_cost, laer};
use lazarus_planner::relayout::policy::{RelayoutPolicy, Schedule, relayout};
use lazarus_planner::relayout::{LinkModel, Topology, migration, node_view, score};
use lazarus_planner::{LayerPlacement, PlacePolicy, place};
use proptest::prelude::*;

fn link() -> LinkModel {
    LinkModel {
        bytes_per_token: 2048.0,
        intra_node_bytes_per_s: 400e9,
        inter_node_bytes_per_s: 40e9,
        compute_s_per_token: 2e-9,
        bytes_per_expert: 100_000_000,
    }
}

/// Equal replica counts spread round-robin over nodes, each node's slots split over devices.
fn start_layout(topo: Topology, experts: usize) -> LayerPlacement {
    let slots = topo.devices * topo.slots_per_device;
    let mut r = vec![slots / experts; experts];
    for x in r.iter_mut().take(slots % experts) {
        *x += 1;
    }
    let nodes = place(
        PlacePolicy::Spread,
        &r,
        topo.nodes(),
        topo.devices_per_node * topo.slots_per_device,
    )
    .unwrap();
    let grid: Vec<Vec<u32>> = nodes
        .grid()
        .iter()
        .flat_map(|row| row.chunks(topo.slots_per_device).map(<[u32]>::to_vec))
        .collect();
    LayerPlacement::from_grid(grid, experts, Some(&r)).unwrap()
}

/// Zipf-like traffic with a per-device jitter.
fn traffic(topo: Topology, experts: usize, skew: f64, seed: u64) -> Vec<Vec<u64>> {
    (0..topo.devices)
        .map(|d| {
            (0..experts)
                .map(|e| {
                    let base = 100_000.0 / ((e + 1) as f64).powf(skew);
                    let jitter =
                        ((seed ^ (d * 31 + e) as u64).wrapping_mul(0x9E37_79B9) >> 40) % 100;
                    base as u64 + jitter
                })
                .collect()
        })
        .collect()
}

fn distinct_nodes(topo: Topology, layout: &LayerPlacement) -> Vec<usize> {
    node_view(topo, layout)
        .node_sets()
        .iter()
        .map(Vec::len)
        .collect()
}

fn replay(current: &LayerPlacement, actions: &[Action], experts: usize) -> Vec<LayerPlacement> {
    let mut grid = current.grid().to_vec();
    let mut out = Vec::new();
    let swap_in = |row: &mut Vec<u32>, from: u32, to: u32| {
        let i = row.iter().position(|&x| x == from).unwrap();
        row[i] = to;
    };
    for &a in actions {
        match a {
            Action::Replace { device, evict, add } => swap_in(&mut grid[device], evict, add),
            Action::Swap {
                device_a,
                expert_a,
                device_b,
                expert_b,
            } => {
                swap_in(&mut grid[device_a], expert_a, expert_b);
                swap_in(&mut grid[device_b], expert_b, expert_a);
            }
        }
        out.push(LayerPlacement::from_grid(grid.clone(), experts, None).unwrap());
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn laer_keeps_every_constraint_and_never_increases_its_objective(
        nodes in 1usize..=4,
        dpn in 1usize..=3,
        slots in 1usize..=4,
        experts_frac in 0.2f64..=1.0,
        f in 1usize..=3,
        skew in 0.0f64..2.0,
        floor in 0.0f64..=1.0,
        cap_experts in 1u64..=20,
        seed in any::<u64>(),
    ) {
        let topo = Topology { devices: nodes * dpn, devices_per_node: dpn, slots_per_device: slots };
        let max_e = (topo.devices * slots / f).max(1);
        let experts = ((max_e as f64 * experts_frac) as usize).clamp(1, max_e);
        let current = start_layout(topo, experts);
        let t = traffic(topo, experts, skew, seed);
        let params = LaerParams {
            f,
            recovery_floor: floor,
            max_bytes: cap_experts * link().bytes_per_expert,
            ..LaerParams::default()
        };
        let out = laer(topo, link(), &t, Some(&t), &current, &params).unwrap();
        let new = &out.layout;
        // Slots: same shape, every slot a valid expert.
        prop_assert_eq!(new.nodes(), topo.devices);
        prop_assert!(new.grid().iter().all(|d| d.len() == slots));
        // ≥ f replicas where the start had them; distinct nodes kept up to f.
        let (r0, r1) = (current.replicas(), new.replicas());
        let (n0, n1) = (distinct_nodes(topo, &current), distinct_nodes(topo, new));
        for e in 0..experts {
            prop_assert!(r1[e] >= f.min(r0[e]), "expert {} replicas {} -> {}", e, r0[e], r1[e]);
            prop_assert!(n1[e] >= f.min(n0[e]), "expert {} nodes {} -> {}", e, n0[e], n1[e]);
        }
        // Recovery floor at k = f node failures (relative to the start when it was lower).
        let k = f.min(topo.nodes());
        let p0 = exact_small_k(&[node_view(topo, &current)], k).unwrap();
        let p1 = exact_small_k(&[node_view(topo, new)], k).unwrap();
        prop_assert!(p1 + 1e-12 >= floor.min(p0), "recovery {} -> {} (floor {})", p0, p1, floor);
        // Migration accounting equals the sum of the transfers, within the byte cap.
        let m = migration(&current, new, &link()).unwrap();
        prop_assert_eq!(m.replicas, m.transfers.len() as u64);
        prop_assert_eq!(m.bytes, m.replicas * link().bytes_per_expert);
        prop_assert!(m.bytes <= params.max_bytes);
        for &(e, src, dst) in &m.transfers {
            prop_assert!(current.grid()[src as usize].contains(&e), "source lacks {}", e);
            prop_assert!(new.grid()[dst as usize].contains(&e));
            prop_assert!(!current.grid()[dst as usize].contains(&e));
        }
        // The objective strictly decreases with every accepted action.
        let mut last = decision_cost(topo, link(), &t, &current, &current, &params).unwrap();
        prop_assert!((last - out.cost_before).abs() <= 1e-9 * last.max(1.0));
        for l in replay(&current, &out.actions, experts) {
            let c = decision_cost(topo, link(), &t, &current, &l, &params).unwrap();
            prop_assert!(c < last + 1e-12, "cost rose {} -> {}", last, c);
            last = c;
        }
        prop_assert!(out.cost_after <= out.cost_before);
    }

    /// Every policy returns a full layout with every expert present, and its migration
    /// accounting adds up.
    #[test]
    fn every_policy_returns_a_valid_layout(
        nodes in 1usize..=4,
        dpn in 1usize..=2,
        slots in 1usize..=3,
        skew in 0.0f64..2.0,
        seed in any::<u64>(),
    ) {
        let topo = Topology { devices: nodes * dpn, devices_per_node: dpn, slots_per_device: slots };
        let experts = (topo.devices * slots / 2).max(1);
        let current = start_layout(topo, experts);
        let t = traffic(topo, experts, skew, seed);
        for name in ["static", "lazarus", "eplb", "eplb-hier", "eplb-remap", "flexmoe", "laer"] {
            let p: RelayoutPolicy = name.parse().unwrap();
            let d = relayout(&p, topo, link(), &t, None, &current, 1).unwrap();
            prop_assert!(d.layout.grid().iter().all(|row| row.len() == slots), "{}", name);
            prop_assert!(d.layout.replicas().iter().all(|&r| r >= 1), "{}", name);
            prop_assert_eq!(d.migration.bytes, d.migration.transfers.len() as u64 * link().bytes_per_expert);
            if name == "static" {
                prop_assert_eq!(d.migration.replicas, 0);
            }
            if name == "flexmoe" {
                prop_assert!(d.after.step_time_s <= d.before.step_time_s + 1e-12, "{}", name);
            }
            // LAER guarantees that its objective (the smooth step time plus the migration
            // pause) never rises, not the bare max: the max may rise by a hair while the power
            // mean falls (the saved regression: 5.466104e-2 -> 5.466123e-2 s, the same before
            // and after the per-round caches).
            if name == "laer" {
                prop_assert!(
                    d.after.smooth_step_time_s <= d.before.smooth_step_time_s + 1e-12,
                    "{}", name
                );
            }
        }
    }
}

#[test]
fn laer_balances_a_hot_expert_and_moves_less_than_eplb() {
    let topo = Topology {
        devices: 16,
        devices_per_node: 4,
        slots_per_device: 2,
    };
    let experts = 8;
    let current = start_layout(topo, experts);
    let t = traffic(topo, experts, 1.5, 7);
    let before = score(topo, link(), &t, &current).unwrap();
    let params = LaerParams {
        f: 2,
        recovery_floor: 0.9,
        ..LaerParams::default()
    };
    let l = relayout(
        &RelayoutPolicy::Laer(params),
        topo,
        link(),
        &t,
        None,
        &current,
        2,
    )
    .unwrap();
    let e = relayout(
        &"eplb".parse().unwrap(),
        topo,
        link(),
        &t,
        None,
        &current,
        2,
    )
    .unwrap();
    assert!(
        l.after.load_ratio < before.load_ratio * 0.8,
        "{before:?} -> {:?}",
        l.after
    );
    assert!(l.migration.bytes < e.migration.bytes);
    // EPLB gives cold experts one copy: a single node failure can lose them; LAER cannot.
    let k1 =
        |x: &LayerPlacement| lazarus_planner::recovery::exact(&[node_view(topo, x)], 1).unwrap();
    assert_eq!(k1(&l.layout), 1.0);
    assert!(k1(&e.layout) < 1.0);
}

#[test]
fn schedule_has_warmup_period_and_hysteresis() {
    let s = Schedule {
        warmup_steps: 400,
        period_steps: 200,
        imbalance_threshold: 1.2,
    };
    assert!(!s.due(200, 3.0), "warm-up");
    assert!(s.due(400, 1.5));
    assert!(!s.due(500, 1.5), "between periods");
    assert!(!s.due(600, 1.1), "hysteresis");
    assert!(s.due(600, 1.21));
}
