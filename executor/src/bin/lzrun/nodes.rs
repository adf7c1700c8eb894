//! The local node processes of `lzrun local`: launching, killing and reaping agents. With G
//! GPUs per node an agent runs G workers, registered as `<node>-gpu<i>`.

use std::ffi::OsString;
use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow};

/// The agent processes of `lzrun local`, each in its own process group (with its worker);
/// dropping it SIGKILLs every group still running.
pub struct Nodes {
    exe: PathBuf,
    controller: SocketAddr,
    token: String,
    /// Extra environment of every agent (and so of its worker), e.g. a failpoint.
    env: Vec<(String, OsString)>,
    children: Vec<(String, Option<Child>)>,
    /// Workers per agent (`--gpus-per-node`).
    gpus: usize,
}

impl Nodes {
    /// No nodes yet; agents of `exe` will register with `controller` presenting `token`.
    /// Every agent runs `gpus` workers.
    pub fn new(exe: PathBuf, controller: SocketAddr, token: String, gpus: usize) -> Self {
        Self {
            exe,
            controller,
            token,
            env: Vec::new(),
            children: Vec::new(),
            gpus: gpus.max(1),
        }
    }

    /// Workers per agent.
    pub fn gpus(&self) -> usize {
        self.gpus
    }

    /// The names node `i`'s workers register with: the node's name with one GPU, else
    /// `<name>-gpu<g>` (as `lzrun agent --gpus-per-node` names them).
    pub fn worker_names(&self, i: usize) -> Vec<String> {
        let Some(name) = self.name(i) else {
            return Vec::new();
        };
        match self.gpus {
            1 => vec![name.to_owned()],
            g => (0..g).map(|k| format!("{name}-gpu{k}")).collect(),
        }
    }

    /// The ranks node `i`'s workers hold in the plan in force, ascending.
    pub fn ranks(&self, i: usize, job: &lazarus_executor::control::JobHandle) -> Vec<usize> {
        let mut ranks: Vec<usize> = self
            .worker_names(i)
            .iter()
            .filter_map(|n| job.rank_of(n))
            .collect();
        ranks.sort_unstable();
        ranks
    }

    /// The index of the running node one of whose workers is called `worker`.
    pub fn index_of_worker(&self, worker: &str) -> Option<usize> {
        (0..self.children.len())
            .rev()
            .find(|&i| self.is_running(i) && self.worker_names(i).iter().any(|n| n == worker))
    }

    /// Sets `key` in the environment of the agents started from now on.
    pub fn set_env(&mut self, key: &str, value: impl Into<OsString>) {
        self.env.push((key.to_owned(), value.into()));
    }

    /// Nodes launched so far, running or not (the next node's index).
    pub fn launched(&self) -> usize {
        self.children.len()
    }

    /// Starts agent `name` (which starts its worker) in its own process group.
    pub fn spawn(&mut self, name: &str) -> Result<()> {
        let child = Command::new(&self.exe)
            .arg("agent")
            .args(["--controller", &self.controller.to_string()])
            .args(["--name", name])
            .env("LZRUN_TOKEN", &self.token)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            // Own process group: `kill_group` takes the agent and its worker together, and a
            // Ctrl-C in the terminal reaches only `lzrun local`, which stops the job cleanly.
            .process_group(0)
            .spawn()
            .with_context(|| format!("starting agent {name} ({})", self.exe.display()))?;
        self.children.push((name.to_owned(), Some(child)));
        Ok(())
    }

    /// The name of node `i` (launch index), running or not.
    pub fn name(&self, i: usize) -> Option<&str> {
        self.children.get(i).map(|(n, _)| n.as_str())
    }

    /// What messages call node `i`: its name (`n3`), or `n<i>` before it was launched.
    pub fn label(&self, i: usize) -> String {
        self.name(i).map_or_else(|| format!("n{i}"), str::to_owned)
    }

    /// The node a trace kill of `name` is about ([`Named`]).
    pub fn find_name(&self, name: &str) -> Named {
        let children: Vec<(&str, bool)> = self
            .children
            .iter()
            .map(|(n, c)| (n.as_str(), c.is_some()))
            .collect();
        named(&children, name)
    }

    /// Nodes launched, not killed by this launcher and not exited on their own (some may be
    /// frozen or starting). Reaps the agents that exited first ([`Nodes::reap_exited`]): an
    /// agent whose worker died exits with it, and counting it as coming left the job waiting
    /// for a node that would never register.
    pub fn running(&mut self) -> usize {
        self.reap_exited();
        self.children.iter().filter(|(_, c)| c.is_some()).count()
    }

    /// The agents that exited on their own since the last call (a worker that died takes its
    /// agent with it), with how they ended; they no longer count as running.
    pub fn reap_exited(&mut self) -> Vec<(String, std::process::ExitStatus)> {
        let mut exited = Vec::new();
        for (name, slot) in &mut self.children {
            if let Some(Ok(Some(status))) = slot.as_mut().map(Child::try_wait) {
                *slot = None;
                exited.push((name.clone(), status));
            }
        }
        exited
    }

    /// Whether node `i` was launched and not killed by this launcher.
    pub fn is_running(&self, i: usize) -> bool {
        self.agent_pid(i).is_some()
    }

    /// The pid of node `i`'s agent, while it runs.
    fn agent_pid(&self, i: usize) -> Option<i32> {
        let child = self.children.get(i)?.1.as_ref()?;
        i32::try_from(child.id()).ok()
    }

    /// SIGSTOPs node `i`'s agent (its worker runs on); its name.
    pub fn freeze_agent(&mut self, i: usize) -> Result<String> {
        let pid = self
            .agent_pid(i)
            .ok_or_else(|| anyhow!("node {} is not running", self.label(i)))?;
        // SAFETY: kill(2) on a process this launcher started; no memory is shared.
        unsafe {
            libc::kill(pid, libc::SIGSTOP);
        }
        Ok(self.children[i].0.clone())
    }

    /// SIGSTOPs node `i`'s worker (its agent runs on); its name. Fails when the agent has no
    /// worker process (yet).
    pub fn freeze_worker(&mut self, i: usize) -> Result<String> {
        let agent = self
            .agent_pid(i)
            .ok_or_else(|| anyhow!("node {} is not running", self.label(i)))?;
        let worker = children_of(agent)
            .into_iter()
            .next()
            .ok_or_else(|| anyhow!("node {} has no worker process", self.label(i)))?;
        // SAFETY: kill(2) on a child of a process this launcher started; no memory is shared.
        unsafe {
            libc::kill(worker, libc::SIGSTOP);
        }
        Ok(self.children[i].0.clone())
    }

    /// SIGKILLs node `i`'s process group (agent and worker).
    pub fn kill_group(&mut self, i: usize) -> Result<String> {
        let (name, slot) = self
            .children
            .get_mut(i)
            .ok_or_else(|| anyhow!("no node n{i} was launched"))?;
        let mut child = slot
            .take()
            .ok_or_else(|| anyhow!("node {name} is not running"))?;
        let pgid = i32::try_from(child.id()).context("pid out of range")?;
        // SAFETY: kill(2) with a negative pid signals that process group; no memory is shared.
        unsafe {
            libc::kill(-pgid, libc::SIGKILL);
        }
        let _ = child.wait();
        Ok(name.clone())
    }

    /// Waits up to `grace` for every agent to exit, then kills the rest.
    pub fn reap(&mut self, grace: Duration) {
        let deadline = Instant::now() + grace;
        for i in 0..self.children.len() {
            while let Some(c) = self.children[i].1.as_mut() {
                match c.try_wait() {
                    Ok(Some(_)) | Err(_) => {
                        self.children[i].1 = None;
                    }
                    Ok(None) if Instant::now() < deadline => {
                        thread::sleep(Duration::from_millis(20));
                    }
                    Ok(None) => {
                        let _ = self.kill_group(i);
                    }
                }
            }
        }
    }
}

/// What a trace kill of a name finds among the nodes launched so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Named {
    /// The running node carrying the name (the newest, when the name was added again).
    Running(usize),
    /// The name's newest node, no longer running: the controller fenced it and the launcher
    /// killed it, or an earlier kill did. A kill of it is a no-op.
    Gone(usize),
    /// No node ever carried the name (a schedule that does not match the trace's adds).
    Unknown,
}

/// [`Nodes::find_name`] over `(name, running)` of every node launched, in launch order.
fn named(children: &[(&str, bool)], name: &str) -> Named {
    if let Some(i) = children
        .iter()
        .rposition(|&(n, running)| n == name && running)
    {
        return Named::Running(i);
    }
    children
        .iter()
        .rposition(|&(n, _)| n == name)
        .map_or(Named::Unknown, Named::Gone)
}

/// The pids of `parent`'s child processes (Linux `/proc`; empty elsewhere).
fn children_of(parent: i32) -> Vec<i32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                // `pid (comm) state ppid …`: comm may hold spaces, so split after the last ')'.
                .and_then(|st| {
                    st.rsplit_once(')')?
                        .1
                        .split_whitespace()
                        .nth(1)?
                        .parse()
                        .ok()
                })
                == Some(parent)
        })
        .collect()
}

impl Drop for Nodes {
    fn drop(&mut self) {
        for i in 0..self.children.len() {
            if self.children[i].1.is_some() {
                let _ = self.kill_group(i);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A trace kill of a node the controller already fenced (and the launcher killed) finds it
    /// gone, not missing: `lzrun local` used to end with "trace kills NAME, which is not
    /// running".
    #[test]
    fn a_trace_kill_finds_the_running_node_a_gone_one_or_none() {
        let nodes = [("a", false), ("b", true), ("a", true), ("c", false)];
        assert_eq!(named(&nodes, "a"), Named::Running(2));
        assert_eq!(named(&nodes, "b"), Named::Running(1));
        assert_eq!(named(&nodes, "c"), Named::Gone(3));
        assert_eq!(named(&nodes, "d"), Named::Unknown);
        // A name added again and gone again: its newest node.
        assert_eq!(named(&[("a", false), ("a", false)], "a"), Named::Gone(1));
    }
}
