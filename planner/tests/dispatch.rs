//! Tests of the flexible token dispatch plan (Lazarus Alg. 1).

// Index loops read several `[e][rank]` arrays and the plan at once; keep them explicit.
#![allow(clippy::needless_range_loop)]

use lazarus_planner::dispatch::{
    DispatchError, DispatchPlan, RecvBlock, plan, replicas_per_rank, tokens_per_rank,
};
use proptest::prelude::*;

/// Random `(tokens[e][rank], replicas[e][rank])` with every expert replicated somewhere.
fn instance() -> impl Strategy<Value = (Vec<Vec<u64>>, Vec<Vec<u32>>)> {
    (1usize..=12, 1usize..=10).prop_flat_map(|(ranks, experts)| {
        (
            prop::collection::vec(prop::collection::vec(0u64..=500, ranks), experts),
            prop::collection::vec(prop::collection::vec(0u32..=4, ranks), experts),
            prop::collection::vec(0usize..ranks, experts),
            // Sometimes concentrate the load on few ranks to force large overflows.
            prop::collection::vec(prop::bool::weighted(0.3), experts),
        )
            .prop_map(|(mut tokens, mut replicas, forced, skew)| {
                for e in 0..tokens.len() {
                    if replicas[e].iter().all(|&r| r == 0) {
                        replicas[e][forced[e]] = 1;
                    }
                    if skew[e] {
                        for (j, t) in tokens[e].iter_mut().enumerate() {
                            if j != forced[e] {
                                *t /= 50;
                            }
                        }
                    }
                }
                (tokens, replicas)
            })
    })
}

fn dims(tokens: &[Vec<u64>]) -> (usize, usize) {
    (tokens.len(), tokens[0].len())
}

/// `O_i`, `P_j`, `S` of expert `e` recomputed from the plan's capacities.
fn overflow_residual(p: &DispatchPlan, tokens: &[Vec<u64>], e: usize) -> (Vec<u64>, Vec<u64>, u64) {
    let ranks = tokens[e].len();
    let mut o = vec![0; ranks];
    let mut res = vec![0; ranks];
    for j in 0..ranks {
        let k = tokens[e][j].min(p.capacity(e, j));
        o[j] = tokens[e][j] - k;
        res[j] = p.capacity(e, j) - k;
    }
    let s = o.iter().sum();
    (o, res, s)
}

/// Tiny deterministic shuffle for building token lists.
fn shuffle<T>(v: &mut [T], mut seed: u64) {
    for i in (1..v.len()).rev() {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let j = (seed % (i as u64 + 1)) as usize;
        v.swap(i, j);
    }
}

fn token_list(tokens: &[Vec<u64>], src: usize, seed: u64) -> Vec<u32> {
    let mut list = Vec::new();
    for (e, row) in tokens.iter().enumerate() {
        list.extend(std::iter::repeat_n(e as u32, row[src] as usize));
    }
    shuffle(&mut list, seed | 1);
    list
}

proptest! {
    #[test]
    fn tokens_per_rank_is_what_every_rank_receives_whoever_routed((tokens, replicas) in instance()) {
        let p = plan(&tokens, &replicas).unwrap();
        let (experts, ranks) = dims(&tokens);
        let loads: Vec<u64> = tokens.iter().map(|row| row.iter().sum()).collect();
        let got = tokens_per_rank(&loads, &replicas).unwrap();
        for dst in 0..ranks {
            let received: u64 = (0..experts).map(|e| p.received(e, dst)).sum();
            prop_assert_eq!(got[dst], received);
        }
        // The same totals routed by rank 0 alone: the capacities, hence the loads, are equal.
        let mut from_zero = vec![vec![0u64; ranks]; experts];
        for e in 0..experts {
            from_zero[e][0] = loads[e];
        }
        let q = plan(&from_zero, &replicas).unwrap();
        for dst in 0..ranks {
            let received: u64 = (0..experts).map(|e| q.received(e, dst)).sum();
            prop_assert_eq!(got[dst], received);
        }
    }

    #[test]
    fn conservation((tokens, replicas) in instance()) {
        let p = plan(&tokens, &replicas).unwrap();
        let (experts, ranks) = dims(&tokens);
        for src in 0..ranks {
            for e in 0..experts {
                let sent: u64 = (0..ranks).map(|dst| p.count(src, e, dst)).sum();
                prop_assert_eq!(sent, tokens[e][src]);
                prop_assert_eq!(p.routed(e, src), tokens[e][src]);
            }
        }
    }

    #[test]
    fn capacity_is_hamilton_within_one((tokens, replicas) in instance()) {
        let p = plan(&tokens, &replicas).unwrap();
        let (experts, ranks) = dims(&tokens);
        for e in 0..experts {
            let t_e: u64 = tokens[e].iter().sum();
            let r_e: u64 = replicas[e].iter().map(|&r| u64::from(r)).sum();
            let mut cap_sum = 0;
            for dst in 0..ranks {
                let got: u64 = (0..ranks).map(|src| p.count(src, e, dst)).sum();
                let cap = p.capacity(e, dst);
                prop_assert_eq!(got, cap);
                prop_assert_eq!(p.received(e, dst), cap);
                // |cap − t_e·R/r_e| < 1  ⇔  |cap·r_e − t_e·R| < r_e
                let lhs = i128::from(cap) * i128::from(r_e);
                let rhs = i128::from(t_e) * i128::from(replicas[e][dst]);
                prop_assert!((lhs - rhs).abs() < i128::from(r_e));
                cap_sum += cap;
            }
            prop_assert_eq!(cap_sum, t_e);
        }
    }

    #[test]
    fn local_first((tokens, replicas) in instance()) {
        let p = plan(&tokens, &replicas).unwrap();
        let (experts, ranks) = dims(&tokens);
        for e in 0..experts {
            for i in 0..ranks {
                let keep = tokens[e][i].min(p.capacity(e, i));
                prop_assert_eq!(p.count(i, e, i), keep);
                prop_assert_eq!(p.local(e, i), keep);
                let overflows = tokens[e][i] > keep;
                let remote_in: u64 =
                    (0..ranks).filter(|&s| s != i).map(|s| p.count(s, e, i)).sum();
                prop_assert!(!(overflows && remote_in > 0));
            }
        }
    }

    #[test]
    fn proportional_split((tokens, replicas) in instance()) {
        let p = plan(&tokens, &replicas).unwrap();
        let (experts, ranks) = dims(&tokens);
        for e in 0..experts {
            let (o, res, s) = overflow_residual(&p, &tokens, e);
            for i in 0..ranks {
                for j in (0..ranks).filter(|&j| j != i) {
                    let d = p.count(i, e, j);
                    if s == 0 {
                        prop_assert_eq!(d, 0);
                        continue;
                    }
                    // |d − O_i·P_j/S| ≤ 1  ⇔  |d·S − O_i·P_j| ≤ S
                    let x = u128::from(o[i]) * u128::from(res[j]);
                    let ds = u128::from(d) * u128::from(s);
                    prop_assert!(ds.abs_diff(x) <= u128::from(s));
                    // stronger: d is the floor or the floor + 1
                    let f = x / u128::from(s);
                    prop_assert!(u128::from(d) == f || u128::from(d) == f + 1);
                }
            }
        }
    }

    #[test]
    fn send_recv_agreement((tokens, replicas) in instance()) {
        let p = plan(&tokens, &replicas).unwrap();
        let (experts, ranks) = dims(&tokens);
        let mut total_sent = 0;
        let mut remote = 0;
        for s in 0..ranks {
            for d in 0..ranks {
                let sum: u64 = (0..experts).map(|e| p.count(s, e, d)).sum();
                prop_assert_eq!(p.send_counts[s][d], sum);
                prop_assert_eq!(p.recv_counts[d][s], sum);
                total_sent += sum;
                if s != d {
                    remote += sum;
                }
            }
        }
        let total: u64 = tokens.iter().flatten().sum();
        prop_assert_eq!(total_sent, total);
        prop_assert_eq!(p.total_remote_tokens(), remote);
        let max_recv = (0..ranks)
            .map(|d| (0..experts).map(|e| p.capacity(e, d)).sum::<u64>())
            .max()
            .unwrap();
        prop_assert_eq!(p.max_recv_tokens(), max_recv);
        for t in p.transfers() {
            prop_assert!(t.count > 0 && t.src != t.dst);
        }
    }

    #[test]
    fn send_order_layout((tokens, replicas) in instance(), seed in any::<u64>()) {
        let p = plan(&tokens, &replicas).unwrap();
        let (experts, ranks) = dims(&tokens);
        for src in 0..ranks {
            let list = token_list(&tokens, src, seed ^ src as u64);
            let order = p.send_order(src, &list).unwrap();
            // permutation
            let mut seen = vec![false; list.len()];
            prop_assert_eq!(order.len(), list.len());
            for &k in &order {
                prop_assert!(!seen[k]);
                seen[k] = true;
            }
            // blocks (dst, e) at the documented offsets, of size D, in appearance order
            let offs = p.send_offsets(src);
            let mut pos = 0u64;
            for dst in 0..ranks {
                for e in 0..experts {
                    prop_assert_eq!(offs[dst][e], pos);
                    let len = p.count(src, e, dst);
                    let before: u64 = (0..dst).map(|j| p.count(src, e, j)).sum();
                    // indices of expert-e tokens, in order of appearance
                    let of_e: Vec<usize> =
                        (0..list.len()).filter(|&k| list[k] as usize == e).collect();
                    let block = &order[pos as usize..(pos + len) as usize];
                    prop_assert_eq!(block, &of_e[before as usize..(before + len) as usize]);
                    pos += len;
                }
                let end: u64 = (0..=dst).map(|j| p.send_counts[src][j]).sum();
                prop_assert_eq!(pos, end);
            }
            prop_assert_eq!(pos as usize, list.len());
        }
    }

    #[test]
    fn recv_layout_matches_plan((tokens, replicas) in instance()) {
        let p = plan(&tokens, &replicas).unwrap();
        let (experts, ranks) = dims(&tokens);
        for dst in 0..ranks {
            let mut expected = Vec::new();
            let mut pos = 0;
            for src in 0..ranks {
                for e in 0..experts {
                    let len = p.count(src, e, dst);
                    if len > 0 {
                        expected.push(RecvBlock { src, expert: e, start: pos, len });
                        pos += len;
                    }
                }
            }
            prop_assert_eq!(p.recv_layout(dst), expected);
            prop_assert_eq!(pos, p.recv_counts[dst].iter().sum::<u64>());
        }
    }

    #[test]
    fn deterministic_and_serde_roundtrip((tokens, replicas) in instance()) {
        let p = plan(&tokens, &replicas).unwrap();
        prop_assert_eq!(&plan(&tokens, &replicas).unwrap(), &p);
        let json = serde_json::to_string(&p).unwrap();
        let back: DispatchPlan = serde_json::from_str(&json).unwrap();
        prop_assert_eq!(back, p);
    }
}

#[test]
fn two_ranks_even_split() {
    let p = plan(&[vec![10, 0]], &[vec![1, 1]]).unwrap();
    assert_eq!(p.count(0, 0, 0), 5);
    assert_eq!(p.count(0, 0, 1), 5);
    assert_eq!(p.count(1, 0, 0), 0);
    assert_eq!(p.count(1, 0, 1), 0);
    assert_eq!(p.send_counts, vec![vec![5, 5], vec![0, 0]]);
    assert_eq!(p.recv_counts, vec![vec![5, 0], vec![5, 0]]);
    assert_eq!(p.total_remote_tokens(), 5);
    assert_eq!(p.max_recv_tokens(), 5);
}

#[test]
fn three_way_split_largest_remainder() {
    let p = plan(&[vec![7, 0, 0]], &[vec![1, 1, 1]]).unwrap();
    assert_eq!([0, 1, 2].map(|j| p.capacity(0, j)), [3, 2, 2]);
    assert_eq!([0, 1, 2].map(|j| p.count(0, 0, j)), [3, 2, 2]);
}

#[test]
fn unequal_replicas_remainders() {
    // t = 10, R = [1, 2, 4]: ideal 1.43, 2.86, 5.71 → floors 1, 2, 5, remainders 3, 6, 5 (/7)
    let p = plan(&[vec![0, 0, 10]], &[vec![1, 2, 4]]).unwrap();
    assert_eq!([0, 1, 2].map(|j| p.capacity(0, j)), [1, 3, 6]);
    assert_eq!([0, 1, 2].map(|j| p.count(2, 0, j)), [1, 3, 6]);
}

#[test]
fn two_senders_two_receivers_rounding() {
    // caps 4 each (t = 16, 4 ranks); O = [4, 4] on ranks 0, 1 (8, 8 tokens), P = [4, 4] on 2, 3.
    let p = plan(&[vec![8, 8, 0, 0]], &[vec![1, 1, 1, 1]]).unwrap();
    for i in 0..2 {
        assert_eq!(p.count(i, 0, i), 4);
        assert_eq!(p.count(i, 0, 2), 2);
        assert_eq!(p.count(i, 0, 3), 2);
    }
    // Odd case: t = 9 over 3 ranks, T = [5, 4, 0] → caps 3, 3, 3; O = [2, 1], P = [3].
    let p = plan(&[vec![5, 4, 0]], &[vec![1, 1, 1]]).unwrap();
    assert_eq!(p.count(0, 0, 2), 2);
    assert_eq!(p.count(1, 0, 2), 1);
    // O = [1, 1, 1] to P = [1, 2] (x = 1/3, 2/3): Ryser fills row 0 first, largest column.
    let p = plan(&[vec![3, 3, 3, 0, 1]], &[vec![1, 1, 1, 1, 1]]).unwrap();
    assert_eq!([3, 4].map(|j| p.capacity(0, j)), [2, 2]);
    assert_eq!(p.count(0, 0, 3) + p.count(1, 0, 3) + p.count(2, 0, 3), 2);
    assert_eq!(p.count(0, 0, 4) + p.count(1, 0, 4) + p.count(2, 0, 4), 1);
    assert_eq!([0, 1, 2].map(|i| p.count(i, 0, 3)), [1, 1, 0]);
    assert_eq!([0, 1, 2].map(|i| p.count(i, 0, 4)), [0, 0, 1]);
}

#[test]
fn send_order_hand_example() {
    // Rank 0 has tokens [e1, e0, e0, e1, e0, e0], T0 = [4, 0], T1 = [2, 0].
    // Expert 0 on ranks 0, 1 → caps 2, 2: keep 2, send 2 to rank 1.
    // Expert 1 only on rank 1 → send both to rank 1.
    let tokens = vec![vec![4, 0], vec![2, 0]];
    let replicas = vec![vec![1, 1], vec![0, 1]];
    let p = plan(&tokens, &replicas).unwrap();
    assert_eq!(p.send_offsets(0), vec![vec![0, 2], vec![2, 4]]);
    let order = p.send_order(0, &[1, 0, 0, 1, 0, 0]).unwrap();
    assert_eq!(order, vec![1, 2, 4, 5, 0, 3]);
    assert_eq!(
        p.recv_layout(1),
        vec![
            RecvBlock {
                src: 0,
                expert: 0,
                start: 0,
                len: 2
            },
            RecvBlock {
                src: 0,
                expert: 1,
                start: 2,
                len: 2
            },
        ]
    );
    assert_eq!(
        p.recv_layout(0),
        vec![RecvBlock {
            src: 0,
            expert: 0,
            start: 0,
            len: 2
        }]
    );
}

#[test]
fn send_order_errors() {
    let p = plan(&[vec![2, 0], vec![1, 0]], &[vec![1, 1], vec![1, 0]]).unwrap();
    assert_eq!(
        p.send_order(0, &[0, 1]),
        Err(DispatchError::TokenCountMismatch {
            rank: 0,
            expert: 0,
            expected: 2,
            found: 1
        })
    );
    assert_eq!(
        p.send_order(0, &[0, 2, 0]),
        Err(DispatchError::UnknownExpert {
            index: 1,
            expert: 2,
            experts: 2
        })
    );
    assert_eq!(
        p.send_order(5, &[]),
        Err(DispatchError::RankOutOfRange { rank: 5, ranks: 2 })
    );
    assert!(p.send_order(1, &[]).unwrap().is_empty());
}

#[test]
fn no_replica_error() {
    let err = plan(&[vec![1, 2], vec![3, 0]], &[vec![1, 0], vec![0, 0]]).unwrap_err();
    assert_eq!(
        err,
        DispatchError::NoReplica {
            expert: 1,
            tokens: 3
        }
    );
    assert!(err.to_string().contains("expert 1"));
}

#[test]
fn zero_token_expert_needs_no_replica() {
    let p = plan(&[vec![0, 0], vec![3, 1]], &[vec![0, 0], vec![1, 1]]).unwrap();
    assert_eq!([0, 1].map(|j| p.capacity(0, j)), [0, 0]);
    assert_eq!(p.count(0, 1, 0), 2);
    assert_eq!(p.count(0, 1, 1), 1);
}

/// The forced-skew case of `results/fsep` (4 nodes × 6 slots, 8 experts, f = 2): Eq. 1's floors
/// bind, MRO puts the six floored experts on nodes 0–1 and the two hot ones on nodes 2–3, and
/// the dispatcher's capacities leave those blocks unequally loaded; `spread` of the same
/// allocation mixes hot and cold replicas on every node.
#[test]
fn tokens_per_rank_of_an_mro_plan_with_binding_floors() {
    use lazarus_planner::{AllocPolicy, PlacePolicy, allocate, place};
    let loads = [1618, 1018, 564, 336, 241, 151, 95, 73];
    let a = allocate(AllocPolicy::Lazarus, &loads, 24, 2).unwrap();
    assert_eq!(a.replicas, [8, 4, 2, 2, 2, 2, 2, 2]);
    let per_rank = |policy| {
        let p = place(policy, &a.replicas, 4, 6).unwrap();
        tokens_per_rank(&loads, &replicas_per_rank(&p.grid().to_vec(), 8)).unwrap()
    };
    assert_eq!(per_rank(PlacePolicy::Mro), [732, 728, 1318, 1318]);
    assert_eq!(per_rank(PlacePolicy::Spread), [1111, 1109, 939, 937]);
}

#[test]
fn tokens_per_rank_errors() {
    assert!(matches!(
        tokens_per_rank(&[1, 2], &[vec![1, 1]]),
        Err(DispatchError::ShapeMismatch {
            expected: 2,
            found: 1,
            ..
        })
    ));
    assert!(matches!(
        tokens_per_rank(&[1, 2], &[vec![1, 1], vec![1]]),
        Err(DispatchError::ShapeMismatch {
            expected: 2,
            found: 1,
            ..
        })
    ));
    assert!(matches!(
        tokens_per_rank(&[0, 5], &[vec![0, 0], vec![0, 0]]),
        Err(DispatchError::NoReplica {
            expert: 1,
            tokens: 5
        })
    ));
    assert!(matches!(
        tokens_per_rank(&[u64::MAX, 1], &[vec![1], vec![1]]),
        Err(DispatchError::Overflow { .. })
    ));
    assert_eq!(tokens_per_rank(&[], &[]).unwrap(), Vec::<u64>::new());
}

#[test]
fn shape_mismatch_errors() {
    assert!(matches!(
        plan(&[vec![1, 2]], &[vec![1, 1], vec![1, 1]]),
        Err(DispatchError::ShapeMismatch {
            expected: 1,
            found: 2,
            ..
        })
    ));
    assert!(matches!(
        plan(&[vec![1, 2], vec![3]], &[vec![1, 1], vec![1, 1]]),
        Err(DispatchError::ShapeMismatch {
            expected: 2,
            found: 1,
            ..
        })
    ));
    assert!(matches!(
        plan(&[vec![1, 2]], &[vec![1, 1, 1]]),
        Err(DispatchError::ShapeMismatch {
            expected: 2,
            found: 3,
            ..
        })
    ));
}

#[test]
fn empty_and_overflow_inputs() {
    let p = plan(&[], &[]).unwrap();
    assert_eq!((p.experts, p.ranks), (0, 0));
    assert_eq!(p.max_recv_tokens(), 0);
    let p = plan(&[vec![], vec![]], &[vec![], vec![]]).unwrap();
    assert_eq!((p.experts, p.ranks), (2, 0));
    assert!(matches!(
        plan(&[vec![u64::MAX, 1]], &[vec![1, 1]]),
        Err(DispatchError::Overflow { .. })
    ));
}

#[test]
fn huge_counts_exact() {
    // Products O·P overflow u64; the u128 path must keep everything exact.
    let big = u64::MAX / 4;
    let p = plan(&[vec![big, big, 0]], &[vec![1, 1, 1]]).unwrap();
    let t = 2 * big;
    let caps = [0, 1, 2].map(|j| p.capacity(0, j));
    assert_eq!(caps.iter().sum::<u64>(), t);
    for src in 0..2 {
        assert_eq!((0..3).map(|d| p.count(src, 0, d)).sum::<u64>(), big);
    }
    assert_eq!(p.count(0, 0, 2) + p.count(1, 0, 2), caps[2]);
}

#[test]
fn replicas_from_grid() {
    let grid = vec![vec![0, 1], vec![1, 1], vec![2, u32::MAX]];
    assert_eq!(
        replicas_per_rank(&grid, 3),
        vec![vec![1, 0, 0], vec![1, 2, 0], vec![0, 0, 1]]
    );
}

/// `cargo test --release -p lazarus-planner --test dispatch -- --ignored --nocapture`
#[test]
#[ignore]
fn perf_1024_ranks_256_experts() {
    let (ranks, experts) = (1024usize, 256usize);
    let slots: usize = std::env::var("SLOTS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(4);
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let grid: Vec<Vec<u32>> = (0..ranks)
        .map(|_| {
            (0..slots)
                .map(|_| (next() % experts as u64) as u32)
                .collect()
        })
        .collect();
    let mut replicas = replicas_per_rank(&grid, experts);
    for row in &mut replicas {
        if row.iter().all(|&r| r == 0) {
            row[0] = 1;
        }
    }
    let tokens: Vec<Vec<u64>> = (0..experts)
        .map(|_| (0..ranks).map(|_| next() % 64).collect())
        .collect();
    let start = std::time::Instant::now();
    let runs = 10;
    for _ in 0..runs {
        std::hint::black_box(plan(&tokens, &replicas).unwrap());
    }
    let per = start.elapsed() / runs;
    let p = plan(&tokens, &replicas).unwrap();
    println!(
        "plan R={ranks} E={experts}: {per:?}/call, {} transfers",
        p.transfers().count()
    );
}
