//! 64-bit fingerprints of training state, for telling copies of one object apart.
//!
//! FNV-1a ([`super::Fnv64`]) takes a multiply per byte; a fingerprint of every step's whole
//! state must cost little next to the optimizer update that touches the same values, so this
//! folds 64-bit words: `h = (h ⊕ w)·K; h ^= h >> 32` with an odd `K`. Both steps are
//! bijections of `h`, so for the same later words two inputs that differ in exactly one word
//! always give different fingerprints (a flipped bit is never missed); more differences
//! collide with probability about 2⁻⁶⁴. Not a cryptographic hash: it guards against bugs and
//! faults, not adversaries.

use candle_core::{CpuStorage, Storage, Tensor};

use super::{ExpertState, OptimState, ShardState};

/// The 64-bit golden-ratio constant (odd), as in Fibonacci hashing.
const K: u64 = 0x9e37_79b9_7f4a_7c15;

/// An incremental word-wise fingerprint (see the [module docs](self)).
#[derive(Debug, Clone, Copy)]
pub struct Fingerprint(u64);

impl Default for Fingerprint {
    fn default() -> Self {
        // Any non-zero start: the FNV offset basis.
        Self(0xcbf2_9ce4_8422_2325)
    }
}

impl Fingerprint {
    pub fn word(&mut self, w: u64) {
        self.0 = (self.0 ^ w).wrapping_mul(K);
        self.0 ^= self.0 >> 32;
    }

    /// The values' IEEE-754 bits, two per word, after their count (so that sections of a
    /// longer input cannot shift into each other).
    pub fn f32s(&mut self, xs: &[f32]) {
        self.word(xs.len() as u64);
        let mut pairs = xs.chunks_exact(2);
        for p in &mut pairs {
            self.word(u64::from(p[0].to_bits()) | (u64::from(p[1].to_bits()) << 32));
        }
        if let [x] = pairs.remainder() {
            self.word(u64::from(x.to_bits()));
        }
    }

    pub fn finish(&self) -> u64 {
        self.0
    }
}

/// Folds a tensor's f32 values as [`Fingerprint::f32s`] does, in place from a contiguous
/// f32 CPU storage (no copy: the per-step fingerprint must not double the state in memory),
/// else from a copy (another dtype, a strided view, a device).
pub fn tensor(h: &mut Fingerprint, t: &Tensor) -> candle_core::Result<()> {
    {
        let (storage, layout) = t.storage_and_layout();
        if let (Storage::Cpu(CpuStorage::F32(values)), Some((start, end))) =
            (&*storage, layout.contiguous_offsets())
            && let Some(xs) = values.get(start..end)
        {
            h.f32s(xs);
            return Ok(());
        }
    }
    h.f32s(
        &t.flatten_all()?
            .to_dtype(candle_core::DType::F32)?
            .to_vec1::<f32>()?,
    );
    Ok(())
}

/// Fingerprint of an optimizer's whole state: the step counter, then every parameter's
/// values and both AdamW moments, in slot order.
pub fn optim_state(s: &OptimState) -> u64 {
    let mut h = Fingerprint::default();
    h.word(s.step);
    h.word(s.params.len() as u64);
    for p in &s.params {
        h.f32s(&p.value);
        h.f32s(&p.m);
        h.f32s(&p.v);
    }
    h.finish()
}

/// Fingerprint of one expert replica: its step, weights and both AdamW moments.
pub fn expert_state(s: &ExpertState) -> u64 {
    let mut h = Fingerprint::default();
    h.word(s.step);
    for xs in [&s.w1, &s.w2, &s.m1, &s.v1, &s.m2, &s.v2] {
        h.f32s(xs);
    }
    h.finish()
}

/// Fingerprint of one shard copy: its slice of every expert (`states`, ascending
/// `(layer, expert)`, all of one shard index), with each slice's moments and step.
pub fn shard_copy(states: &[ShardState]) -> u64 {
    let mut h = Fingerprint::default();
    h.word(states.len() as u64);
    for s in states {
        h.word(s.layer as u64);
        h.word(s.expert as u64);
        h.word(s.step);
        h.f32s(&s.value);
        h.f32s(&s.m);
        h.f32s(&s.v);
    }
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn of(xs: &[f32]) -> u64 {
        let mut h = Fingerprint::default();
        h.f32s(xs);
        h.finish()
    }

    #[test]
    fn every_single_bit_flip_changes_the_fingerprint() {
        let xs: Vec<f32> = (0..33).map(|i| i as f32 * 0.37 - 3.0).collect();
        let base = of(&xs);
        for i in 0..xs.len() {
            for bit in 0..32 {
                let mut ys = xs.clone();
                ys[i] = f32::from_bits(ys[i].to_bits() ^ (1 << bit));
                assert_ne!(of(&ys), base, "value {i}, bit {bit}");
            }
        }
    }

    #[test]
    fn lengths_are_part_of_the_input() {
        assert_ne!(of(&[]), of(&[0.0]));
        assert_ne!(of(&[0.0]), of(&[0.0, 0.0]));
        let mut a = Fingerprint::default();
        a.f32s(&[1.0, 2.0]);
        a.f32s(&[3.0]);
        let mut b = Fingerprint::default();
        b.f32s(&[1.0]);
        b.f32s(&[2.0, 3.0]);
        assert_ne!(a.finish(), b.finish());
    }

    #[test]
    fn a_tensor_folds_in_place_as_its_values_do() {
        use candle_core::{Device, Tensor};
        let xs: Vec<f32> = (0..12).map(|i| i as f32 / 7.0).collect();
        let t = Tensor::from_vec(xs.clone(), (3, 4), &Device::Cpu).unwrap();
        for view in [t.clone(), t.t().unwrap(), t.narrow(1, 1, 2).unwrap()] {
            let mut a = Fingerprint::default();
            tensor(&mut a, &view).unwrap();
            let mut b = Fingerprint::default();
            b.f32s(&view.flatten_all().unwrap().to_vec1::<f32>().unwrap());
            assert_eq!(a.finish(), b.finish());
        }
    }
}
