// csrc's tensor-core FP8 decode GEMV for Hopper (sm_90a): out[M, N] = x[M, K] @ dequant(w[N, K])^T (+ bias),
// M = 1..8 (fp8_gemv_widen.cu is the variant for M <= 2, where the MMA's 8 columns are mostly padding).
//
// Same arithmetic as minisgl.layers.fp8.fp8_linear_torch and the Triton GEMV (minisgl/kernels/gemv.py):
// x is quantized to e4m3 per row and 128-column group (scale = amax / 448, x times its reciprocal rounded to
// nearest), each group's e4m3 products are summed exactly in float32 on the tensor cores (mma.sync m16n8k32
// e4m3, weights as the 16-row A operand, x as the 8-column B operand: M <= 8 fills it) and scaled by the row's
// activation scale and the weight's scale. Quantizing x leaves the multiply-adds to the tensor cores:
// widening the weights for float32 FMAs asks ~8 FMAs per weight byte at M = 8, more than an H100 SM issues
// while its share of HBM bandwidth delivers that byte (the Triton weight-widening GEMV measured 3.65 ms a
// step against 3.18 for the quantizing one). Hopper multiplies FP8 natively only in wgmma: ptxas lowers this
// mma to e4m3 -> f16 unpacks (F2FP, two bytes each) and f16 HMMAs, exact all the same.
//
// Work split: a CTA owns ROWS = 16 * TILES output rows and all of K; its 8 warps split K by whole groups
// and meet in shared memory at the end (a fixed-order sum: results do not depend on timing). Each lane
// streams 16-byte weight loads that bypass L1, the next group's loads in flight while the current one is
// multiplied (8 KB per warp at TILES = 2), and prefetches the next group of x into L1. x is read by each warp
// for its own K slice only, so every CTA reads x once in all; it is quantized in registers (the four lanes
// holding a row's 128-column group reduce its amax by shuffles), so no shared-memory staging or barrier sits
// before the first MMA.
//
// Lane (g, t) = (lane / 4, lane % 4) loads rows g and g + 8 of each 16-row tile at columns 16t..16t+15 of
// both 64-column halves of a group, and x's row g at the same columns. mma's k index is only summed over,
// so any assignment of physical columns to a lane's k slots works when A and B use the same one: the lane's
// 8-byte halves of each 16-byte load feed one MMA each (registers a0/a2 from row g, a1/a3 from row g + 8,
// b0/b1 from x's row g).
//
// Programmatic dependent launch (pdl != 0, launched with cudaLaunchKernelEx): the first group's weight
// loads are issued, dependents are let launch, then griddepcontrol.wait precedes every read of x (written
// by the previous kernel). Without the launch attribute the wait returns at once.

#include "fp8_gemv.cuh"

namespace minisgl_csrc {
namespace {

constexpr int MAX_M = MMA_MAX_M;
constexpr float FP8_MAX = 448.0f;
constexpr float MIN_SCALE = 1e-10f;

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// d += a (16 x 32 e4m3) @ b (32 x 8 e4m3), float32
__device__ __forceinline__ void mma_e4m3(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
    asm(
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_e4m3(float a, float b, float c, float d) {
    uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
    uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, __NV_E4M3);
    return lo | (hi << 16);
}

template <int TILES>
struct Weights {
    uint4 v[TILES][2][2];  // [tile][64-column half][row g, row g + 8]
};

template <int TILES>
__device__ __forceinline__ void load_group(Weights<TILES>& w, const Params& p, const int (&rows)[TILES][2],
                                           int col) {
#pragma unroll
    for (int i = 0; i < TILES; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int r = 0; r < 2; ++r) w.v[i][h][r] = load_streaming(p.w + rows[i][r] * p.stride_wn + col + 64 * h);
}

template <bool SILU, bool BLOCK, int TILES>
__global__ void __launch_bounds__(THREADS, 2) fp8_gemv_kernel(Params p) {
    constexpr int ROWS = 16 * TILES;
    __shared__ float partial[WARPS][MAX_M][ROWS];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const int row0 = blockIdx.x * ROWS;
    int rows[TILES][2];  // this lane's weight rows, clamped into W (results past N are not stored)
#pragma unroll
    for (int i = 0; i < TILES; ++i)
#pragma unroll
        for (int r = 0; r < 2; ++r) rows[i][r] = min(row0 + 16 * i + g + 8 * r, p.n - 1);
    const int groups = p.k / GROUP;
    const int first = warp * groups / WARPS, last = (warp + 1) * groups / WARPS;
    const int lane_col = 16 * t;

    // the CTA's rows lie in one 128-row weight block: one weight scale per group (block-scaled layout)
    const float* block_scales = p.scale + (row0 / GROUP) * p.stride_sn;
    Weights<TILES> cur;
    float sw = 1.0f;
    if (first < last) {
        load_group(cur, p, rows, first * GROUP + lane_col);
        if constexpr (BLOCK) sw = block_scales[first * p.stride_sk];
    }
    pdl_release_and_wait();

    const bool has_row = g < p.m;
    const __nv_bfloat16* x_row = p.x + g * p.stride_xm + lane_col;
    float acc[TILES][4] = {};
    for (int grp = first; grp < last; ++grp) {
        // the next group in flight: its weights into registers, its scale, its x into L1 (no registers)
        Weights<TILES> next;
        float sw_next = 1.0f;
        if (grp + 1 < last) {
            load_group(next, p, rows, (grp + 1) * GROUP + lane_col);
            if constexpr (BLOCK) sw_next = block_scales[(grp + 1) * p.stride_sk];
            if (has_row)
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int half = 0; half < (SILU ? 2 : 1); ++half)
                        asm volatile("prefetch.global.L1 [%0];"
                                     :: "l"(x_row + (grp + 1) * GROUP + 64 * h + half * p.k));
        }

        // x's row g at this lane's 32 columns of the group, quantized with the group's row scale
        float v[2][16];
        const uint4 zero = make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const __nv_bfloat16* src = x_row + grp * GROUP + 64 * h + 8 * j;
                uint4 gate = has_row ? *reinterpret_cast<const uint4*>(src) : zero;
                uint4 up = SILU && has_row ? *reinterpret_cast<const uint4*>(src + p.k) : zero;
                widen_x<SILU>(gate, up, &v[h][8 * j]);
            }
        float amax = 0.0f;
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(v[h][i]));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
        // x / sx as a product with its reciprocal (a value can round to the neighbouring e4m3 one, as in the
        // Triton GEMV); the conversion saturates at 448
        const float sx = fmaxf(amax, MIN_SCALE) / FP8_MAX, inv = 1.0f / sx;
        uint32_t xq[2][4];
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float* q = &v[h][4 * j];
                xq[h][j] = pack_e4m3(q[0] * inv, q[1] * inv, q[2] * inv, q[3] * inv);
            }
        // the scales of x's rows 2t and 2t + 1 (this lane's accumulator columns), held by lanes 8t and 8t + 4
        const float s0 = __shfl_sync(0xffffffffu, sx, 8 * t) * sw;
        const float s1 = __shfl_sync(0xffffffffu, sx, 8 * t + 4) * sw;

#pragma unroll
        for (int i = 0; i < TILES; ++i) {
            float d[4] = {};
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int s = 0; s < 2; ++s)
                    mma_e4m3(d, word(cur.v[i][h][0], 2 * s), word(cur.v[i][h][1], 2 * s),
                             word(cur.v[i][h][0], 2 * s + 1), word(cur.v[i][h][1], 2 * s + 1), xq[h][2 * s],
                             xq[h][2 * s + 1]);
            acc[i][0] += d[0] * s0;
            acc[i][1] += d[1] * s1;
            acc[i][2] += d[2] * s0;
            acc[i][3] += d[3] * s1;
        }
        cur = next;
        sw = sw_next;
    }

    // d[0], d[1]: row g, x rows 2t, 2t + 1; d[2], d[3]: row g + 8
#pragma unroll
    for (int i = 0; i < TILES; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) partial[warp][2 * t + j % 2][16 * i + g + 8 * (j / 2)] = acc[i][j];
    __syncthreads();
    for (int e = threadIdx.x; e < MAX_M * ROWS; e += THREADS) {
        const int m = e / ROWS, r = e % ROWS, n = row0 + r;
        if (m >= p.m || n >= p.n) continue;
        float y = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) y += partial[w][m][r];
        if constexpr (!BLOCK) y *= p.scale[n * p.stride_sn];
        if (p.bias) y += __bfloat162float(p.bias[n]);
        p.out[m * p.n + n] = __float2bfloat16_rn(y);
    }
}

template <bool SILU, bool BLOCK>
cudaError_t launch_tiles(const Params& p, int rows, bool pdl, cudaStream_t stream) {
    return rows == 32 ? launch(fp8_gemv_kernel<SILU, BLOCK, 2>, p, rows, pdl, stream)
                      : launch(fp8_gemv_kernel<SILU, BLOCK, 1>, p, rows, pdl, stream);
}

}  // namespace

// rows: 16 or 32 (one or two 16-row MMA tiles per CTA)
cudaError_t launch_mma(const Params& p, bool silu, bool block, int rows, bool pdl, cudaStream_t stream) {
    if (silu)
        return block ? launch_tiles<true, true>(p, rows, pdl, stream) : launch_tiles<true, false>(p, rows, pdl, stream);
    return block ? launch_tiles<false, true>(p, rows, pdl, stream)
                 : launch_tiles<false, false>(p, rows, pdl, stream);
}

}  // namespace minisgl_csrc
