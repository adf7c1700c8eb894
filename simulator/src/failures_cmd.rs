//! `lzsim failures`: synthetic failure traces as Bamboo CSV, so the simulator and the executor
//! can replay the very same sequence.

use crate::duration::{parse_ms, parse_period_ms};
use crate::limits::{self, MAX_NODES};
use crate::replay::output::write_atomic;
use anyhow::{Result, bail};
use clap::Args;
use lazarus_traces::hardware::{self, HardwareModel};
use lazarus_traces::synth::{self, IntervalDist};
use std::path::PathBuf;

/// Hours in Llama 3's 54-day window.
const LLAMA3_HOURS: f64 = 54.0 * 24.0;
/// Llama 3's cluster: 16,384 H100 in 2,048 nodes of 8, two nodes per rack.
const LLAMA3_GPUS: f64 = 16_384.0;
const LLAMA3_NODES: f64 = 2_048.0;
const LLAMA3_RACKS: f64 = 1_024.0;

/// Failure-rate presets with their sources (rates per GPU-, node- and rack-hour).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Preset {
    /// Llama 3 (arXiv 2407.21783, Table 5: 54 days, 16,384 H100 = 2,048 nodes x 8, two nodes per
    /// ToR switch) by cause: GPU faults (faulty GPU 148, HBM3 72, SRAM 19, GPU system
    /// processor 17, thermal 6, silent data corruption 6 = 268) per GPU-hour; host faults (host
    /// maintenance 32, NIC 7, SSD 3, PSU 3, chassis 2, IO board 2, CPU 2, DRAM 2 = 53) per
    /// node-hour; network switch/cable 35 per rack-hour with 2 nodes per rack. Software causes
    /// (63) lose no hardware and are left out: 356 of the 419 unexpected interruptions.
    Llama3,
    /// All 419 unexpected Llama 3 interruptions as GPU faults: 419 / (16,384 x 1,296 h) per
    /// GPU-hour, about 7.8 per day per 16,384 GPUs.
    Llama3Gpu,
    /// Meta's RSC projection (Kokolis et al., HPCA'25, arXiv 2410.21680): job MTTF 0.23 h (14
    /// min) at 131,072 GPUs, i.e. 1 / (0.23 h x 131,072) per GPU-hour, all GPU faults.
    Rsc,
}

impl Preset {
    /// (per GPU-hour, per node-hour, per rack-hour, nodes per rack).
    pub fn rates(self) -> (f64, f64, f64, usize) {
        match self {
            Preset::Llama3 => (
                268.0 / (LLAMA3_GPUS * LLAMA3_HOURS),
                53.0 / (LLAMA3_NODES * LLAMA3_HOURS),
                35.0 / (LLAMA3_RACKS * LLAMA3_HOURS),
                2,
            ),
            Preset::Llama3Gpu => (419.0 / (LLAMA3_GPUS * LLAMA3_HOURS), 0.0, 0.0, 0),
            Preset::Rsc => (1.0 / (0.23 * 131_072.0), 0.0, 0.0, 0),
        }
    }
}

/// Most faults a hardware trace may expect (about a second of generation per million).
pub const MAX_HARDWARE_FAULTS: f64 = 1e7;

#[derive(Args, Debug)]
pub struct FailuresArgs {
    /// Nodes at time 0, 1..=1048576.
    #[arg(long, default_value_t = 10, value_parser = limits::count(MAX_NODES))]
    pub nodes: usize,
    /// Controlled scenario: one uniformly random node fails per interval (paper §6.4: 5m, 40m),
    /// 1ms..=365d.
    #[arg(long, conflicts_with = "hazard")]
    pub every: Option<String>,
    /// Interval distribution for --every: fixed, exp, or weibull:SHAPE (mean = --every).
    #[arg(long, default_value = "fixed")]
    pub dist: String,
    /// Stop failing nodes when this many remain (default: half, as in the paper).
    #[arg(long)]
    pub until_live: Option<usize>,
    /// Stochastic mode (Bamboo style): per-node preemption rate per hour.
    #[arg(long)]
    pub hazard: Option<f64>,
    /// Stochastic mode: expected node arrivals per hour.
    #[arg(long, default_value_t = 0.0)]
    pub add_rate: f64,
    /// Stochastic mode: trace length, at most 365d.
    #[arg(long, default_value = "4h")]
    pub duration: String,
    /// Stochastic mode: time step of the hazard process, at least 1ms; duration / tick x
    /// max nodes <= 1073741824 random draws.
    #[arg(long, default_value = "1m")]
    pub tick: String,
    /// Stochastic mode: cap on live nodes (default: --nodes), 1..=1048576.
    #[arg(long, value_parser = limits::count(MAX_NODES))]
    pub max_nodes: Option<usize>,
    /// Hardware mode (GPU, host and rack faults with repairs; nodes come back under their
    /// name): faults per GPU-hour.
    #[arg(long, conflicts_with_all = ["every", "hazard"])]
    pub gpu_hazard: Option<f64>,
    /// Hardware mode: host faults (everything but the GPUs) per node-hour.
    #[arg(long, conflicts_with_all = ["every", "hazard"])]
    pub node_hazard: Option<f64>,
    /// Hardware mode: faults per rack-hour that take every node of the rack (needs
    /// --nodes-per-rack).
    #[arg(long, conflicts_with_all = ["every", "hazard"])]
    pub rack_hazard: Option<f64>,
    /// Hardware mode: rates from a published source (llama3, llama3-gpu, rsc; see the
    /// README); explicit --gpu-hazard, --node-hazard, --rack-hazard, --nodes-per-rack win.
    #[arg(long, value_enum, conflicts_with_all = ["every", "hazard"])]
    pub preset: Option<Preset>,
    /// Hardware mode: GPUs per node, 1..=256.
    #[arg(long, default_value_t = 8, value_parser = limits::count(limits::MAX_GPUS_PER_NODE))]
    pub gpus_per_node: usize,
    /// Hardware mode: consecutive nodes per rack (default: the preset's, else no racks).
    #[arg(long, value_parser = limits::count(MAX_NODES))]
    pub nodes_per_rack: Option<usize>,
    /// Hardware mode: mean repair time of a GPU fault (drain, swap, return); an assumption,
    /// no source gives it.
    #[arg(long, default_value = "24h")]
    pub gpu_repair: String,
    /// Hardware mode: mean repair time of a host fault (an assumption).
    #[arg(long, default_value = "24h")]
    pub node_repair: String,
    /// Hardware mode: mean repair time of a rack fault (an assumption).
    #[arg(long, default_value = "2h")]
    pub rack_repair: String,
    /// Hardware mode: repair-time distribution around the means: fixed, exp, weibull:SHAPE.
    #[arg(long, default_value = "exp")]
    pub repair_dist: String,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Write here instead of stdout (refuses to replace an existing file).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

impl FailuresArgs {
    /// Hardware mode was asked for.
    pub fn hardware_mode(&self) -> bool {
        self.preset.is_some()
            || self.gpu_hazard.is_some()
            || self.node_hazard.is_some()
            || self.rack_hazard.is_some()
    }

    /// The hardware model of these arguments, checked.
    pub fn hardware_model(&self) -> Result<HardwareModel> {
        let (gpu, node, rack, per_rack) = self.preset.map_or((0.0, 0.0, 0.0, 0), Preset::rates);
        let gpu_per_hour = self.gpu_hazard.unwrap_or(gpu);
        let node_per_hour = self.node_hazard.unwrap_or(node);
        let rack_per_hour = self.rack_hazard.unwrap_or(rack);
        for (name, r) in [
            ("--gpu-hazard", gpu_per_hour),
            ("--node-hazard", node_per_hour),
            ("--rack-hazard", rack_per_hour),
        ] {
            if !(r.is_finite() && r >= 0.0) {
                bail!("{name} must be a finite rate >= 0 per hour (got {r})");
            }
        }
        let nodes_per_rack = self.nodes_per_rack.unwrap_or(per_rack);
        if rack_per_hour > 0.0 && nodes_per_rack == 0 {
            bail!("--rack-hazard needs --nodes-per-rack");
        }
        let repair: IntervalDist = self
            .repair_dist
            .parse()
            .map_err(|e| anyhow::anyhow!("--repair-dist: {e}"))?;
        let m = HardwareModel {
            nodes: self.nodes,
            gpus_per_node: self.gpus_per_node,
            nodes_per_rack,
            gpu_per_hour,
            node_per_hour,
            rack_per_hour,
            gpu_repair_ms: parse_period_ms("--gpu-repair", &self.gpu_repair)?,
            node_repair_ms: parse_period_ms("--node-repair", &self.node_repair)?,
            rack_repair_ms: parse_period_ms("--rack-repair", &self.rack_repair)?,
            repair,
            duration_ms: parse_ms("--duration", &self.duration)?,
        };
        let expected = m.faults_per_day() * m.duration_ms as f64 / 86_400_000.0;
        if expected > MAX_HARDWARE_FAULTS {
            bail!(
                "these rates expect {expected:.3e} faults over --duration, more than the limit of \
                 {MAX_HARDWARE_FAULTS:e}; use lower rates or a shorter --duration"
            );
        }
        Ok(m)
    }
}

pub fn run(a: &FailuresArgs) -> Result<()> {
    if a.hardware_mode() {
        let m = a.hardware_model()?;
        let h = hardware::hardware(&m, a.seed);
        let days = m.duration_ms as f64 / 86_400_000.0;
        let c = h.counts;
        eprintln!(
            "hardware faults over {days:.1} days: gpu {}, host {}, rack {}; {} node removals \
             ({:.2} per day; {:.2} faults per day expected)",
            c.gpu,
            c.node,
            c.rack,
            c.removals,
            c.removals as f64 / days.max(f64::MIN_POSITIVE),
            m.faults_per_day()
        );
        return write(a, &h.trace.to_bamboo_csv());
    }
    let trace = match (&a.every, a.hazard) {
        (Some(every), None) => {
            let dist: IntervalDist = a.dist.parse().map_err(|e| anyhow::anyhow!("--dist: {e}"))?;
            let every_ms = parse_period_ms("--every", every)?;
            let until = a.until_live.unwrap_or(a.nodes.div_ceil(2));
            if until > a.nodes {
                bail!("--until-live {until} exceeds --nodes {}", a.nodes);
            }
            synth::fixed_interval(a.nodes, every_ms, dist, until, a.seed)
        }
        (None, Some(h)) => {
            if !(h.is_finite() && h >= 0.0 && a.add_rate.is_finite() && a.add_rate >= 0.0) {
                bail!("--hazard and --add-rate must be finite rates >= 0");
            }
            let tick = parse_period_ms("--tick", &a.tick)?;
            let duration = parse_ms("--duration", &a.duration)?;
            let max_nodes = a.max_nodes.unwrap_or(a.nodes).max(a.nodes);
            limits::check_hazard_draws(duration, tick, max_nodes)?;
            synth::hazard(a.nodes, h, a.add_rate, duration, tick, max_nodes, a.seed)
        }
        _ => bail!(
            "give --every INTERVAL, --hazard RATE, or hardware rates (--gpu-hazard, --node-hazard, \
             --rack-hazard or --preset)"
        ),
    };
    write(a, &trace.to_bamboo_csv())
}

fn write(a: &FailuresArgs, csv: &str) -> Result<()> {
    match &a.out {
        None => crate::stdout::print(csv)?,
        Some(p) => {
            if p.exists() {
                bail!("{} exists; not replacing it", p.display());
            }
            write_atomic(p, csv.as_bytes())?;
        }
    }
    Ok(())
}
