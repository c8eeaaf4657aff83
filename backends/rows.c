/* The passes over a decoding step's (rows, V) float32 logits that dominate the loop's own time,
 * in C: the log-sum-exp with the finite check, the top-k, and beam search's whole scoring of a
 * step (log_softmax, masks, repetition penalty, top-k) in one call on its own threads.
 * backends/native.py compiles this file on first use; backends/scoring.py keeps the numpy
 * versions, which define the results: these must agree with them (tests/test_native.py). */
#include <math.h>
#include <pthread.h>
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

/* Whether id is in the ascending list ids[0..n), starting the search at *at and leaving *at at the
 * first entry >= id: callers ask in ascending order, so the search only moves forward. */
static inline int listed(const int64_t *ids, int64_t n, int64_t *at, int64_t id)
{
    while (*at < n && ids[*at] < id)
        (*at)++;
    return *at < n && ids[*at] == id;
}

/* Ids a scan leaves out: three ascending lists (any may be empty). */
typedef struct {
    const int64_t *ids[3];
    int64_t n[3];
} skip_lists;

/* The ids of the k largest entries of p[0..v) not in `skip` (NULL: none), best first, a tie going to
 * the lower id (as a stable sort by value descending), their values in best[]; NaN and -inf never
 * enter. Returns how many were found. The scan tests CHUNK entries at a time against the k-th best
 * so far, so nearly every entry costs one vector comparison. */
static int64_t scan_top_k(const float *p, int64_t v, int64_t k, const skip_lists *skip, float *best, int64_t *out)
{
    int64_t n = 0, at_list[3] = {0, 0, 0};
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
            if (skip && (listed(skip->ids[0], skip->n[0], &at_list[0], q) ||
                         listed(skip->ids[1], skip->n[1], &at_list[1], q) ||
                         listed(skip->ids[2], skip->n[2], &at_list[2], q)))
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
    return n;
}

/* Per row: the ids of its k largest entries (scan_top_k); found[r] says how many there were, and a
 * row with fewer than k is left to the caller. */
void row_top_k(const float *logits, int64_t rows, int64_t v, int64_t k, int64_t *ids, int64_t *found)
{
    float best[256];
    if (k < 1 || k > 256)
        return;
    for (int64_t r = 0; r < rows; r++)
        found[r] = scan_top_k(logits + r * v, v, k, NULL, best, ids + r * k);
}

static inline int in_sorted(const int64_t *ids, int64_t n, int64_t id)
{
    int64_t lo = 0, hi = n;
    while (lo < hi) {
        int64_t mid = (lo + hi) / 2;
        if (ids[mid] < id)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < n && ids[lo] == id;
}

typedef struct {
    const float *logits;
    int64_t v, k;
    const int64_t *shared;
    int64_t n_shared;
    const int64_t *masked_at, *masked, *penalised_at, *penalised;
    double penalty;
    uint8_t *non_finite;
    int64_t *ids;
    double *values;
    int64_t *found;
    int64_t lo, hi;
} beam_job;

/* One beam-search row: log_softmax of the raw row, then generate()'s processors on it, as
 * scoring.beam_scores defines them: masked ids (shared by every row, or the row's own) never
 * enter; the row's penalised ids are left out of the scan and scored exactly, lp * penalty where
 * lp < 0 and lp / penalty otherwise, then merged by (value desc, id asc). */
static void beam_row(const beam_job *job, int64_t r)
{
    const float *p = job->logits + r * job->v;
    int64_t k = job->k, *out = job->ids + r * k;
    double *val = job->values + r * k;
    float m, t;
    double s = sum_exp(p, job->v, 0.0f, &m, &t);
    job->non_finite[r] = !isfinite(t);
    job->found[r] = 0;
    if (job->non_finite[r] || m == -INFINITY)
        return; /* the caller's: NaN, an infinity, or no finite entry */
    double lse = fabsf(m) <= 40.0f ? log(s) : (double)m + log(sum_exp(p, job->v, m, &m, &t));
    const int64_t *masked = job->masked + job->masked_at[r], *pen = job->penalised + job->penalised_at[r];
    int64_t n_masked = job->masked_at[r + 1] - job->masked_at[r];
    int64_t n_pen = job->penalised_at[r + 1] - job->penalised_at[r];
    skip_lists skip = {{job->shared, masked, pen}, {job->n_shared, n_masked, n_pen}};
    float best[256];
    int64_t n = scan_top_k(p, job->v, k, &skip, best, out);
    job->found[r] = n;
    if (n < k)
        return; /* the caller's */
    for (int64_t j = 0; j < k; j++)
        val[j] = (double)best[j] - lse;
    for (int64_t j = 0; j < n_pen; j++) {
        int64_t id = pen[j];
        double lp = (double)p[id] - lse;
        double x = lp < 0 ? lp * job->penalty : lp / job->penalty;
        if (in_sorted(job->shared, job->n_shared, id) || in_sorted(masked, n_masked, id))
            x = -INFINITY;
        if (!(x >= val[k - 1]) || (x == val[k - 1] && out[k - 1] < id))
            continue; /* ranks after the k-th (or is NaN) */
        int64_t at = k - 1; /* replaces the k-th, then moves up past every entry it ranks before */
        while (at > 0 && (val[at - 1] < x || (val[at - 1] == x && out[at - 1] > id))) {
            val[at] = val[at - 1];
            out[at] = out[at - 1];
            at--;
        }
        val[at] = x;
        out[at] = id;
    }
}

static void *beam_rows_job(void *arg)
{
    const beam_job *job = arg;
    for (int64_t r = job->lo; r < job->hi; r++)
        beam_row(job, r);
    return NULL;
}

/* beam_row for every row, on up to `threads` threads (rows split into contiguous blocks). */
void beam_rows(const float *logits, int64_t rows, int64_t v, int64_t k, const int64_t *shared, int64_t n_shared,
               const int64_t *masked_at, const int64_t *masked, const int64_t *penalised_at,
               const int64_t *penalised, double penalty, int64_t threads, uint8_t *non_finite,
               int64_t *ids, double *values, int64_t *found)
{
    if (k < 1 || k > 256)
        return;
    beam_job jobs[16];
    pthread_t workers[16];
    if (threads < 1)
        threads = 1;
    if (threads > 16)
        threads = 16;
    if (threads > rows)
        threads = rows > 0 ? rows : 1;
    for (int64_t i = 0; i < threads; i++) {
        jobs[i] = (beam_job){logits, v, k, shared, n_shared, masked_at, masked, penalised_at, penalised, penalty,
                             non_finite, ids, values, found, rows * i / threads, rows * (i + 1) / threads};
    }
    int64_t started = 0;
    for (int64_t i = 1; i < threads; i++) {
        if (pthread_create(&workers[i], NULL, beam_rows_job, &jobs[i]) != 0)
            break;
        started = i;
    }
    for (int64_t i = started + 1; i < threads; i++) /* threads that could not start: done here */
        beam_rows_job(&jobs[i]);
    beam_rows_job(&jobs[0]);
    for (int64_t i = 1; i <= started; i++)
        pthread_join(workers[i], NULL);
}

/* Whether candidate a ranks before candidate b: the higher score, then the lower key; NaN ranks
 * last (as numpy's sorts place it). */
static inline int ranks_before(double sa, int64_t ka, double sb, int64_t kb)
{
    if (isnan(sa) || isnan(sb))
        return isnan(sa) ? (isnan(sb) && ka < kb) : 1;
    return sa > sb || (sa == sb && ka < kb);
}

/* Beam search's choice of a step's continuations, as beam_search.BeamSearchDecoder.update's numpy
 * path defines it. Per sentence s: each of its n beams' running score plus the beam's first `keep`
 * log-probs (ids and values: (sentences * n, width), best first) are its n * keep candidates; the
 * best `keep` of them, by score and then by beam * vocab + id, go to top_* (sentences, keep); a
 * candidate hits a stop when its id is eos or `capped`; of those that do not, the best n by score
 * (a stop counts -1e9; ties: the earlier) go on: `next` (sentences, n) says which of the keep. */
void beam_select(int64_t sentences, int64_t n, int64_t keep, int64_t width, int64_t vocab, const double *running,
                 const int64_t *ids, const double *values, int64_t eos, int64_t capped, double *top_scores,
                 int64_t *top_beams, int64_t *top_tokens, double *top_logprobs, uint8_t *hits, int64_t *next)
{
    int64_t key[512];
    if (keep < 1 || keep > 512 || n < 1 || n > keep)
        return;
    for (int64_t s = 0; s < sentences; s++) {
        double *score = top_scores + s * keep, *lp = top_logprobs + s * keep;
        int64_t *beam = top_beams + s * keep, *token = top_tokens + s * keep, found = 0;
        for (int64_t j = 0; j < n; j++) {
            int64_t row = s * n + j;
            for (int64_t c = 0; c < keep; c++) {
                double x = running[row] + values[row * width + c];
                int64_t id = ids[row * width + c], kx = j * vocab + id;
                if (found == keep && !ranks_before(x, kx, score[keep - 1], key[keep - 1]))
                    continue;
                int64_t at = found < keep ? found++ : keep - 1;
                while (at > 0 && ranks_before(x, kx, score[at - 1], key[at - 1])) {
                    score[at] = score[at - 1], key[at] = key[at - 1], beam[at] = beam[at - 1];
                    token[at] = token[at - 1], lp[at] = lp[at - 1];
                    at--;
                }
                score[at] = x, key[at] = kx, beam[at] = j, token[at] = id, lp[at] = values[row * width + c];
            }
        }
        /* the n best of running = score + hit * -1e9, ties to the earlier (a stable sort) */
        double go[512];
        int64_t *pick = next + s * n, picked = 0;
        for (int64_t c = 0; c < keep; c++) {
            uint8_t hit = token[c] == eos || capped;
            hits[s * keep + c] = hit;
            go[c] = score[c] + (double)hit * -1.0e9;
            if (picked == n && !ranks_before(go[c], c, go[pick[n - 1]], pick[n - 1]))
                continue;
            int64_t at = picked < n ? picked++ : n - 1;
            while (at > 0 && ranks_before(go[c], c, go[pick[at - 1]], pick[at - 1])) {
                pick[at] = pick[at - 1];
                at--;
            }
            pick[at] = c;
        }
    }
}
