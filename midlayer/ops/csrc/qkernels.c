/* Batch-invariant CPU kernels for midlayer's `q4` inference format (see midlayer/kernels.py), and the static
 * decode step's fp32 and bf16 linear (qk_linear_f32 / qk_linear_bf16, "fp32 and bf16 linears" below).
 *
 * Each computation has a portable scalar version and an AVX2 version that return bit-identical results,
 * the GEMMs also an AVX512-VNNI version (the functions are compiled with target attributes and picked at run
 * time: qk_simd_level), and qk_block_q4 chains them into one whole block:
 *
 *   quantize_q8   x [M, K] fp32 -> per row, per group of 32: int8 codes q, scale d = amax / 127 and
 *                 s = d * sum(q)  (llama.cpp's Q8_1 activation layout: Gerganov et al., ggml).
 *   gemm_q4_1     y[m, n] = sum_g (d_w d_x) isum + m_w s_x  with 4-bit weights w = d_w q + m_w (Q4_1).
 *   gemm_q8_0     y[m, n] = sum_g (d_w d_x) isum            with 8-bit weights w = d_w q (Q8_0).
 *   attention     one query row at a time over an additive mask: softmax(q k^T / sqrt(d) + mask) v,
 *                 its sums over the visible keys only, in slot order (so also invariant to where in the
 *                 cache those keys sit: draft trees interleave siblings' rows with a node's ancestors).
 *
 * Why these are batch-invariant (a row's result does not depend on how many rows share the call): the
 * block dot products isum are exact int32 sums, and every float operation is done per row in a fixed
 * order that does not depend on M (or, for attention, on how many query rows there are). That order is
 * the contract that kernels.py's pure-PyTorch reference reproduces bit for bit ("canonical order"):
 *
 *   isum_g = the exact integer dot product of block g (32 weight codes x 32 activation codes), int32;
 *   acc = 0.0f;  for g = 0, 1, ..., G-1 in order:
 *     Q4_1:  acc <- (acc + (d_w,g * d_x,g) * float(isum_g)) + m_w,g * s_x,g
 *     Q8_0:  acc <- acc + (d_w,g * d_x,g) * float(isum_g)
 *   y = acc.
 * Every * and + is a separately rounded fp32 operation (no fused multiply-add): first d_w * d_x, then
 * times float(isum) (exact: |isum| < 2^24), then added to acc; for Q4_1 then m_w * s_x, added to acc.
 *
 * Weight layout (built by kernels.quantize_q4_1 / quantize_q8_0): outputs are interleaved by groups of 8
 * (N padded up to a multiple of 8 with zero codes and zero scales; padded outputs are never written).
 * For output group o (outputs 8o..8o+7, j = n - 8o), block g, element e = 4c + i (chunk c = 0..7, i = 0..3):
 *   Q4_1 codes: 128 bytes at (o G + g) * 128; byte 32 (c mod 4) + 4 j + i holds element e of output j in
 *               its low nibble if c < 4, in its high nibble if c >= 4 (so one 32-byte load, after `& 15`
 *               or `>> 4 & 15`, is 8 outputs x 4 consecutive elements);
 *               scales: 16 fp16 at (o G + g) * 16: d_w of outputs j = 0..7, then m_w of outputs 0..7.
 *   Q8_0 codes: 256 bytes at (o G + g) * 256; byte 32 c + 4 j + i holds element e of output j (int8,
 *               in [-127, 127]); scales: 8 fp16 at (o G + g) * 8, d_w of outputs 0..7.
 * The AVX2 GEMMs broadcast a row's 4 activation bytes of chunk c to all 8 outputs, so the 8 outputs' block
 * sums come out in the 8 int32 lanes of one register and the float work is one vector op per 8 outputs
 * (no horizontal sums). Q4_1: pair products |w a| <= 15 * 127, so the 16 int16 pair sums of a block's 8
 * chunks stay below 8 * 3810 = 30480 and are summed in int16 before one madd; Q8_0 (|w a| <= 127^2) widens
 * every chunk to int32.
 *
 * Compile with -ffp-contract=off so that the compiler does not fuse the multiply-adds of the scalar path (the
 * attention's dot products and weighted sums, and the fp32 linear's, are fused on purpose, fmaf and vfmadd
 * alike).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* The SIMD versions are x86-64's. Any other CPU (arm64: Apple silicon, Graviton, ...) builds the portable
 * scalar versions alone, and so does an x86-64 build with -DQK_PORTABLE (kernels.compile_library(portable=True):
 * how the tests check that build): the same bits either way, the scalar versions being the reference order. */
#if (defined(__x86_64__) || defined(_M_X64)) && !defined(QK_PORTABLE)
#define QK_X86 1
#include <immintrin.h>
#else
#define QK_X86 0
#endif

#define QK 32
#define INLINE static inline __attribute__((always_inline))
#define NOINLINE static __attribute__((noinline))
#define GEMM_Q4_ARGS const int8_t *xq, const float *xd, const float *xs, int M, int K, const uint8_t *wq, \
                     const uint16_t *wdm, int o0, int o1, int N, float *y, long ldy
#define GEMM_Q8_ARGS const int8_t *xq, const float *xd, int M, int K, const int8_t *wq, const uint16_t *wd, \
                     int o0, int o1, int N, float *y, long ldy

static float f16_to_f32(uint16_t h) {
    /* IEEE half -> single, exact (every half is a float). */
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400u)) { man <<= 1; exp--; }
            man &= 0x3ffu;
            bits = sign | (exp << 23) | (man << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* IEEE single -> half, rounded to nearest even: what F16C's vcvtps2ph (imm 0) and torch's .half() give for
 * every finite value. Overflow goes to infinity, values below half's range to subnormals or zero; a NaN stays a
 * quiet NaN (its payload's top bits kept, as vcvtps2ph keeps them). */
static uint16_t f32_to_f16(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    uint16_t sign = (uint16_t)((b >> 16) & 0x8000u);
    uint32_t a = b & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7e00u | (uint16_t)((a >> 13) & 0x3ffu);
    int e = (int)(a >> 23) - 127; /* a float subnormal (e = -127) lies far below half's range */
    if (e > 15) return sign | 0x7c00u;
    if (e < -25) return sign;     /* below 2^-25: nearer to 0 than to the least subnormal 2^-24 */
    uint32_t m = (a & 0x7fffffu) | 0x800000u;
    int shift = e >= -14 ? 13 : -1 - e; /* significand bits dropped: 13 for a normal half, more below 2^-14 */
    uint32_t q = m >> shift, rem = m & ((1u << shift) - 1u), halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (q & 1u))) q++;
    if (e < -14) return sign | (uint16_t)q; /* subnormal; q = 0x400 is the least normal, bits and all */
    /* q in [0x400, 0x800]: a carry out of the 10 stored bits moves the exponent up (to infinity from 2^15) */
    return sign | (uint16_t)(((uint32_t)(e + 15) << 10) + q - 0x400u);
}

static inline float bf16_to_f32(uint16_t h) { /* exact: a bf16 is an fp32's top half */
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* IEEE single -> bfloat16, rounded to nearest even (torch's .to(torch.bfloat16) for every non-NaN value;
 * overflow rounds to infinity); a NaN stays a quiet NaN of its sign. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* The KV cache's element type, `kv16`: 0 fp32, 1 fp16 (KV_F16), 2 bf16 (KV_BF16). A 16-bit value widens to fp32
 * exactly, so the attention's arithmetic is the same fp32 arithmetic whatever the cache holds. */
#define KV_F16 1
#define KV_BF16 2
static inline float kv_at(const void *p, long i, int kv16) {
    if (kv16 == KV_F16) return f16_to_f32(((const uint16_t *)p)[i]);
    if (kv16 == KV_BF16) return bf16_to_f32(((const uint16_t *)p)[i]);
    return ((const float *)p)[i];
}

static float hsum8_scalar(const float *a) {
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

/* 1 / d for a group's codes, 0 where d is 0 or so small (amax < ~3.7e-37) that 1 / d overflows: the codes are
 * then 0 (an infinite inverse gave -128 codes on AVX2, undefined behaviour in the scalar cast, NaN in torch) */
static inline float q8_inverse(float dd) {
    return dd >= FLT_MIN ? 1.0f / dd : 0.0f;
}

/* A group holding a NaN or an infinity has no scale: its codes are 0 and d = s = NaN, so that every output it
 * feeds is NaN, as a float GEMM's would be (the max skipped a NaN, and its code was whatever the conversion of
 * NaN gave: INT_MIN in the scalar sum, -128 on AVX2, finite outputs ~1e8). One rule for every SIMD level. */
static inline int q8_group_finite(const float *xg) {
    int finite = 1;
    for (int j = 0; j < QK; j++) finite &= isfinite(xg[j]) != 0;
    return finite;
}

static inline void q8_group_nan(int8_t *qg, float *d, float *s) {
    memset(qg, 0, QK);
    *d = NAN;
    *s = NAN;
}

/* ================================================================================ scalar reference */
static void quantize_q8_scalar(const float *x, long ldx, int M, int K, int8_t *q, float *d, float *s) {
    int G = K / QK;
    for (int m = 0; m < M; m++) {
        for (int g = 0; g < G; g++) {
            const float *xg = x + m * ldx + g * QK;
            if (!q8_group_finite(xg)) {
                q8_group_nan(q + (long)m * K + g * QK, d + (long)m * G + g, s + (long)m * G + g);
                continue;
            }
            float amax = 0.0f;
            for (int j = 0; j < QK; j++) {
                float a = fabsf(xg[j]);
                amax = a > amax ? a : amax;
            }
            float dd = amax / 127.0f;
            float id = q8_inverse(dd);
            int sum = 0;
            for (int j = 0; j < QK; j++) {
                int v = (int)nearbyintf(xg[j] * id);
                q[(long)m * K + g * QK + j] = (int8_t)v;
                sum += v;
            }
            d[(long)m * G + g] = dd;
            s[(long)m * G + g] = dd * (float)sum;
        }
    }
}

/* Output groups [o0, o1) (outputs 8 o0 .. min(8 o1, N) - 1) of all M rows, in the canonical order: the 8
 * outputs of a group side by side (the header's layout, chunk by chunk), each one's block sum an exact int32
 * and its float work the canonical sequence. (On arm64 these are the kernels that run. Output by output, with
 * each code's address computed alone, SmolLM2's block linears took 2.5x this time; in 32 lanes, one per code
 * byte, which gcc vectorises, 2.1x: x86-64 builds with -DQK_PORTABLE, docs/results/decode-cpu.md, 61st session.) */
static void gemm_q4_1_scalar(const int8_t *xq, const float *xd, const float *xs, int M, int K,
                             const uint8_t *wq, const uint16_t *wdm, int o0, int o1, int N, float *y, long ldy) {
    int G = K / QK;
    for (int o = o0; o < o1; o++) {
        int nv = N - 8 * o < 8 ? N - 8 * o : 8;
        for (int m = 0; m < M; m++) {
            const int8_t *a = xq + (long)m * K;
            float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            for (int g = 0; g < G; g++) {
                const uint8_t *wb = wq + ((long)o * G + g) * 128; /* byte 32 c + 4 j + i, c = 0..3 */
                const uint16_t *sc = wdm + ((long)o * G + g) * 16;
                const int8_t *ag = a + g * QK;
                int32_t isum[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                for (int c = 0; c < 4; c++)
                    for (int j = 0; j < 8; j++)
                        for (int i = 0; i < 4; i++) {
                            int b = wb[32 * c + 4 * j + i];
                            isum[j] += (b & 0xf) * ag[4 * c + i] + (b >> 4) * ag[16 + 4 * c + i];
                        }
                float dx = xd[(long)m * G + g], sx = xs[(long)m * G + g];
                for (int j = 0; j < 8; j++) {
                    acc[j] = acc[j] + (f16_to_f32(sc[j]) * dx) * (float)isum[j];
                    acc[j] = acc[j] + f16_to_f32(sc[8 + j]) * sx;
                }
            }
            for (int j = 0; j < nv; j++) y[(long)m * ldy + 8 * o + j] = acc[j];
        }
    }
}

static void gemm_q8_0_scalar(const int8_t *xq, const float *xd, int M, int K, const int8_t *wq,
                             const uint16_t *wd, int o0, int o1, int N, float *y, long ldy) {
    int G = K / QK;
    for (int o = o0; o < o1; o++) {
        int nv = N - 8 * o < 8 ? N - 8 * o : 8;
        for (int m = 0; m < M; m++) {
            const int8_t *a = xq + (long)m * K;
            float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            for (int g = 0; g < G; g++) {
                const int8_t *wb = wq + ((long)o * G + g) * 256; /* byte 32 c + 4 j + i, c = 0..7 */
                const uint16_t *sc = wd + ((long)o * G + g) * 8;
                const int8_t *ag = a + g * QK;
                int32_t isum[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                for (int c = 0; c < 8; c++)
                    for (int j = 0; j < 8; j++)
                        for (int i = 0; i < 4; i++) isum[j] += wb[32 * c + 4 * j + i] * ag[4 * c + i];
                float dx = xd[(long)m * G + g];
                for (int j = 0; j < 8; j++) acc[j] = acc[j] + (f16_to_f32(sc[j]) * dx) * (float)isum[j];
            }
            for (int j = 0; j < nv; j++) y[(long)m * ldy + 8 * o + j] = acc[j];
        }
    }
}

/* exp(x) for x <= 0 (softmax after subtracting the max): Cody-Waite range reduction and a degree-6
 * polynomial, written once as a sequence of single-rounded operations so that the scalar and AVX2 versions
 * agree bit for bit. Relative error ~2e-7; exp(-inf) = 0. */
#define EXP_LO (-87.3f)
static float exp_scalar(float x) {
    if (!(x >= EXP_LO)) return 0.0f; /* also NaN -> 0: cannot happen for finite scores */
    float n = nearbyintf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r;
    p = p + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &e, 4);
    return p * two_n;
}

/* Drop the `hidden` invisible keys (mask -inf, counted by the caller's score loop) from the scores, in slot
 * order: scores[0..n) then holds the visible keys' scores and keys[0..n) their slots; returns n. The sums
 * below run over this compacted list, so a row's result depends only on the sequence of keys it sees, not
 * on the slots they occupy: a draft-tree node whose ancestors sit at slots p+1, p+3 (a sibling's row at p+2
 * masked) gets the bits a plain decode step gets with the same keys at p+1, p+2 -- what keeps tree
 * verification lossless (speculative.py). *out == NULL when every key is visible (no copy: slot = index). */
static int visible_keys(float *scores, int S, const float *mask, int hidden, int *keys, int **out) {
    int n = 0;
    if (!hidden) { *out = 0; return S; }
    for (int s = 0; s < S; s++)
        if (mask[s] != -INFINITY) { scores[n] = scores[s]; keys[n] = s; n++; }
    *out = keys;
    return n;
}

static void attention_row_scalar(const float *q, const void *k, const void *v, long sk, const float *mask,
                                 int S, int D, float scale, float *scores, int *keys, float *out, int kv16) {
    float mx = -INFINITY;
    int hidden = 0;
    for (int s = 0; s < S; s++) {
        if (mask && mask[s] == -INFINITY) { scores[s] = -INFINITY; hidden++; continue; } /* invisible: skip the dot */
        float acc[8] = {0};
        for (int j = 0; j < D; j++) acc[j & 7] = fmaf(q[j], kv_at(k, s * sk + j, kv16), acc[j & 7]);
        float sc = hsum8_scalar(acc) * scale;
        if (mask) sc = sc + mask[s];
        scores[s] = sc;
        mx = sc > mx ? sc : mx;
    }
    int *slot;
    int n = visible_keys(scores, S, mask, hidden, keys, &slot);
    float lanes[8] = {0};
    for (int s = 0; s < n; s++) {
        float p = exp_scalar(scores[s] - mx);
        scores[s] = p;
        lanes[s & 7] = lanes[s & 7] + p;
    }
    float inv = 1.0f / hsum8_scalar(lanes);
    for (int j = 0; j < D; j++) out[j] = 0.0f;
    for (int s = 0; s < n; s++) {
        float p = scores[s];
        if (p == 0.0f) continue; /* a key whose weight underflowed: adds exactly nothing */
        long vs = (slot ? slot[s] : s) * sk;
        for (int j = 0; j < D; j++) out[j] = fmaf(p, kv_at(v, vs + j, kv16), out[j]);
    }
    for (int j = 0; j < D; j++) out[j] = out[j] * inv;
}

/* ==================================================================================== AVX2 versions */
#if QK_X86
#define AVX2 __attribute__((target("avx2,fma,f16c")))

AVX2 static inline float hsum8_avx2(__m256 a) {
    __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1)); /* l + (l+4) */
    __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));                               /* (0+2), (1+3) */
    return _mm_cvtss_f32(_mm_add_ss(t2, _mm_shuffle_ps(t2, t2, 1)));
}

AVX2 static void quantize_q8_avx2(const float *x, long ldx, int M, int K, int8_t *q, float *d, float *s) {
    int G = K / QK;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int m = 0; m < M; m++) {
        for (int g = 0; g < G; g++) {
            const float *xg = x + m * ldx + g * QK;
            if (!q8_group_finite(xg)) {
                q8_group_nan(q + (long)m * K + g * QK, d + (long)m * G + g, s + (long)m * G + g);
                continue;
            }
            __m256 v0 = _mm256_loadu_ps(xg), v1 = _mm256_loadu_ps(xg + 8), v2 = _mm256_loadu_ps(xg + 16),
                   v3 = _mm256_loadu_ps(xg + 24);
            __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                      _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
            float amax = _mm_cvtss_f32(m4);
            float dd = amax / 127.0f;
            float id = q8_inverse(dd);
            __m256 vid = _mm256_set1_ps(id);
            const int rnd = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
            __m256i i0 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v0, vid), rnd));
            __m256i i1 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v1, vid), rnd));
            __m256i i2 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v2, vid), rnd));
            __m256i i3 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v3, vid), rnd));
            __m256i sum = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
            s4 = _mm_hadd_epi32(s4, s4);
            s4 = _mm_hadd_epi32(s4, s4);
            /* pack 32 int32 -> 32 int8 in order (packs interleave 128-bit lanes; permute restores order) */
            __m256i p01 = _mm256_packs_epi32(i0, i1), p23 = _mm256_packs_epi32(i2, i3);
            __m256i p = _mm256_packs_epi16(p01, p23);
            p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *)(q + (long)m * K + g * QK), p);
            d[(long)m * G + g] = dd;
            s[(long)m * G + g] = dd * (float)_mm_cvtsi128_si32(s4);
        }
    }
}

/* 4 activation bytes (one chunk of 4 consecutive elements) broadcast to all 8 int32 lanes */
AVX2 INLINE __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* Software prefetch of the weight stream: `lines` cache lines of codes PREFETCH bytes ahead of the block
 * being read, and a line of scales PREFETCH / 4 bytes ahead (level with the codes for Q4_1, whose scales
 * are a quarter of its codes; further ahead for Q8_0's). Each output group is one contiguous stream and the
 * groups of a work item follow each other, so "ahead" runs on into the next group. The hardware prefetcher
 * alone left the tiles waiting on memory: on Zen 2, streaming 40 distinct 3072x576 Q4_1 weights (more than
 * the L3), one row went from 52 to 44 us per linear and four rows from 71 to 58 us. Prefetches change no
 * bits. */
#define PREFETCH 1024
AVX2 INLINE void prefetch_ahead(const void *codes, int lines, const void *scales) {
    for (int i = 0; i < lines; i++) _mm_prefetch((const char *)codes + PREFETCH + 64 * i, _MM_HINT_T0);
    _mm_prefetch((const char *)scales + PREFETCH / 4, _MM_HINT_T0);
}

/* the first nv lanes of v to dst: a group of 8 outputs, of which the last may be padding */
AVX2 INLINE void store_outputs(float *dst, __m256 v, int nv) {
    if (nv >= 8) {
        _mm256_storeu_ps(dst, v);
    } else { /* (a copy through a stack buffer would make the accumulators addressable: they would spill) */
        __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        _mm256_maskstore_ps(dst, _mm256_cmpgt_epi32(_mm256_set1_epi32(nv), lane), v);
    }
}

/* One register tile: the 8 outputs of group o x R rows (R = 4, 2 or 1: DEFINE_Q4_TILE(R) defines
 * q4_tile_<R>; the VNNI family below shares this body with its own block-sum step), all K. R is a literal,
 * so the block sums stay in registers (16 ymm: with R = 4 the inner loop fits, the float accumulators may go
 * to the stack once per block). Each weight register is used by
 * all R rows; a row's arithmetic does not depend on R. The empty asm after each int16 accumulation keeps
 * the sums in chunk order: without it GCC reassociates the integer adds into a tree whose partial products
 * spill (same result, slower). Timed on Zen 2: vpmaddubsw and vpmaddwd share one pipe at 1/cycle, so a
 * row costs at least 9 cycles per group of 8 outputs and block (Q4_1), 16 (Q8_0); measured ~13 and ~20
 * with R = 4. Two output groups per tile for one row (sharing the broadcasts) spilled and was slower. */
#define DEFINE_Q4_TILE_FAMILY(ATTR, NAME, STEP, SUM, R)                                                      \
    ATTR NOINLINE void NAME##_##R(const int8_t *xq, const float *xd, const float *xs, int K, const uint8_t *wq, \
                                  const uint16_t *wdm, int o, int m0, int N, float *y, long ldy) {           \
        const int G = K / QK;                                                                                \
        const __m256i lo4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);                             \
        const uint8_t *wo = wq + (long)o * G * 128;                                                          \
        const uint16_t *so = wdm + (long)o * G * 16;                                                         \
        __m256 acc[R];                                                                                       \
        __m256i sums[R];                                                                                     \
        (void)ones;                                                                                          \
        for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();                                            \
        for (int g = 0; g < G; g++) {                                                                        \
            prefetch_ahead(wo + g * 128, 2, so + g * 16);                                                    \
            for (int v = 0; v < 4; v++) {                                                                    \
                __m256i raw = _mm256_loadu_si256((const __m256i *)(wo + g * 128 + 32 * v));                  \
                __m256i wl = _mm256_and_si256(raw, lo4);                       /* chunk v: elements 4v..4v+3 */ \
                __m256i wh = _mm256_and_si256(_mm256_srli_epi16(raw, 4), lo4); /* chunk v + 4: 16+4v.. */    \
                for (int r = 0; r < R; r++) {                                                                \
                    const int8_t *a = xq + (long)(m0 + r) * K + g * QK;                                      \
                    STEP(sums[r], v, wl, bcast4(a + 4 * v), wh, bcast4(a + 16 + 4 * v));                     \
                }                                                                                            \
            }                                                                                                \
            __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(so + g * 16)));                    \
            __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(so + g * 16 + 8)));                \
            for (int r = 0; r < R; r++) {                                                                    \
                long m = m0 + r;                                                                             \
                __m256 isum = _mm256_cvtepi32_ps(SUM(sums[r])); /* exact int32 sums */                       \
                __m256 dd = _mm256_mul_ps(dw, _mm256_broadcast_ss(xd + m * G + g));                          \
                acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(dd, isum));                                     \
                acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(mw, _mm256_broadcast_ss(xs + m * G + g)));      \
            }                                                                                                \
        }                                                                                                    \
        for (int r = 0; r < R; r++) store_outputs(y + (long)(m0 + r) * ldy + 8 * o, acc[r], N - 8 * o);     \
    }
/* AVX2: the pair products of chunk v summed in int16 (|.| <= 8 * 2 * 15 * 127 < 2^15), widened once a block */
#define Q4_STEP_AVX2(s, v, wl, al, wh, ah)                                                                   \
    do {                                                                                                     \
        __m256i p_ = _mm256_add_epi16(_mm256_maddubs_epi16(wl, al), _mm256_maddubs_epi16(wh, ah));           \
        s = v ? _mm256_add_epi16(s, p_) : p_;                                                                \
        __asm__("" : "+x"(s));                                                                               \
    } while (0)
#define Q4_SUM_AVX2(s) _mm256_madd_epi16(s, ones)
#define DEFINE_Q4_TILE(R) DEFINE_Q4_TILE_FAMILY(AVX2, q4_tile, Q4_STEP_AVX2, Q4_SUM_AVX2, R)

/* Q8_0 tiles, for a target attribute ATTR and a block-sum step DOT(acc, |w|, sign(a, w)) that adds the exact
 * int32 dot products of 4-byte groups to acc: the AVX2 one via maddubs + madd, the VNNI one below. */
#define DEFINE_Q8_TILE_FAMILY(ATTR, NAME, DOT, R)                                                            \
    ATTR NOINLINE void NAME##_##R(const int8_t *xq, const float *xd, int K, const int8_t *wq, const uint16_t *wd, \
                                  int o, int m0, int N, float *y, long ldy) {                                \
        const int G = K / QK;                                                                                \
        const __m256i ones = _mm256_set1_epi16(1);                                                           \
        const int8_t *wo = wq + (long)o * G * 256;                                                           \
        const uint16_t *so = wd + (long)o * G * 8;                                                           \
        __m256 acc[R];                                                                                       \
        __m256i s32[R];                                                                                      \
        (void)ones;                                                                                          \
        for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();                                            \
        for (int g = 0; g < G; g++) {                                                                        \
            prefetch_ahead(wo + g * 256, 4, so + g * 8);                                                     \
            for (int r = 0; r < R; r++) s32[r] = _mm256_setzero_si256();                                     \
            for (int c = 0; c < 8; c++) {                                                                    \
                __m256i w = _mm256_loadu_si256((const __m256i *)(wo + g * 256 + 32 * c));                    \
                __m256i aw = _mm256_sign_epi8(w, w); /* |w| as unsigned bytes, shared by the rows */         \
                for (int r = 0; r < R; r++) {                                                                \
                    __m256i a = bcast4(xq + (long)(m0 + r) * K + g * QK + 4 * c);                            \
                    s32[r] = DOT(s32[r], aw, _mm256_sign_epi8(a, w));                                        \
                }                                                                                            \
            }                                                                                                \
            __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(so + g * 8)));                     \
            for (int r = 0; r < R; r++) {                                                                    \
                __m256 dd = _mm256_mul_ps(dw, _mm256_broadcast_ss(xd + (long)(m0 + r) * G + g));             \
                acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(dd, _mm256_cvtepi32_ps(s32[r])));               \
            }                                                                                                \
        }                                                                                                    \
        for (int r = 0; r < R; r++) store_outputs(y + (long)(m0 + r) * ldy + 8 * o, acc[r], N - 8 * o);     \
    }
#define Q8_DOT_AVX2(acc, aw, sa) _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sa), ones))
#define DEFINE_Q8_TILE(R) DEFINE_Q8_TILE_FAMILY(AVX2, q8_tile, Q8_DOT_AVX2, R)

DEFINE_Q4_TILE(4)
DEFINE_Q4_TILE(3)
DEFINE_Q4_TILE(2)
DEFINE_Q4_TILE(1)
DEFINE_Q8_TILE(4)
DEFINE_Q8_TILE(3)
DEFINE_Q8_TILE(2)
DEFINE_Q8_TILE(1)

/* The same tiles with AVX512-VNNI (on 256-bit registers, AVX512-VL): vpdpbusd multiplies unsigned by
 * signed bytes and adds each group of 4 products to an int32 lane in one instruction, where AVX2 needs
 * maddubs (to int16), adds and a madd. The block sums are the same exact integers (no saturation: |sum| <
 * 2^24), and the float work per block is the AVX2 tile's, operation for operation: bit-identical results.
 * Q4_1: codes 0..15 are the unsigned operand, activations the signed one. Q8_0: |w| and sign(a, w) as in
 * the AVX2 tile. */
#define VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512vnni")))
/* VNNI: both chunks straight into int32 lanes */
#define Q4_STEP_VNNI(s, v, wl, al, wh, ah)                                                                   \
    s = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(v ? s : _mm256_setzero_si256(), wl, al), wh, ah)
#define Q4_SUM_VNNI(s) (s)
#define DEFINE_Q4_TILE_VNNI(R) DEFINE_Q4_TILE_FAMILY(VNNI, q4_tile_vnni, Q4_STEP_VNNI, Q4_SUM_VNNI, R)
#define DEFINE_Q8_TILE_VNNI(R) DEFINE_Q8_TILE_FAMILY(VNNI, q8_tile_vnni, _mm256_dpbusd_epi32, R)

DEFINE_Q4_TILE_VNNI(4)
DEFINE_Q4_TILE_VNNI(3)
DEFINE_Q4_TILE_VNNI(2)
DEFINE_Q4_TILE_VNNI(1)
DEFINE_Q8_TILE_VNNI(4)
DEFINE_Q8_TILE_VNNI(3)
DEFINE_Q8_TILE_VNNI(2)
DEFINE_Q8_TILE_VNNI(1)

/* The VNNI tiles on 512-bit registers (AVX512-BW for the byte ops): one tile is two output groups, o and
 * o + 1 -- a work item of the GEMMs below -- side by side, group o in lanes 0-7 and o + 1 in lanes 8-15. The
 * rows' activation bytes are still one broadcast (the same elements for both groups); the two groups' code
 * chunks are joined once per chunk and shared by the R rows. Each lane's operations are the 256-bit tile's,
 * in the same order: bit-identical. Why: on a Xeon (model 207) vpdpbusd zmm issues at nearly the rate of
 * vpdpbusd ymm (0.55 vs 0.48 cycles), so a row costs half the instructions per output
 * (docs/results/decode-cpu.md, 28th session). */
#define VNNI512 __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")))
VNNI512 INLINE __m512i join256(const void *a, const void *b) { /* 32 bytes of group o | 32 of o + 1 */
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}
VNNI512 INLINE __m512 join_halves(const uint16_t *a, const uint16_t *b) { /* 8 fp16 of o | 8 of o + 1 */
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)a)),
                                                   _mm_loadu_si128((const __m128i *)b), 1));
}
VNNI512 INLINE __m512i bcast4_512(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}
VNNI512 INLINE void store_outputs16(float *dst, __m512 v, int nv) {
    if (nv >= 16) _mm512_storeu_ps(dst, v);
    else _mm512_mask_storeu_ps(dst, (__mmask16)((1u << nv) - 1u), v);
}
/* The prefetch of a pair's two streams (groups o and o + 1, `span` bytes each, block b of `bb` bytes; their
 * scales likewise): the stream of group o + 1 runs on into o + 2, the next pair's first stream, by itself;
 * the stream of group o, past its end, is sent to o + 3 (the next pair's second stream), not into o + 1,
 * which its partner is reading already. */
VNNI512 INLINE void prefetch_pair(const char *w0, long span, long off, int lines, const char *s0, long sspan,
                                  long soff) {
    long x = off + PREFETCH, y = soff + PREFETCH / 4;
    const char *a = x < span ? w0 + x : w0 + 2 * span + x;
    const char *sa = y < sspan ? s0 + y : s0 + 2 * sspan + y;
    for (int i = 0; i < lines; i++) {
        _mm_prefetch(a + 64 * i, _MM_HINT_T0);
        _mm_prefetch(w0 + span + x + 64 * i, _MM_HINT_T0);
    }
    _mm_prefetch(sa, _MM_HINT_T0);
    _mm_prefetch(s0 + sspan + y, _MM_HINT_T0);
}
#define DEFINE_Q4_TILE_ZMM(R)                                                                                \
    VNNI512 NOINLINE void q4_tile_zmm_##R(const int8_t *xq, const float *xd, const float *xs, int K,        \
                                          const uint8_t *wq, const uint16_t *wdm, int o, int m0, int N,     \
                                          float *y, long ldy) {                                             \
        const int G = K / QK;                                                                                \
        const __m512i lo4 = _mm512_set1_epi8(0x0f);                                                          \
        const uint8_t *w0 = wq + (long)o * G * 128, *w1 = w0 + (long)G * 128;                                \
        const uint16_t *s0 = wdm + (long)o * G * 16, *s1 = s0 + (long)G * 16;                                \
        __m512 acc[R];                                                                                       \
        __m512i sums[R];                                                                                     \
        for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();                                            \
        for (int g = 0; g < G; g++) {                                                                        \
            prefetch_pair((const char *)w0, (long)G * 128, (long)g * 128, 2, (const char *)s0, (long)G * 32, \
                          (long)g * 32);                                                                     \
            for (int v = 0; v < 4; v++) {                                                                    \
                __m512i raw = join256(w0 + g * 128 + 32 * v, w1 + g * 128 + 32 * v);                         \
                __m512i wl = _mm512_and_si512(raw, lo4);                                                     \
                __m512i wh = _mm512_and_si512(_mm512_srli_epi16(raw, 4), lo4);                               \
                for (int r = 0; r < R; r++) {                                                                \
                    const int8_t *a = xq + (long)(m0 + r) * K + g * QK;                                      \
                    __m512i s_ = v ? sums[r] : _mm512_setzero_si512();                                       \
                    s_ = _mm512_dpbusd_epi32(s_, wl, bcast4_512(a + 4 * v));                                 \
                    sums[r] = _mm512_dpbusd_epi32(s_, wh, bcast4_512(a + 16 + 4 * v));                       \
                }                                                                                            \
            }                                                                                                \
            __m512 dw = join_halves(s0 + g * 16, s1 + g * 16), mw = join_halves(s0 + g * 16 + 8, s1 + g * 16 + 8); \
            for (int r = 0; r < R; r++) {                                                                    \
                long m = m0 + r;                                                                             \
                __m512 isum = _mm512_cvtepi32_ps(sums[r]);                                                   \
                __m512 dd = _mm512_mul_ps(dw, _mm512_set1_ps(xd[m * G + g]));                                \
                acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(dd, isum));                                     \
                acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(mw, _mm512_set1_ps(xs[m * G + g])));            \
            }                                                                                                \
        }                                                                                                    \
        for (int r = 0; r < R; r++) store_outputs16(y + (long)(m0 + r) * ldy + 8 * o, acc[r], N - 8 * o);  \
    }
/* Q8_0: AVX-512 has no vpsignb; |w| is vpabsb and sign(a, w) negates a where w < 0 (a mask from w's sign
 * bits, shared by the rows). Where w = 0, |w| = 0 makes the product 0 as vpsignb's zero does. */
#define DEFINE_Q8_TILE_ZMM(R)                                                                                \
    VNNI512 NOINLINE void q8_tile_zmm_##R(const int8_t *xq, const float *xd, int K, const int8_t *wq,        \
                                          const uint16_t *wd, int o, int m0, int N, float *y, long ldy) {   \
        const int G = K / QK;                                                                                \
        const int8_t *w0 = wq + (long)o * G * 256, *w1 = w0 + (long)G * 256;                                 \
        const uint16_t *s0 = wd + (long)o * G * 8, *s1 = s0 + (long)G * 8;                                   \
        const __m512i zero = _mm512_setzero_si512();                                                         \
        __m512 acc[R];                                                                                       \
        __m512i s32[R];                                                                                      \
        for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();                                            \
        for (int g = 0; g < G; g++) {                                                                        \
            prefetch_pair((const char *)w0, (long)G * 256, (long)g * 256, 4, (const char *)s0, (long)G * 16, \
                          (long)g * 16);                                                                     \
            for (int r = 0; r < R; r++) s32[r] = zero;                                                       \
            for (int c = 0; c < 8; c++) {                                                                    \
                __m512i w = join256(w0 + g * 256 + 32 * c, w1 + g * 256 + 32 * c);                           \
                __m512i aw = _mm512_abs_epi8(w);                                                             \
                __mmask64 neg = _mm512_movepi8_mask(w);                                                      \
                for (int r = 0; r < R; r++) {                                                                \
                    __m512i a = bcast4_512(xq + (long)(m0 + r) * K + g * QK + 4 * c);                        \
                    s32[r] = _mm512_dpbusd_epi32(s32[r], aw, _mm512_mask_sub_epi8(a, neg, zero, a));         \
                }                                                                                            \
            }                                                                                                \
            __m512 dw = _mm512_cvtph_ps(_mm256_inserti128_si256(                                             \
                _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(s0 + g * 8))),                      \
                _mm_loadu_si128((const __m128i *)(s1 + g * 8)), 1));                                         \
            for (int r = 0; r < R; r++) {                                                                    \
                __m512 dd = _mm512_mul_ps(dw, _mm512_set1_ps(xd[(long)(m0 + r) * G + g]));                   \
                acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(dd, _mm512_cvtepi32_ps(s32[r])));               \
            }                                                                                                \
        }                                                                                                    \
        for (int r = 0; r < R; r++) store_outputs16(y + (long)(m0 + r) * ldy + 8 * o, acc[r], N - 8 * o);  \
    }

DEFINE_Q4_TILE_ZMM(8)
DEFINE_Q4_TILE_ZMM(7)
DEFINE_Q4_TILE_ZMM(6)
DEFINE_Q4_TILE_ZMM(5)
DEFINE_Q4_TILE_ZMM(4)
DEFINE_Q4_TILE_ZMM(2)
DEFINE_Q4_TILE_ZMM(1)
DEFINE_Q8_TILE_ZMM(8)
DEFINE_Q8_TILE_ZMM(7)
DEFINE_Q8_TILE_ZMM(6)
DEFINE_Q8_TILE_ZMM(5)
DEFINE_Q8_TILE_ZMM(4)
DEFINE_Q8_TILE_ZMM(2)
DEFINE_Q8_TILE_ZMM(1)

/* Output groups [o0, o1) of all M rows, rows in tiles of 4, then 3 left in one tile, or tiles of 2, 1 (e.g. 7 =
 * 4 + 3): `tile` names a family of tiles (tile_4, tile_3, tile_2, tile_1), called with the arguments that follow.
 * (3 rows in one tile: 10% less time than 2 + 1 in AVX2, 18-21% in 256-bit VNNI; SmolLM2's linears on an AMX Xeon
 * at those levels, 61st session.) */
#define ROW_TILES(tile, ...)                                                                                 \
    for (int o = o0; o < o1; o++) {                                                                          \
        int m0 = 0;                                                                                          \
        for (; m0 + 4 <= M; m0 += 4) tile##_4(__VA_ARGS__);                                                  \
        if (M - m0 == 3) tile##_3(__VA_ARGS__);                                                               \
        else {                                                                                               \
            if (m0 + 2 <= M) { tile##_2(__VA_ARGS__); m0 += 2; }                                             \
            if (m0 < M) tile##_1(__VA_ARGS__);                                                               \
        }                                                                                                    \
    }
AVX2 static void gemm_q4_1_avx2(GEMM_Q4_ARGS) { ROW_TILES(q4_tile, xq, xd, xs, K, wq, wdm, o, m0, N, y, ldy) }
AVX2 static void gemm_q8_0_avx2(GEMM_Q8_ARGS) { ROW_TILES(q8_tile, xq, xd, K, wq, wd, o, m0, N, y, ldy) }
VNNI static void gemm_q4_1_vnni(GEMM_Q4_ARGS) { ROW_TILES(q4_tile_vnni, xq, xd, xs, K, wq, wdm, o, m0, N, y, ldy) }
VNNI static void gemm_q8_0_vnni(GEMM_Q8_ARGS) { ROW_TILES(q8_tile_vnni, xq, xd, K, wq, wd, o, m0, N, y, ldy) }
/* a pair of groups (a full work item) as one 512-bit tile, rows in tiles of 8, then the 5-7 left in one tile, or
 * tiles of 4, 2, 1 (32 zmm registers: 8 rows' sums and accumulators fit; 8 rows cost 10% less than two tiles of 4,
 * 16 rows 12%; 5, 6 and 7 rows in one tile 13-25% less than 4 + 1, 4 + 2 and 4 + 2 + 1, SmolLM2's linears on an
 * AMX Xeon, 61st session); an odd last group takes the 256-bit VNNI tile */
#define ROW_TILES_ZMM(tile, ...)                                                                             \
    for (int o = o0; o + 1 < o1; o += 2) {                                                                   \
        int m0 = 0;                                                                                          \
        for (; m0 + 8 <= M; m0 += 8) tile##_8(__VA_ARGS__);                                                  \
        if (M - m0 == 7) tile##_7(__VA_ARGS__);                                                               \
        else if (M - m0 == 6) tile##_6(__VA_ARGS__);                                                          \
        else if (M - m0 == 5) tile##_5(__VA_ARGS__);                                                          \
        else {                                                                                               \
            if (m0 + 4 <= M) { tile##_4(__VA_ARGS__); m0 += 4; }                                             \
            if (m0 + 2 <= M) { tile##_2(__VA_ARGS__); m0 += 2; }                                             \
            if (m0 < M) tile##_1(__VA_ARGS__);                                                               \
        }                                                                                                    \
    }
VNNI512 static void gemm_q4_1_zmm(GEMM_Q4_ARGS) {
    ROW_TILES_ZMM(q4_tile_zmm, xq, xd, xs, K, wq, wdm, o, m0, N, y, ldy)
    if ((o1 - o0) & 1) gemm_q4_1_vnni(xq, xd, xs, M, K, wq, wdm, o1 - 1, o1, N, y, ldy);
}
VNNI512 static void gemm_q8_0_zmm(GEMM_Q8_ARGS) {
    ROW_TILES_ZMM(q8_tile_zmm, xq, xd, K, wq, wd, o, m0, N, y, ldy)
    if ((o1 - o0) & 1) gemm_q8_0_vnni(xq, xd, M, K, wq, wd, o1 - 1, o1, N, y, ldy);
}

AVX2 static inline __m256 exp_avx2(__m256 x) {
    /* exactly exp_scalar's operation sequence, 8 lanes at a time */
    __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(EXP_LO), _CMP_GE_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(EXP_LO)); /* keeps the lanes that will be zeroed harmless */
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r);
    p = _mm256_add_ps(p, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), keep);
}

/* 8 consecutive cache values from element i, as fp32 (kv_at's rule) */
AVX2 static inline __m256 kv8(const void *p, long i, int kv16) {
    if (kv16 == KV_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i))), 16));
    return kv16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)))
                : _mm256_loadu_ps((const float *)p + i);
}

/* exp of the visible scores in place (scores[0..n), max mx) and 1 / their sum, attention_row_scalar's lanes[s & 7]
 * order: vector i holds s = 8i..8i+7 */
AVX2 static float softmax_visible_avx2(float *scores, int n, float mx) {
    __m256 lanes = _mm256_setzero_ps(), vmx = _mm256_set1_ps(mx);
    int s = 0;
    for (; s + 8 <= n; s += 8) {
        __m256 p = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(scores + s), vmx));
        _mm256_storeu_ps(scores + s, p);
        lanes = _mm256_add_ps(lanes, p);
    }
    float ln[8];
    _mm256_storeu_ps(ln, lanes);
    for (; s < n; s++) {
        float p = exp_scalar(scores[s] - mx);
        scores[s] = p;
        ln[s & 7] = ln[s & 7] + p;
    }
    return 1.0f / hsum8_scalar(ln);
}

/* Attention of R query heads (R = 1..4) that share one KV head, over the same keys and mask (GQA): each head's
 * arithmetic is attention_row_scalar's, operation for operation (fused multiply-adds in the same order, the
 * same sums), so the bits do not depend on R; what R changes is that each 8-column chunk of a key or a value
 * is loaded (and widened from fp16) once for the R heads. Independent chains hide the FMA latency (4 cycles at
 * 2 a cycle: 8 chains keep the units busy): KB keys at a time in the dot products (R x KB accumulators), and C
 * 8-column chunks at a time of each head's output (R x C accumulators); both fit the 16 ymm registers. */
#define DEFINE_ATTENTION_HEADS(R, KB, C)                                                                     \
    AVX2 static void attention_heads##R##_avx2(const float *const *q, const void *k, const void *v, long sk, \
                                               const float *mask, int S, int D, float scale,                \
                                               float *const *scores, int *keys, float *const *out, int kv16) { \
        float mx[R];                                                                                         \
        for (int r = 0; r < R; r++) mx[r] = -INFINITY;                                                       \
        int hidden = 0, s = 0;                                                                               \
        for (; s + KB <= S; s += KB) {                                                                       \
            int all = mask != 0; /* KB invisible keys: no dots (a continuous batch's rows read up to the */  \
            for (int i = 0; i < KB && all; i++) all = mask[s + i] == -INFINITY; /* longest row's length) */ \
            if (all) {                                                                                       \
                for (int r = 0; r < R; r++)                                                                  \
                    for (int i = 0; i < KB; i++) scores[r][s + i] = -INFINITY;                               \
                hidden += KB;                                                                                \
                continue;                                                                                    \
            }                                                                                                \
            __m256 acc[R][KB];                                                                               \
            for (int r = 0; r < R; r++)                                                                      \
                for (int i = 0; i < KB; i++) acc[r][i] = _mm256_setzero_ps();                                \
            for (int j = 0; j < D; j += 8)                                                                   \
                for (int i = 0; i < KB; i++) {                                                               \
                    __m256 x = kv8(k, (s + i) * sk + j, kv16);                                               \
                    for (int r = 0; r < R; r++) acc[r][i] = _mm256_fmadd_ps(_mm256_loadu_ps(q[r] + j), x, acc[r][i]); \
                }                                                                                            \
            for (int i = 0; i < KB; i++) {                                                                   \
                int hid = mask && mask[s + i] == -INFINITY; /* invisible: its dot is discarded */            \
                hidden += hid;                                                                               \
                for (int r = 0; r < R; r++) {                                                                \
                    float sc = -INFINITY;                                                                    \
                    if (!hid) {                                                                              \
                        sc = hsum8_avx2(acc[r][i]) * scale;                                                  \
                        if (mask) sc = sc + mask[s + i];                                                     \
                    }                                                                                        \
                    scores[r][s + i] = sc;                                                                   \
                    mx[r] = sc > mx[r] ? sc : mx[r];                                                         \
                }                                                                                            \
            }                                                                                                \
        }                                                                                                    \
        for (; s < S; s++) {                                                                                 \
            if (mask && mask[s] == -INFINITY) {                                                              \
                for (int r = 0; r < R; r++) scores[r][s] = -INFINITY;                                        \
                hidden++;                                                                                    \
                continue;                                                                                    \
            }                                                                                                \
            __m256 acc[R];                                                                                   \
            for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();                                        \
            for (int j = 0; j < D; j += 8) {                                                                 \
                __m256 x = kv8(k, s * sk + j, kv16);                                                         \
                for (int r = 0; r < R; r++) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q[r] + j), x, acc[r]); \
            }                                                                                                \
            for (int r = 0; r < R; r++) {                                                                    \
                float sc = hsum8_avx2(acc[r]) * scale;                                                       \
                if (mask) sc = sc + mask[s];                                                                 \
                scores[r][s] = sc;                                                                           \
                mx[r] = sc > mx[r] ? sc : mx[r];                                                             \
            }                                                                                                \
        }                                                                                                    \
        int *slot = 0, n = S;                                                                                \
        float inv[R];                                                                                        \
        for (int r = 0; r < R; r++) { /* the same visible keys for every head: the same compaction */       \
            n = visible_keys(scores[r], S, mask, hidden, keys, &slot);                                       \
            inv[r] = softmax_visible_avx2(scores[r], n, mx[r]);                                              \
        }                                                                                                    \
        int j = 0;                                                                                           \
        for (; j + 8 * C <= D; j += 8 * C) { /* out[j] accumulates over the visible keys in order */        \
            __m256 o[R][C];                                                                                  \
            for (int r = 0; r < R; r++)                                                                      \
                for (int c = 0; c < C; c++) o[r][c] = _mm256_setzero_ps();                                   \
            for (int t = 0; t < n; t++) {                                                                    \
                long vv = (slot ? slot[t] : t) * sk + j;                                                     \
                __m256 vp[R];                                                                                \
                int some_zero = 0;                                                                           \
                for (int r = 0; r < R; r++) {                                                                \
                    some_zero |= scores[r][t] == 0.0f;                                                       \
                    vp[r] = _mm256_set1_ps(scores[r][t]);                                                    \
                }                                                                                            \
                if (!some_zero) {                                                                            \
                    for (int c = 0; c < C; c++) {                                                            \
                        __m256 x = kv8(v, vv + 8 * c, kv16);                                                 \
                        for (int r = 0; r < R; r++) o[r][c] = _mm256_fmadd_ps(vp[r], x, o[r][c]);            \
                    }                                                                                        \
                } else { /* a key whose weight underflowed to 0 in some head adds exactly nothing there */   \
                    for (int c = 0; c < C; c++) {                                                            \
                        __m256 x = kv8(v, vv + 8 * c, kv16);                                                 \
                        for (int r = 0; r < R; r++)                                                          \
                            if (scores[r][t] != 0.0f) o[r][c] = _mm256_fmadd_ps(vp[r], x, o[r][c]);          \
                    }                                                                                        \
                }                                                                                            \
            }                                                                                                \
            for (int r = 0; r < R; r++) {                                                                    \
                __m256 vi = _mm256_set1_ps(inv[r]);                                                          \
                for (int c = 0; c < C; c++) _mm256_storeu_ps(out[r] + j + 8 * c, _mm256_mul_ps(o[r][c], vi)); \
            }                                                                                                \
        }                                                                                                    \
        for (; j < D; j += 8) {                                                                              \
            __m256 o[R];                                                                                     \
            for (int r = 0; r < R; r++) o[r] = _mm256_setzero_ps();                                          \
            for (int t = 0; t < n; t++) {                                                                    \
                __m256 x = kv8(v, (slot ? slot[t] : t) * sk + j, kv16);                                      \
                for (int r = 0; r < R; r++) {                                                                \
                    float p = scores[r][t];                                                                  \
                    if (p == 0.0f) continue;                                                                 \
                    o[r] = _mm256_fmadd_ps(_mm256_set1_ps(p), x, o[r]);                                      \
                }                                                                                            \
            }                                                                                                \
            for (int r = 0; r < R; r++) _mm256_storeu_ps(out[r] + j, _mm256_mul_ps(o[r], _mm256_set1_ps(inv[r]))); \
        }                                                                                                    \
    }

DEFINE_ATTENTION_HEADS(1, 8, 8)
DEFINE_ATTENTION_HEADS(2, 4, 4)
DEFINE_ATTENTION_HEADS(3, 4, 4)
DEFINE_ATTENTION_HEADS(4, 2, 2)

#endif /* QK_X86 */

/* ======================================================================================= dispatch */
/* The instruction set the kernels use: 0 portable scalar, 1 AVX2 (+FMA, F16C), 2 AVX2 with the AVX512-VNNI
 * GEMM tiles, 3 those tiles on 512-bit registers (AVX512-BW too). Every level gives the same bits; the best
 * one the CPU has is the default. */
static int simd_level = -1;

static int detect_simd(void) {
#if !QK_X86
    return 0;
#else
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))) return 0;
    if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl"))
        return __builtin_cpu_supports("avx512bw") ? 3 : 2;
    return 1;
#endif
}

int qk_simd_level(void) {
    if (simd_level < 0) simd_level = detect_simd();
    return simd_level;
}

int qk_has_avx2(void) { return qk_simd_level() >= 1; }

/* Use at most `level` (tests: every level must agree); a level the CPU lacks falls back to the best it has;
 * -1 restores detection. */
void qk_set_simd(int level) {
    int best = detect_simd();
    simd_level = level < 0 || level > best ? best : level;
}

void qk_set_avx2(int on) { qk_set_simd(on ? -1 : 0); }

void qk_quantize_q8(const float *x, long ldx, int M, int K, int8_t *q, float *d, float *s) {
#if QK_X86
    if (qk_has_avx2()) { quantize_q8_avx2(x, ldx, M, K, q, d, s); return; }
#endif
    quantize_q8_scalar(x, ldx, M, K, q, d, s);
}

/* The GEMM tiles of each SIMD level, in one table: the dispatch and `qk_gemm_tiles` read the same entry
 * (q4_gemm, q8_gemm). Every level gives the same bits, so a level sent to another level's tiles would pass
 * the tests that compare the levels' bits while testing nothing; `qk_gemm_tiles` names the tiles a level
 * runs, for the tests. */
typedef void (*gemm_q4_fn)(GEMM_Q4_ARGS);
typedef void (*gemm_q8_fn)(GEMM_Q8_ARGS);
#if QK_X86
static const gemm_q4_fn GEMM_Q4[4] = {gemm_q4_1_scalar, gemm_q4_1_avx2, gemm_q4_1_vnni, gemm_q4_1_zmm};
static const gemm_q8_fn GEMM_Q8[4] = {gemm_q8_0_scalar, gemm_q8_0_avx2, gemm_q8_0_vnni, gemm_q8_0_zmm};
#else /* (level 0 only: detect_simd) */
static const gemm_q4_fn GEMM_Q4[1] = {gemm_q4_1_scalar};
static const gemm_q8_fn GEMM_Q8[1] = {gemm_q8_0_scalar};
#endif
static gemm_q4_fn q4_gemm(void) { return GEMM_Q4[qk_simd_level()]; }
static gemm_q8_fn q8_gemm(void) { return GEMM_Q8[qk_simd_level()]; }

/* The tiles the GEMMs run at the SIMD level in use, named by function (not by place in the tables): 0 scalar,
 * 1 AVX2, 2 VNNI on 256-bit registers, 3 on 512-bit ones; q4 in the low byte, q8 in the next. */
int qk_gemm_tiles(void) {
#if QK_X86
    gemm_q4_fn f4 = q4_gemm();
    gemm_q8_fn f8 = q8_gemm();
    int q4 = f4 == gemm_q4_1_zmm ? 3 : f4 == gemm_q4_1_vnni ? 2 : f4 == gemm_q4_1_avx2 ? 1 : 0;
    int q8 = f8 == gemm_q8_0_zmm ? 3 : f8 == gemm_q8_0_vnni ? 2 : f8 == gemm_q8_0_avx2 ? 1 : 0;
    return q4 | (q8 << 8);
#else
    return 0;
#endif
}

/* Output groups are split between threads, two groups (16 outputs) per work item; each output's arithmetic
 * is the same whoever computes it. N = the real number of outputs (the layout holds ceil(N / 8) groups). */
void qk_gemm_q4_1(const int8_t *xq, const float *xd, const float *xs, int M, int K, const uint8_t *wq,
                  const uint16_t *wdm, int N, float *y, long ldy) {
    int groups = (N + 7) / 8, items = (groups + 1) / 2;
    gemm_q4_fn gemm = q4_gemm();
#pragma omp parallel for schedule(static)
    for (int c = 0; c < items; c++) {
        int o0 = 2 * c, o1 = o0 + 2 < groups ? o0 + 2 : groups;
        gemm(xq, xd, xs, M, K, wq, wdm, o0, o1, N, y, ldy);
    }
}

void qk_gemm_q8_0(const int8_t *xq, const float *xd, int M, int K, const int8_t *wq, const uint16_t *wd, int N,
                  float *y, long ldy) {
    int groups = (N + 7) / 8, items = (groups + 1) / 2;
    gemm_q8_fn gemm = q8_gemm();
#pragma omp parallel for schedule(static)
    for (int c = 0; c < items; c++) {
        int o0 = 2 * c, o1 = o0 + 2 < groups ? o0 + 2 : groups;
        gemm(xq, xd, M, K, wq, wd, o0, o1, N, y, ldy);
    }
}

/* ===================================================================== fp32 and bf16 linears, row-invariant
 * y[m, n] = sum_k x[m, k] w[n, k] for fp32 x [M, K] and W [N, K], or bf16 ones widened to fp32 (qk_linear_bf16;
 * y is fp32 either way, the caller rounds it) (the static decode step's linears in fp32 or bf16 on
 * a CPU whose BLAS rounds a row by M: an AVX-512 Xeon's MKL gave a row other bits at M = 1, 2..8 and 16+, and
 * the step's probe then passed only one bucket of 256 rows; docs/results/static-step.md). The order of the sum
 * depends on K alone ("lane order"):
 *   L_j = sum over i = 0, 1, ... of x[m, 16 i + j] * w[n, 16 i + j], j = 0..15, in increasing i, x and w taken
 *         as +0 past K; each step a fused multiply-add, L_j <- fma(x, w, L_j), rounded once (fmaf, vfmadd: one
 *         IEEE operation; the PyTorch reference, kernels.linear_rows_reference, emulates it exactly in fp64,
 *         kernels.fma_reference; with the K loop's whole chunks apart from its tail, 1.3-1.6x faster from 8
 *         rows than a product then a sum, docs/results/static-step.md);
 *   s_j = L_j + L_{j+8} (j < 8);  y = hsum8(s), hsum8_scalar's tree.
 * A row's result then depends on its own x and W: not on M, the row's place in the call or the thread that
 * computes it. Nor on the SIMD level: the 16 lanes are independent, so 16 scalar lanes, two 8-lane registers
 * (AVX2) and one 16-lane register (AVX-512F) compute the same sums. A tile is R rows x C outputs (each loaded
 * once for the tile): the tiles differ by level in size, not in arithmetic. */
typedef struct { float v[16]; } f32x16_scalar;
INLINE f32x16_scalar f32_zero_scalar(void) { f32x16_scalar r; for (int j = 0; j < 16; j++) r.v[j] = 0.0f; return r; }
INLINE f32x16_scalar f32_load_scalar(const float *p, int n) { /* n < 16: the lanes past n are +0 */
    f32x16_scalar r;
    for (int j = 0; j < 16; j++) r.v[j] = j < n ? p[j] : 0.0f;
    return r;
}
/* 16 bf16 from p, or where n < 16 its n copied into `tail` (zeroed by the caller) and the rest +0: a K tail
 * reads nothing past the row. The SIMD loads read 16 from what this returns. */
INLINE const uint16_t *bf16_padded(const uint16_t *p, int n, uint16_t *tail) {
    if (n >= 16) return p;
    memcpy(tail, p, 2 * (size_t)n);
    return tail;
}
INLINE f32x16_scalar bf16_load_scalar(const uint16_t *p, int n) {
    f32x16_scalar r;
    for (int j = 0; j < 16; j++) r.v[j] = j < n ? bf16_to_f32(p[j]) : 0.0f;
    return r;
}
INLINE f32x16_scalar f32_muladd_scalar(f32x16_scalar a, f32x16_scalar x, f32x16_scalar w) {
    for (int j = 0; j < 16; j++) a.v[j] = fmaf(x.v[j], w.v[j], a.v[j]);
    return a;
}
INLINE float f32_tree_scalar(f32x16_scalar a) {
    float s[8];
    for (int j = 0; j < 8; j++) s[j] = a.v[j] + a.v[j + 8];
    return hsum8_scalar(s);
}

#if QK_X86
typedef struct { __m256 lo, hi; } f32x16_avx2; /* lanes 0-7, 8-15 */
AVX2 INLINE f32x16_avx2 f32_zero_avx2(void) { f32x16_avx2 r = {_mm256_setzero_ps(), _mm256_setzero_ps()}; return r; }
AVX2 INLINE f32x16_avx2 f32_load_avx2(const float *p, int n) {
    f32x16_avx2 r;
    if (n >= 16) {
        r.lo = _mm256_loadu_ps(p);
        r.hi = _mm256_loadu_ps(p + 8);
        return r;
    }
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    r.lo = _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane));
    r.hi = _mm256_maskload_ps(p + 8, _mm256_cmpgt_epi32(_mm256_set1_epi32(n - 8), lane));
    return r;
}
AVX2 INLINE __m256 bf16x8_avx2(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
AVX2 INLINE f32x16_avx2 bf16_load_avx2(const uint16_t *p, int n) {
    uint16_t tail[16] = {0};
    p = bf16_padded(p, n, tail);
    f32x16_avx2 r = {bf16x8_avx2(p), bf16x8_avx2(p + 8)};
    return r;
}
AVX2 INLINE f32x16_avx2 f32_muladd_avx2(f32x16_avx2 a, f32x16_avx2 x, f32x16_avx2 w) {
    a.lo = _mm256_fmadd_ps(x.lo, w.lo, a.lo);
    a.hi = _mm256_fmadd_ps(x.hi, w.hi, a.hi);
    return a;
}
AVX2 INLINE float f32_tree_avx2(f32x16_avx2 a) { return hsum8_avx2(_mm256_add_ps(a.lo, a.hi)); }

#define AVX512F_ __attribute__((target("avx2,fma,f16c,avx512f")))
typedef __m512 f32x16_zmm;
AVX512F_ INLINE f32x16_zmm f32_zero_zmm(void) { return _mm512_setzero_ps(); }
AVX512F_ INLINE f32x16_zmm f32_load_zmm(const float *p, int n) {
    return n >= 16 ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1u), p);
}
AVX512F_ INLINE f32x16_zmm bf16_load_zmm(const uint16_t *p, int n) {
    uint16_t tail[16] = {0};
    p = bf16_padded(p, n, tail);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
AVX512F_ INLINE f32x16_zmm f32_muladd_zmm(f32x16_zmm a, f32x16_zmm x, f32x16_zmm w) {
    return _mm512_fmadd_ps(x, w, a);
}
AVX512F_ INLINE float f32_tree_zmm(f32x16_zmm a) {
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
    return hsum8_avx2(_mm256_add_ps(_mm512_castps512_ps256(a), hi));
}
#endif /* QK_X86 */

/* One tile, R rows (stride ldx) x C outputs (weight rows, stride ldw), into y (row stride ldy), of operands of
 * type T: f32, or bf16 (widened to fp32 as they are loaded: exact; the products of two bf16 are exact in fp32,
 * so the bf16 linear is the f32 formula of the widened operands). */
typedef float f32_elem;
typedef uint16_t bf16_elem;
#define LIN_TILE_ARGS(T) const T##_elem *x, long ldx, const T##_elem *w, long ldw, int K, float *y, long ldy
#define DEFINE_LIN_TILE(ATTR, T, ISA, R, C)                                                                  \
    ATTR NOINLINE void T##_tile_##ISA##_##R##_##C(LIN_TILE_ARGS(T)) {                                        \
        f32x16_##ISA acc[R][C], wv[C];                                                                       \
        for (int r = 0; r < R; r++)                                                                          \
            for (int c = 0; c < C; c++) acc[r][c] = f32_zero_##ISA();                                        \
        int k = 0;                                                                                           \
        for (; k + 16 <= K; k += 16) { /* whole chunks: unmasked loads */                                    \
            for (int c = 0; c < C; c++) wv[c] = T##_load_##ISA(w + c * ldw + k, 16);                         \
            for (int r = 0; r < R; r++) {                                                                    \
                f32x16_##ISA xv = T##_load_##ISA(x + r * ldx + k, 16);                                       \
                for (int c = 0; c < C; c++) acc[r][c] = f32_muladd_##ISA(acc[r][c], xv, wv[c]);              \
            }                                                                                                \
        }                                                                                                    \
        if (k < K) { /* the K tail, its lanes past K +0 */                                                   \
            for (int c = 0; c < C; c++) wv[c] = T##_load_##ISA(w + c * ldw + k, K - k);                      \
            for (int r = 0; r < R; r++) {                                                                    \
                f32x16_##ISA xv = T##_load_##ISA(x + r * ldx + k, K - k);                                    \
                for (int c = 0; c < C; c++) acc[r][c] = f32_muladd_##ISA(acc[r][c], xv, wv[c]);              \
            }                                                                                                \
        }                                                                                                    \
        for (int r = 0; r < R; r++)                                                                          \
            for (int c = 0; c < C; c++) y[r * ldy + c] = f32_tree_##ISA(acc[r][c]);                          \
    }
#define DEFINE_LIN_TILE_ROW(ATTR, T, ISA, R)                                                                 \
    DEFINE_LIN_TILE(ATTR, T, ISA, R, 1) DEFINE_LIN_TILE(ATTR, T, ISA, R, 2) DEFINE_LIN_TILE(ATTR, T, ISA, R, 3) \
    DEFINE_LIN_TILE(ATTR, T, ISA, R, 4)
#define DEFINE_LIN_TILES(ATTR, T, ISA)                                                                       \
    DEFINE_LIN_TILE_ROW(ATTR, T, ISA, 1) DEFINE_LIN_TILE_ROW(ATTR, T, ISA, 2)                                \
    DEFINE_LIN_TILE_ROW(ATTR, T, ISA, 3) DEFINE_LIN_TILE_ROW(ATTR, T, ISA, 4)
#define LIN_TILE_ROW(T, ISA, R) {T##_tile_##ISA##_##R##_1, T##_tile_##ISA##_##R##_2, T##_tile_##ISA##_##R##_3,  \
                                 T##_tile_##ISA##_##R##_4}
#define LIN_TILE_TABLE(T, ISA) {LIN_TILE_ROW(T, ISA, 1), LIN_TILE_ROW(T, ISA, 2), LIN_TILE_ROW(T, ISA, 3),      \
                                LIN_TILE_ROW(T, ISA, 4)}
DEFINE_LIN_TILES(, f32, scalar)
DEFINE_LIN_TILES(, bf16, scalar)
#if QK_X86
DEFINE_LIN_TILES(AVX2, f32, avx2)
DEFINE_LIN_TILES(AVX512F_, f32, zmm)
DEFINE_LIN_TILES(AVX2, bf16, avx2)
DEFINE_LIN_TILES(AVX512F_, bf16, zmm)
#endif

typedef void (*f32_tile_fn)(LIN_TILE_ARGS(f32));
typedef void (*bf16_tile_fn)(LIN_TILE_ARGS(bf16));
/* the largest tile (rows, outputs), then the tiles [R - 1][C - 1] */
typedef struct { int rows, cols; f32_tile_fn tile[4][4]; } f32_tiles;
typedef struct { int rows, cols; bf16_tile_fn tile[4][4]; } bf16_tiles;
/* Per SIMD level (levels 2 and 3 have AVX-512F): AVX2 has 16 ymm registers, so 2 x 2 tiles (8 pairs of
 * accumulators); AVX-512 32 zmm, so 4 x 4 (16 accumulators, 4 weight vectors, a row's x). */
#if QK_X86
static const f32_tiles F32_LINEAR[4] = {{4, 4, LIN_TILE_TABLE(f32, scalar)}, {2, 2, LIN_TILE_TABLE(f32, avx2)},
                                        {4, 4, LIN_TILE_TABLE(f32, zmm)}, {4, 4, LIN_TILE_TABLE(f32, zmm)}};
static const bf16_tiles BF16_LINEAR[4] = {{4, 4, LIN_TILE_TABLE(bf16, scalar)}, {2, 2, LIN_TILE_TABLE(bf16, avx2)},
                                          {4, 4, LIN_TILE_TABLE(bf16, zmm)}, {4, 4, LIN_TILE_TABLE(bf16, zmm)}};
#else
static const f32_tiles F32_LINEAR[1] = {{4, 4, LIN_TILE_TABLE(f32, scalar)}};
static const bf16_tiles BF16_LINEAR[1] = {{4, 4, LIN_TILE_TABLE(bf16, scalar)}};
#endif

/* The tiles the SIMD level in use runs, named by their tables' first tile: 0 scalar, 1 AVX2, 2 AVX-512F; f32 in
 * the low byte, bf16 in the next. */
int qk_linear_tiles(void) {
#if QK_X86
    f32_tile_fn f = F32_LINEAR[qk_simd_level()].tile[0][0];
    bf16_tile_fn b = BF16_LINEAR[qk_simd_level()].tile[0][0];
    int f32 = f == f32_tile_zmm_1_1 ? 2 : f == f32_tile_avx2_1_1 ? 1 : 0;
    int bf16 = b == bf16_tile_zmm_1_1 ? 2 : b == bf16_tile_avx2_1_1 ? 1 : 0;
    return f32 | bf16 << 8;
#else
    return 0;
#endif
}

/* Work items of 16 outputs split between threads; in an item, outputs in tiles of t->cols, rows in tiles of
 * t->rows (the last of each as many as are left). y is fp32 for either operand type. */
#define LINEAR_ROWS(t)                                                                                       \
    int items = (N + 15) / 16;                                                                               \
    _Pragma("omp parallel for schedule(static)")                                                             \
    for (int it = 0; it < items; it++) {                                                                     \
        int n1 = 16 * it + 16 < N ? 16 * it + 16 : N;                                                        \
        for (int n = 16 * it; n < n1; n += t->cols) {                                                        \
            int C = n1 - n < t->cols ? n1 - n : t->cols;                                                     \
            for (int m = 0; m < M; m += t->rows) {                                                           \
                int R = M - m < t->rows ? M - m : t->rows;                                                   \
                t->tile[R - 1][C - 1](x + (long)m * ldx, ldx, w + (long)n * ldw, ldw, K, y + (long)m * ldy + n, \
                                      ldy);                                                                  \
            }                                                                                                \
        }                                                                                                    \
    }
void qk_linear_f32(const float *x, long ldx, int M, int K, const float *w, long ldw, int N, float *y, long ldy) {
    const f32_tiles *t = &F32_LINEAR[qk_simd_level()];
    LINEAR_ROWS(t)
}
void qk_linear_bf16(const uint16_t *x, long ldx, int M, int K, const uint16_t *w, long ldw, int N, float *y,
                    long ldy) {
    const bf16_tiles *t = &BF16_LINEAR[qk_simd_level()];
    LINEAR_ROWS(t)
}

/* Attention of T query rows over S keys, batch B, H query heads sharing Hk key/value heads (GQA).
 * q: row (b, t) head h at q + b*qb + t*qt + h*D.  k, v: (b, hk, s) at k + b*kb + hk*kh + s*ks.
 * mask: additive [B, T, S] fp32 (row stride S, batch stride T*S), or NULL (every key visible).
 * out: (b, t, h) at out + (b*T + t)*H*D + h*D.  scratch: 2*B*T*H*S floats. */
/* mask: [B, MH, T, S] additive, MH = 1 (shared by the heads) or H (per-head position biases: ALiBi, T5). */
/* kv16: k and v hold fp16 or bf16 values (else fp32: kv_at); kb, kh, ks count elements either way. */
void qk_attention(const float *q, long qb, long qt, const void *k, const void *v, long kb, long kh, long ks,
                  const float *mask, int B, int T, int H, int Hk, int S, int D, float scale, float *out,
                  float *scratch, int MH, int kv16) {
    int rep = H / Hk;
    int avx2 = qk_has_avx2() && D % 8 == 0;
    /* A work item is G query heads of one KV head (the AVX2 path, where the heads share their mask): G of them
     * read each key and value once. G = 1 where that would leave fewer than 8 items to share between threads
     * (one decode row: H items of one head each, as before). The bits do not depend on G. */
    /* Wide heads (D > 128, Gemma 3's 256) take at most 2 per item: 4 heads' outputs leave room for only 2
     * accumulator columns per pass over the keys (C = 2), and re-broadcasting 4 weights per key and pass cost
     * more than 2 heads with 4 columns (benchmarks/attention_shapes.py: 58 against 81 us, 16 rows of Gemma 3). */
    int G = 1, gmax = D > 128 ? 2 : 4;
    for (int g = rep < gmax ? rep : gmax; avx2 && MH == 1 && g > 1; g--)
        if (rep % g == 0 && (long)B * T * Hk * (rep / g) >= 8) { G = g; break; }
    long items = (long)B * T * H / G;
    int esz = kv16 ? 2 : 4;
#pragma omp parallel for schedule(static)
    for (long it = 0; it < items; it++) {
        int h0 = (int)(it % (H / G)) * G, t = (it / (H / G)) % T, b = it / ((long)(H / G) * T);
        long kv = b * kb + (long)(h0 / rep) * kh; /* element offset of these heads' keys (and values) */
        const void *kk = (const char *)k + kv * esz, *vv = (const char *)v + kv * esz;
        const float *qq[4];
        float *oo[4], *sc[4];
        int *keys = 0;
        for (int r = 0; r < G; r++) {
            int h = h0 + r;
            long row = ((long)b * T + t) * H + h;
            qq[r] = q + b * qb + t * qt + (long)h * D;
            oo[r] = out + row * D;
            sc[r] = scratch + row * 2 * S; /* S scores, then S key slots (int) */
            if (r == 0) keys = (int *)(sc[r] + S);
        }
        const float *mm = mask ? mask + (((long)b * MH + (MH > 1 ? h0 : 0)) * T + t) * S : 0;
#if QK_X86
        if (avx2) {
            if (G == 1) attention_heads1_avx2(qq, kk, vv, ks, mm, S, D, scale, sc, keys, oo, kv16);
            else if (G == 2) attention_heads2_avx2(qq, kk, vv, ks, mm, S, D, scale, sc, keys, oo, kv16);
            else if (G == 3) attention_heads3_avx2(qq, kk, vv, ks, mm, S, D, scale, sc, keys, oo, kv16);
            else attention_heads4_avx2(qq, kk, vv, ks, mm, S, D, scale, sc, keys, oo, kv16);
            continue;
        }
#endif
        attention_row_scalar(qq[0], kk, vv, ks, mm, S, D, scale, sc[0], keys, oo[0], kv16);
    }
}

/* y = x W^T for Q4_1 / Q8_0 weights, one call per linear: x is quantised to Q8 into the caller's workspace
 * -- codes (M*K bytes, padded to 64), then the scales d and sums s (M*K/32 floats each); kernels.py's
 * _q8_bytes gives its size -- and multiplied. */
typedef struct { int8_t *q; float *d, *s; } q8_rows;

static q8_rows quantize_into(const float *x, int M, int K, void *work) {
    q8_rows r;
    r.q = (int8_t *)work;
    r.d = (float *)(r.q + (((long)M * K + 63) & ~63L));
    r.s = r.d + (long)M * (K / QK);
    qk_quantize_q8(x, K, M, K, r.q, r.d, r.s);
    return r;
}

void qk_linear_q4_1(const float *x, int M, int K, const uint8_t *wq, const uint16_t *wdm, int N, float *y,
                    void *work) {
    q8_rows r = quantize_into(x, M, K, work);
    qk_gemm_q4_1(r.q, r.d, r.s, M, K, wq, wdm, N, y, N);
}

void qk_linear_q8_0(const float *x, int M, int K, const int8_t *wq, const uint16_t *wd, int N, float *y,
                    void *work) {
    q8_rows r = quantize_into(x, M, K, work);
    qk_gemm_q8_0(r.q, r.d, M, K, wq, wd, N, y, N);
}

/* RMSNorm of M rows: y = x / sqrt(mean(x^2) + eps) * w, sum of squares in 8 lanes (j & 7) then the fixed
 * hsum8 tree, so every row is computed the same way whatever M is. */
void qk_rmsnorm(const float *x, const float *w, int M, int K, float eps, float *y) {
    for (int m = 0; m < M; m++) {
        const float *xx = x + (long)m * K;
        float acc[8] = {0};
        for (int j = 0; j < K; j++) acc[j & 7] = acc[j & 7] + xx[j] * xx[j];
        float r = 1.0f / sqrtf(hsum8_scalar(acc) / (float)K + eps);
        float *yy = y + (long)m * K;
        for (int j = 0; j < K; j++) yy[j] = (xx[j] * r) * w[j];
    }
}

/* Row n of fp32 values into a KV cache buffer at element i: copied (kv16 = 0), rounded to fp16 (f32_to_f16's
 * rule; F16C's vcvtps2ph where the CPU has it, the same bits) or to bf16 (f32_to_bf16). */
#if QK_X86
AVX2 static void kv_put_f16c(uint16_t *dst, const float *src, int n) {
    int j = 0;
    for (; j + 8 <= n; j += 8)
        _mm_storeu_si128((__m128i *)(dst + j), _mm256_cvtps_ph(_mm256_loadu_ps(src + j), _MM_FROUND_TO_NEAREST_INT));
    for (; j < n; j++) dst[j] = f32_to_f16(src[j]);
}
#endif

static void kv_put(void *base, long i, const float *src, int n, int kv16) {
    if (!kv16) { memcpy((float *)base + i, src, n * sizeof(float)); return; }
    uint16_t *dst = (uint16_t *)base + i;
    if (kv16 == KV_BF16) { for (int j = 0; j < n; j++) dst[j] = f32_to_bf16(src[j]); return; }
#if QK_X86
    if (qk_has_avx2()) { kv_put_f16c(dst, src, n); return; }
#endif
    for (int j = 0; j < n; j++) dst[j] = f32_to_f16(src[j]);
}

/* RoPE on the q and k heads of a fused qkv projection, then k and v stored in the KV cache.
 * qkv: [T, (H + 2 Hk) * D] rows of one sequence (b = 0..B-1 via qkv_b); cos/sin: [B*T, D] per row;
 * rotate-half convention (x1, x2) -> (x1 c - x2 s, x2 c + x1 s) on the two halves of each head.
 * q is rotated in place; k (rotated) and v go to kc/vc at slot slots[b*T + t] (head stride ch, slot
 * stride D, batch stride cb). */
/* kv16: the cache holds fp16 or bf16 (else fp32: kv_at); cb, ch count elements. */
void qk_rope_store(float *qkv, long qkv_b, int B, int T, int H, int Hk, int D, const float *cos,
                   const float *sin, void *kc, void *vc, long cb, long ch, const long *slots, int kv16) {
    int half = D / 2;
    float krow[D]; /* one rotated key head */
    for (int b = 0; b < B; b++) {
        for (int t = 0; t < T; t++) {
            float *row = qkv + b * qkv_b + (long)t * (H + 2 * Hk) * D;
            const float *c = cos + ((long)b * T + t) * D, *s = sin + ((long)b * T + t) * D;
            long slot = slots[(long)b * T + t];
            for (int h = 0; h < H + Hk; h++) {
                float *x = row + (long)h * D;
                float *dst = h < H ? x : krow;
                for (int j = 0; j < half; j++) {
                    float x1 = x[j], x2 = x[j + half];
                    float r1 = x1 * c[j] - x2 * s[j];
                    float r2 = x2 * c[j + half] + x1 * s[j + half];
                    dst[j] = r1;
                    dst[j + half] = r2;
                }
                if (h >= H) kv_put(kc, b * cb + (long)(h - H) * ch + slot * D, krow, D, kv16);
            }
            for (int h = 0; h < Hk; h++)
                kv_put(vc, b * cb + (long)h * ch + slot * D, row + (long)(H + Hk + h) * D, D, kv16);
        }
    }
}

/* ========================================================================================= SwiGLU */
/* y[m, j] = silu(a) * b with a = ab[m, j], b = ab[m, h + j] (the fused w1|w3 projection's two halves):
 * silu(a) = a sigmoid(a), computed from exp of a non-positive argument only (exp_scalar's domain):
 *   a >= 0: a / (1 + exp(-a));   a < 0: (a exp(a)) / (1 + exp(a)).
 * Element-wise, so row-invariant; the AVX2 version does the same single-rounded operations per lane. */
static inline float silu_mul_scalar(float a, float b) {
    float e = exp_scalar(a >= 0.0f ? -a : a);
    float num = a >= 0.0f ? a : a * e;
    return (num / (1.0f + e)) * b;
}

#if QK_X86
AVX2 static void silu_mul_avx2(const float *a, const float *b, int n, float *y) {
    const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    int j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 va = _mm256_loadu_ps(a + j);
        __m256 pos = _mm256_cmp_ps(va, zero, _CMP_GE_OQ);
        __m256 e = exp_avx2(_mm256_blendv_ps(va, _mm256_xor_ps(va, sign), pos)); /* -a where a >= 0 */
        __m256 num = _mm256_blendv_ps(_mm256_mul_ps(va, e), va, pos);
        __m256 s = _mm256_div_ps(num, _mm256_add_ps(one, e));
        _mm256_storeu_ps(y + j, _mm256_mul_ps(s, _mm256_loadu_ps(b + j)));
    }
    for (; j < n; j++) y[j] = silu_mul_scalar(a[j], b[j]);
}
#endif

void qk_silu_mul(const float *ab, int M, int h, float *y) {
    int avx2 = qk_has_avx2();
    (void)avx2; /* (read on x86-64 only) */
    for (int m = 0; m < M; m++) {
        const float *a = ab + (long)m * 2 * h, *b = a + h;
        float *yy = y + (long)m * h;
#if QK_X86
        if (avx2) { silu_mul_avx2(a, b, h, yy); continue; }
#endif
        for (int j = 0; j < h; j++) yy[j] = silu_mul_scalar(a[j], b[j]);
    }
}

/* ================================================================================== top-k of rows
 * The k largest entries of each row of x [M, N] (row stride ld), largest first; equal values keep index
 * order (the first maximum first: torch.argmax's rule; torch.topk leaves the order of ties open). A NaN
 * counts as larger than any number, as in torch, the first NaN first. With lse != NULL also
 * lse[m] = max + log(sum_j exp(x[m, j] - max)), for log-probabilities of the top k (EAGLE-2's scores).
 * Why: torch's argmax over SmolLM2's 49,152 logits took 86 us a row here and its topk over a 16,384-token
 * draft vocabulary 40-78 us, at every decode step and draft level; one pass that skips the 8-value chunks
 * below the current k-th value takes a few us (docs/results/decode-cpu.md, 28th session). k <= 64. */
INLINE int topk_greater(float a, float b) { return a != a ? b == b : (b == b && a > b); }

INLINE void topk_insert(float v, int64_t j, int k, int *n, float *bv, int64_t *bi) {
    int pos = *n < k ? *n : k;
    while (pos > 0 && topk_greater(v, bv[pos - 1])) pos--;
    if (pos >= k) return;
    int last = *n < k ? *n : k - 1;
    for (int t = last; t > pos; t--) { bv[t] = bv[t - 1]; bi[t] = bi[t - 1]; }
    bv[pos] = v;
    bi[pos] = j;
    if (*n < k) (*n)++;
}

#if QK_X86
AVX2 static void topk_row_avx2(const float *x, int N, int k, float *bv, int64_t *bi) {
    int n = 0, j = 0;
    for (; j < N && n < k; j++) topk_insert(x[j], j, k, &n, bv, bi);
    for (; j + 8 <= N; j += 8) { /* a chunk is looked at only if one of its values beats the k-th (or is NaN) */
        __m256 c = _mm256_cmp_ps(_mm256_loadu_ps(x + j), _mm256_set1_ps(bv[k - 1]), _CMP_NLE_UQ);
        if (_mm256_movemask_ps(c))
            for (int t = j; t < j + 8; t++) topk_insert(x[t], t, k, &n, bv, bi);
    }
    for (; j < N; j++) topk_insert(x[j], j, k, &n, bv, bi);
}

/* logsumexp's sum in 8 lanes (lane j & 7), then hsum8_scalar's tree: the same bits with or without AVX2 */
AVX2 static float lse_row_avx2(const float *x, int N, float mx) {
    __m256 acc = _mm256_setzero_ps(), vmx = _mm256_set1_ps(mx);
    int j = 0;
    for (; j + 8 <= N; j += 8) acc = _mm256_add_ps(acc, exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(x + j), vmx)));
    float ln[8];
    _mm256_storeu_ps(ln, acc);
    for (; j < N; j++) ln[j & 7] = ln[j & 7] + exp_scalar(x[j] - mx);
    return mx + logf(hsum8_scalar(ln));
}
#endif

static float lse_row_scalar(const float *x, int N, float mx) {
    float ln[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int j = 0; j < N; j++) ln[j & 7] = ln[j & 7] + exp_scalar(x[j] - mx);
    return mx + logf(hsum8_scalar(ln));
}

void qk_topk(const float *x, int M, int N, long ld, int k, float *vals, int64_t *idx, float *lse) {
    int avx2 = qk_has_avx2();
    (void)avx2; /* (read on x86-64 only) */
    for (int m = 0; m < M; m++) {
        const float *r = x + m * ld;
        float *bv = vals + (long)m * k;
        int64_t *bi = idx + (long)m * k;
#if QK_X86
        if (avx2) topk_row_avx2(r, N, k, bv, bi);
        else
#endif
        {
            int n = 0;
            for (int j = 0; j < N; j++) topk_insert(r[j], j, k, &n, bv, bi);
        }
        if (lse) {
            float mx = bv[0];
            if (mx != mx || isinf(mx)) { lse[m] = mx; continue; } /* a NaN row; +inf dominates; -inf: all -inf */
#if QK_X86
            if (avx2) { lse[m] = lse_row_avx2(r, N, mx); continue; }
#endif
            lse[m] = lse_row_scalar(r, N, mx);
        }
    }
}

/* ============================================================================ the whole q4 block */
/* One pre-norm (or sandwich / peri-LN) SwiGLU block of the q4 format over a KV cache, in one call
 * (kernels.block_q4): the same functions, in the same order, that the module-by-module path calls one at a
 * time from Python --
 *   xn = RMSNorm(x);  qkv = xn Wqkv;  RoPE + K/V store;  att = attention(q, cache, mask);
 *   y = x + N_ao(att Wo);  xn = RMSNorm(y);  ab = xn W13;  y = y + N_fo((silu(a) * b) W2)
 * (N_ao, N_fo: the sandwich's output norms, skipped where their weights are NULL: pre-norm) -- so its result is bit-identical to that path (tests/test_kernels.py), and a row's result still does
 * not depend on the other rows. What it saves is Python: ~15 calls per block and their tensors.
 * x, y: [B*M, d] (y must not alias x: a caller may hold x, e.g. a captured middle-layer residual).
 * Workspace: qk_block_q4_work bytes. */
static long align64(long n) { return (n + 63) & ~63L; }

static long q8_work_bytes(long R, long K) { return align64(R * K) + 8 * R * (K / QK); }

long qk_block_q4_work(int R, int d, int H, int Hk, int D, int hid, int S) {
    long nqkv = (long)(H + 2 * Hk) * D, kmax = d;
    if ((long)H * D > kmax) kmax = (long)H * D;
    if (hid > kmax) kmax = hid;
    long f = align64(4L * R * d) * 2 + align64(4L * R * nqkv) + align64(4L * R * H * D) + align64(8L * R * hid)
           + align64(4L * R * hid) + align64(8L * R * H * S);
    return f + q8_work_bytes(R, kmax);
}

void qk_block_q4(const float *x, float *y, int B, int M, int d, int H, int Hk, int D, int hid, float eps,
                 float scale, const float *norm1, const float *norm2, const float *norm_ao, const float *norm_fo,
                 const uint8_t *wqkv, const uint16_t *sqkv,
                 const uint8_t *wo, const uint16_t *so, const uint8_t *w13, const uint16_t *s13,
                 const uint8_t *w2, const uint16_t *s2, const float *cos, const float *sin, void *kc, void *vc,
                 long cb, long ch, long cs, const long *slots, const float *mask, int MH, int S, void *work,
                 int kv16) {
    long R = (long)B * M, nqkv = (long)(H + 2 * Hk) * D;
    char *p = (char *)work;
    float *xn = (float *)p;    p += align64(4L * R * d);
    float *tmp = (float *)p;   p += align64(4L * R * d);
    float *qkv = (float *)p;   p += align64(4L * R * nqkv);
    float *att = (float *)p;   p += align64(4L * R * H * D);
    float *ab = (float *)p;    p += align64(8L * R * hid);
    float *act = (float *)p;   p += align64(4L * R * hid);
    float *scr = (float *)p;   p += align64(8L * R * H * S);
    void *q8 = p;
    qk_rmsnorm(x, norm1, (int)R, d, eps, xn);
    qk_linear_q4_1(xn, (int)R, d, wqkv, sqkv, (int)nqkv, qkv, q8);
    qk_rope_store(qkv, M * nqkv, B, M, H, Hk, D, cos, sin, kc, vc, cb, ch, slots, kv16);
    qk_attention(qkv, M * nqkv, nqkv, kc, vc, cb, ch, cs, mask, B, M, H, Hk, S, D, scale, att, scr, MH, kv16);
    qk_linear_q4_1(att, (int)R, H * D, wo, so, d, tmp, q8);
    if (norm_ao) qk_rmsnorm(tmp, norm_ao, (int)R, d, eps, tmp); /* in place: a row is read before written */
    for (long i = 0; i < R * d; i++) y[i] = x[i] + tmp[i];
    qk_rmsnorm(y, norm2, (int)R, d, eps, xn);
    qk_linear_q4_1(xn, (int)R, d, w13, s13, 2 * hid, ab, q8);
    qk_silu_mul(ab, (int)R, hid, act);
    qk_linear_q4_1(act, (int)R, hid, w2, s2, d, tmp, q8);
    if (norm_fo) qk_rmsnorm(tmp, norm_fo, (int)R, d, eps, tmp);
    for (long i = 0; i < R * d; i++) y[i] = y[i] + tmp[i];
}

/* nb consecutive blocks in one call: block b reads the weights w[12 b .. 12 b + 11] (qk_block_q4's order:
 * norm1, norm2, norm_ao, norm_fo, wqkv, sqkv, wo, so, w13, s13, w2, s2) and the cache layer at kc + b * ls
 * (likewise vc), with the same rows, positions, slots and mask -- a forward whose blocks are all dense q4
 * blocks (model.Transformer.run_blocks dispatches here through generate.CachedStep.run_fused). Each block
 * is qk_block_q4 itself, so the result is bit-identical to calling it block by block; what this saves is
 * the Python between the calls (~30 us a block). The residual alternates between y and tmp ([B*M, d]
 * each), so that the last block writes y. */
void qk_blocks_q4(const float *x, float *y, float *tmp, int nb, int B, int M, int d, int H, int Hk, int D,
                  int hid, float eps, float scale, const void *const *w, const float *cos, const float *sin,
                  void *kc, void *vc, long ls, long cb, long ch, long cs, const long *slots, const float *mask,
                  int MH, int S, void *work, int kv16) {
    const float *in = x;
    int esz = kv16 ? 2 : 4; /* ls, cb, ch, cs count elements */
    for (int b = 0; b < nb; b++) {
        float *out = (nb - 1 - b) % 2 == 0 ? y : tmp;
        const void *const *p = w + 12L * b;
        qk_block_q4(in, out, B, M, d, H, Hk, D, hid, eps, scale, (const float *)p[0], (const float *)p[1],
                    (const float *)p[2], (const float *)p[3], (const uint8_t *)p[4], (const uint16_t *)p[5],
                    (const uint8_t *)p[6], (const uint16_t *)p[7], (const uint8_t *)p[8], (const uint16_t *)p[9],
                    (const uint8_t *)p[10], (const uint16_t *)p[11], cos, sin, (char *)kc + b * ls * esz,
                    (char *)vc + b * ls * esz, cb, ch, cs, slots, mask, MH, S, work, kv16);
        in = out;
    }
}
