//! Frontier-scale benchmarks (criterion, one thread unless noted). Run:
//! `cargo bench -p lazarus-planner --bench scale`.
//!
//! * `scale/replan_{2048,16384}x32_e256_l58`: whole-model plan + replan after losing one node
//!   (Eq. 1 allocation + MRO for 58 layers + the `scalable` mapping on the survivors), loads
//!   unchanged. Goals: < 200 ms at 2,048 nodes, < 2 s at 16,384.
//! * `scale/plan_model_2048_{template,per_layer}`: the 58-layer plan on 2,047 nodes, as
//!   `plan_model` builds it (one MRO construction renamed for layers with equal sorted counts)
//!   and as it was built before (allocation + `place` for every layer), side by side.
//! * `scale/mapping_2048_{classes,windowed}`: the node mapping of that replan alone, exact
//!   through classes of equal nodes (`scalable` now) against the windowed Hungarian (`scalable`
//!   before), side by side; both costs are printed.
//! * `scale/mapping_1024`: the `scalable` mapping alone at 1,024 nodes; the Hungarian on the
//!   same instance is timed once (it takes seconds) and the ratio printed, with both costs.
//! * `scale/laer_{sparse,previous,reference}_1024x256`: one LAER decision, 1,024 devices × 256
//!   experts: the current sparse search, its previous version (same decisions, no per-round
//!   caches) and the reference (full re-evaluation of every candidate). All three share the
//!   evaluator, so its speed-ups show in all three; `examples/laer_decision.rs` times them
//!   alternately with CPU time.
//! * `scale/closed_form_16384_k1_64`: exact model recovery curve, k = 1..64, 16,384 nodes.
//! * `scale/monte_carlo_16384_k8`: trials/s of the chunked sampler on the 58-layer model
//!   (rayon: all cores).

// Test oracles kept outside the library (see `tests/oracles/`).
#[path = "../tests/oracles/laer_previous.rs"]
mod laer_previous;
#[path = "../tests/oracles/laer_reference.rs"]
mod laer_reference;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use lazarus_planner::migrate::{
    MappingMethod, SCALABLE_BAND, SCALABLE_WINDOW, assignment_cost, cost_matrix,
    min_cost_assignment, scalable_assignment, windowed_assignment,
};
use lazarus_planner::recovery::{FailureModel, model_plan_closed_form};
use lazarus_planner::relayout::laer::{LaerParams, laer};
use lazarus_planner::relayout::{LinkModel, Topology, migration, score};
use lazarus_planner::{
    Alignment, AllocPolicy, ClusterSpec, ModelPlan, ModelSpec, PlacePolicy, ReplanOptions,
    allocate, place, plan_model, replan,
};
use rand::rngs::Xoshiro256PlusPlus;
use rand::seq::SliceRandom;
use rand::{RngExt, SeedableRng};
use std::hint::black_box;
use std::time::Instant;

fn zipf_loads(layers: usize, experts: usize, seed: u64) -> Vec<Vec<u64>> {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    (0..layers)
        .map(|_| {
            let mut perm: Vec<usize> = (0..experts).collect();
            perm.shuffle(&mut rng);
            let mut row = vec![0u64; experts];
            for (rank, &e) in perm.iter().enumerate() {
                row[e] = (1_000_000.0 / (rank + 1) as f64) as u64 + 1;
            }
            row
        })
        .collect()
}

const MODEL: ModelSpec = ModelSpec {
    experts: 256,
    layers: 58,
    f: 2,
};

fn model_plan(nodes: usize, loads: &[Vec<u64>]) -> ModelPlan {
    plan_model(
        &ClusterSpec::new(nodes, 32).with_gpus_per_node(8),
        &MODEL,
        loads,
        AllocPolicy::Lazarus,
        PlacePolicy::Mro,
        Alignment::Aligned,
    )
    .unwrap()
}

fn options(mapping: MappingMethod) -> ReplanOptions {
    ReplanOptions {
        alloc: AllocPolicy::Lazarus,
        place: PlacePolicy::Mro,
        mapping,
        bytes_per_expert: 44_000_000,
    }
}

fn bench_replan(c: &mut Criterion) {
    let mut g = c.benchmark_group("scale");
    g.sample_size(10);
    let loads = zipf_loads(58, 256, 1);
    for nodes in [2048usize, 16_384] {
        let before = model_plan(nodes, &loads);
        let survivors: Vec<_> = before
            .physical_nodes()
            .into_iter()
            .filter(|n| n.id != 77)
            .collect();
        drop(before);
        let opts = options(MappingMethod::Scalable);
        let (_, m) = replan(&survivors, 32, &MODEL, &loads, &opts, 0).unwrap();
        eprintln!(
            "{nodes} nodes, 1 lost: {} expert states move (scalable mapping)",
            m.new_replicas
        );
        g.bench_function(format!("replan_{nodes}x32_e256_l58"), |b| {
            b.iter(|| replan(black_box(&survivors), 32, &MODEL, &loads, &opts, 0).unwrap())
        });
    }
    g.finish();
}

fn bench_replan_parts(c: &mut Criterion) {
    let mut g = c.benchmark_group("scale");
    g.sample_size(10);
    let loads = zipf_loads(58, 256, 1);
    let nodes = 2048;
    let survivors: Vec<_> = model_plan(nodes, &loads)
        .physical_nodes()
        .into_iter()
        .filter(|n| n.id != 77)
        .collect();
    let cluster = ClusterSpec::new(nodes - 1, 32);
    g.bench_function("plan_model_2048_template", |b| {
        b.iter(|| {
            plan_model(
                black_box(&cluster),
                &MODEL,
                &loads,
                AllocPolicy::Lazarus,
                PlacePolicy::Mro,
                Alignment::Aligned,
            )
            .unwrap()
        })
    });
    // What plan_model did before the template: every layer allocated and placed on its own.
    g.bench_function("plan_model_2048_per_layer", |b| {
        b.iter(|| {
            loads
                .iter()
                .map(|row| {
                    let a = allocate(AllocPolicy::Lazarus, row, cluster.total_slots(), MODEL.f)
                        .unwrap();
                    place(PlacePolicy::Mro, &a.replicas, cluster.nodes, 32).unwrap()
                })
                .collect::<Vec<_>>()
        })
    });
    let plan = model_plan(nodes - 1, &loads).plan_node_contents();
    // Distinct (layer, expert) pairs a plan node needs that its physical node lacks.
    let cost = |a: &[usize]| -> u64 {
        a.iter()
            .enumerate()
            .map(|(q, &p)| {
                plan[q]
                    .iter()
                    .zip(&survivors[p].holdings)
                    .map(|(need, have)| {
                        let mut need = need.clone();
                        need.dedup();
                        need.iter().filter(|e| !have.contains(e)).count() as u64
                    })
                    .sum::<u64>()
            })
            .sum()
    };
    let classes = scalable_assignment(&plan, &survivors, 256, SCALABLE_BAND).unwrap();
    let windowed = windowed_assignment(&plan, &survivors, 256, SCALABLE_WINDOW).unwrap();
    let identity: Vec<usize> = (0..plan.len()).collect();
    eprintln!(
        "mapping at 2048 nodes, 1 lost: classes (scalable) moves {} states, windowed {}, \
         identity {}",
        cost(&classes),
        cost(&windowed),
        cost(&identity)
    );
    g.bench_function("mapping_2048_classes", |b| {
        b.iter(|| scalable_assignment(black_box(&plan), &survivors, 256, SCALABLE_BAND).unwrap())
    });
    g.bench_function("mapping_2048_windowed", |b| {
        b.iter(|| windowed_assignment(black_box(&plan), &survivors, 256, SCALABLE_WINDOW).unwrap())
    });
    g.finish();
}

fn bench_mapping(c: &mut Criterion) {
    let mut g = c.benchmark_group("scale");
    g.sample_size(10);
    let loads = zipf_loads(58, 256, 1);
    let nodes = 1024;
    let before = model_plan(nodes, &loads);
    let survivors: Vec<_> = before
        .physical_nodes()
        .into_iter()
        .filter(|n| n.id != 77)
        .collect();
    let after = model_plan(nodes - 1, &loads);
    let plan = after.plan_node_contents();
    let t = Instant::now();
    let cost = cost_matrix(&plan, &survivors, 256).unwrap();
    let opt = assignment_cost(&cost, &min_cost_assignment(&cost));
    let hungarian_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let s = lazarus_planner::migrate::map_nodes(&plan, &survivors, 256, MappingMethod::Scalable, 1)
        .unwrap();
    let scalable_s = t.elapsed().as_secs_f64();
    let ident: Vec<usize> = (0..plan.len()).collect();
    eprintln!(
        "mapping at 1024 nodes: Hungarian {hungarian_s:.3} s (cost {opt}), scalable {scalable_s:.3} s \
         (cost {}), identity cost {}; speed-up {:.1}x, cost ratio {:.3}",
        s.new_replicas,
        assignment_cost(&cost, &ident),
        hungarian_s / scalable_s,
        s.new_replicas as f64 / opt.max(1) as f64
    );
    g.bench_function("mapping_1024_scalable", |b| {
        b.iter(|| {
            lazarus_planner::migrate::map_nodes(
                black_box(&plan),
                &survivors,
                256,
                MappingMethod::Scalable,
                1,
            )
            .unwrap()
        })
    });
    g.finish();
}

fn bench_laer(c: &mut Criterion) {
    let topo = Topology {
        devices: 1024,
        devices_per_node: 8,
        slots_per_device: 4,
    };
    let experts = 256;
    let link = LinkModel {
        bytes_per_token: 2.0 * 7168.0,
        intra_node_bytes_per_s: 360e9,
        inter_node_bytes_per_s: 40e9,
        compute_s_per_token: 2.0 * 3.0 * 7168.0 * 2048.0 / 494e12,
        bytes_per_expert: 44_040_192 * 14 / 2,
    };
    // The same instance as benches/planner.rs `relayout/laer_1024_devices_e256`.
    let slots = topo.devices * topo.slots_per_device;
    let r = vec![slots / experts; experts];
    let nodes = lazarus_planner::place(PlacePolicy::Spread, &r, 128, 32).unwrap();
    let grid: Vec<Vec<u32>> = nodes
        .grid()
        .iter()
        .flat_map(|row| row.chunks(4).map(<[u32]>::to_vec))
        .collect();
    let current = lazarus_planner::LayerPlacement::from_grid(grid, experts, Some(&r)).unwrap();
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(9);
    let traffic: Vec<Vec<u64>> = (0..topo.devices)
        .map(|_| {
            (0..experts)
                .map(|e| 8192 / (e as u64 + 1) + rng.random_range(0..4))
                .collect()
        })
        .collect();
    let params = LaerParams {
        f: 2,
        recovery_floor: 0.9,
        ..LaerParams::default()
    };
    let new = laer(topo, link, &traffic, None, &current, &params).unwrap();
    let old = laer_reference::laer(topo, link, &traffic, None, &current, &params).unwrap();
    for (name, d) in [("sparse", &new), ("reference", &old)] {
        eprintln!(
            "laer {name} at 1024x256: load ratio {:.4}, {} bytes moved, {} actions",
            score(topo, link, &traffic, &d.layout).unwrap().load_ratio,
            migration(&current, &d.layout, &link).unwrap().bytes,
            d.actions.len()
        );
    }
    let mut g = c.benchmark_group("scale");
    g.sample_size(10);
    g.bench_function("laer_sparse_1024x256", |b| {
        b.iter(|| laer(topo, link, black_box(&traffic), None, &current, &params).unwrap())
    });
    g.bench_function("laer_previous_1024x256", |b| {
        b.iter(|| {
            laer_previous::laer(topo, link, black_box(&traffic), None, &current, &params).unwrap()
        })
    });
    g.bench_function("laer_reference_1024x256", |b| {
        b.iter(|| {
            laer_reference::laer(topo, link, black_box(&traffic), None, &current, &params).unwrap()
        })
    });
    g.finish();
}

fn bench_recovery(c: &mut Criterion) {
    let mut g = c.benchmark_group("scale");
    g.sample_size(10);
    let plan = model_plan(16_384, &zipf_loads(58, 256, 4));
    let curve = model_plan_closed_form(&plan, 64).unwrap();
    eprintln!(
        "closed form at 16384 nodes: P(k=1) {:.6}, P(k=64) {:.6}",
        curve[1], curve[64]
    );
    g.bench_function("closed_form_16384_k1_64", |b| {
        b.iter(|| model_plan_closed_form(black_box(&plan), 64).unwrap())
    });
    // The sampler treats the plan as arbitrary (node sets, no MRO structure); at this size no
    // expert sits on 8 nodes or fewer, so a trial costs its draws plus the set lookups.
    let fm = FailureModel::new(&plan.layers, 8).unwrap();
    let trials = 2_000_000u64;
    g.throughput(Throughput::Elements(trials));
    g.bench_function("monte_carlo_16384_k8", |b| {
        b.iter(|| fm.monte_carlo(8, trials, 7).unwrap())
    });
    g.finish();
}

criterion_group!(
    benches,
    bench_laer,
    bench_recovery,
    bench_replan,
    bench_replan_parts,
    bench_mapping
);
criterion_main!(benches);
