//! [`DistributedExperts`]: expert execution across workers (see the [module docs](super)).

use super::dispatch::{self, LayerRoute};
use super::fsep::{self, ShardGrads, SharedShards, Traffic, bytes_to_others};
use crate::comm::{Communicator, Rank};
use crate::model::{DenseModel, ExpertExec, ExpertState, ExpertStore, ExpertWeights, ShardStore};
use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Result, Shape, Tensor, Var};
use lazarus_planner::dispatch::{DispatchPlan, RecvBlock, plan};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

/// A communicator (or other library) error as a candle error, without the backtrace
/// `candle_core::Error::wrap` captures when `RUST_BACKTRACE` is set: capturing one walks the
/// stack on every failed collective, and displaying it resolves symbols (the first time in a
/// process, seconds of reading debug information: `worker::managed::error_text`).
fn wrap<E: std::error::Error + Send + Sync + 'static>(e: E) -> candle_core::Error {
    fsep::wrap(e)
}

/// Fails when the communicator was aborted (a peer is gone, or the controller said so): the
/// step is lost, so the rest of this rank's expert compute would be wasted, and its report
/// waits for it ([`crate::comm::Communicator::is_aborted`]).
fn check_live(inner: &Inner) -> Result<()> {
    if inner.comm.is_aborted() {
        return Err(wrap(crate::comm::CommError::Aborted));
    }
    Ok(())
}

/// What one forward exchange of one MoE layer did on this worker.
#[derive(Debug, Clone)]
pub struct LayerLog {
    pub layer: usize,
    /// The dispatch plan (identical on every worker).
    pub plan: DispatchPlan,
    /// `[expert]` rows this worker actually ran through its replica of the expert.
    pub computed: Vec<u64>,
}

/// The backward of this rank's experts for the rows it received in a layer's forward
/// exchange: `dL/dx` of every row (receive layout), the weight gradients added to
/// `inner.grads`.
fn backward_experts(
    inner: &mut Inner,
    layer: usize,
    d: usize,
    recv_x: &[f32],
    recv_g: &[f32],
    groups: &BTreeMap<usize, Vec<RecvBlock>>,
) -> Result<Vec<f32>> {
    let mut dx_recv = vec![0f32; recv_g.len()];
    let t = CpuClock::start();
    for (&e, blocks) in groups {
        check_live(inner)?;
        let w = inner.weights(layer, e)?.clone();
        let dev = w.w1.device().clone();
        let n = blocks.iter().map(|b| b.len as usize).sum::<usize>();
        let x = Tensor::from_vec(gather(recv_x, blocks, d), (n, d), &dev)?;
        let gy = Tensor::from_vec(gather(recv_g, blocks, d), (n, d), &dev)?;
        let xv = Var::from_tensor(&x)?;
        let y = w.forward(xv.as_tensor())?;
        let grads = (y * gy)?.sum_all()?.backward()?;
        let dx = match grads.get(xv.as_tensor()) {
            Some(t) => t.flatten_all()?.to_vec1::<f32>()?,
            None => vec![0f32; n * d],
        };
        scatter(&mut dx_recv, blocks, d, &dx);
        // Detached: candle leaves a variable's gradient attached to the forward graph.
        let g1 = match grads.get(&w.w1) {
            Some(t) => t.detach(),
            None => w.w1.zeros_like()?,
        };
        let g2 = match grads.get(&w.w2) {
            Some(t) => t.detach(),
            None => w.w2.zeros_like()?,
        };
        let acc = match inner.grads.remove(&(layer, e)) {
            Some((a1, a2)) => ((a1 + g1)?, (a2 + g2)?),
            None => (g1, g2),
        };
        inner.grads.insert((layer, e), acc);
    }
    inner.compute_ms += t.elapsed_ms();
    Ok(dx_recv)
}

/// The forward of this rank's experts for the rows it received: the outputs (receive
/// layout) and the rows each expert computed.
fn forward_experts(
    inner: &mut Inner,
    layer: usize,
    ne: usize,
    d: usize,
    recv_x: &[f32],
    groups: &BTreeMap<usize, Vec<RecvBlock>>,
) -> Result<(Vec<f32>, Vec<u64>)> {
    let mut y_recv = vec![0f32; recv_x.len()];
    let mut computed = vec![0u64; ne];
    let t0 = CpuClock::start();
    for (&e, blocks) in groups {
        check_live(inner)?;
        let w = inner.weights(layer, e)?;
        let wdev = w.w1.device().clone();
        let n = blocks.iter().map(|b| b.len as usize).sum::<usize>();
        let x = Tensor::from_vec(gather(recv_x, blocks, d), (n, d), &wdev)?;
        let y = w.forward(&x)?.detach();
        computed[e] += y.dim(0)? as u64;
        scatter(&mut y_recv, blocks, d, &y.flatten_all()?.to_vec1::<f32>()?);
    }
    inner.compute_ms += t0.elapsed_ms();
    inner.computed_rows += computed.iter().sum::<u64>();
    Ok((y_recv, computed))
}

/// A layer's dispatch plan from every rank's `counts` (one all-gather), with FSEP's
/// materialisation of the layer's experts (a collective too).
fn plan_layer(
    inner: &mut Inner,
    layer: usize,
    counts: &[u64],
    reps: &[Vec<u32>],
    world: usize,
) -> Result<DispatchPlan> {
    let ne = reps.len();
    let all = inner.comm.all_gather_u64(counts).map_err(wrap)?;
    let mut t = vec![vec![0u64; world]; ne];
    for (r, row) in all.iter().enumerate() {
        if row.len() != ne {
            candle_core::bail!("rank {r} reports {} experts, expected {ne}", row.len());
        }
        for (e, &c) in row.iter().enumerate() {
            t[e][r] = c;
        }
    }
    let p = plan(&t, reps).map_err(wrap)?;
    if let Some(sh) = inner.shards.clone() {
        let sh = lock_shards(&sh)?;
        let (ws, bytes) = fsep::materialise(inner.comm.as_mut(), &sh, layer, reps)?;
        inner.traffic.expert_param_bytes += bytes;
        for (e, w) in ws {
            inner.weights.insert((layer, e), w);
        }
    }
    for (e, row) in t.iter().enumerate() {
        *inner.routed.entry((layer, e)).or_insert(0) += row.iter().sum::<u64>();
    }
    Ok(p)
}

/// What a phantom pass's forward exchange of one layer leaves for its backward exchange: the
/// layer, its plan, the rows received and their blocks by expert.
type PhantomLayer = (
    usize,
    DispatchPlan,
    Vec<f32>,
    BTreeMap<usize, Vec<RecvBlock>>,
);

/// Mutable state shared by the executor and its custom ops (which run inside
/// `loss.backward()`).
struct Inner {
    comm: Box<dyn Communicator>,
    weights: BTreeMap<(usize, usize), ExpertWeights>,
    /// Expert weight gradients accumulated by backward exchanges since the last reset.
    grads: BTreeMap<(usize, usize), (Tensor, Tensor)>,
    /// Tokens routed to `(layer, expert)` over all workers since the last reset.
    routed: BTreeMap<(usize, usize), u64>,
    log: Vec<LayerLog>,
    /// FSEP: this rank's shards; `weights` then holds the experts materialised this step.
    shards: Option<SharedShards>,
    /// Bytes sent to other ranks since the last reset.
    traffic: Traffic,
    /// CPU time this rank's process spent computing its experts (forward and backward) since
    /// the last reset: the per-rank load a re-layout evens out (the wall step is equal on every
    /// rank, as the collectives synchronise them). CPU time, not wall time: workers sharing
    /// cores with each other (and with anything else) would otherwise measure the scheduler.
    compute_ms: f64,
    /// Token rows this rank ran through its experts in the forward since the last reset.
    computed_rows: u64,
    /// [`Communicator::payload_bytes_sent`] at the last reset.
    sent_bytes_at_reset: u64,
    /// Replicated re-layout in flight: the ranks that join each `(layer, expert)`'s gradient
    /// all-reduce without holding a replica yet (they add zeros and keep the result; see
    /// `model::shadow`).
    joining: BTreeMap<(usize, usize), Vec<Rank>>,
    /// `(d_model, d_ff)` and device of the zeros a joining rank contributes.
    joining_shape: Option<(usize, usize, usize, Device)>,
    /// The dispatch kernels of the CUDA devices layers ran on (feature `cuda`).
    kernels: dispatch::Kernels,
}

impl Inner {
    fn weights(&self, layer: usize, expert: usize) -> Result<&ExpertWeights> {
        match self.weights.get(&(layer, expert)) {
            Some(w) => Ok(w),
            None => candle_core::bail!(
                "rank {}: tokens of expert ({layer}, {expert}) arrived but no replica is held",
                self.comm.rank()
            ),
        }
    }
}

/// The blocks of the receive buffer grouped by expert, in layout order.
fn by_expert(layout: &[RecvBlock]) -> BTreeMap<usize, Vec<RecvBlock>> {
    let mut m: BTreeMap<usize, Vec<RecvBlock>> = BTreeMap::new();
    for b in layout {
        m.entry(b.expert).or_default().push(*b);
    }
    m
}

fn gather(buf: &[f32], blocks: &[RecvBlock], d: usize) -> Vec<f32> {
    let mut out = Vec::new();
    for b in blocks {
        let (s, n) = (b.start as usize * d, b.len as usize * d);
        out.extend_from_slice(&buf[s..s + n]);
    }
    out
}

fn scatter(out: &mut [f32], blocks: &[RecvBlock], d: usize, data: &[f32]) {
    let mut pos = 0;
    for b in blocks {
        let (s, n) = (b.start as usize * d, b.len as usize * d);
        out[s..s + n].copy_from_slice(&data[pos..pos + n]);
        pos += n;
    }
}

/// Splits a receive-layout buffer into per-source chunks (`counts[src]` rows each).
fn split_rows(buf: &[f32], counts: &[u64], d: usize) -> Vec<Vec<f32>> {
    let mut pos = 0;
    counts
        .iter()
        .map(|&c| {
            let n = c as usize * d;
            let v = buf[pos..pos + n].to_vec();
            pos += n;
            v
        })
        .collect()
}

/// Everything the backward exchange of one layer needs.
struct LayerCtx {
    layer: usize,
    rank: Rank,
    d: usize,
    plan: DispatchPlan,
    /// Send positions of the local rows and the permutations through the dispatch kernels
    /// (on the layer's CUDA device, or the CPU references on host copies).
    route: LayerRoute,
    /// Receive buffer of the forward exchange (inputs of the local experts).
    recv_x: Vec<f32>,
    groups: BTreeMap<usize, Vec<RecvBlock>>,
    /// The layer's outputs in local order (what the op's forward returns), `rows × d` f32 on
    /// the route's device.
    y_local: Tensor,
}

/// The custom op that carries the outputs forward and performs the reverse exchange in
/// backward.
struct ExchangeOp {
    shared: Arc<Mutex<Inner>>,
    ctx: Arc<LayerCtx>,
}

fn lock(m: &Mutex<Inner>) -> Result<MutexGuard<'_, Inner>> {
    m.lock()
        .map_err(|_| candle_core::Error::Msg("distributed experts: lock poisoned".into()))
}

fn lock_shards(m: &Mutex<ShardStore>) -> Result<MutexGuard<'_, ShardStore>> {
    m.lock()
        .map_err(|_| candle_core::Error::Msg("shard store: lock poisoned".into()))
}

/// Checks that a layout is `[layers][experts][world]` and computes every expert somewhere.
fn check_layout(
    replicas: &[Vec<Vec<u32>>],
    layers: usize,
    experts: usize,
    world: usize,
) -> Result<()> {
    if replicas.len() != layers {
        candle_core::bail!(
            "layout covers {} layers, the model has {layers}",
            replicas.len()
        );
    }
    for (l, layer) in replicas.iter().enumerate() {
        if layer.len() != experts {
            candle_core::bail!(
                "layout of layer {l} has {} experts, expected {experts}",
                layer.len()
            );
        }
        for (e, row) in layer.iter().enumerate() {
            if row.len() != world {
                candle_core::bail!("layout[{l}][{e}] has {} ranks, world {world}", row.len());
            }
            if row.iter().all(|&n| n == 0) {
                candle_core::bail!("layout computes expert {e} of layer {l} nowhere");
            }
        }
    }
    Ok(())
}

impl CustomOp1 for ExchangeOp {
    fn name(&self) -> &'static str {
        "moe-exchange"
    }

    fn cpu_fwd(&self, _s: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let shape = layout.shape().clone();
        if shape.elem_count() != self.ctx.y_local.elem_count() {
            candle_core::bail!("moe-exchange: input {shape:?} does not match the outputs");
        }
        let y = self.ctx.y_local.flatten_all()?.to_vec1::<f32>()?;
        Ok((CpuStorage::F32(y), shape))
    }

    /// The layer ran on a CUDA device (feature `cuda`): its outputs were un-permuted there.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _s: &candle_core::CudaStorage,
        layout: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let shape = layout.shape().clone();
        if shape.elem_count() != self.ctx.y_local.elem_count() {
            candle_core::bail!("moe-exchange: input {shape:?} does not match the outputs");
        }
        Ok((dispatch::cuda_storage_of(&self.ctx.y_local)?, shape))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let c = &*self.ctx;
        // dL/dy in the forward's send layout (permuted where the layer's rows live).
        let send = c.route.send_buffers(grad_res)?;
        let mut inner = lock(&self.shared)?;
        inner.traffic.token_bytes += bytes_to_others(&send, c.rank);
        let recv_g = inner.comm.all_to_all_v(send).map_err(wrap)?.concat();
        if recv_g.len() != c.recv_x.len() {
            candle_core::bail!("backward exchange: received {} values", recv_g.len());
        }
        let dx_recv = backward_experts(&mut inner, c.layer, c.d, &c.recv_x, &recv_g, &c.groups)?;
        let back = split_rows(&dx_recv, &c.plan.recv_counts[c.rank], c.d);
        inner.traffic.token_bytes += bytes_to_others(&back, c.rank);
        let back = inner.comm.all_to_all_v(back).map_err(wrap)?;
        drop(inner);
        let dx = c
            .route
            .unpermute(&back)?
            .to_device(arg.device())?
            .to_dtype(arg.dtype())?;
        Ok(Some(dx))
    }
}

/// Expert execution across workers: an [`ExpertExec`] whose `run_layer` dispatches tokens with
/// the Lazarus dispatch plan over a [`Communicator`] (see the [module docs](super)).
pub struct DistributedExperts {
    shared: Arc<Mutex<Inner>>,
    /// `[layer][expert][rank]` replicas (the `R` of the dispatch plan).
    replicas: Vec<Vec<Vec<u32>>>,
    rank: Rank,
    world: usize,
}

impl std::fmt::Debug for DistributedExperts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DistributedExperts")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("replicas", &self.replicas)
            .finish_non_exhaustive()
    }
}

impl DistributedExperts {
    /// `replicas[layer][expert][rank]`: how many replicas of each expert each rank holds; this
    /// rank's entries must be `> 0` exactly for the replicas in `store`.
    pub fn new(
        comm: Box<dyn Communicator>,
        store: &ExpertStore,
        replicas: Vec<Vec<Vec<u32>>>,
    ) -> Result<Self> {
        let (rank, world) = (comm.rank(), comm.world());
        if replicas.len() != store.n_layers() {
            candle_core::bail!(
                "replicas cover {} layers, the model has {}",
                replicas.len(),
                store.n_layers()
            );
        }
        let mut weights = BTreeMap::new();
        for (l, layer) in replicas.iter().enumerate() {
            for (e, row) in layer.iter().enumerate() {
                if row.len() != world {
                    candle_core::bail!("replicas[{l}][{e}] has {} ranks, world {world}", row.len());
                }
                let held = row[rank] > 0;
                if held != store.contains(l, e) {
                    candle_core::bail!(
                        "rank {rank}: plan says replica ({l}, {e}) held = {held}, store disagrees"
                    );
                }
                if let Some(w) = store.weights(l, e) {
                    weights.insert((l, e), w);
                }
            }
        }
        if let Some(&(l, e)) = store
            .replicas()
            .iter()
            .find(|(l, e)| replicas.get(*l).is_none_or(|r| r.get(*e).is_none()))
        {
            candle_core::bail!("rank {rank}: store holds ({l}, {e}) outside the plan");
        }
        Ok(Self {
            shared: Arc::new(Mutex::new(Inner {
                comm,
                weights,
                grads: BTreeMap::new(),
                routed: BTreeMap::new(),
                log: Vec::new(),
                shards: None,
                traffic: Traffic::default(),
                compute_ms: 0.0,
                computed_rows: 0,
                sent_bytes_at_reset: 0,
                joining: BTreeMap::new(),
                joining_shape: None,
                kernels: dispatch::Kernels::default(),
            })),
            replicas,
            rank,
            world,
        })
    }

    /// FSEP execution: this rank keeps only `shards` (its copies of the shards their
    /// placement gives it, of every expert) and materialises the experts that `replicas` (the
    /// layout, `[layer][expert][rank] > 0`: the same table the dispatch plan reads in
    /// replicated mode) assigns to it before each layer's forward; see the
    /// [runtime docs](super).
    pub fn new_sharded(
        comm: Box<dyn Communicator>,
        shards: SharedShards,
        replicas: Vec<Vec<Vec<u32>>>,
    ) -> Result<Self> {
        let (rank, world) = (comm.rank(), comm.world());
        {
            let sh = shards
                .lock()
                .map_err(|_| candle_core::Error::Msg("shard store: lock poisoned".into()))?;
            let outside = sh.holders().iter().flatten().any(|&r| r >= world);
            if sh.rank() != rank || outside {
                candle_core::bail!(
                    "shards of rank {} placed on {:?} on a mesh rank {rank} of {world}",
                    sh.rank(),
                    sh.holders()
                );
            }
            check_layout(&replicas, sh.n_layers(), sh.experts(), world)?;
        }
        Ok(Self {
            shared: Arc::new(Mutex::new(Inner {
                comm,
                weights: BTreeMap::new(),
                grads: BTreeMap::new(),
                routed: BTreeMap::new(),
                log: Vec::new(),
                shards: Some(shards),
                traffic: Traffic::default(),
                compute_ms: 0.0,
                computed_rows: 0,
                sent_bytes_at_reset: 0,
                joining: BTreeMap::new(),
                joining_shape: None,
                kernels: dispatch::Kernels::default(),
            })),
            replicas,
            rank,
            world,
        })
    }

    /// Whether experts are sharded (FSEP) rather than replicated.
    pub fn is_sharded(&self) -> Result<bool> {
        Ok(lock(&self.shared)?.shards.is_some())
    }

    /// FSEP: the shard store (None when replicated).
    pub fn shard_store(&self) -> Result<Option<SharedShards>> {
        Ok(lock(&self.shared)?.shards.clone())
    }

    /// FSEP re-layout: from the next step on, the experts are materialised and tokens
    /// dispatched by `replicas`. Only the index table changes; no state moves. Call it at a
    /// step boundary, with the same table on every rank.
    pub fn set_layout(&mut self, replicas: Vec<Vec<Vec<u32>>>) -> Result<()> {
        let inner = lock(&self.shared)?;
        let Some(sh) = &inner.shards else {
            candle_core::bail!("a re-layout without migration needs FSEP (sharded experts)");
        };
        let (layers, experts) = {
            let sh = lock_shards(sh)?;
            (sh.n_layers(), sh.experts())
        };
        check_layout(&replicas, layers, experts, self.world)?;
        drop(inner);
        self.replicas = replicas;
        Ok(())
    }

    /// Replicated re-layout in flight: from the next step on, the ranks `joining[(l, e)]`
    /// join expert `(l, e)`'s gradient all-reduce, a rank among them that holds no replica
    /// contributing zeros of `w1 (d_model, w1_cols)`, `w2 (d_ff, d_model)` on `device` (so the
    /// sum is the holders'; `w1_cols` is `MoeConfig::w1_cols`, 2·d_ff for SwiGLU) and
    /// getting the reduced gradient in [`Self::reduce_expert_grads`]' result. Every member
    /// must set the same table at the same step boundary.
    pub fn set_joining(
        &mut self,
        joining: BTreeMap<(usize, usize), Vec<Rank>>,
        d_model: usize,
        w1_cols: usize,
        d_ff: usize,
        device: Device,
    ) -> Result<()> {
        let mut inner = lock(&self.shared)?;
        if inner.shards.is_some() {
            candle_core::bail!("sharded experts move no replicas");
        }
        if joining.values().flatten().any(|&r| r >= self.world) {
            candle_core::bail!("a joining rank outside the {} ranks", self.world);
        }
        inner.joining = joining;
        inner.joining_shape = Some((d_model, w1_cols, d_ff, device));
        Ok(())
    }

    /// Replicated re-layout: from the next step on, tokens are dispatched by `replicas` and
    /// this rank computes with the replicas `store` now holds (exactly those `replicas` gives
    /// it); the joining table is cleared. Call it at a step boundary every rank agrees on.
    pub fn set_replicas(
        &mut self,
        store: &ExpertStore,
        replicas: Vec<Vec<Vec<u32>>>,
    ) -> Result<()> {
        let mut inner = lock(&self.shared)?;
        if inner.shards.is_some() {
            candle_core::bail!("sharded experts switch layouts with set_layout");
        }
        let experts = replicas.first().map_or(0, Vec::len);
        check_layout(&replicas, store.n_layers(), experts, self.world)?;
        let mut weights = BTreeMap::new();
        for (l, layer) in replicas.iter().enumerate() {
            for (e, row) in layer.iter().enumerate() {
                if (row[self.rank] > 0) != store.contains(l, e) {
                    candle_core::bail!(
                        "rank {}: the new layout and the store disagree on replica ({l}, {e})",
                        self.rank
                    );
                }
                if let Some(w) = store.weights(l, e) {
                    weights.insert((l, e), w);
                }
            }
        }
        if store.len() != weights.len() {
            candle_core::bail!(
                "rank {}: the store holds replicas outside the layout",
                self.rank
            );
        }
        inner.weights = weights;
        inner.joining.clear();
        inner.joining_shape = None;
        drop(inner);
        self.replicas = replicas;
        Ok(())
    }

    /// Milliseconds this rank spent computing its experts and the token rows it computed
    /// (forward) since [`Self::begin_step`].
    pub fn expert_compute(&self) -> Result<(f64, u64)> {
        let inner = lock(&self.shared)?;
        Ok((inner.compute_ms, inner.computed_rows))
    }

    /// Bytes this rank put on the network since [`Self::begin_step`]: every collective of the
    /// step (tokens, expert weights and gradients, dense gradients, counts), as its
    /// communicator counts them ([`Communicator::payload_bytes_sent`]).
    pub fn sent_bytes(&self) -> Result<u64> {
        let inner = lock(&self.shared)?;
        Ok(inner.comm.payload_bytes_sent() - inner.sent_bytes_at_reset)
    }

    /// Bytes this rank sent to other ranks since [`Self::begin_step`], by what they carried
    /// (the expert layer's exchanges only).
    pub fn traffic(&self) -> Result<Traffic> {
        Ok(lock(&self.shared)?.traffic)
    }

    /// FSEP: one AdamW update of this rank's copy of every shard in `grads` (from
    /// [`Self::reduce_shard_grads`]), each gradient multiplied by `factor`.
    pub fn step_shards(&mut self, grads: ShardGrads, factor: f64) -> Result<()> {
        let Some(sh) = self.shard_store()? else {
            candle_core::bail!("step_shards without sharded experts");
        };
        let mut sh = lock_shards(&sh)?;
        for ((l, e, w), g) in grads {
            sh.step_shard(w, l, e, &g, factor)?;
        }
        Ok(())
    }

    /// FSEP: whole expert states for the `(layer, expert)` pairs `writers` gives this rank
    /// (a collective: every rank calls it with the same `writers`), e.g. to write checkpoint
    /// parts.
    pub fn gather_experts(
        &mut self,
        writers: &BTreeMap<(usize, usize), Rank>,
    ) -> Result<Vec<ExpertState>> {
        let mut inner = lock(&self.shared)?;
        let Some(sh) = inner.shards.clone() else {
            candle_core::bail!("gather_experts without sharded experts");
        };
        let sh = lock_shards(&sh)?;
        fsep::gather_experts(inner.comm.as_mut(), &sh, writers)
    }

    pub fn rank(&self) -> Rank {
        self.rank
    }

    pub fn world(&self) -> usize {
        self.world
    }

    pub fn replicas(&self) -> &[Vec<Vec<u32>>] {
        &self.replicas
    }

    /// Forgets accumulated expert gradients, routed counts and logs (start of a step).
    pub fn begin_step(&mut self) -> Result<()> {
        let mut inner = lock(&self.shared)?;
        inner.grads.clear();
        inner.routed.clear();
        inner.log.clear();
        inner.traffic = Traffic::default();
        inner.compute_ms = 0.0;
        inner.computed_rows = 0;
        inner.sent_bytes_at_reset = inner.comm.payload_bytes_sent();
        if inner.shards.is_some() {
            inner.weights.clear();
        }
        Ok(())
    }

    /// The forward exchanges since [`Self::begin_step`], in call order.
    pub fn logs(&self) -> Result<Vec<LayerLog>> {
        Ok(lock(&self.shared)?.log.clone())
    }

    /// Locally accumulated (not yet all-reduced) expert gradients `(dL/dw1, dL/dw2)`.
    pub fn local_expert_grads(&self) -> Result<BTreeMap<(usize, usize), (Tensor, Tensor)>> {
        Ok(lock(&self.shared)?.grads.clone())
    }

    /// Runs `f` with the communicator (all collectives of the step go through it).
    pub fn with_comm<T>(&mut self, f: impl FnOnce(&mut dyn Communicator) -> T) -> Result<T> {
        let mut inner = lock(&self.shared)?;
        Ok(f(inner.comm.as_mut()))
    }

    /// FSEP: the reduce-scatter — this rank's copy of every shard of every expert with
    /// routed tokens, summed over the ranks that computed it (1-D, by `(layer, expert,
    /// shard)`; see `fsep::reduce_scatter`); the materialised weights are freed.
    pub fn reduce_shard_grads(&mut self) -> Result<ShardGrads> {
        let mut inner = lock(&self.shared)?;
        let Some(sh) = inner.shards.clone() else {
            candle_core::bail!("reduce_shard_grads without sharded experts");
        };
        let sh = lock_shards(&sh)?;
        let keys: Vec<(usize, usize)> = inner
            .routed
            .iter()
            .filter(|(_, n)| **n > 0)
            .map(|(k, _)| *k)
            .collect();
        let local = std::mem::take(&mut inner.grads);
        let (out, bytes) =
            fsep::reduce_scatter(inner.comm.as_mut(), &sh, &self.replicas, &keys, &local)?;
        inner.traffic.expert_grad_bytes += bytes;
        // The materialised experts were kept for backward; backward is done.
        inner.weights.clear();
        Ok(out)
    }

    /// Sums every held expert's gradients over the ranks holding a replica of it (ascending
    /// `(layer, expert)` order; a replica that computed nothing contributes zeros). Experts to
    /// which no worker routed a token this step are skipped (and absent from the result), as
    /// in the single-worker trainer. FSEP: [`Self::reduce_shard_grads`] instead.
    pub fn reduce_expert_grads(&mut self) -> Result<BTreeMap<(usize, usize), (Tensor, Tensor)>> {
        let mut inner = lock(&self.shared)?;
        if inner.shards.is_some() {
            candle_core::bail!("FSEP reduces gradient shards: use reduce_shard_grads");
        }
        let mut out = BTreeMap::new();
        let mut keys: std::collections::BTreeSet<(usize, usize)> =
            inner.weights.keys().copied().collect();
        for (k, ranks) in &inner.joining {
            if ranks.contains(&self.rank) {
                keys.insert(*k);
            }
        }
        for (l, e) in keys {
            if inner.routed.get(&(l, e)).copied().unwrap_or(0) == 0 {
                continue;
            }
            let mut group: Vec<Rank> = (0..self.world)
                .filter(|&r| self.replicas[l][e][r] > 0)
                .collect();
            if let Some(j) = inner.joining.get(&(l, e)) {
                group.extend(j);
                group.sort_unstable();
                group.dedup();
            }
            let (shape1, shape2, dev) = match (inner.weights.get(&(l, e)), &inner.joining_shape) {
                (Some(w), _) => (
                    w.w1.shape().clone(),
                    w.w2.shape().clone(),
                    w.w1.device().clone(),
                ),
                (None, Some((d, c, f, dev))) => ((*d, *c).into(), (*f, *d).into(), dev.clone()),
                (None, None) => candle_core::bail!("no shape for expert ({l}, {e})"),
            };
            let mut buf = match inner.grads.get(&(l, e)) {
                Some((a, b)) => {
                    let mut v = a.flatten_all()?.to_vec1::<f32>()?;
                    v.extend(b.flatten_all()?.to_vec1::<f32>()?);
                    v
                }
                // Computed nothing, or joining: zeros (exact: `x + 0.0 == x`).
                None => vec![0f32; shape1.elem_count() + shape2.elem_count()],
            };
            let n1 = shape1.elem_count();
            inner.comm.all_reduce_sum(&group, &mut buf).map_err(wrap)?;
            // The root receives from and sends back to each other member; the others send once.
            let copies = if group[0] == self.rank {
                group.len() - 1
            } else {
                1
            };
            inner.traffic.expert_grad_bytes += (4 * buf.len() * copies) as u64;
            let r1 = Tensor::from_slice(&buf[..n1], shape1, &dev)?;
            let r2 = Tensor::from_slice(&buf[n1..], shape2, &dev)?;
            out.insert((l, e), (r1, r2));
        }
        Ok(out)
    }

    /// [`Self::reduce_expert_grads`] then one [`ExpertStore::step_replica`] per reduced expert.
    pub fn step_experts(&mut self, store: &mut ExpertStore) -> Result<()> {
        for ((l, e), (g1, g2)) in self.reduce_expert_grads()? {
            store.step_replica(l, e, &g1, &g2)?;
        }
        Ok(())
    }

    /// One micro-batch round without data of its own (a global batch whose micro-batches do
    /// not divide evenly over the members, see `lazarus_planner::data`): every layer's forward
    /// exchange in layer order, then every backward exchange in reverse order, as a member
    /// with data runs them from its forward and `backward()`. This rank routes no token, so
    /// it adds nothing to the routed counts or the loss; it still computes its replicas (or
    /// shards) for the rows the others send it and accumulates their gradients.
    pub fn phantom_round(&mut self, d_model: usize) -> Result<()> {
        let (me, world) = (self.rank, self.world);
        let mut inner = lock(&self.shared)?;
        let ctxs = self.phantom_forwards(&mut inner, d_model)?;
        for (layer, p, recv_x, groups) in ctxs.into_iter().rev() {
            let recv_g = inner
                .comm
                .all_to_all_v(vec![Vec::new(); world])
                .map_err(wrap)?
                .concat();
            if recv_g.len() != recv_x.len() {
                candle_core::bail!("backward exchange: received {} values", recv_g.len());
            }
            let dx_recv = backward_experts(&mut inner, layer, d_model, &recv_x, &recv_g, &groups)?;
            let back = split_rows(&dx_recv, &p.recv_counts[me], d_model);
            inner.traffic.token_bytes += bytes_to_others(&back, me);
            inner.comm.all_to_all_v(back).map_err(wrap)?;
        }
        Ok(())
    }

    /// A forward pass without data of its own (held-out evaluation, which runs no backward):
    /// every layer's forward exchange in layer order with zero local rows, the forward of
    /// [`Self::phantom_round`] without its backward. Forward-only members skip the backward
    /// exchanges too (nothing calls `backward()`, so the exchange op's backward never runs),
    /// so the collectives still pair up.
    pub fn phantom_forward(&mut self, d_model: usize) -> Result<()> {
        let mut inner = lock(&self.shared)?;
        self.phantom_forwards(&mut inner, d_model)?;
        Ok(())
    }

    /// The forward exchanges of a phantom pass; what each layer's backward exchange needs.
    fn phantom_forwards(&self, inner: &mut Inner, d_model: usize) -> Result<Vec<PhantomLayer>> {
        let (me, world) = (self.rank, self.world);
        let mut ctxs = Vec::with_capacity(self.replicas.len());
        for (layer, reps) in self.replicas.iter().enumerate() {
            let ne = reps.len();
            let p = plan_layer(inner, layer, &vec![0u64; ne], reps, world)?;
            let recv_x = inner
                .comm
                .all_to_all_v(vec![Vec::new(); world])
                .map_err(wrap)?
                .concat();
            if recv_x.len() as u64 != p.recv_tokens(me) * d_model as u64 {
                candle_core::bail!("forward exchange: received {} values", recv_x.len());
            }
            let groups = by_expert(&p.recv_layout(me));
            let (y_recv, computed) = forward_experts(inner, layer, ne, d_model, &recv_x, &groups)?;
            let back = split_rows(&y_recv, &p.recv_counts[me], d_model);
            inner.traffic.token_bytes += bytes_to_others(&back, me);
            let got = inner.comm.all_to_all_v(back).map_err(wrap)?;
            if got.iter().any(|b| !b.is_empty()) {
                candle_core::bail!("reverse exchange: rows came back to a rank that sent none");
            }
            inner.log.push(LayerLog {
                layer,
                plan: p.clone(),
                computed,
            });
            ctxs.push((layer, p, recv_x, groups));
        }
        Ok(ctxs)
    }

    /// Sums the dense gradients over all ranks (one all-reduce, in
    /// [`DenseModel::named_vars`] order; a variable without gradient contributes zeros).
    /// Returns one gradient per dense variable, in that order (for `AdamW::step_with`).
    pub fn all_reduce_dense(
        &mut self,
        model: &DenseModel,
        grads: &candle_core::backprop::GradStore,
    ) -> Result<Vec<Option<Tensor>>> {
        let local = model
            .named_vars()
            .iter()
            .map(|(_, v)| grads.get(v.as_tensor()).cloned())
            .collect();
        self.all_reduce_dense_grads(model, local)
    }

    /// [`Self::all_reduce_dense`] of gradients already taken out of their store (one per
    /// dense variable, in order; summed over a step's micro-batches).
    pub fn all_reduce_dense_grads(
        &mut self,
        model: &DenseModel,
        local: Vec<Option<Tensor>>,
    ) -> Result<Vec<Option<Tensor>>> {
        let vars = model.named_vars();
        if local.len() != vars.len() {
            candle_core::bail!(
                "{} dense gradients for {} variables",
                local.len(),
                vars.len()
            );
        }
        let mut buf = Vec::new();
        let mut lens = Vec::with_capacity(vars.len());
        for ((_, v), g) in vars.iter().zip(local) {
            let g = match g {
                Some(g) => g.flatten_all()?.to_vec1::<f32>()?,
                None => vec![0f32; v.as_tensor().elem_count()],
            };
            lens.push(g.len());
            buf.extend(g);
        }
        let group: Vec<Rank> = (0..self.world).collect();
        lock(&self.shared)?
            .comm
            .all_reduce_sum(&group, &mut buf)
            .map_err(wrap)?;
        let mut pos = 0;
        let mut out = Vec::with_capacity(vars.len());
        for ((_, v), n) in vars.iter().zip(lens) {
            let t = v.as_tensor();
            out.push(Some(Tensor::from_slice(
                &buf[pos..pos + n],
                t.shape(),
                t.device(),
            )?));
            pos += n;
        }
        Ok(out)
    }
}

impl ExpertExec for DistributedExperts {
    /// One exchange for a single expert: a collective, so every worker must call it for the
    /// same `(layer, expert)` sequence (with at least one token each); prefer `run_layer`.
    fn run(&mut self, layer: usize, expert: usize, x: &Tensor) -> Result<Tensor> {
        let mut ys = self.run_layer(layer, &[(expert, x.clone())])?;
        Ok(ys.remove(0))
    }

    fn run_layer(&mut self, layer: usize, batches: &[(usize, Tensor)]) -> Result<Vec<Tensor>> {
        let Some(reps) = self.replicas.get(layer) else {
            candle_core::bail!("layer {layer} is not in the replica plan");
        };
        let ne = reps.len();
        if batches.is_empty() {
            // The backward exchange hangs off the layer's output: without a token there is no
            // node to run it from, and the peers would wait for us.
            candle_core::bail!("run_layer({layer}) without tokens is not supported");
        }
        let dev = batches[0].1.device().clone();
        let d = batches[0].1.dim(1)?;
        let mut counts = vec![0u64; ne];
        let mut token_experts = Vec::new();
        let mut xs = Vec::with_capacity(batches.len());
        let mut sizes = Vec::with_capacity(batches.len());
        for (e, x) in batches {
            let (n, dx) = x.dims2()?;
            if *e >= ne || dx != d {
                candle_core::bail!("run_layer({layer}): bad batch for expert {e}: {n}x{dx}");
            }
            counts[*e] += n as u64;
            token_experts.extend(std::iter::repeat_n(*e as u32, n));
            xs.push(x.to_dtype(DType::F32)?);
            sizes.push(n);
        }
        // On a CUDA device (feature `cuda`) the rows stay there and the dispatch kernels move
        // them; elsewhere the exchange works on a host copy (moved with differentiable
        // `to_device`).
        let x_all = Tensor::cat(&xs, 0)?;
        let x_all = if dispatch::routes_on_device(&dev) {
            x_all
        } else {
            x_all.to_device(&Device::Cpu)?
        };

        let mut inner = lock(&self.shared)?;
        let (me, world) = (self.rank, self.world);
        let p = plan_layer(&mut inner, layer, &counts, reps, world)?;
        let route = LayerRoute::new(
            &mut inner.kernels,
            &p,
            me,
            &token_experts,
            d,
            x_all.device(),
        )?;
        let send = route.send_buffers(&x_all)?;
        inner.traffic.token_bytes += bytes_to_others(&send, me);
        let recv_x = inner.comm.all_to_all_v(send).map_err(wrap)?.concat();
        if recv_x.len() as u64 != p.recv_tokens(me) * d as u64 {
            candle_core::bail!("forward exchange: received {} values", recv_x.len());
        }
        let groups = by_expert(&p.recv_layout(me));
        let (y_recv, computed) = forward_experts(&mut inner, layer, ne, d, &recv_x, &groups)?;
        let back = split_rows(&y_recv, &p.recv_counts[me], d);
        inner.traffic.token_bytes += bytes_to_others(&back, me);
        let back = inner.comm.all_to_all_v(back).map_err(wrap)?;
        let y_local = route.unpermute(&back)?;
        inner.log.push(LayerLog {
            layer,
            plan: p.clone(),
            computed,
        });
        drop(inner);

        let op = ExchangeOp {
            shared: Arc::clone(&self.shared),
            ctx: Arc::new(LayerCtx {
                layer,
                rank: me,
                d,
                plan: p,
                route,
                recv_x,
                groups,
                y_local,
            }),
        };
        let y = x_all.apply_op1(op)?.to_device(&dev)?;
        let dtype = batches[0].1.dtype();
        let mut out = Vec::with_capacity(sizes.len());
        let mut pos = 0;
        for n in sizes {
            out.push(y.narrow(0, pos, n)?.to_dtype(dtype)?);
            pos += n;
        }
        Ok(out)
    }
}

/// The CPU time of this process (every thread: the compute library may run its own), from
/// `CLOCK_PROCESS_CPUTIME_ID`; wall time where that clock is unavailable.
struct CpuClock {
    cpu_ms: Option<f64>,
    wall: std::time::Instant,
}

impl CpuClock {
    fn start() -> Self {
        Self {
            cpu_ms: process_cpu_ms(),
            wall: std::time::Instant::now(),
        }
    }

    fn elapsed_ms(&self) -> f64 {
        match (self.cpu_ms, process_cpu_ms()) {
            (Some(a), Some(b)) => (b - a).max(0.0),
            _ => self.wall.elapsed().as_secs_f64() * 1e3,
        }
    }
}

fn process_cpu_ms() -> Option<f64> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; the call only writes it.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    (rc == 0).then(|| ts.tv_sec as f64 * 1e3 + ts.tv_nsec as f64 / 1e6)
}
