/* The kernels' bits on another CPU (scripts/portable_check.sh): every exported kernel of a qkernels library
 * (argv[1], at SIMD level argv[2], -1 = the best the CPU has) runs on the same pseudo-random inputs, and one
 * line per kernel prints an FNV-1a hash of its output bytes. Builds that give the same bits print the same
 * lines. */
#include <dlfcn.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t state = 88172645463325252ULL;
static uint32_t next(void) { /* xorshift64: the same sequence on every CPU */
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return (uint32_t)state;
}
static float uniform(void) { return ((int)(next() % 20001) - 10000) / 5000.0f; } /* [-2, 2], exact in fp32 */
static uint16_t small_half(void) { return (uint16_t)(0x1800 + next() % 0x1800); } /* fp16 in ~[2^-9, 2^-1) */
static void say(const char *name, const void *p, size_t n) {
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < n; i++) h = (h ^ ((const unsigned char *)p)[i]) * 1099511628211ULL;
    printf("%s %016llx\n", name, (unsigned long long)h);
}
static void *lib;
static void *fn(const char *name) {
    void *f = dlsym(lib, name);
    if (!f) { printf("missing %s\n", name); exit(1); }
    return f;
}

int main(int argc, char **argv) {
    if (argc < 2 || !(lib = dlopen(argv[1], RTLD_NOW))) {
        printf("usage: portable_check LIB [LEVEL] (%s)\n", argc < 2 ? "no LIB" : dlerror());
        return 1;
    }
    ((void (*)(int))fn("qk_set_simd"))(argc > 2 ? atoi(argv[2]) : -1);
    printf("simd level %d\n", ((int (*)(void))fn("qk_simd_level"))());
    const int M = 7, K = 576, N = 200, G = K / 32, NG = (N + 7) / 8;
    float *x = malloc(4 * M * K), *y = calloc(M * N, 4), *wf = malloc(4 * N * K), *nw = malloc(4 * K);
    float *yn = malloc(4 * M * K);
    uint8_t *w4 = malloc(NG * G * 128);
    int8_t *w8 = malloc(NG * G * 256);
    uint16_t *s4 = malloc(2 * NG * G * 16), *s8 = malloc(2 * NG * G * 8);
    uint16_t *xb = malloc(2 * M * K), *wb = malloc(2 * N * K);
    void *work = calloc(1, 1 << 20);
    for (int i = 0; i < M * K; i++) x[i] = uniform();
    for (int i = 0; i < NG * G * 128; i++) w4[i] = (uint8_t)next();
    for (int i = 0; i < NG * G * 16; i++) s4[i] = small_half();
    for (int i = 0; i < NG * G * 256; i++) w8[i] = (int8_t)((int)(next() % 255) - 127);
    for (int i = 0; i < NG * G * 8; i++) s8[i] = small_half();
    for (int i = 0; i < N * K; i++) wf[i] = uniform();
    for (int i = 0; i < K; i++) nw[i] = uniform();
    for (int i = 0; i < M * K; i++) { uint32_t u; memcpy(&u, &x[i], 4); xb[i] = (uint16_t)(u >> 16); }
    for (int i = 0; i < N * K; i++) { uint32_t u; memcpy(&u, &wf[i], 4); wb[i] = (uint16_t)(u >> 16); }

    ((void (*)(const float *, int, int, const uint8_t *, const uint16_t *, int, float *, void *))fn("qk_linear_q4_1"))(
        x, M, K, w4, s4, N, y, work);
    say("linear_q4_1", y, 4 * M * N);
    ((void (*)(const float *, int, int, const int8_t *, const uint16_t *, int, float *, void *))fn("qk_linear_q8_0"))(
        x, M, K, w8, s8, N, y, work);
    say("linear_q8_0", y, 4 * M * N);
    ((void (*)(const float *, long, int, int, const float *, long, int, float *, long))fn("qk_linear_f32"))(
        x, K, M, K - 5, wf, K, N, y, N); /* K - 5: a K tail */
    say("linear_f32", y, 4 * M * N);
    ((void (*)(const uint16_t *, long, int, int, const uint16_t *, long, int, float *, long))fn("qk_linear_bf16"))(
        xb, K, M, K - 3, wb, K, N, y, N);
    say("linear_bf16", y, 4 * M * N);
    ((void (*)(const float *, const float *, int, int, float, float *))fn("qk_rmsnorm"))(x, nw, M, K, 1e-5f, yn);
    say("rmsnorm", yn, 4 * M * K);
    ((void (*)(const float *, int, int, float *))fn("qk_silu_mul"))(x, M, K / 2, yn);
    say("silu_mul", yn, 4 * M * K / 2);
    float vals[7 * 8], lse[7];
    int64_t idx[7 * 8];
    ((void (*)(const float *, int, int, long, int, float *, int64_t *, float *))fn("qk_topk"))(
        x, M, K, K, 8, vals, idx, lse);
    say("topk values", vals, sizeof vals);
    say("topk indices", idx, sizeof idx);
    say("topk logsumexp", lse, sizeof lse);

    /* RoPE with the store into an fp32, an fp16 and a bf16 cache, then attention over it: one sequence of T = 3 rows
     * at scattered slots, H = 9 query heads on Hk = 3 KV heads of D = 64, S = 40 slots, a random mask */
    const int T = 3, H = 9, Hk = 3, D = 64, S = 40, W = (H + 2 * Hk) * D;
    const char *names[3][4] = {{"rope_store fp32: q", "rope_store fp32: k", "rope_store fp32: v", "attention fp32"},
                               {"rope_store fp16: q", "rope_store fp16: k", "rope_store fp16: v", "attention fp16"},
                               {"rope_store bf16: q", "rope_store bf16: k", "rope_store bf16: v", "attention bf16"}};
    for (int kv16 = 0; kv16 < 3; kv16++) {
        size_t esz = kv16 ? 2 : 4, n = (size_t)Hk * S * D;
        float *qkv = malloc(4 * T * W), *cs = malloc(4 * T * D), *sn = malloc(4 * T * D), *mask = malloc(4 * T * S);
        float *out = malloc(4 * T * H * D), *scratch = malloc(4 * 2 * T * H * S);
        void *kc = malloc(n * esz), *vc = malloc(n * esz);
        long slots[3] = {37, 20, 39};
        for (int i = 0; i < T * W; i++) qkv[i] = uniform();
        for (int i = 0; i < T * D; i++) { cs[i] = uniform() / 2; sn[i] = uniform() / 2; }
        for (size_t i = 0; i < n; i++) {
            if (kv16 == 1) { ((uint16_t *)kc)[i] = small_half(); ((uint16_t *)vc)[i] = small_half(); }
            else if (kv16 == 2) { /* a bf16: the top half of an fp32 */
                float a = uniform(), b = uniform();
                uint32_t ua, ub;
                memcpy(&ua, &a, 4);
                memcpy(&ub, &b, 4);
                ((uint16_t *)kc)[i] = (uint16_t)(ua >> 16);
                ((uint16_t *)vc)[i] = (uint16_t)(ub >> 16);
            } else { ((float *)kc)[i] = uniform(); ((float *)vc)[i] = uniform(); }
        }
        for (int i = 0; i < T * S; i++) mask[i] = next() % 4 ? 0.0f : -INFINITY;
        ((void (*)(float *, long, int, int, int, int, int, const float *, const float *, void *, void *, long, long,
                   const long *, int))fn("qk_rope_store"))(qkv, T * W, 1, T, H, Hk, D, cs, sn, kc, vc, (long)n,
                                                           (long)S * D, slots, kv16);
        say(names[kv16][0], qkv, 4 * T * W);
        say(names[kv16][1], kc, n * esz);
        say(names[kv16][2], vc, n * esz);
        ((void (*)(const float *, long, long, const void *, const void *, long, long, long, const float *, int, int,
                   int, int, int, int, float, float *, float *, int, int))fn("qk_attention"))(
            qkv, T * W, W, kc, vc, (long)n, (long)S * D, D, mask, 1, T, H, Hk, S, D, 0.125f, out, scratch, 1, kv16);
        say(names[kv16][3], out, 4 * T * H * D);
    }
    return 0;
}
