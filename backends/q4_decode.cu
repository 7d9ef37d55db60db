// The 4-bit gate/up kernel of a decode step in CUDA C (compiled at run time by NVRTC, see
// backends/cuda.py): RMSNorm of the residual stream, the gate and up GEMVs on one-group 4-bit
// weights in the kernels' layout (backends/kernels.py `_mac`: words of four rows interleaved,
// values in `pair_nibbles` order), SiLU(gate) * up, rounded as `_rms_gate_up` rounds.
//
// Compile-time constants (NVRTC -D): DIM (inputs), INTER (rows of gate, and of up), WARPS (warps
// a block), PDL (1: the kernel is a programmatic dependent of the previous one: its first weights
// load before the wait).
//
// The work: 4736 items (for Qwen2-7B) of a quad (four rows of gate, the same four of up) by all
// of K, dealt out to the warps of a grid that fills the GPU once (persistent warps); a warp walks
// its items in two halves of K, loading the next half's words (7 KB a warp) while it computes one,
// so that every warp keeps its loads in flight from the start to its end. The inputs, times the
// RMSNorm gain and prescaled for the nibbles, are prepared once a block, in shared memory.
//
// No headers: bfloat16 values are handled as bit patterns.

typedef unsigned int u32;
typedef unsigned short u16;

#define KW (DIM / 8)             // 4-bit words a row
#define HW (KW / 2)              // words of a half
#define NW (HW / 32)             // words a lane takes of each row in a half
#define NT (WARPS * 32)          // threads a block
#define ITEMS (INTER / 4)        // quads
#define PREP ((KW + NT - 1) / NT)  // words whose inputs a thread prepares

static_assert(HW % 32 == 0, "each half of K must be whole words a lane");
static_assert(INTER % 4 == 0, "whole quads");

// A 16-byte load of weights. Not ld.global.nc: ptxas moves those below the wait (griddepcontrol.wait),
// where they are no longer in flight while the previous kernel ends. VOLATILE: ld.volatile, which
// ptxas keeps in order with the (volatile) loads of the inputs from shared memory, so that the
// next half's words go out before this half is computed, as written (plain loads it sinks to
// their use).
__device__ __forceinline__ uint4 ld_weights(const uint4* p) {
    uint4 r;
#if VOLATILE
    asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
#else
    asm volatile("ld.global.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
#endif
    return r;
}

__device__ __forceinline__ float4 ld_shared(const float4* p) {
    float4 r;
#if VOLATILE
    asm volatile("ld.volatile.shared.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(r.x), "=f"(r.y), "=f"(r.z), "=f"(r.w) : "r"((u32)__cvta_generic_to_shared(p)));
#else
    r = *p;
#endif
    return r;
}

// A 16-byte load of what the previous kernel wrote: a plain load, which ptxas keeps after the
// wait (an ld.global.nc, as `const __restrict__` would give, it may move above it).
__device__ __forceinline__ uint4 ld_plain(const uint4* p) {
    uint4 r;
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p) : "memory");
    return r;
}

__device__ __forceinline__ float bf_lo(u32 u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float bf_hi(u32 u) { return __uint_as_float(u & 0xffff0000u); }

__device__ __forceinline__ u16 to_bf16(float v) {
    u16 b;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(v));
    return b;
}

// v rounded to bfloat16 and back, as an eager op's output is
__device__ __forceinline__ float rnd(float v) { return __uint_as_float(((u32)to_bf16(v)) << 16); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Eight inputs (one word's) from 16 bytes of bfloat16, in value order
__device__ __forceinline__ void eight(uint4 u, float* v) {
    v[0] = bf_lo(u.x); v[1] = bf_hi(u.x); v[2] = bf_lo(u.y); v[3] = bf_hi(u.y);
    v[4] = bf_lo(u.z); v[5] = bf_hi(u.z); v[6] = bf_lo(u.w); v[7] = bf_hi(u.w);
}

// The eight values of a word times their inputs into acc. Nibble n holds value 2n (n < 4) or
// 2(n - 4) + 1; masked in place (bits 4n.., or 4n - 16.. of the word shifted by 16 for n >= 6)
// it is, as a float32, the denormal q * 2^(sh - 149), and p[n] = v * 2^(100 - sh) makes the
// product q * v * 2^-49 exactly (the FMA keeps denormals: NVRTC's default is no flush to zero).
__device__ __forceinline__ float dot8(u32 w, const float* p, float acc) {
    const u32 hi = w >> 16;
#pragma unroll
    for (int n = 0; n < 8; n++) {
        const int sh = n < 6 ? 4 * n : 4 * n - 16;
        const u32 src = n < 6 ? w : hi;
        acc = fmaf(__uint_as_float(src & (0xFu << sh)), p[n], acc);
    }
    return acc;
}

// Loads the words of quad `item`'s half `half` (gate, up) into wg, wu.
__device__ __forceinline__ void load_half(const uint4* w, int item, int half, int lane, uint4* wg, uint4* wu) {
    const uint4* g = w + (long long)item * KW + half * HW + lane;
    const uint4* u = g + (long long)ITEMS * KW;
#pragma unroll
    for (int i = 0; i < NW; i++) {
        wg[i] = ld_weights(g + 32 * i);
        wu[i] = ld_weights(u + 32 * i);
    }
}

// The products of one half's words with their prescaled inputs into a (gate rows, up rows).
__device__ __forceinline__ void mac_half(const uint4* wg, const uint4* wu, const float4* pa, const float4* pb,
                                         int half, int lane, float* a) {
#pragma unroll
    for (int i = 0; i < NW; i++) {
        const int kw = half * HW + lane + 32 * i;
        const float4 p0 = ld_shared(pa + kw), p1 = ld_shared(pb + kw);
        const float p[8] = {p0.x, p0.y, p0.z, p0.w, p1.x, p1.y, p1.z, p1.w};
        a[0] = dot8(wg[i].x, p, a[0]);
        a[1] = dot8(wg[i].y, p, a[1]);
        a[2] = dot8(wg[i].z, p, a[2]);
        a[3] = dot8(wg[i].w, p, a[3]);
        a[4] = dot8(wu[i].x, p, a[4]);
        a[5] = dot8(wu[i].y, p, a[5]);
        a[6] = dot8(wu[i].z, p, a[6]);
        a[7] = dot8(wu[i].w, p, a[7]);
    }
}

extern "C" __global__ void __launch_bounds__(NT)
q4_rms_gate_up(const uint4* x, const uint4* __restrict__ gain, const uint4* __restrict__ w,
               const float* __restrict__ scales, const float* __restrict__ zeros, u16* __restrict__ h, float eps) {
    // the inputs, prescaled for the nibbles (see dot8): p[0..3] of word kw at pa[kw], p[4..7] at pb[kw]
    __shared__ float4 pa[KW], pb[KW];
    __shared__ float part[WARPS][2];
    const int t = threadIdx.x, warp = t >> 5, lane = t & 31;
    const int stride = gridDim.x * WARPS;
    int item = blockIdx.x * WARPS + warp;  // then every stride-th
    uint4 ag[NW], au[NW], bg[NW], bu[NW];  // the words of two halves
    if (item < ITEMS) {
        load_half(w, item, 0, lane, ag, au);
        load_half(w, item, 1, lane, bg, bu);
    }
    uint4 gn[PREP];
#pragma unroll
    for (int j = 0; j < PREP; j++)
        if (t + NT * j < KW) gn[j] = ld_weights(gain + t + NT * j);
#if PDL
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    uint4 xv[PREP];
#pragma unroll
    for (int j = 0; j < PREP; j++)
        if (t + NT * j < KW) xv[j] = ld_plain(x + t + NT * j);
    float ss = 0.f, vs = 0.f;  // this thread's share of sum(x^2) (the RMS) and sum(g * x) (the zero point)
#pragma unroll
    for (int j = 0; j < PREP; j++) {
        if (t + NT * j < KW) {
            float v[8], g[8], p[8];
            eight(xv[j], v);
            eight(gn[j], g);
#pragma unroll
            for (int k = 0; k < 8; k++) {
                ss = fmaf(v[k], v[k], ss);
                v[k] *= g[k];
                vs += v[k];
            }
#pragma unroll
            for (int n = 0; n < 8; n++) {
                const int sh = n < 6 ? 4 * n : 4 * n - 16;
                p[n] = v[n < 4 ? 2 * n : 2 * n - 7] * __uint_as_float((u32)(227 - sh) << 23);  // 2^(100 - sh)
            }
            pa[t + NT * j] = make_float4(p[0], p[1], p[2], p[3]);
            pb[t + NT * j] = make_float4(p[4], p[5], p[6], p[7]);
        }
    }
    ss = warp_sum(ss);
    vs = warp_sum(vs);
    if (lane == 0) { part[warp][0] = ss; part[warp][1] = vs; }
    __syncthreads();
    float s2 = 0.f, sv = 0.f;
#pragma unroll
    for (int s = 0; s < WARPS; s++) { s2 += part[s][0]; sv += part[s][1]; }
    const float inv = 1.f / sqrtf(s2 / DIM + eps);
    const float vz = sv * 1.7763568394002505e-15f;  // 2^-49: the zero point's share in the sums' units
    const float two49 = 562949953421312.f;
    while (item < ITEMS) {
        const int next = item + stride;
        const int r = lane & 3;
        float sc_g = 0.f, z_g = 0.f, sc_u = 0.f, z_u = 0.f;
        if (lane < 4) {
            sc_g = scales[item * 4 + r]; z_g = zeros[item * 4 + r];
            sc_u = scales[INTER + item * 4 + r]; z_u = zeros[INTER + item * 4 + r];
        }
        float a[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};  // gate rows 0..3, up rows 0..3 of the quad
        mac_half(ag, au, pa, pb, 0, lane, a);
        if (next < ITEMS) load_half(w, next, 0, lane, ag, au);
        mac_half(bg, bu, pa, pb, 1, lane, a);
        if (next < ITEMS) load_half(w, next, 1, lane, bg, bu);
#if PDL
        if (next >= ITEMS) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
#pragma unroll
        for (int k = 0; k < 8; k++) a[k] = warp_sum(a[k]);
        if (lane < 4) {
            const float tg = r == 0 ? a[0] : r == 1 ? a[1] : r == 2 ? a[2] : a[3];
            const float tu = r == 0 ? a[4] : r == 1 ? a[5] : r == 2 ? a[6] : a[7];
            const float gt = rnd((tg - z_g * vz) * (sc_g * two49) * inv);
            const float ut = rnd((tu - z_u * vz) * (sc_u * two49) * inv);
            const float act = rnd(gt / (1.f + expf(-gt)));
            h[item * 4 + r] = to_bf16(act * ut);
        }
        item = next;
    }
}
