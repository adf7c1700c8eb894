//! Placement: which expert each slot of each node holds, for one layer.
//!
//! A placement is the paper's plan matrix `T ∈ [E]^{c×N}` stored node-major: `grid[node][slot]`.
//! Every policy fills every slot and honours every expert's replica count exactly; both are
//! asserted on construction ([`LayerPlacement::from_grid`]). Slots within a node are kept sorted
//! by expert id, so duplicates of one expert sit on the same GPU (a GPU holding two replicas of
//! an expert simply takes twice the share of its tokens, §4.1).

use crate::allocate::ascending_order_by;
use crate::error::PlanError;
use rand::SeedableRng;
use rand::rngs::Xoshiro256PlusPlus;
use rand::seq::SliceRandom;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

/// Which placement rule to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum PlacePolicy {
    /// Maximum-Rank-Overlap (§4.1, App. A.2): nested node sets inside groups of `c` experts.
    Mro,
    /// Round-robin over nodes: each expert's replicas on distinct consecutive nodes (§6.3).
    Spread,
    /// Each expert on as few nodes as possible (§6.3).
    Compact,
    /// Uniformly random arrangement of the replica multiset, from a seed.
    Random { seed: u64 },
}

impl PlacePolicy {
    pub fn name(&self) -> &'static str {
        match self {
            Self::Mro => "mro",
            Self::Spread => "spread",
            Self::Compact => "compact",
            Self::Random { .. } => "random",
        }
    }
}

impl fmt::Display for PlacePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Random { seed } => write!(f, "random:{seed}"),
            p => f.write_str(p.name()),
        }
    }
}

impl FromStr for PlacePolicy {
    type Err = String;
    /// `mro`, `spread`, `compact`, `random` (seed 0) or `random:SEED`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "mro" => Ok(Self::Mro),
            "spread" => Ok(Self::Spread),
            "compact" => Ok(Self::Compact),
            "random" => Ok(Self::Random { seed: 0 }),
            _ => match s.strip_prefix("random:").map(str::parse::<u64>) {
                Some(Ok(seed)) => Ok(Self::Random { seed }),
                _ => Err(format!(
                    "unknown placement {s:?} (expected mro, spread, compact, random or random:SEED)"
                )),
            },
        }
    }
}

/// One layer's placement: `grid[node][slot]` = expert id.
///
/// Stored flat, node-major (`cells[node · c + slot]`): one allocation per layer instead of one
/// per node (a 2,048-node plan of 58 layers had about 119,000 row vectors, each built, cloned
/// and freed with every plan). The cells are shared, never changed once built: a clone of a
/// plan (the job machine keeps the plan it sends, 15 MB at 2,048 nodes) copies no cell.
/// Serialized as before, `{"experts": E, "grid": [[..], ..]}`.
///
/// An MRO placement also knows which of its rows are equal ([`LayerPlacement::same_rows`]):
/// the planner's passes over a plan (the mapping's bitsets, the lost-expert check, the
/// simulator's runs of equal nodes) compare each row with its predecessor's, and at 16,384
/// nodes × 58 layers that was a sixth of a replayed reconfiguration in `memcmp`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(into = "GridRepr", from = "GridRepr")]
pub struct LayerPlacement {
    experts: usize,
    slots: usize,
    cells: Arc<[u32]>,
    /// Index of each node's row among the distinct rows, when known: two rows are equal
    /// exactly when their indices are (an MRO template's numbering, shared by every layer
    /// placed from it). `None`: [`LayerPlacement::same_rows`] compares cells.
    row_ids: Option<Arc<[u32]>>,
}

/// Equal placements have equal cells; whether the row indices are known does not matter.
impl PartialEq for LayerPlacement {
    fn eq(&self, other: &Self) -> bool {
        self.experts == other.experts && self.slots == other.slots && self.cells == other.cells
    }
}

impl Eq for LayerPlacement {}

/// The serialized form of a [`LayerPlacement`]: rows of slots.
#[derive(Serialize, Deserialize)]
struct GridRepr {
    experts: usize,
    grid: Vec<Vec<u32>>,
}

impl From<LayerPlacement> for GridRepr {
    fn from(p: LayerPlacement) -> Self {
        GridRepr {
            experts: p.experts,
            grid: p.grid().to_vec(),
        }
    }
}

impl From<GridRepr> for LayerPlacement {
    /// Unchecked, as the derived form was; a ragged grid keeps the first row's width and
    /// its cells in order.
    fn from(r: GridRepr) -> Self {
        LayerPlacement {
            experts: r.experts,
            slots: r.grid.first().map_or(0, Vec::len),
            cells: r.grid.into_iter().flatten().collect::<Vec<u32>>().into(),
            row_ids: None,
        }
    }
}

/// A read-only view of a placement's rows: `grid[node]` is that node's slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grid<'a> {
    cells: &'a [u32],
    slots: usize,
}

impl<'a> Grid<'a> {
    /// Number of nodes.
    pub fn len(&self) -> usize {
        self.cells.len().checked_div(self.slots).unwrap_or(0)
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The rows in node order.
    pub fn iter(&self) -> std::slice::ChunksExact<'a, u32> {
        self.cells.chunks_exact(self.slots.max(1))
    }
    /// Node `node`'s slots.
    pub fn row(&self, node: usize) -> &'a [u32] {
        &self.cells[node * self.slots..(node + 1) * self.slots]
    }
    /// All slots, node-major.
    pub fn cells(&self) -> &'a [u32] {
        self.cells
    }
    /// Slots per node.
    pub fn slots(&self) -> usize {
        self.slots
    }
    /// The rows as vectors.
    pub fn to_vec(&self) -> Vec<Vec<u32>> {
        self.iter().map(<[u32]>::to_vec).collect()
    }
}

impl std::ops::Index<usize> for Grid<'_> {
    type Output = [u32];
    fn index(&self, node: usize) -> &[u32] {
        &self.cells[node * self.slots..(node + 1) * self.slots]
    }
}

impl<'a> IntoIterator for Grid<'a> {
    type Item = &'a [u32];
    type IntoIter = std::slice::ChunksExact<'a, u32>;
    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl<'a> IntoIterator for &Grid<'a> {
    type Item = &'a [u32];
    type IntoIter = std::slice::ChunksExact<'a, u32>;
    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

/// As the rows would: a sequence of sequences.
impl Serialize for Grid<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.iter())
    }
}

impl PartialEq<Vec<Vec<u32>>> for Grid<'_> {
    fn eq(&self, other: &Vec<Vec<u32>>) -> bool {
        self.len() == other.len() && self.iter().zip(other).all(|(a, b)| a == b.as_slice())
    }
}

impl LayerPlacement {
    /// Builds a placement from a grid, checking that every node has the same number of slots,
    /// every slot holds a valid expert, and (when given) each expert's count matches `replicas`.
    pub fn from_grid(
        grid: Vec<Vec<u32>>,
        experts: usize,
        replicas: Option<&[usize]>,
    ) -> Result<Self, PlanError> {
        if grid.is_empty() {
            return Err(PlanError::NoNodes(0));
        }
        let c = grid[0].len();
        if c == 0 {
            return Err(PlanError::NoSlots(0));
        }
        let mut counts = vec![0usize; experts];
        for (n, node) in grid.iter().enumerate() {
            if node.len() != c {
                return Err(PlanError::RaggedGrid {
                    node: n,
                    expected: c,
                    got: node.len(),
                });
            }
            for &e in node {
                let e = e as usize;
                if e >= experts {
                    return Err(PlanError::ExpertOutOfRange { expert: e, experts });
                }
                counts[e] += 1;
            }
        }
        if let Some(r) = replicas {
            if r.len() != experts {
                return Err(PlanError::LoadCount {
                    expected: experts,
                    got: r.len(),
                });
            }
            if let Some(e) = (0..experts).find(|&e| counts[e] != r[e]) {
                return Err(PlanError::CountMismatch {
                    expert: e,
                    expected: r[e],
                    got: counts[e],
                });
            }
        }
        Ok(Self {
            experts,
            slots: c,
            cells: grid.into_iter().flatten().collect::<Vec<u32>>().into(),
            row_ids: None,
        })
    }

    pub fn nodes(&self) -> usize {
        self.grid().len()
    }
    pub fn slots_per_node(&self) -> usize {
        self.slots
    }
    pub fn experts(&self) -> usize {
        self.experts
    }
    /// `grid[node][slot]` = expert id.
    pub fn grid(&self) -> Grid<'_> {
        Grid {
            cells: &self.cells,
            slots: self.slots,
        }
    }

    /// Whether nodes `a` and `b` hold the same slot row (the same experts in the same
    /// order): an index comparison when the placement knows its distinct rows, else the cells.
    ///
    /// # Panics
    /// If `a` or `b` is not a node of the placement.
    pub fn same_rows(&self, a: usize, b: usize) -> bool {
        match &self.row_ids {
            Some(ids) => ids[a] == ids[b],
            None => {
                let grid = self.grid();
                grid.row(a) == grid.row(b)
            }
        }
    }

    /// Replica count per expert.
    pub fn replicas(&self) -> Vec<usize> {
        let mut r = vec![0; self.experts];
        self.cells.iter().for_each(|&e| r[e as usize] += 1);
        r
    }

    /// `replicas[e][node]`: replicas of expert `e` held by `node`.
    pub fn replica_matrix(&self) -> Vec<Vec<u32>> {
        let mut m = vec![vec![0u32; self.nodes()]; self.experts];
        for (n, node) in self.grid().iter().enumerate() {
            for &e in node {
                m[e as usize][n] += 1;
            }
        }
        m
    }

    /// Distinct nodes holding each expert (`S_e`), ascending.
    pub fn node_sets(&self) -> Vec<Vec<usize>> {
        let mut s: Vec<Vec<usize>> = vec![Vec::new(); self.experts];
        for (n, node) in self.grid().iter().enumerate() {
            for &e in node {
                let set = &mut s[e as usize];
                if set.last() != Some(&n) {
                    set.push(n);
                }
            }
        }
        s
    }

    /// Returns the placement with node `q` moved to position `perm[q]`.
    pub fn permute_nodes(&self, perm: &[usize]) -> Self {
        let mut cells = vec![0u32; self.cells.len()];
        let c = self.slots;
        for (q, &to) in perm.iter().enumerate() {
            cells[to * c..(to + 1) * c].copy_from_slice(self.grid().row(q));
        }
        Self {
            experts: self.experts,
            slots: c,
            cells: cells.into(),
            row_ids: None,
        }
    }
}

/// Places `replicas[e]` copies of each expert on `nodes × slots_per_node` slots.
/// `Σ replicas` must equal `nodes · slots_per_node` and every expert needs at least one replica.
pub fn place(
    policy: PlacePolicy,
    replicas: &[usize],
    nodes: usize,
    slots_per_node: usize,
) -> Result<LayerPlacement, PlanError> {
    check_place_inputs(replicas, nodes, slots_per_node)?;
    let mut grid = match policy {
        PlacePolicy::Mro => mro(replicas, nodes, slots_per_node),
        PlacePolicy::Spread => spread(replicas, nodes, slots_per_node),
        PlacePolicy::Compact => compact(replicas, nodes, slots_per_node),
        PlacePolicy::Random { seed } => random(replicas, nodes, slots_per_node, seed),
    };
    for node in &mut grid {
        node.sort_unstable();
    }
    // Invariants: every slot filled, every expert's count honoured.
    LayerPlacement::from_grid(grid, replicas.len(), Some(replicas))
}

/// `nodes` empty rows with room for `c` slots each. (`vec![Vec::with_capacity(c); nodes]`
/// would not do: cloning a vector drops its spare capacity, so every row would regrow.)
fn empty_rows(nodes: usize, c: usize) -> Vec<Vec<u32>> {
    (0..nodes).map(|_| Vec::with_capacity(c)).collect()
}

/// The input errors of [`place`], in the order it reports them.
fn check_place_inputs(
    replicas: &[usize],
    nodes: usize,
    slots_per_node: usize,
) -> Result<(), PlanError> {
    if nodes == 0 {
        return Err(PlanError::NoNodes(nodes));
    }
    if slots_per_node == 0 {
        return Err(PlanError::NoSlots(slots_per_node));
    }
    if replicas.is_empty() {
        return Err(PlanError::NoExperts(0));
    }
    if let Some(expert) = replicas.iter().position(|&r| r == 0) {
        return Err(PlanError::ZeroReplicas { expert });
    }
    let total: usize = replicas.iter().sum();
    if total != nodes * slots_per_node {
        return Err(PlanError::ReplicaSum {
            expected: nodes * slots_per_node,
            got: total,
        });
    }
    Ok(())
}

/// MRO placement of many layers that builds the grid once per distinct sorted count vector.
///
/// MRO sees the replica counts only through their ascending sequence: experts enter the
/// construction by rank (App. A.2: groups of `c` consecutive ranks, leftovers dealt in
/// descending rank). Two layers whose sorted counts are equal therefore have the same grid
/// up to renaming rank `k` to each layer's `k`-th expert. The layers of a model often match
/// (same load skew, different hot experts), and at 16K nodes the construction and its per-node
/// sorts are most of the planning time. Renaming is cheap because an MRO grid has few distinct
/// rows: block nodes of a group are equal, and the round-robin leftovers make consecutive
/// nodes equal between the points where one expert's run ends (about 250 distinct rows at
/// 2,048 and at 16,384 nodes with E = 256, c = 32). So each distinct row is renamed and sorted
/// once per layer, and every node gets a copy of its row. The result equals
/// `place(PlacePolicy::Mro, ..)` exactly (tested); layers that would fall back to spread are
/// handed to [`place`].
#[derive(Debug, Default)]
pub(crate) struct MroPlacer {
    template: Option<RankTemplate>,
}

/// An MRO grid over ranks, stored as its distinct rows (sorted rank multisets) and the row of
/// each node.
#[derive(Debug)]
struct RankTemplate {
    slots_per_node: usize,
    /// Replica counts in rank order (ascending).
    sorted: Vec<usize>,
    rows: Vec<Vec<u32>>,
    /// Shared with every placement renamed from the template ([`LayerPlacement::same_rows`]).
    row_of_node: Arc<[u32]>,
}

impl RankTemplate {
    /// `None` when MRO would fall back to spread, which depends on expert ids.
    fn new(sorted: Vec<usize>, nodes: usize, c: usize) -> Option<Self> {
        // Sorted counts are their own rank order, so "expert" ids in this grid are ranks.
        let s = mro_structure(&sorted, nodes, c);
        if s.spread_fallback {
            return None;
        }
        let grid = mro_grid(&s, &sorted, nodes, c);
        // An ordered map, not a hash map: numbering rows by first appearance needs no hasher
        // state, and the planner stays free of process-level randomness.
        let mut index: BTreeMap<Vec<u32>, u32> = BTreeMap::new();
        let mut rows = Vec::new();
        // Consecutive nodes are often equal as built (block nodes, round-robin runs): such a
        // node takes its predecessor's row without a sort or a lookup (equal rows as built
        // are equal sorted, so the numbering is the same).
        let mut row_of_node: Vec<u32> = Vec::with_capacity(grid.len());
        for (n, row) in grid.iter().enumerate() {
            if n > 0 && *row == grid[n - 1] {
                row_of_node.push(row_of_node[n - 1]);
                continue;
            }
            let mut row = row.clone();
            row.sort_unstable();
            row_of_node.push(*index.entry(row).or_insert_with_key(|row| {
                rows.push(row.clone());
                rows.len() as u32 - 1
            }));
        }
        Some(Self {
            slots_per_node: c,
            sorted,
            rows,
            row_of_node: row_of_node.into(),
        })
    }

    fn fits(&self, replicas: &[usize], order: &[usize], nodes: usize, c: usize) -> bool {
        self.row_of_node.len() == nodes
            && self.slots_per_node == c
            && self.sorted.len() == order.len()
            && order
                .iter()
                .zip(&self.sorted)
                .all(|(&e, &r)| replicas[e] == r)
    }

    /// The grid with rank `k` renamed to `order[k]`, rows sorted by expert id.
    fn rename(&self, order: &[usize]) -> LayerPlacement {
        let renamed: Vec<Vec<u32>> = self
            .rows
            .iter()
            .map(|ranks| {
                let mut row: Vec<u32> = ranks.iter().map(|&k| order[k as usize] as u32).collect();
                row.sort_unstable();
                row
            })
            .collect();
        let c = self.slots_per_node;
        // Written in place: collecting into a vector first would copy every cell once more.
        let mut cells = Arc::<[u32]>::new_uninit_slice(self.row_of_node.len() * c);
        let out = Arc::get_mut(&mut cells).expect("not shared yet");
        for (dst, &r) in out.chunks_exact_mut(c.max(1)).zip(self.row_of_node.iter()) {
            let row = &renamed[r as usize];
            assert_eq!(row.len(), dst.len(), "every MRO row has the node's slots");
            for (cell, &e) in dst.iter_mut().zip(row) {
                cell.write(e);
            }
        }
        LayerPlacement {
            experts: order.len(),
            slots: c,
            // SAFETY: `row_of_node.len()` chunks of `c` cells cover the slice and each chunk
            // was written (every row of `renamed` has `c` cells; `c = 0` leaves it empty).
            cells: unsafe { cells.assume_init() },
            // Distinct rank rows stay distinct: renaming is a bijection of the experts and
            // sorting a row keeps its multiset.
            row_ids: Some(self.row_of_node.clone()),
        }
    }
}

impl MroPlacer {
    /// Same result and errors as `place(PlacePolicy::Mro, replicas, nodes, slots_per_node)`.
    pub(crate) fn place(
        &mut self,
        replicas: &[usize],
        nodes: usize,
        slots_per_node: usize,
    ) -> Result<LayerPlacement, PlanError> {
        check_place_inputs(replicas, nodes, slots_per_node)?;
        let order = ascending_order_by(replicas);
        let fits = self
            .template
            .as_ref()
            .is_some_and(|t| t.fits(replicas, &order, nodes, slots_per_node));
        if !fits {
            let sorted = order.iter().map(|&e| replicas[e]).collect();
            match RankTemplate::new(sorted, nodes, slots_per_node) {
                Some(t) => self.template = Some(t),
                None => return place(PlacePolicy::Mro, replicas, nodes, slots_per_node),
            }
        }
        let t = self.template.as_ref().expect("set above");
        Ok(t.rename(&order))
    }
}

/// The MRO structure derived from the replica counts alone (our reading of
/// the paper's MRO construction, §4.1 and App. A.2):
/// experts sorted ascending by `(replicas, id)`, cut into groups of `c` consecutive experts;
/// group `i` owns a block of `r_{rep(i)}` consecutive nodes (its representative — least
/// replicated member — has that many replicas), the last block truncated by `N`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MroStructure {
    /// Experts in rank order (ascending replicas, ties by id).
    pub order: Vec<usize>,
    /// Node-block length of each group, in node order starting at node 0.
    pub block_sizes: Vec<usize>,
    /// True when `E ≤ c`: one group, placed as nested prefixes `S_1 ⊂ S_2 ⊂ …`.
    pub nested: bool,
    /// True when the last block is shorter than its representative's replica count.
    pub truncated: bool,
    /// True when the paper's construction would leave some expert on fewer distinct nodes than
    /// the smallest replica count (only possible when `truncated`), breaking the guarantee that
    /// fewer than `f` failures are always survivable; [`place`] then uses spread instead and
    /// the closed form does not apply.
    pub spread_fallback: bool,
}

/// Computes the [`MroStructure`] for replica counts on `nodes × c` slots (`Σr = N·c`).
pub fn mro_structure(replicas: &[usize], nodes: usize, c: usize) -> MroStructure {
    let mut s = mro_blocks(replicas, nodes, c);
    if s.truncated {
        let guaranteed = replicas.iter().min().copied().unwrap_or(0).min(nodes);
        s.spread_fallback = min_distinct_nodes(&mro_grid(&s, replicas, nodes, c)) < guaranteed;
    }
    s
}

/// Fewest distinct nodes any expert sits on.
fn min_distinct_nodes(grid: &[Vec<u32>]) -> usize {
    let experts = grid
        .iter()
        .flatten()
        .map(|&e| e as usize + 1)
        .max()
        .unwrap_or(0);
    let mut seen = vec![usize::MAX; experts];
    let mut count = vec![0usize; experts];
    for (n, node) in grid.iter().enumerate() {
        for &e in node {
            if seen[e as usize] != n {
                seen[e as usize] = n;
                count[e as usize] += 1;
            }
        }
    }
    count.into_iter().min().unwrap_or(0)
}

fn mro_blocks(replicas: &[usize], nodes: usize, c: usize) -> MroStructure {
    let order = ascending_order_by(replicas);
    let e = replicas.len();
    if e <= c {
        let r1 = replicas[order[0]];
        return MroStructure {
            order,
            block_sizes: vec![r1.min(nodes)],
            nested: true,
            truncated: r1 > nodes,
            spread_fallback: false,
        };
    }
    let groups = e.div_ceil(c);
    let mut block_sizes = Vec::with_capacity(groups);
    let mut used = 0usize;
    let mut truncated = false;
    for g in 0..groups {
        let want = replicas[order[g * c]];
        // With Σr = N·c the first G−1 blocks always fit (each block node takes c replicas of
        // its group, never more than the group owns); only the last can be cut by N.
        let got = want.min(nodes - used);
        truncated |= got < want;
        block_sizes.push(got);
        used += got;
    }
    MroStructure {
        order,
        block_sizes,
        nested: false,
        truncated,
        spread_fallback: false,
    }
}

/// The MRO construction.
///
/// * `E ≤ c`: expert `k` (rank order) on the first `min(r_k, N)` nodes — nested sets.
/// * `E > c`: every node of block `i` holds one replica of each expert of group `i`.
///
/// **Fill rule for leftover replicas** (the paper says only "uniformly"): leftovers are taken
/// hottest expert first (descending rank) and dealt round-robin over the nodes that still have
/// free slots, starting at the first such node and skipping full ones, so one expert's
/// leftovers land on distinct consecutive nodes and every node fills evenly. Leftovers never
/// change recovery: recovery ⇔ every block keeps a live node, because each representative has
/// no leftover replica outside its block (except in a truncated last block, whose free slots are
/// the only free ones left).
///
/// **Guard (our addition).** Theorem 1 is only true when the last block is not truncated: brute
/// force over all placements of tiny clusters finds counterexamples among truncated cases only
/// (test `theorem1_fails_when_last_block_is_truncated`: N=3, c=2, r=[2,2,2] gives 2/3 at one
/// failure where a cyclic plan gives 1). When truncation would put an expert on fewer distinct
/// nodes than the smallest replica count — losing the "< f failures always recover" guarantee —
/// the layer is placed with spread instead ([`MroStructure::spread_fallback`]).
fn mro(replicas: &[usize], nodes: usize, c: usize) -> Vec<Vec<u32>> {
    let s = mro_structure(replicas, nodes, c);
    if s.spread_fallback {
        return spread(replicas, nodes, c);
    }
    mro_grid(&s, replicas, nodes, c)
}

fn mro_grid(s: &MroStructure, replicas: &[usize], nodes: usize, c: usize) -> Vec<Vec<u32>> {
    let mut grid = empty_rows(nodes, c);
    let mut left: Vec<usize> = replicas.to_vec();
    if s.nested {
        for &e in &s.order {
            for node in grid.iter_mut().take(replicas[e].min(nodes)) {
                node.push(e as u32);
            }
            left[e] -= replicas[e].min(nodes);
        }
    } else {
        let mut start = 0;
        for (g, &len) in s.block_sizes.iter().enumerate() {
            let members = &s.order[g * c..((g + 1) * c).min(s.order.len())];
            for node in &mut grid[start..start + len] {
                for &e in members {
                    node.push(e as u32);
                    left[e] -= 1;
                }
            }
            start += len;
        }
    }
    let leftovers = s
        .order
        .iter()
        .rev()
        .flat_map(|&e| std::iter::repeat_n(e as u32, left[e]));
    deal_round_robin(&mut grid, c, leftovers);
    grid
}

/// Deals replicas round-robin over the nodes with free slots (see [`mro`]'s fill rule).
///
/// A node that fills up drops out of the rotation. Removing it from the open list on the spot
/// costs `O(N)` per removal, which made this quadratic at 16K nodes; instead a pass over the
/// open list skips nothing (every node in it was open when the pass began and is visited once
/// per pass), and full nodes are compacted away when the pass wraps. The visiting order is the
/// same as removing on the spot.
fn deal_round_robin(grid: &mut [Vec<u32>], c: usize, items: impl Iterator<Item = u32>) {
    let mut open: Vec<usize> = (0..grid.len()).filter(|&n| grid[n].len() < c).collect();
    let mut cursor = 0;
    for e in items {
        if cursor >= open.len() {
            open.retain(|&n| grid[n].len() < c);
            cursor = 0;
        }
        assert!(!open.is_empty(), "more replicas than slots");
        let n = open[cursor];
        grid[n].push(e);
        cursor += 1;
    }
}

/// Spread: all replicas listed expert by expert (id order) and dealt to node `t mod N` — each
/// node receives exactly `c`, and an expert with `r ≤ N` replicas lands on `r` distinct nodes.
fn spread(replicas: &[usize], nodes: usize, c: usize) -> Vec<Vec<u32>> {
    let mut grid = empty_rows(nodes, c);
    let mut t = 0;
    for (e, &r) in replicas.iter().enumerate() {
        for _ in 0..r {
            grid[t % nodes].push(e as u32);
            t += 1;
        }
    }
    grid
}

/// Compact: experts in descending replica order (ties by id); each first takes whole empty
/// nodes (`⌊r/c⌋` of them), then its remainder goes to the node with the fewest free slots that
/// still fits it whole (best fit); only if none fits is it split, filling the emptiest nodes.
fn compact(replicas: &[usize], nodes: usize, c: usize) -> Vec<Vec<u32>> {
    let mut grid = empty_rows(nodes, c);
    let mut order: Vec<usize> = (0..replicas.len()).collect();
    order.sort_by_key(|&e| (std::cmp::Reverse(replicas[e]), e));
    for e in order {
        let mut left = replicas[e];
        while left >= c {
            match grid.iter().position(Vec::is_empty) {
                Some(n) => {
                    grid[n].extend(std::iter::repeat_n(e as u32, c));
                    left -= c;
                }
                None => break,
            }
        }
        while left > 0 {
            let best_fit = (0..nodes)
                .filter(|&n| c - grid[n].len() >= left)
                .min_by_key(|&n| (c - grid[n].len(), n));
            let n = best_fit.unwrap_or_else(|| {
                (0..nodes)
                    .max_by_key(|&n| (c - grid[n].len(), std::cmp::Reverse(n)))
                    .expect("nodes > 0")
            });
            let take = left.min(c - grid[n].len());
            grid[n].extend(std::iter::repeat_n(e as u32, take));
            left -= take;
        }
    }
    grid
}

/// Random: the replica multiset shuffled with a seeded, portable generator (xoshiro256++),
/// then cut into nodes of `c` slots.
fn random(replicas: &[usize], nodes: usize, c: usize, seed: u64) -> Vec<Vec<u32>> {
    let mut all: Vec<u32> = replicas
        .iter()
        .enumerate()
        .flat_map(|(e, &r)| std::iter::repeat_n(e as u32, r))
        .collect();
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    all.shuffle(&mut rng);
    let grid: Vec<Vec<u32>> = all.chunks(c).map(<[u32]>::to_vec).collect();
    debug_assert_eq!(grid.len(), nodes);
    grid
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The flat grid serializes as the rows did, reads back equal, and its view matches the
    /// rows it was built from (rows, cells, permutation).
    #[test]
    fn flat_grid_keeps_the_rows_and_their_serialized_form() {
        let rows = vec![vec![0u32, 1, 1], vec![2, 2, 3], vec![0, 1, 3]];
        let p = LayerPlacement::from_grid(rows.clone(), 4, None).unwrap();
        assert_eq!(p.grid(), rows);
        assert_eq!(p.grid().to_vec(), rows);
        assert_eq!(p.grid().cells(), &[0, 1, 1, 2, 2, 3, 0, 1, 3]);
        assert_eq!((p.nodes(), p.slots_per_node()), (3, 3));
        assert_eq!(&p.grid()[1], &[2, 2, 3]);
        let json = serde_json::to_string(&p).unwrap();
        assert_eq!(json, r#"{"experts":4,"grid":[[0,1,1],[2,2,3],[0,1,3]]}"#);
        assert_eq!(
            serde_json::to_string(&p.grid()).unwrap(),
            r#"[[0,1,1],[2,2,3],[0,1,3]]"#
        );
        assert_eq!(serde_json::from_str::<LayerPlacement>(&json).unwrap(), p);
        let q = p.permute_nodes(&[2, 0, 1]);
        assert_eq!(
            q.grid(),
            vec![rows[1].clone(), rows[2].clone(), rows[0].clone()]
        );
    }

    /// The round-robin deal as first written (remove a full node from the open list on the
    /// spot), kept as the reference for the compacting version.
    fn deal_round_robin_reference(
        grid: &mut [Vec<u32>],
        c: usize,
        items: impl Iterator<Item = u32>,
    ) {
        let mut open: Vec<usize> = (0..grid.len()).filter(|&n| grid[n].len() < c).collect();
        let mut cursor = 0;
        for e in items {
            assert!(!open.is_empty(), "more replicas than slots");
            if cursor >= open.len() {
                cursor = 0;
            }
            let n = open[cursor];
            grid[n].push(e);
            if grid[n].len() == c {
                open.remove(cursor);
            } else {
                cursor += 1;
            }
        }
    }

    proptest! {
        /// Compacting at the wrap deals every item to the same node as removing on the spot.
        #[test]
        fn deal_round_robin_equals_reference(
            fill in prop::collection::vec(0usize..=6, 1..20),
            c in 1usize..=6,
            extra in 0usize..40,
        ) {
            let mut grid: Vec<Vec<u32>> =
                fill.iter().map(|&f| vec![u32::MAX; f.min(c)]).collect();
            let free: usize = grid.iter().map(|n| c - n.len()).sum();
            let items = (0..extra.min(free) as u32).collect::<Vec<_>>();
            let mut want = grid.clone();
            deal_round_robin_reference(&mut want, c, items.iter().copied());
            deal_round_robin(&mut grid, c, items.iter().copied());
            prop_assert_eq!(grid, want);
        }

        /// The rank template renamed per layer equals a fresh MRO placement, including layers
        /// that reuse the previous layer's template and shapes that fall back to spread.
        #[test]
        fn mro_placer_equals_place(
            counts in prop::collection::vec(1usize..12, 1..24),
            c in 1usize..8,
            extra_nodes in 0usize..4,
            perms in prop::collection::vec(any::<u64>(), 1..4),
        ) {
            let total: usize = counts.iter().sum();
            let nodes = total.div_ceil(c) + extra_nodes;
            // Top up the last expert so the counts fill every slot exactly.
            let mut counts = counts;
            *counts.last_mut().unwrap() += nodes * c - total;
            let mut placer = MroPlacer::default();
            for seed in perms {
                // A seeded shuffle of the same counts: equal sorted vectors, other experts.
                let mut r = counts.clone();
                r.shuffle(&mut Xoshiro256PlusPlus::seed_from_u64(seed));
                let want = place(PlacePolicy::Mro, &r, nodes, c).unwrap();
                let got = placer.place(&r, nodes, c).unwrap();
                prop_assert_eq!(&got, &want);
                // Its row indices say exactly which rows are equal (`want`'s compare cells).
                for a in 0..nodes {
                    for b in 0..nodes {
                        let equal = got.grid().row(a) == got.grid().row(b);
                        prop_assert_eq!(got.same_rows(a, b), equal, "rows {} and {}", a, b);
                        prop_assert_eq!(want.same_rows(a, b), equal);
                    }
                }
            }
        }
    }

    #[test]
    fn mro_placer_handles_nested_and_fallback_shapes() {
        // Nested (E ≤ c), spread fallback (N = 3, c = 2, r = [2, 2, 2], see `mro`), blocks.
        for (r, nodes, c) in [
            (vec![2, 4, 6, 8], 5, 4),
            (vec![2, 2, 2], 3, 2),
            (vec![1, 2, 2], 5, 1),
        ] {
            assert!(r.iter().sum::<usize>() == nodes * c);
            let mut placer = MroPlacer::default();
            for _ in 0..2 {
                let want = place(PlacePolicy::Mro, &r, nodes, c).unwrap();
                assert_eq!(placer.place(&r, nodes, c).unwrap(), want);
            }
        }
        assert!(mro_structure(&[2, 2, 2], 3, 2).spread_fallback);
    }

    #[test]
    fn mro_nested_when_e_le_c() {
        // Fig. 4 plan B shape: 4 experts, 5 nodes, 4 slots, r_1 = 2.
        let p = place(PlacePolicy::Mro, &[2, 4, 6, 8], 5, 4).unwrap();
        let s = p.node_sets();
        assert_eq!(s[0], vec![0, 1]);
        assert!(s[0].iter().all(|n| s[1].contains(n)));
        assert!(s[1].iter().all(|n| s[2].contains(n)));
        assert!(s[2].iter().all(|n| s[3].contains(n)));
    }

    #[test]
    fn mro_blocks_when_e_gt_c() {
        // §10 vector: r = [2×15, 30], N = 10, c = 6 → three blocks of 2 nodes.
        let mut r = vec![2usize; 15];
        r.push(30);
        let st = mro_structure(&r, 10, 6);
        assert_eq!(st.block_sizes, vec![2, 2, 2]);
        assert!(!st.truncated);
        let p = place(PlacePolicy::Mro, &r, 10, 6).unwrap();
        // Nodes 0,1 hold experts 0..6; nodes 2,3 hold 6..12; nodes 4,5 hold 12,13,14,15 (+ fill).
        for n in 0..2 {
            assert_eq!(p.grid()[n], vec![0, 1, 2, 3, 4, 5]);
        }
        for n in 4..6 {
            for e in 12..16 {
                assert!(p.grid()[n].contains(&e));
            }
        }
        // Expert 15's leftovers fill everything else.
        assert_eq!(p.replicas()[15], 30);
    }

    #[test]
    fn spread_and_compact_shapes() {
        let r = [3, 3, 2, 4];
        let s = place(PlacePolicy::Spread, &r, 4, 3).unwrap();
        assert!(s.node_sets().iter().zip(&r).all(|(s, &r)| s.len() == r));
        let c = place(PlacePolicy::Compact, &r, 4, 3).unwrap();
        let sets = c.node_sets();
        assert_eq!(sets[0].len(), 1);
        assert_eq!(sets[1].len(), 1);
        assert!(sets[3].len() <= 2);
    }

    #[test]
    fn malformed_grids_are_errors() {
        assert!(matches!(
            LayerPlacement::from_grid(vec![vec![0, 1], vec![0]], 2, None),
            Err(PlanError::RaggedGrid { node: 1, .. })
        ));
        assert!(matches!(
            LayerPlacement::from_grid(vec![vec![0, 5]], 2, None),
            Err(PlanError::ExpertOutOfRange {
                expert: 5,
                experts: 2
            })
        ));
        assert!(matches!(
            LayerPlacement::from_grid(vec![vec![0, 0]], 2, Some(&[1, 1])),
            Err(PlanError::CountMismatch {
                expert: 0,
                expected: 1,
                got: 2
            })
        ));
        let a = LayerPlacement::from_grid(vec![vec![0], vec![1]], 2, None).unwrap();
        let b = LayerPlacement::from_grid(vec![vec![0, 1]], 2, None).unwrap();
        assert!(matches!(
            crate::recovery::critical_sets(&[a, b]),
            Err(PlanError::LayerNodeMismatch { layer: 1, .. })
        ));
    }

    #[test]
    fn random_is_seeded() {
        let r = [3, 3, 2, 4];
        let a = place(PlacePolicy::Random { seed: 7 }, &r, 4, 3).unwrap();
        let b = place(PlacePolicy::Random { seed: 7 }, &r, 4, 3).unwrap();
        assert_eq!(a, b);
    }

    #[test]
    fn bad_inputs_are_errors() {
        assert!(matches!(
            place(PlacePolicy::Mro, &[1, 1], 1, 3),
            Err(PlanError::ReplicaSum { .. })
        ));
        assert!(matches!(
            place(PlacePolicy::Mro, &[0, 2], 1, 2),
            Err(PlanError::ZeroReplicas { expert: 0 })
        ));
        assert!(place(PlacePolicy::Mro, &[1], 0, 1).is_err());
        assert!("random:x".parse::<PlacePolicy>().is_err());
        assert_eq!(
            "random:5".parse::<PlacePolicy>().unwrap(),
            PlacePolicy::Random { seed: 5 }
        );
    }
}
