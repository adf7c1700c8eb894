//! Planner benchmarks (criterion). Run: `cargo bench -p lazarus-planner`.
//!
//! * `replan/deepseek_v3_*`: whole-model replan at DeepSeek-V3 scale — 128 nodes × 8 GPUs with
//!   4 slots per GPU (c = 32 per node), E = 256, 58 MoE layers — after one node fails: Eq. 1
//!   allocation + MRO placement for every layer + the optimal (Hungarian) migration mapping on
//!   the 127 survivors. Goal < 50 ms on one core; the paper reports < 1 s for 1K GPUs.
//! * `recovery/exact_n32_k6`: exact enumeration of all C(32,6) = 906,192 failure sets.
//! * `recovery/monte_carlo_*`: trials per second for the whole 58-layer model.
//! * `dispatch/plan_*`: one flexible-dispatch schedule (Alg. 1).
//! * `relayout/*_1024_devices_e256`: one re-layout decision for 1024 devices (128 nodes × 8),
//!   4 slots each, E = 256, per policy (LAER-style, EPLB, Lazarus replan, FlexMoE rounds).

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use lazarus_planner::migrate::MappingMethod;
use lazarus_planner::recovery::{exact, monte_carlo};
use lazarus_planner::{
    Alignment, AllocPolicy, ClusterSpec, ModelSpec, PlacePolicy, ReplanOptions, dispatch,
    plan_model, replan,
};
use lazarus_traces::zipf::ZipfLoads;
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};
use std::hint::black_box;

/// Zipf(1.0) loads with a different hot set per layer (seeded).
fn zipf_loads(layers: usize, experts: usize, seed: u64) -> Vec<Vec<u64>> {
    ZipfLoads::new(1.0, experts, layers, seed).loads(0)
}

fn bench_replan(c: &mut Criterion) {
    let (nodes, slots, experts, layers) = (128, 32, 256, 58);
    let model = ModelSpec {
        experts,
        layers,
        f: 2,
    };
    let loads = zipf_loads(layers, experts, 1);
    let before = plan_model(
        &ClusterSpec::new(nodes, slots),
        &model,
        &loads,
        AllocPolicy::Lazarus,
        PlacePolicy::Mro,
        Alignment::Aligned,
    )
    .unwrap();
    // Node 77 fails; the new loads have drifted too (new seed).
    let survivors: Vec<_> = before
        .physical_nodes()
        .into_iter()
        .filter(|n| n.id != 77)
        .collect();
    let new_loads = zipf_loads(layers, experts, 2);
    let mut g = c.benchmark_group("replan");
    g.sample_size(20);
    g.bench_function("deepseek_v3_plan_only_128x32_e256_l58", |b| {
        b.iter(|| {
            plan_model(
                &ClusterSpec::new(nodes - 1, slots),
                &model,
                black_box(&new_loads),
                AllocPolicy::Lazarus,
                PlacePolicy::Mro,
                Alignment::Aligned,
            )
            .unwrap()
        })
    });
    for mapping in [MappingMethod::Optimal, MappingMethod::Greedy] {
        let options = ReplanOptions {
            alloc: AllocPolicy::Lazarus,
            place: PlacePolicy::Mro,
            mapping,
            bytes_per_expert: 44_000_000,
        };
        let (_, same) = replan(&survivors, slots, &model, &loads, &options, 0).unwrap();
        let (_, drift) = replan(&survivors, slots, &model, &new_loads, &options, 0).unwrap();
        eprintln!(
            "1 of 128 nodes lost, {mapping} mapping: {} expert states move with unchanged loads, \
             {} when every layer's hot set also changed",
            same.new_replicas, drift.new_replicas
        );
        g.bench_function(format!("deepseek_v3_{mapping}_128x32_e256_l58"), |b| {
            b.iter(|| {
                replan(
                    black_box(&survivors),
                    slots,
                    &model,
                    &new_loads,
                    &options,
                    0,
                )
                .unwrap()
            })
        });
    }
    g.finish();
}

fn bench_recovery(c: &mut Criterion) {
    let mut g = c.benchmark_group("recovery");
    g.sample_size(10);
    // N = 32 nodes × 8 slots, E = 64 skewed: a realistic mid-size layer.
    let loads = zipf_loads(1, 64, 3);
    let small = plan_model(
        &ClusterSpec::new(32, 8),
        &ModelSpec {
            experts: 64,
            layers: 1,
            f: 2,
        },
        &loads,
        AllocPolicy::Lazarus,
        PlacePolicy::Mro,
        Alignment::Aligned,
    )
    .unwrap();
    g.bench_function("exact_n32_k6", |b| {
        b.iter(|| exact(black_box(&small.layers), 6).unwrap())
    });
    let big = plan_model(
        &ClusterSpec::new(128, 32),
        &ModelSpec {
            experts: 256,
            layers: 58,
            f: 2,
        },
        &zipf_loads(58, 256, 4),
        AllocPolicy::Lazarus,
        PlacePolicy::Mro,
        Alignment::Aligned,
    )
    .unwrap();
    let trials = 100_000u64;
    g.throughput(Throughput::Elements(trials));
    for (name, plan) in [("n32_l1", &small), ("n128_l58", &big)] {
        g.bench_with_input(BenchmarkId::new("monte_carlo_k6", name), plan, |b, plan| {
            b.iter(|| monte_carlo(&plan.layers, None, 6, trials, 7).unwrap())
        });
    }
    g.finish();
}

fn bench_dispatch(c: &mut Criterion) {
    let mut g = c.benchmark_group("dispatch");
    g.sample_size(10);
    for (ranks, experts) in [(64usize, 64usize), (1024, 256)] {
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(5);
        // Every rank routes 4096 tokens with a Zipf-like skew; 4 slots per rank, MRO-like
        // replica counts from Eq. 1 spread round-robin.
        let loads: Vec<u64> = (0..experts).map(|e| 1_000_000 / (e as u64 + 1)).collect();
        let a = lazarus_planner::allocate(AllocPolicy::Lazarus, &loads, ranks * 4, 2).unwrap();
        let p = lazarus_planner::place(PlacePolicy::Spread, &a.replicas, ranks, 4).unwrap();
        let replicas = dispatch::replicas_per_rank(&p.grid().to_vec(), experts);
        let total: u64 = loads.iter().sum();
        let tokens: Vec<Vec<u64>> = (0..experts)
            .map(|e| {
                (0..ranks)
                    .map(|_| loads[e] * 4096 / total + rng.random_range(0..3))
                    .collect()
            })
            .collect();
        g.bench_function(format!("plan_r{ranks}_e{experts}"), |b| {
            b.iter(|| dispatch::plan(black_box(&tokens), &replicas).unwrap())
        });
    }
    g.finish();
}

fn bench_relayout(c: &mut Criterion) {
    use lazarus_planner::relayout::laer::LaerParams;
    use lazarus_planner::relayout::policy::{RelayoutPolicy, relayout};
    use lazarus_planner::relayout::{LinkModel, Topology};
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
    // Equal replica counts spread over nodes; Zipf(1) traffic with a per-device hot set shift.
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
    let mut g = c.benchmark_group("relayout");
    g.sample_size(10);
    for name in ["laer", "eplb", "lazarus", "flexmoe"] {
        let mut policy: RelayoutPolicy = name.parse().unwrap();
        if let RelayoutPolicy::Laer(p) = &mut policy {
            *p = LaerParams {
                f: 2,
                recovery_floor: 0.9,
                ..LaerParams::default()
            };
        }
        let d = relayout(&policy, topo, link, &traffic, None, &current, 2).unwrap();
        eprintln!(
            "{name} at 1024 devices, E=256: load ratio {:.3} -> {:.3}, {} replicas moved",
            d.before.load_ratio, d.after.load_ratio, d.migration.replicas
        );
        g.bench_function(format!("{name}_1024_devices_e256"), |b| {
            b.iter(|| {
                relayout(&policy, topo, link, black_box(&traffic), None, &current, 2).unwrap()
            })
        });
    }
    g.finish();
}

criterion_group!(
    benches,
    bench_replan,
    bench_recovery,
    bench_dispatch,
    bench_relayout
);
criterion_main!(benches);
