"""Reference solutions to lesson 22's exercises (notebooks/22_engine_room.ipynb).

Try them yourself first: each check in the notebook says right or wrong, and why.
"""


# Exercise 1: every int8 weight crosses the memory bus once a call (1 byte each), with an fp32 scale a row read, x
# read and y written (4 bytes each: small beside a large matrix, a tenth and more of a skinny one's bytes).
# Time = bytes / (bytes per second), in microseconds.
def my_predicted_us(out_features: int, in_features: int, bandwidth: float) -> float:
    nbytes = out_features * in_features + 4 * out_features + 4 * in_features + 4 * out_features
    return nbytes / bandwidth * 1e6


# On the (512, 512) matrix the answer is the machine's: its 256 KiB come from the cache, faster than the formula's
# memory, but each call from Python costs microseconds before the loop starts, and the loop's own work may not keep
# up with the cache. On a 2-core Xeon the call came out slower than the formula's time; the check says which it was.
my_small_matrix = "slower"


# Exercise 2, found by probing:
# - A is right on a matrix of 64 rows, wrong on one of 65, 66 or 67: only the last (out % 4) rows differ, and each of
#   them equals (up to its own scale) the first row of the last block of four: the leftover rows read the weights of
#   row r0, not their own.
# - B is right when every row has the same scale, wrong otherwise; with x a single 1 at column j, its answer for every
#   row is scaled by scale[j], not by scale[r]: the scale of the column.
# - C is wrong by a small amount everywhere; with x a single 1 at the last column its answer is 0 for every row: the
#   last column is skipped. No loop reads x one place late (a single 1 at column 0 would then give 0 everywhere).
my_diagnosis = {"A": "last rows read the wrong weights", "B": "scale per column", "C": "last column skipped"}


# Exercise 3: in each group, byte j holds column j (low nibble) and column j + group / 2 (high nibble). A group's sum
# is d * (q . x) + m * (sum of its x): the minimum multiplies every x of the group once.
my_int4_source = r"""
#include <stdint.h>

void matvec_int4_row(const float *x, const uint8_t *packed, const float *d, const float *m, float *y,
                     long out, long in, long group) {
    long groups = in / group, half = group / 2;
    for (long r = 0; r < out; r++) {
        const uint8_t *row = packed + r * (in / 2);     /* half a byte a weight */
        float acc = 0;
        for (long g = 0; g < groups; g++) {
            const uint8_t *b = row + g * half;           /* the group's bytes */
            const float *xg = x + g * group;             /* its columns of x */
            float dot = 0, sum = 0;
            for (long j = 0; j < half; j++) {
                dot += (float)(b[j] & 15) * xg[j] + (float)(b[j] >> 4) * xg[j + half];
                sum += xg[j] + xg[j + half];
            }
            acc += d[r * groups + g] * dot + m[r * groups + g] * sum;
        }
        y[r] = acc;
    }
}
"""
