//! The CPU references against the planner: counts and send positions bit for bit
//! (`DispatchPlan::send_order` is the inverse of `send_positions`), the permutation row by row,
//! the un-permute as its exact inverse (bits, -0.0 and NaN payloads included), the combine
//! within a tolerance of an f64 evaluation.

use lazarus_kernels::cpu::{
    combine, combine_bf16, count_experts, order_from_positions, permute_rows, send_positions,
    unpermute_rows,
};
use lazarus_kernels::{DispatchTables, KernelError, NO_POSITION, bf16_from_f32, f32_from_bf16};
use lazarus_planner::dispatch::{DispatchPlan, plan};
use proptest::prelude::*;

/// Random gate output of every rank (`experts[rank][slot]`) and replica counts `R[e][rank]`
/// (every expert has at least one replica).
fn scenario() -> impl Strategy<Value = (Vec<Vec<u32>>, Vec<Vec<u32>>, usize)> {
    (1usize..6, 1usize..9, 1usize..3).prop_flat_map(|(ranks, experts, top_k)| {
        let gate = prop::collection::vec(
            prop::collection::vec(0..experts as u32, 0..40).prop_map(move |mut v| {
                v.truncate(v.len() / top_k * top_k);
                v
            }),
            ranks,
        );
        let replicas = prop::collection::vec(
            (0..ranks, prop::collection::vec(0u32..3, ranks)).prop_map(|(home, mut row)| {
                row[home] += 1;
                row
            }),
            experts,
        );
        (gate, replicas, Just(top_k))
    })
}

fn plan_for(gate: &[Vec<u32>], replicas: &[Vec<u32>]) -> DispatchPlan {
    let experts = replicas.len();
    let mut tokens = vec![vec![0u64; gate.len()]; experts];
    for (rank, slots) in gate.iter().enumerate() {
        let counts = count_experts(slots, experts).unwrap();
        for (e, c) in counts.into_iter().enumerate() {
            tokens[e][rank] = u64::from(c);
        }
    }
    plan(&tokens, replicas).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn positions_invert_the_planners_send_order((gate, replicas, _k) in scenario()) {
        let p = plan_for(&gate, &replicas);
        for (src, slots) in gate.iter().enumerate() {
            let t = DispatchTables::from_plan(&p, src).unwrap();
            prop_assert_eq!(t.send_rows, slots.len());
            let pos = send_positions(slots, &t).unwrap();
            let order = order_from_positions(&pos, t.send_rows);
            prop_assert_eq!(order, p.send_order(src, slots).unwrap());
        }
    }

    #[test]
    fn permutation_and_identity_combine((gate, replicas, k) in scenario(), hidden in 1usize..5) {
        let p = plan_for(&gate, &replicas);
        for (src, slots) in gate.iter().enumerate() {
            let t = DispatchTables::from_plan(&p, src).unwrap();
            let pos = send_positions(slots, &t).unwrap();
            let tokens = slots.len() / k;
            let x: Vec<f32> = (0..tokens * hidden).map(|i| i as f32 * 0.25 - 3.0).collect();
            let send = permute_rows(&x, hidden, k, &pos, t.send_rows).unwrap();
            let order = p.send_order(src, slots).unwrap();
            for (row, &slot) in order.iter().enumerate() {
                let tok = slot / k;
                prop_assert_eq!(&send[row * hidden..(row + 1) * hidden], &x[tok * hidden..(tok + 1) * hidden]);
            }
            // Experts that return their input, weights 1/k: the combine gives x back.
            let w = vec![1.0 / k as f32; slots.len()];
            let y = combine(&send, hidden, k, &pos, &w).unwrap();
            for (a, b) in y.iter().zip(&x) {
                prop_assert!((a - b).abs() <= 1e-5 * b.abs().max(1.0), "{a} vs {b}");
            }
        }
    }

    /// top_k = 1 (the worker's case): the un-permute gives back every bit of `x`, signed zeros
    /// and NaN payloads included.
    #[test]
    fn unpermute_inverts_permute_bit_for_bit(
        (gate, replicas, _k) in scenario(),
        hidden in 1usize..6,
        bits in prop::collection::vec(any::<u32>(), 0..64),
    ) {
        let p = plan_for(&gate, &replicas);
        // Interesting bit patterns first (both zeros, infinities, quiet and signalling NaNs
        // with payloads), then arbitrary ones.
        let special = [
            0x8000_0000u32, 0x0000_0000, 0x7f80_0000, 0xff80_0000, 0x7fc0_0001, 0xffc1_2345,
            0x7f80_0001, 0xff9a_bcde, 0x0000_0001, 0x8000_0001,
        ];
        let pool: Vec<u32> = special.iter().copied().chain(bits).collect();
        for (src, slots) in gate.iter().enumerate() {
            let t = DispatchTables::from_plan(&p, src).unwrap();
            let pos = send_positions(slots, &t).unwrap();
            let x: Vec<f32> = (0..slots.len() * hidden)
                .map(|i| f32::from_bits(pool[(i * 7 + src) % pool.len()]))
                .collect();
            let send = permute_rows(&x, hidden, 1, &pos, t.send_rows).unwrap();
            let back = unpermute_rows(&send, hidden, &pos, slots.len()).unwrap();
            let (a, b): (Vec<u32>, Vec<u32>) = (
                back.iter().map(|v| v.to_bits()).collect(),
                x.iter().map(|v| v.to_bits()).collect(),
            );
            prop_assert_eq!(a, b);
            // And the rows land where `send_order` says they come from.
            let order = p.send_order(src, slots).unwrap();
            for (row, &slot) in order.iter().enumerate() {
                prop_assert_eq!(
                    &back[slot * hidden..(slot + 1) * hidden].iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    &send[row * hidden..(row + 1) * hidden].iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                );
            }
        }
    }
}

#[test]
fn unpermute_is_exact_where_a_unit_combine_is_not() {
    // fma(1, -0.0, +0.0) = +0.0: the weighted combine loses the sign of a zero, the un-permute
    // copies it.
    let x = [-0.0f32, f32::from_bits(0x7fc0_1234)];
    let pos = [1u32, 0];
    let send = permute_rows(&x, 1, 1, &pos, 2).unwrap();
    let back = unpermute_rows(&send, 1, &pos, 2).unwrap();
    assert_eq!(back[0].to_bits(), 0x8000_0000);
    assert_eq!(back[1].to_bits(), 0x7fc0_1234);
    let unit = combine(&send, 1, 1, &pos, &[1.0, 1.0]).unwrap();
    assert_eq!(unit[0].to_bits(), 0, "the combine turns -0.0 into +0.0");
    // Any element type: bf16 bits.
    let x16 = [0x8000u16, 0x7fc1, 0x3f80, 0x0001];
    let pos = [3u32, 0, 2, 1];
    let send16 = permute_rows(&x16, 1, 1, &pos, 4).unwrap();
    assert_eq!(unpermute_rows(&send16, 1, &pos, 4).unwrap(), x16);
}

#[test]
fn combine_is_close_to_f64() {
    let (tokens, k, hidden) = (7usize, 3usize, 5usize);
    let pos: Vec<u32> = (0..(tokens * k) as u32).rev().collect();
    let back: Vec<f32> = (0..tokens * k * hidden)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
        .collect();
    let w: Vec<f32> = (0..tokens * k)
        .map(|i| (i % 5) as f32 / 3.0 - 0.4)
        .collect();
    let y = combine(&back, hidden, k, &pos, &w).unwrap();
    for t in 0..tokens {
        for i in 0..hidden {
            let want: f64 = (0..k)
                .map(|j| {
                    let s = t * k + j;
                    f64::from(w[s]) * f64::from(back[pos[s] as usize * hidden + i])
                })
                .sum();
            let got = f64::from(y[t * hidden + i]);
            assert!(
                (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                "{got} vs {want}"
            );
        }
    }
    // bf16 rows: the sum of the rounded inputs, rounded once (relative error ≤ 2^-8).
    let back16: Vec<u16> = back.iter().map(|&v| bf16_from_f32(v)).collect();
    let rounded: Vec<f32> = back16.iter().map(|&b| f32_from_bf16(b)).collect();
    let want = combine(&rounded, hidden, k, &pos, &w).unwrap();
    let y16 = combine_bf16(&back16, hidden, k, &pos, &w).unwrap();
    for (a, b) in y16.iter().zip(&want) {
        assert_eq!(
            *a,
            bf16_from_f32(*b),
            "bf16 combine rounds the f32 sum once"
        );
    }
}

#[test]
fn bf16_rounds_to_nearest_even() {
    assert_eq!(bf16_from_f32(1.0), 0x3f80);
    assert_eq!(f32_from_bf16(0x3f80), 1.0);
    // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0).
    assert_eq!(bf16_from_f32(1.0 + 1.0 / 256.0), 0x3f80);
    // 1 + 3·2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties to even (1 + 2^-6).
    assert_eq!(bf16_from_f32(1.0 + 3.0 / 256.0), 0x3f82);
    assert!(f32_from_bf16(bf16_from_f32(f32::NAN)).is_nan());
    assert_eq!(f32_from_bf16(bf16_from_f32(-2.5)), -2.5);
}

#[test]
fn bad_input_is_an_error_not_a_panic() {
    assert_eq!(
        count_experts(&[0, 3, 1], 2),
        Err(KernelError::UnknownExpert {
            slot: 1,
            expert: 3,
            experts: 2
        })
    );
    let p = plan(&[vec![2, 0], vec![0, 1]], &[vec![1, 0], vec![0, 1]]).unwrap();
    let t = DispatchTables::from_plan(&p, 0).unwrap();
    assert_eq!(
        send_positions(&[0, 1], &t),
        Err(KernelError::CountMismatch {
            expert: 0,
            expected: 2,
            found: 1
        })
    );
    assert!(matches!(
        DispatchTables::from_plan(&p, 5),
        Err(KernelError::RankOutOfRange { rank: 5, ranks: 2 })
    ));
    assert!(matches!(
        permute_rows(&[1.0f32; 3], 2, 1, &[0], 1),
        Err(KernelError::Shape(_))
    ));
    assert!(matches!(
        combine(&[1.0; 4], 2, 2, &[0, 1, 2], &[1.0; 3]),
        Err(KernelError::Shape(_))
    ));
}

#[test]
fn unpermute_shape_errors() {
    let back = [1.0f32, 2.0, 3.0, 4.0];
    // Row length 0, or back not whole rows.
    assert!(matches!(
        unpermute_rows(&back, 0, &[0], 1),
        Err(KernelError::Shape(_))
    ));
    assert!(matches!(
        unpermute_rows(&back, 3, &[0], 1),
        Err(KernelError::Shape(_))
    ));
    // One position per output row.
    assert!(matches!(
        unpermute_rows(&back, 2, &[0, 1], 3),
        Err(KernelError::Shape(_))
    ));
    // A position past the end of back names the slot and the row.
    let e = unpermute_rows(&back, 2, &[1, 2], 2).unwrap_err();
    assert!(matches!(e, KernelError::Shape(_)));
    assert!(e.to_string().contains("slot 1 maps to row 2"), "{e}");
    // NO_POSITION leaves the row at its default; empty input is fine.
    assert_eq!(
        unpermute_rows(&back, 2, &[NO_POSITION, 0], 2).unwrap(),
        vec![0.0, 0.0, 1.0, 2.0]
    );
    assert_eq!(
        unpermute_rows::<f32>(&[], 2, &[], 0).unwrap(),
        Vec::<f32>::new()
    );
}
