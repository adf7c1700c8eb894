//! Property tests of allocation and placement invariants on random inputs.

use lazarus_planner::allocate::{ascending_order, effective_f};
use lazarus_planner::place::{PlacePolicy, place};
use lazarus_planner::{Aggregation, AllocPolicy, LoadHistory, allocate};
use proptest::prelude::*;

fn policies() -> impl Strategy<Value = AllocPolicy> {
    prop_oneof![
        Just(AllocPolicy::Lazarus),
        Just(AllocPolicy::Eplb),
        Just(AllocPolicy::Uniform)
    ]
}

fn placements() -> impl Strategy<Value = PlacePolicy> {
    prop_oneof![
        Just(PlacePolicy::Mro),
        Just(PlacePolicy::Spread),
        Just(PlacePolicy::Compact),
        any::<u64>().prop_map(|seed| PlacePolicy::Random { seed }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    /// Σr = N·c, r ≥ f_eff ≥ 1, f_eff = min(f, ⌊N·c/E⌋).
    #[test]
    fn allocation_fills_every_slot_and_honours_threshold(
        policy in policies(),
        loads in prop::collection::vec(0u64..1_000_000, 1..=64),
        slots in 1usize..=512,
        f in 1usize..=4,
    ) {
        let e = loads.len();
        match allocate(policy, &loads, slots, f) {
            Err(_) => prop_assert!(slots < e),
            Ok(a) => {
                prop_assert_eq!(a.replicas.iter().sum::<usize>(), slots);
                prop_assert_eq!(a.f_effective, effective_f(slots, e, f).unwrap());
                prop_assert_eq!(a.f_effective, f.min(slots / e));
                prop_assert!(a.f_effective >= 1);
                prop_assert!(a.replicas.iter().all(|&r| r >= a.f_effective));
            }
        }
    }

    /// Eq. 1 is monotone in load (r_e ≥ r_{e−1} in ascending order, the paper's third
    /// property) and roughly proportional: no expert is more than one replica below its
    /// proportional share among the experts above the threshold.
    #[test]
    fn eq1_is_monotone_in_load(
        loads in prop::collection::vec(0u64..100_000, 1..=64),
        extra in 0usize..=512,
        f in 1usize..=3,
    ) {
        let slots = loads.len() * f + extra;
        let a = allocate(AllocPolicy::Lazarus, &loads, slots, f).unwrap();
        let order = ascending_order(&loads);
        for w in order.windows(2) {
            prop_assert!(a.replicas[w[1]] >= a.replicas[w[0]],
                "r not monotone: loads {:?} r {:?}", loads, a.replicas);
        }
    }

    /// EPLB's greedy ends with no expert that would rather have a replica of another:
    /// max load/replica after removing one replica from anyone ≥ current max.
    #[test]
    fn eplb_is_balanced(
        loads in prop::collection::vec(1u64..100_000, 1..=32),
        extra in 0usize..=128,
    ) {
        let slots = loads.len() + extra;
        let r = allocate(AllocPolicy::Eplb, &loads, slots, 1).unwrap().replicas;
        let max = loads.iter().zip(&r).map(|(&t, &x)| t as f64 / x as f64).fold(0.0, f64::max);
        for (i, (&t, &x)) in loads.iter().zip(&r).enumerate() {
            if x > 1 {
                // Moving one replica away from i would make i's share at least the current max.
                prop_assert!(t as f64 / (x - 1) as f64 >= max - 1e-9, "expert {}", i);
            }
        }
    }

    /// Every placement fills every slot and honours every count exactly.
    #[test]
    fn placement_honours_counts(
        policy in placements(),
        alloc in policies(),
        loads in prop::collection::vec(0u64..10_000, 1..=40),
        nodes in 1usize..=16,
        c in 1usize..=8,
        f in 1usize..=3,
    ) {
        prop_assume!(loads.len() <= nodes * c);
        let a = allocate(alloc, &loads, nodes * c, f).unwrap();
        let p = place(policy, &a.replicas, nodes, c).unwrap();
        prop_assert_eq!(p.nodes(), nodes);
        prop_assert!(p.grid().iter().all(|n| n.len() == c));
        prop_assert_eq!(p.replicas(), a.replicas.clone());
        let m = p.replica_matrix();
        for (e, row) in m.iter().enumerate() {
            prop_assert_eq!(row.iter().map(|&x| x as usize).sum::<usize>(), a.replicas[e]);
        }
        // Spread and MRO put an expert with r ≤ N replicas on distinct nodes where they can.
        if policy == PlacePolicy::Spread {
            for (e, s) in p.node_sets().iter().enumerate() {
                prop_assert_eq!(s.len(), a.replicas[e].min(nodes));
            }
        }
    }

    /// A sliding sum window equals the sum of the last W pushes.
    #[test]
    fn sum_window_matches_naive(
        steps in prop::collection::vec(prop::collection::vec(0u64..1000, 3), 1..30),
        window in 1usize..8,
    ) {
        let mut h = LoadHistory::new(Aggregation::Sum { window_steps: window }, 1, 3).unwrap();
        for s in &steps {
            h.push(std::slice::from_ref(s)).unwrap();
        }
        let start = steps.len().saturating_sub(window);
        let mut want = vec![0u64; 3];
        for s in &steps[start..] {
            for (w, x) in want.iter_mut().zip(s) {
                *w += x;
            }
        }
        prop_assert_eq!(h.loads(), vec![want]);
    }
}
