//! The simulated training state: every piece of state (the dense state, each expert replica,
//! each expert shard) is a hash chain of the steps trained on it, so the correct value at each
//! step is known ([`Canon`]): a restore or a peer transfer reproduces it, a process's own
//! initialisation, a replica that was never sent or a state at another step does not.
//! Non-finite steps ([`Canon::skipped`]) leave every value as it was: the members agreed to
//! skip the update.

use std::collections::BTreeSet;

pub fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// One step of training applied to a state value.
fn train(v: u64, step: u64) -> u64 {
    splitmix64(v ^ splitmix64(step))
}

/// The correct value of every piece of state after each number of completed steps.
pub struct Canon {
    /// `dense[s]`: after `s` completed steps.
    pub dense: Vec<u64>,
    /// `experts[l][e][s]`.
    pub experts: Vec<Vec<Vec<u64>>>,
    /// Steps whose update every member skips (a non-finite loss or gradient).
    nonfinite: BTreeSet<u64>,
}

impl Canon {
    pub fn new(layers: usize, experts: usize, steps: u64, nonfinite: BTreeSet<u64>) -> Self {
        let mut c = Self {
            dense: Vec::new(),
            experts: Vec::new(),
            nonfinite,
        };
        let chain = |c: &Self, seed: u64| {
            let mut v = vec![splitmix64(seed)];
            for s in 0..steps {
                v.push(c.step(v[s as usize], s));
            }
            v
        };
        c.dense = chain(&c, 0xDE45E);
        c.experts = (0..layers)
            .map(|l| {
                (0..experts)
                    .map(|e| chain(&c, ((l as u64) << 32) | e as u64))
                    .collect()
            })
            .collect();
        c
    }

    pub fn skipped(&self, step: u64) -> bool {
        self.nonfinite.contains(&step)
    }

    /// `v` after training `step` (unchanged when the step's update was skipped).
    pub fn step(&self, v: u64, step: u64) -> u64 {
        if self.skipped(step) {
            v
        } else {
            train(v, step)
        }
    }

    /// Shard `s` of the experts cut into `count` shards, after `at` completed steps (the
    /// shards of another cut are other values: only a full checkpoint reshards).
    pub fn shard(&self, count: usize, s: u32, at: u64) -> u64 {
        let mut v = splitmix64(0x5A4D_0000_0000 | ((count as u64) << 16) | s as u64);
        for t in 0..at {
            v = self.step(v, t);
        }
        v
    }
}

/// A piece of state a reconfiguration puts on a member.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Piece {
    Expert(usize, u32),
    Shard(u32),
}

/// What a worker holds: dense state, replicas `[layer] → (expert, value)`, shards
/// `(shard, value)` (sharded experts), next step to train.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct State {
    pub dense: u64,
    pub held: Vec<Vec<(u32, u64)>>,
    pub shards: Vec<(u32, u64)>,
    pub next_step: u64,
}

impl State {
    pub fn trained(&self, canon: &Canon) -> Self {
        let s = self.next_step;
        Self {
            dense: canon.step(self.dense, s),
            held: self
                .held
                .iter()
                .map(|l| l.iter().map(|&(e, v)| (e, canon.step(v, s))).collect())
                .collect(),
            shards: self
                .shards
                .iter()
                .map(|&(i, v)| (i, canon.step(v, s)))
                .collect(),
            next_step: s + 1,
        }
    }

    pub fn value(&self, layer: usize, expert: u32) -> Option<u64> {
        self.held
            .get(layer)?
            .iter()
            .find(|(e, _)| *e == expert)
            .map(|(_, v)| *v)
    }

    pub fn shard(&self, s: u32) -> Option<u64> {
        self.shards.iter().find(|(i, _)| *i == s).map(|(_, v)| *v)
    }

    pub fn piece(&self, p: Piece) -> Option<u64> {
        match p {
            Piece::Expert(l, e) => self.value(l, e),
            Piece::Shard(s) => self.shard(s),
        }
    }

    /// Puts `v` in place of `p` (adds it if it is not held).
    pub fn set(&mut self, p: Piece, v: u64) {
        match p {
            Piece::Expert(l, e) => {
                if self.held.len() <= l {
                    self.held.resize(l + 1, Vec::new());
                }
                match self.held[l].iter_mut().find(|(x, _)| *x == e) {
                    Some(slot) => slot.1 = v,
                    None => self.held[l].push((e, v)),
                }
            }
            Piece::Shard(s) => match self.shards.iter_mut().find(|(x, _)| *x == s) {
                Some(slot) => slot.1 = v,
                None => self.shards.push((s, v)),
            },
        }
    }

    pub fn holdings(&self) -> Vec<Vec<u32>> {
        self.held
            .iter()
            .map(|l| l.iter().map(|(e, _)| *e).collect())
            .collect()
    }

    /// Every value made wrong (a member that cannot reach a resume step).
    pub fn spoil(&mut self) {
        self.dense = splitmix64(self.dense ^ 0x57A1E);
        for l in &mut self.held {
            for (_, v) in l {
                *v = splitmix64(*v ^ 0x57A1E);
            }
        }
        for (_, v) in &mut self.shards {
            *v = splitmix64(*v ^ 0x57A1E);
        }
    }
}
