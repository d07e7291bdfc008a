// csrc's CUDA-core FP8 decode GEMV for Hopper (sm_90a), for 1 or 2 rows of x (batch-1 decode, W2):
// out[M, N] = x[M, K] @ dequant(w[N, K])^T (+ bias), weights e4m3 scaled per 128 x 128 block or per row.
//
// x is NOT quantized: it stays in float32 (bf16 widened exactly; with SILU, silu(gate) * up rounded to bf16 as
// silu_and_mul does), each e4m3 weight is widened exactly (hardware cvt e4m3x2 -> f16x2, then f16 -> f32) and
// multiplied in float32 FMAs: every product is exact, only the float32 sums round. The reference
// (fp8_linear_torch, the tensor-core variant, the Triton GEMV) also rounds x to e4m3, so this one is the more
// accurate. A lane sums its 16 products of a row in float32 and scales the sum by the 128 x 128 block's scale
// (per-row scales are applied once, at the end).
//
// Why it should stream at HBM bandwidth. An H100 SM receives ~14.5 bytes of HBM a clock (3.35 TB/s over 132
// SMs at 1.755 GHz) and issues 4 warp instructions a clock (128 lane instructions): 8.8 lane instructions per
// weight byte. Per weight byte a lane issues 1/16 LDG.128, 1/2 F2FP.F16.E4M3.UNPACK_B (two bytes each),
// 1 HADD2.F32 (f16 -> f32) and M FFMA, plus addresses, the block scale, x's loads and SiLU per chunk. ptxas's
// main loop (nvcc 13.0, sm_90a; cuobjdump -sass) counts, per weight byte:
//   M = 1: 3.8 (16-row CTAs) / 4.1 (8-row); with SiLU 4.8 / 6.0
//   M = 2: 4.9-5.0 / 5.2-5.4;               with SiLU 6.9 / 9.2
// i.e. 45-80% of the issue slots, except M = 2 with SiLU in 8-row CTAs (SiLU is formed once per CTA, so its
// cost per byte halves with 16 rows). The unpacks, if conversions issue at a quarter rate (16 lanes a clock),
// take 7.3 of those 16 slots. At M = 8 the same loop would ask ~12 per byte: the tensor-core variant
// (fp8_gemv_mma.cu) serves there.
//
// Work split: a CTA owns ROWS (8 or 16) output rows and all of K; its 8 warps split K into 512-column chunks
// (a warp's 32 lanes x 16 bytes; 4 scale groups) and meet in shared memory at the end (a fixed-order sum:
// results do not depend on timing). Each lane holds its 16 columns of x (per row, in float32 registers) for a
// chunk and streams 8 rows of weights at a time in 16-byte loads that bypass L1, the next 8 rows (or the next
// chunk's first 8) in flight while the current ones are multiplied: 4 KB a warp, 16 warps an SM at M = 1 (two
// CTAs: <= 128 registers) and 8 at M = 2 (one CTA: 164-255 registers), 32-64 KB, above the ~20 KB an SM must
// keep in flight to cover HBM's ~700 ns at full bandwidth. A warp's sums (ROWS x M per lane)
// are reduced across its lanes by a butterfly (each step halves the values a lane keeps: V - 1 shuffles for V
// sums, not 5 V).
//
// Programmatic dependent launch as the tensor-core variant: the first 8 rows' weight loads are issued before
// griddepcontrol.wait, which precedes every read of x.

#include <cuda_fp16.h>

#include "fp8_gemv.cuh"

namespace minisgl_csrc {
namespace {

constexpr int TILE = 8;                 // weight rows in flight together: one 16-byte load each per lane
constexpr int LANE_COLS = 16;           // K columns per lane (one 16-byte weight load)
constexpr int CHUNK = 32 * LANE_COLS;   // K columns a warp covers at once

// TILE rows from w_rows (this lane's 16 bytes of the first; rows `stride` bytes apart), the rows from `valid` on
// (past N: not stored) and every row past K (a last chunk of 128-column groups that does not fill the warp)
// as zeros
__device__ __forceinline__ void load_tile(uint4 (&v)[TILE], const uint8_t* w_rows, long long stride, int valid,
                                          bool in_k) {
#pragma unroll
    for (int r = 0; r < TILE; ++r)
        v[r] = in_k && r < valid ? load_streaming(w_rows + r * stride) : make_uint4(0, 0, 0, 0);
}

// x's M rows at this lane's 16 columns from col, in float32 (zeros past K)
template <int M, bool SILU>
__device__ __forceinline__ void load_x(float (&xv)[M][LANE_COLS], const Params& p, int col) {
    const uint4 zero = make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const __nv_bfloat16* src = p.x + m * p.stride_xm + col + 8 * j;
            const uint4 gate = col < p.k ? *reinterpret_cast<const uint4*>(src) : zero;
            const uint4 up = SILU && col < p.k ? *reinterpret_cast<const uint4*>(src + p.k) : zero;
            widen_x<SILU>(gate, up, &xv[m][8 * j]);
        }
}

// the next chunk's x into L1 while this chunk's weights are multiplied (no registers held)
template <int M, bool SILU>
__device__ __forceinline__ void prefetch_x(const Params& p, int col) {
    if (col >= p.k) return;
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int half = 0; half < (SILU ? 2 : 1); ++half)
            asm volatile("prefetch.global.L1 [%0];" ::"l"(p.x + m * p.stride_xm + col + half * p.k));
}

// 4 e4m3 (one word, the first in its low byte) as two f16 pairs, exactly: the hardware cvt of each 16-bit
// half (read in place, no shift)
__device__ __forceinline__ void unpack_e4m3x4(uint32_t word, __half2 (&pair)[2]) {
    uint32_t lo, hi;
    asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.rn.f16x2.e4m3x2 %0, l;\ncvt.rn.f16x2.e4m3x2 %1, h;\n}"
        : "=r"(lo), "=r"(hi)
        : "r"(word));
    pair[0] = *reinterpret_cast<__half2*>(&lo);
    pair[1] = *reinterpret_cast<__half2*>(&hi);
}

// acc[r][m] += sum over the lane's 16 columns of w[r] * x[m] (times the block scale sw)
template <int M, bool BLOCK>
__device__ __forceinline__ void multiply_tile(float (*acc)[M], const uint4 (&w)[TILE],
                                              const float (&xv)[M][LANE_COLS], float sw) {
#pragma unroll
    for (int r = 0; r < TILE; ++r) {
        const uint32_t words[4] = {w[r].x, w[r].y, w[r].z, w[r].w};
        __half2 pairs[4][2];
#pragma unroll
        for (int q = 0; q < 4; ++q) unpack_e4m3x4(words[q], pairs[q]);
        float s[M] = {};
#pragma unroll
        for (int q = 0; q < 4; ++q)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float2 wf = __half22float2(pairs[q][h]);
                const int c = 4 * q + 2 * h;
#pragma unroll
                for (int m = 0; m < M; ++m) s[m] = fmaf(wf.y, xv[m][c + 1], fmaf(wf.x, xv[m][c], s[m]));
            }
#pragma unroll
        for (int m = 0; m < M; ++m) acc[r][m] = BLOCK ? fmaf(s[m], sw, acc[r][m]) : acc[r][m] + s[m];
    }
}

// One butterfly step of width H over a warp's V sums per lane: a lane keeps the H values (of its first 2H) whose
// index has its own bit H and adds its partner's (lane ^ H), which keeps the other H; then width H / 2.
template <int H, int V>
__device__ __forceinline__ void butterfly(float (&v)[V], int lane) {
    if constexpr (H >= 1) {
        const bool upper = lane & H;
#pragma unroll
        for (int i = 0; i < H; ++i) {
            const float send = upper ? v[i] : v[i + H], keep = upper ? v[i + H] : v[i];
            v[i] = keep + __shfl_xor_sync(0xffffffffu, send, H);
        }
        butterfly<H / 2>(v, lane);
    }
}

// The warp's V sums per lane reduced over its 32 lanes: returns, in every lane, the total of value lane % V
// (V - 1 shuffles in the butterfly, then plain xor steps across the lanes' groups of V).
template <int V>
__device__ __forceinline__ float reduce_scatter(float (&v)[V], int lane) {
    butterfly<V / 2>(v, lane);
#pragma unroll
    for (int o = V; o < 32; o *= 2) v[0] += __shfl_xor_sync(0xffffffffu, v[0], o);
    return v[0];
}

template <int M, bool SILU, bool BLOCK, int ROWS>
__global__ void __launch_bounds__(THREADS, M == 1 ? 2 : 1) fp8_gemv_widen_kernel(Params p) {
    constexpr int TILES = ROWS / TILE, V = ROWS * M;
    static_assert(V <= 32 && (V & (V - 1)) == 0, "one butterfly over the warp: V a power of two <= 32");
    __shared__ float partial[WARPS][V];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row0 = blockIdx.x * ROWS;
    const int chunks = (p.k + CHUNK - 1) / CHUNK;
    const int first = warp * chunks / WARPS, last = (warp + 1) * chunks / WARPS;
    const int lane_col = LANE_COLS * lane;
    // the CTA's rows lie in one 128-row weight block (ROWS divides 128)
    const float* block_scales = p.scale + (row0 / GROUP) * p.stride_sn;

    const long long stride = p.stride_wn;
    const uint8_t* w_lane = p.w + row0 * stride + lane_col;  // the CTA's first row, this lane's columns
    const int valid = p.n - row0;                            // rows of the CTA inside W
    uint4 cur[TILE];
    if (first < last) load_tile(cur, w_lane + first * CHUNK, stride, valid, first * CHUNK + lane_col < p.k);
    pdl_release_and_wait();

    float acc[ROWS][M] = {};
    for (int chunk = first; chunk < last; ++chunk) {
        const int col = chunk * CHUNK + lane_col;
        if (chunk + 1 < last) prefetch_x<M, SILU>(p, col + CHUNK);
        float xv[M][LANE_COLS];
        load_x<M, SILU>(xv, p, col);
        // this lane's 16 columns lie in one 128-column group: one block scale per chunk
        const float sw = BLOCK && col < p.k ? block_scales[(col / GROUP) * p.stride_sk] : 1.0f;
#pragma unroll
        for (int t = 0; t < TILES; ++t) {
            // the next 8 rows in flight: this chunk's next tile, else the next chunk's first
            uint4 next[TILE];
            const bool more = t + 1 < TILES || chunk + 1 < last;
            if (more) {
                const int next_t = (t + 1) % TILES, next_col = t + 1 < TILES ? col : col + CHUNK;
                load_tile(next, w_lane + TILE * next_t * stride + (next_col - lane_col), stride, valid - TILE * next_t,
                          next_col < p.k);
            }
            multiply_tile<M, BLOCK>(acc + TILE * t, cur, xv, sw);
            if (more)
#pragma unroll
                for (int r = 0; r < TILE; ++r) cur[r] = next[r];
        }
    }

    float v[V];
#pragma unroll
    for (int i = 0; i < V; ++i) v[i] = acc[i / M][i % M];
    const float total = reduce_scatter<V>(v, lane);
    if (lane < V) partial[warp][lane] = total;
    __syncthreads();
    if (threadIdx.x < V) {
        const int r = threadIdx.x / M, m = threadIdx.x % M, n = row0 + r;
        if (n >= p.n) return;
        float y = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) y += partial[w][threadIdx.x];
        if constexpr (!BLOCK) y *= p.scale[n * p.stride_sn];
        if (p.bias) y += __bfloat162float(p.bias[n]);
        p.out[m * p.n + n] = __float2bfloat16_rn(y);
    }
}

template <int M, bool SILU, bool BLOCK>
cudaError_t launch_rows(const Params& p, int rows, bool pdl, cudaStream_t stream) {
    return rows == 16 ? launch(fp8_gemv_widen_kernel<M, SILU, BLOCK, 16>, p, rows, pdl, stream)
                      : launch(fp8_gemv_widen_kernel<M, SILU, BLOCK, 8>, p, rows, pdl, stream);
}

template <int M>
cudaError_t launch_m(const Params& p, bool silu, bool block, int rows, bool pdl, cudaStream_t stream) {
    if (silu)
        return block ? launch_rows<M, true, true>(p, rows, pdl, stream)
                     : launch_rows<M, true, false>(p, rows, pdl, stream);
    return block ? launch_rows<M, false, true>(p, rows, pdl, stream)
                 : launch_rows<M, false, false>(p, rows, pdl, stream);
}

}  // namespace

// rows: 8 or 16 (one or two 8-row tiles per CTA); p.m: 1 or 2
cudaError_t launch_widen(const Params& p, bool silu, bool block, int rows, bool pdl, cudaStream_t stream) {
    return p.m == 1 ? launch_m<1>(p, silu, block, rows, pdl, stream) : launch_m<2>(p, silu, block, rows, pdl, stream);
}

}  // namespace minisgl_csrc
