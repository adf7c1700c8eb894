//! Expert-routing (gate) traces: per sampled training iteration and MoE layer, how many token
//! assignments the gate sent to each expert. The format is the SmartMoE derived CSV
//! (`iter,layer,e0,…,e{N-1}`, one row per sampled iteration and layer), the gate trace the
//! Lazarus paper replays for its expert loads (Wu et al., arXiv 2407.04656, §6.2, Fig. 2), or our plain
//! per-step CSV with a `step` first column.
//!
//! ```
//! use lazarus_traces::routing::GateTrace;
//! let csv = "iter,layer,e0,e1,e2\n1,0,5,9,1\n11,0,7,3,8\n";
//! let g = GateTrace::parse(csv, 1, 2).unwrap();
//! assert_eq!(g.iterations(), &[1, 11]);
//! assert_eq!(g.loads_at_step(0)[0], vec![5, 9]); // the two most-loaded of the three
//! assert_eq!(g.top_loads_at_iteration(11).unwrap(), vec![vec![8, 7]]);
//! ```
use std::collections::BTreeMap;
use std::num::ParseIntError;
use std::path::{Path, PathBuf};

/// Why a gate trace could not be read or parsed. Line numbers are 1-based physical lines.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GateTraceError {
    /// The file could not be read.
    #[error("cannot read gate trace {}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A parse error inside a named file (produced by [`GateTrace::load`]).
    #[error("gate trace {}", path.display())]
    InFile {
        /// The file.
        path: PathBuf,
        /// What was wrong with its content.
        #[source]
        source: Box<GateTraceError>,
    },
    /// The model asks for no layers or no experts.
    #[error("need at least one layer and one expert (got {layers} layers, {experts} experts)")]
    EmptyModel {
        /// Requested MoE layers.
        layers: usize,
        /// Requested experts per layer.
        experts: usize,
    },
    /// No header line.
    #[error("the file is empty")]
    Empty,
    /// The first non-blank line is not `iter,layer,e0,…` or `step,layer,e0,…`.
    #[error("line 1: expected a header `iter,layer,e0,…` or `step,layer,e0,…`, found {0:?}")]
    Header(String),
    /// The model has more experts per layer than the trace.
    #[error("the trace has {source_experts} experts per layer, fewer than the model's {experts}")]
    TooFewExperts {
        /// Experts per layer in the file.
        source_experts: usize,
        /// Experts per layer the model needs.
        experts: usize,
    },
    /// A field is not a non-negative integer.
    #[error("line {line}: {field:?} is not a non-negative integer")]
    Field {
        /// 1-based line.
        line: usize,
        /// The offending field.
        field: String,
        /// Why it did not parse.
        #[source]
        source: ParseIntError,
    },
    /// A row has another field count than the header.
    #[error("line {line}: {fields} fields, the header has {header}")]
    FieldCount {
        /// 1-based line.
        line: usize,
        /// Fields on the line.
        fields: usize,
        /// Fields in the header.
        header: usize,
    },
    /// The same (iteration, layer) appears twice.
    #[error("line {line}: iteration {iteration}, layer {layer} already given on line {first}")]
    Duplicate {
        /// 1-based line of the repeat.
        line: usize,
        /// 1-based line of the first occurrence.
        first: usize,
        /// The iteration.
        iteration: u64,
        /// The layer.
        layer: u64,
    },
    /// Only a header.
    #[error("no data rows after the header")]
    NoRows,
    /// A sampled iteration lacks one of the model's layers.
    #[error("iteration {iteration} has no row for layer {layer} (the model needs {layers} layers)")]
    MissingLayer {
        /// The iteration.
        iteration: u64,
        /// The missing layer.
        layer: usize,
        /// Layers the model needs.
        layers: usize,
    },
}

/// A gate trace reduced to a model's `layers` MoE layers and `experts` experts per layer.
///
/// Mapping (the reading of the paper's "loads of the top experts at each layer", §6.2; the
/// paper gives no details):
/// * **Layers**: the first `layers` layers of the trace (0…layers−1).
/// * **Experts**: in every row, the `experts` most-loaded trace experts (ties: lower id); the
///   others are dropped, and since only shares matter the kept counts are used as they are
///   (implicitly renormalised). The trace counts top-2 assignments; each counts as one token
///   of the top-1 model.
/// * **Expert identity**: model expert ids are assigned at the first sampled iteration, in
///   ascending trace id. When the top set of a later row changes, each entering trace expert
///   takes the model id of a leaving one — paired by load (the most-loaded entering one takes
///   the id of the one that was most loaded in the previous row). So a trace expert keeps its
///   model id for as long as it stays in the top set, and shifts of popularity among kept
///   experts show up as real load drift rather than being sorted away.
#[derive(Debug, Clone, PartialEq)]
pub struct GateTrace {
    /// Sampled training iterations (1-based, as in the trace), ascending.
    iterations: Vec<u64>,
    /// `[row][layer][expert]` assignment counts of the kept experts.
    loads: Vec<Vec<Vec<u64>>>,
    /// `[row][layer][expert]` trace expert id playing each model expert.
    source_ids: Vec<Vec<Vec<u32>>>,
    /// Experts per layer in the file.
    source_experts: usize,
}

impl GateTrace {
    /// Reads and parses the file `path` (see [`GateTrace::parse`]); errors name the file.
    pub fn load(path: &Path, layers: usize, experts: usize) -> Result<Self, GateTraceError> {
        let text = std::fs::read_to_string(path).map_err(|source| GateTraceError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(&text, layers, experts).map_err(|e| GateTraceError::InFile {
            path: path.to_path_buf(),
            source: Box::new(e),
        })
    }

    /// Parses a gate trace for a model with `layers` MoE layers and `experts` experts per
    /// layer. Rows may come in any order; every sampled iteration must have all `layers`
    /// layers. Errors name the line.
    pub fn parse(text: &str, layers: usize, experts: usize) -> Result<Self, GateTraceError> {
        if layers == 0 || experts == 0 {
            return Err(GateTraceError::EmptyModel { layers, experts });
        }
        let mut lines = text.lines().enumerate();
        let (_, header) = lines
            .find(|(_, l)| !l.trim().is_empty())
            .ok_or(GateTraceError::Empty)?;
        let cols: Vec<&str> = header.trim().split(',').map(str::trim).collect();
        if cols.len() < 3 || !(cols[0] == "iter" || cols[0] == "step") || cols[1] != "layer" {
            return Err(GateTraceError::Header(header.to_string()));
        }
        let source_experts = cols.len() - 2;
        if experts > source_experts {
            return Err(GateTraceError::TooFewExperts {
                source_experts,
                experts,
            });
        }

        // iteration → layer → (line number, counts)
        let mut rows: BTreeMap<u64, BTreeMap<u64, (usize, Vec<u64>)>> = BTreeMap::new();
        for (i, raw) in lines {
            let line = i + 1;
            let trimmed = raw.trim();
            if trimmed.is_empty() {
                continue;
            }
            let values = trimmed
                .split(',')
                .map(|x| {
                    x.trim()
                        .parse::<u64>()
                        .map_err(|source| GateTraceError::Field {
                            line,
                            field: x.to_string(),
                            source,
                        })
                })
                .collect::<Result<Vec<u64>, _>>()?;
            if values.len() != cols.len() {
                return Err(GateTraceError::FieldCount {
                    line,
                    fields: values.len(),
                    header: cols.len(),
                });
            }
            let (iteration, layer) = (values[0], values[1]);
            if let Some((first, _)) = rows
                .entry(iteration)
                .or_default()
                .insert(layer, (line, values[2..].to_vec()))
            {
                return Err(GateTraceError::Duplicate {
                    line,
                    first,
                    iteration,
                    layer,
                });
            }
        }
        if rows.is_empty() {
            return Err(GateTraceError::NoRows);
        }

        let mut iterations = Vec::with_capacity(rows.len());
        let mut loads: Vec<Vec<Vec<u64>>> = Vec::with_capacity(rows.len());
        let mut source_ids: Vec<Vec<Vec<u32>>> = Vec::with_capacity(rows.len());
        for (&iteration, by_layer) in &rows {
            let mut row_loads = Vec::with_capacity(layers);
            let mut row_ids = Vec::with_capacity(layers);
            for layer in 0..layers {
                let (_, counts) =
                    by_layer
                        .get(&(layer as u64))
                        .ok_or(GateTraceError::MissingLayer {
                            iteration,
                            layer,
                            layers,
                        })?;
                let prev = source_ids
                    .last()
                    .map(|r| &r[layer])
                    .zip(loads.last().map(|r| &r[layer]));
                let ids = keep_top(counts, experts, prev);
                row_loads.push(ids.iter().map(|&id| counts[id as usize]).collect());
                row_ids.push(ids);
            }
            iterations.push(iteration);
            loads.push(row_loads);
            source_ids.push(row_ids);
        }
        Ok(GateTrace {
            iterations,
            loads,
            source_ids,
            source_experts,
        })
    }

    /// MoE layers kept.
    pub fn layers(&self) -> usize {
        self.loads[0].len()
    }

    /// Experts per layer kept.
    pub fn experts(&self) -> usize {
        self.loads[0][0].len()
    }

    /// Experts per layer in the trace file.
    pub fn source_experts(&self) -> usize {
        self.source_experts
    }

    /// The sampled iterations, ascending.
    pub fn iterations(&self) -> &[u64] {
        &self.iterations
    }

    /// Row of training step `step` (0-based): the step is trace iteration `step + 1` (the
    /// trace counts from 1), mapped to the latest sampled iteration `≤ step + 1`; before the
    /// first sample, the first; after the last, the last (clamped).
    fn row_of_step(&self, step: u64) -> usize {
        let iteration = step.saturating_add(1);
        self.iterations
            .partition_point(|&i| i <= iteration)
            .saturating_sub(1)
    }

    /// The sampled iteration whose loads step `step` uses.
    pub fn iteration_for_step(&self, step: u64) -> u64 {
        self.iterations[self.row_of_step(step)]
    }

    /// Loads `[layer][expert]` of training step `step` (0-based).
    pub fn loads_at_step(&self, step: u64) -> &[Vec<u64>] {
        &self.loads[self.row_of_step(step)]
    }

    /// Loads of a sampled iteration, if it is one.
    pub fn loads_at_iteration(&self, iteration: u64) -> Option<&[Vec<u64>]> {
        let row = self.iterations.binary_search(&iteration).ok()?;
        Some(&self.loads[row])
    }

    /// Loads of a sampled iteration with each layer sorted from most to least loaded: "the
    /// loads of the top experts at each layer" without expert identity, as a one-off plan
    /// uses them.
    pub fn top_loads_at_iteration(&self, iteration: u64) -> Option<Vec<Vec<u64>>> {
        let mut layers = self.loads_at_iteration(iteration)?.to_vec();
        for row in &mut layers {
            row.sort_unstable_by(|a, b| b.cmp(a));
        }
        Some(layers)
    }

    /// Trace expert id of each model expert, `[layer][expert]`, at step `step`.
    pub fn source_ids_at_step(&self, step: u64) -> &[Vec<u32>] {
        &self.source_ids[self.row_of_step(step)]
    }

    /// First step after `step` that maps to another sampled iteration, if any.
    pub fn next_change(&self, step: u64) -> Option<u64> {
        let next = self.row_of_step(step) + 1;
        // Iteration i is first used by step i - 1; it is > step + 1 here.
        self.iterations.get(next).map(|&i| (i - 1).max(step + 1))
    }
}

/// Trace ids of the model experts for one row: the `experts` most-loaded (ties: lower id),
/// keeping the previous row's id assignment where possible (see [`GateTrace`]).
/// `prev`: the previous row's ids and loads, both in model-expert order.
fn keep_top(counts: &[u64], experts: usize, prev: Option<(&Vec<u32>, &Vec<u64>)>) -> Vec<u32> {
    let mut order: Vec<u32> = (0..counts.len() as u32).collect();
    order.sort_by(|&a, &b| counts[b as usize].cmp(&counts[a as usize]).then(a.cmp(&b)));
    let top = &order[..experts];
    let Some((prev_ids, prev_loads)) = prev else {
        let mut ids = top.to_vec();
        ids.sort_unstable();
        return ids;
    };
    let mut ids = prev_ids.clone();
    // Model slots whose trace expert left the top set, most loaded (previous row) first.
    let mut vacated: Vec<usize> = (0..experts).filter(|&j| !top.contains(&ids[j])).collect();
    vacated.sort_by(|&a, &b| prev_loads[b].cmp(&prev_loads[a]).then(a.cmp(&b)));
    // Entering trace experts, most loaded first (`top` is already in that order).
    let entering = top.iter().filter(|id| !prev_ids.contains(id));
    for (slot, &id) in vacated.into_iter().zip(entering) {
        ids[slot] = id;
    }
    ids
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_trace_mapping() {
        let t = "iter,layer,e0,e1,e2,e3\n\
                 11,0,1,9,5,0\n11,1,4,3,2,1\n\
                 1,0,5,9,1,0\n1,1,1,2,3,4\n\
                 21,0,9,1,0,5\n21,1,1,2,3,4\n";
        let g = GateTrace::parse(t, 2, 2).unwrap();
        assert_eq!(g.iterations(), &[1, 11, 21]);
        assert_eq!((g.layers(), g.experts(), g.source_experts()), (2, 2, 4));
        // Iteration 1, layer 0: top-2 are e1 (9), e0 (5) → ids ascending [0, 1].
        assert_eq!(g.loads_at_iteration(1).unwrap()[0], vec![5, 9]);
        assert_eq!(g.top_loads_at_iteration(1).unwrap()[0], vec![9, 5]);
        assert!(g.top_loads_at_iteration(2).is_none());
        // Iteration 11, layer 0: top-2 e1 (9), e2 (5): e0 left slot 0, e2 takes it.
        assert_eq!(g.source_ids_at_step(10)[0], vec![2, 1]);
        assert_eq!(g.loads_at_step(10)[0], vec![5, 9]);
        // Iteration 21: e0 (9) and e3 (5) enter; e1 (prev 9, slot 1) ↔ e0, e2 (slot 0) ↔ e3.
        assert_eq!(g.source_ids_at_step(20)[0], vec![3, 0]);
        assert_eq!(g.loads_at_step(20)[0], vec![5, 9]);
        // Layer 1, iteration 1: top-2 e3, e2 → [2, 3]; iteration 11: e0 (4), e1 (3) replace.
        assert_eq!(g.source_ids_at_step(0)[1], vec![2, 3]);
        assert_eq!(g.source_ids_at_step(10)[1], vec![1, 0]);
        // Step mapping: step s → latest sampled iteration ≤ s + 1, clamped.
        assert_eq!(g.iteration_for_step(0), 1);
        assert_eq!(g.iteration_for_step(9), 1);
        assert_eq!(g.iteration_for_step(10), 11);
        assert_eq!(g.iteration_for_step(1_000_000), 21);
        assert_eq!(g.next_change(0), Some(10));
        assert_eq!(g.next_change(10), Some(20));
        assert_eq!(g.next_change(25), None);
    }

    /// The error and its causes, as `anyhow`'s `{:#}` prints them.
    fn chain(e: &dyn std::error::Error) -> String {
        let mut s = e.to_string();
        let mut cur = e.source();
        while let Some(c) = cur {
            s += &format!(": {c}");
            cur = c.source();
        }
        s
    }

    #[test]
    fn errors_name_the_line() {
        let e = |t: &str, l, x| chain(&GateTrace::parse(t, l, x).unwrap_err());
        let msg = e("iter,layer,e0,e1\n1,0,1,2\n1,1,x,2\n", 2, 2);
        assert!(msg.contains("line 3"), "{msg}");
        let msg = e("iter,layer,e0,e1\n1,0,1,2\n1,0,1,2\n", 1, 2);
        assert!(msg.contains("line 3") && msg.contains("line 2"), "{msg}");
        let msg = e("iter,layer,e0,e1\n1,0,1,2,3\n", 1, 2);
        assert!(msg.contains("line 2"), "{msg}");
        let msg = e("iter,layer,e0,e1\n1,0,1,2\n", 2, 2);
        assert!(msg.contains("layer 1"), "{msg}");
        let msg = e("iter,layer,e0,e1\n1,0,1,2\n", 1, 3);
        assert!(msg.contains("2 experts"), "{msg}");
        let msg = e("it,layer,e0\n", 1, 1);
        assert!(msg.contains("line 1"), "{msg}");
        let msg = chain(&GateTrace::load(Path::new("/nonexistent/trace.csv"), 1, 1).unwrap_err());
        assert!(msg.contains("/nonexistent/trace.csv"), "{msg}");
    }
}
