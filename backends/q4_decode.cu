// The int4 decode step's gate/up kernel in CUDA C, compiled at run time by NVRTC (backends/cuda.py):
// RMSNorm of the residual stream, the gate and up products with one-group 4-bit weights in the
// kernels' layout (backends/kernels/matvec.py `_mac`: the words of four rows interleaved, a word's values
// in `pair_nibbles` order), SiLU(gate) * up, rounded where the eager layer rounds.
//
// Compile-time constants (NVRTC -D): DIM (inputs), INTER (rows of gate, and of up), WARPS (warps a
// block), CHUNKS (parts of K an item is walked in), STAGES (chunks whose words are loaded or in
// flight), PDL (1: launched as a programmatic dependent of the previous kernel: the first words
// load before the wait for it).
//
// The work: items of a quad (four rows of gate and the same four of up) by all of K (4736 for
// Qwen2-7B), dealt out to the warps of a grid that fills the GPU once; a warp walks its items'
// chunks in order with the words of the next STAGES - 1 chunks in flight while it computes one,
// so that it keeps loads in flight from its start to its end (more warps, each short, were
// slower: docs/journal.md). A lane loads 16 bytes, a word of each of the quad's four rows, so
// a warp's load is 512 contiguous bytes. The products go through the tensor cores
// (mma.m16n8k16, bfloat16, float32 sums): one LOP3 a pair of values makes the bfloat16 128 + q of
// both (`pair`), the A fragments of two MMAs with rows 0 and 1 of the quad in the row places g
// and g + 8 of lane group g = lane / 4, and two more with rows 2 and 3, for the word's four pairs.
// Each lane group takes its own words, so its B fragment is its own words' inputs, and the
// product's diagonal (row g, column g) holds the group's sums, which the eight groups then add.
// The inputs are the RMSNorm's bfloat16 outputs, as the eager module makes them, prepared once a
// block in shared memory; 128 + z times their sum comes off each row's sum at the end.
//
// No headers: bfloat16 values are handled as bit patterns.

typedef unsigned int u32;
typedef unsigned short u16;

#define KW (DIM / 8)               // 4-bit words a row
#define JW (KW / 32)               // 16-byte loads a lane makes of each of gate and up for an item
#define CJ (JW / CHUNKS)           // of a chunk
#define NT (WARPS * 32)            // threads a block
#define ITEMS (INTER / 4)          // quads
#define PREP ((KW + NT - 1) / NT)  // words whose inputs a thread prepares

static_assert(KW % 32 == 0 && JW % CHUNKS == 0, "K must be whole chunks of 512-byte loads");
static_assert(INTER % 4 == 0, "whole quads");

// A 16-byte load of weights. Volatile, which ptxas keeps in order with the other volatile loads
// (the inputs' from shared memory, ld_shared), so that a chunk's words go out before the chunk
// before it is computed, as written: plain loads it sinks to their first use, where they are no
// longer in flight during the computation. Not ld.global.nc either: ptxas moves those below
// griddepcontrol.wait, where they no longer overlap the end of the previous kernel.
__device__ __forceinline__ uint4 ld_weights(const uint4* p) {
    uint4 r;
    asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

__device__ __forceinline__ uint4 ld_shared(const uint4* p) {
    uint4 r;
    asm volatile("ld.volatile.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"((u32)__cvta_generic_to_shared(p)));
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

__device__ __forceinline__ u32 pair(u32 w, int p) {
    u32 r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(w >> (4 * p)), "r"(0x000F000Fu), "r"(0x43004300u));
    return r;
}

__device__ __forceinline__ void mma(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The four words of a 16-byte load (rows 0..3 of a quad) times the word's inputs b into
// ca (rows 0, 1) and cb (rows 2, 3).
__device__ __forceinline__ void mma4(uint4 v, uint4 b, float* ca, float* cb) {
    mma(ca, pair(v.x, 0), pair(v.y, 0), pair(v.x, 1), pair(v.y, 1), b.x, b.y);
    mma(ca, pair(v.x, 2), pair(v.y, 2), pair(v.x, 3), pair(v.y, 3), b.z, b.w);
    mma(cb, pair(v.z, 0), pair(v.w, 0), pair(v.z, 1), pair(v.w, 1), b.x, b.y);
    mma(cb, pair(v.z, 2), pair(v.w, 2), pair(v.z, 3), pair(v.w, 3), b.z, b.w);
}

__device__ __forceinline__ void load_chunk(const uint4* w, int item, int part, int lane, uint4* wg, uint4* wu) {
    const uint4* g = w + (long long)item * KW + 32 * CJ * part + lane;
    const uint4* u = g + (long long)ITEMS * KW;
#pragma unroll
    for (int j = 0; j < CJ; j++) {
        wg[j] = ld_weights(g + 32 * j);
        wu[j] = ld_weights(u + 32 * j);
    }
}

__device__ __forceinline__ void mma_chunk(const uint4* wg, const uint4* wu, const uint4* xs, int part, int lane,
                                          float (*acc)[4]) {
#pragma unroll
    for (int j = 0; j < CJ; j++) {
        const uint4 b = ld_shared(xs + 32 * (CJ * part + j) + lane);
        mma4(wg[j], b, acc[0], acc[1]);
        mma4(wu[j], b, acc[2], acc[3]);
    }
}

extern "C" __global__ void __launch_bounds__(NT)
q4_rms_gate_up(const uint4* x, const uint4* __restrict__ gain, const uint4* __restrict__ w,
               const float* __restrict__ scales, const float* __restrict__ zeros, u16* __restrict__ h, float eps) {
    __shared__ uint4 xs[KW];  // the RMSNorm's outputs, bfloat16, eight (a word's inputs) to 16 bytes
    __shared__ float part[WARPS];
    const int t = threadIdx.x, warp = t >> 5, lane = t & 31, g = lane >> 2, c = lane & 3;
    const int stride = gridDim.x * WARPS;
    const int first = blockIdx.x * WARPS + warp;
    const int n = first < ITEMS ? ((ITEMS - 1 - first) / stride + 1) * CHUNKS : 0;
    uint4 bg[STAGES][CJ], bu[STAGES][CJ];
#pragma unroll
    for (int s = 0; s < STAGES; s++)
        if (s < n) load_chunk(w, first + (s / CHUNKS) * stride, s % CHUNKS, lane, bg[s], bu[s]);
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
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < PREP; j++) {
        if (t + NT * j < KW) {
            float v[8];
            eight(xv[j], v);
#pragma unroll
            for (int k = 0; k < 8; k++) ss = fmaf(v[k], v[k], ss);
        }
    }
    ss = warp_sum(ss);
    if (lane == 0) part[warp] = ss;
    __syncthreads();
    float s2 = 0.f;
#pragma unroll
    for (int s = 0; s < WARPS; s++) s2 += part[s];
    const float inv = 1.f / sqrtf(s2 / DIM + eps);
    float sb = 0.f;  // this thread's share of the sum of the normalised inputs
#pragma unroll
    for (int j = 0; j < PREP; j++) {
        if (t + NT * j < KW) {
            float v[8], gg[8];
            eight(xv[j], v);
            eight(gn[j], gg);
            u32 o[4];
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const u16 lo = to_bf16(rnd(v[2 * k] * inv) * gg[2 * k]);
                const u16 hi = to_bf16(rnd(v[2 * k + 1] * inv) * gg[2 * k + 1]);
                sb += __uint_as_float((u32)lo << 16) + __uint_as_float((u32)hi << 16);
                o[k] = (u32)lo | ((u32)hi << 16);
            }
            xs[t + NT * j] = make_uint4(o[0], o[1], o[2], o[3]);
        }
    }
    sb = warp_sum(sb);
    __syncthreads();  // (part is read above by every thread before it is written again)
    if (lane == 0) part[warp] = sb;
    __syncthreads();
    float sbt = 0.f;
#pragma unroll
    for (int s = 0; s < WARPS; s++) sbt += part[s];
    const int r = lane & 3;
    float acc[4][4];  // gate rows 0, 1; gate rows 2, 3; up rows 0, 1; up rows 2, 3 (fragments)
    for (int c0 = 0; c0 < n; c0 += STAGES) {
#pragma unroll
        for (int s = 0; s < STAGES; s++) {
            const int cc = c0 + s;
            if (cc < n) {
                const int item = first + (cc / CHUNKS) * stride, piece = cc % CHUNKS;
                if (piece == 0) {
#pragma unroll
                    for (int k = 0; k < 16; k++) acc[k / 4][k % 4] = 0.f;
                }
                mma_chunk(bg[s], bu[s], xs, piece, lane, acc);
                if (cc + STAGES < n)
                    load_chunk(w, first + ((cc + STAGES) / CHUNKS) * stride, (cc + STAGES) % CHUNKS, lane, bg[s],
                                   bu[s]);
                if (piece == CHUNKS - 1) {
#if PDL
                    if (cc == n - 1) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
                    // the diagonal, row place g (quad rows 0, 2) and g + 8 (rows 1, 3), column g: held
                    // by lane c = g / 2 of group g, at d[g % 2] and d[2 + g % 2]
                    const bool diag = c == (g >> 1), odd = g & 1;
                    float v[8];
#pragma unroll
                    for (int m = 0; m < 4; m++) {
                        v[2 * m] = diag ? (odd ? acc[m][1] : acc[m][0]) : 0.f;
                        v[2 * m + 1] = diag ? (odd ? acc[m][3] : acc[m][2]) : 0.f;
                    }
#pragma unroll
                    for (int k = 0; k < 8; k++) v[k] = warp_sum(v[k]);
                    // v: gate rows 0, 1, 2, 3 at v[0], v[1], v[2], v[3]; up at v[4..7]
                    if (lane < 4) {
                        const int row = item * 4 + r;
                        const float tg = r == 0 ? v[0] : r == 1 ? v[1] : r == 2 ? v[2] : v[3];
                        const float tu = r == 0 ? v[4] : r == 1 ? v[5] : r == 2 ? v[6] : v[7];
                        const float gt = rnd((tg - (128.f + zeros[row]) * sbt) * scales[row]);
                        const float ut = rnd((tu - (128.f + zeros[INTER + row]) * sbt) * scales[INTER + row]);
                        const float act = rnd(gt / (1.f + expf(-gt)));
                        h[row] = to_bf16(act * ut);
                    }
                }
            }
        }
    }
}
