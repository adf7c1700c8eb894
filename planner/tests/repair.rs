//! Property tests of repair-first recovery ([`lazarus_planner::repair`], issue 42): after any
//! sequence of losses and joins, every expert keeps `min(f, N)` distinct nodes, every node has
//! exactly its slots, transfers go only into slots whose content changed and copy at most what
//! was lost plus the newcomers' slots; the re-optimisation (the full replan from the repaired
//! holdings) gives the replan's layout.

use lazarus_planner::migrate::{Holders, MappingMethod, PhysicalNode, lost_experts};
use lazarus_planner::repair::{RepairError, RepairOptions, repair_held};
use lazarus_planner::{
    Alignment, AllocPolicy, ClusterSpec, ModelPlan, ModelSpec, PlacePolicy, ReplanOptions,
    plan_model, replan,
};
use proptest::prelude::*;

/// Distinct nodes holding each expert of `layer` in `rows[node][layer]`.
fn distinct(rows: &[Vec<Vec<u32>>], layer: usize, experts: usize) -> Vec<usize> {
    let mut d = vec![0; experts];
    for r in rows {
        let mut seen = r[layer].clone();
        seen.sort_unstable();
        seen.dedup();
        seen.iter().for_each(|&e| d[e as usize] += 1);
    }
    d
}

/// Distinct experts of `new` that `old` does not hold: a node copies an expert once, however
/// many of its slots hold it.
fn newly_held(new: &[u32], old: &[u32]) -> usize {
    let mut n = new.to_vec();
    n.sort_unstable();
    n.dedup();
    n.iter().filter(|e| !old.contains(e)).count()
}

/// Eq. 1 + MRO with `mapping`, states of 10 bytes.
fn replan_options(mapping: MappingMethod) -> ReplanOptions {
    ReplanOptions {
        alloc: AllocPolicy::Lazarus,
        place: PlacePolicy::Mro,
        mapping,
        bytes_per_expert: 10,
    }
}

/// Eq. 1 + MRO on `nodes × slots`, aligned.
fn first_plan(nodes: usize, slots: usize, model: &ModelSpec, loads: &[Vec<u64>]) -> ModelPlan {
    plan_model(
        &ClusterSpec::new(nodes, slots),
        model,
        loads,
        AllocPolicy::Lazarus,
        PlacePolicy::Mro,
        Alignment::Aligned,
    )
    .unwrap()
}

#[derive(Debug, Clone)]
enum Step {
    /// Lose the nodes at these positions (mod the current count; at least one node stays).
    Lose(Vec<usize>),
    /// This many blank nodes join.
    Join(usize),
}

fn steps() -> impl Strategy<Value = Vec<Step>> {
    prop::collection::vec(
        prop_oneof![
            prop::collection::vec(0usize..64, 1..3).prop_map(Step::Lose),
            (1usize..3).prop_map(Step::Join),
        ],
        1..8,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn repair_keeps_floors_and_moves_only_what_changed(
        experts in 2usize..10,
        layers in 1usize..3,
        slots in 1usize..5,
        f in 1usize..4,
        extra_nodes in 0usize..4,
        skew in prop::collection::vec(0u64..1000, 10),
        slack in prop_oneof![Just(0.0), Just(0.5), Just(1.0)],
        events in steps(),
    ) {
        let model = ModelSpec { experts, layers, f };
        let nodes = (experts * f).div_ceil(slots).max(1) + extra_nodes;
        let loads: Vec<Vec<u64>> = (0..layers)
            .map(|l| (0..experts).map(|e| skew[(e + l) % skew.len()]).collect())
            .collect();
        let mut plan = first_plan(nodes, slots, &model, &loads);
        let mut next_id = nodes as u32;
        let options = RepairOptions { load_slack: slack, bytes_per_expert: 10 };
        for ev in events {
            let mut physical = plan.physical_nodes();
            // Replicas under the floor before the event (a plan made when slots were short).
            let rows_before = plan.plan_node_contents();
            let mut newcomer_slots = 0usize;
            let mut lost_replicas = vec![vec![0usize; experts]; layers];
            match ev {
                Step::Lose(pos) => {
                    for p in pos {
                        if physical.len() <= 1 {
                            break;
                        }
                        let gone = physical.remove(p % physical.len());
                        for (l, row) in gone.holdings.iter().enumerate() {
                            row.iter().for_each(|&e| lost_replicas[l][e as usize] += 1);
                        }
                    }
                }
                Step::Join(k) => {
                    for _ in 0..k {
                        physical.push(PhysicalNode { id: next_id, holdings: Vec::new() });
                        next_id += 1;
                        newcomer_slots += slots * layers;
                    }
                }
            }
            // An expert with no replica left is a restore, not a repair.
            if !lost_experts(&physical, layers, experts).is_empty() {
                break;
            }
            let n = physical.len();
            let floor = f.min(n);
            let repaired = match repair_held(
                Holders::Nodes(&physical),
                &plan,
                &model,
                &loads,
                &options,
                plan.version + 1,
            ) {
                Ok(r) => r,
                // Only when the floors cannot fit the slots at all... or no donor row exists
                // for the distinct-node rule: then the machine replans.
                Err(RepairError::NoDonor { .. }) => {
                    let opts = replan_options(MappingMethod::Optimal);
                    let (p, _) = replan(&physical, slots, &model, &loads, &opts, plan.version).unwrap();
                    plan = p;
                    continue;
                }
                Err(e) => panic!("repair failed: {e}"),
            };
            let new_rows = repaired.plan.plan_node_contents();
            prop_assert_eq!(&repaired.plan.node_map, &physical.iter().map(|p| p.id).collect::<Vec<_>>());
            // Every slot booked once: each node has exactly `slots` experts per layer.
            for row in &new_rows {
                prop_assert_eq!(row.len(), layers);
                prop_assert!(row.iter().all(|r| r.len() == slots));
            }
            // Floors.
            for l in 0..layers {
                let d = distinct(&new_rows, l, experts);
                prop_assert!(
                    d.iter().all(|&x| x >= floor),
                    "layer {} distinct {:?} floor {}", l, d, floor
                );
            }
            // Transfers exactly the slots whose content changed, each from a holder.
            let mut changed = 0usize;
            for (p, node) in physical.iter().enumerate() {
                for (l, new) in new_rows[p].iter().enumerate() {
                    let old = node.holdings.get(l).map_or(&[][..], Vec::as_slice);
                    changed += newly_held(new, old);
                }
            }
            prop_assert_eq!(repaired.migration.transfers.len(), changed);
            for t in &repaired.migration.transfers {
                let src = physical.iter().find(|p| p.id == t.src).unwrap();
                prop_assert!(src.holdings[t.layer as usize].contains(&t.expert));
                let dst = physical.iter().position(|p| p.id == t.dst).unwrap();
                prop_assert!(new_rows[dst][t.layer as usize].contains(&t.expert));
                let before = physical[dst].holdings.get(t.layer as usize).is_some_and(|h| h.contains(&t.expert));
                prop_assert!(!before, "a transfer into a node that holds the expert");
            }
            // At most the lost replicas plus the newcomers' slots, plus the floor deficit the
            // plan had before the event (a plan made when slots were short of `f`).
            let lost: usize = lost_replicas.iter().flatten().sum();
            let deficit: usize = (0..layers)
                .map(|l| {
                    distinct(&rows_before, l, experts)
                        .iter()
                        .map(|&d| floor.saturating_sub(d))
                        .sum::<usize>()
                })
                .sum();
            prop_assert!(
                repaired.migration.transfers.len() <= lost + newcomer_slots + deficit,
                "{} transfers for {} lost + {} newcomer slots + {} under the floor",
                repaired.migration.transfers.len(), lost, newcomer_slots, deficit
            );
            let s = repaired.stats;
            prop_assert!(s.copies() as usize >= repaired.migration.transfers.len());
            // Survivors changed only the slots given up to re-created replicas.
            let survivor_changes: usize = physical
                .iter()
                .enumerate()
                .filter(|(_, p)| !p.holdings.is_empty())
                .map(|(q, p)| {
                    (0..layers)
                        .map(|l| {
                            p.holdings[l]
                                .iter()
                                .zip(&new_rows[q][l])
                                .filter(|(a, b)| a != b)
                                .count()
                        })
                        .sum::<usize>()
                })
                .sum();
            prop_assert_eq!(survivor_changes as u64, s.evicted);
            // The re-optimisation converges to the replan's layout: the full replan from the
            // repaired holdings and from the unrepaired survivors place the same plan.
            let opts = replan_options(MappingMethod::Optimal);
            let from_repaired = replan(&repaired.plan.physical_nodes(), slots, &model, &loads, &opts, 0).unwrap().0;
            let from_survivors = replan(&physical, slots, &model, &loads, &opts, 0).unwrap().0;
            prop_assert_eq!(&from_repaired.layers, &from_survivors.layers);
            prop_assert_eq!(&from_repaired.allocations, &from_survivors.allocations);
            plan = repaired.plan;
        }
    }
}

/// A node loss at a larger scale copies only what fell under the floor: 64 nodes, 8 slots,
/// 32 experts (16 replicas each on average), `f = 2`; the replan moves far more.
#[test]
fn repair_moves_a_small_fraction_of_the_replan() {
    let model = ModelSpec {
        experts: 32,
        layers: 4,
        f: 2,
    };
    let (nodes, slots) = (64, 8);
    let loads: Vec<Vec<u64>> = (0..4)
        .map(|l| {
            (0..32)
                .map(|e| 1000 / (1 + ((e + 3 * l) % 32) as u64))
                .collect()
        })
        .collect();
    let plan = first_plan(nodes, slots, &model, &loads);
    let mut physical = plan.physical_nodes();
    let gone = physical.remove(0);
    // Loads drift a little, as the routing window does between failures.
    let drifted: Vec<Vec<u64>> = loads
        .iter()
        .map(|l| {
            l.iter()
                .enumerate()
                .map(|(e, &t)| t + (e as u64 % 3))
                .collect()
        })
        .collect();
    let repaired = repair_held(
        Holders::Nodes(&physical),
        &plan,
        &model,
        &drifted,
        &RepairOptions::default(),
        1,
    )
    .unwrap();
    let opts = replan_options(MappingMethod::Scalable);
    let (_, replanned) = replan(&physical, slots, &model, &drifted, &opts, 0).unwrap();
    let lost: usize = gone.holdings.iter().map(Vec::len).sum();
    let moved = repaired.migration.transfers.len();
    assert!(moved <= lost, "{moved} > {lost}");
    assert!(
        (replanned.transfers.len() as f64) >= 5.0 * moved.max(1) as f64,
        "repair {moved}, replan {}",
        replanned.transfers.len()
    );
}
