//! The checks made after every event the machine handles, from what the simulated nodes
//! really hold (the oracle is the test's, not the machine's: the machine's own
//! `check_invariants` runs too).

use lazarus_planner::job::{NodeId, Phase, ReconfigKind, Reconfiguration, StateSource, StepRecord};

use super::model::State;
use super::{Sim, first_uncovered, resolve};

impl Sim {
    /// Every expert has a replica (every shard a copy) on a live member while the members
    /// train or take a plan in (a lost one must have sent the machine to
    /// Quiescing/Restoring/WaitingForNodes).
    pub(super) fn check_coverage(&mut self) {
        if !matches!(self.m.phase(), Phase::Training | Phase::Reconfiguring) {
            return;
        }
        let Some(plan) = self.m.plan() else {
            return self.fail(format!("{:?} without a plan", self.m.phase()));
        };
        let members = self.m.members();
        let mut covered = vec![vec![false; self.cfg.model.experts]; self.cfg.model.layers];
        for p in plan.physical_nodes() {
            if members.contains(&p.id) {
                for (l, es) in p.holdings.iter().enumerate() {
                    for &e in es {
                        covered[l][e as usize] = true;
                    }
                }
            }
        }
        if let Some((l, e)) = first_uncovered(&covered) {
            return self.fail(format!(
                "phase {:?}: expert {e} of layer {l} has no replica on a live member",
                self.m.phase()
            ));
        }
        if let Some(mesh) = &self.mesh
            && self.cfg.sharded_experts
            && mesh.r.epoch == self.m.epoch()
        {
            let node_map = mesh.r.members();
            for (s, holders) in mesh.r.shard_holders.iter().enumerate() {
                if !holders.iter().any(|&r| members.contains(&node_map[r])) {
                    return self.fail(format!(
                        "phase {:?}: shard {s} has no copy on a live member",
                        self.m.phase()
                    ));
                }
            }
        }
    }

    /// A host fails whole: no member is a sibling (same host, joined with it) of a node the
    /// machine dropped.
    pub(super) fn check_hosts(&mut self) {
        // While stopping nothing is replanned: a lost node leaves its siblings be.
        if self.gpus == 1 || matches!(self.m.phase(), Phase::Stopping | Phase::Over) {
            return;
        }
        for &m in self.m.members() {
            let (batch, since) = (self.nodes[&m].batch, self.nodes[&m].registered_at);
            // (a sibling dropped before the machine heard of this one is not its to know)
            if let Some(gone) = self
                .machine_lost
                .iter()
                .find(|&(&g, &at)| self.nodes[&g].batch == batch && at > since)
                .map(|(g, _)| *g)
            {
                let why = format!("member {m} outlived node {gone} of its host");
                return self.fail(why);
            }
        }
    }

    pub(super) fn check_record(&mut self, r: &StepRecord) {
        if r.epoch != self.record_epoch {
            return self.fail(format!(
                "step {} counted in epoch {} but the plan in force is epoch {}",
                r.step, r.epoch, self.record_epoch
            ));
        }
        if r.step != self.counted_next {
            return self.fail(format!(
                "step {} counted, expected step {} (a step counted twice or skipped)",
                r.step, self.counted_next
            ));
        }
        if r.step >= self.cfg.total_steps {
            return self.fail(format!("step {} counted past the end", r.step));
        }
        self.counted_next += 1;
        self.stats.steps += 1;
        if self.canon.skipped(r.step) {
            self.nonfinite_run += 1;
            self.stats.nonfinite_counted += 1;
        } else {
            self.nonfinite_run = 0;
        }
        if r.plan_version > self.last_version {
            self.stats.switches_done += 1;
            self.last_version = r.plan_version;
        }
        let Some(t) = self.trained.get(&(r.epoch, r.step)) else {
            return self.fail(format!("step {} counted but no member trained it", r.step));
        };
        let mut problems = Vec::new();
        // Members only leave within an epoch until a new plan replaces them (in the same
        // batch of actions, after this record): every member at counting time was a member
        // before the event, and each of them must have trained the step.
        let trainers: Vec<&(NodeId, State, u64)> = t
            .states
            .iter()
            .filter(|(id, _, _)| self.members_before.contains(id))
            .collect();
        if trainers.len() < r.members {
            problems.push(format!(
                "{} members counted it but only {} of {:?} trained it",
                r.members,
                trainers.len(),
                self.members_before
            ));
        }
        // A switch never splits the members: each trained the step on the layout the
        // machine has in force for it.
        for (id, _, layout) in &trainers {
            if *layout != r.plan_version {
                problems.push(format!(
                    "node {id} trained it on layout v{layout}, the machine counts it on v{}",
                    r.plan_version
                ));
            }
        }
        let s = r.step as usize + 1;
        let mut covered = vec![vec![false; self.cfg.model.experts]; self.cfg.model.layers];
        let shard_count = self.mesh.as_ref().map_or(0, |m| m.shard_count());
        let mut shards = vec![false; shard_count];
        for (id, st, _) in &t.states {
            if st.dense != self.canon.dense[s] {
                problems.push(format!("node {id} trained on a wrong dense state"));
            }
            for (l, es) in st.held.iter().enumerate() {
                for &(e, v) in es {
                    covered[l][e as usize] = true;
                    if v != self.canon.experts[l][e as usize][s] {
                        problems.push(format!(
                            "node {id}'s replica of expert {e} of layer {l} is wrong"
                        ));
                    }
                }
            }
            for &(sh, v) in &st.shards {
                if let Some(c) = shards.get_mut(sh as usize) {
                    *c = true;
                }
                if v != self.canon.shard(shard_count, sh, s as u64) {
                    problems.push(format!("node {id}'s copy of shard {sh} is wrong"));
                }
            }
        }
        if t.full {
            if self.cfg.sharded_experts {
                if let Some(sh) = shards.iter().position(|c| !c) {
                    problems.push(format!("shard {sh} had no copy"));
                }
            } else if let Some((l, e)) = first_uncovered(&covered) {
                problems.push(format!("expert {e} of layer {l} had no replica"));
            }
        }
        if !problems.is_empty() {
            problems.dedup();
            self.fail(format!(
                "counted step {} of epoch {}: {}",
                r.step,
                r.epoch,
                problems.join("; ")
            ));
        }
    }

    /// Checks a new plan against what the nodes really hold; false when it failed.
    pub(super) fn check_reconfiguration(&mut self, r: &Reconfiguration) -> bool {
        if r.epoch <= self.last_epoch || r.plan.version <= self.last_version {
            self.fail(format!(
                "epoch {} / plan v{} after epoch {} / plan v{}",
                r.epoch, r.plan.version, self.last_epoch, self.last_version
            ));
            return false;
        }
        self.last_epoch = r.epoch;
        self.last_version = r.plan.version;
        match r.kind {
            ReconfigKind::InPlace => self.stats.in_place += 1,
            ReconfigKind::Restore => self.stats.restores += 1,
            ReconfigKind::Join => self.stats.joins += 1,
            ReconfigKind::Rebalance => self.stats.rebalances += 1,
            ReconfigKind::Start => {}
        }
        if !r.shard_transfers.is_empty() {
            self.stats.shard_repairs += 1;
        }
        if std::mem::take(&mut self.repair_said)
            && let Some(p) = self.repair_problem(r)
        {
            self.fail(format!("epoch {}: repair: {p}", r.epoch));
            return false;
        }
        let problem = match &r.source {
            StateSource::Fresh if r.resume_step != 0 => {
                Some(format!("a fresh start resumes at {}", r.resume_step))
            }
            StateSource::Fresh => None,
            StateSource::Checkpoint { step } => {
                let newest = self.committed.keys().next_back().copied();
                (r.resume_step != *step
                    || !self.committed.contains_key(step)
                    || newest.is_none_or(|n| *step > n))
                .then(|| {
                    format!(
                        "restore of step {step} resuming at {}: newest committed {newest:?}",
                        r.resume_step
                    )
                })
            }
            StateSource::Peers { .. } if r.resume_step != self.counted_next => Some(format!(
                "in-place replan resumes at step {} but steps up to {} were counted",
                r.resume_step, self.counted_next
            )),
            // Within a lineage resume steps never go back.
            StateSource::Peers { .. } if r.resume_step < self.lineage_resume => Some(format!(
                "in-place replan resumes at step {}, before the lineage's resume step {}",
                r.resume_step, self.lineage_resume
            )),
            StateSource::Peers { .. } => self.peers_plan_problem(r),
        };
        if let Some(p) = problem {
            self.fail(format!("epoch {}: {p}", r.epoch));
            return false;
        }
        self.lineage_resume = r.resume_step;
        true
    }

    /// A repaired plan (issue 42): an in-place plan over the members, every expert of every
    /// layer on at least `min(f, N)` distinct members, and every transfer going into a member
    /// whose new row holds the expert more often than the member holds it now.
    fn repair_problem(&mut self, r: &Reconfiguration) -> Option<String> {
        if !matches!(r.source, StateSource::Peers { .. }) {
            return Some(format!("a {:?} reconfiguration", r.source));
        }
        self.stats.repairs += 1;
        self.stats.repair_copies += r.transfers.len() as u64;
        let n = r.members().len();
        let floor = self.cfg.model.f.min(n);
        for (l, layer) in r.plan.layers.iter().enumerate() {
            let sets = layer.node_sets();
            if let Some(e) = sets.iter().position(|s| s.len() < floor) {
                return Some(format!(
                    "layer {l} expert {e} on {} distinct members, floor {floor}",
                    sets[e].len()
                ));
            }
        }
        let rows = r.plan.plan_node_contents();
        for t in &r.transfers {
            let dst = r.members()[t.dst_rank];
            let count = |row: &[u32]| row.iter().filter(|&&e| e as usize == t.expert).count();
            let now = count(&rows[t.dst_rank][t.layer]);
            // What the member holds now (a newcomer whose join was cut short holds nothing).
            let held = &self.nodes[&dst].rows;
            let had = held.get(t.layer).map_or(0, |row| count(row));
            if now <= had || t.src_rank == t.dst_rank {
                return Some(format!(
                    "transfer of layer {} expert {} to {dst}, which held {had} and now {now}",
                    t.layer, t.expert
                ));
            }
        }
        None
    }

    /// An in-place plan may only keep and send replicas, shards and a dense state that exist
    /// at the resume step (a member not in `dense_to` must hold the job's dense state).
    fn peers_plan_problem(&self, r: &Reconfiguration) -> Option<String> {
        let StateSource::Peers {
            dense_from,
            dense_to,
        } = &r.source
        else {
            return None;
        };
        let resume = r.resume_step;
        let rows = r.plan.plan_node_contents();
        let good_dense = self.canon.dense[resume as usize];
        let states: Vec<Option<State>> = r
            .members()
            .iter()
            .map(|m| {
                let n = &self.nodes[m];
                // A node that is already dead is the machine's to learn about, not a bad plan.
                n.alive.then(|| resolve(n, resume).unwrap_or_default())
            })
            .collect();
        let count = r.shard_holders.len();
        for (q, st) in states.iter().enumerate() {
            let Some(st) = st else { continue };
            let id = r.members()[q];
            let wants_dense = dense_to.contains(&q);
            if (!wants_dense || q == *dense_from) && st.dense != good_dense {
                return Some(format!(
                    "rank {q} (node {id}) is not sent the dense state but does not hold it \
                     at step {resume}"
                ));
            }
            if self.cfg.sharded_experts {
                for (s, holders) in r.shard_holders.iter().enumerate() {
                    if !holders.contains(&q) {
                        continue;
                    }
                    let src = r
                        .shard_transfers
                        .iter()
                        .find(|t| t.dst_rank == q && t.shard == s)
                        .map_or(q, |t| t.src_rank);
                    let Some(src_state) = &states[src] else {
                        continue;
                    };
                    if src_state.shard(s as u32) != Some(self.canon.shard(count, s as u32, resume))
                    {
                        return Some(format!(
                            "rank {q} (node {id}) gets shard {s} from rank {src}, which does \
                             not hold it at step {resume}"
                        ));
                    }
                }
                continue;
            }
            for (l, es) in rows[q].iter().enumerate() {
                for &e in es {
                    let src = r
                        .transfers
                        .iter()
                        .find(|t| t.dst_rank == q && t.layer == l && t.expert == e as usize)
                        .map_or(q, |t| t.src_rank);
                    let Some(src_state) = &states[src] else {
                        continue;
                    };
                    if src_state.value(l, e)
                        != Some(self.canon.experts[l][e as usize][resume as usize])
                    {
                        return Some(format!(
                            "rank {q} (node {id}) gets expert {e} of layer {l} from rank {src}, \
                             which does not hold it at step {resume}"
                        ));
                    }
                }
            }
        }
        None
    }

    /// Slow is not dead: with worker heartbeats, a member fenced as stuck must really be
    /// stuck (its worker frozen or hung), not merely slow or waiting on a peer.
    pub(super) fn check_fenced_stuck(&mut self, node: NodeId, reason: &str) {
        // A healthy member blocked in a collective by a hung or frozen peer cannot be told
        // from one that is stuck itself: fenced with it.
        let blocked = self.mesh.as_ref().is_some_and(|mesh| {
            // (fenced in the same breath as it, maybe just before)
            mesh.r.members().iter().any(|m| self.nodes[m].worker_frozen)
        });
        let n = &self.nodes[&node];
        let healthy = n.alive
            && !n.worker_frozen
            && !n.agent_frozen
            && n.started
            && n.status != super::Status::Starting;
        if healthy && blocked {
            self.stats.fenced_collateral += 1;
        }
        if healthy && !blocked && self.cfg.step_deadline.is_some() {
            let why = format!(
                "node {node} (healthy, {}x slow) fenced as stuck: {reason}",
                n.slow
            );
            self.fail(why);
        }
    }

    /// The final-state rule: a job that reports `Finished(Ok)` holds its whole final state —
    /// the state every member of the last mesh stopped with (what the simulated nodes hold,
    /// not what the machine believes; a member that left after stopping counts) is the final
    /// step's, together with the committed checkpoint of the final step (a member lost while
    /// stopping is excused only by it) they hold the dense state and every expert (every
    /// shard), and with checkpoints that checkpoint was committed. `LAZARUS_SWARM_FINAL_STATE=0`
    /// turns it off.
    pub(super) fn check_final_state(&mut self) {
        if !self.final_state {
            return;
        }
        let total = self.cfg.total_steps;
        let members: Vec<NodeId> = match &self.mesh {
            // The members of the last mesh that stopped (live or gone since).
            Some(mesh) => mesh
                .r
                .members()
                .iter()
                .copied()
                .filter(|id| self.nodes.get(id).is_some_and(|n| n.stopped.is_some()))
                .collect(),
            None => self.m.members().to_vec(),
        };
        let mut problems = Vec::new();
        let mut covered = vec![vec![false; self.cfg.model.experts]; self.cfg.model.layers];
        let count = self.mesh.as_ref().map_or(0, |m| m.shard_count());
        let mut shards = vec![false; count];
        let ckpt = self.committed.get(&total);
        if let Some(c) = ckpt {
            for (&(l, e), &v) in &c.experts {
                if v == self.canon.experts[l][e as usize][total as usize] {
                    covered[l][e as usize] = true;
                }
            }
            // A checkpoint holding every shard of its own cut, correct, holds every expert
            // (a restore cuts it anew for any membership).
            if self.reshards(c, total) {
                shards.iter_mut().for_each(|x| *x = true);
            }
        }
        if members.is_empty() && ckpt.is_none() {
            problems.push("no member holds the final state".to_owned());
        }
        for &id in &members {
            let Some(st) = &self.nodes[&id].stopped else {
                problems.push(format!("member {id} never stopped (sent no checksums)"));
                continue;
            };
            if st.next_step != total || st.dense != self.canon.dense[total as usize] {
                problems.push(format!(
                    "member {id} holds the dense state of step {}, not the final one",
                    st.next_step
                ));
            }
            for (l, es) in st.held.iter().enumerate() {
                for &(e, v) in es {
                    if v == self.canon.experts[l][e as usize][total as usize] {
                        covered[l][e as usize] = true;
                    } else {
                        problems.push(format!("member {id}'s expert {e} of layer {l} is wrong"));
                    }
                }
            }
            for &(s, v) in &st.shards {
                if v == self.canon.shard(count, s, total) {
                    if let Some(c) = shards.get_mut(s as usize) {
                        *c = true;
                    }
                } else {
                    problems.push(format!("member {id}'s shard {s} is wrong"));
                }
            }
        }
        if self.cfg.sharded_experts {
            let missing: Vec<usize> = (0..count).filter(|&s| !shards[s]).collect();
            if !missing.is_empty() {
                problems.push(format!("no member holds shards {missing:?}"));
            }
        } else if let Some((l, e)) = first_uncovered(&covered) {
            problems.push(format!("no member holds expert {e} of layer {l}"));
        }
        if self.cfg.checkpoint_due(total) && !self.committed.contains_key(&total) {
            problems.push(format!(
                "no checkpoint of the final step {total} was committed"
            ));
        }
        if !problems.is_empty() {
            problems.dedup();
            self.final_state_failed = true;
            self.fail(format!(
                "final state of Finished(Ok) over members {members:?}: {}",
                problems.join("; ")
            ));
        }
    }
}
