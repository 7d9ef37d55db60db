// The batch-invariant 4-bit product for a few tokens (1 to 8) in CUDA C, compiled at run time by
// NVRTC (backends/cuda.py): the same sums, bit for bit, as Triton's `q4_invariant`
// (backends/kernels/q4.py) at any token count, in less time at one token (and a few of down),
// where Triton's 16-token tile spends its time unpacking and changing layouts (docs/journal.md).
//
// What a row of the output sums, as `_q4_mm` does with `q4_invariant_config`'s launch shape: the
// inputs cut into SPLIT parts of KS (the last one shorter); in each part, a chain of tensor-core
// products of 16 inputs (mma.m16n8k16, bfloat16, float32 sums) in input order, from zero, with the
// weights as the 16-bit floats q - z (exact) and the row's tokens' bfloat16 inputs; the parts
// added in order (part 0 + part 1 + ...) by the last warp of a tile to finish; then the row scale
// (and the bias: in one FMA, as Triton's compiler contracts it; separately, 1-4 of 4608 outputs
// differ on an H200), one rounding.
//
// The work: a warp takes ROWS rows of W (quads of the interleaved layout, `_mac` in
// backends/kernels/matvec.py) and one part of K. With 32 rows its lane group g (lane / 4) holds
// quad g and each 16-input step is two MMAs: rows 0, 1 of the quads in MMA row places g, g + 8,
// then rows 2, 3; with 16 rows group g holds rows 2 (g % 2), +1 of quad g / 2, one MMA. Lane c of
// a group takes the pair c of each word (inputs 2c, 2c + 1 of the word's eight), which are the A
// fragment's columns 2c, 2c + 1 (first word) and 2c + 8, 2c + 9 (second): inputs in order. B's
// column g is token g's inputs (zero past m). Words and inputs come through shared memory, a
// warp's own, in STAGES chunks of STEPS steps in flight (cp.async, 16 contiguous bytes a lane: the
// words of a quad's consecutive inputs, runs of 32 STEPS bytes; the inputs after the wait for the
// previous kernel), read back by each group with 16-byte loads (8 with 16 rows). A split tile's
// last warp requests every part's sums at once, then adds them in order. Measured on an H200 at
// one token (docs/journal.md; us, `_q4_mm` first): gate/up 42.1 -> 31.4, down 24.2 -> 16.2, q/k/v
// 9.1 -> 7.5, o 7.9 -> 6.6 (`chain_shape` in backends/kernels/q4.py picks the launch shapes; at 2-8
// tokens only down is faster here). The words through registers instead of cp.async were no
// faster.
//
// Compile-time constants (NVRTC -D): N (rows), K (inputs), KS (inputs a part), SPLIT (parts), MT
// (token places: m rounded up to 1, 2, 4 or 8), ROWS (16 or 32 a warp), WARPS (warps a block),
// STEPS (16-input steps a chunk), STAGES (chunks in flight), HAS_BIAS, PDL (launched as a
// programmatic dependent: the first chunks' words are requested before the wait for the previous
// kernel).
//
// No headers: bfloat16 values are handled as bit patterns.

typedef unsigned int u32;
typedef unsigned short u16;

#define QUADS (ROWS / 4)               // quads of rows a warp
#define TILES (N / ROWS)               // a warp's rows: a tile
#define KW (K / 8)                     // 4-bit words a row
#define CW (2 * STEPS)                 // words of a row a chunk
#define ROW_BYTES (CW * 16 + 16)       // a quad's chunk in shared memory, padded (no bank conflicts)
#define CHUNK_BYTES (QUADS * ROW_BYTES)
#define XROW (32 * STEPS + 16)         // a token's inputs of a chunk in shared memory, padded
#define STAGE_BYTES (CHUNK_BYTES + MT * XROW)
#define FRAG (ROWS / 16 * 4)           // a lane's sums

static_assert(ROWS == 16 || ROWS == 32, "16 or 32 rows a warp");
static_assert(N % ROWS == 0, "whole tiles");
static_assert(KS % (16 * STEPS) == 0 && K % (16 * STEPS) == 0, "whole chunks");
static_assert((K + KS - 1) / KS == SPLIT, "SPLIT parts of KS");
static_assert(QUADS * CW % 32 == 0, "a chunk is whole 16-byte copies of the warp");
static_assert(MT == 1 || MT == 2 || MT == 4 || MT == 8, "1, 2, 4 or 8 token places");

__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void copy16(u32 dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}

__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N_>
__device__ __forceinline__ void wait_chunks() { asm volatile("cp.async.wait_group %0;" ::"n"(N_) : "memory"); }

__device__ __forceinline__ uint4 ld_shared4(u32 a) {
    uint4 r;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"(a));
    return r;
}

__device__ __forceinline__ u32 ld_shared1(u32 a) {
    u32 r;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(r) : "r"(a));
    return r;
}

__device__ __forceinline__ uint2 ld_shared2(u32 a) {
    uint2 r;
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(r.x), "=r"(r.y) : "r"(a));
    return r;
}

__device__ __forceinline__ u16 to_bf16(float v) {
    u16 b;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(v));
    return b;
}

// Pair c of word w (its inputs 2c, 2c + 1) as two bfloat16 q - z: one LOP3 makes 128 + q in each
// half, one paired FMA adds nz = -(128 + z) (as `_pairs16`)
__device__ __forceinline__ u32 pair(u32 w, int c, u32 nz) {
    u32 t, r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(t) : "r"(w >> (4 * c)), "r"(0x000F000Fu), "r"(0x43004300u));
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(t), "r"(0x3F803F80u), "r"(nz));
    return r;
}

__device__ __forceinline__ void mma(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}


// A chunk of this warp's part into its shared buffer: each quad's CW words at 16 bytes, so that
// a warp's copy is runs of 16 * CW contiguous bytes
__device__ __forceinline__ void load_chunk(const uint4* w, int quad0, int kw0, u32 buf, int lane) {
#pragma unroll
    for (int i = lane; i < QUADS * CW; i += 32) {
        const int q = i / CW, j = i % CW;
        copy16(buf + q * ROW_BYTES + j * 16, w + (long long)(quad0 + q) * KW + kw0 + j);
    }
}

// The tokens' inputs of a chunk (from input k0) into the stage's shared buffer after the words
// (tokens past m are never read)
__device__ __forceinline__ void load_inputs(const u16* x, int m, int k0, u32 buf, int lane) {
#pragma unroll
    for (int i = lane; i < MT * CW; i += 32) {
        const int t = i / CW, j = i % CW;
        if (t < m) copy16(buf + CHUNK_BYTES + t * XROW + j * 16, x + (long long)t * K + k0 + 8 * j);
    }
}

__device__ __forceinline__ void mma_chunk(u32 buf, int m, int g, int c, const u32* nz, float* acc) {
#pragma unroll
    for (int s = 0; s < STEPS; s++) {
        // the B fragment: token g's inputs 16s + 2c, +1 and 16s + 2c + 8, +9 (zero past the tokens)
        const u32 xa = buf + CHUNK_BYTES + (g < MT ? g : 0) * XROW + (16 * s + 2 * c) * 2;
        const u32 b0 = g < m ? ld_shared1(xa) : 0u;
        const u32 b1 = g < m ? ld_shared1(xa + 16) : 0u;
#if ROWS == 32
        const uint4 v = ld_shared4(buf + g * ROW_BYTES + (2 * s) * 16);      // quad g's words, inputs 16s..
        const uint4 u = ld_shared4(buf + g * ROW_BYTES + (2 * s + 1) * 16);  // and 16s + 8..
        mma(acc, pair(v.x, c, nz[0]), pair(v.y, c, nz[1]), pair(u.x, c, nz[0]), pair(u.y, c, nz[1]), b0, b1);
        mma(acc + 4, pair(v.z, c, nz[2]), pair(v.w, c, nz[3]), pair(u.z, c, nz[2]), pair(u.w, c, nz[3]), b0, b1);
#else
        const u32 at = buf + (g >> 1) * ROW_BYTES + (g & 1) * 8;  // rows 2 (g & 1), +1 of quad g / 2
        const uint2 v = ld_shared2(at + (2 * s) * 16);
        const uint2 u = ld_shared2(at + (2 * s + 1) * 16);
        mma(acc, pair(v.x, c, nz[0]), pair(v.y, c, nz[1]), pair(u.x, c, nz[0]), pair(u.y, c, nz[1]), b0, b1);
#endif
    }
}

// -(128 + z) as a bfloat16 in both halves of a word, for row r
__device__ __forceinline__ u32 neg_zero(const float* zeros, int r) {
    const u32 h = to_bf16(-(128.f + zeros[r]));
    return h | (h << 16);
}

__device__ __forceinline__ void out_row(u16* y, const float* scales, const u16* bias, int m, int r, int t, float v) {
    if (t < m) {
        float o;
#if HAS_BIAS
        o = fmaf(v, scales[r], __uint_as_float((u32)bias[r] << 16));  // one FMA: Triton contracts y * s + b
#else
        o = v * scales[r];
#endif
        y[t * N + r] = to_bf16(o);
    }
}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
q4_chain(const u16* x, const uint4* __restrict__ w, const float* __restrict__ scales,
         const float* __restrict__ zeros, const u16* __restrict__ bias, u16* y, float* part, int* count, int m) {
    __shared__ __align__(16) unsigned char smem[WARPS * STAGES * STAGE_BYTES];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int tile = blockIdx.x * WARPS + warp, sp = blockIdx.y;
    if (tile >= TILES) return;
    const u32 base = smem_addr(smem) + warp * (STAGES * STAGE_BYTES);
    const int quad0 = tile * QUADS, k_lo = sp * KS;
    const int n = (K - k_lo < KS ? K - k_lo : KS) / (16 * STEPS);  // chunks of this part
    // the first STAGES chunks' words before the wait; their inputs after it, a commit group each
    // (the first group holds all of those words)
#pragma unroll
    for (int s = 0; s < STAGES; s++)
        if (s < n) load_chunk(w, quad0, k_lo / 8 + s * CW, base + s * STAGE_BYTES, lane);
#if ROWS == 32
    const int r = tile * 32 + 4 * g;  // the rows of this lane's sums: r .. r + 3
    const u32 nz[4] = {neg_zero(zeros, r), neg_zero(zeros, r + 1), neg_zero(zeros, r + 2), neg_zero(zeros, r + 3)};
#else
    const int r = tile * 16 + 4 * (g >> 1) + 2 * (g & 1);  // r, r + 1
    const u32 nz[2] = {neg_zero(zeros, r), neg_zero(zeros, r + 1)};
#endif
#if PDL
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
#pragma unroll
    for (int s = 0; s < STAGES; s++) {
        if (s < n) load_inputs(x, m, k_lo + s * 16 * STEPS, base + s * STAGE_BYTES, lane);
        commit();
    }
    float acc[FRAG];
#pragma unroll
    for (int i = 0; i < FRAG; i++) acc[i] = 0.f;
    for (int c0 = 0; c0 < n; c0 += STAGES) {
#pragma unroll
        for (int s = 0; s < STAGES; s++) {
            const int cc = c0 + s;
            if (cc < n) {
                wait_chunks<STAGES - 1>();
                __syncwarp();
                mma_chunk(base + s * STAGE_BYTES, m, g, c, nz, acc);
                __syncwarp();  // every lane has read the buffer before it is filled again
                if (cc + STAGES < n) {
                    load_chunk(w, quad0, k_lo / 8 + (cc + STAGES) * CW, base + s * STAGE_BYTES, lane);
                    load_inputs(x, m, k_lo + (cc + STAGES) * 16 * STEPS, base + s * STAGE_BYTES, lane);
                }
            }
            commit();
        }
    }
#if PDL
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
#if SPLIT > 1
    float* mine = part + ((long long)(tile * SPLIT + sp) * 32 + lane) * FRAG;
#pragma unroll
    for (int i = 0; i < FRAG; i += 4) *(float4*)(mine + i) = make_float4(acc[i], acc[i + 1], acc[i + 2], acc[i + 3]);
    __threadfence();
    __syncwarp();
    int last = 0;
    if (lane == 0) last = atomicAdd(count + tile, 1) == SPLIT - 1;
    last = __shfl_sync(0xffffffffu, last, 0);
    if (!last) return;
    __threadfence();
    // every part's sums requested at once (one after another, the last warp waited SPLIT round
    // trips to L2), then added in order
    const float4* all = (const float4*)(part + (long long)tile * SPLIT * 32 * FRAG + lane * FRAG);
    float4 p[SPLIT][FRAG / 4];
#pragma unroll
    for (int j = 0; j < SPLIT; j++)
#pragma unroll
        for (int i = 0; i < FRAG / 4; i++) p[j][i] = __ldcg(all + j * 8 * FRAG + i);
#pragma unroll
    for (int i = 0; i < FRAG / 4; i++) {
        float4 t = p[0][i];
#pragma unroll
        for (int j = 1; j < SPLIT; j++) {
            t.x += p[j][i].x;
            t.y += p[j][i].y;
            t.z += p[j][i].z;
            t.w += p[j][i].w;
        }
        acc[4 * i] = t.x;
        acc[4 * i + 1] = t.y;
        acc[4 * i + 2] = t.z;
        acc[4 * i + 3] = t.w;
    }
    if (lane == 0) count[tile] = 0;
#endif
    // fragments: acc[0], acc[1] row r (MMA row g), tokens 2c, 2c + 1; acc[2], acc[3] row r + 1
    // (MMA row g + 8); for 32 rows acc[4..7] rows r + 2, r + 3
#pragma unroll
    for (int i = 0; i < FRAG; i++) out_row(y, scales, bias, m, r + i / 2, 2 * c + i % 2, acc[i]);
}
