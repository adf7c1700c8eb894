//! A job's settings resolved from the command line: planner rules, checkpoints, timeouts.

use std::path::PathBuf;

use anyhow::{Context, Result, anyhow, ensure};
use lazarus_executor::control::{JobParams, ServerConfig};
use lazarus_executor::worker::CheckpointSpec;
use lazarus_planner::ModelSpec;
use lazarus_planner::job::JobConfig;

use crate::args::JobArgs;
use crate::config::load_config;

/// Everything a job needs from the command line, resolved.
pub struct Job {
    pub server: ServerConfig,
    pub params: JobParams,
    /// A checkpoint directory we created and remove at the end.
    pub temp_ckpt: Option<PathBuf>,
}

/// Checks the job options and resolves them for a job that starts on `nodes` nodes.
pub fn job_from_args(a: &JobArgs, nodes: usize, token: &str) -> Result<Job> {
    ensure!(
        a.heartbeat_timeout_ms >= 1,
        "--heartbeat-timeout-ms must be at least 1"
    );
    ensure!(a.model.steps >= 1, "--steps must be at least 1 (got 0)");
    ensure!(nodes >= 1, "at least one node is needed");
    ensure!(
        a.fault_tolerance >= 1,
        "--fault-tolerance must be at least 1"
    );
    ensure!(a.timeout_ms >= 1, "--timeout-ms must be at least 1");
    ensure!(a.ckpt_keep >= 1, "--ckpt-keep must be at least 1");
    let config = load_config(&a.model.config, a.model.seed)?;
    let slots = a
        .slots
        .unwrap_or_else(|| (a.fault_tolerance * config.experts).div_ceil(nodes).max(1));
    ensure!(
        slots * nodes >= config.experts,
        "{nodes} nodes × {slots} slots cannot hold {} experts (raise --slots)",
        config.experts
    );
    if let Some(r) = &a.resume {
        ensure!(
            r.is_dir(),
            "--resume {}: no such checkpoint directory",
            r.display()
        );
    }
    let mut temp_ckpt = None;
    let checkpoint = if a.ckpt_every == 0 {
        None
    } else {
        let root = match (&a.ckpt_dir, &a.metrics_out, &a.out) {
            (Some(d), _, _) => d.clone(),
            (None, Some(d), _) | (None, None, Some(d)) => d.join("ckpt"),
            (None, None, None) => {
                let d = std::env::temp_dir().join(format!("lzrun-ckpt-{}", std::process::id()));
                temp_ckpt = Some(d.clone());
                d
            }
        };
        std::fs::create_dir_all(&root)
            .with_context(|| format!("creating the checkpoint directory {}", root.display()))?;
        Some(CheckpointSpec {
            root,
            every_steps: a.ckpt_every,
        })
    };
    let model = ModelSpec {
        experts: config.experts,
        layers: config.n_layers,
        f: a.fault_tolerance,
    };
    let mut rules = JobConfig::new(model, slots, a.model.steps);
    rules.initial_nodes = nodes;
    rules.heartbeat_timeout_ms = a.heartbeat_timeout_ms;
    // Survivors notice a stuck peer after one collective timeout; give the stuck member that
    // long again (and a margin) to answer before fencing it.
    rules.member_timeout_ms = a.timeout_ms.saturating_mul(2).saturating_add(2_000);
    // Newcomers join at the next step boundary (the paper waits 2 min to batch joins; this
    // executor pauses training for them anyway).
    rules.scale_out_wait_ms = 0;
    rules.rebalance_every_steps = a.rebalance_every;
    rules.wait_for_nodes_ms = a.wait_for_nodes_ms;
    rules.checkpoint_every_steps = if checkpoint.is_some() {
        a.ckpt_every
    } else {
        0
    };
    rules.resume = a.resume.is_some();
    rules.bytes_per_expert = config.expert_state_bytes() as u64;
    rules
        .validate()
        .map_err(|e| anyhow!("invalid job configuration: {e}"))?;
    Ok(Job {
        server: ServerConfig::new(50, a.heartbeat_timeout_ms),
        params: JobParams {
            config,
            rules,
            token: token.to_owned(),
            timeout_ms: a.timeout_ms,
            checkpoint,
            checkpoint_keep: a.ckpt_keep,
            out: a.out.clone(),
            resume: a.resume.clone(),
        },
        temp_ckpt,
    })
}
