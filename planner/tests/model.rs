//! Whole-model plans on real gate loads (the SmartMoE trace, from the shared-traces directory): aligning the
//! layers' MRO blocks keeps model-level recovery near the weakest layer's, far above an
//! independent per-layer mapping.

use lazarus_planner::place::mro_structure;
use lazarus_planner::recovery::exact;
use lazarus_planner::{
    Alignment, AllocPolicy, ClusterSpec, ModelSpec, PlacePolicy, PlanError, plan_model,
};
use lazarus_traces::routing::GateTrace;

/// Per-layer loads for a GPT-L-like model (E = 16, 12 layers) from the SmartMoE global counts at
/// one iteration: the first `layers` of the 24 layers, the `experts` most-loaded of the 32
/// experts, most loaded first (the reading of the Lazarus paper's "loads of the top experts at
/// each layer", arXiv 2407.04656 §6.2). `None`, after one `skipped:` line, when the shared
/// SmartMoE trace is absent.
pub(crate) fn smartmoe_loads(iter: u64, layers: usize, experts: usize) -> Option<Vec<Vec<u64>>> {
    let path =
        lazarus_traces::shared::or_skip("routing/smartmoe/derived/global_expert_counts.csv")?;
    let trace = GateTrace::load(&path, layers, experts).unwrap();
    Some(
        trace
            .top_loads_at_iteration(iter)
            .expect("a sampled iteration"),
    )
}

/// Eq. 1 allocation + MRO placement for every layer.
pub(crate) fn mro_plan(
    cluster: &ClusterSpec,
    model: &ModelSpec,
    loads: &[Vec<u64>],
    alignment: Alignment,
) -> Result<lazarus_planner::ModelPlan, PlanError> {
    plan_model(
        cluster,
        model,
        loads,
        AllocPolicy::Lazarus,
        PlacePolicy::Mro,
        alignment,
    )
}

fn model_recovery(plan: &lazarus_planner::ModelPlan, k: usize) -> f64 {
    exact(&plan.layers, k).unwrap()
}

#[test]
fn aligned_layers_beat_independent_mapping() {
    let cluster = ClusterSpec::new(10, 6);
    let model = ModelSpec {
        experts: 16,
        layers: 12,
        f: 2,
    };
    let Some(loads) = smartmoe_loads(2001, 12, 16) else {
        return;
    };
    let aligned = mro_plan(&cluster, &model, &loads, Alignment::Aligned).unwrap();
    for k in 2..=6 {
        let weakest = aligned
            .layers
            .iter()
            .map(|l| exact(std::slice::from_ref(l), k).unwrap())
            .fold(1.0, f64::min);
        let a = model_recovery(&aligned, k);
        let mut independent = 0.0;
        let seeds = 5;
        for seed in 0..seeds {
            let p = mro_plan(&cluster, &model, &loads, Alignment::Independent { seed }).unwrap();
            independent += model_recovery(&p, k) / seeds as f64;
        }
        eprintln!(
            "k={k}: weakest layer {weakest:.4}, aligned model {a:.4}, independent {independent:.4}"
        );
        assert!(a <= weakest + 1e-12);
        // On this trace the aligned blocks nest completely: the model is exactly as robust as
        // its weakest layer.
        assert!(
            (a - weakest).abs() < 1e-12,
            "k={k}: aligned {a} vs weakest {weakest}"
        );
        assert!(
            a >= independent,
            "k={k}: aligned {a} < independent {independent}"
        );
        if k >= 2 && weakest < 1.0 {
            assert!(a > independent, "k={k}: alignment should strictly help");
        }
    }
}

#[test]
fn identical_block_sizes_make_model_equal_to_one_layer() {
    // Same loads in every layer ⇒ same blocks ⇒ model recovery = layer recovery when aligned.
    let cluster = ClusterSpec::new(10, 6);
    let model = ModelSpec {
        experts: 16,
        layers: 4,
        f: 2,
    };
    let Some(mut layers) = smartmoe_loads(3001, 1, 16) else {
        return;
    };
    let loads = vec![layers.remove(0); 4];
    let p = mro_plan(&cluster, &model, &loads, Alignment::Aligned).unwrap();
    let blocks = mro_structure(&p.allocations[0].replicas, 10, 6).block_sizes;
    for k in 0..=10 {
        let one = lazarus_planner::recovery::mro_closed_form(&blocks, 10, k);
        assert!((model_recovery(&p, k) - one).abs() < 1e-12);
    }
}

#[test]
fn bad_model_inputs_are_errors() {
    let cluster = ClusterSpec::new(2, 2);
    let model = ModelSpec {
        experts: 5,
        layers: 1,
        f: 1,
    };
    let r = mro_plan(&cluster, &model, &[vec![1; 5]], Alignment::Aligned);
    assert!(matches!(r, Err(PlanError::TooFewSlots { .. })));
    let model = ModelSpec {
        experts: 2,
        layers: 2,
        f: 1,
    };
    let r = mro_plan(&cluster, &model, &[vec![1; 2]], Alignment::Aligned);
    assert!(matches!(r, Err(PlanError::LayerCount { .. })));
}

mod reconfiguration {
    use super::{mro_plan, smartmoe_loads};
    use lazarus_planner::migrate::{MappingMethod, MigrateError};
    use lazarus_planner::{
        Alignment, AllocPolicy, ClusterSpec, ModelSpec, PlacePolicy, ReplanError, ReplanOptions,
        replan,
    };

    fn options(mapping: MappingMethod) -> ReplanOptions {
        ReplanOptions {
            alloc: AllocPolicy::Lazarus,
            place: PlacePolicy::Mro,
            mapping,
            bytes_per_expert: 112_000_000,
        }
    }

    #[test]
    fn failure_then_scale_out_moves_few_states() {
        let model = ModelSpec {
            experts: 16,
            layers: 12,
            f: 2,
        };
        let Some(loads) = smartmoe_loads(2001, 12, 16) else {
            return;
        };
        let start = mro_plan(&ClusterSpec::new(10, 6), &model, &loads, Alignment::Aligned).unwrap();
        // Nodes 3 and 7 fail (neither holds a whole MRO block of every layer alone).
        let survivors: Vec<_> = start
            .physical_nodes()
            .into_iter()
            .filter(|n| n.id != 3 && n.id != 7)
            .collect();
        let (opt_plan, opt) = replan(
            &survivors,
            6,
            &model,
            &loads,
            &options(MappingMethod::Optimal),
            0,
        )
        .unwrap();
        let (_, greedy) = replan(
            &survivors,
            6,
            &model,
            &loads,
            &options(MappingMethod::Greedy),
            0,
        )
        .unwrap();
        assert_eq!(opt_plan.version, 1);
        assert!(opt.new_replicas <= greedy.new_replicas);
        assert_eq!(opt.bytes, opt.new_replicas * 112_000_000);
        // A full replan from scratch would move far more: every (layer, expert) a node lacks.
        let total_distinct: usize = opt_plan
            .plan_node_contents()
            .iter()
            .flatten()
            .map(|l| {
                let mut v = l.clone();
                v.dedup();
                v.len()
            })
            .sum();
        assert!(
            (opt.new_replicas as usize) < total_distinct / 2,
            "{} of {total_distinct}",
            opt.new_replicas
        );
        eprintln!(
            "2 of 10 nodes failed: optimal mapping moves {} expert states, greedy {}",
            opt.new_replicas, greedy.new_replicas
        );
        // Scale out: two new empty nodes join.
        let mut grown = opt_plan.physical_nodes();
        for id in [10, 11] {
            grown.push(lazarus_planner::migrate::PhysicalNode {
                id,
                holdings: vec![Vec::new(); 12],
            });
        }
        let (grown_plan, m) = replan(
            &grown,
            6,
            &model,
            &loads,
            &options(MappingMethod::Optimal),
            opt_plan.version,
        )
        .unwrap();
        assert_eq!(grown_plan.version, 2);
        assert_eq!(grown_plan.cluster.nodes, 10);
        // Every transfer's source holds the expert now.
        for t in &m.transfers {
            let src = grown.iter().find(|n| n.id == t.src).unwrap();
            assert!(src.holdings[t.layer as usize].contains(&t.expert));
        }
        assert!(m.transfers.iter().any(|t| t.dst == 10 || t.dst == 11));
    }

    #[test]
    fn losing_every_replica_is_expert_lost() {
        let model = ModelSpec {
            experts: 16,
            layers: 1,
            f: 2,
        };
        let Some(mut layers) = smartmoe_loads(2001, 1, 16) else {
            return;
        };
        let loads = vec![layers.remove(0)];
        let start = mro_plan(&ClusterSpec::new(10, 6), &model, &loads, Alignment::Aligned).unwrap();
        // MRO's first block is nodes {0, 1}: losing both loses its representative.
        let survivors: Vec<_> = start
            .physical_nodes()
            .into_iter()
            .filter(|n| n.id >= 2)
            .collect();
        let r = replan(
            &survivors,
            6,
            &model,
            &loads,
            &options(MappingMethod::Optimal),
            0,
        );
        assert!(matches!(
            r,
            Err(ReplanError::Migrate(MigrateError::ExpertLost {
                layer: 0,
                ..
            }))
        ));
    }
}

#[test]
fn replicas_per_rank_splits_nodes_into_gpus() {
    let cluster = ClusterSpec::new(4, 8).with_gpus_per_node(2);
    let model = ModelSpec {
        experts: 6,
        layers: 1,
        f: 2,
    };
    let p = mro_plan(
        &cluster,
        &model,
        &[vec![1, 2, 3, 4, 5, 60]],
        Alignment::Aligned,
    )
    .unwrap();
    let r = p.replicas_per_rank(0);
    assert_eq!(r.len(), 6);
    assert!(r.iter().all(|row| row.len() == 8));
    // Every GPU holds 4 slots; every expert keeps its count.
    for rank in 0..8 {
        assert_eq!(r.iter().map(|row| row[rank]).sum::<u32>(), 4);
    }
    for (e, row) in r.iter().enumerate() {
        assert_eq!(
            row.iter().sum::<u32>() as usize,
            p.allocations[0].replicas[e]
        );
    }
    // The dispatcher accepts it and conserves tokens.
    let tokens: Vec<Vec<u64>> = (0..6).map(|e| vec![10 * (e as u64 + 1); 8]).collect();
    let d = lazarus_planner::dispatch::plan(&tokens, &r).unwrap();
    for e in 0..6 {
        let got: u64 = (0..8).map(|j| d.received(e, j)).sum();
        assert_eq!(got, 80 * (e as u64 + 1));
    }
}

mod mro_reuse {
    use super::*;
    use lazarus_planner::{allocate, place};
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// `plan_model` builds an MRO grid once per distinct sorted count vector and renames it
        /// for the other layers; every layer must equal a fresh allocation + placement. Layers
        /// are rotations of one load row (equal sorted counts, so the template is reused) or
        /// fresh rows (a new template).
        #[test]
        fn plan_model_equals_per_layer_placement(
            base in prop::collection::vec(0u64..1000, 2..20),
            fresh in prop::collection::vec(prop::collection::vec(0u64..1000, 20), 0..3),
            shifts in prop::collection::vec(0usize..20, 1..5),
            nodes in 1usize..24,
            c in 1usize..6,
        ) {
            let experts = base.len();
            prop_assume!(nodes * c >= experts);
            let mut loads: Vec<Vec<u64>> = shifts
                .iter()
                .map(|&s| {
                    let mut row = base.clone();
                    row.rotate_left(s % experts);
                    row
                })
                .collect();
            loads.extend(fresh.iter().map(|row| row[..experts].to_vec()));
            loads.push(base.clone());
            let model = ModelSpec { experts, layers: loads.len(), f: 2 };
            let plan = mro_plan(&ClusterSpec::new(nodes, c), &model, &loads, Alignment::Aligned)
                .unwrap();
            for (l, row) in loads.iter().enumerate() {
                let a = allocate(AllocPolicy::Lazarus, row, nodes * c, 2).unwrap();
                let want = place(PlacePolicy::Mro, &a.replicas, nodes, c).unwrap();
                prop_assert_eq!(&plan.layers[l], &want);
            }
        }
    }
}
