//! Bandwidth of the dispatch permutation on one GPU, as a ratio of a device-to-device copy of
//! the same bytes (the goal is ≥ 0.7), plus the position pipeline's time. Prints one JSON
//! object. Used by `kernels/check-gpu.sh`; needs feature `cuda` and a GPU.
//!
//! `dispatch_bench [TOKENS] [HIDDEN] [TOP_K] [EXPERTS]` (defaults 16384 4096 2 64; bf16 rows).

use std::time::Instant;

use anyhow::{Context, Result, anyhow};
use cudarc::driver::sys::CUevent_flags;
use lazarus_kernels::cuda::DispatchKernels;
use lazarus_kernels::{DispatchTables, cpu};
use lazarus_planner::dispatch::plan;

fn arg(i: usize, default: usize) -> Result<usize> {
    match std::env::args().nth(i) {
        Some(v) => v
            .parse()
            .with_context(|| format!("argument {i}: {v:?} is not a number")),
        None => Ok(default),
    }
}

fn main() -> Result<()> {
    let (tokens, hidden, top_k, experts) = (arg(1, 16384)?, arg(2, 4096)?, arg(3, 2)?, arg(4, 64)?);
    let k = DispatchKernels::on_device(0).map_err(|e| anyhow!("{e}"))?;
    let s = k.stream().clone();
    let slots = tokens * top_k;
    // Deterministic skewed routing; one rank, so the send buffer is expert-major.
    let gate: Vec<u32> = (0..slots as u64)
        .map(|i| {
            let h = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
            (if h % 2 == 0 {
                h % (experts as u64 / 4).max(1)
            } else {
                h % experts as u64
            }) as u32
        })
        .collect();
    let counts = cpu::count_experts(&gate, experts)?;
    // Four ranks' worth of plan: this rank keeps what it can and sends the rest.
    let ranks = 4;
    let tok: Vec<Vec<u64>> = counts
        .iter()
        .map(|&c| {
            let mut v = vec![u64::from(c); ranks];
            v[1] /= 2;
            v
        })
        .collect();
    let rep: Vec<Vec<u32>> = (0..experts)
        .map(|e| {
            (0..ranks)
                .map(|r| u32::from(r == e % ranks || r == (e + 1) % ranks))
                .collect()
        })
        .collect();
    let p = plan(&tok, &rep)?;
    let t = DispatchTables::from_plan(&p, 0)?;
    let d_gate = s.clone_htod(&gate)?;
    let x: Vec<u16> = (0..tokens * hidden).map(|i| (i % 65_000) as u16).collect();
    let d_x = s.clone_htod(&x)?;
    let mut d_send = s.alloc_zeros::<u16>(slots * hidden)?;
    let mut d_copy = s.alloc_zeros::<u16>(slots * hidden)?;
    let d_src = s.alloc_zeros::<u16>(slots * hidden)?;

    // Positions (count + scan + positions), host round trip for the counts included.
    let t0 = Instant::now();
    let c = k.count(&d_gate, experts)?;
    let d_pos = k.positions(&d_gate, &c, &t)?;
    s.synchronize()?;
    let positions_ms = t0.elapsed().as_secs_f64() * 1e3;
    let want = cpu::send_positions(&gate, &t)?;
    let ok = s.clone_dtoh(&d_pos)?[..slots] == want[..];

    let timed = |f: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
        for _ in 0..3 {
            f()?;
        }
        let reps = 20;
        let a = s.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        for _ in 0..reps {
            f()?;
        }
        let b = s.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        b.synchronize()?;
        Ok(f64::from(a.elapsed_ms(&b)?) / f64::from(reps))
    };
    let permute_ms = timed(&mut || {
        k.permute(&d_x, hidden, top_k, &d_pos, slots, &mut d_send)
            .map_err(|e| anyhow!("{e}"))
    })?;
    let copy_ms = timed(&mut || Ok(s.memcpy_dtod(&d_src, &mut d_copy)?))?;
    let bytes = (slots * hidden * 2) as f64;
    // The permutation reads and writes each byte once, as the copy does.
    let gbps = |ms: f64| 2.0 * bytes / (ms * 1e-3) / 1e9;
    println!(
        "{{\"tokens\":{tokens},\"hidden\":{hidden},\"top_k\":{top_k},\"experts\":{experts},\
         \"dtype\":\"bf16\",\"positions_match_cpu\":{ok},\"positions_ms\":{positions_ms:.3},\
         \"permute_ms\":{permute_ms:.4},\"copy_ms\":{copy_ms:.4},\"permute_gbps\":{:.1},\
         \"copy_gbps\":{:.1},\"ratio\":{:.3}}}",
        gbps(permute_ms),
        gbps(copy_ms),
        copy_ms / permute_ms
    );
    Ok(())
}
