// Each query row of ggml_flash_attn_ext over n causal rows (a verification pass) equals the same row's attention
// alone (a decode step), bit for bit, F32 queries over an F16 KV cache as llama-server's (scripts/
// llamacpp-f32-invariant.patch: one query over 512 or more cached positions no longer splits them over the threads).
// Default precision: F32 accumulators. tests/engines/test_llamacpp_f32_rows.py builds it against make llamacpp's ggml. Usage: llamacpp_attn_rows HEADS
// KV_HEADS DIM CACHE NMAX; exit 1 if any row differs.
#include "ggml.h"
#include "ggml-cpu.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
static int heads, kv_heads, dim, cache;
// rows first..first+n-1 of q (each [dim, heads]) at positions pos0+first.., over the cache (positions 0..cache-1,
// each row seeing those up to its own): out [n, heads, dim]
static float * attend(const float * q, const ggml_fp16_t * k, const ggml_fp16_t * v, int pos0, int first, int n,
                      int threads) {
    struct ggml_init_params ip = { ((size_t) 64 << 20), NULL, false };
    struct ggml_context * ctx = ggml_init(ip);
    struct ggml_tensor * Q = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, dim, n, heads);
    struct ggml_tensor * K = ggml_new_tensor_3d(ctx, GGML_TYPE_F16, dim, cache, kv_heads);
    struct ggml_tensor * V = ggml_new_tensor_3d(ctx, GGML_TYPE_F16, dim, cache, kv_heads);
    struct ggml_tensor * M = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, cache, n);
    for (int h = 0; h < heads; ++h) {
        for (int j = 0; j < n; ++j) {
            memcpy((float *) Q->data + ((size_t) h * n + j) * dim, q + ((size_t) (first + j) * heads + h) * dim,
                   sizeof(float) * dim);
        }
    }
    memcpy(K->data, k, sizeof(ggml_fp16_t) * dim * cache * kv_heads);
    memcpy(V->data, v, sizeof(ggml_fp16_t) * dim * cache * kv_heads);
    for (int j = 0; j < n; ++j) {
        for (int c = 0; c < cache; ++c) {
            ((ggml_fp16_t *) M->data)[(size_t) j * cache + c] = ggml_fp32_to_fp16(c <= pos0 + first + j ? 0.0f : -INFINITY);
        }
    }
    struct ggml_tensor * out = ggml_flash_attn_ext(ctx, Q, K, V, M, 1.0f / sqrtf((float) dim), 0.0f, 0.0f);
    struct ggml_cgraph * g = ggml_new_graph(ctx);
    ggml_build_forward_expand(g, out);
    ggml_graph_compute_with_ctx(ctx, g, threads);
    float * res = malloc(sizeof(float) * n * heads * dim); // out: [dim, heads, n]
    memcpy(res, out->data, sizeof(float) * n * heads * dim);
    ggml_free(ctx);
    return res;
}
int main(int argc, char ** argv) {
    heads = argc > 1 ? atoi(argv[1]) : 9, kv_heads = argc > 2 ? atoi(argv[2]) : 3, dim = argc > 3 ? atoi(argv[3]) : 64;
    cache = argc > 4 ? atoi(argv[4]) : 768;
    const int nmax = argc > 5 ? atoi(argv[5]) : 12, pos0 = cache - nmax;
    float * q = malloc(sizeof(float) * nmax * heads * dim);
    ggml_fp16_t * k = malloc(sizeof(ggml_fp16_t) * dim * cache * kv_heads), * v = malloc(sizeof(ggml_fp16_t) * dim * cache * kv_heads);
    srand(1);
    for (int i = 0; i < nmax * heads * dim; ++i) q[i] = 4.0f * ((float) rand() / RAND_MAX - 0.5f);
    for (int i = 0; i < dim * cache * kv_heads; ++i) k[i] = ggml_fp32_to_fp16((float) rand() / RAND_MAX - 0.5f);
    for (int i = 0; i < dim * cache * kv_heads; ++i) v[i] = ggml_fp32_to_fp16((float) rand() / RAND_MAX - 0.5f);
    int bad = 0;
    for (int threads = 1; threads <= 2; ++threads) {
        for (int n = 1; n <= nmax; ++n) {
            float * batch = attend(q, k, v, pos0, 0, n, threads);
            int diff = 0;
            for (int j = 0; j < n; ++j) {
                float * one = attend(q, k, v, pos0, j, 1, threads);
                diff += memcmp(one, batch + (size_t) j * heads * dim, sizeof(float) * heads * dim) != 0;
                free(one);
            }
            printf("threads %d rows %2d: %d of %d rows differ from their one-row attention\n", threads, n, diff, n);
            bad += diff;
            free(batch);
        }
    }
    return bad != 0;
}
