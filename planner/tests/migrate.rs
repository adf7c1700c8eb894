//! Integration tests for `lazarus_planner::migrate`.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::time::Instant;

use lazarus_planner::migrate::{
    MappingMethod, MigrateError, MigrationPlan, NodeSide, PhysicalNode, Transfer, assignment_cost,
    cost_matrix, greedy_assignment, lost_experts, map_nodes, min_cost_assignment,
};
use proptest::prelude::*;
use rand::rngs::Xoshiro256PlusPlus;
use rand::seq::SliceRandom;
use rand::{RngExt, SeedableRng};

type Plan = Vec<Vec<Vec<u32>>>;

fn node(id: u32, holdings: Vec<Vec<u32>>) -> PhysicalNode {
    PhysicalNode { id, holdings }
}

fn distinct(layers: &[Vec<u32>]) -> BTreeSet<(u32, u32)> {
    layers
        .iter()
        .enumerate()
        .flat_map(|(l, ids)| ids.iter().map(move |&e| (l as u32, e)))
        .collect()
}

/// Checks every accounting invariant of a successful plan.
fn check_plan(
    plan: &Plan,
    physical: &[PhysicalNode],
    experts: usize,
    bpe: u64,
    mp: &MigrationPlan,
) {
    let n = physical.len();
    let index: HashMap<u32, usize> = physical
        .iter()
        .enumerate()
        .map(|(i, p)| (p.id, i))
        .collect();
    // plan_to_physical is a bijection onto the physical ids.
    assert_eq!(mp.plan_to_physical.len(), n);
    let assign: Vec<usize> = mp.plan_to_physical.iter().map(|id| index[id]).collect();
    assert_eq!(assign.iter().collect::<HashSet<_>>().len(), n);

    let cost = cost_matrix(plan, physical, experts).unwrap();
    assert_eq!(mp.new_replicas, mp.transfers.len() as u64);
    assert_eq!(mp.new_replicas, assignment_cost(&cost, &assign));
    assert_eq!(mp.bytes, mp.transfers.len() as u64 * bpe);

    let old: Vec<BTreeSet<(u32, u32)>> = physical.iter().map(|p| distinct(&p.holdings)).collect();
    let mut now = old.clone();
    let mut sent = vec![0u64; n];
    let mut recv = vec![0u64; n];
    let mut seen = HashSet::new();
    for t in &mp.transfers {
        let (s, d) = (index[&t.src], index[&t.dst]);
        assert!(
            old[s].contains(&(t.layer, t.expert)),
            "source {t:?} does not hold the expert now"
        );
        assert!(
            !old[d].contains(&(t.layer, t.expert)),
            "destination {t:?} already holds it"
        );
        assert!(
            seen.insert((t.dst, t.layer, t.expert)),
            "duplicate transfer {t:?}"
        );
        now[d].insert((t.layer, t.expert));
        sent[s] += bpe;
        recv[d] += bpe;
    }
    for (q, &p) in assign.iter().enumerate() {
        assert!(
            distinct(&plan[q]).is_subset(&now[p]),
            "plan node {q} not satisfied"
        );
    }
    assert_eq!(mp.sent_bytes, sent);
    assert_eq!(mp.recv_bytes, recv);
    assert_eq!(mp.max_sent_bytes, sent.iter().copied().max().unwrap_or(0));
    assert_eq!(mp.max_recv_bytes, recv.iter().copied().max().unwrap_or(0));
    assert_eq!(mp.transfers, reference_transfers(plan, physical, mp));
}

/// Straightforward restatement of the documented source rule: needs ordered by (number of
/// holders, layer, expert, destination index), each served by the holder with the fewest
/// transfers so far, ties to the lowest index; output sorted by (destination index, layer, expert).
fn reference_transfers(
    plan: &Plan,
    physical: &[PhysicalNode],
    mp: &MigrationPlan,
) -> Vec<Transfer> {
    let index: HashMap<u32, usize> = physical
        .iter()
        .enumerate()
        .map(|(i, p)| (p.id, i))
        .collect();
    let old: Vec<BTreeSet<(u32, u32)>> = physical.iter().map(|p| distinct(&p.holdings)).collect();
    let mut holders: HashMap<(u32, u32), Vec<usize>> = HashMap::new();
    for (p, set) in old.iter().enumerate() {
        for &k in set {
            holders.entry(k).or_default().push(p);
        }
    }
    let mut plan_of = vec![0; physical.len()];
    for (q, id) in mp.plan_to_physical.iter().enumerate() {
        plan_of[index[id]] = q;
    }
    let mut needs: Vec<(usize, (u32, u32))> = Vec::new();
    for (p, &q) in plan_of.iter().enumerate() {
        needs.extend(distinct(&plan[q]).difference(&old[p]).map(|&k| (p, k)));
    }
    needs.sort_by_key(|&(p, k)| (holders[&k].len(), k, p));
    let mut sent = vec![0u64; physical.len()];
    let mut out: Vec<(usize, (u32, u32), usize)> = needs
        .into_iter()
        .map(|(p, k)| {
            let s = *holders[&k].iter().min_by_key(|&&h| (sent[h], h)).unwrap();
            sent[s] += 1;
            (p, k, s)
        })
        .collect();
    out.sort_unstable();
    out.into_iter()
        .map(|(p, (layer, expert), s)| Transfer {
            layer,
            expert,
            src: physical[s].id,
            dst: physical[p].id,
        })
        .collect()
}

/// One layer's placement over `nodes` nodes with `c` slots each, every expert at least once.
fn covering_layer(
    rng: &mut Xoshiro256PlusPlus,
    nodes: usize,
    c: usize,
    experts: usize,
) -> Vec<Vec<u32>> {
    assert!(nodes * c >= experts);
    let mut slots: Vec<u32> = (0..experts as u32).collect();
    while slots.len() < nodes * c {
        slots.push(rng.random_range(0..experts as u32));
    }
    slots.shuffle(rng);
    slots.chunks(c).map(<[u32]>::to_vec).collect()
}

/// `nodes` plan nodes × `layers`, each layer covering every expert.
fn covering_plan(
    rng: &mut Xoshiro256PlusPlus,
    nodes: usize,
    layers: usize,
    c: usize,
    experts: usize,
) -> Plan {
    let mut plan = vec![Vec::with_capacity(layers); nodes];
    for _ in 0..layers {
        for (q, ids) in covering_layer(rng, nodes, c, experts)
            .into_iter()
            .enumerate()
        {
            plan[q].push(ids);
        }
    }
    plan
}

/// Realistic reconfiguration: an old placement on `n + k` nodes (every expert held by the
/// survivors), `k` random nodes fail, and a fresh independent placement for the `n` survivors.
fn realistic(
    rng: &mut Xoshiro256PlusPlus,
    n: usize,
    k: usize,
    layers: usize,
    c: usize,
    experts: usize,
) -> (Plan, Vec<PhysicalNode>) {
    let mut ids: Vec<u32> = (0..(n + k) as u32).collect();
    ids.shuffle(rng);
    let mut survivors: Vec<u32> = ids[..n].to_vec();
    survivors.sort_unstable();
    let old_survivors = covering_plan(rng, n, layers, c, experts);
    // The failed nodes' old state is irrelevant: they are simply absent.
    let physical = survivors
        .iter()
        .zip(old_survivors)
        .map(|(&id, holdings)| node(id, holdings))
        .collect();
    (covering_plan(rng, n, layers, c, experts), physical)
}

fn brute_force_min(cost: &[Vec<u64>]) -> u64 {
    fn rec(cost: &[Vec<u64>], row: usize, used: &mut Vec<bool>, acc: u64, best: &mut u64) {
        if row == cost.len() {
            *best = (*best).min(acc);
            return;
        }
        for p in 0..used.len() {
            if !used[p] {
                used[p] = true;
                rec(cost, row + 1, used, acc + cost[row][p], best);
                used[p] = false;
            }
        }
    }
    let mut best = u64::MAX;
    rec(cost, 0, &mut vec![false; cost.len()], 0, &mut best);
    best
}

fn brute_force_min_wide(cost: &[Vec<u64>]) -> u128 {
    let n = cost.len();
    let mut perm: Vec<usize> = (0..n).collect();
    let mut best = u128::MAX;
    // Heap's algorithm over all n! permutations.
    let mut c = vec![0usize; n];
    let total = |perm: &[usize]| {
        perm.iter()
            .enumerate()
            .map(|(q, &p)| u128::from(cost[q][p]))
            .sum::<u128>()
    };
    best = best.min(total(&perm));
    let mut i = 0;
    while i < n {
        if c[i] < i {
            if i % 2 == 0 {
                perm.swap(0, i);
            } else {
                perm.swap(c[i], i);
            }
            best = best.min(total(&perm));
            c[i] += 1;
            i = 0;
        } else {
            c[i] = 0;
            i += 1;
        }
    }
    best
}

fn is_permutation(a: &[usize]) -> bool {
    let mut s = a.to_vec();
    s.sort_unstable();
    s.iter().enumerate().all(|(i, &x)| i == x)
}

// ---------------------------------------------------------------------------------------------
// Property tests
// ---------------------------------------------------------------------------------------------

fn square(max: u64) -> impl Strategy<Value = Vec<Vec<u64>>> {
    (0usize..=6).prop_flat_map(move |n| prop::collection::vec(prop::collection::vec(0..=max, n), n))
}

/// Random plan (N ≤ 12, L ≤ 3, E ≤ 10) plus random, possibly incomplete or blank holdings.
fn random_instance() -> impl Strategy<Value = (Plan, Vec<PhysicalNode>, usize)> {
    (1usize..=12, 1usize..=3, 1usize..=10, 1usize..=4).prop_flat_map(|(n, l, e, c)| {
        let layer = prop::collection::vec(0..e as u32, c);
        let plan = prop::collection::vec(prop::collection::vec(layer, l), n);
        let held = prop::collection::vec(0..e as u32, 0..=2 * c);
        let holdings = prop::collection::vec(
            prop_oneof![
                1 => Just(Vec::new()),
                6 => prop::collection::vec(held, l),
            ],
            n,
        );
        (plan, holdings).prop_map(move |(plan, holdings)| {
            let physical = holdings
                .into_iter()
                .enumerate()
                .map(|(i, h)| node(100 + 3 * i as u32, h))
                .collect();
            (plan, physical, e)
        })
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn hungarian_matches_brute_force(cost in prop_oneof![square(3), square(1_000_000)]) {
        let a = min_cost_assignment(&cost);
        prop_assert!(is_permutation(&a));
        prop_assert_eq!(assignment_cost(&cost, &a), brute_force_min(&cost));
        let g = greedy_assignment(&cost);
        prop_assert!(is_permutation(&g));
        prop_assert!(assignment_cost(&cost, &a) <= assignment_cost(&cost, &g));
    }

    #[test]
    fn hungarian_exact_for_huge_costs(
        cost in (0usize..=6).prop_flat_map(|n| prop::collection::vec(
            prop::collection::vec(prop_oneof![any::<u64>(), (1u64 << 56)..(1u64 << 58), 0u64..4], n), n))
    ) {
        let a = min_cost_assignment(&cost);
        prop_assert!(is_permutation(&a));
        let total = |a: &[usize]| a.iter().enumerate().map(|(q, &p)| u128::from(cost[q][p])).sum::<u128>();
        prop_assert_eq!(total(&a), brute_force_min_wide(&cost));
    }

    #[test]
    fn optimal_never_worse_than_greedy((plan, physical, e) in random_instance()) {
        let cost = cost_matrix(&plan, &physical, e).unwrap();
        let opt = assignment_cost(&cost, &min_cost_assignment(&cost));
        let greedy = assignment_cost(&cost, &greedy_assignment(&cost));
        prop_assert!(opt <= greedy);

        let layers = plan[0].len();
        let lost: HashSet<(u32, u32)> = lost_experts(&physical, layers, e).into_iter().collect();
        let needed_lost = plan.iter().flat_map(|q| distinct(q)).filter(|k| lost.contains(k)).min();
        for method in [MappingMethod::Greedy, MappingMethod::Optimal] {
            match (map_nodes(&plan, &physical, e, method, 7), needed_lost) {
                (Ok(mp), None) => {
                    check_plan(&plan, &physical, e, 7, &mp);
                    prop_assert_eq!(mp.new_replicas, if method == MappingMethod::Optimal { opt } else { greedy });
                }
                (Err(MigrateError::ExpertLost { layer, expert }), Some(k)) => {
                    prop_assert_eq!((layer, expert), k);
                }
                (r, k) => prop_assert!(false, "unexpected {:?} with needed lost {:?}", r, k),
            }
        }
    }

    #[test]
    fn never_panics_on_bad_input(
        plan in prop::collection::vec(prop::collection::vec(prop::collection::vec(0u32..12, 0..4), 0..4), 0..5),
        phys in prop::collection::vec(
            (0u32..6, prop::collection::vec(prop::collection::vec(0u32..12, 0..4), 0..4)), 0..5),
        experts in 0usize..12,
        bpe in prop_oneof![Just(u64::MAX), 0u64..1000],
    ) {
        let physical: Vec<PhysicalNode> = phys.into_iter().map(|(id, h)| node(id, h)).collect();
        let _ = cost_matrix(&plan, &physical, experts);
        let _ = lost_experts(&physical, 3, experts);
        for method in [MappingMethod::Greedy, MappingMethod::Optimal] {
            let result = map_nodes(&plan, &physical, experts, method, bpe);
            // Huge byte sizes only exercise saturation; the invariants assume no overflow.
            if let Some(mp) = result.ok().filter(|_| bpe < 1000) {
                check_plan(&plan, &physical, experts, bpe, &mp);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Deterministic tests
// ---------------------------------------------------------------------------------------------

#[test]
fn optimal_beats_greedy_on_realistic_instances() {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(20_240_704);
    let runs = 500;
    let (mut better, mut saved, mut greedy_total, mut opt_total) = (0u32, 0u64, 0u64, 0u64);
    for _ in 0..runs {
        let experts = rng.random_range(4..=16usize);
        let c = rng.random_range(2..=4usize);
        let n = rng.random_range(experts.div_ceil(c).max(2)..=16);
        let k = rng.random_range(1..=3usize);
        let layers = rng.random_range(1..=3usize);
        let (plan, physical) = realistic(&mut rng, n, k, layers, c, experts);
        assert!(lost_experts(&physical, layers, experts).is_empty());
        let g = map_nodes(&plan, &physical, experts, MappingMethod::Greedy, 1).unwrap();
        let o = map_nodes(&plan, &physical, experts, MappingMethod::Optimal, 1).unwrap();
        check_plan(&plan, &physical, experts, 1, &g);
        check_plan(&plan, &physical, experts, 1, &o);
        assert!(
            o.new_replicas <= g.new_replicas,
            "optimal worse than greedy"
        );
        if o.new_replicas < g.new_replicas {
            better += 1;
            saved += g.new_replicas - o.new_replicas;
        }
        greedy_total += g.new_replicas;
        opt_total += o.new_replicas;
    }
    eprintln!(
        "optimal strictly better than greedy in {better}/{runs} instances ({:.1}%); \
         mean saving when better: {:.2} transfers; totals: greedy {greedy_total}, optimal {opt_total} \
         ({:.2}% fewer)",
        100.0 * f64::from(better) / f64::from(runs),
        if better > 0 {
            saved as f64 / f64::from(better)
        } else {
            0.0
        },
        100.0 * (greedy_total - opt_total) as f64 / greedy_total as f64,
    );
    assert!(better > 0, "greedy was never suboptimal");
}

#[test]
fn transfers_match_the_reference_across_many_node_blocks() {
    // More than 64 nodes, so that bit-level node sets span several words; identity and
    // scalable mappings, on realistic instances with a few failed nodes.
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(7);
    for _ in 0..12 {
        let n = rng.random_range(65..=300usize);
        let experts = rng.random_range(8..=40usize);
        let layers = rng.random_range(1..=3usize);
        let (plan, physical) = realistic(&mut rng, n, 3, layers, 4, experts);
        for method in [MappingMethod::Identity, MappingMethod::Scalable] {
            let mp = map_nodes(&plan, &physical, experts, method, 5).unwrap();
            check_plan(&plan, &physical, experts, 5, &mp);
        }
        // Scale-out by many blank nodes: keys with more destinations than holders, so
        // holders serve several levels of load.
        let (mut plan, mut physical) = (plan, physical);
        let blank = rng.random_range(40..=150usize);
        let extra = covering_plan(&mut rng, blank, layers, 4, experts);
        plan.extend(extra);
        physical.extend((0..blank).map(|i| node(10_000 + i as u32, Vec::new())));
        let mp = map_nodes(&plan, &physical, experts, MappingMethod::Identity, 5).unwrap();
        check_plan(&plan, &physical, experts, 5, &mp);
    }
}

#[test]
fn map_layers_equals_map_nodes_on_a_model_plan() {
    use lazarus_planner::{
        Alignment, AllocPolicy, ClusterSpec, LayerPlacement, ModelSpec, PlacePolicy,
        migrate::map_layers, plan_model,
    };
    let model = ModelSpec {
        experts: 24,
        layers: 3,
        f: 2,
    };
    let loads: Vec<Vec<u64>> = (0..3)
        .map(|l| (0..24).map(|e| 1000 / (1 + (e + 5 * l) % 24)).collect())
        .collect();
    let plan = |n| {
        plan_model(
            &ClusterSpec::new(n, 8),
            &model,
            &loads,
            AllocPolicy::Lazarus,
            PlacePolicy::Mro,
            Alignment::Aligned,
        )
        .unwrap()
    };
    let survivors: Vec<PhysicalNode> = plan(40)
        .physical_nodes()
        .into_iter()
        .filter(|p| p.id != 11)
        .collect();
    let after = plan(39);
    for method in [MappingMethod::Optimal, MappingMethod::Scalable] {
        let a = map_layers(&after.layers, &survivors, 24, method, 3).unwrap();
        let b = map_nodes(&after.plan_node_contents(), &survivors, 24, method, 3).unwrap();
        assert_eq!(a, b);
    }
    // The first error in node order, although map_layers reads layer by layer: node 0's
    // layer 1 comes before node 1's layer 0.
    let layers = [
        LayerPlacement::from_grid(vec![vec![0], vec![5]], 7, None).unwrap(),
        LayerPlacement::from_grid(vec![vec![6], vec![0]], 7, None).unwrap(),
    ];
    let two = [node(1, vec![vec![0], vec![0]]), node(2, vec![])];
    assert_eq!(
        map_layers(&layers, &two, 4, MappingMethod::Identity, 1),
        Err(MigrateError::ExpertOutOfRange {
            layer: 1,
            expert: 6,
            experts: 4
        })
    );
    // Too few experts: the same first error, although map_layers reads layer by layer.
    let narrow = map_layers(&after.layers, &survivors, 10, MappingMethod::Identity, 3);
    assert!(matches!(narrow, Err(MigrateError::ExpertOutOfRange { .. })));
    let contents = after.plan_node_contents();
    assert_eq!(
        narrow,
        map_nodes(&contents, &survivors, 10, MappingMethod::Identity, 3)
    );
    assert_eq!(
        map_layers(
            &after.layers,
            &survivors[1..],
            24,
            MappingMethod::Identity,
            3
        ),
        Err(MigrateError::NodeCountMismatch {
            plan_nodes: 39,
            physical: 38
        })
    );
}

#[test]
fn greedy_is_suboptimal_on_hand_case() {
    // Physical 0 holds {0,1}, physical 1 holds {0}. Plan node 0 needs {0}, plan node 1 needs {0,1}.
    // Greedy: physical 0 takes plan node 0 (cost 0), physical 1 gets plan node 1 (cost 1).
    // Optimal: physical 0 → plan node 1, physical 1 → plan node 0: zero transfers.
    let plan = vec![vec![vec![0]], vec![vec![0, 1]]];
    let physical = vec![node(5, vec![vec![0, 1]]), node(6, vec![vec![0]])];
    let g = map_nodes(&plan, &physical, 2, MappingMethod::Greedy, 1).unwrap();
    let o = map_nodes(&plan, &physical, 2, MappingMethod::Optimal, 1).unwrap();
    assert_eq!(g.plan_to_physical, vec![5, 6]);
    assert_eq!(g.new_replicas, 1);
    assert_eq!(o.plan_to_physical, vec![6, 5]);
    assert_eq!(o.new_replicas, 0);
}

#[test]
fn identity_when_survivors_already_hold_plan() {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(42);
    for _ in 0..20 {
        let (n, layers, c, experts) = (12, 4, 3, 20);
        let plan = covering_plan(&mut rng, n, layers, c, experts);
        let mut order: Vec<usize> = (0..n).collect();
        order.shuffle(&mut rng);
        let physical: Vec<PhysicalNode> = order
            .iter()
            .enumerate()
            .map(|(i, &q)| {
                let mut h = plan[q].clone();
                for ids in &mut h {
                    ids.shuffle(&mut rng);
                }
                node(1000 + i as u32, h)
            })
            .collect();
        let mp = map_nodes(&plan, &physical, experts, MappingMethod::Optimal, 123).unwrap();
        assert!(mp.transfers.is_empty());
        assert_eq!(
            (
                mp.new_replicas,
                mp.bytes,
                mp.max_sent_bytes,
                mp.max_recv_bytes
            ),
            (0, 0, 0, 0)
        );
        check_plan(&plan, &physical, experts, 123, &mp);
    }
}

#[test]
fn scale_out_fills_blank_nodes() {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(7);
    let (old_n, new_n, layers, c, experts) = (6, 9, 3, 4, 16);
    let old = covering_plan(&mut rng, old_n, layers, c, experts);
    let mut physical: Vec<PhysicalNode> = old
        .into_iter()
        .enumerate()
        .map(|(i, h)| node(i as u32, h))
        .collect();
    // Two spellings of a blank node: no layers at all, and one empty vector per layer.
    physical.push(node(50, Vec::new()));
    physical.push(node(51, vec![Vec::new(); layers]));
    physical.push(node(52, Vec::new()));
    let plan = covering_plan(&mut rng, new_n, layers, c, experts);
    for method in [MappingMethod::Greedy, MappingMethod::Optimal] {
        let mp = map_nodes(&plan, &physical, experts, method, 10).unwrap();
        check_plan(&plan, &physical, experts, 10, &mp);
        for new_id in [50, 51, 52] {
            let q = mp
                .plan_to_physical
                .iter()
                .position(|&id| id == new_id)
                .unwrap();
            let got: BTreeSet<(u32, u32)> = mp
                .transfers
                .iter()
                .filter(|t| t.dst == new_id)
                .map(|t| (t.layer, t.expert))
                .collect();
            let n_got = mp.transfers.iter().filter(|t| t.dst == new_id).count();
            assert_eq!(got, distinct(&plan[q]));
            assert_eq!(n_got, got.len());
            assert!(
                mp.transfers.iter().all(|t| t.src < 50),
                "blank nodes cannot send"
            );
        }
    }
}

#[test]
fn transfers_spread_over_holders() {
    // A(10) and B(11) hold expert 0 (and 1); C(12) and D(13) are blank and need expert 0.
    let plan = vec![
        vec![vec![0, 1]],
        vec![vec![0, 1]],
        vec![vec![0]],
        vec![vec![0]],
    ];
    let physical = vec![
        node(10, vec![vec![0, 1]]),
        node(11, vec![vec![1, 0]]),
        node(12, vec![vec![]]),
        node(13, vec![]),
    ];
    let mp = map_nodes(&plan, &physical, 2, MappingMethod::Optimal, 64).unwrap();
    check_plan(&plan, &physical, 2, 64, &mp);
    assert_eq!(
        mp.transfers,
        vec![
            Transfer {
                layer: 0,
                expert: 0,
                src: 10,
                dst: 12
            },
            Transfer {
                layer: 0,
                expert: 0,
                src: 11,
                dst: 13
            },
        ]
    );
    assert_eq!(mp.sent_bytes, vec![64, 64, 0, 0]);
    assert_eq!(mp.recv_bytes, vec![0, 0, 64, 64]);
    assert_eq!(
        (mp.max_sent_bytes, mp.max_recv_bytes, mp.bytes),
        (64, 64, 128)
    );
}

#[test]
fn constrained_transfers_are_placed_first() {
    // Expert 1 is only on A; expert 0 is on A and B. C needs 1 and 0, D needs 0.
    // Most-constrained first: (1 from A), then 0 for C from B, then 0 for D from A or B → max 2
    // rather than A sending everything.
    let plan = vec![
        vec![vec![0, 1]],
        vec![vec![0]],
        vec![vec![0, 1]],
        vec![vec![0]],
    ];
    let physical = vec![
        node(0, vec![vec![0, 1]]),
        node(1, vec![vec![0]]),
        node(2, vec![vec![]]),
        node(3, vec![vec![]]),
    ];
    let mp = map_nodes(&plan, &physical, 2, MappingMethod::Optimal, 1).unwrap();
    check_plan(&plan, &physical, 2, 1, &mp);
    assert_eq!(mp.new_replicas, 3);
    assert_eq!(mp.max_sent_bytes, 2);
    assert_eq!(mp.sent_bytes.iter().sum::<u64>(), 3);
}

#[test]
fn expert_lost_is_reported() {
    let plan = vec![vec![vec![0], vec![2]], vec![vec![1], vec![0]]];
    let physical = vec![
        node(0, vec![vec![0], vec![0]]),
        node(1, vec![vec![1], vec![1]]),
    ];
    assert_eq!(lost_experts(&physical, 2, 3), vec![(0, 2), (1, 2)]);
    for method in [MappingMethod::Greedy, MappingMethod::Optimal] {
        assert_eq!(
            map_nodes(&plan, &physical, 3, method, 1),
            Err(MigrateError::ExpertLost {
                layer: 1,
                expert: 2
            })
        );
    }
    // A lost expert nobody needs is harmless.
    let plan = vec![vec![vec![0], vec![0]], vec![vec![1], vec![1]]];
    assert!(map_nodes(&plan, &physical, 3, MappingMethod::Optimal, 1).is_ok());
}

#[test]
fn shape_errors() {
    let plan = vec![vec![vec![0], vec![1]], vec![vec![1], vec![0]]];
    let ok = vec![
        node(0, vec![vec![0], vec![1]]),
        node(1, vec![vec![1], vec![0]]),
    ];
    assert!(map_nodes(&plan, &ok, 2, MappingMethod::Optimal, 1).is_ok());

    assert_eq!(
        map_nodes(&plan, &ok[..1], 2, MappingMethod::Optimal, 1),
        Err(MigrateError::NodeCountMismatch {
            plan_nodes: 2,
            physical: 1
        })
    );
    assert_eq!(
        cost_matrix(&plan[..1], &ok, 2),
        Err(MigrateError::NodeCountMismatch {
            plan_nodes: 1,
            physical: 2
        })
    );
    let ragged = vec![vec![vec![0], vec![1]], vec![vec![1]]];
    assert_eq!(
        map_nodes(&ragged, &ok, 2, MappingMethod::Greedy, 1),
        Err(MigrateError::LayerCountMismatch {
            side: NodeSide::Plan,
            node: 1,
            expected: 2,
            found: 1
        })
    );
    let bad_holdings = vec![node(0, vec![vec![0], vec![1]]), node(9, vec![vec![1]])];
    assert_eq!(
        map_nodes(&plan, &bad_holdings, 2, MappingMethod::Greedy, 1),
        Err(MigrateError::LayerCountMismatch {
            side: NodeSide::Physical,
            node: 9,
            expected: 2,
            found: 1
        })
    );
    assert_eq!(
        map_nodes(&plan, &ok, 1, MappingMethod::Optimal, 1),
        Err(MigrateError::ExpertOutOfRange {
            layer: 1,
            expert: 1,
            experts: 1
        })
    );
    let out = vec![
        node(0, vec![vec![0], vec![1]]),
        node(1, vec![vec![1], vec![7]]),
    ];
    assert_eq!(
        map_nodes(&plan, &out, 2, MappingMethod::Optimal, 1),
        Err(MigrateError::ExpertOutOfRange {
            layer: 1,
            expert: 7,
            experts: 2
        })
    );
    let dup = vec![
        node(4, vec![vec![0], vec![1]]),
        node(4, vec![vec![1], vec![0]]),
    ];
    assert_eq!(
        map_nodes(&plan, &dup, 2, MappingMethod::Optimal, 1),
        Err(MigrateError::DuplicatePhysicalId { id: 4 })
    );
    // Empty instance is fine.
    let empty = map_nodes(&[], &[], 0, MappingMethod::Optimal, 1).unwrap();
    assert!(empty.plan_to_physical.is_empty() && empty.transfers.is_empty());
    // Errors render.
    assert!(
        MigrateError::ExpertLost {
            layer: 3,
            expert: 4
        }
        .to_string()
        .contains("expert 4")
    );
}

#[test]
fn plan_serde_roundtrip() {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(3);
    let (plan, physical) = realistic(&mut rng, 6, 2, 2, 3, 8);
    let mp = map_nodes(&plan, &physical, 8, MappingMethod::Optimal, 5).unwrap();
    let json = serde_json::to_string(&mp).unwrap();
    assert!(json.contains("\"optimal\""));
    let back: MigrationPlan = serde_json::from_str(&json).unwrap();
    assert_eq!(back, mp);
    let m: MappingMethod = serde_json::from_str("\"greedy\"").unwrap();
    assert_eq!(m, MappingMethod::Greedy);
}

/// DeepSeek-V3 scale: 128 surviving nodes (2 failed), 58 MoE layers, 256 experts, 32 slots.
/// Run with `cargo test --release -p lazarus-planner --test migrate -- --ignored --nocapture`.
#[test]
#[ignore = "timing; run in release"]
fn timing_deepseek_v3_scale() {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(2407_04656);
    let (n, layers, experts, c) = (128, 58, 256, 32);
    let (plan, physical) = realistic(&mut rng, n, 2, layers, c, experts);
    let bpe = 44 << 20; // ~44 MiB per expert (weights + optimizer state), illustrative.
    for method in [MappingMethod::Greedy, MappingMethod::Optimal] {
        let mut best = f64::INFINITY;
        let mut mp = None;
        for _ in 0..30 {
            let t = Instant::now();
            let r = map_nodes(&plan, &physical, experts, method, bpe).unwrap();
            best = best.min(t.elapsed().as_secs_f64());
            mp = Some(r);
        }
        let mp = mp.unwrap();
        eprintln!(
            "{method}: best of 30 = {:.2} ms; transfers {}, max sent {} MiB, max recv {} MiB",
            best * 1e3,
            mp.new_replicas,
            mp.max_sent_bytes >> 20,
            mp.max_recv_bytes >> 20
        );
    }
    let t = Instant::now();
    let cost = cost_matrix(&plan, &physical, experts).unwrap();
    let t_cost = t.elapsed();
    let t = Instant::now();
    let _ = min_cost_assignment(&cost);
    eprintln!(
        "cost_matrix {:.2} ms, hungarian {:.2} ms",
        t_cost.as_secs_f64() * 1e3,
        t.elapsed().as_secs_f64() * 1e3
    );
}

/// An aligned MRO plan of 24 experts × 3 layers on `nodes` nodes of 8 slots.
fn mro_plan_24x3(nodes: usize, loads: &[Vec<u64>]) -> lazarus_planner::ModelPlan {
    use lazarus_planner::{
        Alignment, AllocPolicy, ClusterSpec, ModelSpec, PlacePolicy, plan_model,
    };
    let model = ModelSpec {
        experts: 24,
        layers: 3,
        f: 2,
    };
    plan_model(
        &ClusterSpec::new(nodes, 8),
        &model,
        loads,
        AllocPolicy::Lazarus,
        PlacePolicy::Mro,
        Alignment::Aligned,
    )
    .unwrap()
}

/// A random replan's inputs: the previous plan (on `before` nodes), the survivors' rows in
/// it, some of them reported as lists instead, and blank newcomers.
fn held_instance(
    before: usize,
    dead: &[usize],
    newcomers: usize,
    as_lists: &[usize],
    skew: u64,
) -> (lazarus_planner::ModelPlan, Vec<u32>, Vec<(usize, bool)>) {
    let loads: Vec<Vec<u64>> = (0..3)
        .map(|l| {
            (0..24)
                .map(|e| 1 + 1000 / (1 + (e + skew as usize * l) % 24) as u64)
                .collect()
        })
        .collect();
    let mut plan = mro_plan_24x3(before, &loads);
    // Physical ids not in plan order, as after earlier reconfigurations.
    plan.node_map = (0..before as u32).map(|r| 1000 - 7 * r).collect();
    let mut ids = Vec::new();
    let mut rows = Vec::new();
    for r in (0..before).filter(|r| !dead.contains(r)) {
        ids.push(plan.node_map[r]);
        rows.push((r, as_lists.contains(&r)));
    }
    for k in 0..newcomers {
        ids.push(5000 + k as u32);
        rows.push((usize::MAX, false));
    }
    (plan, ids, rows)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Holdings given by reference ([`Holders::Rows`], some as lists, newcomers blank) give
    /// exactly the migration plan and the lost experts of the same holdings as lists.
    #[test]
    fn held_rows_equal_the_lists(
        before in 6usize..14,
        dead in proptest::collection::vec(0usize..14, 0..4),
        newcomers in 0usize..3,
        as_lists in proptest::collection::vec(0usize..14, 0..4),
        skew in 0u64..7,
        method in prop_oneof![
            Just(MappingMethod::Optimal),
            Just(MappingMethod::Scalable),
            Just(MappingMethod::Greedy),
            Just(MappingMethod::Identity),
        ],
    ) {
        use lazarus_planner::migrate::{
            Held, Holders, lost_experts_held, map_layers, map_layers_held, map_nodes_held,
        };
        let (plan, ids, rows) = held_instance(before, &dead, newcomers, &as_lists, skew);
        let lists: Vec<Vec<Vec<u32>>> = rows
            .iter()
            .map(|&(r, _)| {
                if r == usize::MAX {
                    Vec::new()
                } else {
                    plan.layers.iter().map(|l| l.grid().row(r).to_vec()).collect()
                }
            })
            .collect();
        let held: Vec<Held<'_>> = rows
            .iter()
            .zip(&lists)
            .map(|(&(r, list), l)| {
                if r == usize::MAX || list {
                    Held::Lists(l)
                } else {
                    Held::Row(r as u32)
                }
            })
            .collect();
        let holders = Holders::Rows { ids: &ids, held: &held, layers: &plan.layers };
        let physical: Vec<PhysicalNode> = ids
            .iter()
            .zip(&lists)
            .map(|(&id, l)| node(id, l.clone()))
            .collect();
        prop_assert_eq!(holders.to_physical_nodes().unwrap(), physical.clone());
        prop_assert_eq!(
            lost_experts_held(holders, 3, 24),
            lost_experts(&physical, 3, 24)
        );
        let loads: Vec<Vec<u64>> = (0..3)
            .map(|l| (0..24).map(|e| 1 + ((e * 7 + l) % 11) as u64).collect())
            .collect();
        if ids.len() * 8 >= 24 {
            let after = mro_plan_24x3(ids.len(), &loads);
            prop_assert_eq!(
                map_layers_held(&after.layers, holders, 24, method, 5),
                map_layers(&after.layers, &physical, 24, method, 5)
            );
            // The node-major plan with spare blank plan nodes, as `ds-ft` maps it.
            let mut plan_nodes = after.plan_node_contents();
            let spare = plan_nodes.len() / 3;
            plan_nodes.truncate(plan_nodes.len() - spare);
            plan_nodes.extend(std::iter::repeat_n(vec![Vec::new(); 3], spare));
            let refs: Vec<&[Vec<u32>]> = plan_nodes.iter().map(Vec::as_slice).collect();
            prop_assert_eq!(
                map_nodes_held(&refs, holders, 24, method, 5),
                map_nodes(&plan_nodes, &physical, 24, method, 5)
            );
        }
    }
}

#[test]
fn held_rows_out_of_range_are_errors() {
    use lazarus_planner::migrate::{Held, Holders, map_layers_held};
    let (plan, ids, _) = held_instance(8, &[], 0, &[], 1);
    let mut held: Vec<Held<'_>> = (0..8).map(Held::Row).collect();
    held[3] = Held::Row(8);
    let holders = Holders::Rows {
        ids: &ids,
        held: &held,
        layers: &plan.layers,
    };
    let err = MigrateError::RowOutOfRange {
        node: ids[3],
        row: 8,
        rows: 8,
    };
    assert_eq!(holders.to_physical_nodes(), Err(err.clone()));
    assert_eq!(
        map_layers_held(&plan.layers, holders, 24, MappingMethod::Scalable, 1),
        Err(err)
    );
    let short = Holders::Rows {
        ids: &ids[..7],
        held: &held,
        layers: &plan.layers,
    };
    assert!(matches!(
        map_layers_held(&plan.layers, short, 24, MappingMethod::Scalable, 1),
        Err(MigrateError::RowOutOfRange { .. })
    ));
}
