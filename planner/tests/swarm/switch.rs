//! Layout switches without a pause (`Action::SwitchLayout`): the members of the epoch get the
//! new layout while they train, copy the replicas it adds in the background (replicated
//! experts with asynchronous migration), and all switch after the first step `≥ from − 1`
//! whose barrier shows every member holding it (and every copy arrived): one boundary for
//! all, whenever the command reached each of them. The steps report the layout they ran on.

use lazarus_planner::job::relayout::Relayout;
use lazarus_planner::job::{LayoutSwitch, NodeId, ReplicaMigration};
use rand::RngExt;

use super::model::{Piece, State};
use super::{Cmd, Sim, Status};

impl Sim {
    /// The driver sends a switch to every member of its epoch.
    pub(super) fn switch_layout(&mut self, sw: LayoutSwitch) {
        // Only sharded experts with LAER and asynchronous replica migration switch (the latter
        // not over hosts planned per host; hosts of unequal sizes are planned per node).
        let laer = matches!(self.cfg.relayout, Relayout::Laer(_));
        let sharded_laer = self.cfg.sharded_experts && laer;
        if !sharded_laer && self.cfg.replica_migration != ReplicaMigration::Async {
            return self.fail(format!(
                "unexpected layout switch to plan v{} in mode {}",
                sw.plan.version,
                self.mode.name()
            ));
        }
        if self.cfg.sharded_experts && !sw.transfers.is_empty() {
            return self.fail("a sharded layout switch with replica transfers".into());
        }
        let Some(mesh) = self.mesh.as_ref() else {
            return self.fail("a layout switch without a mesh".into());
        };
        if mesh.r.epoch != sw.epoch {
            let why = format!(
                "a layout switch of epoch {} while the mesh is of epoch {}",
                sw.epoch, mesh.r.epoch
            );
            return self.fail(why);
        }
        if sw.plan.node_map != mesh.r.plan.node_map {
            return self.fail("a layout switch that changes the members or their ranks".into());
        }
        let mesh = self.mesh.as_mut().unwrap();
        self.stats.switches_sent += 1;
        let (epoch, version) = (sw.epoch, sw.plan.version);
        let members = mesh.r.members().to_vec();
        mesh.switches.insert(version, sw);
        for m in members {
            self.cmd(m, Cmd::Switch(epoch, version));
        }
    }

    pub(super) fn switch_arrived(&mut self, id: NodeId, epoch: u64, version: u64) {
        let copies = self.rng.random_range(10..400);
        let now = self.now_ms;
        let n = self.nodes.get_mut(&id).unwrap();
        if n.epoch != epoch || !matches!(n.status, Status::Training | Status::Migrating) {
            return;
        }
        if n.switch_held.is_none_or(|v| v < version) {
            n.switch_held = Some(version);
            n.copies_at_ms = now + copies;
        }
    }

    /// At the barrier of `step`: switches every member to the newest layout sent to the
    /// epoch if every member holds it, the step is past its start and every copy arrived.
    pub(super) fn maybe_switch(&mut self, epoch: u64, members: &[NodeId], step: u64) {
        let Some(mesh) = self.mesh.as_ref() else {
            return;
        };
        let Some((&v, sw)) = mesh.switches.iter().next_back() else {
            return;
        };
        if mesh.r.epoch != epoch || v <= mesh.layout || step + 1 < sw.from_step {
            return;
        }
        let ready = members.iter().all(|m| {
            let n = &self.nodes[m];
            n.switch_held == Some(v) && (sw.transfers.is_empty() || n.copies_at_ms <= self.now_ms)
        });
        if !ready {
            return;
        }
        let sw = sw.clone();
        let rows = sw.plan.plan_node_contents();
        if !self.cfg.sharded_experts {
            // The new replicas: kept, or copied from their holder in the layout in force (a
            // copy taken earlier and caught up since: the holder's value now). Done on the
            // state before the step too, for a member that rolls the step back.
            self.stats.async_copies += sw.transfers.len() as u64;
            let now: Vec<State> = members
                .iter()
                .map(|m| self.nodes[m].state.clone())
                .collect();
            let before: Vec<Option<State>> =
                members.iter().map(|m| self.nodes[m].prev.clone()).collect();
            for (q, &id) in members.iter().enumerate() {
                let next = self.relaid(&sw, &rows, q, &now);
                let prev = if before.iter().all(Option::is_some) {
                    let before: Vec<State> = before.iter().flatten().cloned().collect();
                    Some(self.relaid(&sw, &rows, q, &before))
                } else {
                    None
                };
                let n = self.nodes.get_mut(&id).unwrap();
                n.state = next;
                n.prev = prev;
            }
        }
        for (q, &id) in members.iter().enumerate() {
            let n = self.nodes.get_mut(&id).unwrap();
            n.plan_version = v;
            n.rows = rows[q].clone();
        }
        let mesh = self.mesh.as_mut().unwrap();
        mesh.layout = v;
        mesh.rows = rows;
        self.note(format!(
            "members of epoch {epoch} switch to layout v{v} after step {step}"
        ));
    }

    /// Rank `q`'s state on the new layout, from every rank's state on the old one.
    fn relaid(
        &mut self,
        sw: &LayoutSwitch,
        rows: &[Vec<Vec<u32>>],
        q: usize,
        old: &[State],
    ) -> State {
        let mut st = State {
            dense: old[q].dense,
            held: vec![Vec::new(); self.cfg.model.layers],
            shards: old[q].shards.clone(),
            next_step: old[q].next_step,
        };
        for (l, es) in rows[q].iter().enumerate() {
            for &e in es {
                let p = Piece::Expert(l, e);
                let v = old[q].piece(p).or_else(|| {
                    sw.transfers
                        .iter()
                        .find(|t| t.dst_rank == q && t.layer == l && t.expert == e as usize)
                        .and_then(|t| old[t.src_rank].piece(p))
                });
                let v = v.unwrap_or_else(|| self.garbage());
                st.set(p, v);
            }
        }
        st
    }
}
