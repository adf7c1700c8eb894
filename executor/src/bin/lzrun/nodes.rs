//! The local node processes of `lzrun local`: launching, killing and reaping agents.

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
    children: Vec<(String, Option<Child>)>,
}

impl Nodes {
    /// No nodes yet; agents of `exe` will register with `controller` presenting `token`.
    pub fn new(exe: PathBuf, controller: SocketAddr, token: String) -> Self {
        Self {
            exe,
            controller,
            token,
            children: Vec::new(),
        }
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

    /// The index of the running node called `name`.
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.children
            .iter()
            .rposition(|(n, c)| n == name && c.is_some())
    }

    /// SIGKILLs node `i`'s process group (agent and worker).
    pub fn kill_group(&mut self, i: usize) -> Result<String> {
        let (name, slot) = self
            .children
            .get_mut(i)
            .ok_or_else(|| anyhow!("no node {i}"))?;
        let mut child = slot
            .take()
            .ok_or_else(|| anyhow!("node {i} is not running"))?;
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

impl Drop for Nodes {
    fn drop(&mut self) {
        for i in 0..self.children.len() {
            if self.children[i].1.is_some() {
                let _ = self.kill_group(i);
            }
        }
    }
}
