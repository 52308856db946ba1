/* A program around one path of the GGUF kernel, for a CPU that this machine can only emulate (qemu-user runs the
   ARM build): reads type, rows, in, out (4 int64), then x (rows * in float32) and the blocks (out * row_bytes
   bytes) from stdin, writes y (rows * out float32) to stdout. Built with the path's file:
   cc -O2 -ffp-contract=off -I hardway/kernels/c hardway/kernels/c/gguf_neon.c tests/c/gguf_driver.c */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

long row_bytes(int type, long in);
int gguf_matmul(const float *x, long rows, long in, const uint8_t *w, int type, long out, float *y, int threads);

int main(void) {
    int64_t h[4];
    if (fread(h, sizeof h, 1, stdin) != 1) return 1;
    long rows = h[1], in = h[2], out = h[3], bytes = out * row_bytes((int)h[0], in);
    float *x = malloc(rows * in * sizeof(float)), *y = malloc(rows * out * sizeof(float));
    uint8_t *w = malloc(bytes);
    if (fread(x, sizeof(float), rows * in, stdin) != (size_t)(rows * in) || fread(w, 1, bytes, stdin) != (size_t)bytes) return 1;
    if (gguf_matmul(x, rows, in, w, (int)h[0], out, y, 1) != 0) return 2;
    fwrite(y, sizeof(float), rows * out, stdout);
    return 0;
}
