//! The seeded fault schedule: node deaths, joins, frozen workers and agents, hosts failing
//! whole, slow and hung members, and the driver's own crash and restart (fail-over).

use lazarus_planner::job::{Event, JobMachine, NodeId, Phase};
use rand::RngExt;

use super::{Item, Mode, SETTLE_MS, Sim, event_node};

impl Sim {
    pub(super) fn schedule_faults(&mut self) {
        let faults = self.rng.random_range(0..=10);
        for _ in 0..faults {
            let at = self.rng.random_range(300..self.faults_until_ms);
            self.at(at, Item::Fault);
        }
        if self.mode == Mode::Failover {
            for _ in 0..self.rng.random_range(1..=3) {
                let at = self.rng.random_range(200..self.faults_until_ms + 2_000);
                self.at(at, Item::Crash);
            }
        }
        let at = self.faults_until_ms;
        self.at(at, Item::Heal);
    }

    fn pick_alive(&mut self) -> Option<NodeId> {
        let alive: Vec<NodeId> = self
            .nodes
            .iter()
            .filter(|(_, n)| n.alive)
            .map(|(&id, _)| id)
            .collect();
        (!alive.is_empty()).then(|| alive[self.rng.random_range(0..alive.len())])
    }

    pub(super) fn fault(&mut self) {
        let kind = self.rng.random_range(0..100);
        match kind {
            0..30 => {
                if let Some(id) = self.pick_alive() {
                    if self.gpus > 1 && self.rng.random_bool(0.5) {
                        let batch = self.nodes[&id].batch;
                        self.note(format!("fault: kill the host of node {id}"));
                        self.fault_injected();
                        let host: Vec<NodeId> = self
                            .nodes
                            .iter()
                            .filter(|(_, n)| n.alive && n.batch == batch)
                            .map(|(&i, _)| i)
                            .collect();
                        for i in host {
                            self.kill(i, true);
                        }
                    } else {
                        self.note(format!("fault: kill node {id}"));
                        self.fault_injected();
                        self.kill(id, true);
                    }
                }
            }
            30..40 => {
                let k = self.rng.random_range(2..=3);
                for _ in 0..k {
                    if let Some(id) = self.pick_alive() {
                        self.note(format!("fault: kill node {id} (simultaneous)"));
                        self.kill(id, true);
                    }
                }
            }
            40..50 => {
                self.note("fault: kill a member during the next reconfiguration".into());
                self.kill_in_reconfig += 1;
            }
            50..68 => {
                self.note("fault: a new node joins".into());
                self.join(None);
            }
            68..80 => {
                // A dead node (host) comes back under a new id and its old name.
                let dead: Vec<NodeId> = self
                    .nodes
                    .iter()
                    .filter(|(_, n)| !n.alive)
                    .map(|(&id, _)| id)
                    .collect();
                let pick = (!dead.is_empty()).then(|| dead[self.rng.random_range(0..dead.len())]);
                if self.gpus > 1 {
                    let host = pick.and_then(|id| self.nodes[&id].host.clone());
                    // Not while another incarnation of that host still lives.
                    let taken = host.as_ref().is_some_and(|h| {
                        self.nodes
                            .values()
                            .any(|n| n.alive && n.host.as_ref() == Some(h))
                    });
                    self.note(format!("fault: host {host:?} rejoins"));
                    self.join_host(if taken { None } else { host });
                } else {
                    let name = pick.map(|id| self.names[&id].clone());
                    self.note(format!("fault: node {name:?} rejoins"));
                    self.join(name);
                }
            }
            80..90 => {
                if let Some(id) = self.pick_alive() {
                    let n = self.nodes.get_mut(&id).unwrap();
                    n.worker_frozen = true;
                    // With worker heartbeats, half the frozen workers are hung in compute
                    // (their heartbeat thread goes on): slow-looking, never answering.
                    n.hung = self.cfg.step_deadline.is_some() && self.rng.random_bool(0.5);
                    let hung = self.nodes[&id].hung;
                    self.note(format!("fault: worker of node {id} freezes (hung: {hung})"));
                }
            }
            90..95 if self.cfg.step_deadline.is_some() => {
                if let Some(id) = self.pick_alive() {
                    let slow = self.rng.random_range(3..=8);
                    self.note(format!("fault: node {id} becomes {slow}x slower"));
                    self.stats.slow_members += 1;
                    self.nodes.get_mut(&id).unwrap().slow = slow;
                }
            }
            _ => {
                if let Some(id) = self.pick_alive() {
                    self.note(format!("fault: agent of node {id} freezes"));
                    self.nodes.get_mut(&id).unwrap().agent_frozen = true;
                }
            }
        }
    }

    fn fault_injected(&mut self) {
        if !self.driver_down {
            self.deliver(Event::FaultInjected);
        }
    }

    /// Faults stop; most seeds replace the lost nodes (the job must then finish), the others
    /// may be left with too few (the job must then wait for nodes).
    pub(super) fn heal(&mut self) {
        self.commit_fail_p = 0.0;
        self.kill_in_reconfig = 0;
        if !self.rng.random_bool(0.75) {
            self.note("faults stop; no healing".into());
            return;
        }
        let healthy = self.healthy_nodes();
        self.note(format!("faults stop; healing from {healthy} healthy nodes"));
        let mut n = healthy;
        while n < self.cfg.initial_nodes {
            self.join(None);
            n += self.gpus;
        }
    }

    /// The driver crashes: what it saved survives, the commands it had not sent yet may be
    /// lost, the nodes' agents keep their reports until it is back.
    pub(super) fn crash(&mut self) {
        if self.driver_down {
            return;
        }
        self.note("fault: the driver crashes".into());
        self.driver_down = true;
        self.incarnation += 1;
        let d = self.rng.random_range(50..1_500);
        self.at(self.now_ms + d, Item::Restart);
    }

    /// The driver restarts from the saved machine (serialised, dropped, deserialised) and
    /// calls `recover`; every node whose agent is alive reattaches with what its worker
    /// holds, then sends the reports it kept.
    pub(super) fn restart(&mut self) {
        self.stats.restarts += 1;
        let saved = serde_json::to_string(&self.m).expect("the machine serialises");
        drop(std::mem::replace(
            &mut self.m,
            JobMachine::new(self.cfg.clone()).expect("a valid config"),
        ));
        self.m = serde_json::from_str(&saved).expect("the machine deserialises");
        self.driver_down = false;
        self.note(format!("the driver restarts ({} bytes saved)", saved.len()));
        let known = self.m.live_nodes();
        let mut out = Vec::new();
        self.members_before.clear();
        self.members_before.extend_from_slice(self.m.members());
        self.m.recover(self.now_ms, &mut out);
        self.after_machine(&known, out);
        // The reports still on their way were sent to the old driver: the agents send them
        // again after their `Reattached`, in order after those they kept.
        let queue = std::mem::take(&mut self.queue);
        let mut in_flight: Vec<super::Entry> = Vec::new();
        for e in queue.into_vec() {
            match &e.item {
                Item::ToMachine(ev)
                    if event_node(ev).is_some()
                        && !matches!(**ev, Event::Lost { .. } | Event::Heartbeat { .. }) =>
                {
                    in_flight.push(e)
                }
                _ => self.queue.push(e),
            }
        }
        in_flight.sort_by_key(|e| (e.at_ms, e.seq));
        for e in in_flight {
            if let Item::ToMachine(ev) = e.item {
                let id = event_node(&ev).expect("checked");
                self.buffered.entry(id).or_default().push(*ev);
            }
        }
        let ids: Vec<NodeId> = self.nodes.keys().copied().collect();
        for id in ids {
            self.nodes.get_mut(&id).unwrap().report_free_ms = self.now_ms;
            let n = &self.nodes[&id];
            if !n.alive {
                self.buffered.remove(&id);
                continue;
            }
            if n.agent_frozen {
                // It never comes back: what it reports waits in its agent for ever.
                continue;
            }
            let registered = n.registered;
            self.nodes.get_mut(&id).unwrap().attached = self.incarnation;
            if registered {
                self.stats.reattached += 1;
                let report = self.worker_report(id);
                self.send_with(Event::Reattached { node: id, report }, false);
            }
            for ev in self.buffered.remove(&id).unwrap_or_default() {
                self.send_with(ev, false);
            }
        }
    }

    /// Liveness: the job finished, or it waits for nodes because there are too few.
    pub(super) fn check_end(&mut self) {
        if self.finished.is_some() {
            return;
        }
        let healthy = self.healthy_nodes();
        let too_few = healthy * self.cfg.slots_per_node < self.cfg.model.experts;
        match self.m.phase() {
            Phase::WaitingForNodes if too_few => self.stats.ended_waiting += 1,
            Phase::Gathering if healthy < self.cfg.initial_nodes => self.stats.ended_waiting += 1,
            phase => self.fail(format!(
                "stalled: {phase:?} {} ms after faults stopped, {} of {} steps counted, \
                 {healthy} healthy nodes, members {:?}",
                SETTLE_MS,
                self.counted_next,
                self.cfg.total_steps,
                self.m.members()
            )),
        }
    }
}
