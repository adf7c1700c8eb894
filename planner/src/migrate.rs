//! Migration mapping for reconfiguration (Lazarus, arXiv 2407.04656 §4.3 and §5.2).
//!
//! After a failure (or a scale-out) the planner computes a fresh whole-model placement for the
//! `N` physical nodes that are usable now. That placement is written over *plan nodes*
//! `0..N`: `plan_nodes[q][l]` is the multiset of expert ids plan node `q` must hold in MoE
//! layer `l`. The placement is indifferent to which physical node plays which plan node, but the
//! amount of state that must move is not: a physical node that already holds expert `(l, e)`
//! keeps it for free. This module chooses the plan-node → physical-node mapping and the
//! resulting point-to-point transfers. Everything here is a pure function of its arguments.
//!
//! # Decisions
//!
//! * **Cost.** Mapping plan node `q` to physical node `p` costs the number of *distinct*
//!   `(layer, expert)` pairs that `q` needs and `p` does not hold now. Several replicas of one
//!   expert on one node are filled by one network transfer plus local (intra-node) copies, so
//!   they count once. Costs are computed with per-(node, layer) expert bitsets (`⌈E/64⌉` words)
//!   as `popcount(need & !have)`.
//! * **Greedy** ([`MappingMethod::Greedy`], paper §5.2: "repeatedly map a physical node to the
//!   plan node that gives it the fewest newly assigned experts"): physical nodes are visited in
//!   input order; each takes the still-free plan node of minimum cost, ties to the lowest plan
//!   index.
//! * **Optimal** ([`MappingMethod::Optimal`]): a minimum-total-cost perfect matching, found with
//!   the Hungarian (Kuhn–Munkres) algorithm with potentials in `O(n³)`. Its total is never above
//!   the greedy one.
//! * **Scalable** ([`MappingMethod::Scalable`]): the Hungarian algorithm up to
//!   [`HUNGARIAN_MAX_NODES`] nodes. Beyond, nodes with equal needs (plan side) or equal
//!   holdings (physical side) are interchangeable, so the optimum is found between classes as
//!   a transportation problem ([`crate::transport`]) when there are at most
//!   [`CLASS_PAIR_LIMIT`] class pairs; class members are paired in ascending index order. With
//!   more classes (each layer its own skew), a banded sparse assignment
//!   ([`banded_assignment`]): each plan node may take a physical node within
//!   [`SCALABLE_BAND`] ranks of its own or jump; the banded problem is solved exactly with an
//!   estimated price for a jump, then the few jumpers are paired exactly with the physical
//!   nodes left free. Never worse than the rank-aligned identity. (The windowed Hungarian
//!   [`windowed_assignment`] it replaced stays available.)
//! * **Transfers.** Every `(layer, expert)` newly needed at a physical node is fetched once, from
//!   a node that holds it *now* (old holdings; a node does not forward what it is itself
//!   receiving in this round). The source is the current holder with the fewest transfers
//!   assigned so far (all transfers have the same size), ties to the lowest physical index.
//!   Transfers are assigned most-constrained first — those with the fewest possible sources —
//!   which keeps the busiest sender lighter than plain input order; within the same number of
//!   holders the order is (layer, expert, destination index). The returned list is sorted by
//!   (destination index, layer, expert).
//! * **Lost experts.** If a needed expert has no surviving holder, [`map_nodes`] returns
//!   [`MigrateError::ExpertLost`] (the smallest such `(layer, expert)`); the caller then falls
//!   back to a checkpoint. [`lost_experts`] lists every such pair up front.
//! * **Shapes.** All plan nodes must have the same number of layers `L`. A physical node's
//!   `holdings` has either `L` entries or none at all (a blank node: new in a scale-out, or one
//!   whose state was lost). Every expert id must be below `experts`. Physical ids must be
//!   distinct. Violations are reported as [`MigrateError`]s, never as panics.

use std::collections::BTreeMap;
use std::fmt;
use std::ops::{Add, AddAssign, Sub, SubAssign};
use std::str::FromStr;

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::place::LayerPlacement;
use crate::transport::min_cost_transport;

/// How plan nodes are assigned to physical nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MappingMethod {
    /// Paper §5.2 greedy: physical nodes in input order each take the cheapest free plan node.
    Greedy,
    /// Minimum-total-cost perfect matching (Hungarian algorithm).
    Optimal,
    /// Plan node `q` is physical node `q` (input order): identities are fixed, only the
    /// transfers are planned — e.g. a re-layout on the same devices.
    Identity,
    /// [`MappingMethod::Optimal`] up to [`HUNGARIAN_MAX_NODES`] nodes; beyond, still optimal
    /// when the nodes fall into few classes of equal contents (aligned MRO plans do), solved
    /// as a transportation problem between classes; otherwise a banded sparse assignment
    /// around the rank-aligned pairing with a few long jumps, never worse than the rank-aligned
    /// identity mapping ([`scalable_assignment`]).
    Scalable,
}

impl fmt::Display for MappingMethod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            MappingMethod::Greedy => "greedy",
            MappingMethod::Optimal => "optimal",
            MappingMethod::Identity => "identity",
            MappingMethod::Scalable => "scalable",
        })
    }
}

/// Error from parsing a [`MappingMethod`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown mapping method {0:?} (expected \"greedy\", \"optimal\", \"identity\" or \"scalable\")"
)]
pub struct ParseMappingMethodError(pub String);

impl FromStr for MappingMethod {
    type Err = ParseMappingMethodError;

    /// Accepts `greedy` and `optimal`, ASCII case-insensitively, surrounding whitespace ignored.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim();
        if t.eq_ignore_ascii_case("greedy") {
            Ok(MappingMethod::Greedy)
        } else if t.eq_ignore_ascii_case("optimal") {
            Ok(MappingMethod::Optimal)
        } else if t.eq_ignore_ascii_case("identity") {
            Ok(MappingMethod::Identity)
        } else if t.eq_ignore_ascii_case("scalable") {
            Ok(MappingMethod::Scalable)
        } else {
            Err(ParseMappingMethodError(s.to_owned()))
        }
    }
}

/// A usable physical node and the expert states it holds now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PhysicalNode {
    /// Stable node id (distinct across the slice).
    pub id: u32,
    /// `holdings[l]`: expert ids held now in layer `l` (duplicates allowed). Either one entry
    /// per layer or empty altogether (a blank node).
    pub holdings: Vec<Vec<u32>>,
}

/// What one usable node holds, by reference: its own lists, or its row of an earlier plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Held<'a> {
    /// `[layer]` expert ids, as in [`PhysicalNode::holdings`] (empty: a blank node).
    Lists(&'a [Vec<u32>]),
    /// Exactly plan node `row` of the placements in [`Holders::Rows`], in every layer.
    Row(u32),
}

/// The usable nodes and their holdings, as the mapping reads them.
///
/// [`Holders::Rows`] spares a caller whose nodes hold what an earlier plan gave them (every
/// survivor of an in-place reconfiguration) copying that plan into one list per node and layer
/// and freeing it again: at 2,048 nodes × 58 layers, about a fifth of a replayed replan.
#[derive(Debug, Clone, Copy)]
pub enum Holders<'a> {
    Nodes(&'a [PhysicalNode]),
    /// Node `p` has id `ids[p]` and holds `held[p]`; rows index the placements `layers`.
    Rows {
        ids: &'a [u32],
        held: &'a [Held<'a>],
        layers: &'a [LayerPlacement],
    },
}

impl<'a> Holders<'a> {
    pub fn len(self) -> usize {
        match self {
            Holders::Nodes(n) => n.len(),
            Holders::Rows { ids, .. } => ids.len(),
        }
    }

    pub fn is_empty(self) -> bool {
        self.len() == 0
    }

    pub fn id(self, p: usize) -> u32 {
        match self {
            Holders::Nodes(n) => n[p].id,
            Holders::Rows { ids, .. } => ids[p],
        }
    }

    /// Layers node `p` reports: 0 for a blank node.
    pub(crate) fn layer_count(self, p: usize) -> usize {
        match self {
            Holders::Nodes(n) => n[p].holdings.len(),
            Holders::Rows { held, layers, .. } => match held[p] {
                Held::Lists(h) => h.len(),
                Held::Row(_) => layers.len(),
            },
        }
    }

    /// Node `p`'s ids in layer `l` (`None` past its layers). Rows must have been checked
    /// ([`check_rows`]).
    pub(crate) fn ids(self, p: usize, l: usize) -> Option<&'a [u32]> {
        match self {
            Holders::Nodes(n) => n[p].holdings.get(l).map(Vec::as_slice),
            Holders::Rows { held, layers, .. } => match held[p] {
                Held::Lists(h) => h.get(l).map(Vec::as_slice),
                Held::Row(r) => layers.get(l).map(|pl| pl.grid().row(r as usize)),
            },
        }
    }

    /// Whether node `p - 1` reports the same ids as node `p` in layer `l` (false for `p = 0`
    /// and when either reports nothing there): for two rows of a placement that knows its
    /// distinct rows, an index comparison ([`LayerPlacement::same_rows`]). Rows must have been
    /// checked ([`check_rows`]).
    fn same_ids_as_prev(self, p: usize, l: usize) -> bool {
        if p == 0 {
            return false;
        }
        if let Holders::Rows { held, layers, .. } = self
            && let (Held::Row(a), Held::Row(b)) = (held[p - 1], held[p])
            && let Some(placement) = layers.get(l)
        {
            return placement.same_rows(a as usize, b as usize);
        }
        matches!((self.ids(p - 1, l), self.ids(p, l)), (Some(a), Some(b)) if a == b)
    }

    /// Every node's holdings as owned [`PhysicalNode`]s, for callers that need them.
    ///
    /// # Errors
    /// [`MigrateError::RowOutOfRange`] for a row the placements do not have.
    pub fn to_physical_nodes(self) -> Result<Vec<PhysicalNode>, MigrateError> {
        check_rows(self)?;
        Ok((0..self.len())
            .map(|p| PhysicalNode {
                id: self.id(p),
                holdings: self.lists_of(p),
            })
            .collect())
    }

    /// Node `p`'s holdings as owned lists. Panics on a row the placements do not have.
    pub fn lists_of(self, p: usize) -> Vec<Vec<u32>> {
        (0..self.layer_count(p))
            .map(|l| self.ids(p, l).unwrap_or(&[]).to_vec())
            .collect()
    }
}

/// One expert state sent over the network.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Transfer {
    /// MoE layer.
    pub layer: u32,
    /// Expert id within the layer.
    pub expert: u32,
    /// Physical id of the sender (holds the expert now).
    pub src: u32,
    /// Physical id of the receiver.
    pub dst: u32,
}

/// The chosen mapping and the state movement it implies.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigrationPlan {
    /// Method used to choose the mapping.
    pub method: MappingMethod,
    /// Physical id playing each plan node.
    pub plan_to_physical: Vec<u32>,
    /// All network transfers, sorted by (destination index, layer, expert).
    pub transfers: Vec<Transfer>,
    /// Number of expert states fetched over the network (`transfers.len()`, equal to the total
    /// mapping cost).
    pub new_replicas: u64,
    /// `new_replicas × bytes_per_expert` (saturating).
    pub bytes: u64,
    /// Bytes sent by each physical node, indexed like the `physical` input.
    pub sent_bytes: Vec<u64>,
    /// Bytes received by each physical node, indexed like the `physical` input.
    pub recv_bytes: Vec<u64>,
    /// Largest entry of `sent_bytes` (0 when there are no nodes).
    pub max_sent_bytes: u64,
    /// Largest entry of `recv_bytes` (0 when there are no nodes).
    pub max_recv_bytes: u64,
}

/// Which side of the mapping a shape error refers to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum NodeSide {
    /// A plan node, identified by its plan index.
    Plan,
    /// A physical node, identified by its physical id.
    Physical,
}

impl fmt::Display for NodeSide {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            NodeSide::Plan => "plan node",
            NodeSide::Physical => "physical node",
        })
    }
}

/// Invalid input to the migration planner, or an expert with no surviving copy.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MigrateError {
    /// The plan is for a different number of nodes than are available.
    #[error("plan has {plan_nodes} nodes but {physical} physical nodes are available")]
    NodeCountMismatch { plan_nodes: usize, physical: usize },
    /// A node's layer count differs from that of plan node 0.
    #[error("{side} {node} has {found} layers, expected {expected}")]
    LayerCountMismatch {
        side: NodeSide,
        /// Plan index or physical id, per `side`.
        node: u32,
        expected: usize,
        found: usize,
    },
    /// An expert id is not below the number of experts per layer.
    #[error("expert {expert} in layer {layer} is out of range (experts per layer: {experts})")]
    ExpertOutOfRange {
        layer: u32,
        expert: u32,
        experts: usize,
    },
    /// Two physical nodes share an id.
    #[error("physical id {id} appears more than once")]
    DuplicatePhysicalId { id: u32 },
    /// A node said to hold a row of an earlier plan that has no such row ([`Holders::Rows`]),
    /// or a [`Holders::Rows`] whose ids and holdings differ in length (`row` = holdings).
    #[error("physical node {node} holds row {row} of a plan of {rows} rows")]
    RowOutOfRange { node: u32, row: u32, rows: usize },
    /// A needed expert is held by no available node; restore it from a checkpoint.
    #[error("expert {expert} of layer {layer} has no surviving holder")]
    ExpertLost { layer: u32, expert: u32 },
}

// ---------------------------------------------------------------------------------------------
// Bitsets
// ---------------------------------------------------------------------------------------------

/// Largest id range indexed directly; sparser (absurdly large) ids are rank-compressed so that
/// memory stays proportional to the input.
const DENSE_LIMIT: usize = 1 << 16;

/// Checked shape of an instance.
#[derive(Debug, Clone, Copy)]
struct Dims {
    nodes: usize,
    layers: usize,
    /// Bitset width in experts: one past the largest id present (≤ `experts`), or the number
    /// of distinct ids present when they are sparse (see [`DENSE_LIMIT`]).
    width: usize,
    /// `width.div_ceil(64)`.
    words: usize,
}

impl Dims {
    /// Words per node (all layers).
    fn stride(&self) -> usize {
        self.layers * self.words
    }
}

fn check_ids(
    layer: usize,
    ids: &[u32],
    experts: usize,
    max: &mut Option<u32>,
) -> Result<(), MigrateError> {
    let Some(&m) = ids.iter().max() else {
        return Ok(());
    };
    if m as usize >= experts {
        let &expert = ids.iter().find(|&&e| e as usize >= experts).unwrap_or(&m);
        return Err(MigrateError::ExpertOutOfRange {
            layer: layer as u32,
            expert,
            experts,
        });
    }
    *max = Some(max.map_or(m, |x| x.max(m)));
    Ok(())
}

/// The plan side of an instance: `[plan node][layer]` id lists as [`map_nodes`] takes them,
/// or a model plan's placements as they are (`[layer]`, each over all plan nodes), which spares
/// [`crate::model::replan`] a transposed copy of the whole plan.
#[derive(Clone, Copy)]
enum PlanView<'a> {
    Nodes(&'a [Vec<Vec<u32>>]),
    /// As `Nodes`, each plan node's lists by reference (nodes may share them).
    Refs(&'a [&'a [Vec<u32>]]),
    /// Every placement has `nodes` rows (checked by [`map_layers`]).
    Layers {
        layers: &'a [LayerPlacement],
        nodes: usize,
    },
}

impl<'a> PlanView<'a> {
    fn nodes(self) -> usize {
        match self {
            PlanView::Nodes(p) => p.len(),
            PlanView::Refs(p) => p.len(),
            PlanView::Layers { nodes, .. } => nodes,
        }
    }

    fn layer_count(self, q: usize) -> usize {
        match self {
            PlanView::Nodes(p) => p[q].len(),
            PlanView::Refs(p) => p[q].len(),
            PlanView::Layers { layers, .. } => layers.len(),
        }
    }

    fn ids(self, q: usize, l: usize) -> &'a [u32] {
        match self {
            PlanView::Nodes(p) => &p[q][l],
            PlanView::Refs(p) => &p[q][l],
            PlanView::Layers { layers, .. } => layers[l].grid().row(q),
        }
    }
}

/// Validates the instance; returns its shape and, when ids are sparse, the sorted distinct ids
/// (column `i` of the bitsets is expert `ids[i]`).
fn validate(
    plan: PlanView<'_>,
    physical: Holders<'_>,
    experts: usize,
) -> Result<(Dims, Option<Vec<u32>>), MigrateError> {
    let layers = check_shapes(plan, physical)?;
    let mut max = None;
    for q in 0..plan.nodes() {
        check_plan_layers(plan, q, layers)?;
        for l in 0..layers {
            check_ids(l, plan.ids(q, l), experts, &mut max)?;
        }
    }
    for p in 0..physical.len() {
        check_physical_layers(physical, p, layers)?;
        for l in 0..physical.layer_count(p) {
            check_ids(l, physical.ids(p, l).unwrap_or(&[]), experts, &mut max)?;
        }
    }
    check_distinct_ids(physical)?;
    let mut width = max.map_or(0, |m| m as usize + 1);
    let sparse = (width > DENSE_LIMIT).then(|| {
        let plan_ids =
            (0..plan.nodes()).flat_map(|q| (0..layers).flat_map(move |l| plan.ids(q, l)));
        let held = (0..physical.len())
            .flat_map(|p| (0..physical.layer_count(p)).flat_map(move |l| physical.ids(p, l)))
            .flatten();
        let mut ids: Vec<u32> = plan_ids.chain(held).copied().collect();
        ids.sort_unstable();
        ids.dedup();
        width = ids.len();
        ids
    });
    let dims = Dims {
        nodes: plan.nodes(),
        layers,
        width,
        words: width.div_ceil(64),
    };
    Ok((dims, sparse))
}

/// Node counts agree; returns the layer count (plan node 0's, 0 without nodes).
fn check_shapes(plan: PlanView<'_>, physical: Holders<'_>) -> Result<usize, MigrateError> {
    check_rows(physical)?;
    if plan.nodes() != physical.len() {
        return Err(MigrateError::NodeCountMismatch {
            plan_nodes: plan.nodes(),
            physical: physical.len(),
        });
    }
    Ok(if plan.nodes() == 0 {
        0
    } else {
        plan.layer_count(0)
    })
}

fn check_plan_layers(plan: PlanView<'_>, q: usize, layers: usize) -> Result<(), MigrateError> {
    let found = plan.layer_count(q);
    if found != layers {
        return Err(MigrateError::LayerCountMismatch {
            side: NodeSide::Plan,
            node: q as u32,
            expected: layers,
            found,
        });
    }
    Ok(())
}

fn check_physical_layers(
    physical: Holders<'_>,
    p: usize,
    layers: usize,
) -> Result<(), MigrateError> {
    let found = physical.layer_count(p);
    if found != 0 && found != layers {
        return Err(MigrateError::LayerCountMismatch {
            side: NodeSide::Physical,
            node: physical.id(p),
            expected: layers,
            found,
        });
    }
    Ok(())
}

/// The rows of a [`Holders::Rows`] exist in every placement, and its slices agree in length.
pub(crate) fn check_rows(physical: Holders<'_>) -> Result<(), MigrateError> {
    let Holders::Rows { ids, held, layers } = physical else {
        return Ok(());
    };
    let rows = layers.iter().map(LayerPlacement::nodes).min().unwrap_or(0);
    if ids.len() != held.len() {
        return Err(MigrateError::RowOutOfRange {
            node: ids.len() as u32,
            row: held.len() as u32,
            rows,
        });
    }
    for (&node, h) in ids.iter().zip(held) {
        if let Held::Row(row) = *h
            && row as usize >= rows
        {
            return Err(MigrateError::RowOutOfRange { node, row, rows });
        }
    }
    Ok(())
}

fn check_distinct_ids(physical: Holders<'_>) -> Result<(), MigrateError> {
    let mut ids: Vec<u32> = (0..physical.len()).map(|p| physical.id(p)).collect();
    ids.sort_unstable();
    if let Some(w) = ids.windows(2).find(|w| w[0] == w[1]) {
        return Err(MigrateError::DuplicatePhysicalId { id: w[0] });
    }
    Ok(())
}

/// Flat bitsets, node-major: word `w` of layer `l` of node `i` is at `i*stride + l*words + w`.
/// `ids(i, l)` must be validated ids for every `l < layers(i) ≤ dims.layers`.
fn build_bits<'a>(
    dims: &Dims,
    sparse: Option<&[u32]>,
    layers: impl Fn(usize) -> usize,
    ids: impl Fn(usize, usize) -> &'a [u32],
) -> Vec<u64> {
    let stride = dims.stride();
    let mut bits = vec![0u64; dims.nodes * stride];
    for i in 0..dims.nodes {
        let node = &mut bits[i * stride..(i + 1) * stride];
        for l in 0..layers(i) {
            let layer = &mut node[l * dims.words..(l + 1) * dims.words];
            for &e in ids(i, l) {
                let col = sparse.map_or(e as usize, |s| s.binary_search(&e).unwrap_or(0));
                layer[col / 64] |= 1u64 << (col % 64);
            }
        }
    }
    bits
}

/// Sets the bits of one layer's ids, failing on the first id out of range.
///
/// Bits are gathered in a register while consecutive ids share a word (plan rows are sorted,
/// so that is most of them): or-ing each id into memory would chain every update through a
/// store and a reload of the same word.
fn set_checked(
    layer: usize,
    ids: &[u32],
    experts: usize,
    words: &mut [u64],
) -> Result<(), MigrateError> {
    let mut word = usize::MAX;
    let mut acc = 0u64;
    for &e in ids {
        if e as usize >= experts {
            return Err(MigrateError::ExpertOutOfRange {
                layer: layer as u32,
                expert: e,
                experts,
            });
        }
        let w = e as usize / 64;
        if w != word {
            if word != usize::MAX {
                words[word] |= acc;
            }
            word = w;
            acc = 0;
        }
        acc |= 1u64 << (e % 64);
    }
    if word != usize::MAX {
        words[word] |= acc;
    }
    Ok(())
}

/// [`set_checked`] of layer `l`'s `ids` into the node bitsets `bits` of the node at `base`
/// (words `base + l*words..`, zero before), or a copy of the previous node's words when
/// `same_as_prev` (its ids, set already and so valid, are the same list): MRO plans repeat a
/// node's row over runs of nodes (about 9 in 10 rows at 2,048 nodes), and so do holdings
/// reported from such a plan.
#[allow(clippy::too_many_arguments)]
fn set_or_copy(
    l: usize,
    ids: &[u32],
    same_as_prev: bool,
    experts: usize,
    bits: &mut [u64],
    base: usize,
    stride: usize,
    words: usize,
) -> Result<(), MigrateError> {
    let at = base + l * words;
    if same_as_prev {
        bits.copy_within(at - stride..at - stride + words, at);
        Ok(())
    } else {
        set_checked(l, ids, experts, &mut bits[at..at + words])
    }
}

struct Instance {
    dims: Dims,
    /// Sorted distinct ids when rank-compressed, else `None` (column = id).
    sparse: Option<Vec<u32>>,
    need: Vec<u64>,
    have: Vec<u64>,
}

impl Instance {
    fn new(
        plan: PlanView<'_>,
        physical: Holders<'_>,
        experts: usize,
    ) -> Result<Self, MigrateError> {
        if experts <= DENSE_LIMIT {
            return Self::new_dense(plan, physical, experts);
        }
        let (dims, sparse) = validate(plan, physical, experts)?;
        let need = build_bits(
            &dims,
            sparse.as_deref(),
            |q| plan.layer_count(q),
            |q, l| plan.ids(q, l),
        );
        let have = build_bits(
            &dims,
            sparse.as_deref(),
            |p| physical.layer_count(p),
            |p, l| physical.ids(p, l).unwrap_or(&[]),
        );
        Ok(Instance {
            dims,
            sparse,
            need,
            have,
        })
    }

    /// [`Instance::new`] when every id fits a dense column (`experts ≤ DENSE_LIMIT`): one pass
    /// that checks and sets bits together, in the order [`validate`] reports errors. The
    /// bitsets are `experts` wide rather than one past the largest id; keys keep their
    /// (layer, expert) order, so every result is the same.
    fn new_dense(
        plan: PlanView<'_>,
        physical: Holders<'_>,
        experts: usize,
    ) -> Result<Self, MigrateError> {
        let layers = check_shapes(plan, physical)?;
        let dims = Dims {
            nodes: plan.nodes(),
            layers,
            width: experts,
            words: experts.div_ceil(64),
        };
        let (stride, words) = (dims.stride(), dims.words);
        // The two sides are independent: built at the same time (a plan side's error is still
        // the one reported when both fail).
        let build_need = || -> Result<Vec<u64>, MigrateError> {
            let mut need = vec![0u64; dims.nodes * stride];
            let node_order = |need: &mut [u64]| -> Result<(), MigrateError> {
                for q in 0..dims.nodes {
                    check_plan_layers(plan, q, layers)?;
                    let bits = &mut need[q * stride..(q + 1) * stride];
                    for l in 0..layers {
                        let words = &mut bits[l * words..(l + 1) * words];
                        set_checked(l, plan.ids(q, l), experts, words)?;
                    }
                }
                Ok(())
            };
            match plan {
                PlanView::Nodes(_) | PlanView::Refs(_) => node_order(&mut need)?,
                PlanView::Layers {
                    layers: placements, ..
                } => {
                    // Each placement's rows lie together in memory, so read one layer at a time for
                    // a block of nodes whose bitsets stay in cache, rather than 58 rows far apart
                    // for every node. On an error, redo it in node order to report the same first
                    // error as `map_nodes`.
                    let blocked = (0..dims.nodes).step_by(64).try_for_each(|q0| {
                        let block = q0..(q0 + 64).min(dims.nodes);
                        placements.iter().enumerate().try_for_each(|(l, p)| {
                            let grid = p.grid();
                            block.clone().try_for_each(|q| {
                                set_or_copy(
                                    l,
                                    &grid[q],
                                    q > 0 && p.same_rows(q - 1, q),
                                    experts,
                                    &mut need,
                                    q * stride,
                                    stride,
                                    words,
                                )
                            })
                        })
                    });
                    if blocked.is_err() {
                        node_order(&mut need)?;
                    }
                }
            }
            Ok(need)
        };
        let build_have = || -> Result<Vec<u64>, MigrateError> {
            let mut have = vec![0u64; dims.nodes * stride];
            let node_order = |have: &mut [u64]| -> Result<(), MigrateError> {
                for p in 0..physical.len() {
                    check_physical_layers(physical, p, layers)?;
                    let bits = &mut have[p * stride..(p + 1) * stride];
                    for l in 0..physical.layer_count(p) {
                        let ids = physical.ids(p, l).unwrap_or(&[]);
                        set_checked(l, ids, experts, &mut bits[l * words..(l + 1) * words])?;
                    }
                }
                Ok(())
            };
            // Reported holdings are one small vector per node and layer, typically allocated layer
            // by layer (the members' reports are built from the previous plan's placements), so
            // read one layer of a block of nodes at a time, as for the plan side: node by node,
            // every id list was a cache miss. On an error, redo it in node order to report the
            // same first error.
            let blocked = (0..dims.nodes).step_by(64).try_for_each(|p0| {
                let block = p0..(p0 + 64).min(dims.nodes);
                block
                    .clone()
                    .try_for_each(|p| check_physical_layers(physical, p, layers))?;
                (0..layers).try_for_each(|l| {
                    block.clone().try_for_each(|p| {
                        let Some(ids) = physical.ids(p, l) else {
                            return Ok(());
                        };
                        let same = physical.same_ids_as_prev(p, l);
                        set_or_copy(l, ids, same, experts, &mut have, p * stride, stride, words)
                    })
                })
            });
            if blocked.is_err() {
                have.fill(0);
                node_order(&mut have)?;
            }
            Ok(have)
        };
        let (need, have) = rayon::join(build_need, build_have);
        let (need, have) = (need?, have?);
        check_distinct_ids(physical)?;
        Ok(Instance {
            dims,
            sparse: None,
            need,
            have,
        })
    }

    /// `(layer, expert)` of key `layer*width + column`.
    fn pair(&self, key: usize) -> (u32, u32) {
        let col = key % self.dims.width;
        let expert = self.sparse.as_ref().map_or(col as u32, |s| s[col]);
        ((key / self.dims.width) as u32, expert)
    }

    fn node<'b>(&self, bits: &'b [u64], i: usize) -> &'b [u64] {
        let s = self.dims.stride();
        &bits[i * s..(i + 1) * s]
    }

    /// `cost[q][p]` for one plan node and one physical node.
    fn pair_cost(&self, q: usize, p: usize) -> u64 {
        and_not_ones(self.node(&self.need, q), self.node(&self.have, p))
    }

    /// The [`MappingMethod::Scalable`] assignment: exact Hungarian up to
    /// [`HUNGARIAN_MAX_NODES`]; beyond, exact through classes of equal nodes when there are few
    /// ([`Instance::by_classes`]), else the banded sparse assignment with half-width `band`.
    fn scalable(&self, band: usize) -> Vec<usize> {
        if self.dims.nodes <= HUNGARIAN_MAX_NODES {
            return min_cost_assignment(&self.cost_matrix());
        }
        self.by_classes(CLASS_PAIR_LIMIT)
            .unwrap_or_else(|| self.banded(band))
    }

    /// Optimal assignment found between classes of interchangeable nodes, or `None` when the
    /// number of plan classes times physical classes exceeds `max_class_pairs`.
    ///
    /// The cost of pairing plan node `q` with physical node `p` depends only on `q`'s needed
    /// set and `p`'s held set, so plan nodes with equal needs are interchangeable, and so are
    /// physical nodes with equal holdings. An aligned MRO plan has few such classes: block nodes
    /// of a group are equal, and the round-robin leftovers make consecutive nodes equal between
    /// the points where one expert's run ends (measured: about 250 classes of each kind at
    /// 2,048 and at 16,384 nodes with E = 256, c = 32). The assignment problem then becomes a
    /// transportation problem between classes ([`min_cost_transport`]), whose integral optimum
    /// is an optimal assignment; any pairing of members within a class pair costs the same.
    /// Members are paired in ascending index order, so the result is deterministic.
    fn by_classes(&self, max_class_pairs: usize) -> Option<Vec<usize>> {
        let n = self.dims.nodes;
        let stride = self.dims.stride();
        // Both sides, and the class-pair costs (about 250 × 250 pairs of whole-node bitsets at
        // 2,048 nodes), are independent work: done in parallel, with the same result.
        let (plan, phys) = rayon::join(
            || NodeClasses::of(&self.need, stride, n),
            || NodeClasses::of(&self.have, stride, n),
        );
        if plan.count().saturating_mul(phys.count()) > max_class_pairs {
            return None;
        }
        let phys_reps: Vec<usize> = phys.reps().collect();
        let plan_reps: Vec<usize> = plan.reps().collect();
        let cost: Vec<Vec<u64>> = plan_reps
            .par_iter()
            .map(|&q| phys_reps.iter().map(|&p| self.pair_cost(q, p)).collect())
            .collect();
        // Costs are at most layers · width ≤ the size of the bitsets, far below the solver's
        // limit, and both sides hold `n` nodes.
        let flow = min_cost_transport(&cost, &plan.sizes(), &phys.sizes())
            .expect("balanced class sizes and small costs");
        let mut next: Vec<usize> = phys.start.iter().map(|&s| s as usize).collect();
        let mut assign = vec![0usize; n];
        for (i, row) in flow.iter().enumerate() {
            let mut members = plan.members(i).iter();
            for (j, &units) in row.iter().enumerate() {
                for _ in 0..units {
                    let q = *members.next().expect("flow out of a class equals its size");
                    assign[q as usize] = phys.order[next[j]] as usize;
                    next[j] += 1;
                }
            }
        }
        Some(assign)
    }

    /// Windowed Hungarian (see [`windowed_assignment`]). Plan node `q` and physical node `q`
    /// (input order) share a rank; windows of `w` consecutive ranks are solved exactly, then
    /// windows shifted by `w/2` re-solve each window's plan nodes over the physical nodes they
    /// hold, which repairs pairings cut by the first window boundaries. Every step is optimal
    /// over a set that contains the current pairing, so the cost never increases from the
    /// rank-aligned identity.
    fn windowed(&self, w: usize) -> Vec<usize> {
        let n = self.dims.nodes;
        let w = w.max(2);
        let mut assign: Vec<usize> = (0..n).collect();
        for offset in [0, w / 2] {
            let mut windows = Vec::new();
            let mut lo = 0;
            let mut hi = offset.min(n);
            if hi == 0 {
                hi = w.min(n);
            }
            while lo < n {
                windows.push(lo..hi);
                lo = hi;
                hi = (hi + w).min(n);
            }
            // The windows of a pass are disjoint ranges of plan nodes, each re-pairing only the
            // physical nodes its own plan nodes hold, so they are solved independently (in
            // parallel) and applied afterwards: the same result as one after the other.
            let repaired: Vec<Option<Vec<usize>>> = windows
                .par_iter()
                .map(|qs| {
                    let ps: Vec<usize> = qs.clone().map(|q| assign[q]).collect();
                    let cost: Vec<Vec<u64>> = qs
                        .clone()
                        .map(|q| ps.iter().map(|&p| self.pair_cost(q, p)).collect())
                        .collect();
                    let before: u64 = (0..ps.len()).map(|i| cost[i][i]).sum();
                    let sol = min_cost_assignment(&cost);
                    let after = assignment_cost(&cost, &sol);
                    // Keep the old pairing on ties so that the result is stable.
                    (after < before).then(|| sol.iter().map(|&j| ps[j]).collect())
                })
                .collect();
            for (qs, new) in windows.iter().zip(repaired) {
                if let Some(ps) = new {
                    assign[qs.clone()].copy_from_slice(&ps);
                }
            }
        }
        assign
    }

    /// Banded sparse assignment (see [`banded_assignment`]): plan node `q` may take a physical
    /// node within `band` ranks of `q`, or *jump* — be left for a second round. Jumping costs
    /// an estimate of what `q` pays at a distant node (its mean cost over sampled distant
    /// ranks), and a physical node left free is credited with how much cheaper than average
    /// it is to distant plan nodes. The banded problem is solved exactly
    /// ([`sparse_assignment`]); the jumpers are then paired with the free physical nodes by
    /// the Hungarian algorithm on their true costs (in index order when there are more than
    /// [`HUNGARIAN_MAX_NODES`] of them). The result is kept only if it beats the
    /// rank-aligned identity.
    fn banded(&self, band: usize) -> Vec<usize> {
        let n = self.dims.nodes;
        let identity: Vec<usize> = (0..n).collect();
        if n == 0 {
            return identity;
        }
        // Every cost is at most the bits of a node; the sparse solver takes them as `u32`.
        if self.dims.stride() * 64 > (u32::MAX / 4) as usize {
            return self.windowed(SCALABLE_WINDOW);
        }
        let band = band.min(n - 1);
        let width = 2 * band + 1;
        let lo = |q: usize| q.saturating_sub(band);
        let hi = |q: usize| (q + band + 1).min(n);
        // Samples: evenly spaced ranks.
        let samples: Vec<usize> = (0..JUMP_SAMPLES)
            .map(|s| (2 * s + 1) * n / (2 * JUMP_SAMPLES))
            .collect();
        let far = |a: usize, b: usize| a.abs_diff(b) > band;
        let mean = |it: &mut dyn Iterator<Item = u64>| -> Option<i64> {
            let (sum, k) = it.fold((0u64, 0u64), |(s, k), c| (s + c, k + 1));
            (k > 0).then(|| (sum / k) as i64)
        };
        // Band costs, row by row (`u32::MAX` off the ends), and the jump estimates.
        let rows: Vec<(Vec<u32>, Option<i64>, Option<i64>)> = (0..n)
            .into_par_iter()
            .map(|q| {
                let mut row = vec![u32::MAX; width];
                for p in lo(q)..hi(q) {
                    row[p + band - q] = self.pair_cost(q, p) as u32;
                }
                let jump = mean(
                    &mut samples
                        .iter()
                        .filter(|&&p| far(q, p))
                        .map(|&p| self.pair_cost(q, p)),
                );
                // Column side: physical node `q` against distant sampled plan nodes.
                let credit = mean(
                    &mut samples
                        .iter()
                        .filter(|&&r| far(q, r))
                        .map(|&r| self.pair_cost(r, q)),
                );
                (row, jump, credit)
            })
            .collect();
        let credits: Vec<i64> = rows.iter().filter_map(|r| r.2).collect();
        let avg = if credits.is_empty() {
            0
        } else {
            credits.iter().sum::<i64>() / credits.len() as i64
        };
        // `b[p]`: what leaving physical node `p` free is estimated to cost (its distant cost
        // above average), charged to the pairings that use it instead; `k` keeps costs ≥ 0.
        let b: Vec<i64> = rows.iter().map(|r| r.2.map_or(0, |c| c - avg)).collect();
        let k = b.iter().copied().max().unwrap_or(0).max(0);
        let mut start = Vec::with_capacity(n + 1);
        let mut adj: Vec<(u32, u32)> = Vec::with_capacity(n * (width + 1));
        start.push(0);
        for (q, (row, jump, _)) in rows.iter().enumerate() {
            for p in lo(q)..hi(q) {
                let c = i64::from(row[p + band - q]) - b[p] + k;
                adj.push((p as u32, c as u32));
            }
            if let Some(j) = jump {
                adj.push(((n + q) as u32, (j + k) as u32));
            }
            start.push(adj.len());
        }
        let Some(sol) = sparse_assignment(&start, &adj, 2 * n) else {
            return identity;
        };
        let mut assign = sol;
        let jumpers: Vec<usize> = (0..n).filter(|&q| assign[q] >= n).collect();
        if !jumpers.is_empty() {
            let mut taken = vec![false; n];
            for &p in assign.iter().filter(|&&p| p < n) {
                taken[p] = true;
            }
            let free: Vec<usize> = (0..n).filter(|&p| !taken[p]).collect();
            let pick: Vec<usize> = if jumpers.len() <= HUNGARIAN_MAX_NODES {
                let cost: Vec<Vec<u64>> = jumpers
                    .par_iter()
                    .map(|&q| free.iter().map(|&p| self.pair_cost(q, p)).collect())
                    .collect();
                min_cost_assignment(&cost)
            } else {
                (0..jumpers.len()).collect()
            };
            for (&q, j) in jumpers.iter().zip(pick) {
                assign[q] = free[j];
            }
        }
        let total = |a: &[usize]| -> u64 {
            a.par_iter()
                .enumerate()
                .map(|(q, &p)| self.pair_cost(q, p))
                .sum()
        };
        if total(&assign) < total(&identity) {
            assign
        } else {
            identity
        }
    }

    fn cost_matrix(&self) -> Vec<Vec<u64>> {
        let n = self.dims.nodes;
        (0..n)
            .map(|q| {
                let need = self.node(&self.need, q);
                (0..n)
                    .map(|p| and_not_ones(need, self.node(&self.have, p)))
                    .collect()
            })
            .collect()
    }
}

/// `Σ popcount(a[i] & !b[i])`: the pair cost, evaluated for millions of node pairs per
/// windowed mapping (232 words each at E = 256, L = 58). The portable build targets x86-64
/// without `popcnt`, whose software popcount made this the largest part of a replan, so the
/// same loop is also compiled for CPUs with vector or scalar popcount and picked at run time.
/// Every variant computes the same integer.
fn and_not_ones(a: &[u64], b: &[u64]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512vpopcntdq")
            && std::arch::is_x86_feature_detected!("avx512f")
        {
            // SAFETY: the CPU has the features the function is compiled for (checked above).
            return unsafe { and_not_ones_avx512(a, b) };
        }
        if std::arch::is_x86_feature_detected!("popcnt") {
            // SAFETY: as above.
            return unsafe { and_not_ones_popcnt(a, b) };
        }
    }
    and_not_ones_portable(a, b)
}

#[inline(always)]
fn and_not_ones_portable(a: &[u64], b: &[u64]) -> u64 {
    a.iter()
        .zip(b)
        .map(|(&x, &y)| u64::from((x & !y).count_ones()))
        .sum()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vpopcntdq")]
fn and_not_ones_avx512(a: &[u64], b: &[u64]) -> u64 {
    and_not_ones_portable(a, b)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "popcnt")]
fn and_not_ones_popcnt(a: &[u64], b: &[u64]) -> u64 {
    and_not_ones_portable(a, b)
}

/// Nodes grouped by equal bitsets. Class `k` is numbered by its first member, so class 0
/// holds node 0; `order[start[k]..start[k + 1]]` are its members, ascending.
struct NodeClasses {
    start: Vec<u32>,
    order: Vec<u32>,
}

impl NodeClasses {
    /// Groups `n` nodes of `stride` words each. Nodes are sorted by a hash of their words and
    /// only nodes with equal hashes are compared word by word, so this is `O(n·stride)` plus a
    /// sort of `n` hashes.
    fn of(bits: &[u64], stride: usize, n: usize) -> Self {
        let words = |i: usize| &bits[i * stride..(i + 1) * stride];
        // FNV-1a over words: cheap, deterministic, and a collision only costs a comparison.
        let hash = |i: usize| {
            words(i).iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &w| {
                (h ^ w).wrapping_mul(0x0100_0000_01b3).rotate_left(29)
            })
        };
        let mut by_hash: Vec<(u64, u32)> = (0..n)
            .into_par_iter()
            .map(|i| (hash(i), i as u32))
            .collect();
        by_hash.sort_unstable();
        // Provisional class of each node: the first node (in index order) with equal words.
        let mut rep = vec![0u32; n];
        let mut run = 0;
        while run < n {
            let h = by_hash[run].0;
            let end = run + by_hash[run..].iter().take_while(|x| x.0 == h).count();
            let mut seen: Vec<u32> = Vec::new();
            for &(_, i) in &by_hash[run..end] {
                let i = i as usize;
                match seen.iter().find(|&&r| words(r as usize) == words(i)) {
                    Some(&r) => rep[i] = r,
                    None => {
                        seen.push(i as u32);
                        rep[i] = i as u32;
                    }
                }
            }
            run = end;
        }
        // Number classes by first member; counting sort of the nodes by class.
        let mut class_of_rep = vec![u32::MAX; n];
        let mut classes = 0u32;
        let class: Vec<u32> = (0..n)
            .map(|i| {
                let r = rep[i] as usize;
                if class_of_rep[r] == u32::MAX {
                    class_of_rep[r] = classes;
                    classes += 1;
                }
                class_of_rep[r]
            })
            .collect();
        let mut start = vec![0u32; classes as usize + 1];
        for &k in &class {
            start[k as usize + 1] += 1;
        }
        for k in 0..classes as usize {
            start[k + 1] += start[k];
        }
        let mut fill = start.clone();
        let mut order = vec![0u32; n];
        for (i, &k) in class.iter().enumerate() {
            order[fill[k as usize] as usize] = i as u32;
            fill[k as usize] += 1;
        }
        NodeClasses { start, order }
    }

    fn count(&self) -> usize {
        self.start.len() - 1
    }

    fn members(&self, k: usize) -> &[u32] {
        &self.order[self.start[k] as usize..self.start[k + 1] as usize]
    }

    /// First (lowest-index) member of each class.
    fn reps(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.count()).map(|k| self.order[self.start[k] as usize] as usize)
    }

    fn sizes(&self) -> Vec<u64> {
        self.start
            .windows(2)
            .map(|w| u64::from(w[1] - w[0]))
            .collect()
    }
}

/// Largest node count [`MappingMethod::Scalable`] solves with the exact Hungarian algorithm
/// (`O(N³)`: about 20 M steps here, a few ms).
pub const HUNGARIAN_MAX_NODES: usize = 256;

/// Most (plan classes × physical classes) pairs [`MappingMethod::Scalable`] solves exactly
/// through classes above [`HUNGARIAN_MAX_NODES`] (512 × 512): the class cost matrix takes
/// that many bitset comparisons and the transportation solver's shortest paths scan it.
pub const CLASS_PAIR_LIMIT: usize = 1 << 18;

/// Window of the windowed Hungarian ([`windowed_assignment`]), which was
/// [`MappingMethod::Scalable`]'s fallback before [`banded_assignment`].
pub const SCALABLE_WINDOW: usize = 128;

/// Half-width of the rank band of [`banded_assignment`] under [`MappingMethod::Scalable`].
pub const SCALABLE_BAND: usize = 32;

/// Distant ranks sampled to price a jump in [`banded_assignment`].
const JUMP_SAMPLES: usize = 32;

/// The instance of `[plan node][layer]` lists and owned physical nodes.
fn node_instance(
    plan_nodes: &[Vec<Vec<u32>>],
    physical: &[PhysicalNode],
    experts: usize,
) -> Result<Instance, MigrateError> {
    Instance::new(
        PlanView::Nodes(plan_nodes),
        Holders::Nodes(physical),
        experts,
    )
}

/// The [`MappingMethod::Scalable`] assignment on its own: the plan-node → physical-index
/// pairing. Exact up to [`HUNGARIAN_MAX_NODES`] nodes (Hungarian), and beyond whenever the
/// plan nodes and the physical nodes fall into few classes of equal contents
/// ([`class_assignment`] with [`CLASS_PAIR_LIMIT`]), which aligned MRO plans do. Otherwise
/// [`banded_assignment`] with half-width `band` ([`SCALABLE_BAND`] under
/// [`MappingMethod::Scalable`]).
pub fn scalable_assignment(
    plan_nodes: &[Vec<Vec<u32>>],
    physical: &[PhysicalNode],
    experts: usize,
    band: usize,
) -> Result<Vec<usize>, MigrateError> {
    Ok(node_instance(plan_nodes, physical, experts)?.scalable(band))
}

/// An optimal assignment (minimum total cost, like [`min_cost_assignment`] on
/// [`cost_matrix`]) found between classes of interchangeable nodes: plan nodes that need the
/// same `(layer, expert)` pairs, and physical nodes that hold the same ones. `Ok(None)` when
/// the plan classes times the physical classes exceed `max_class_pairs`. Any size; the cost is
/// `O(N·stride)` to find the classes plus the class-level transportation problem.
pub fn class_assignment(
    plan_nodes: &[Vec<Vec<u32>>],
    physical: &[PhysicalNode],
    experts: usize,
    max_class_pairs: usize,
) -> Result<Option<Vec<usize>>, MigrateError> {
    Ok(node_instance(plan_nodes, physical, experts)?.by_classes(max_class_pairs))
}

/// The windowed Hungarian on its own, at any size (before class compression it was
/// [`MappingMethod::Scalable`] above [`HUNGARIAN_MAX_NODES`]): plan node `q` starts paired with
/// physical node `q`, so list the physical nodes in their previous plan order (what
/// [`crate::model::ModelPlan::physical_nodes`] returns, minus the failed ones): under Lazarus'
/// aligned MRO (arXiv 2407.04656 §4.1) a replan on one node fewer shifts block boundaries by a
/// few ranks, so good partners sit at nearby ranks. Windows of `window` ranks are solved
/// exactly, then windows offset by half of it. `O(N·window·(stride + window))` time,
/// `O(N·stride)` memory; the total never exceeds the identity pairing's.
pub fn windowed_assignment(
    plan_nodes: &[Vec<Vec<u32>>],
    physical: &[PhysicalNode],
    experts: usize,
    window: usize,
) -> Result<Vec<usize>, MigrateError> {
    Ok(node_instance(plan_nodes, physical, experts)?.windowed(window))
}

/// The banded sparse assignment on its own, at any size: plan node `q` may take a physical
/// node within `band` ranks of `q` (list the physical nodes in their previous plan order, as
/// for [`windowed_assignment`]) or jump to a distant one; the banded problem is solved exactly
/// with an estimated price for jumping, then the jumpers are paired exactly with the physical
/// nodes left free. Never worse than the rank-aligned identity.
pub fn banded_assignment(
    plan_nodes: &[Vec<Vec<u32>>],
    physical: &[PhysicalNode],
    experts: usize,
    band: usize,
) -> Result<Vec<usize>, MigrateError> {
    Ok(node_instance(plan_nodes, physical, experts)?.banded(band))
}

/// Cost of every (plan node, physical node) pairing: `cost[q][p]` = number of distinct
/// `(layer, expert)` pairs plan node `q` needs that physical node `p` (by index in `physical`)
/// does not hold now.
///
/// # Errors
/// Shape errors as described in the module docs; never [`MigrateError::ExpertLost`].
pub fn cost_matrix(
    plan_nodes: &[Vec<Vec<u32>>],
    physical: &[PhysicalNode],
    experts: usize,
) -> Result<Vec<Vec<u64>>, MigrateError> {
    Ok(node_instance(plan_nodes, physical, experts)?.cost_matrix())
}

/// Total cost of an assignment (`assignment[q]` = column of row `q`), saturating.
///
/// # Panics
/// If an assigned column is out of range for its row.
pub fn assignment_cost(cost: &[Vec<u64>], assignment: &[usize]) -> u64 {
    cost.iter()
        .zip(assignment)
        .fold(0u64, |acc, (row, &p)| acc.saturating_add(row[p]))
}

/// Every `(layer, expert)` with `layer < layers`, `expert < experts` held by none of `survivors`.
/// Ids or layers out of range in the holdings are ignored. Sorted by (layer, expert).
pub fn lost_experts(survivors: &[PhysicalNode], layers: usize, experts: usize) -> Vec<(u32, u32)> {
    lost_experts_of(
        survivors.iter().map(|n| n.holdings.as_slice()),
        layers,
        experts,
    )
}

/// [`lost_experts`] of holdings given by reference (`[layer]` = expert ids of one node), for
/// callers that keep them elsewhere than in [`PhysicalNode`]s.
pub fn lost_experts_of<'a>(
    holdings: impl IntoIterator<Item = &'a [Vec<u32>]>,
    layers: usize,
    experts: usize,
) -> Vec<(u32, u32)> {
    let nodes: Vec<&[Vec<u32>]> = holdings.into_iter().collect();
    lost_in(
        nodes.len(),
        |p, l| nodes[p].get(l).map(Vec::as_slice),
        layers,
        experts,
    )
}

/// [`lost_experts`] of [`Holders`] (rows out of range hold nothing).
pub fn lost_experts_held(holders: Holders<'_>, layers: usize, experts: usize) -> Vec<(u32, u32)> {
    let Holders::Rows {
        held,
        layers: placements,
        ..
    } = holders
    else {
        return lost_in(holders.len(), |p, l| holders.ids(p, l), layers, experts);
    };
    let rows = placements
        .iter()
        .map(LayerPlacement::nodes)
        .min()
        .unwrap_or(0);
    let valid = |h: &Held<'_>| !matches!(*h, Held::Row(r) if r as usize >= rows);
    // A plan's rows lie together layer by layer, so the layers are independent passes over
    // contiguous memory, in parallel: this check precedes every in-place replan.
    let held_per_layer: Vec<Vec<bool>> = (0..layers)
        .into_par_iter()
        .map(|l| {
            let mut row = vec![false; experts];
            // The previous list set, and its plan row when it was one.
            let mut prev: Option<(Option<u32>, &[u32])> = None;
            let placement = placements.get(l);
            for h in held.iter().filter(|h| valid(h)) {
                let (plan_row, ids) = match *h {
                    Held::Lists(lists) => (None, lists.get(l).map(Vec::as_slice)),
                    Held::Row(r) => (Some(r), placement.map(|p| p.grid().row(r as usize))),
                };
                let Some(ids) = ids else { continue };
                // Setting a list equal to the previous one again changes nothing. Two rows of
                // the plan compare by index when the placement knows its distinct rows.
                let same = match (prev, plan_row, placement) {
                    (Some((Some(a), _)), Some(b), Some(p)) => p.same_rows(a as usize, b as usize),
                    (Some((_, before)), _, _) => before == ids,
                    (None, _, _) => false,
                };
                if same {
                    continue;
                }
                prev = Some((plan_row, ids));
                for &e in ids {
                    if let Some(x) = row.get_mut(e as usize) {
                        *x = true;
                    }
                }
            }
            row
        })
        .collect();
    held_per_layer
        .iter()
        .enumerate()
        .flat_map(|(l, row)| {
            row.iter()
                .enumerate()
                .filter(|(_, h)| !**h)
                .map(move |(e, _)| (l as u32, e as u32))
        })
        .collect()
}

fn lost_in<'a>(
    nodes: usize,
    ids_of: impl Fn(usize, usize) -> Option<&'a [u32]>,
    layers: usize,
    experts: usize,
) -> Vec<(u32, u32)> {
    let mut held = vec![false; layers * experts];
    // One layer of a block of nodes at a time: the id lists are typically allocated layer by
    // layer (see `Instance::new_dense`), so node by node each one was a cache miss.
    for block in (0..nodes).step_by(64) {
        for l in 0..layers {
            let row = &mut held[l * experts..(l + 1) * experts];
            let mut prev: Option<&[u32]> = None;
            for ids in (block..(block + 64).min(nodes)).filter_map(|p| ids_of(p, l)) {
                // Setting a list equal to the previous one again changes nothing.
                if prev == Some(ids) {
                    continue;
                }
                prev = Some(ids);
                for &e in ids {
                    if let Some(h) = row.get_mut(e as usize) {
                        *h = true;
                    }
                }
            }
        }
    }
    held.iter()
        .enumerate()
        .filter(|(_, h)| !**h)
        .map(|(i, _)| ((i / experts) as u32, (i % experts) as u32))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Assignment
// ---------------------------------------------------------------------------------------------

/// Signed accumulator for the Hungarian algorithm.
trait Acc: Copy + Ord + Add<Output = Self> + Sub<Output = Self> + AddAssign + SubAssign {
    const ZERO: Self;
    const INF: Self;
    fn from_u64(x: u64) -> Self;
}

impl Acc for i64 {
    const ZERO: Self = 0;
    const INF: Self = i64::MAX / 2;
    fn from_u64(x: u64) -> Self {
        x as i64
    }
}

impl Acc for i128 {
    const ZERO: Self = 0;
    const INF: Self = i128::MAX / 2;
    fn from_u64(x: u64) -> Self {
        i128::from(x)
    }
}

/// Shortest-augmenting-path Hungarian algorithm with row/column potentials (rows ≤ columns).
/// Returns the column of each row.
///
/// The same steps, comparisons and tie-breaks as [`hungarian_reference`], so the same
/// assignment (tested on random matrices with many ties), with two savings that integer
/// arithmetic makes exact: a step scans only the free columns (kept in ascending order), and
/// the potentials of the used columns and the slacks of the free ones are shifted lazily by
/// the deltas summed over the phase (`shift`) instead of in a pass over every column per step.
fn hungarian<T: Acc>(cost: &[Vec<u64>], m: usize) -> Vec<usize> {
    let n = cost.len();
    let mut u = vec![T::ZERO; n + 1];
    let mut v = vec![T::ZERO; m + 1];
    let mut p = vec![0usize; m + 1];
    let mut way = vec![0usize; m + 1];
    // `slack[j] - shift` is the reference's `minv[j]` for a free column.
    let mut slack = vec![T::INF; m + 1];
    let mut free: Vec<usize> = Vec::with_capacity(m);
    // Columns used in this phase with the shift when they were taken.
    let mut used: Vec<(usize, T)> = Vec::with_capacity(m + 1);
    for i in 1..=n {
        p[0] = i;
        let mut j0 = 0usize;
        slack.fill(T::INF);
        free.clear();
        free.extend(1..=m);
        used.clear();
        let mut shift = T::ZERO;
        loop {
            used.push((j0, shift));
            let i0 = p[j0];
            let row = &cost[i0 - 1];
            // Every row is matched to one column at most, so its potential has not moved yet
            // in this phase.
            let ui0 = u[i0];
            let mut best = T::INF + shift;
            let (mut j1, mut k1) = (0usize, 0usize);
            for (k, &j) in free.iter().enumerate() {
                let cur = T::from_u64(row[j - 1]) - ui0 - v[j] + shift;
                if cur < slack[j] {
                    slack[j] = cur;
                    way[j] = j0;
                }
                if slack[j] < best {
                    best = slack[j];
                    j1 = j;
                    k1 = k;
                }
            }
            // The step's delta is `best - shift`; the new shift is the old one plus it.
            shift = best;
            free.remove(k1);
            j0 = j1;
            if p[j0] == 0 {
                break;
            }
        }
        for &(j, taken) in &used {
            let d = shift - taken;
            u[p[j]] += d;
            v[j] -= d;
        }
        loop {
            let j1 = way[j0];
            p[j0] = p[j1];
            j0 = j1;
            if j0 == 0 {
                break;
            }
        }
    }
    let mut ans = vec![0usize; n];
    for j in 1..=m {
        if p[j] != 0 {
            ans[p[j] - 1] = j - 1;
        }
    }
    ans
}

/// Minimum-cost assignment of every row to a distinct column on a sparse graph: `adj[start[i]..
/// start[i + 1]]` are row `i`'s `(column, cost)` edges, columns below `cols`. Successive
/// shortest paths with potentials (the sparse form of [`hungarian`]): rows in index order each
/// run Dijkstra on the reduced costs until the first free column, ties to the lower distance
/// then the lower column index, so the result is deterministic and optimal over the edges.
/// Columns that are never reached keep potential 0 and cost nothing to visit, so a search
/// touches only the neighbourhood it needs. `None` when some row cannot be assigned.
fn sparse_assignment(start: &[usize], adj: &[(u32, u32)], cols: usize) -> Option<Vec<usize>> {
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;
    const NONE: u32 = u32::MAX;
    let rows = start.len() - 1;
    let mut u = vec![0i64; rows];
    let mut v = vec![0i64; cols];
    let mut row_of = vec![NONE; cols];
    let mut col_of = vec![NONE; rows];
    let mut dist = vec![i64::MAX; cols];
    // Row from which each column was reached, and whether its distance is final.
    let mut from = vec![NONE; cols];
    let mut done = vec![false; cols];
    let mut touched: Vec<u32> = Vec::new();
    let mut finals: Vec<u32> = Vec::new();
    let mut heap: BinaryHeap<Reverse<(i64, bool, u32)>> = BinaryHeap::new();
    // Rows in bit-reversed index order: in index order each row of a long stretch shifted by
    // the same few ranks pushed the whole stretch along again (measured: thousands of columns
    // per search at 16,384 nodes); spread out, the searches stay local.
    let bits = usize::BITS - rows.next_power_of_two().trailing_zeros();
    let mut order: Vec<usize> = (0..rows).collect();
    order.sort_unstable_by_key(|&i| {
        if bits == usize::BITS {
            0
        } else {
            i.reverse_bits() >> bits
        }
    });
    for s in order {
        // Scan row `i` reached at distance `d`.
        let scan = |i: usize,
                    d: i64,
                    dist: &mut [i64],
                    from: &mut [u32],
                    touched: &mut Vec<u32>,
                    heap: &mut BinaryHeap<Reverse<(i64, bool, u32)>>,
                    done: &[bool],
                    row_of: &[u32],
                    u: &[i64],
                    v: &[i64]| {
            for &(j, c) in &adj[start[i]..start[i + 1]] {
                let ju = j as usize;
                if done[ju] {
                    continue;
                }
                let nd = d + i64::from(c) - u[i] - v[ju];
                if nd < dist[ju] {
                    if dist[ju] == i64::MAX {
                        touched.push(j);
                    }
                    dist[ju] = nd;
                    from[ju] = i as u32;
                    // At equal distance a free column comes first: it ends the search.
                    heap.push(Reverse((nd, row_of[ju] != NONE, j)));
                }
            }
        };
        scan(
            s,
            0,
            &mut dist,
            &mut from,
            &mut touched,
            &mut heap,
            &done,
            &row_of,
            &u,
            &v,
        );
        let mut end = None;
        while let Some(Reverse((d, _, j))) = heap.pop() {
            let ju = j as usize;
            if done[ju] || d > dist[ju] {
                continue;
            }
            done[ju] = true;
            finals.push(j);
            let r = row_of[ju];
            if r == NONE {
                end = Some((ju, d));
                break;
            }
            scan(
                r as usize,
                d,
                &mut dist,
                &mut from,
                &mut touched,
                &mut heap,
                &done,
                &row_of,
                &u,
                &v,
            );
        }
        let (t, big) = end?;

        // Potentials: every scanned row (the start and the rows of the final columns but
        // `t`) and every final column move by `big - d`, which keeps the reduced costs
        // non-negative and those on the shortest-path tree zero.
        u[s] += big;
        for &j in &finals {
            let ju = j as usize;
            let delta = big - dist[ju];
            v[ju] -= delta;
            let r = row_of[ju];
            if r != NONE {
                u[r as usize] += delta;
            }
        }
        // Augment along the path back to `s`.
        let mut j = t;
        loop {
            let i = from[j] as usize;
            let prev = col_of[i];
            row_of[j] = i as u32;
            col_of[i] = j as u32;
            if i == s {
                break;
            }
            j = prev as usize;
        }
        for &j in &touched {
            dist[j as usize] = i64::MAX;
            done[j as usize] = false;
            from[j as usize] = NONE;
        }
        touched.clear();
        finals.clear();
        heap.clear();
    }
    Some(col_of.into_iter().map(|j| j as usize).collect())
}

/// The textbook form of [`hungarian`] (every column visited per step, potentials shifted
/// eagerly): the reference the fast form is tested against.
#[cfg(test)]
fn hungarian_reference<T: Acc>(cost: &[Vec<u64>], m: usize) -> Vec<usize> {
    let n = cost.len();
    // 1-based: index 0 of the column arrays is a virtual column; p[j] = row matched to column j.
    let mut u = vec![T::ZERO; n + 1];
    let mut v = vec![T::ZERO; m + 1];
    let mut p = vec![0usize; m + 1];
    let mut way = vec![0usize; m + 1];
    let mut minv = vec![T::INF; m + 1];
    let mut used = vec![false; m + 1];
    for i in 1..=n {
        p[0] = i;
        let mut j0 = 0usize;
        minv.fill(T::INF);
        used.fill(false);
        loop {
            used[j0] = true;
            let i0 = p[j0];
            let row = &cost[i0 - 1];
            let ui0 = u[i0];
            let mut delta = T::INF;
            let mut j1 = 0usize;
            for j in 1..=m {
                if !used[j] {
                    let cur = T::from_u64(row[j - 1]) - ui0 - v[j];
                    if cur < minv[j] {
                        minv[j] = cur;
                        way[j] = j0;
                    }
                    if minv[j] < delta {
                        delta = minv[j];
                        j1 = j;
                    }
                }
            }
            for j in 0..=m {
                if used[j] {
                    u[p[j]] += delta;
                    v[j] -= delta;
                } else {
                    minv[j] -= delta;
                }
            }
            j0 = j1;
            if p[j0] == 0 {
                break;
            }
        }
        loop {
            let j1 = way[j0];
            p[j0] = p[j1];
            j0 = j1;
            if j0 == 0 {
                break;
            }
        }
    }
    let mut ans = vec![0usize; n];
    for j in 1..=m {
        if p[j] != 0 {
            ans[p[j] - 1] = j - 1;
        }
    }
    ans
}

/// Checks the matrix is rectangular with rows ≤ columns; returns the column count.
fn columns(cost: &[Vec<u64>]) -> usize {
    let m = cost.first().map_or(0, Vec::len);
    assert!(
        cost.iter().all(|r| r.len() == m),
        "cost matrix rows must all have the same length"
    );
    assert!(
        cost.len() <= m || cost.is_empty(),
        "cost matrix needs rows <= columns"
    );
    m
}

/// Minimum-total-cost assignment of rows (plan nodes) to distinct columns (physical nodes):
/// returns the column for each row. Hungarian algorithm with potentials, `O(n²·m)`; exact for
/// any `u64` costs (uses `i64` arithmetic when the costs are small enough to rule out overflow,
/// `i128` otherwise). Deterministic.
///
/// # Panics
/// If the rows have different lengths or there are more rows than columns.
pub fn min_cost_assignment(cost: &[Vec<u64>]) -> Vec<usize> {
    let m = columns(cost);
    let max = cost.iter().flatten().copied().max().unwrap_or(0);
    // Potentials and reduced costs stay within a few multiples of n·max.
    let bound = (i64::MAX as u64 / 8) / (m as u64 + 1);
    if max <= bound {
        hungarian::<i64>(cost, m)
    } else {
        hungarian::<i128>(cost, m)
    }
}

/// Paper §5.2 greedy: columns (physical nodes) in order each take the still-free row (plan
/// node) of minimum cost, ties to the lowest row index, until every row is assigned. Returns
/// the column for each row.
///
/// # Panics
/// If the rows have different lengths or there are more rows than columns.
pub fn greedy_assignment(cost: &[Vec<u64>]) -> Vec<usize> {
    let m = columns(cost);
    let n = cost.len();
    let mut ans = vec![usize::MAX; n];
    let mut free: Vec<usize> = (0..n).collect();
    // Every column assigns one row, so only the first `n` columns take part.
    for p in (0..m).take(n) {
        let Some((k, _)) = free
            .iter()
            .enumerate()
            .min_by_key(|&(k, &q)| (cost[q][p], k))
        else {
            break;
        };
        // `free` stays sorted, so the position tie-break is the lowest plan index.
        let q = free.remove(k);
        ans[q] = p;
    }
    ans
}

// ---------------------------------------------------------------------------------------------
// Transfers
// ---------------------------------------------------------------------------------------------

/// Chooses the mapping with `method` and plans the transfers that realize it.
///
/// `plan_nodes[q][l]` is the multiset of experts plan node `q` needs in layer `l`; `physical`
/// are the usable nodes with their current holdings; `experts` is the number of experts per
/// layer. See the module docs for the cost, the tie-breaks and source selection.
///
/// # Errors
/// [`MigrateError::NodeCountMismatch`], [`MigrateError::LayerCountMismatch`],
/// [`MigrateError::ExpertOutOfRange`], [`MigrateError::DuplicatePhysicalId`] for bad input;
/// [`MigrateError::ExpertLost`] (smallest `(layer, expert)`) when a needed expert has no holder.
pub fn map_nodes(
    plan_nodes: &[Vec<Vec<u32>>],
    physical: &[PhysicalNode],
    experts: usize,
    method: MappingMethod,
    bytes_per_expert: u64,
) -> Result<MigrationPlan, MigrateError> {
    let plan_nodes: Vec<&[Vec<u32>]> = plan_nodes.iter().map(Vec::as_slice).collect();
    map_nodes_held(
        &plan_nodes,
        Holders::Nodes(physical),
        experts,
        method,
        bytes_per_expert,
    )
}

/// [`map_nodes`] of plan nodes and holdings given by reference (`plan_nodes[q]` = plan node
/// `q`'s `[layer]` lists; [`Holders`]): a caller whose nodes share their lists (standard EP:
/// one per group position) need not copy them into one vector per node and layer (about a
/// million lists per side and failure at 16,384 nodes × 58 layers).
///
/// # Errors
/// As [`map_nodes`]; a [`Held::Row`] past the placements is a [`MigrateError::RowOutOfRange`].
pub fn map_nodes_held(
    plan_nodes: &[&[Vec<u32>]],
    physical: Holders<'_>,
    experts: usize,
    method: MappingMethod,
    bytes_per_expert: u64,
) -> Result<MigrationPlan, MigrateError> {
    check_rows(physical)?;
    let inst = Instance::new(PlanView::Refs(plan_nodes), physical, experts)?;
    migration_plan(&inst, physical, method, bytes_per_expert)
}

/// [`map_nodes`] with the plan given as its per-layer placements (`layers[l]` over plan nodes
/// `0..N`, as in [`crate::ModelPlan::layers`]) instead of `[plan node][layer]` lists: the same
/// result, without first copying the whole plan node-major
/// ([`crate::ModelPlan::plan_node_contents`]).
///
/// # Errors
/// As [`map_nodes`]; a placement whose node count differs from `physical.len()` is a
/// [`MigrateError::NodeCountMismatch`].
pub fn map_layers(
    layers: &[LayerPlacement],
    physical: &[PhysicalNode],
    experts: usize,
    method: MappingMethod,
    bytes_per_expert: u64,
) -> Result<MigrationPlan, MigrateError> {
    map_layers_held(
        layers,
        Holders::Nodes(physical),
        experts,
        method,
        bytes_per_expert,
    )
}

/// [`map_layers`] with the holdings given by reference ([`Holders`]): the same result as for
/// the equal [`PhysicalNode`]s ([`Holders::to_physical_nodes`]).
///
/// # Errors
/// As [`map_layers`]; also [`MigrateError::RowOutOfRange`].
pub fn map_layers_held(
    layers: &[LayerPlacement],
    physical: Holders<'_>,
    experts: usize,
    method: MappingMethod,
    bytes_per_expert: u64,
) -> Result<MigrationPlan, MigrateError> {
    check_rows(physical)?;
    if let Some(l) = layers.iter().find(|l| l.nodes() != physical.len()) {
        return Err(MigrateError::NodeCountMismatch {
            plan_nodes: l.nodes(),
            physical: physical.len(),
        });
    }
    let plan = PlanView::Layers {
        layers,
        nodes: physical.len(),
    };
    let inst = Instance::new(plan, physical, experts)?;
    migration_plan(&inst, physical, method, bytes_per_expert)
}

/// The mapping and transfers of a validated instance (see [`map_nodes`]).
fn migration_plan(
    inst: &Instance,
    physical: Holders<'_>,
    method: MappingMethod,
    bytes_per_expert: u64,
) -> Result<MigrationPlan, MigrateError> {
    let dims = inst.dims;
    let n = dims.nodes;
    let stride = dims.stride();
    let plan_to_phys = match method {
        MappingMethod::Greedy => greedy_assignment(&inst.cost_matrix()),
        MappingMethod::Optimal => min_cost_assignment(&inst.cost_matrix()),
        MappingMethod::Identity => (0..n).collect(),
        MappingMethod::Scalable => inst.scalable(SCALABLE_BAND),
    };
    let mut phys_to_plan = vec![0usize; n];
    for (q, &p) in plan_to_phys.iter().enumerate() {
        phys_to_plan[p] = q;
    }

    // Needed-but-missing pairs, in (destination index, layer, expert) order, and the union of
    // their keys as one node-shaped bitset.
    struct Need {
        dst: u32,
        key: u32,
    }
    let mut needs: Vec<Need> = Vec::new();
    let mut needed = vec![0u64; stride];
    for (p, &q) in phys_to_plan.iter().enumerate() {
        let need = inst.node(&inst.need, q);
        let have = inst.node(&inst.have, p);
        for (i, (&a, &b)) in need.iter().zip(have).enumerate() {
            let mut missing = a & !b;
            needed[i] |= missing;
            while missing != 0 {
                let key = bit_key(dims, i, missing.trailing_zeros() as usize);
                missing &= missing - 1;
                needs.push(Need {
                    dst: p as u32,
                    key: key as u32,
                });
            }
        }
    }

    // Holders of each needed key as a node bitset. Only the needed keys: a replan typically
    // needs some of them, and listing every holding would walk every bit of the cluster.
    let holders = HolderSets::new(inst, &needed);
    let lost = needs
        .iter()
        .map(|nd| nd.key as usize)
        .filter(|&key| holders.count[holders.slot_of[key] as usize] == 0)
        .min();
    if let Some(key) = lost {
        let (layer, expert) = inst.pair(key);
        return Err(MigrateError::ExpertLost { layer, expert });
    }

    // Group the needs by key (stable counting sort: destinations stay in index order).
    let keys = dims.layers * dims.width;
    let mut need_start = vec![0u32; keys + 1];
    for nd in &needs {
        need_start[nd.key as usize + 1] += 1;
    }
    for k in 0..keys {
        need_start[k + 1] += need_start[k];
    }
    let mut need_fill = need_start.clone();
    let mut by_key = vec![0u32; needs.len()];
    for (i, nd) in needs.iter().enumerate() {
        let k = nd.key as usize;
        by_key[need_fill[k] as usize] = i as u32;
        need_fill[k] += 1;
    }
    // Most-constrained first: needed keys ordered by (number of holders, key).
    let needed_key = |k: usize| need_start[k] != need_start[k + 1];
    let count = |k: usize| holders.count[holders.slot_of[k] as usize];
    let mut bucket = vec![0usize; n + 2];
    for k in (0..keys).filter(|&k| needed_key(k)) {
        bucket[count(k) + 1] += 1;
    }
    for c in 0..=n {
        bucket[c + 1] += bucket[c];
    }
    let mut key_order = vec![0u32; bucket[n + 1]];
    for k in (0..keys).filter(|&k| needed_key(k)) {
        let c = count(k);
        key_order[bucket[c]] = k as u32;
        bucket[c] += 1;
    }

    let mut sent = vec![0u64; n];
    let mut recv = vec![0u64; n];
    let mut src = vec![0u32; needs.len()];
    // Serving a key's destinations one by one from the least-loaded holder (ties to the lowest
    // index) picks, in ascending order, the smallest pairs (s_c + t, c) over holders c with load
    // s_c at the start of the key and t ≥ 0. So sweep levels v = min s_c, min s_c + 1, …, and at
    // each level serve the holders with s_c ≤ v in index order. Each level serves at least one
    // destination; typically one or two levels suffice. The holders with s_c ≤ v are the
    // key's node set intersected with the sets of nodes at each load up to v ([`LoadLevels`]),
    // so a key costs a few passes over `N/64` words, not a visit of every holder.
    let mut levels = LoadLevels::new(n);
    let mut eligible = vec![0u64; holders.words];
    let mut moved: Vec<(usize, u64)> = Vec::new();
    let mut touched_by = vec![usize::MAX; n];
    for (turn, &k) in key_order.iter().enumerate() {
        let k = k as usize;
        // Non-empty: lost keys were returned above.
        let h = holders.set(k);
        let mut dsts = by_key[need_start[k] as usize..need_start[k + 1] as usize].iter();
        let mut level = levels.lowest_meeting(h);
        eligible.fill(0);
        levels.add_eligible(level, h, &mut eligible);
        moved.clear();
        'serve: loop {
            for (w, &word) in eligible.iter().enumerate() {
                let mut word = word;
                while word != 0 {
                    let c = w * 64 + word.trailing_zeros() as usize;
                    word &= word - 1;
                    let Some(&i) = dsts.next() else {
                        break 'serve;
                    };
                    if touched_by[c] != turn {
                        touched_by[c] = turn;
                        moved.push((c, sent[c]));
                    }
                    sent[c] += 1;
                    recv[needs[i as usize].dst as usize] += 1;
                    src[i as usize] = c as u32;
                }
            }
            level += 1;
            levels.add_eligible(level, h, &mut eligible);
        }
        // Loads change only after the key: its levels were taken at its start.
        for &(c, from) in &moved {
            levels.move_node(c, from, sent[c]);
        }
    }
    let transfers: Vec<Transfer> = needs
        .iter()
        .zip(&src)
        .map(|(nd, &s)| {
            let (layer, expert) = inst.pair(nd.key as usize);
            Transfer {
                layer,
                expert,
                src: physical.id(s as usize),
                dst: physical.id(nd.dst as usize),
            }
        })
        .collect();
    let to_bytes = |c: u64| c.saturating_mul(bytes_per_expert);
    let sent_bytes: Vec<u64> = sent.into_iter().map(to_bytes).collect();
    let recv_bytes: Vec<u64> = recv.into_iter().map(to_bytes).collect();
    let new_replicas = transfers.len() as u64;
    Ok(MigrationPlan {
        method,
        plan_to_physical: plan_to_phys.iter().map(|&p| physical.id(p)).collect(),
        new_replicas,
        bytes: to_bytes(new_replicas),
        max_sent_bytes: sent_bytes.iter().copied().max().unwrap_or(0),
        max_recv_bytes: recv_bytes.iter().copied().max().unwrap_or(0),
        sent_bytes,
        recv_bytes,
        transfers,
    })
}

/// The physical nodes holding each needed key, as node bitsets: the node-major `have`
/// bitsets transposed for the keys set in `needed`, 64 nodes × 64 keys at a time.
struct HolderSets {
    /// Words per node set, `N.div_ceil(64)`.
    words: usize,
    /// Row of each key in `bits`, `u32::MAX` when the key is not needed.
    slot_of: Vec<u32>,
    bits: Vec<u64>,
    /// Number of holders of each row.
    count: Vec<usize>,
}

impl HolderSets {
    fn new(inst: &Instance, needed: &[u64]) -> Self {
        let dims = inst.dims;
        let (n, stride) = (dims.nodes, dims.stride());
        let words = n.div_ceil(64);
        // Slots follow the needed bits in order, so word `i`'s keys take the slots from
        // `first_slot[i]` on, with no key arithmetic in the loop below.
        let mut slot_of = vec![u32::MAX; dims.layers * dims.width];
        let mut first_slot = Vec::with_capacity(stride);
        let mut slots = 0usize;
        for (i, &m) in needed.iter().enumerate() {
            first_slot.push(slots);
            for_each_set_bit(m, |c| {
                slot_of[bit_key(dims, i, c)] = slots as u32;
                slots += 1;
            });
        }
        let mut bits = vec![0u64; slots * words];
        // Tiles of 8 key words (one cache line of each node's bitset) by all node blocks: the
        // 64 lines a block reads serve all 8 words, and the up to 512 node sets being written
        // stay in cache while the node blocks advance along them. A tile writes only its own
        // keys' slots, which are contiguous, so the tiles fill disjoint parts in parallel.
        let tiles: Vec<std::ops::Range<usize>> = (0..stride)
            .step_by(8)
            .map(|t| t..(t + 8).min(stride))
            .collect();
        let mut parts: Vec<(std::ops::Range<usize>, &mut [u64])> = Vec::with_capacity(tiles.len());
        let mut rest: &mut [u64] = &mut bits;
        for tile in tiles {
            let end_slot = first_slot.get(tile.end).copied().unwrap_or(slots);
            let len = (end_slot - first_slot[tile.start]) * words;
            let (part, tail) = std::mem::take(&mut rest).split_at_mut(len);
            rest = tail;
            parts.push((tile, part));
        }
        parts.into_par_iter().for_each(|(tile, part)| {
            let base = first_slot[tile.start];
            let mut block = [0u64; 64];
            for b in 0..words {
                let rows = (n - b * 64).min(64);
                for i in tile.clone() {
                    let m = needed[i];
                    if m == 0 {
                        continue;
                    }
                    for (r, row) in block.iter_mut().enumerate() {
                        *row = if r < rows {
                            inst.have[(b * 64 + r) * stride + i] & m
                        } else {
                            0
                        };
                    }
                    transpose64(&mut block);
                    let mut slot = first_slot[i] - base;
                    for_each_set_bit(m, |c| {
                        part[slot * words + b] = block[c];
                        slot += 1;
                    });
                }
            }
        });
        let count = bits
            .chunks(words.max(1))
            .take(slots)
            .map(|set| set.iter().map(|w| w.count_ones() as usize).sum())
            .collect();
        HolderSets {
            words,
            slot_of,
            bits,
            count,
        }
    }

    /// Node set of a needed key.
    fn set(&self, key: usize) -> &[u64] {
        let slot = self.slot_of[key] as usize;
        &self.bits[slot * self.words..(slot + 1) * self.words]
    }
}

/// The physical nodes grouped by how many transfers they send so far: `at[v]` is the node
/// bitset of load `v`, for the loads some node has.
struct LoadLevels {
    words: usize,
    at: BTreeMap<u64, (Vec<u64>, usize)>,
}

impl LoadLevels {
    /// All `n` nodes at load 0.
    fn new(n: usize) -> Self {
        let words = n.div_ceil(64);
        let mut all = vec![u64::MAX; words];
        if !n.is_multiple_of(64) {
            all[words - 1] = (1u64 << (n % 64)) - 1;
        }
        let mut at = BTreeMap::new();
        if n > 0 {
            at.insert(0, (all, n));
        }
        LoadLevels { words, at }
    }

    /// The lowest load of any node in the non-empty set `h`.
    fn lowest_meeting(&self, h: &[u64]) -> u64 {
        self.at
            .iter()
            .find(|(_, (set, _))| set.iter().zip(h).any(|(&a, &b)| a & b != 0))
            .map(|(&v, _)| v)
            .expect("every node has a load, and the set is not empty")
    }

    /// Adds the members of `h` at load `v` to `eligible`.
    fn add_eligible(&self, v: u64, h: &[u64], eligible: &mut [u64]) {
        if let Some((set, _)) = self.at.get(&v) {
            for ((e, &a), &b) in eligible.iter_mut().zip(set).zip(h) {
                *e |= a & b;
            }
        }
    }

    fn move_node(&mut self, c: usize, from: u64, to: u64) {
        let (w, bit) = (c / 64, 1u64 << (c % 64));
        if let Some((set, size)) = self.at.get_mut(&from) {
            set[w] &= !bit;
            *size -= 1;
            if *size == 0 {
                self.at.remove(&from);
            }
        }
        let words = self.words;
        let (set, size) = self.at.entry(to).or_insert_with(|| (vec![0; words], 0));
        set[w] |= bit;
        *size += 1;
    }
}

/// Transposes a 64 × 64 bit matrix in place: bit `c` of row `r` becomes bit `r` of row `c`.
/// Swaps the off-diagonal blocks of halves, then of quarters, down to single bits (the
/// recursive block transpose of Warren, *Hacker's Delight*, 2nd ed., §7-3).
fn transpose64(a: &mut [u64; 64]) {
    let mut j = 32;
    let mut m: u64 = 0x0000_0000_FFFF_FFFF;
    while j != 0 {
        let mut k = 0;
        while k < 64 {
            // Rows k and k + j (bit j of k clear): swap the high-j bits of row k's pairs with
            // the low-j bits of row k + j's.
            let t = ((a[k] >> j) ^ a[k + j]) & m;
            a[k] ^= t << j;
            a[k + j] ^= t;
            k = (k + j + 1) & !j;
        }
        j >>= 1;
        m ^= m << j;
    }
}

fn for_each_set_bit(mut w: u64, mut f: impl FnMut(usize)) {
    while w != 0 {
        f(w.trailing_zeros() as usize);
        w &= w - 1;
    }
}

/// Key `layer*width + column` of bit `bit` in word `i` of a node's bitset.
fn bit_key(dims: Dims, i: usize, bit: usize) -> usize {
    let l = i / dims.words;
    let e = (i % dims.words) * 64 + bit;
    l * dims.width + e
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(id: u32, holdings: Vec<Vec<u32>>) -> PhysicalNode {
        PhysicalNode { id, holdings }
    }

    /// The two-pass build (validate, then bits one past the largest id), as the sparse path
    /// still does, for comparison with the one-pass dense build.
    fn two_pass(
        plan: &[Vec<Vec<u32>>],
        physical: &[PhysicalNode],
        experts: usize,
    ) -> Result<Instance, MigrateError> {
        let view = PlanView::Nodes(plan);
        let (dims, sparse) = validate(view, Holders::Nodes(physical), experts)?;
        let need = build_bits(
            &dims,
            sparse.as_deref(),
            |q| plan[q].len(),
            |q, l| &plan[q][l],
        );
        let have = build_bits(
            &dims,
            sparse.as_deref(),
            |p| physical[p].holdings.len(),
            |p, l| &physical[p].holdings[l],
        );
        Ok(Instance {
            dims,
            sparse,
            need,
            have,
        })
    }

    proptest::proptest! {
        /// The run-time picked popcount equals the portable loop on any words and lengths.
        #[test]
        fn and_not_ones_equals_the_portable_loop(
            pairs in proptest::collection::vec((proptest::num::u64::ANY, proptest::num::u64::ANY), 0..300)
        ) {
            let (a, b): (Vec<u64>, Vec<u64>) = pairs.into_iter().unzip();
            proptest::prop_assert_eq!(and_not_ones(&a, &b), and_not_ones_portable(&a, &b));
        }
    }

    proptest::proptest! {
        /// The one-pass dense build reports the same first error as validating first, and on
        /// valid input gives the same costs (its bitsets are `experts` wide instead of one past
        /// the largest id).
        #[test]
        fn dense_build_equals_two_pass(
            plan in proptest::collection::vec(
                proptest::collection::vec(proptest::collection::vec(0u32..12, 0..4), 0..4), 0..5),
            phys in proptest::collection::vec(
                (0u32..6, proptest::collection::vec(
                    proptest::collection::vec(0u32..12, 0..4), 0..4)), 0..5),
            experts in 0usize..12,
        ) {
            let physical: Vec<PhysicalNode> =
                phys.into_iter().map(|(id, holdings)| node(id, holdings)).collect();
            let one = Instance::new_dense(PlanView::Nodes(&plan), Holders::Nodes(&physical), experts);
            let two = two_pass(&plan, &physical, experts);
            match (one, two) {
                (Ok(a), Ok(b)) => proptest::prop_assert_eq!(a.cost_matrix(), b.cost_matrix()),
                (a, b) => proptest::prop_assert_eq!(a.err(), b.err()),
            }
        }
    }

    #[test]
    fn transpose64_matches_naive() {
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let mut a = [0u64; 64];
        for row in &mut a {
            // xorshift: a fixed, dense pattern
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *row = x;
        }
        let mut t = a;
        transpose64(&mut t);
        for (r, &row) in a.iter().enumerate() {
            for (c, &col) in t.iter().enumerate() {
                assert_eq!((col >> r) & 1, (row >> c) & 1, "row {r} col {c}");
            }
        }
    }

    #[test]
    fn parse_and_display_roundtrip() {
        for m in [MappingMethod::Greedy, MappingMethod::Optimal] {
            assert_eq!(m.to_string().parse::<MappingMethod>(), Ok(m));
        }
        assert_eq!(
            " Optimal ".parse::<MappingMethod>(),
            Ok(MappingMethod::Optimal)
        );
        assert!("best".parse::<MappingMethod>().is_err());
    }

    #[test]
    fn duplicates_count_once() {
        let plan = vec![vec![vec![1, 1, 2]]];
        let phys = vec![node(7, vec![vec![2]])];
        assert_eq!(cost_matrix(&plan, &phys, 3).unwrap(), vec![vec![1]]);
    }

    proptest::proptest! {
        /// The fast Hungarian makes the reference's choices, ties included: random
        /// rectangular matrices with costs from a small range (many ties) or a wide one.
        #[test]
        fn hungarian_equals_the_reference(
            rows in 1usize..24,
            extra in 0usize..6,
            range in proptest::sample::select(vec![2u64, 4, 1_000, u64::MAX / 4]),
            seed in proptest::prelude::any::<u64>(),
        ) {
            let m = rows + extra;
            let mut x = seed | 1;
            let cost: Vec<Vec<u64>> = (0..rows)
                .map(|_| {
                    (0..m)
                        .map(|_| {
                            x ^= x << 13;
                            x ^= x >> 7;
                            x ^= x << 17;
                            x % range
                        })
                        .collect()
                })
                .collect();
            // `min_cost_assignment` takes the i64 path only for small costs.
            if range <= 1_000 {
                proptest::prop_assert_eq!(
                    hungarian::<i64>(&cost, m),
                    hungarian_reference::<i64>(&cost, m)
                );
            }
            proptest::prop_assert_eq!(
                hungarian::<i128>(&cost, m),
                hungarian_reference::<i128>(&cost, m)
            );
        }
    }

    proptest::proptest! {
        /// The sparse solver is optimal over its edges: against the Hungarian algorithm on the
        /// dense matrix where a missing edge costs more than any assignment of real ones. The
        /// diagonal is always present, so a complete assignment exists.
        #[test]
        fn sparse_assignment_is_optimal(
            rows in 1usize..30,
            extra in 0usize..5,
            range in proptest::sample::select(vec![2u32, 5, 1_000]),
            density in 0u64..4,
            seed in proptest::prelude::any::<u64>(),
        ) {
            let m = rows + extra;
            let mut x = seed | 1;
            let mut next = || {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x
            };
            let missing = u64::from(range) * (rows as u64 + 1);
            let mut start = vec![0usize];
            let mut adj = Vec::new();
            let mut dense = vec![vec![missing; m]; rows];
            for (i, row) in dense.iter_mut().enumerate() {
                for (j, d) in row.iter_mut().enumerate() {
                    if i == j || next() % 4 <= density {
                        let c = (next() % u64::from(range)) as u32;
                        adj.push((j as u32, c));
                        *d = u64::from(c);
                    }
                }
                start.push(adj.len());
            }
            let got = sparse_assignment(&start, &adj, m).expect("the diagonal is feasible");
            let mut seen = vec![false; m];
            for (i, &j) in got.iter().enumerate() {
                proptest::prop_assert!(dense[i][j] < missing, "not an edge");
                proptest::prop_assert!(!std::mem::replace(&mut seen[j], true), "column twice");
            }
            let opt = assignment_cost(&dense, &min_cost_assignment(&dense));
            proptest::prop_assert_eq!(assignment_cost(&dense, &got), opt);
        }
    }

    #[test]
    fn sparse_assignment_reports_infeasible() {
        // Two rows that can only use column 0.
        assert_eq!(sparse_assignment(&[0, 1, 2], &[(0, 1), (0, 2)], 2), None);
        assert_eq!(sparse_assignment(&[0], &[], 0), Some(vec![]));
    }

    #[test]
    fn hungarian_huge_costs_use_wide_path() {
        let big = u64::MAX;
        let cost = vec![vec![big, 1, big], vec![1, big, big], vec![big, big, 0]];
        assert_eq!(min_cost_assignment(&cost), vec![1, 0, 2]);
        // Diagonal: 2·big − 3; anti-diagonal: 2·big − 2.
        let cost = vec![vec![big, big - 1], vec![big - 1, big - 3]];
        assert_eq!(min_cost_assignment(&cost), vec![0, 1]);
    }

    #[test]
    fn rectangular_and_empty() {
        assert!(min_cost_assignment(&[]).is_empty());
        assert!(greedy_assignment(&[]).is_empty());
        let cost = vec![vec![5, 1, 3]];
        assert_eq!(min_cost_assignment(&cost), vec![1]);
        assert_eq!(greedy_assignment(&cost), vec![0]);
    }

    #[test]
    fn blank_node_holdings_accepted() {
        let plan = vec![vec![vec![0], vec![1]], vec![vec![1], vec![0]]];
        let phys = vec![node(1, vec![vec![0, 1], vec![0, 1]]), node(2, vec![])];
        let mp = map_nodes(&plan, &phys, 2, MappingMethod::Optimal, 10).unwrap();
        assert_eq!(mp.new_replicas, 2);
        assert_eq!(mp.recv_bytes, vec![0, 20]);
        assert_eq!(mp.sent_bytes, vec![20, 0]);
    }

    #[test]
    fn sparse_huge_ids_are_compressed() {
        let big = u32::MAX;
        let plan = vec![vec![vec![big, 5, 5]], vec![vec![1_000_000]]];
        let phys = vec![node(0, vec![vec![1_000_000, 5]]), node(1, vec![vec![big]])];
        assert_eq!(
            cost_matrix(&plan, &phys, usize::MAX).unwrap(),
            vec![vec![1, 1], vec![0, 1]]
        );
        let mp = map_nodes(&plan, &phys, usize::MAX, MappingMethod::Optimal, 3).unwrap();
        assert_eq!(mp.plan_to_physical, vec![1, 0]);
        let t = Transfer {
            layer: 0,
            expert: 5,
            src: 0,
            dst: 1,
        };
        assert_eq!(mp.transfers, vec![t]);
        let plan = vec![vec![vec![4_000_000_000]], vec![vec![1_000_000]]];
        assert_eq!(
            map_nodes(&plan, &phys, usize::MAX, MappingMethod::Greedy, 3),
            Err(MigrateError::ExpertLost {
                layer: 0,
                expert: 4_000_000_000
            })
        );
    }

    #[test]
    fn lost_experts_lists_missing() {
        let phys = vec![
            node(0, vec![vec![0, 2], vec![]]),
            node(1, vec![vec![9], vec![1]]),
        ];
        assert_eq!(lost_experts(&phys, 2, 3), vec![(0, 1), (1, 0), (1, 2)]);
    }
}
