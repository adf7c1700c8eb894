//! # Resilient sharded experts: repair in place instead of restoring
//!
//! With [`JobConfig::sharded_experts`](super::JobConfig::sharded_experts) every expert's
//! parameters and Adam moments are cut into `S` shards (`S` = the members of the plan that
//! made the lineage: a start or a restore), and with
//! [`JobConfig::shard_copies`](super::JobConfig::shard_copies) `= f` each shard index lives on
//! `f` distinct members, placed by [`fsep::place`] (MRO blocks: the placement that keeps every
//! shard alive with the highest probability under random node failures). Every plan carries
//! the placement as `[shard]` → ranks ([`Reconfiguration::shard_holders`]).
//!
//! The rules, on a change of membership (members lost, newcomers joined, or both) — the one
//! rule set `lzrun --expert-mode fsep` and `lzsim replay`'s `laer` / `lazarus-fsep` follow:
//! * **Some shard lost every copy** (with `f = 1`: any lost member): restore the checkpoint,
//!   as for a replicated expert that lost every replica.
//! * **A member lost, every shard kept a copy**: [`fsep::repair`] picks which survivor copies
//!   which shard to whom — one transfer per missing copy, the fewest bytes any repair moves —
//!   and the next plan is an in-place reconfiguration over the survivors
//!   ([`ReconfigKind::InPlace`], state from peers). Its expert layout is planned afresh over
//!   the survivors (in FSEP the layout is only the index table of the shard all-to-all, so it
//!   moves no state), and it carries the repaired placement and the copies to make
//!   ([`Reconfiguration::shard_transfers`]). Survivors one step ahead roll back, as in a
//!   replicated in-place replan.
//! * **A newcomer joins** (lazily, as a replicated join; with losses at the same time if every
//!   shard kept a copy): it joins **in place**, for any `f` including 1 — never a restore.
//!   [`fsep::rejoin`] re-places the shard copies over the new membership (the lost copies
//!   rebuilt, then the fullest members hand whole shards to the newcomers until every member
//!   is within the balanced room `⌈S·f/n⌉`), each new copy one transfer from a member that
//!   held the shard; the newcomers get the dense state from a member
//!   ([`StateSource::Peers`]'s `dense_to`). `S` stays (shards are cut once per lineage), so a
//!   newcomer to a job whose members are all within the balanced room takes no shard: it
//!   computes on the shards the all-to-all brings it, and later repairs may place copies on
//!   it. Why not a restore: nothing is lost, a restore would roll back up to a checkpoint
//!   interval and reload every shard from storage, and LAER-MoE / FSEP re-materialise every
//!   expert per step from shards wherever they live — a member without shards is legal.
//!
//! The placement is kept by node id (ranks are renumbered by every plan). The one a
//! reconfiguration issues is *committed* only once every member finished it: until then the
//! machine cannot tell which copies exist, so a membership change in between restores the
//! checkpoint when that placement differs from the committed one; the same members retrying (a failed step, a rebalance) get the same placement
//! and the same transfers again (a copy that already arrived is overwritten with equal bits).
//!
//! [`Reconfiguration::shard_holders`]: super::Reconfiguration::shard_holders
//! [`Reconfiguration::shard_transfers`]: super::Reconfiguration::shard_transfers
//! [`ReconfigKind::InPlace`]: super::ReconfigKind::InPlace

use serde::{Deserialize, Serialize};

use super::{Action, JobMachine, NodeId, ReconfigKind, StateSource};
use crate::fsep::{self, FsepSpec, RepairOutcome, ShardPlacement};

/// One shard copy to rebuild: every `(layer, expert)` slice of shard `shard`, between ranks
/// of the new membership.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankShardTransfer {
    pub shard: usize,
    pub src_rank: usize,
    pub dst_rank: usize,
}

/// Where the shard copies are, by node id.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Shards {
    /// `[shard]` = the nodes holding a copy after the last completed reconfiguration.
    holders: Vec<Vec<NodeId>>,
    /// The placement of the reconfiguration in flight (see the [module docs](self)).
    next: Option<Vec<Vec<NodeId>>>,
    /// The copies it rebuilds, `(shard, src, dst)`.
    transfers: Vec<(usize, NodeId, NodeId)>,
}

impl Shards {
    /// `[shard]` = the nodes holding a copy after the last completed reconfiguration.
    pub(super) fn holders(&self) -> &[Vec<NodeId>] {
        &self.holders
    }

    /// Every member finished the reconfiguration in flight: its placement is the truth.
    pub(super) fn commit(&mut self) {
        if let Some(next) = self.next.take() {
            self.holders = next;
            self.transfers.clear();
        }
    }
}

impl JobMachine {
    /// The shard placement (`[shard]` → ranks of `node_map`) and shard transfers of the next
    /// plan: a fresh [`fsep::place`] for a new lineage (`fresh`: start or restore, `S` = the
    /// members), else the committed placement or the repair in flight. Empty for replicated
    /// experts; `None` when a holder is not in `node_map` (a membership change that was
    /// neither repaired nor restored: a bug, the caller fails the job).
    pub(super) fn shard_layout(
        &mut self,
        node_map: &[NodeId],
        fresh: bool,
    ) -> Option<(Vec<Vec<usize>>, Vec<RankShardTransfer>)> {
        if !self.cfg.sharded_experts {
            return Some((Vec::new(), Vec::new()));
        }
        let holders = if fresh {
            let n = node_map.len();
            let spec = FsepSpec::balanced(n, n, self.cfg.shard_copies.min(n));
            self.shards.transfers.clear();
            fsep::place(&spec)
                .ok()?
                .all_holders()
                .iter()
                .map(|h| h.iter().map(|&r| node_map[r as usize]).collect())
                .collect()
        } else {
            self.shards
                .next
                .clone()
                .unwrap_or_else(|| self.shards.holders.clone())
        };
        let rank_of = |id: NodeId| node_map.iter().position(|&m| m == id);
        let by_rank = holders
            .iter()
            .map(|h| {
                let mut ranks = h
                    .iter()
                    .map(|&id| rank_of(id))
                    .collect::<Option<Vec<_>>>()?;
                ranks.sort_unstable();
                Some(ranks)
            })
            .collect::<Option<Vec<_>>>()?;
        let transfers = self
            .shards
            .transfers
            .iter()
            .map(|&(shard, src, dst)| {
                Some(RankShardTransfer {
                    shard,
                    src_rank: rank_of(src)?,
                    dst_rank: rank_of(dst)?,
                })
            })
            .collect::<Option<Vec<_>>>()?;
        self.shards.next = Some(holders);
        Some((by_rank, transfers))
    }

    /// After the membership of a sharded job changed (members lost, newcomers joined, or
    /// both): issues the in-place reconfiguration and returns true when every shard kept a
    /// copy (see the [module docs](self)); false when the caller must restore the checkpoint
    /// (said why in a log line).
    pub(super) fn repair_shards(&mut self, now_ms: u64, out: &mut Vec<Action>) -> bool {
        if !self.cfg.sharded_experts {
            return false;
        }
        let Some(old) = self.plan.as_ref().map(|p| p.node_map.clone()) else {
            return false;
        };
        let candidates = self.candidate_ids();
        let newcomers: Vec<NodeId> = candidates
            .iter()
            .copied()
            .filter(|id| !old.contains(id))
            .collect();
        let why = if self
            .shards
            .next
            .as_ref()
            .is_some_and(|n| *n != self.shards.holders)
        {
            Some("the last shard placement was not completed on every member")
        } else if candidates
            .iter()
            .any(|id| old.contains(id) && !self.nodes[id].has_state)
        {
            Some("a member has no state")
        } else if !candidates.iter().any(|id| self.nodes[id].has_state) {
            Some("no member has the state")
        } else {
            None
        };
        if let Some(why) = why {
            out.push(Action::Log(format!("sharded experts: {why}")));
            return false;
        }
        let dead: Vec<u32> = (0..old.len() as u32)
            .filter(|&r| !candidates.contains(&old[r as usize]))
            .collect();
        let rank_of = |id: &NodeId| old.iter().position(|m| m == id).map(|r| r as u32);
        let by_rank: Option<Vec<Vec<u32>>> = self
            .shards
            .holders
            .iter()
            .map(|h| h.iter().map(rank_of).collect())
            .collect();
        let f = self.cfg.shard_copies;
        let outcome = by_rank
            .and_then(|h| ShardPlacement::new(old.len(), h).ok())
            .ok_or_else(|| "the shard placement does not match the last plan".to_owned())
            .and_then(|p| {
                if !newcomers.is_empty() {
                    // A join (with or without losses): re-placed over the new membership.
                    return fsep::rejoin(&p, f, &dead, newcomers.len()).map_err(|e| e.to_string());
                }
                let survivors = old.len() - dead.len();
                let copies = f.min(survivors);
                let most = (0..old.len())
                    .filter(|r| !dead.contains(&(*r as u32)))
                    .map(|r| p.load()[r])
                    .max()
                    .unwrap_or(0);
                let capacity = fsep::min_capacity(survivors, p.shards(), copies).max(most);
                fsep::repair(&p, f, &dead, capacity).map_err(|e| e.to_string())
            });
        let repair = match outcome {
            Ok(RepairOutcome::InPlace(r)) => r,
            Ok(RepairOutcome::RestoreCheckpoint { lost_shards }) => {
                let line = format!("sharded experts: shards {lost_shards:?} lost every copy");
                out.push(Action::Log(line));
                return false;
            }
            Err(e) => {
                out.push(Action::Log(format!("shard repair failed ({e})")));
                return false;
            }
        };
        // Indices before the change: the old ranks, then the newcomers.
        let id_of = |i: u32| match old.get(i as usize) {
            Some(&id) => id,
            None => newcomers[i as usize - old.len()],
        };
        let node = |survivor: u32| id_of(repair.survivors[survivor as usize]);
        let holders = repair
            .placement
            .all_holders()
            .iter()
            .map(|h| h.iter().map(|&i| node(i)).collect())
            .collect();
        self.shards.next = Some(holders);
        self.shards.transfers = repair
            .transfers
            .iter()
            .map(|t| (t.shard as usize, id_of(t.src), id_of(t.dst)))
            .collect();
        out.push(Action::Log(if newcomers.is_empty() {
            format!(
                "sharded experts: every shard kept a copy; rebuilding {} shard copies in place",
                repair.transfers.len()
            )
        } else {
            format!(
                "sharded experts: {} newcomer(s) join in place; {} shard copies re-placed",
                newcomers.len(),
                repair.transfers.len()
            )
        }));
        let resume_step = self
            .members
            .iter()
            .filter_map(|m| self.nodes[m].idle.as_ref().map(|i| i.1))
            .min()
            // Survivors one step ahead roll back (as in `replan_in_place`).
            .map_or(self.next_step, |s| s.min(self.next_step));
        let kind = self.cause.map_or(ReconfigKind::InPlace, |c| c.kind);
        // The ranks are the plan's: `send_plan` fills them in (`peers_source`).
        let source = StateSource::Peers {
            dense_from: 0,
            dense_to: Vec::new(),
        };
        self.send_plan(kind, source, resume_step, now_ms, out);
        true
    }

    /// The state source of an in-place sharded plan over `node_map`: the dense state from
    /// the first member that has it to every member that has not (the newcomers of a join).
    pub(super) fn peers_source(&self, node_map: &[NodeId]) -> StateSource {
        let has = |id: &NodeId| self.nodes.get(id).is_some_and(|n| n.has_state);
        StateSource::Peers {
            dense_from: node_map.iter().position(has).unwrap_or(0),
            dense_to: (0..node_map.len())
                .filter(|&r| !has(&node_map[r]))
                .collect(),
        }
    }
}
