/* Writes crates/frugal/src/quant/testdata/llama_cpp_q8_k.json: llama.cpp's own Q8_K quantization
 * (quantize_row_q8_K_ref, what its CPU backend feeds K-quant products) of four super-blocks:
 * a positive largest value, a negative outlier, exact halves (ties), and zeros.
 *   gcc -O1 scripts/llama-cpp-q8k.c -L$BIN -lggml-base -Wl,-rpath,$BIN -o /tmp/q8k && /tmp/q8k > ...
 * with BIN the llama.cpp build's bin folder (../shared/peers/build-llama-cpp). */
#include <stdio.h>
#include <stdint.h>
#include <math.h>
#define QK_K 256
typedef struct { float d; int8_t qs[QK_K]; int16_t bsums[QK_K/16]; } block_q8_K;
void quantize_row_q8_K_ref(const float * x, block_q8_K * y, int64_t k);
int main(void) {
    enum { NB = 4 };
    static float x[NB * QK_K];
    uint32_t s = 12345;
    for (int i = 0; i < QK_K; ++i) { s = s * 1664525u + 1013904223u; x[i] = ((float)(s >> 8) / 16777216.0f - 0.5f) * 3.0f; }
    x[17] = 4.25f; /* positive largest value */
    for (int i = 0; i < QK_K; ++i) { s = s * 1664525u + 1013904223u; x[QK_K + i] = ((float)(s >> 8) / 16777216.0f - 0.5f) * 0.02f; }
    x[QK_K + 200] = -0.75f; /* negative largest value, outlier */
    /* max 127 -> iscale -1: halves round to even */
    for (int i = 0; i < QK_K; ++i) x[2*QK_K + i] = (float)((i % 64) - 32) + 0.5f;
    x[2*QK_K + 3] = 127.0f;
    for (int i = 0; i < QK_K; ++i) x[3*QK_K + i] = 0.0f;
    block_q8_K y[NB];
    quantize_row_q8_K_ref(x, y, NB * QK_K);
    printf("{\"x\":[");
    for (int i = 0; i < NB * QK_K; ++i) printf("%s%.9g", i ? "," : "", x[i]);
    printf("],\"d\":[");
    for (int b = 0; b < NB; ++b) printf("%s%.9g", b ? "," : "", y[b].d);
    printf("],\"qs\":[");
    for (int b = 0; b < NB; ++b) for (int i = 0; i < QK_K; ++i) printf("%s%d", (b||i) ? "," : "", y[b].qs[i]);
    printf("],\"bsums\":[");
    for (int b = 0; b < NB; ++b) for (int i = 0; i < QK_K/16; ++i) printf("%s%d", (b||i) ? "," : "", y[b].bsums[i]);
    printf("]}\n");
    return 0;
}
