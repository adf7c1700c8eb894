//! Fully sharded expert storage (FSEP, LAER-MoE §1.2): every expert's flattened parameters
//! `[w1; w2]` and their AdamW moments are cut into `S` shards, and each shard index of
//! *every* expert is kept on the ranks a placement names (`holders[w]`, [`ShardStore`]).
//! LAER's layout is one copy per rank (`S` = ranks, shard `w` on rank `w`:
//! [`ShardStore::fresh`]); resilient FSEP keeps `f` copies of each shard on distinct ranks
//! (placed by `lazarus_planner::fsep::place`), so a lost rank loses no shard. No rank holds a
//! whole expert between steps; the runtime materialises the experts the layout assigns to a
//! rank with an all-to-all of shards ([`crate::runtime::DistributedExperts::new_sharded`]) and
//! returns each gradient shard to every holder, so the optimizer runs on local shards only.
//!
//! Shard `w` of `S` covers `[w·P/S, (w+1)·P/S)` of the `P = 2·d_model·d_ff` values (`3·d_model·d_ff` for SwiGLU experts), so shard
//! sizes differ by at most one value. AdamW is element-wise, so updating the shards of an
//! expert with the slices of its summed gradient gives the same values, bit for bit, as
//! updating the whole expert with the whole gradient (given the same clipping factor); and
//! the copies of a shard, updated with the same summed slice, stay bit-identical.

use std::collections::BTreeMap;
use std::ops::Range;

use candle_core::{Device, Result, Tensor, Var};
use serde::{Deserialize, Serialize};

use super::config::{MoeConfig, Precision};
use super::experts::{ExpertState, ExpertStore};
use super::optim::{AdamW, OptimState, ParamState, ParamsAdamW, flat, scale_grad};

/// How a job stores its experts.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum ExpertMode {
    /// Whole replicas with their own optimizer state, placed by the plan; a re-layout moves
    /// replicas (migration).
    #[default]
    Replicated,
    /// Every expert cut into one shard per rank; the layout only says which experts a rank
    /// materialises, so a re-layout moves no state.
    Fsep,
}

impl ExpertMode {
    pub fn name(self) -> &'static str {
        match self {
            Self::Replicated => "replicated",
            Self::Fsep => "fsep",
        }
    }
}

/// The values `[start, end)` of shard `w` of `world` of a flat parameter vector of `len`.
pub fn shard_range(len: usize, world: usize, w: usize) -> Range<usize> {
    let world = world.max(1);
    (w * len / world)..((w + 1) * len / world)
}

/// One shard of one expert with its optimizer state (what a checkpoint gather carries).
#[derive(Debug, Clone, PartialEq)]
pub struct ShardState {
    /// The shard index `w`.
    pub shard: usize,
    pub layer: usize,
    pub expert: usize,
    pub value: Vec<f32>,
    pub m: Vec<f32>,
    pub v: Vec<f32>,
    /// AdamW updates applied to the expert.
    pub step: u64,
}

impl ShardState {
    /// `value, m, v, step` as f32 words (the step as two raw 32-bit halves), for the
    /// communicator's f32 channel.
    pub fn to_words(&self) -> Vec<f32> {
        let mut out = Vec::with_capacity(2 + 3 * self.value.len());
        out.push(f32::from_bits(self.step as u32));
        out.push(f32::from_bits((self.step >> 32) as u32));
        out.extend_from_slice(&self.value);
        out.extend_from_slice(&self.m);
        out.extend_from_slice(&self.v);
        out
    }

    /// Inverse of [`Self::to_words`] for shard `shard` of `len` values.
    pub fn from_words(
        shard: usize,
        layer: usize,
        expert: usize,
        len: usize,
        words: &[f32],
    ) -> Result<Self> {
        if words.len() != 2 + 3 * len {
            candle_core::bail!(
                "shard ({layer}, {expert}): {} words for {len} values",
                words.len()
            );
        }
        let step = u64::from(words[0].to_bits()) | (u64::from(words[1].to_bits()) << 32);
        let body = &words[2..];
        Ok(Self {
            shard,
            layer,
            expert,
            value: body[..len].to_vec(),
            m: body[len..2 * len].to_vec(),
            v: body[2 * len..].to_vec(),
            step,
        })
    }
}

/// `[w1; w2]` of `a` and `b` (flattened, row-major).
fn join(a: &[f32], b: &[f32]) -> Vec<f32> {
    let mut p = Vec::with_capacity(a.len() + b.len());
    p.extend_from_slice(a);
    p.extend_from_slice(b);
    p
}

/// Shard `w` of `world` of a whole expert state.
pub fn cut(state: &ExpertState, world: usize, w: usize) -> ShardState {
    let r = shard_range(state.w1.len() + state.w2.len(), world, w);
    let part = |a: &[f32], b: &[f32]| join(a, b)[r.clone()].to_vec();
    ShardState {
        shard: w,
        layer: state.layer,
        expert: state.expert,
        value: part(&state.w1, &state.w2),
        m: part(&state.m1, &state.m2),
        v: part(&state.v1, &state.v2),
        step: state.step,
    }
}

/// The whole expert from its shards, `shards[w]` = shard `w` (all of one expert, one step).
/// `w2` is `d_ff × d_model`; `w1` is the rest, `d_model × d_ff` (GELU) or `d_model × 2·d_ff`
/// (SwiGLU, [`MoeConfig::w1_cols`]) — anything else is an error.
pub fn assemble(d_model: usize, d_ff: usize, shards: &[ShardState]) -> Result<ExpertState> {
    let Some(first) = shards.first() else {
        candle_core::bail!("assembling an expert from no shards");
    };
    let (layer, expert, step) = (first.layer, first.expert, first.step);
    let n2 = d_model * d_ff;
    let total: usize = shards.iter().map(|s| s.value.len()).sum();
    if total != 2 * n2 && total != 3 * n2 {
        candle_core::bail!(
            "shards of ({layer}, {expert}) hold {total} values, not an expert of \
             {d_model}x{d_ff} (GELU {} or SwiGLU {})",
            2 * n2,
            3 * n2
        );
    }
    let n = total - n2;
    let world = shards.len();
    let (mut p, mut m, mut v) = (Vec::new(), Vec::new(), Vec::new());
    for (w, s) in shards.iter().enumerate() {
        if s.shard != w {
            candle_core::bail!("shard {} of ({layer}, {expert}) in place {w}", s.shard);
        }
        if (s.layer, s.expert, s.step) != (layer, expert, step) {
            candle_core::bail!(
                "shard {w} is of expert ({}, {}) at step {}, expected ({layer}, {expert}) at {step}",
                s.layer,
                s.expert,
                s.step
            );
        }
        let want = shard_range(total, world, w).len();
        if s.value.len() != want || s.m.len() != want || s.v.len() != want {
            candle_core::bail!("shard {w} of ({layer}, {expert}) is not {want} values");
        }
        p.extend_from_slice(&s.value);
        m.extend_from_slice(&s.m);
        v.extend_from_slice(&s.v);
    }
    Ok(ExpertState {
        layer,
        expert,
        d_model,
        d_ff,
        w1: p[..n].to_vec(),
        w2: p[n..].to_vec(),
        m1: m[..n].to_vec(),
        v1: v[..n].to_vec(),
        m2: m[n..].to_vec(),
        v2: v[n..].to_vec(),
        step,
    })
}

#[derive(Debug)]
struct Shard {
    var: Var,
    opt: AdamW,
}

/// `S` shards, shard `w` on rank `w` alone (LAER's FSEP layout).
pub fn one_per_rank(shards: usize) -> Vec<Vec<usize>> {
    (0..shards).map(|w| vec![w]).collect()
}

/// This rank's copies of the shards the placement gives it, of every expert of every layer,
/// with AdamW state, and the placement itself (`holders[w]` = the ranks holding shard `w`,
/// ascending; see the [module docs](self)).
#[derive(Debug)]
pub struct ShardStore {
    rank: usize,
    holders: Vec<Vec<usize>>,
    d_model: usize,
    d_ff: usize,
    /// Columns of `w1` ([`MoeConfig::w1_cols`]).
    w1_cols: usize,
    n_layers: usize,
    experts: usize,
    device: Device,
    params: ParamsAdamW,
    /// By `(shard, layer, expert)`.
    shards: BTreeMap<(usize, usize, usize), Shard>,
    /// The products' arithmetic of the experts this rank materialises.
    compute: Precision,
}

impl ShardStore {
    /// Shard `rank` of `world` of the freshly initialised model (the same values as the
    /// replicas of [`ExpertStore::all`]), one shard per rank.
    pub fn fresh(cfg: &MoeConfig, device: &Device, rank: usize, world: usize) -> Result<Self> {
        Self::fresh_placed(cfg, device, rank, one_per_rank(world))
    }

    /// The shards `holders` gives `rank`, of the freshly initialised model.
    pub fn fresh_placed(
        cfg: &MoeConfig,
        device: &Device,
        rank: usize,
        holders: Vec<Vec<usize>>,
    ) -> Result<Self> {
        let all = ExpertStore::all(cfg, device)?;
        let states = all
            .replicas()
            .into_iter()
            .map(|(l, e)| all.export(l, e))
            .collect::<Result<Vec<_>>>()?;
        Self::from_states_placed(cfg, device, rank, holders, &states)
    }

    /// Shard `rank` of `world` of every expert in `states`, which must hold each
    /// `(layer, expert)` of the model (e.g. a checkpoint's), one shard per rank.
    pub fn from_states(
        cfg: &MoeConfig,
        device: &Device,
        rank: usize,
        world: usize,
        states: &[ExpertState],
    ) -> Result<Self> {
        Self::from_states_placed(cfg, device, rank, one_per_rank(world), states)
    }

    /// The shards `holders` gives `rank` of every expert in `states`.
    pub fn from_states_placed(
        cfg: &MoeConfig,
        device: &Device,
        rank: usize,
        holders: Vec<Vec<usize>>,
        states: &[ExpertState],
    ) -> Result<Self> {
        let mut s = Self::empty(cfg, device, rank, holders)?;
        for st in states {
            if (st.d_model, st.d_ff) != (s.d_model, s.d_ff) {
                candle_core::bail!(
                    "expert state is {}x{}, this model is {}x{}",
                    st.d_model,
                    st.d_ff,
                    s.d_model,
                    s.d_ff
                );
            }
            for w in s.held_shards() {
                s.import(&cut(st, s.count(), w))?;
            }
        }
        s.check_complete()?;
        Ok(s)
    }

    /// A store of rank `rank` of `world`, one shard per rank, from shard states cut for that
    /// rank (e.g. the shards another rank held before the ranks were renumbered); every expert
    /// must be present.
    pub fn from_shards(
        cfg: &MoeConfig,
        device: &Device,
        rank: usize,
        world: usize,
        shards: &[ShardState],
    ) -> Result<Self> {
        let mut s = Self::empty(cfg, device, rank, one_per_rank(world))?;
        for sh in shards {
            s.import(sh)?;
        }
        s.check_complete()?;
        Ok(s)
    }

    /// A store of a newcomer to an in-place join: the placement `holders`, no shard yet (the
    /// copies it gives `rank` arrive by [`Self::import`]; [`Self::set_placement`] checks them).
    pub fn joining(
        cfg: &MoeConfig,
        device: &Device,
        rank: usize,
        holders: Vec<Vec<usize>>,
    ) -> Result<Self> {
        Self::empty(cfg, device, rank, holders)
    }

    fn empty(
        cfg: &MoeConfig,
        device: &Device,
        rank: usize,
        holders: Vec<Vec<usize>>,
    ) -> Result<Self> {
        check_holders(&holders)?;
        Ok(Self {
            rank,
            holders,
            d_model: cfg.d_model,
            d_ff: cfg.d_ff,
            w1_cols: cfg.w1_cols(),
            n_layers: cfg.n_layers,
            experts: cfg.experts,
            device: device.clone(),
            params: cfg.adam_params(),
            shards: BTreeMap::new(),
            compute: cfg.precision.on(device),
        })
    }

    fn check_complete(&self) -> Result<()> {
        for w in self.held_shards() {
            for l in 0..self.n_layers {
                for e in 0..self.experts {
                    if !self.shards.contains_key(&(w, l, e)) {
                        candle_core::bail!(
                            "rank {}: no shard {w} of expert {e} of layer {l}",
                            self.rank
                        );
                    }
                }
            }
        }
        Ok(())
    }

    /// A new placement and rank (a reconfiguration, once the shard copies it rebuilds were
    /// imported): drops the copies the placement no longer gives this rank and checks that
    /// every copy it gives is here. The shard count must stay.
    pub fn set_placement(&mut self, rank: usize, holders: Vec<Vec<usize>>) -> Result<()> {
        check_holders(&holders)?;
        if holders.len() != self.holders.len() {
            candle_core::bail!(
                "a placement of {} shards for a store of {}",
                holders.len(),
                self.holders.len()
            );
        }
        // Checked before anything changes: a refused placement leaves the store as it was.
        let before = std::mem::replace(&mut self.holders, holders);
        let old_rank = std::mem::replace(&mut self.rank, rank);
        if let Err(e) = self.check_complete() {
            self.holders = before;
            self.rank = old_rank;
            return Err(e);
        }
        let keep: Vec<usize> = self.held_shards();
        self.shards.retain(|&(w, _, _), _| keep.contains(&w));
        Ok(())
    }

    /// This rank (in the mesh the placement refers to).
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The shard count `S`.
    pub fn count(&self) -> usize {
        self.holders.len()
    }

    /// `[shard]` = the ranks holding it, ascending.
    pub fn holders(&self) -> &[Vec<usize>] {
        &self.holders
    }

    /// The rank that serves shard `w` in the all-to-alls: its lowest holder.
    pub fn primary(&self, w: usize) -> usize {
        self.holders[w][0]
    }

    /// The shards this rank holds a copy of, ascending.
    pub fn held_shards(&self) -> Vec<usize> {
        (0..self.holders.len())
            .filter(|&w| self.holders[w].contains(&self.rank))
            .collect()
    }

    pub fn n_layers(&self) -> usize {
        self.n_layers
    }

    pub fn experts(&self) -> usize {
        self.experts
    }

    pub fn d_model(&self) -> usize {
        self.d_model
    }

    pub fn d_ff(&self) -> usize {
        self.d_ff
    }

    /// Columns of each expert's `w1` ([`MoeConfig::w1_cols`]).
    pub fn w1_cols(&self) -> usize {
        self.w1_cols
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The arithmetic of the experts' products on this rank ([`Precision::on`]).
    pub fn compute(&self) -> Precision {
        self.compute
    }

    /// Values of one whole expert, `(w1_cols + d_ff)·d_model` (`2·d·ff` GELU, `3·d·ff`
    /// SwiGLU).
    pub fn expert_len(&self) -> usize {
        (self.w1_cols + self.d_ff) * self.d_model
    }

    /// The values of the flattened expert that shard `w` covers.
    pub fn range(&self, w: usize) -> Range<usize> {
        shard_range(self.expert_len(), self.count(), w)
    }

    /// f32 values held by this rank (weights and both moments), for the memory report.
    pub fn held_values(&self) -> usize {
        3 * self
            .shards
            .values()
            .map(|s| s.var.elem_count())
            .sum::<usize>()
    }

    fn shard(&self, w: usize, layer: usize, expert: usize) -> Result<&Shard> {
        match self.shards.get(&(w, layer, expert)) {
            Some(s) => Ok(s),
            None => candle_core::bail!(
                "rank {}: no shard {w} of expert ({layer}, {expert})",
                self.rank
            ),
        }
    }

    /// This rank's weight values of shard `w` of one expert.
    pub fn values(&self, w: usize, layer: usize, expert: usize) -> Result<Vec<f32>> {
        flat(self.shard(w, layer, expert)?.var.as_tensor())
    }

    /// Weights, moments and step of this rank's copy of shard `w` of one expert.
    pub fn export(&self, w: usize, layer: usize, expert: usize) -> Result<ShardState> {
        let st = self.shard(w, layer, expert)?.opt.export()?;
        let Some(p) = st.params.into_iter().next() else {
            candle_core::bail!("shard optimizer without its parameter");
        };
        Ok(ShardState {
            shard: w,
            layer,
            expert,
            value: p.value,
            m: p.m,
            v: p.v,
            step: st.step,
        })
    }

    /// Every shard copy of this rank, ascending `(shard, layer, expert)` (a step's snapshot).
    pub fn export_all(&self) -> Result<Vec<ShardState>> {
        self.shards
            .keys()
            .map(|&(w, l, e)| self.export(w, l, e))
            .collect()
    }

    /// Shard `w` of every expert, ascending `(layer, expert)` (a copy to send).
    pub fn export_shard(&self, w: usize) -> Result<Vec<ShardState>> {
        self.shards
            .range((w, 0, 0)..(w + 1, 0, 0))
            .map(|(&(w, l, e), _)| self.export(w, l, e))
            .collect()
    }

    /// Installs a shard state (creating or overwriting this rank's copy of that shard).
    pub fn import(&mut self, s: &ShardState) -> Result<()> {
        if s.shard >= self.count() || s.layer >= self.n_layers || s.expert >= self.experts {
            candle_core::bail!(
                "shard {} of ({}, {}) out of range",
                s.shard,
                s.layer,
                s.expert
            );
        }
        let n = self.range(s.shard).len();
        if s.value.len() != n || s.m.len() != n || s.v.len() != n {
            candle_core::bail!(
                "shard {} of ({}, {}) has {} values, shard {} of {} has {n}",
                s.shard,
                s.layer,
                s.expert,
                s.value.len(),
                s.shard,
                self.count()
            );
        }
        let key = (s.shard, s.layer, s.expert);
        if !self.shards.contains_key(&key) {
            let var = Var::zeros(n, candle_core::DType::F32, &self.device)?;
            let opt = AdamW::new(vec![("shard".into(), var.clone())], self.params.clone())?;
            self.shards.insert(key, Shard { var, opt });
        }
        let sh = self.shards.get_mut(&key).expect("inserted above");
        sh.opt.import(&OptimState {
            step: s.step,
            params: vec![ParamState {
                name: "shard".into(),
                shape: vec![n],
                value: s.value.clone(),
                m: s.m.clone(),
                v: s.v.clone(),
            }],
        })
    }

    /// One AdamW update of this rank's copy of shard `w` of one expert from that shard of
    /// the expert's summed gradient (flat), multiplied by `factor` first (as
    /// [`super::apply_update`] does for whole replicas).
    pub fn step_shard(
        &mut self,
        w: usize,
        layer: usize,
        expert: usize,
        g: &Tensor,
        factor: f64,
    ) -> Result<()> {
        let Some(sh) = self.shards.get_mut(&(w, layer, expert)) else {
            candle_core::bail!("no shard {w} of expert ({layer}, {expert})");
        };
        if g.elem_count() != sh.var.elem_count() {
            candle_core::bail!(
                "gradient shard {w} of ({layer}, {expert}) has {} values, the shard {}",
                g.elem_count(),
                sh.var.elem_count()
            );
        }
        let g = g.flatten_all()?;
        sh.opt.step_with(&[Some(scale_grad(&g, factor)?)])
    }

    pub fn set_lr(&mut self, lr: f64) {
        self.params.lr = lr;
        for s in self.shards.values_mut() {
            s.opt.set_lr(lr);
        }
    }
}

/// Every shard has a holder, and no rank twice.
fn check_holders(holders: &[Vec<usize>]) -> Result<()> {
    if holders.is_empty() {
        candle_core::bail!("a shard placement of no shards");
    }
    for (w, h) in holders.iter().enumerate() {
        let mut sorted = h.clone();
        sorted.sort_unstable();
        sorted.dedup();
        if h.is_empty() || sorted != *h {
            candle_core::bail!("shard {w}: holders {h:?} are not distinct ascending ranks");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> MoeConfig {
        MoeConfig {
            d_model: 8,
            d_ff: 12,
            n_layers: 2,
            experts: 3,
            ..MoeConfig::tiny()
        }
    }

    #[test]
    fn ranges_tile_the_expert() {
        for len in [0usize, 1, 7, 192] {
            for world in 1..=5 {
                let mut next = 0;
                for w in 0..world {
                    let r = shard_range(len, world, w);
                    assert_eq!(r.start, next);
                    assert!(r.len() <= len.div_ceil(world));
                    next = r.end;
                }
                assert_eq!(next, len);
            }
        }
    }

    #[test]
    fn cut_and_assemble_round_trip_through_words() -> Result<()> {
        let c = cfg();
        let all = ExpertStore::all(&c, &Device::Cpu)?;
        let st = all.export(1, 2)?;
        for world in [1, 3, 4] {
            let shards: Vec<ShardState> = (0..world)
                .map(|w| {
                    let s = cut(&st, world, w);
                    ShardState::from_words(w, 1, 2, s.value.len(), &s.to_words()).unwrap()
                })
                .collect();
            assert_eq!(assemble(c.d_model, c.d_ff, &shards)?, st);
        }
        Ok(())
    }

    /// AdamW on the shards gives the values of AdamW on the whole expert, bit for bit.
    #[test]
    fn sharded_adam_equals_whole_expert_adam() -> Result<()> {
        let c = cfg();
        let dev = Device::Cpu;
        let mut whole = ExpertStore::all(&c, &dev)?;
        let world = 3;
        let mut stores: Vec<ShardStore> = (0..world)
            .map(|w| ShardStore::fresh(&c, &dev, w, world))
            .collect::<Result<_>>()?;
        let n = c.d_model * c.d_ff;
        for step in 0..3u32 {
            let g: Vec<f32> = (0..2 * n)
                .map(|i| ((i as f32 + 1.0) * 0.37 + step as f32).sin() * 1e-2)
                .collect();
            let g1 = Tensor::from_slice(&g[..n], (c.d_model, c.d_ff), &dev)?;
            let g2 = Tensor::from_slice(&g[n..], (c.d_ff, c.d_model), &dev)?;
            whole.step_replica(0, 1, &scale_grad(&g1, 0.5)?, &scale_grad(&g2, 0.5)?)?;
            for (w, s) in stores.iter_mut().enumerate() {
                let r = s.range(w);
                let part = Tensor::from_slice(&g[r.clone()], r.len(), &dev)?;
                s.step_shard(w, 0, 1, &part, 0.5)?;
            }
        }
        let shards: Vec<ShardState> = stores
            .iter()
            .enumerate()
            .map(|(w, s)| s.export(w, 0, 1))
            .collect::<Result<_>>()?;
        assert_eq!(assemble(c.d_model, c.d_ff, &shards)?, whole.export(0, 1)?);
        assert_eq!(stores[0].export(0, 0, 0)?.step, 0);
        Ok(())
    }

    /// Two copies of each of 2 shards over 3 ranks: each rank holds what the placement says,
    /// the copies start equal, and a new placement drops what it no longer gives.
    #[test]
    fn placed_copies_are_equal_and_follow_the_placement() -> Result<()> {
        let c = cfg();
        let dev = Device::Cpu;
        let holders = vec![vec![0, 1], vec![1, 2]];
        let stores: Vec<ShardStore> = (0..3)
            .map(|r| ShardStore::fresh_placed(&c, &dev, r, holders.clone()))
            .collect::<Result<_>>()?;
        assert_eq!(stores[1].held_shards(), [0, 1]);
        assert_eq!(stores[2].held_shards(), [1]);
        assert_eq!(stores[0].export_all()?, stores[1].export_shard(0)?);
        assert_eq!(stores[1].export_shard(1)?, stores[2].export_all()?);
        let mut s = ShardStore::fresh_placed(&c, &dev, 1, holders)?;
        // Rank 1 becomes rank 0 and keeps only shard 1.
        s.set_placement(0, vec![vec![1], vec![0]])?;
        assert_eq!(s.held_shards(), [1]);
        assert_eq!(s.export_all()?, stores[2].export_all()?);
        // A placement that gives it a shard it lacks is refused, and changes nothing.
        assert!(s.set_placement(0, vec![vec![0], vec![0]]).is_err());
        assert_eq!(s.held_shards(), [1]);
        assert!(s.set_placement(0, vec![vec![1, 1], vec![0]]).is_err());
        Ok(())
    }
}
