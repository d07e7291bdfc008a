// The C ABI of csrc's FP8 decode GEMVs (raw device pointers, sizes, strides, a stream; cudaError_t as int),
// loaded with ctypes by minisgl/kernels/native.py. The kernels: fp8_gemv_mma.cu (x quantized to e4m3, tensor
// cores, M = 1..8) and fp8_gemv_widen.cu (x in float32, weights widened on the CUDA cores, M = 1..2).

#include "fp8_gemv.cuh"

namespace {

constexpr int ABI_VERSION = 2;
enum Variant { MMA = 0, WIDEN = 1 };

}  // namespace

extern "C" {

// Bumped whenever minisgl_fp8_gemv's arguments change, so that the loader refuses a stale library.
int minisgl_fp8_gemv_abi_version() { return ABI_VERSION; }

// out = x @ dequant(w)^T (+ bias). x: bf16 [m, k] (silu_mul: [m, 2k], gate | up) with unit stride along k
// and stride_xm elements between rows; w: e4m3 [n, k], unit stride along k; scale: float32, block_scaled ?
// 128 x 128 blocks [ceil(n / 128), k / 128] : per row [n, 1], strides in elements; bias: bf16 [n] or null;
// out: bf16 [m, n] contiguous; device: the CUDA device (ordinal) of all of them and of the stream.
// variant 0 (mma): 1 <= m <= 8, rows_per_cta 16 or 32; variant 1 (widen): 1 <= m <= 2, rows_per_cta 8 or 16.
// Both: k % 128 == 0, 16-byte aligned x, w and rows (stride_xm % 8 == 0, stride_wn % 16 == 0).
// Returns a cudaError_t (0: launched).
int minisgl_fp8_gemv(const void* x, long long stride_xm, const void* w, long long stride_wn, const float* scale,
                     long long stride_sn, long long stride_sk, int block_scaled, const void* bias, void* out, int m,
                     int n, int k, int silu_mul, int variant, int rows_per_cta, int pdl, int device, void* stream) {
    using namespace minisgl_csrc;
    const bool aligned = reinterpret_cast<uintptr_t>(x) % 16 == 0 && reinterpret_cast<uintptr_t>(w) % 16 == 0 &&
                         stride_xm % 8 == 0 && stride_wn % 16 == 0;
    const bool served = variant == MMA ? m <= MMA_MAX_M && (rows_per_cta == 16 || rows_per_cta == 32)
                        : variant == WIDEN ? m <= WIDEN_MAX_M && (rows_per_cta == 8 || rows_per_cta == 16)
                                           : false;
    if (!served || m < 1 || n < 1 || k < GROUP || k % GROUP || !aligned)
        return static_cast<int>(cudaErrorInvalidValue);
    const Params p{static_cast<const __nv_bfloat16*>(x), stride_xm, static_cast<const uint8_t*>(w), stride_wn,
                   scale, stride_sn, stride_sk, static_cast<const __nv_bfloat16*>(bias),
                   static_cast<__nv_bfloat16*>(out), m, n, k};
    // this library's static CUDA runtime keeps a current device of its own, apart from torch's
    int current = -1;
    cudaError_t err = cudaGetDevice(&current);
    if (err == cudaSuccess && current != device) err = cudaSetDevice(device);
    if (err != cudaSuccess) return static_cast<int>(err);
    auto s = static_cast<cudaStream_t>(stream);
    err = variant == MMA ? launch_mma(p, silu_mul, block_scaled, rows_per_cta, pdl, s)
                         : launch_widen(p, silu_mul, block_scaled, rows_per_cta, pdl, s);
    return static_cast<int>(err);
}

}  // extern "C"
