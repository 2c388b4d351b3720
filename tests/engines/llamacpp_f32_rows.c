// Each output of an F32 x F32 ggml_mul_mat of n rows of B equals the same row's product alone (n = 1), bit for bit
// (scripts/llamacpp-f32-invariant.patch and scripts/llamacpp-sgemm-narrow.patch). tests/engines/
// test_llamacpp_f32_rows.py builds it against make llamacpp's ggml. Usage: llamacpp_f32_rows M K NMAX; exit 1 if any
// row differs.
#include "ggml.h"
#include "ggml-cpu.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
static float * product(const float * a, const float * b, int m, int k, int n, int threads) {
    struct ggml_init_params ip = { sizeof(float) * ((size_t) m * k + (size_t) k * n + (size_t) m * n) + ((size_t) 1 << 20),
                                   NULL, false };
    struct ggml_context * ctx = ggml_init(ip);
    struct ggml_tensor * A = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, k, m);
    struct ggml_tensor * B = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, k, n);
    memcpy(A->data, a, sizeof(float) * m * k);
    memcpy(B->data, b, sizeof(float) * k * n);
    struct ggml_tensor * C = ggml_mul_mat(ctx, A, B);
    struct ggml_cgraph * g = ggml_new_graph(ctx);
    ggml_build_forward_expand(g, C);
    ggml_graph_compute_with_ctx(ctx, g, threads);
    float * out = malloc(sizeof(float) * m * n);
    memcpy(out, C->data, sizeof(float) * m * n);
    ggml_free(ctx);
    return out;
}
int main(int argc, char ** argv) {
    const int m = argc > 1 ? atoi(argv[1]) : 576, k = argc > 2 ? atoi(argv[2]) : 1536, nmax = argc > 3 ? atoi(argv[3]) : 12;
    float * a = malloc(sizeof(float) * m * k), * b = malloc(sizeof(float) * k * nmax);
    srand(1);
    for (int i = 0; i < m * k; ++i) a[i] = (float) rand() / RAND_MAX - 0.5f;
    for (int i = 0; i < k * nmax; ++i) b[i] = (float) rand() / RAND_MAX - 0.5f;
    int bad = 0;
    for (int threads = 1; threads <= 2; ++threads) {
        for (int n = 1; n <= nmax; ++n) {
            float * c = product(a, b, m, k, n, threads);
            int diff = 0;
            for (int j = 0; j < n; ++j) {
                float * one = product(a, b + (size_t) j * k, m, k, 1, threads);
                diff += memcmp(one, c + (size_t) j * m, sizeof(float) * m) != 0;
                free(one);
            }
            printf("threads %d rows %2d: %d of %d rows differ from their one-row product\n", threads, n, diff, n);
            bad += diff;
            free(c);
        }
    }
    return bad != 0;
}
