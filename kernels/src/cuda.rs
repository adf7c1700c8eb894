//! The dispatch kernels on a CUDA device (feature `cuda`): `src/dispatch.cu`, compiled to PTX
//! for `compute_80` by `build.rs`, loaded through cudarc, with launch wrappers that check their
//! arguments (bad input is a [`KernelError`], never an out-of-bounds access).
//!
//! Typical step of one rank: [`DispatchKernels::count`] (the per-expert counts the ranks
//! all-gather) → the planner's [`DispatchPlan`](lazarus_planner::dispatch::DispatchPlan) →
//! [`DispatchKernels::positions`] with its [`DispatchTables`] → [`DispatchKernels::permute`]
//! (send buffer) → all-to-all, experts, all-to-all back → [`DispatchKernels::combine_f32`] or
//! [`DispatchKernels::combine_bf16`] (weighted), or [`DispatchKernels::unpermute`] (the exact
//! inverse of a top_k = 1 permutation, what the executor's workers use).
//!
//! The row kernels also come in `_view` forms ([`DispatchKernels::permute_view`],
//! [`DispatchKernels::unpermute_view`]) that take cudarc views, so that a caller can pass
//! memory it does not own as a [`CudaSlice`] of 2-byte words: e.g. a candle tensor's f32
//! storage, reinterpreted with `CudaView::transmute`. They pick the 16-byte variant only when
//! the rows are a multiple of 16 bytes *and* both buffers are 16-byte aligned.

use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr,
    DriverError, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;

use crate::{DispatchTables, KernelError, NO_POSITION, to_u32};

/// The PTX of `src/dispatch.cu` (ISA 9.0, target `compute_80`), as built by nvcc.
pub const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/dispatch.ptx"));

/// Threads per block of the counting and position kernels (`LZ_THREADS` in the source).
const THREADS: u32 = 256;
/// Warps per block (`LZ_WARPS`).
const WARPS: u32 = THREADS / 32;
/// Slots per block of the counting and position kernels.
const CHUNK: u32 = 4096;
/// Largest expert count the position kernel's shared memory holds ((1 + WARPS)·E words ≤ 48 KiB).
pub const MAX_EXPERTS: usize = 48 * 1024 / 4 / (1 + WARPS as usize);

fn cuda(op: &'static str) -> impl Fn(DriverError) -> KernelError {
    move |e| KernelError::Cuda {
        op,
        msg: format!("{e:?}"),
    }
}

/// Per-expert counts of one batch of slots, with the per-block counts the position kernel
/// reuses.
#[derive(Debug)]
pub struct Counts {
    /// `counts[e]`, on the host.
    pub counts: Vec<u32>,
    block_hist: CudaSlice<u32>,
    blocks: u32,
    slots: u32,
    experts: u32,
}

/// The loaded kernels of one device.
#[derive(Debug, Clone)]
pub struct DispatchKernels {
    stream: Arc<CudaStream>,
    histogram: CudaFunction,
    scan: CudaFunction,
    positions: CudaFunction,
    permute_v16: CudaFunction,
    permute_u16: CudaFunction,
    combine_f32: CudaFunction,
    combine_bf16: CudaFunction,
    unpermute_v16: CudaFunction,
    unpermute_u16: CudaFunction,
}

impl DispatchKernels {
    /// Loads the module on `stream`'s device.
    pub fn new(stream: Arc<CudaStream>) -> Result<Self, KernelError> {
        let module = stream
            .context()
            .load_module(Ptx::from_src(PTX))
            .map_err(cuda("load the dispatch kernels (cuModuleLoadData)"))?;
        let f = |name: &'static str| module.load_function(name).map_err(cuda(name));
        Ok(Self {
            histogram: f("lz_block_histogram")?,
            scan: f("lz_scan_blocks")?,
            positions: f("lz_send_positions")?,
            permute_v16: f("lz_permute_rows_v16")?,
            permute_u16: f("lz_permute_rows_u16")?,
            combine_f32: f("lz_combine_f32")?,
            combine_bf16: f("lz_combine_bf16")?,
            unpermute_v16: f("lz_unpermute_rows_v16")?,
            unpermute_u16: f("lz_unpermute_rows_u16")?,
            stream,
        })
    }

    /// Opens device `ordinal` and loads the kernels on its default stream. Fails cleanly (no
    /// panic) without a driver or device.
    pub fn on_device(ordinal: usize) -> Result<Self, KernelError> {
        let ctx = CudaContext::new(ordinal).map_err(cuda("open the CUDA device"))?;
        Self::new(ctx.default_stream())
    }

    /// The stream every launch goes to.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Per-expert slot counts of `experts` (device array of `n` expert ids), synchronizing to
    /// bring the counts to the host (they feed the planner). Errors on an expert id out of
    /// range.
    pub fn count(&self, experts: &CudaSlice<u32>, n_experts: usize) -> Result<Counts, KernelError> {
        let slots = to_u32("slots", experts.len() as u64)?;
        let e_n = to_u32("experts", n_experts as u64)?;
        if n_experts == 0 || n_experts > MAX_EXPERTS {
            return Err(KernelError::Shape(format!(
                "{n_experts} experts: the kernels take 1..={MAX_EXPERTS}"
            )));
        }
        let blocks = slots.div_ceil(CHUNK).max(1);
        let s = &self.stream;
        let mut block_hist = s
            .alloc_zeros::<u32>(blocks as usize * n_experts)
            .map_err(cuda("alloc"))?;
        let mut counts = s.alloc_zeros::<u32>(n_experts).map_err(cuda("alloc"))?;
        let mut bad = s.clone_htod(&[NO_POSITION]).map_err(cuda("htod"))?;
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: e_n * 4,
        };
        let mut b = s.launch_builder(&self.histogram);
        b.arg(experts)
            .arg(&slots)
            .arg(&e_n)
            .arg(&CHUNK)
            .arg(&mut block_hist)
            .arg(&mut counts)
            .arg(&mut bad);
        // SAFETY: argument types and order match `lz_block_histogram`; every buffer has the
        // length the kernel indexes (blocks·E, E, 1 words; `slots` ids).
        unsafe { b.launch(cfg) }.map_err(cuda("lz_block_histogram"))?;
        let bad = s.clone_dtoh(&bad).map_err(cuda("dtoh"))?[0];
        if bad != NO_POSITION {
            let e = s
                .clone_dtoh(&experts.slice(bad as usize..bad as usize + 1))
                .map_err(cuda("dtoh"))?[0];
            return Err(KernelError::UnknownExpert {
                slot: bad as usize,
                expert: e,
                experts: n_experts,
            });
        }
        let counts = s.clone_dtoh(&counts).map_err(cuda("dtoh"))?;
        Ok(Counts {
            counts,
            block_hist,
            blocks,
            slots,
            experts: e_n,
        })
    }

    /// Send-buffer row of every slot (the device twin of [`crate::cpu::send_positions`]).
    /// `counts` must come from [`count`](Self::count) on the same `experts`; they are checked
    /// against the plan's tables first.
    pub fn positions(
        &self,
        experts: &CudaSlice<u32>,
        counts: &Counts,
        tables: &DispatchTables,
    ) -> Result<CudaSlice<u32>, KernelError> {
        if experts.len() != counts.slots as usize || tables.experts != counts.experts as usize {
            return Err(KernelError::Shape(format!(
                "counts of {} slots over {} experts used with {} slots and a {}-expert plan",
                counts.slots,
                counts.experts,
                experts.len(),
                tables.experts
            )));
        }
        tables.check_counts(&counts.counts)?;
        let s = &self.stream;
        let ranks = to_u32("ranks", tables.ranks as u64)?;
        let mut base = s
            .alloc_zeros::<u32>(counts.block_hist.len())
            .map_err(cuda("alloc"))?;
        let mut b = s.launch_builder(&self.scan);
        b.arg(&counts.block_hist)
            .arg(&counts.blocks)
            .arg(&counts.experts)
            .arg(&mut base);
        // SAFETY: matches `lz_scan_blocks`; both buffers hold blocks·E words.
        unsafe {
            b.launch(LaunchConfig {
                grid_dim: (counts.experts.div_ceil(THREADS), 1, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .map_err(cuda("lz_scan_blocks"))?;
        let prefix = s.clone_htod(&tables.dst_prefix).map_err(cuda("htod"))?;
        let offsets = s.clone_htod(&tables.send_offsets).map_err(cuda("htod"))?;
        let mut pos = s
            .alloc_zeros::<u32>(experts.len().max(1))
            .map_err(cuda("alloc"))?;
        let mut b = s.launch_builder(&self.positions);
        b.arg(experts)
            .arg(&counts.slots)
            .arg(&counts.experts)
            .arg(&ranks)
            .arg(&CHUNK)
            .arg(&base)
            .arg(&prefix)
            .arg(&offsets)
            .arg(&mut pos);
        // SAFETY: matches `lz_send_positions`; the tables have E·(R+1) and R·E words, and the
        // counts were checked against them, so every rank stays inside its prefix row.
        unsafe {
            b.launch(LaunchConfig {
                grid_dim: (counts.blocks, 1, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: (1 + WARPS) * counts.experts * 4,
            })
        }
        .map_err(cuda("lz_send_positions"))?;
        Ok(pos)
    }

    /// The send buffer: `send[pos[s]] = x[s / top_k]`, rows of `row_words` 2-byte words (bf16
    /// rows: `hidden`; f32 rows: `2·hidden`). Uses 16-byte vectors when a row is a multiple of
    /// 16 bytes.
    pub fn permute(
        &self,
        x: &CudaSlice<u16>,
        row_words: usize,
        top_k: usize,
        pos: &CudaSlice<u32>,
        slots: usize,
        send: &mut CudaSlice<u16>,
    ) -> Result<(), KernelError> {
        self.permute_view(
            &x.as_view(),
            row_words,
            top_k,
            &pos.as_view(),
            slots,
            &mut send.as_view_mut(),
        )
    }

    /// [`permute`](Self::permute) on views (see the [module docs](self): 16-byte vectors only
    /// when both buffers are 16-byte aligned).
    pub fn permute_view(
        &self,
        x: &CudaView<'_, u16>,
        row_words: usize,
        top_k: usize,
        pos: &CudaView<'_, u32>,
        slots: usize,
        send: &mut CudaViewMut<'_, u16>,
    ) -> Result<(), KernelError> {
        if top_k == 0 || !slots.is_multiple_of(top_k) || pos.len() < slots || row_words == 0 {
            return Err(KernelError::Shape(format!(
                "permute: {slots} slots, top_k {top_k}, {} positions, rows of {row_words} words",
                pos.len()
            )));
        }
        if x.len() != slots / top_k * row_words || !send.len().is_multiple_of(row_words) {
            return Err(KernelError::Shape(format!(
                "permute: x has {} words for {} tokens of {row_words}; send has {}",
                x.len(),
                slots / top_k,
                send.len()
            )));
        }
        let n = to_u32("slots", slots as u64)?;
        let k = to_u32("top_k", top_k as u64)?;
        to_u32("send words", send.len() as u64)?;
        let vec16 = row_words.is_multiple_of(8) && self.aligned16(x) && self.aligned16(&*send);
        let words = if vec16 { row_words / 8 } else { row_words };
        let w = to_u32("row words", words as u64)?;
        let s = &self.stream;
        let mut b = s.launch_builder(if vec16 {
            &self.permute_v16
        } else {
            &self.permute_u16
        });
        b.arg(x).arg(&w).arg(&k).arg(&n).arg(pos).arg(send);
        // SAFETY: matches `lz_permute_rows_*` (a u16 buffer read as uint4 only when rows are
        // 16-byte multiples and both buffers are 16-byte aligned, checked above). Positions come
        // from `positions`, a permutation of the send rows; the send buffer must hold them (a
        // position past its end is the caller's bug: the tables fix `send_rows`).
        unsafe { b.launch(row_cfg(n, w)) }.map_err(cuda("lz_permute_rows"))?;
        Ok(())
    }

    /// The un-permute (device twin of [`crate::cpu::unpermute_rows`]): `out[s] = back[pos[s]]`
    /// for `s < slots`, rows of `row_words` 2-byte words copied bit for bit; with the
    /// positions of a top_k = 1 permutation, the exact inverse of [`permute`](Self::permute).
    /// `back` holds whole rows (any number: the returned send buffer); `out` exactly `slots`
    /// rows, every one of them written (a slot whose position is [`NO_POSITION`] or past the end
    /// of `back` gets a zero row: the kernel never reads outside `back`, where the CPU reference
    /// reports an error), so it needs no initialisation.
    pub fn unpermute(
        &self,
        back: &CudaSlice<u16>,
        row_words: usize,
        pos: &CudaSlice<u32>,
        slots: usize,
        out: &mut CudaSlice<u16>,
    ) -> Result<(), KernelError> {
        self.unpermute_view(
            &back.as_view(),
            row_words,
            &pos.as_view(),
            slots,
            &mut out.as_view_mut(),
        )
    }

    /// [`unpermute`](Self::unpermute) on views (see the [module docs](self)).
    pub fn unpermute_view(
        &self,
        back: &CudaView<'_, u16>,
        row_words: usize,
        pos: &CudaView<'_, u32>,
        slots: usize,
        out: &mut CudaViewMut<'_, u16>,
    ) -> Result<(), KernelError> {
        if row_words == 0
            || !back.len().is_multiple_of(row_words)
            || pos.len() < slots
            || out.len() != slots * row_words
        {
            return Err(KernelError::Shape(format!(
                "unpermute: {slots} slots, {} positions, rows of {row_words} words, back has {} \
                 words, out {} (whole rows, one per slot)",
                pos.len(),
                back.len(),
                out.len()
            )));
        }
        let n = to_u32("slots", slots as u64)?;
        let back_rows = to_u32("back rows", (back.len() / row_words) as u64)?;
        to_u32("out words", out.len() as u64)?;
        let vec16 = row_words.is_multiple_of(8) && self.aligned16(back) && self.aligned16(&*out);
        let words = if vec16 { row_words / 8 } else { row_words };
        let w = to_u32("row words", words as u64)?;
        let mut b = self.stream.launch_builder(if vec16 {
            &self.unpermute_v16
        } else {
            &self.unpermute_u16
        });
        b.arg(back)
            .arg(&w)
            .arg(&back_rows)
            .arg(&n)
            .arg(pos)
            .arg(out);
        // SAFETY: matches `lz_unpermute_rows_*` (uint4 words only for 16-byte multiples on
        // 16-byte aligned buffers, checked above). `pos` holds at least `slots` words and `out`
        // exactly `slots` rows; the kernel reads `back` only at positions below `back_rows`.
        unsafe { b.launch(row_cfg(n, w)) }.map_err(cuda("lz_unpermute_rows"))?;
        Ok(())
    }

    /// Whether a buffer starts on a 16-byte boundary (the `uint4` kernels need it).
    fn aligned16<T>(&self, buf: &impl DevicePtr<T>) -> bool {
        let (ptr, _record) = buf.device_ptr(&self.stream);
        ptr % 16 == 0
    }

    /// The weighted combine in f32 (device twin of [`crate::cpu::combine`]).
    pub fn combine_f32(
        &self,
        back: &CudaSlice<f32>,
        hidden: usize,
        top_k: usize,
        pos: &CudaSlice<u32>,
        weights: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        let (t, k, h) = self.combine_shape(back.len(), hidden, top_k, pos, weights, out.len())?;
        let mut b = self.stream.launch_builder(&self.combine_f32);
        b.arg(back)
            .arg(pos)
            .arg(weights)
            .arg(&t)
            .arg(&k)
            .arg(&h)
            .arg(out);
        // SAFETY: matches `lz_combine_f32`; shapes checked by `combine_shape`.
        unsafe { b.launch(row_cfg(t, h)) }.map_err(cuda("lz_combine_f32"))?;
        Ok(())
    }

    /// The weighted combine on bf16 rows (bits as `u16`), f32 accumulation.
    pub fn combine_bf16(
        &self,
        back: &CudaSlice<u16>,
        hidden: usize,
        top_k: usize,
        pos: &CudaSlice<u32>,
        weights: &CudaSlice<f32>,
        out: &mut CudaSlice<u16>,
    ) -> Result<(), KernelError> {
        let (t, k, h) = self.combine_shape(back.len(), hidden, top_k, pos, weights, out.len())?;
        let mut b = self.stream.launch_builder(&self.combine_bf16);
        b.arg(back)
            .arg(pos)
            .arg(weights)
            .arg(&t)
            .arg(&k)
            .arg(&h)
            .arg(out);
        // SAFETY: matches `lz_combine_bf16`; shapes checked by `combine_shape`.
        unsafe { b.launch(row_cfg(t, h)) }.map_err(cuda("lz_combine_bf16"))?;
        Ok(())
    }

    fn combine_shape(
        &self,
        back_len: usize,
        hidden: usize,
        top_k: usize,
        pos: &CudaSlice<u32>,
        weights: &CudaSlice<f32>,
        out_len: usize,
    ) -> Result<(u32, u32, u32), KernelError> {
        let slots = weights.len();
        if hidden == 0
            || top_k == 0
            || !slots.is_multiple_of(top_k)
            || pos.len() < slots
            || out_len != slots / top_k * hidden
            || back_len < slots * hidden
        {
            return Err(KernelError::Shape(format!(
                "combine: {slots} weights, top_k {top_k}, hidden {hidden}, {} positions, back \
                 {back_len}, out {out_len}",
                pos.len()
            )));
        }
        // Positions index `back`, which must hold every row they name: `positions` gives a
        // permutation of 0..slots, and back has at least `slots` rows.
        Ok((
            to_u32("tokens", (slots / top_k) as u64)?,
            to_u32("top_k", top_k as u64)?,
            to_u32("hidden", hidden as u64)?,
        ))
    }
}

/// One block per row (grid-stride past 65 535·8 rows), up to 256 threads over its words (or, for
/// the combine, over a token's hidden values).
fn row_cfg(rows: u32, words: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.clamp(1, 65_535 * 8), 1, 1),
        block_dim: (words.clamp(32, 256).next_multiple_of(32), 1, 1),
        shared_mem_bytes: 0,
    }
}
