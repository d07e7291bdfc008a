// What csrc's two FP8 decode GEMVs share: their operands (Params), the streaming weight load, x's SiLU-and-mul
// staging, the launch (with programmatic dependent launch when asked), and each variant's entry point, which
// fp8_gemv.cu's C ABI calls. Both compute out[M, N] = x[M, K] @ dequant(w[N, K])^T (+ bias) in bf16 with
// float32 sums, for e4m3 weights scaled per 128 x 128 block or per output row:
//   fp8_gemv_mma.cu    x quantized to e4m3 (as the Triton GEMV), e4m3 mma on the tensor cores, M = 1..8;
//   fp8_gemv_widen.cu  x kept in float32, weights widened on the CUDA cores, M = 1..2.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace minisgl_csrc {

constexpr int GROUP = 128;  // K columns per weight (and activation) scale
constexpr int WARPS = 8;    // warps per CTA, splitting K
constexpr int THREADS = WARPS * 32;

struct Params {
    const __nv_bfloat16* x;
    long long stride_xm;  // elements between x's rows
    const uint8_t* w;     // e4m3 [N, K], unit stride along K
    long long stride_wn;
    const float* scale;   // block: [ceil(N / 128), K / 128]; per-channel: [N, 1]
    long long stride_sn, stride_sk;
    const __nv_bfloat16* bias;  // [N] or null
    __nv_bfloat16* out;         // [M, N], contiguous
    int m, n, k;
};

// 16 bytes of weights that are read once: not kept in L1, L2 fetching 256-byte sectors ahead
__device__ __forceinline__ uint4 load_streaming(const uint8_t* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

__device__ __forceinline__ float bf16_round(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// 8 bf16 (one 16-byte load) as floats; with SILU, silu(gate) * up rounded to bf16 as silu_and_mul does
template <bool SILU>
__device__ __forceinline__ void widen_x(const uint4& gate, const uint4& up, float* v) {
    const __nv_bfloat162* g2 = reinterpret_cast<const __nv_bfloat162*>(&gate);
    const __nv_bfloat162* u2 = reinterpret_cast<const __nv_bfloat162*>(&up);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float2 g = __bfloat1622float2(g2[i]);
        if constexpr (SILU) {
            float2 u = __bfloat1622float2(u2[i]);
            g.x = bf16_round(bf16_round(__fdividef(g.x, 1.0f + __expf(-g.x))) * u.x);
            g.y = bf16_round(bf16_round(__fdividef(g.y, 1.0f + __expf(-g.y))) * u.y);
        }
        v[2 * i] = g.x;
        v[2 * i + 1] = g.y;
    }
}

// Lets the next kernel in the stream launch (its own wait still orders it after this one), then waits for
// the previous kernel's writes (x). Both return at once without the programmatic launch attribute.
__device__ __forceinline__ void pdl_release_and_wait() {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
}

// One CTA of THREADS per `rows` output rows, on `stream`, as a programmatic dependent when pdl.
template <typename Kernel>
cudaError_t launch(Kernel kernel, const Params& p, int rows, bool pdl, cudaStream_t stream) {
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3((p.n + rows - 1) / rows);
    config.blockDim = dim3(THREADS);
    config.stream = stream;
    cudaLaunchAttribute attribute;
    attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute.val.programmaticStreamSerializationAllowed = 1;
    config.attrs = &attribute;
    config.numAttrs = pdl ? 1 : 0;
    return cudaLaunchKernelEx(&config, kernel, p);
}

// Each variant's launch; `rows` (output rows per CTA) and p.m are checked by the caller against the
// variant's constants below.
constexpr int MMA_MAX_M = 8;  // x rows: the MMA's N dimension
constexpr int WIDEN_MAX_M = 2;
cudaError_t launch_mma(const Params& p, bool silu, bool block, int rows, bool pdl, cudaStream_t stream);
cudaError_t launch_widen(const Params& p, bool silu, bool block, int rows, bool pdl, cudaStream_t stream);

}  // namespace minisgl_csrc
