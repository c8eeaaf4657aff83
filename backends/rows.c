/* The two passes over a decoding step's (rows, V) float32 logits that dominate the loop's own
 * time, in C: numpy needs five passes and a temporary array for what one pass does here.
 * backends/native.py compiles this file on first use and backends/scoring.py keeps the numpy
 * versions, which define the results: these must agree with them (tests/test_native.py). */
#include <math.h>
#include <stdint.h>

#define SPAN 256

/* e^x for x in [-87, 88], within 2 float ulps: Cody-Waite reduction to |r| <= ln2/2 and a
 * degree-6 Taylor polynomial, written without calls or branches so the compiler vectorizes it.
 * Inputs outside the range are clamped: callers only sum terms whose row maximum is near zero. */
static inline float exp_f32(float x)
{
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float n = (x * 1.44269504f + 12582912.0f) - 12582912.0f; /* round to nearest */
    float r = x - n * 0.693145751953125f;
    r = r - n * 1.428606765330187e-06f;
    float q = 1.0f / 720.0f;
    q = q * r + 1.0f / 120.0f;
    q = q * r + 1.0f / 24.0f;
    q = q * r + 1.0f / 6.0f;
    q = q * r + 0.5f;
    q = q * r + 1.0f;
    q = q * r + 1.0f;
    union { int32_t i; float f; } scale;
    scale.i = ((int32_t)n + 127) << 23;
    return q * scale.f;
}

/* Sum of e^(x - shift) over p[0..v), in float32 vector lanes within spans of SPAN entries and in
 * float64 across spans (so a lane adds few terms in float32), with the row's maximum and its
 * plain sum (finite exactly when every entry is: |logits| is far below FLT_MAX). */
static double sum_exp(const float *p, int64_t v, float shift, float *maximum, float *plain)
{
    double sum = 0.0;
    float m = -INFINITY, t = 0.0f;
    for (int64_t i = 0; i < v; i += SPAN) {
        int64_t end = i + SPAN < v ? i + SPAN : v;
        float part = 0.0f, top = -INFINITY, total = 0.0f;
#pragma omp simd reduction(+ : part, total) reduction(max : top)
        for (int64_t u = i; u < end; u++) {
            float x = p[u];
            part += exp_f32(x - shift);
            top = x > top ? x : top;
            total += x;
        }
        sum += part;
        m = top > m ? top : m;
        t += total;
    }
    *maximum = m;
    *plain = t;
    return sum;
}

/* Per row: log-sum-exp in float64 and whether the row holds a NaN or an infinity.
 * The sum of e^x runs on the raw logits when the row's maximum is within 40 of zero (no term
 * overflows, the largest is far above float32's smallest); otherwise a second pass subtracts the
 * maximum first. -inf entries count as zero; a row with a NaN or +inf, or with no finite entry,
 * gets NaN: the caller computes it its own way. */
void row_log_normalizer(const float *logits, int64_t rows, int64_t v, double *lse, uint8_t *non_finite)
{
    for (int64_t r = 0; r < rows; r++) {
        const float *p = logits + r * v;
        float m, t;
        double s = sum_exp(p, v, 0.0f, &m, &t);
        non_finite[r] = !isfinite(t);
        if (isnan(t) || t == INFINITY || m == -INFINITY)
            lse[r] = NAN;
        else if (fabsf(m) <= 40.0f)
            lse[r] = log(s);
        else
            lse[r] = (double)m + log(sum_exp(p, v, m, &m, &t));
    }
}

#define CHUNK 64

/* Per row: the ids of its k largest entries, best first, a tie going to the lower id (as a
 * stable sort by value descending). NaN and -inf never enter; found[r] says how many did, and a
 * row with fewer than k is left to the caller. The scan tests CHUNK entries at a time against the
 * k-th best so far, so nearly every entry costs one vector comparison. */
void row_top_k(const float *logits, int64_t rows, int64_t v, int64_t k, int64_t *ids, int64_t *found)
{
    float best[256];
    if (k < 1 || k > 256)
        return;
    for (int64_t r = 0; r < rows; r++) {
        const float *p = logits + r * v;
        int64_t *out = ids + r * k;
        int64_t n = 0;
        float threshold = -INFINITY;
        for (int64_t i = 0; i < v; i += CHUNK) {
            int64_t end = i + CHUNK <= v ? i + CHUNK : v;
            if (end - i == CHUNK) {
                int any = 0;
#pragma omp simd reduction(| : any)
                for (int j = 0; j < CHUNK; j++)
                    any |= p[i + j] > threshold;
                if (!any)
                    continue;
            }
            for (int64_t q = i; q < end; q++) {
                float x = p[q];
                if (!(x > threshold))
                    continue;
                /* insert after every kept entry >= x: an equal value already kept has a lower id */
                int64_t at = n < k ? n : k - 1;
                while (at > 0 && best[at - 1] < x) {
                    best[at] = best[at - 1];
                    out[at] = out[at - 1];
                    at--;
                }
                best[at] = x;
                out[at] = q;
                if (n < k)
                    n++;
                if (n == k)
                    threshold = best[k - 1];
            }
        }
        found[r] = n;
    }
}
