//! Minimum-cost transportation: ship `supply[i]` units out of each source `i` and
//! `demand[j]` units into each sink `j` at `cost[i][j]` per unit, at least total cost.
//!
//! The node mapping of a replan ([`crate::migrate`]) is an assignment problem, but nodes that
//! hold the same experts are interchangeable, so it collapses to a transportation problem
//! between classes of equal nodes. Its constraint matrix is totally unimodular, so with integer
//! supplies and demands an optimal flow is integral and expands back to an optimal assignment
//! (Dantzig, *Linear Programming and Extensions*, 1963, ch. 14–15). The solver is successive
//! shortest paths with node potentials (Edmonds and Karp, J. ACM 19(2), 1972): every
//! augmentation follows a cheapest path in the residual graph, found by Dijkstra's algorithm on
//! reduced costs, and carries as many units as the path allows.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// Invalid input to [`min_cost_transport`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransportError {
    #[error("cost matrix has {rows} rows but {supplies} supplies")]
    RowCount { rows: usize, supplies: usize },
    #[error("cost row {row} has {got} entries but there are {demands} demands")]
    RowLength {
        row: usize,
        got: usize,
        demands: usize,
    },
    #[error("total supply {supply} differs from total demand {demand}")]
    Unbalanced { supply: u128, demand: u128 },
    #[error("cost {cost} at row {row}, column {col} is above the supported {max}")]
    CostTooLarge {
        row: usize,
        col: usize,
        cost: u64,
        max: u64,
    },
}

/// Largest unit cost accepted: potentials and path lengths stay within `(rows + cols)` times
/// this, far inside `i64`.
pub const MAX_UNIT_COST: u64 = 1 << 40;

/// An optimal flow: `flow[i][j]` units from source `i` to sink `j`, every supply shipped and
/// every demand met, at minimum `Σ cost[i][j]·flow[i][j]`. Deterministic (ties broken by
/// index).
///
/// # Errors
/// Shape mismatches, unequal totals, or a unit cost above [`MAX_UNIT_COST`].
pub fn min_cost_transport(
    cost: &[Vec<u64>],
    supply: &[u64],
    demand: &[u64],
) -> Result<Vec<Vec<u64>>, TransportError> {
    check(cost, supply, demand)?;
    let (rows, cols) = (supply.len(), demand.len());
    // Reduced cost of edge (i, j): cost + pu[i] − pv[j]. Invariant: ≥ 0 on every edge, and 0 on
    // every edge that carries flow (so its residual back edge is ≥ 0 too).
    let mut pu = vec![0i64; rows];
    let mut pv = vec![0i64; cols];
    for (i, row) in cost.iter().enumerate() {
        pu[i] = -row.iter().map(|&c| c as i64).min().unwrap_or(0);
    }
    for (j, v) in pv.iter_mut().enumerate() {
        *v = cost
            .iter()
            .zip(&pu)
            .map(|(row, &u)| row[j] as i64 + u)
            .min()
            .unwrap_or(0);
    }
    let rc = |i: usize, j: usize, pu: &[i64], pv: &[i64]| cost[i][j] as i64 + pu[i] - pv[j];
    let mut flow = vec![vec![0u64; cols]; rows];
    let mut excess = supply.to_vec();
    let mut deficit = demand.to_vec();
    // Start with flow on tight edges only (a greedy fill), which keeps the invariant and in
    // practice leaves little for the shortest paths to route.
    for i in 0..rows {
        for j in 0..cols {
            if excess[i] == 0 {
                break;
            }
            if deficit[j] > 0 && rc(i, j, &pu, &pv) == 0 {
                let amount = excess[i].min(deficit[j]);
                flow[i][j] += amount;
                excess[i] -= amount;
                deficit[j] -= amount;
            }
        }
    }

    // Dijkstra over rows (ids 0..rows) and columns (ids rows..rows+cols).
    const INF: i64 = i64::MAX;
    let mut dist = vec![INF; rows + cols];
    let mut done = vec![false; rows + cols];
    let mut parent = vec![usize::MAX; rows + cols];
    let mut heap = BinaryHeap::new();
    while excess.iter().any(|&x| x > 0) {
        dist.fill(INF);
        done.fill(false);
        parent.fill(usize::MAX);
        heap.clear();
        for (i, &x) in excess.iter().enumerate() {
            if x > 0 {
                dist[i] = 0;
                heap.push(Reverse((0i64, i)));
            }
        }
        let mut target = None;
        while let Some(Reverse((d, u))) = heap.pop() {
            if done[u] || d > dist[u] {
                continue;
            }
            done[u] = true;
            if u < rows {
                for j in 0..cols {
                    let v = rows + j;
                    let nd = d + rc(u, j, &pu, &pv);
                    if !done[v] && nd < dist[v] {
                        dist[v] = nd;
                        parent[v] = u;
                        heap.push(Reverse((nd, v)));
                    }
                }
            } else {
                let j = u - rows;
                if deficit[j] > 0 {
                    target = Some(u);
                    break;
                }
                // Residual back edges: undo flow on (i, j), reduced cost −rc(i, j) = 0.
                for i in 0..rows {
                    if flow[i][j] > 0 {
                        let nd = d - rc(i, j, &pu, &pv);
                        if !done[i] && nd < dist[i] {
                            dist[i] = nd;
                            parent[i] = u;
                            heap.push(Reverse((nd, i)));
                        }
                    }
                }
            }
        }
        // Balanced totals and a complete bipartite graph: some deficit column is reachable.
        let t = target.expect("a column with unmet demand is reachable");
        let reach = dist[t];
        // New potentials p + min(dist, reach) keep reduced costs ≥ 0 and make the path tight.
        for (i, u) in pu.iter_mut().enumerate() {
            *u += dist[i].min(reach);
        }
        for (j, v) in pv.iter_mut().enumerate() {
            *v += dist[rows + j].min(reach);
        }
        // Walk the path back to its source: the amount is its tightest capacity.
        let mut amount = deficit[t - rows];
        let mut v = t;
        while parent[v] != usize::MAX {
            let u = parent[v];
            if u >= rows {
                amount = amount.min(flow[v][u - rows]);
            }
            v = u;
        }
        amount = amount.min(excess[v]);
        excess[v] -= amount;
        deficit[t - rows] -= amount;
        let mut v = t;
        while parent[v] != usize::MAX {
            let u = parent[v];
            if u < rows {
                flow[u][v - rows] += amount;
            } else {
                flow[v][u - rows] -= amount;
            }
            v = u;
        }
    }
    Ok(flow)
}

fn check(cost: &[Vec<u64>], supply: &[u64], demand: &[u64]) -> Result<(), TransportError> {
    if cost.len() != supply.len() {
        return Err(TransportError::RowCount {
            rows: cost.len(),
            supplies: supply.len(),
        });
    }
    for (row, r) in cost.iter().enumerate() {
        if r.len() != demand.len() {
            return Err(TransportError::RowLength {
                row,
                got: r.len(),
                demands: demand.len(),
            });
        }
        if let Some(col) = r.iter().position(|&c| c > MAX_UNIT_COST) {
            return Err(TransportError::CostTooLarge {
                row,
                col,
                cost: r[col],
                max: MAX_UNIT_COST,
            });
        }
    }
    let s: u128 = supply.iter().map(|&x| u128::from(x)).sum();
    let d: u128 = demand.iter().map(|&x| u128::from(x)).sum();
    if s != d {
        return Err(TransportError::Unbalanced {
            supply: s,
            demand: d,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_the_cheap_diagonal() {
        let cost = vec![vec![0, 5], vec![5, 0]];
        let f = min_cost_transport(&cost, &[3, 2], &[3, 2]).unwrap();
        assert_eq!(f, vec![vec![3, 0], vec![0, 2]]);
    }

    #[test]
    fn reroutes_through_back_edges() {
        // The greedy fill sends row 0 to column 0; the optimum needs row 1 there instead.
        let cost = vec![vec![0, 1], vec![0, 10]];
        let f = min_cost_transport(&cost, &[1, 1], &[1, 1]).unwrap();
        assert_eq!(f, vec![vec![0, 1], vec![1, 0]]);
    }

    #[test]
    fn bad_inputs_are_errors() {
        assert!(matches!(
            min_cost_transport(&[vec![1]], &[1], &[2]),
            Err(TransportError::Unbalanced { .. })
        ));
        assert!(matches!(
            min_cost_transport(&[vec![1, 2]], &[1], &[1]),
            Err(TransportError::RowLength { .. })
        ));
        assert!(matches!(
            min_cost_transport(&[vec![u64::MAX]], &[1], &[1]),
            Err(TransportError::CostTooLarge { .. })
        ));
        assert_eq!(
            min_cost_transport(&[], &[], &[]).unwrap(),
            Vec::<Vec<u64>>::new()
        );
    }
}
