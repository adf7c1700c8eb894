//! Seeded parameter initialisation and the FNV-1a checksum.
//!
//! candle's own `randn` on CPU draws from an unseeded thread RNG, so every parameter here is
//! drawn from its own `Xoshiro256PlusPlus` stream keyed by `(seed, name)`: the value of a
//! parameter does not depend on creation order or on which other parameters a worker holds, so
//! two workers that build the same expert replica get the same bits.

use candle_core::{Device, Result, Shape, Tensor};
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// Incremental 64-bit FNV-1a.
#[derive(Debug, Clone, Copy)]
pub struct Fnv64(u64);

impl Default for Fnv64 {
    fn default() -> Self {
        Self(FNV_OFFSET)
    }
}

impl Fnv64 {
    pub fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(FNV_PRIME);
        }
    }

    /// Hashes each value's IEEE-754 bits, little-endian.
    pub fn write_f32s(&mut self, xs: &[f32]) {
        for x in xs {
            self.write(&x.to_bits().to_le_bytes());
        }
    }

    pub fn finish(&self) -> u64 {
        self.0
    }
}

/// SplitMix64 finaliser, to spread `(seed, key)` over the RNG seed space.
pub(crate) fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// An RNG for stream `key` of run `seed`.
pub(crate) fn rng_for(seed: u64, key: &str) -> Xoshiro256PlusPlus {
    let mut h = Fnv64::default();
    h.write(key.as_bytes());
    Xoshiro256PlusPlus::seed_from_u64(mix(seed ^ mix(h.finish())))
}

/// `N(0, std²)` f32 tensor, drawn with Box–Muller from the `(seed, name)` stream.
pub(crate) fn normal(
    seed: u64,
    name: &str,
    shape: impl Into<Shape>,
    std: f64,
    dev: &Device,
) -> Result<Tensor> {
    let shape = shape.into();
    let n = shape.elem_count();
    let mut rng = rng_for(seed, name);
    let mut out = Vec::with_capacity(n + 1);
    while out.len() < n {
        // u1 in (0, 1] so ln(u1) is finite.
        let u1 = 1.0 - rng.random::<f64>();
        let u2 = rng.random::<f64>();
        let r = (-2.0 * u1.ln()).sqrt() * std;
        let (s, c) = (std::f64::consts::TAU * u2).sin_cos();
        out.push((r * c) as f32);
        out.push((r * s) as f32);
    }
    out.truncate(n);
    Tensor::from_vec(out, shape, dev)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv_known_vectors() {
        let h = |s: &str| {
            let mut f = Fnv64::default();
            f.write(s.as_bytes());
            f.finish()
        };
        assert_eq!(h(""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(h("a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(h("foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn normal_is_seeded_and_plausible() -> Result<()> {
        let dev = Device::Cpu;
        let a = normal(7, "x", 4001, 0.5, &dev)?.to_vec1::<f32>()?;
        let b = normal(7, "x", 4001, 0.5, &dev)?.to_vec1::<f32>()?;
        let c = normal(7, "y", 4001, 0.5, &dev)?.to_vec1::<f32>()?;
        assert_eq!(a, b);
        assert_ne!(a, c);
        let n = a.len() as f64;
        let mean = a.iter().map(|&x| f64::from(x)).sum::<f64>() / n;
        let var = a
            .iter()
            .map(|&x| (f64::from(x) - mean).powi(2))
            .sum::<f64>()
            / n;
        assert!(mean.abs() < 0.05, "mean {mean}");
        assert!((var.sqrt() - 0.5).abs() < 0.05, "std {}", var.sqrt());
        Ok(())
    }
}
