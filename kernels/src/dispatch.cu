// Data path of the flexible token dispatcher (Lazarus, arXiv 2407.04656, §4.3) on one source
// rank. The CPU references in `src/cpu.rs` define the results; the tests compare bit for bit
// (counts, positions, permutation) or within a tolerance (combine).
//
// Terms. A *slot* is one (token, choice) pair of the gate: slot s = t * top_k + j is the j-th
// expert chosen for token t, `experts[s]` its expert id. The planner's `DispatchPlan` says how
// many slots of expert e this rank sends to every destination (D[src][e][dst]); the send buffer
// is destination-major, expert-minor, and the slots of one expert keep their order of
// appearance and fill the destinations in rank order (`DispatchPlan::send_order`).
//
// Pipeline (all integer, deterministic, no floating point before the combine):
//   1. lz_block_histogram: per-block and total per-expert slot counts (the counts the ranks
//      all-gather to build the plan);
//   2. lz_scan_blocks: per-expert exclusive prefix over blocks;
//   3. lz_send_positions: the stable rank of every slot among the slots of its expert, mapped
//      through the plan's tables to its row in the send buffer: pos[s];
//   4. lz_permute_rows_*: send[pos[s]] = x[s / top_k] (row copy, 16-byte vectors when possible);
//   5. lz_combine_*: out[t] = sum_j w[t*top_k + j] * back[pos[t*top_k + j]] (f32 accumulation in
//      ascending j, i.e. the weighted un-permute after the return all-to-all);
//   6. lz_unpermute_rows_*: out[s] = back[pos[s]] (row copy: the exact inverse of step 4 for
//      top_k = 1, what the executor's workers use to bring rows back into local order).
//
// Targets: compiled to PTX for compute_80 (A100 and later; the driver JITs it for sm_90/sm_100);
// `kernels/build-ptx.sh` assembles it with ptxas for sm_80, sm_90, sm_100 and sm_120.

#include <cuda_bf16.h>
#include <stdint.h>

#define LZ_WARPS 8
#define LZ_THREADS (32 * LZ_WARPS)
#define LZ_NONE 0xffffffffu

// 1. Per-block and total per-expert counts. Shared memory: n_experts words.
// `bad` (one word, set to LZ_NONE by the host) receives the smallest index of a slot whose
// expert id is out of range.
extern "C" __global__ void lz_block_histogram(const uint32_t *__restrict__ experts, uint32_t n,
                                              uint32_t n_experts, uint32_t chunk,
                                              uint32_t *__restrict__ block_hist,
                                              uint32_t *__restrict__ counts,
                                              uint32_t *__restrict__ bad) {
    extern __shared__ uint32_t hist[];
    for (uint32_t e = threadIdx.x; e < n_experts; e += blockDim.x) hist[e] = 0;
    __syncthreads();
    const uint64_t begin = (uint64_t)blockIdx.x * chunk;
    const uint64_t end = min((uint64_t)n, begin + chunk);
    for (uint64_t s = begin + threadIdx.x; s < end; s += blockDim.x) {
        const uint32_t e = experts[s];
        if (e < n_experts) {
            atomicAdd(&hist[e], 1u);
        } else {
            atomicMin(bad, (uint32_t)s);
        }
    }
    __syncthreads();
    for (uint32_t e = threadIdx.x; e < n_experts; e += blockDim.x) {
        const uint32_t c = hist[e];
        block_hist[(uint64_t)blockIdx.x * n_experts + e] = c;
        if (c) atomicAdd(&counts[e], c);
    }
}

// 2. block_base[b][e] = sum_{b' < b} block_hist[b'][e]; one thread per expert.
extern "C" __global__ void lz_scan_blocks(const uint32_t *__restrict__ block_hist, uint32_t blocks,
                                          uint32_t n_experts, uint32_t *__restrict__ block_base) {
    const uint32_t e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= n_experts) return;
    uint32_t run = 0;
    for (uint32_t b = 0; b < blocks; ++b) {
        const uint64_t i = (uint64_t)b * n_experts + e;
        block_base[i] = run;
        run += block_hist[i];
    }
}

// 3. Send-buffer row of every slot. Launch with LZ_THREADS threads per block and the same
// `chunk` and grid as lz_block_histogram; shared memory (1 + LZ_WARPS) * n_experts words.
// dst_prefix[e * (ranks + 1) + j] = sum_{j' < j} D[src][e][j'];
// send_offsets[j * n_experts + e] = start of block (j, e) in the send buffer.
// A slot whose rank exceeds the plan (counts disagree with it) gets LZ_NONE; the host checks
// the counts first, so this only guards memory.
extern "C" __global__ void lz_send_positions(const uint32_t *__restrict__ experts, uint32_t n,
                                             uint32_t n_experts, uint32_t ranks, uint32_t chunk,
                                             const uint32_t *__restrict__ block_base,
                                             const uint32_t *__restrict__ dst_prefix,
                                             const uint32_t *__restrict__ send_offsets,
                                             uint32_t *__restrict__ pos) {
    extern __shared__ uint32_t sm[];
    uint32_t *run = sm;                // [n_experts]: slots of e seen before this round
    uint32_t *warp_cnt = sm + n_experts;  // [LZ_WARPS][n_experts]: this round, per warp
    for (uint32_t e = threadIdx.x; e < n_experts; e += blockDim.x) {
        run[e] = block_base[(uint64_t)blockIdx.x * n_experts + e];
    }
    for (uint32_t i = threadIdx.x; i < LZ_WARPS * n_experts; i += blockDim.x) warp_cnt[i] = 0;
    __syncthreads();

    const uint32_t lane = threadIdx.x & 31u;
    const uint32_t warp = threadIdx.x >> 5;
    const uint64_t begin = (uint64_t)blockIdx.x * chunk;
    const uint64_t end = min((uint64_t)n, begin + chunk);
    for (uint64_t base = begin; base < end; base += blockDim.x) {
        const uint64_t s = base + threadIdx.x;
        const uint32_t e = s < end ? experts[s] : LZ_NONE;
        const bool active = e < n_experts;
        // Lanes of this warp with the same expert, and how many of them come before this lane.
        const uint32_t same = __match_any_sync(0xffffffffu, e);
        const uint32_t before = same & ((1u << lane) - 1u);
        const bool leader = before == 0;
        if (active && leader) warp_cnt[warp * n_experts + e] = __popc(same);
        __syncthreads();
        uint32_t r = 0;
        if (active) {
            r = run[e] + __popc(before);
            for (uint32_t w = 0; w < warp; ++w) r += warp_cnt[w * n_experts + e];
        }
        __syncthreads();
        if (active && leader) {
            atomicAdd(&run[e], (uint32_t)__popc(same));
            warp_cnt[warp * n_experts + e] = 0;
        }
        __syncthreads();
        if (active) {
            // Destination j: the last j with dst_prefix[j] <= r (empty segments are skipped
            // because their successor has the same prefix).
            const uint32_t *pre = dst_prefix + (uint64_t)e * (ranks + 1);
            uint32_t p = LZ_NONE;
            if (r < pre[ranks]) {
                uint32_t lo = 0, hi = ranks;  // invariant: pre[lo] <= r < pre[hi]
                while (hi - lo > 1) {
                    const uint32_t mid = (lo + hi) >> 1;
                    if (pre[mid] <= r) lo = mid; else hi = mid;
                }
                p = send_offsets[(uint64_t)lo * n_experts + e] + (r - pre[lo]);
            }
            pos[s] = p;
        }
    }
}

// 4. send[pos[s]] = x[s / top_k], rows of `row_words` words. 16-byte vectors (rows a multiple
// of 16 bytes, 16-byte aligned buffers) or 2-byte words (any bf16/f16 row; f32 rows use it with
// twice the words). A slot with pos == LZ_NONE is skipped.
template <typename W>
__device__ __forceinline__ void permute_rows(const W *__restrict__ x, uint32_t row_words,
                                             uint32_t top_k, uint32_t n_slots,
                                             const uint32_t *__restrict__ pos,
                                             W *__restrict__ send) {
    for (uint32_t s = blockIdx.x; s < n_slots; s += gridDim.x) {
        const uint32_t p = pos[s];
        if (p == LZ_NONE) continue;
        const W *src = x + (uint64_t)(s / top_k) * row_words;
        W *dst = send + (uint64_t)p * row_words;
        for (uint32_t i = threadIdx.x; i < row_words; i += blockDim.x) dst[i] = src[i];
    }
}

extern "C" __global__ void lz_permute_rows_v16(const uint4 *__restrict__ x, uint32_t row_words,
                                               uint32_t top_k, uint32_t n_slots,
                                               const uint32_t *__restrict__ pos,
                                               uint4 *__restrict__ send) {
    permute_rows(x, row_words, top_k, n_slots, pos, send);
}

extern "C" __global__ void lz_permute_rows_u16(const uint16_t *__restrict__ x, uint32_t row_words,
                                               uint32_t top_k, uint32_t n_slots,
                                               const uint32_t *__restrict__ pos,
                                               uint16_t *__restrict__ send) {
    permute_rows(x, row_words, top_k, n_slots, pos, send);
}

// 5. out[t][i] = sum_{j < top_k} w[t * top_k + j] * back[pos[t * top_k + j]][i], accumulated in
// f32 in ascending j (fmaf), one block per token (grid-stride).
template <typename T>
__device__ __forceinline__ float lz_to_f32(T v);
template <>
__device__ __forceinline__ float lz_to_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ float lz_to_f32<__nv_bfloat16>(__nv_bfloat16 v) {
    return __bfloat162float(v);
}
template <typename T>
__device__ __forceinline__ T lz_from_f32(float v);
template <>
__device__ __forceinline__ float lz_from_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 lz_from_f32<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}

template <typename T>
__device__ __forceinline__ void combine(const T *__restrict__ back, const uint32_t *__restrict__ pos,
                                        const float *__restrict__ w, uint32_t n_tokens,
                                        uint32_t top_k, uint32_t hidden, T *__restrict__ out) {
    for (uint32_t t = blockIdx.x; t < n_tokens; t += gridDim.x) {
        for (uint32_t i = threadIdx.x; i < hidden; i += blockDim.x) {
            float acc = 0.0f;
            for (uint32_t j = 0; j < top_k; ++j) {
                const uint32_t s = t * top_k + j;
                const uint32_t p = pos[s];
                if (p == LZ_NONE) continue;
                acc = fmaf(w[s], lz_to_f32(back[(uint64_t)p * hidden + i]), acc);
            }
            out[(uint64_t)t * hidden + i] = lz_from_f32<T>(acc);
        }
    }
}

extern "C" __global__ void lz_combine_f32(const float *__restrict__ back,
                                          const uint32_t *__restrict__ pos,
                                          const float *__restrict__ w, uint32_t n_tokens,
                                          uint32_t top_k, uint32_t hidden,
                                          float *__restrict__ out) {
    combine(back, pos, w, n_tokens, top_k, hidden, out);
}

extern "C" __global__ void lz_combine_bf16(const __nv_bfloat16 *__restrict__ back,
                                           const uint32_t *__restrict__ pos,
                                           const float *__restrict__ w, uint32_t n_tokens,
                                           uint32_t top_k, uint32_t hidden,
                                           __nv_bfloat16 *__restrict__ out) {
    combine(back, pos, w, n_tokens, top_k, hidden, out);
}

// 6. out[s] = back[pos[s]], rows of `row_words` words (the same word types as step 4), one
// block per slot (grid-stride): the un-permute of a top_k = 1 permutation, bit for bit. A slot
// with pos == LZ_NONE, or a position past back's `back_rows` rows (never produced by
// lz_send_positions: it only guards memory; the CPU reference reports it as an error), gets a
// zero row, so `out` needs no initialisation.
template <typename W>
__device__ __forceinline__ void unpermute_rows(const W *__restrict__ back, uint32_t row_words,
                                               uint32_t back_rows, uint32_t n_slots,
                                               const uint32_t *__restrict__ pos,
                                               W *__restrict__ out) {
    for (uint32_t s = blockIdx.x; s < n_slots; s += gridDim.x) {
        const uint32_t p = pos[s];
        W *dst = out + (uint64_t)s * row_words;
        if (p >= back_rows) {
            const W zero = {};
            for (uint32_t i = threadIdx.x; i < row_words; i += blockDim.x) dst[i] = zero;
            continue;
        }
        const W *src = back + (uint64_t)p * row_words;
        for (uint32_t i = threadIdx.x; i < row_words; i += blockDim.x) dst[i] = src[i];
    }
}

extern "C" __global__ void lz_unpermute_rows_v16(const uint4 *__restrict__ back,
                                                 uint32_t row_words, uint32_t back_rows,
                                                 uint32_t n_slots,
                                                 const uint32_t *__restrict__ pos,
                                                 uint4 *__restrict__ out) {
    unpermute_rows(back, row_words, back_rows, n_slots, pos, out);
}

extern "C" __global__ void lz_unpermute_rows_u16(const uint16_t *__restrict__ back,
                                                 uint32_t row_words, uint32_t back_rows,
                                                 uint32_t n_slots,
                                                 const uint32_t *__restrict__ pos,
                                                 uint16_t *__restrict__ out) {
    unpermute_rows(back, row_words, back_rows, n_slots, pos, out);
}
