//! The dispatcher's data path of one MoE layer on this rank, through `lazarus-kernels`.
//!
//! [`LayerRoute`] holds the send position of every local row and moves rows between local
//! order and the send layout of the layer's [`DispatchPlan`]:
//!
//! * **positions** — [`DispatchTables::from_plan`] for this rank, then `send_positions` of the
//!   rows' expert ids (which also checks the per-expert counts against the plan: a row routed
//!   to an unknown expert or counts that disagree are an error, never a panic);
//! * **send buffers** ([`LayerRoute::send_buffers`]) — `permute_rows` with top_k = 1 (at this
//!   level a row is one slot: `run_layer` receives per-expert batches), split per destination
//!   by `plan.send_counts[me]`: what [`Communicator::all_to_all_v`] sends;
//! * **reverse** ([`LayerRoute::unpermute`]) — the buffers that come back (one per destination,
//!   in send order), concatenated and un-permuted into local order with `unpermute_rows`, the
//!   exact inverse of the permutation (rows copied bit for bit).
//!
//! Where it runs: on the CPU references (`lazarus_kernels::cpu`) on host copies of the rows,
//! unless (feature `cuda`) the rows live on a CUDA device. Then the positions, the permutation
//! and the un-permute run as the crate's CUDA kernels on that device, launched on **candle's own
//! stream** of the device (`CudaDevice::cuda_stream` of candle 0.11;
//! for a device opened with `Device::new_cuda` that is the per-thread default stream, and the
//! layer's forward and backward run on the worker's thread like the candle ops around them),
//! so they are ordered with candle's work on the same rows without any extra synchronisation:
//! the expert ids go up once (the position kernels then bring the per-expert counts down to
//! check them against the plan), the permuted send buffer comes down in one device-to-host
//! copy (the [`Communicator`] moves host `Vec<f32>`), and the returned rows go up in one
//! host-to-device copy and are un-permuted on the device into a fresh tensor. The kernel module
//! is loaded once per device ([`Kernels`]). Both paths copy rows bit for bit, so they give the
//! same results (`kernels/tests/device.rs` compares the kernels with the references on a GPU).
//!
//! [`Communicator`]: crate::comm::Communicator
//! [`Communicator::all_to_all_v`]: crate::comm::Communicator::all_to_all_v

use candle_core::{DType, Device, Result, Tensor};
use lazarus_kernels::{DispatchTables, KernelError, cpu};
use lazarus_planner::dispatch::DispatchPlan;

/// Without a backtrace, as `super::fsep::wrap`.
fn kerr(e: KernelError) -> candle_core::Error {
    candle_core::Error::Wrapped(Box::new(e))
}

/// Whether a layer whose rows live on `device` is routed on that device (feature `cuda` and
/// a CUDA device); otherwise the rows are routed on host copies.
pub(super) fn routes_on_device(device: &Device) -> bool {
    cfg!(feature = "cuda") && device.is_cuda()
}

/// The dispatch kernels loaded per CUDA device (empty without feature `cuda`).
#[derive(Default)]
pub(super) struct Kernels {
    #[cfg(feature = "cuda")]
    loaded: Vec<(
        candle_core::CudaDevice,
        lazarus_kernels::cuda::DispatchKernels,
    )>,
}

#[cfg(feature = "cuda")]
impl Kernels {
    /// The kernels of `dev`, on candle's stream of it (loaded on first use).
    fn on(
        &mut self,
        dev: &candle_core::CudaDevice,
    ) -> Result<lazarus_kernels::cuda::DispatchKernels> {
        if let Some((_, k)) = self.loaded.iter().find(|(d, _)| d.id() == dev.id()) {
            return Ok(k.clone());
        }
        let k = lazarus_kernels::cuda::DispatchKernels::new(dev.cuda_stream()).map_err(kerr)?;
        self.loaded.push((dev.clone(), k.clone()));
        Ok(k)
    }
}

/// Where a [`LayerRoute`] keeps its positions and moves its rows.
enum At {
    /// CPU references on host copies.
    Host { pos: Vec<u32> },
    /// CUDA kernels on the rows' device.
    #[cfg(feature = "cuda")]
    Cuda(Box<gpu::Route>),
}

/// The send positions of one layer's local rows on this rank, and the moves between local
/// order and the plan's send layout (see the [module docs](self)).
pub(super) struct LayerRoute {
    /// Row length.
    d: usize,
    /// Local rows (= slots, top_k = 1).
    rows: usize,
    /// `plan.send_counts[me]`: rows per destination.
    send_counts: Vec<u64>,
    /// `Σ send_counts` (equals `rows` once the counts are checked).
    send_rows: usize,
    at: At,
}

impl LayerRoute {
    /// The route of this rank's rows (`token_experts[i]`: the expert of local row `i`, rows of
    /// `d` values) in `plan`, on the rows' `device` (see [`routes_on_device`]).
    pub(super) fn new(
        kernels: &mut Kernels,
        plan: &DispatchPlan,
        me: usize,
        token_experts: &[u32],
        d: usize,
        device: &Device,
    ) -> Result<Self> {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(dev) = device {
            let tables = DispatchTables::from_plan(plan, me).map_err(kerr)?;
            let route = gpu::Route::new(kernels.on(dev)?, dev, token_experts, &tables)?;
            let at = At::Cuda(Box::new(route));
            return Self::with(plan, me, &tables, token_experts.len(), d, at);
        }
        let _ = (kernels, device);
        Self::host(plan, me, token_experts, d)
    }

    /// The route on the CPU references, wherever the rows live.
    pub(super) fn host(
        plan: &DispatchPlan,
        me: usize,
        token_experts: &[u32],
        d: usize,
    ) -> Result<Self> {
        let tables = DispatchTables::from_plan(plan, me).map_err(kerr)?;
        let pos = cpu::send_positions(token_experts, &tables).map_err(kerr)?;
        Self::with(plan, me, &tables, token_experts.len(), d, At::Host { pos })
    }

    fn with(
        plan: &DispatchPlan,
        me: usize,
        tables: &DispatchTables,
        rows: usize,
        d: usize,
        at: At,
    ) -> Result<Self> {
        if d == 0 {
            candle_core::bail!("dispatch: rows of length 0");
        }
        // `send_positions` checked the counts: every local row is sent exactly once.
        if tables.send_rows != rows {
            candle_core::bail!(
                "dispatch: the plan sends {} rows of rank {me}, {rows} given",
                tables.send_rows
            );
        }
        Ok(Self {
            d,
            rows,
            send_counts: plan.send_counts[me].clone(),
            send_rows: tables.send_rows,
            at,
        })
    }

    /// The local rows `x` (`rows × d`, any float dtype: sent as f32) permuted into the send
    /// layout, split per destination (`send_counts[dst]` rows each).
    pub(super) fn send_buffers(&self, x: &Tensor) -> Result<Vec<Vec<f32>>> {
        let d = self.d;
        if x.elem_count() != self.rows * d {
            candle_core::bail!(
                "dispatch: {:?} holds {} values, expected {} rows of {d}",
                x.shape(),
                x.elem_count(),
                self.rows
            );
        }
        let mut flat = match &self.at {
            At::Host { pos } => {
                let x = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                cpu::permute_rows(&x, d, 1, pos, self.send_rows).map_err(kerr)?
            }
            #[cfg(feature = "cuda")]
            At::Cuda(r) => r.permute(x, d, self.rows)?,
        };
        // Split from the back, so that every buffer is moved out once.
        let mut out = Vec::with_capacity(self.send_counts.len());
        for &c in self.send_counts.iter().rev() {
            let start = flat.len() - c as usize * d;
            out.push(flat.split_off(start));
        }
        out.reverse();
        Ok(out)
    }

    /// Inverse of [`Self::send_buffers`]: the buffers that came back (one per destination, in
    /// send order) as the local rows, a `rows × d` f32 tensor where the route runs (the CPU,
    /// or the rows' CUDA device).
    pub(super) fn unpermute(&self, back: &[Vec<f32>]) -> Result<Tensor> {
        let d = self.d;
        let got: usize = back.iter().map(Vec::len).sum();
        if back.len() != self.send_counts.len() || got != self.send_rows * d {
            candle_core::bail!(
                "reverse exchange returned {got} values in {} buffers, expected {} in {}",
                back.len(),
                self.send_rows * d,
                self.send_counts.len()
            );
        }
        let flat = back.concat();
        match &self.at {
            At::Host { pos } => {
                let out = cpu::unpermute_rows(&flat, d, pos, self.rows).map_err(kerr)?;
                Tensor::from_vec(out, (self.rows, d), &Device::Cpu)
            }
            #[cfg(feature = "cuda")]
            At::Cuda(r) => r.unpermute(&flat, d, self.rows),
        }
    }
}

/// A device copy of an f32 CUDA tensor's values, as the storage a custom op's `cuda_fwd`
/// returns (the exchange op hands out the layer's outputs this way).
#[cfg(feature = "cuda")]
pub(super) fn cuda_storage_of(t: &Tensor) -> Result<candle_core::CudaStorage> {
    gpu::storage_of(t)
}

#[cfg(feature = "cuda")]
mod gpu {
    //! The CUDA half of [`super::LayerRoute`]: everything on candle's stream of the device.

    use super::kerr;
    use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DriverError};
    use candle_core::op::BackpropOp;
    use candle_core::{CudaDevice, CudaStorage, DType, Device, Result, Storage, Tensor};
    use lazarus_kernels::DispatchTables;
    use lazarus_kernels::cuda::DispatchKernels;

    fn drv(op: &'static str) -> impl Fn(DriverError) -> candle_core::Error {
        move |e| candle_core::Error::Msg(format!("dispatch: {op}: CUDA error: {e:?}"))
    }

    /// Positions on the device and the kernels that use them.
    pub(super) struct Route {
        kernels: DispatchKernels,
        dev: CudaDevice,
        /// `pos[i]`: send row of local row `i` (at least one word: empty rows allocate one).
        pos: CudaSlice<u32>,
    }

    impl Route {
        /// Uploads the expert ids, counts them on the device (an unknown expert is an error),
        /// checks the counts against the plan and computes the positions.
        pub(super) fn new(
            kernels: DispatchKernels,
            dev: &CudaDevice,
            token_experts: &[u32],
            tables: &DispatchTables,
        ) -> Result<Self> {
            let s = kernels.stream().clone();
            let pos = if token_experts.is_empty() {
                tables
                    .check_counts(&vec![0; tables.experts])
                    .map_err(kerr)?;
                s.alloc_zeros::<u32>(1).map_err(drv("alloc"))?
            } else {
                let experts = s
                    .clone_htod(token_experts)
                    .map_err(drv("upload expert ids"))?;
                let counts = kernels.count(&experts, tables.experts).map_err(kerr)?;
                kernels.positions(&experts, &counts, tables).map_err(kerr)?
            };
            Ok(Self {
                kernels,
                dev: dev.clone(),
                pos,
            })
        }

        /// `x` (`rows × d` values on this device) permuted into the send layout, brought to
        /// the host in one copy.
        pub(super) fn permute(&self, x: &Tensor, d: usize, rows: usize) -> Result<Vec<f32>> {
            let n = rows * d;
            if n == 0 {
                return Ok(Vec::new());
            }
            if !x.device().same_device(&Device::Cuda(self.dev.clone())) {
                candle_core::bail!(
                    "dispatch: rows on {:?}, routed on another device",
                    x.device()
                );
            }
            let x = x.to_dtype(DType::F32)?.contiguous()?;
            let s = self.kernels.stream();
            let mut send = s.alloc_zeros::<f32>(n).map_err(drv("alloc"))?;
            {
                let (storage, layout) = x.storage_and_layout();
                let Storage::Cuda(cs) = &*storage else {
                    candle_core::bail!("dispatch: a CUDA tensor without CUDA storage");
                };
                let start = layout.start_offset();
                let src = cs.as_cuda_slice::<f32>()?.slice(start..start + n);
                // SAFETY: f32 values read as pairs of 2-byte words: the kernel copies bits.
                let src = unsafe { src.transmute::<u16>(2 * n) };
                // SAFETY: as above; the send buffer is written as words, read back as f32.
                let dst = unsafe { send.transmute_mut::<u16>(2 * n) };
                let (Some(src), Some(mut dst)) = (src, dst) else {
                    candle_core::bail!("dispatch: f32 rows do not reinterpret as words");
                };
                self.kernels
                    .permute_view(&src, 2 * d, 1, &self.pos.as_view(), rows, &mut dst)
                    .map_err(kerr)?;
            }
            s.clone_dtoh(&send).map_err(drv("download the send buffer"))
        }

        /// The returned rows (send layout, on the host) uploaded in one copy and un-permuted on
        /// the device: a fresh `rows × d` f32 tensor.
        pub(super) fn unpermute(&self, flat: &[f32], d: usize, rows: usize) -> Result<Tensor> {
            let n = rows * d;
            let s = self.kernels.stream();
            // At least one word (no zero-size allocation; a larger storage than the shape is
            // fine). Every row is written by the kernel; zeros keep the allocation safe anyway.
            let mut out = s.alloc_zeros::<f32>(n.max(1)).map_err(drv("alloc"))?;
            if n > 0 {
                let back = s
                    .clone_htod(flat)
                    .map_err(drv("upload the returned rows"))?;
                // SAFETY: f32 values as pairs of 2-byte words (bits are copied).
                let src = unsafe { back.transmute::<u16>(2 * flat.len()) };
                // SAFETY: as above.
                let dst = unsafe { out.transmute_mut::<u16>(2 * n) };
                let (Some(src), Some(mut dst)) = (src, dst) else {
                    candle_core::bail!("dispatch: f32 rows do not reinterpret as words");
                };
                self.kernels
                    .unpermute_view(&src, 2 * d, &self.pos.as_view(), rows, &mut dst)
                    .map_err(kerr)?;
            }
            let storage = CudaStorage::wrap_cuda_slice(out, self.dev.clone());
            Ok(Tensor::from_storage(
                Storage::Cuda(storage),
                (rows, d),
                BackpropOp::none(),
                false,
            ))
        }
    }

    /// A device-to-device copy of `t`'s f32 values (contiguous, from its start offset).
    pub(super) fn storage_of(t: &Tensor) -> Result<CudaStorage> {
        let t = t.to_dtype(DType::F32)?.contiguous()?;
        let n = t.elem_count();
        let (storage, layout) = t.storage_and_layout();
        let Storage::Cuda(cs) = &*storage else {
            candle_core::bail!("moe-exchange: the layer's outputs are not on a CUDA device");
        };
        let start = layout.start_offset();
        let stream = cs.device.cuda_stream();
        let src = cs.as_cuda_slice::<f32>()?;
        let copy = if n == 0 {
            src.try_clone()
        } else {
            stream.clone_dtod(&src.slice(start..start + n))
        }
        .map_err(drv("copy the layer's outputs"))?;
        Ok(CudaStorage::wrap_cuda_slice(copy, cs.device.clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lazarus_planner::dispatch::plan;
    use rand::{Rng, RngExt, SeedableRng, rngs::StdRng};

    /// The pre-kernel data path, as the executor had it: rows gathered through
    /// `DispatchPlan::send_order`, split per destination, and scattered back.
    fn naive_send(local: &[f32], order: &[usize], counts: &[u64], d: usize) -> Vec<Vec<f32>> {
        let mut rows = order.iter().map(|&i| &local[i * d..(i + 1) * d]);
        counts
            .iter()
            .map(|&c| {
                let mut v = Vec::new();
                for _ in 0..c {
                    v.extend_from_slice(rows.next().unwrap());
                }
                v
            })
            .collect()
    }

    fn naive_back(sent: &[Vec<f32>], order: &[usize], d: usize) -> Vec<f32> {
        let flat = sent.concat();
        let mut out = vec![0f32; flat.len()];
        for (k, &i) in order.iter().enumerate() {
            out[i * d..(i + 1) * d].copy_from_slice(&flat[k * d..(k + 1) * d]);
        }
        out
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// Random routing of `world` ranks over `experts` experts (some ranks route nothing to some
    /// experts; every expert has at least one replica) and its plan.
    fn scenario(rng: &mut StdRng) -> (Vec<Vec<u32>>, DispatchPlan) {
        let world = rng.random_range(1..6);
        let experts = rng.random_range(1..7);
        let gate: Vec<Vec<u32>> = (0..world)
            .map(|_| {
                let n = rng.random_range(0..30);
                (0..n)
                    .map(|_| rng.random_range(0..experts as u32))
                    .collect()
            })
            .collect();
        let mut tokens = vec![vec![0u64; world]; experts];
        for (r, g) in gate.iter().enumerate() {
            for &e in g {
                tokens[e as usize][r] += 1;
            }
        }
        let replicas: Vec<Vec<u32>> = (0..experts)
            .map(|_| {
                let mut row: Vec<u32> = (0..world).map(|_| rng.random_range(0..3)).collect();
                row[rng.random_range(0..world)] += 1;
                row
            })
            .collect();
        (gate, plan(&tokens, &replicas).unwrap())
    }

    /// Values with signed zeros, infinities and NaN payloads among ordinary ones.
    fn values(rng: &mut StdRng, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| match rng.random_range(0..6) {
                0 => -0.0,
                1 => f32::from_bits(0x7fc0_0000 | rng.random_range(1..0x0040_0000)),
                2 => f32::from_bits(0xff80_0001),
                3 => f32::NEG_INFINITY,
                _ => f32::from_bits(rng.next_u32()),
            })
            .collect()
    }

    #[test]
    fn kernels_route_like_the_send_order_bit_for_bit() {
        let mut rng = StdRng::seed_from_u64(7);
        for _ in 0..300 {
            let (gate, p) = scenario(&mut rng);
            let d = rng.random_range(1..6);
            for (me, experts) in gate.iter().enumerate() {
                let rows = experts.len();
                let route =
                    LayerRoute::new(&mut Kernels::default(), &p, me, experts, d, &Device::Cpu)
                        .unwrap();
                let order = p.send_order(me, experts).unwrap();
                let x = values(&mut rng, rows * d);
                let xt = Tensor::from_vec(x.clone(), (rows, d), &Device::Cpu).unwrap();
                let send = route.send_buffers(&xt).unwrap();
                let want = naive_send(&x, &order, &p.send_counts[me], d);
                assert_eq!(send.len(), want.len());
                for (a, b) in send.iter().zip(&want) {
                    assert_eq!(bits(a), bits(b));
                }
                // The reverse: other rows come back in the same layout.
                let y = values(&mut rng, rows * d);
                let back = naive_send(&y, &order, &p.send_counts[me], d);
                let got = route.unpermute(&back).unwrap();
                assert_eq!(got.dims(), &[rows, d]);
                assert!(got.device().is_cpu());
                let got = got.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                assert_eq!(bits(&got), bits(&y));
                assert_eq!(bits(&got), bits(&naive_back(&back, &order, d)));
                // And the round trip of the send buffers themselves.
                let round = route.unpermute(&send).unwrap();
                let round = round.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                assert_eq!(bits(&round), bits(&x));
            }
        }
    }

    #[test]
    fn bad_routing_and_shapes_are_errors() {
        // Rank 0 routes 2 rows to expert 0, rank 1 one row to expert 1.
        let p = plan(&[vec![2, 0], vec![0, 1]], &[vec![1, 0], vec![0, 1]]).unwrap();
        let err = |r: Result<LayerRoute>| match r {
            Ok(_) => panic!("accepted"),
            Err(e) => e.to_string(),
        };
        // A row routed to an expert the plan does not have.
        let e = err(LayerRoute::host(&p, 0, &[0, 5], 3));
        assert!(e.contains("routed to expert 5"), "{e}");
        // Counts that disagree with the plan.
        let e = err(LayerRoute::host(&p, 0, &[0, 1], 3));
        assert!(
            e.contains("expert 0") && e.contains("plan dispatches 2"),
            "{e}"
        );
        let e = err(LayerRoute::host(&p, 0, &[0], 3));
        assert!(e.contains("plan dispatches 2"), "{e}");
        // A rank outside the plan; rows of length 0.
        let e = err(LayerRoute::host(&p, 2, &[0], 3));
        assert!(e.contains("rank 2 is out of range"), "{e}");
        let e = err(LayerRoute::host(&p, 0, &[0, 0], 0));
        assert!(e.contains("length 0"), "{e}");

        let route = LayerRoute::host(&p, 0, &[0, 0], 3).unwrap();
        // Rows of the wrong shape.
        let x = Tensor::zeros((3, 3), DType::F32, &Device::Cpu).unwrap();
        let e = route.send_buffers(&x).unwrap_err().to_string();
        assert!(e.contains("expected 2 rows of 3"), "{e}");
        // A short or ragged reverse exchange.
        let e = route
            .unpermute(&[vec![0.0; 3], vec![]])
            .unwrap_err()
            .to_string();
        assert!(e.contains("returned 3 values"), "{e}");
        let e = route.unpermute(&[vec![0.0; 6]]).unwrap_err().to_string();
        assert!(e.contains("in 1 buffers"), "{e}");
        // Other dtypes travel as f32.
        let x = Tensor::new(&[[1f32, 2., 3.], [4., 5., 6.]], &Device::Cpu)
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap();
        let send = route.send_buffers(&x).unwrap();
        assert_eq!(send, vec![vec![1., 2., 3., 4., 5., 6.], vec![]]);
    }

    /// With feature `cuda` and a device: the kernels' route gives the host route's bits (rows
    /// on the device, send buffers, un-permuted tensor on the device). Without a device (the
    /// link stub) it is skipped, unless `LZ_REQUIRE_GPU` is set.
    #[cfg(feature = "cuda")]
    #[test]
    fn cuda_route_matches_the_host_route() {
        let dev = match std::panic::catch_unwind(|| Device::new_cuda(0)) {
            Ok(Ok(dev)) => dev,
            other => {
                assert!(
                    std::env::var_os("LZ_REQUIRE_GPU").is_none(),
                    "LZ_REQUIRE_GPU is set but no CUDA device opened"
                );
                eprintln!("no CUDA device, comparison skipped ({})", other.is_ok());
                return;
            }
        };
        let mut kernels = Kernels::default();
        let mut rng = StdRng::seed_from_u64(11);
        for _ in 0..50 {
            let (gate, p) = scenario(&mut rng);
            let d = rng.random_range(1..12);
            for (me, experts) in gate.iter().enumerate() {
                let rows = experts.len();
                let host = LayerRoute::host(&p, me, experts, d).unwrap();
                let gpu = LayerRoute::new(&mut kernels, &p, me, experts, d, &dev).unwrap();
                let x = values(&mut rng, rows * d);
                let xh = Tensor::from_vec(x.clone(), (rows, d), &Device::Cpu).unwrap();
                let xd = xh.to_device(&dev).unwrap();
                let want = host.send_buffers(&xh).unwrap();
                let got = gpu.send_buffers(&xd).unwrap();
                assert_eq!(want.len(), got.len());
                for (a, b) in want.iter().zip(&got) {
                    assert_eq!(bits(a), bits(b));
                }
                let y = gpu.unpermute(&got).unwrap();
                assert!(y.device().is_cuda());
                let y = y.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                assert_eq!(bits(&y), bits(&x));
            }
        }
        // An unknown expert is an error on the device too.
        let p = plan(&[vec![2, 0], vec![0, 1]], &[vec![1, 0], vec![0, 1]]).unwrap();
        assert!(LayerRoute::new(&mut kernels, &p, 0, &[0, 5], 3, &dev).is_err());
    }

    #[test]
    fn a_rank_without_rows_routes_nothing() {
        let p = plan(&[vec![0, 2]], &[vec![1, 1]]).unwrap();
        let route = LayerRoute::host(&p, 0, &[], 4).unwrap();
        let x = Tensor::zeros((0, 4), DType::F32, &Device::Cpu).unwrap();
        assert_eq!(route.send_buffers(&x).unwrap(), vec![Vec::<f32>::new(); 2]);
        let y = route.unpermute(&[vec![], vec![]]).unwrap();
        assert_eq!(y.dims(), &[0, 4]);
    }
}
