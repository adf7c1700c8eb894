use super::*;
use proptest::prelude::*;

/// Bitmask of a node set.
fn mask(set: &[u32]) -> u64 {
    set.iter().fold(0u64, |m, &n| m | 1 << n)
}

/// `lost[k]`: failure sets of size `k` (out of all `2^N`) that contain one of `sets` — the
/// lost cases, counted by brute force over every failure set.
fn lost_counts(nodes: usize, sets: &[u64]) -> Vec<u64> {
    let mut lost = vec![0u64; nodes + 1];
    for dead in 0u64..1 << nodes {
        if sets.iter().any(|&m| m & !dead == 0) {
            lost[dead.count_ones() as usize] += 1;
        }
    }
    lost
}

/// The fewest lost failure sets of each size over **every** placement of `shards` shards with
/// `f` copies on distinct nodes and at most `capacity` copies per node. Shards are
/// interchangeable, so placements are multisets of `f`-subsets (non-decreasing index order).
fn brute_force_min_lost(nodes: usize, shards: usize, f: usize, capacity: usize) -> Vec<u64> {
    let subsets: Vec<u64> = (0u64..1 << nodes)
        .filter(|m| m.count_ones() as usize == f)
        .collect();
    let mut best = vec![u64::MAX; nodes + 1];
    let mut chosen: Vec<u64> = Vec::with_capacity(shards);
    let mut load = vec![0usize; nodes];
    #[allow(clippy::too_many_arguments)]
    fn go(
        from: usize,
        subsets: &[u64],
        shards: usize,
        nodes: usize,
        capacity: usize,
        chosen: &mut Vec<u64>,
        load: &mut [usize],
        best: &mut [u64],
    ) {
        if chosen.len() == shards {
            let mut distinct = chosen.clone();
            distinct.dedup(); // chosen is non-decreasing
            for (b, l) in best.iter_mut().zip(lost_counts(nodes, &distinct)) {
                *b = (*b).min(l);
            }
            return;
        }
        for i in from..subsets.len() {
            let m = subsets[i];
            let nodes_of = (0..nodes).filter(|&n| m >> n & 1 == 1);
            if nodes_of.clone().any(|n| load[n] == capacity) {
                continue;
            }
            nodes_of.clone().for_each(|n| load[n] += 1);
            chosen.push(m);
            go(i, subsets, shards, nodes, capacity, chosen, load, best);
            chosen.pop();
            nodes_of.for_each(|n| load[n] -= 1);
        }
    }
    go(
        0,
        &subsets,
        shards,
        nodes,
        capacity,
        &mut chosen,
        &mut load,
        &mut best,
    );
    best
}

fn placement_lost(p: &ShardPlacement) -> Vec<u64> {
    let sets: Vec<u64> = p.critical_sets().iter().map(|s| mask(s)).collect();
    lost_counts(p.nodes(), &sets)
}

#[test]
fn blocks_of_f_nodes_hold_whole_shard_groups() {
    let p = place(&FsepSpec::balanced(6, 6, 2)).unwrap();
    assert_eq!(
        p.all_holders(),
        &[
            vec![0, 1],
            vec![0, 1],
            vec![2, 3],
            vec![2, 3],
            vec![4, 5],
            vec![4, 5]
        ]
    );
    assert_eq!(p.disjoint_blocks(), Some(vec![2, 2, 2]));
    // f = 1 (plain LAER): one shard per node, every node critical.
    let laer = place(&FsepSpec::balanced(4, 4, 1)).unwrap();
    assert_eq!(laer.critical_sets().len(), 4);
    assert_eq!(survival(&laer, 1, 0).unwrap().probability, 0.0);
}

/// Odd N at f = 2 with tight capacity: one full block and a wide group of 3 nodes (a triangle).
#[test]
fn tight_capacity_with_f_not_dividing_n_uses_a_wide_last_group() {
    let p = place(&FsepSpec::balanced(5, 5, 2)).unwrap();
    assert_eq!(
        p.all_holders(),
        &[vec![0, 1], vec![0, 1], vec![2, 3], vec![2, 4], vec![3, 4]]
    );
    assert_eq!(p.load(), vec![2; 5]);
    assert_eq!(p.disjoint_blocks(), None);
}

#[test]
fn survival_is_certain_below_f_and_matches_the_closed_form() {
    for (n, s, f) in [(6, 12, 2), (9, 9, 3), (8, 16, 2), (10, 20, 2), (7, 7, 1)] {
        let p = place(&FsepSpec::balanced(n, s, f)).unwrap();
        let lost = placement_lost(&p);
        for (k, &lost_k) in lost.iter().enumerate() {
            let exact = 1.0 - lost_k as f64 / recovery::binomial(n, k);
            let est = survival(&p, k, 1).unwrap();
            assert!(est.trials.is_none(), "exact at this size");
            assert!((est.probability - exact).abs() < 1e-12, "n={n} k={k}");
            if let Some(c) = survival_closed_form(&p, k) {
                assert!((c - exact).abs() < 1e-12, "closed form n={n} k={k}");
            }
            if k < f {
                assert_eq!(exact, 1.0);
            }
        }
    }
}

/// The paper's check: blocks of 2 among 10 nodes (the §10 table of our reference) — here 5
/// blocks, the FSEP shape of 10 nodes at f = 2.
#[test]
fn ten_nodes_f2_golden_curve() {
    let p = place(&FsepSpec::balanced(10, 10, 2)).unwrap();
    assert_eq!(p.disjoint_blocks(), Some(vec![2; 5]));
    let got: Vec<f64> = (0..=4)
        .map(|k| survival(&p, k, 0).unwrap().probability)
        .collect();
    // 1 − P(some pair dead): k = 2: 5 of C(10,2) = 45 sets lose a pair.
    assert_eq!(got[0], 1.0);
    assert_eq!(got[1], 1.0);
    assert!((got[2] - 40.0 / 45.0).abs() < 1e-12);
    // k = 3: 5 pairs × 8 thirds = 40 of 120.
    assert!((got[3] - 80.0 / 120.0).abs() < 1e-12);
}

/// Optimality: on every small instance, the constructed placement loses no more failure sets
/// of **any** size than the best of all placements (exhaustive search).
#[test]
fn matches_brute_force_optimum() {
    let mut checked = 0;
    for nodes in 1..=6usize {
        for f in 1..=nodes.min(3) {
            for shards in 1..=6usize {
                let min_c = min_capacity(nodes, shards, f);
                for capacity in min_c..=min_c + 1 {
                    let spec = FsepSpec {
                        nodes,
                        shards,
                        copies: f,
                        capacity,
                    };
                    let p = place(&spec).unwrap();
                    let ours = placement_lost(&p);
                    let best = brute_force_min_lost(nodes, shards, f, capacity);
                    assert_eq!(ours, best, "{spec:?}: {:?}", p.all_holders());
                    checked += 1;
                }
            }
        }
    }
    assert!(checked > 100);
}

#[test]
fn repair_rebuilds_lost_copies_from_survivors_keeping_blocks_together() {
    let p = place(&FsepSpec::balanced(6, 6, 2)).unwrap();
    // Room for 4 copies per survivor: shards 0 and 1 (block {0,1}) both go to node 2.
    let RepairOutcome::InPlace(r) = repair(&p, 2, &[0], 4).unwrap() else {
        panic!("one node of a 2-block is recoverable")
    };
    assert_eq!(
        r.transfers,
        vec![
            ShardTransfer {
                shard: 0,
                src: 1,
                dst: 2
            },
            ShardTransfer {
                shard: 1,
                src: 1,
                dst: 2
            },
        ]
    );
    assert_eq!(r.survivors, vec![1, 2, 3, 4, 5]);
    // New indices: old node 1 → 0, old node 2 → 1.
    assert_eq!(r.placement.holders(0), &[0, 1]);
    assert_eq!(r.placement.holders(1), &[0, 1]);
    assert_eq!(r.max_sent_received(), (2, 2));
    // Balanced room (3): the second copy goes to the next least-loaded survivor.
    let RepairOutcome::InPlace(r) = repair(&p, 2, &[0], 3).unwrap() else {
        panic!()
    };
    assert_eq!(r.transfers.len(), 2);
    assert!(r.placement.load().iter().all(|&l| l <= 3));
}

#[test]
fn losing_every_copy_of_a_shard_restores_the_checkpoint() {
    let p = place(&FsepSpec::balanced(6, 6, 2)).unwrap();
    assert_eq!(
        repair(&p, 2, &[0, 1], 4).unwrap(),
        RepairOutcome::RestoreCheckpoint {
            lost_shards: vec![0, 1]
        }
    );
    // Two nodes of different blocks: in place.
    assert!(matches!(
        repair(&p, 2, &[0, 2], 4).unwrap(),
        RepairOutcome::InPlace(_)
    ));
    // Not enough room on the survivors.
    assert!(matches!(
        repair(&p, 2, &[0], 2),
        Err(FsepError::NoRoom { .. })
    ));
}

fn check_repair(p: &ShardPlacement, f: usize, dead: &[u32], capacity: usize) {
    let out = repair(p, f, dead, capacity).unwrap();
    match out {
        RepairOutcome::RestoreCheckpoint { lost_shards } => {
            assert!(!lost_shards.is_empty());
            for w in 0..p.shards() {
                let all_dead = p.holders(w).iter().all(|n| dead.contains(n));
                assert_eq!(all_dead, lost_shards.contains(&(w as u32)), "shard {w}");
            }
        }
        RepairOutcome::InPlace(r) => {
            let copies = f.min(r.survivors.len());
            assert_eq!(r.copies, copies);
            // Conservation: every shard exactly `copies` distinct live holders, within room.
            r.placement
                .check(&FsepSpec {
                    nodes: r.survivors.len(),
                    shards: p.shards(),
                    copies,
                    capacity,
                })
                .unwrap();
            // Minimal bytes: one transfer per missing copy.
            let missing: usize = (0..p.shards())
                .map(|w| {
                    let live = p.holders(w).iter().filter(|n| !dead.contains(n)).count();
                    copies.saturating_sub(live)
                })
                .sum();
            for t in &r.transfers {
                assert!(p.holders(t.shard as usize).contains(&t.src), "{t:?}");
                assert!(!dead.contains(&t.src) && !dead.contains(&t.dst), "{t:?}");
                assert!(!p.holders(t.shard as usize).contains(&t.dst), "{t:?}");
            }
            // Minimal bytes: one transfer per missing copy, plus one per surviving copy that
            // had to move (none when the room allows).
            let mut moved = 0;
            for w in 0..p.shards() {
                for &n in p.holders(w).iter().filter(|n| !dead.contains(n)) {
                    let i = r.survivors.binary_search(&n).unwrap() as u32;
                    if !r.placement.holders(w).contains(&i) {
                        moved += 1;
                    }
                }
            }
            assert_eq!(r.transfers.len(), missing + moved);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Repairing the planner's placement after any failure set: a restore exactly when some
    /// shard lost every copy, else `min(f, survivors)` copies of every shard on distinct
    /// nodes within the balanced room, by exactly the missing copies.
    #[test]
    fn repair_conserves_copies(
        nodes in 1usize..14,
        shards in 1usize..40,
        f in 1usize..4,
        extra in 0usize..2,
        dead_bits in any::<u64>(),
    ) {
        prop_assume!(f <= nodes);
        let p = place(&FsepSpec {
            nodes,
            shards,
            copies: f,
            capacity: min_capacity(nodes, shards, f) + extra,
        })
        .unwrap();
        let mut dead: Vec<u32> = (0..nodes as u32).filter(|n| dead_bits >> n & 1 == 1).collect();
        if dead.len() == nodes {
            dead.pop();
        }
        let alive = nodes - dead.len();
        let capacity = min_capacity(alive, shards, f.min(alive)) + extra;
        check_repair(&p, f, &dead, capacity);
    }

    /// The same on arbitrary (random) placements: the greedy never gets stuck with room.
    #[test]
    fn repair_of_any_placement_conserves_copies(
        nodes in 2usize..10,
        f in 1usize..4,
        picks in proptest::collection::vec(any::<u64>(), 1..20),
        dead_bits in any::<u64>(),
        extra in 0usize..2,
    ) {
        prop_assume!(f <= nodes);
        let holders: Vec<Vec<u32>> = picks
            .iter()
            .map(|&x| {
                // f distinct nodes from the bits of x (a seeded partial shuffle).
                let mut all: Vec<u32> = (0..nodes as u32).collect();
                let mut z = x;
                for i in 0..f {
                    let j = i + (z % (nodes - i) as u64) as usize;
                    all.swap(i, j);
                    z = z.rotate_left(17) ^ 0x9E37_79B9_7F4A_7C15;
                }
                all[..f].to_vec()
            })
            .collect();
        let p = ShardPlacement::new(nodes, holders).unwrap();
        let mut dead: Vec<u32> = (0..nodes as u32).filter(|n| dead_bits >> n & 1 == 1).collect();
        if dead.len() == nodes {
            dead.pop();
        }
        let alive = nodes - dead.len();
        let live_load = p
            .load()
            .iter()
            .enumerate()
            .filter(|(n, _)| !dead.contains(&(*n as u32)))
            .map(|(_, &l)| l)
            .max()
            .unwrap_or(0);
        let capacity = live_load.max(min_capacity(alive, p.shards(), f.min(alive))) + extra;
        check_repair(&p, f, &dead, capacity);
    }
}

#[test]
fn monte_carlo_brackets_the_exact_value() {
    let p = place(&FsepSpec::balanced(12, 24, 2)).unwrap();
    let exact = survival(&p, 4, 0).unwrap().probability;
    let mc = survival_monte_carlo(&p, 4, 200_000, 7).unwrap();
    assert!(mc.ci_low.unwrap() <= exact && exact <= mc.ci_high.unwrap());
    assert_eq!(mc, survival_monte_carlo(&p, 4, 200_000, 7).unwrap());
}

/// The room left after a loss sits on nodes that already hold the damaged shards: one
/// surviving copy moves to make room (4 nodes, 9 shards, f = 2, node 0 dies).
#[test]
fn repair_moves_a_surviving_copy_only_when_the_room_requires_it() {
    let p = place(&FsepSpec::balanced(4, 9, 2)).unwrap();
    let RepairOutcome::InPlace(r) = repair(&p, 2, &[0], 6).unwrap() else {
        panic!("node 0 alone loses no shard")
    };
    let missing = (0..9).filter(|&w| p.holders(w).contains(&0)).count();
    assert_eq!(r.transfers.len(), missing + 1);
    assert!(r.placement.load().iter().all(|&l| l == 6));
}

/// At scale (odd N, tight room: the non-block case) the placement stays valid and its
/// survival exact at small k.
#[test]
fn large_odd_cluster() {
    let spec = FsepSpec::balanced(1001, 8008, 2);
    let p = place(&spec).unwrap();
    p.check(&spec).unwrap();
    let s = survival(&p, 2, 0).unwrap();
    assert!(s.trials.is_none());
    let sets = p.critical_sets().len() as f64;
    assert!((s.probability - (1.0 - sets / recovery::binomial(1001, 2))).abs() < 1e-12);
    assert_eq!(survival(&p, 1, 0).unwrap().probability, 1.0);
}

/// Checks a [`rejoin`]: the new placement is valid on the balanced room of the new membership,
/// every new copy is one transfer from a holder before the change, and nothing else moves.
fn check_rejoin(p: &ShardPlacement, f: usize, dead: &[u32], joined: usize) -> RepairPlan {
    let RepairOutcome::InPlace(r) = rejoin(p, f, dead, joined).unwrap() else {
        panic!("every shard kept a copy");
    };
    let n = p.nodes() + joined - dead.len();
    let copies = f.min(n);
    let spec = FsepSpec::balanced(n, p.shards(), copies);
    r.placement.check(&spec).unwrap();
    assert_eq!(r.survivors.len(), n);
    let mut want = Vec::new();
    for (w, h) in r.placement.all_holders().iter().enumerate() {
        for &i in h {
            let node = r.survivors[i as usize];
            if !p.all_holders()[w].contains(&node) {
                want.push((w as u32, node));
            }
        }
    }
    let mut got: Vec<(u32, u32)> = r.transfers.iter().map(|t| (t.shard, t.dst)).collect();
    got.sort_unstable();
    want.sort_unstable();
    assert_eq!(got, want, "one transfer per new copy");
    for t in &r.transfers {
        assert!(p.all_holders()[t.shard as usize].contains(&t.src), "{t:?}");
        assert!(!dead.contains(&t.src), "{t:?}");
    }
    r
}

/// f = 2, 8 shards in blocks on 4 nodes ({0, 1} hold shards 0–3, {2, 3} shards 4–7), two
/// newcomers: each old node hands one shard to a newcomer (loads 3, 3, 3, 3, 2, 2), and the
/// shards handed keep one holder set: both copies of shard 3 go to the newcomers, and those
/// of shard 7.
#[test]
fn newcomers_take_whole_shard_groups_from_the_fullest_nodes() {
    let p = place(&FsepSpec::balanced(4, 8, 2)).unwrap();
    assert_eq!(p.load(), [4, 4, 4, 4]);
    let r = check_rejoin(&p, 2, &[], 2);
    assert_eq!(r.placement.load(), [3, 3, 3, 3, 2, 2]);
    assert_eq!(r.transfers.len(), 4);
    let moved: Vec<&[u32]> = (0..8)
        .filter(|&w| r.placement.holders(w).iter().any(|&i| i >= 4))
        .map(|w| r.placement.holders(w))
        .collect();
    assert_eq!(moved, [&[4, 5][..], &[4, 5][..]], "{r:?}");
}

/// f = 1 (plain FSEP): a newcomer takes whole shards from the fullest node; a loss restores;
/// shards cut for the old membership (S = N) leave a newcomer without shards: nothing moves.
#[test]
fn one_copy_joins_move_whole_shards_and_losses_restore() {
    let p = ShardPlacement::new(
        3,
        vec![vec![0], vec![0], vec![1], vec![1], vec![2], vec![2]],
    )
    .unwrap();
    let r = check_rejoin(&p, 1, &[], 1);
    assert_eq!(r.placement.load(), [1, 2, 2, 1]);
    assert_eq!(r.transfers.len(), 1);
    assert!(matches!(
        rejoin(&p, 1, &[1], 1).unwrap(),
        RepairOutcome::RestoreCheckpoint { lost_shards } if lost_shards == [2, 3]
    ));
    let cut = place(&FsepSpec::balanced(4, 4, 1)).unwrap();
    let r = check_rejoin(&cut, 1, &[], 2);
    assert!(r.transfers.is_empty());
    assert_eq!(r.placement.load(), [1, 1, 1, 1, 0, 0]);
}

/// A loss and a join at once (f = 2): the lost copies are rebuilt (on the newcomer first)
/// and the result is balanced over the new membership.
#[test]
fn a_loss_and_a_join_together_rebuild_onto_the_newcomer() {
    let p = place(&FsepSpec::balanced(4, 4, 2)).unwrap();
    let r = check_rejoin(&p, 2, &[2], 1);
    assert_eq!(r.survivors, [0, 1, 3, 4]);
    assert_eq!(r.transfers.len(), 2, "{r:?}");
    assert!(
        r.transfers.iter().all(|t| t.dst == 4 && t.src == 3),
        "{r:?}"
    );
}

proptest! {
    /// Any placement, any losses that keep a copy of every shard, any newcomers: a valid
    /// balanced placement, one transfer per new copy from an old holder.
    #[test]
    fn rejoin_is_balanced_and_moves_only_new_copies(
        nodes in 2usize..7,
        shards in 1usize..9,
        f in 1usize..4,
        joined in 0usize..4,
        dead_mask in 0u64..64,
    ) {
        let f = f.min(nodes);
        let p = place(&FsepSpec::balanced(nodes, shards, f)).unwrap();
        let dead: Vec<u32> = (0..nodes as u32).filter(|&n| dead_mask >> n & 1 == 1).collect();
        prop_assume!(dead.len() < nodes && p.survives(&dead));
        check_rejoin(&p, f, &dead, joined);
    }
}
