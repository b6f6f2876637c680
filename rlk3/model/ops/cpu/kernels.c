/* rlk3's CPU kernels: the K3 layers' per-token work fused into single passes, for the rollout engine on a CPU.
 *
 * A decode step of the torch path is ~1,000 small ATen calls (norms, gates, the KDA recurrence over its state pool,
 * the MoE's routing and expert loop), each a few microseconds of dispatch for a few hundred nanoseconds of work; these
 * kernels do the same arithmetic in one call each, and the matmuls stay with torch (MKL/oneDNN). Every kernel has a
 * torch reference, named in its Python wrapper (rlk3/model/ops/cpu/__init__.py), which the tests compare it with.
 *
 * Everything is float32 and row-major; a row stride is given where a caller passes a slice of a wider matrix.
 * Loops are written so that GCC vectorises them (-O3 -march=native -fopenmp-simd): the transcendental functions
 * below are branch-free polynomials for that reason, accurate to a few ulp. NaN propagates through all of them.
 * The KDA kernel runs with denormals flushed to zero: a decaying state reaches ~1e-38 within a few hundred tokens,
 * and x86 arithmetic on denormals is ~40x slower (a decode step of k3-tiny spent most of its time there).
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
static inline unsigned ftz_begin(void) {
    unsigned old = _mm_getcsr();
    _mm_setcsr(old | 0x8040); /* flush-to-zero | denormals-are-zero */
    return old;
}
static inline void ftz_end(unsigned old) { _mm_setcsr(old); }
#else
static inline unsigned ftz_begin(void) { return 0; }
static inline void ftz_end(unsigned old) { (void)old; }
#endif

typedef int64_t i64;

#define PRAGMA(x) _Pragma(#x)
#define SIMD PRAGMA(omp simd)

/* Reductions and register tiles use GCC's generic vectors, one machine register wide (GCC lowers them anywhere):
 * an `omp simd` reduction ends in a serial scalar sum over the lanes, which made every dot product of the KDA
 * recurrence a 16-add dependency chain. */
#if defined(__AVX512F__)
#define VW 16
#elif defined(__AVX__)
#define VW 8
#else
#define VW 4
#endif
typedef float vf __attribute__((vector_size(VW * 4), aligned(4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));

static inline vf vld(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline void vst(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* the sum of the lanes, as a tree of shuffles */
static inline float vsum(vf v) {
#if VW == 16
    v += __builtin_shuffle(v, (vi){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    v += __builtin_shuffle(v, (vi){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    v += __builtin_shuffle(v, (vi){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    v += __builtin_shuffle(v, (vi){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
#elif VW == 8
    v += __builtin_shuffle(v, (vi){4, 5, 6, 7, 0, 1, 2, 3});
    v += __builtin_shuffle(v, (vi){2, 3, 0, 1, 6, 7, 4, 5});
    v += __builtin_shuffle(v, (vi){1, 0, 3, 2, 5, 4, 7, 6});
#else
    v += __builtin_shuffle(v, (vi){2, 3, 0, 1});
    v += __builtin_shuffle(v, (vi){1, 0, 3, 2});
#endif
    return v[0];
}

/* ------------------------------------------------------------------ elementwise math */

static inline float from_bits(int32_t i) {
    union { int32_t i; float f; } u = {.i = i};
    return u.f;
}
static inline int32_t to_bits(float f) {
    union { float f; int32_t i; } u = {.f = f};
    return u.i;
}

/* e^x: x = n·ln2 + r (Cody-Waite), e^r by the degree-7 polynomial of Cephes' expf, 2^n through the exponent bits.
 * Inputs are clamped to [-87, 87]: results stay normal, and 1 + e^x stays inside recip_f's range (so sigmoid(x)
 * bottoms out at 1.6e-38 below x = -87, where the exact value is a denormal or 0). NaN passes the clamps. */
static inline float exp_f(float x) {
    x = x < -87.0f ? -87.0f : x;
    x = x > 87.0f ? 87.0f : x;
    const float shifter = 12582912.0f; /* 1.5·2^23: adding it rounds to an integer held in the low mantissa bits */
    float t = x * 1.44269504088896341f + shifter;
    float n = t - shifter;
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float y = p * (r * r) + r + 1.0f;
    return y * from_bits((to_bits(t) - to_bits(shifter) + 127) << 23);
}

/* 1/x for 1 <= x <= 1e38 (the denominators below): a bit-trick guess within 12%, then three Newton steps (error
 * ~1e-8). A vector division is the slowest instruction of these loops (1 per ~10-16 cycles); this is six FMAs. */
static inline float recip_f(float x) {
    float r = from_bits(0x7EF311C3 - to_bits(x));
    r = r * (2.0f - x * r);
    r = r * (2.0f - x * r);
    return r * (2.0f - x * r);
}

static inline float sigmoid_f(float x) { return recip_f(1.0f + exp_f(-x)); }

/* tanh: an odd polynomial below |x| = 0.625 (Cephes' tanhf: no cancellation near 0), 1 − 2/(e^{2|x|} + 1) above. */
static inline float tanh_f(float x) {
    float z = x * x;
    float p = -5.70498872745e-3f;
    p = p * z + 2.06390887954e-2f;
    p = p * z - 5.37397155531e-2f;
    p = p * z + 1.33314422036e-1f;
    p = p * z - 3.33332819422e-1f;
    float small = x + x * z * p;
    float a = fabsf(x);
    float big = 1.0f - 2.0f * recip_f(exp_f(2.0f * a) + 1.0f);
    big = copysignf(big, x);
    return a < 0.625f ? small : big;
}

/* the gated activations of rlk3/model/layers/common.py over n pairs: act 0 = SiTU-GLU (beta, linear_beta; linear_beta
 * <= 0 means no cap on the up half), act 1 = SwiGLU */
static inline void glu_row(const float *g, const float *u, float *out, i64 n, int act, float beta, float linear_beta) {
    const float inv_beta = 1.0f / beta, inv_linear = 1.0f / linear_beta; /* (vector division is slow) */
    if (act == 1) {
        SIMD for (i64 i = 0; i < n; i++) out[i] = g[i] * sigmoid_f(g[i]) * u[i];
    } else if (linear_beta > 0.0f) {
        SIMD for (i64 i = 0; i < n; i++)
            out[i] = beta * tanh_f(g[i] * inv_beta) * sigmoid_f(g[i]) * (linear_beta * tanh_f(u[i] * inv_linear));
    } else {
        SIMD for (i64 i = 0; i < n; i++) out[i] = beta * tanh_f(g[i] * inv_beta) * sigmoid_f(g[i]) * u[i];
    }
}

/* lane j of the result: the sum of v[j]'s lanes — VW horizontal sums as one transposing tree of shuffles (4 levels
 * of pairs, then a bit-reversal), a third of the work of VW separate sums and no long dependency chain */
static inline vf vsum_each(const vf *v) {
#if VW == 16
    const vi lo1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const vi hi1 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const vi lo2 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
    const vi hi2 = {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31};
    const vi lo3 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
    const vi hi3 = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
    const vi lo4 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
    const vi hi4 = {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31};
    const vi bitrev = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
    vf w[8], x[4], y[2];
    for (int i = 0; i < 8; i++) w[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], lo1) +
                                       __builtin_shuffle(v[2 * i], v[2 * i + 1], hi1);
    for (int i = 0; i < 4; i++) x[i] = __builtin_shuffle(w[2 * i], w[2 * i + 1], lo2) +
                                       __builtin_shuffle(w[2 * i], w[2 * i + 1], hi2);
    for (int i = 0; i < 2; i++) y[i] = __builtin_shuffle(x[2 * i], x[2 * i + 1], lo3) +
                                       __builtin_shuffle(x[2 * i], x[2 * i + 1], hi3);
    const vf z = __builtin_shuffle(y[0], y[1], lo4) + __builtin_shuffle(y[0], y[1], hi4);
    return __builtin_shuffle(z, bitrev);
#else
    vf out;
    for (int j = 0; j < VW; j++) out[j] = vsum(v[j]);
    return out;
#endif
}

/* the vector part of a dot product: Σ over the first n − n % VW elements, lane by lane */
static inline vf dot_lanes(const float *a, const float *b, i64 n) {
    vf acc = {0};
    for (i64 i = 0; i + VW <= n; i += VW) acc += vld(a + i) * vld(b + i);
    return acc;
}

static inline float dot(const float *a, const float *b, i64 n) {
    float s = vsum(dot_lanes(a, b, n));
    for (i64 i = n - n % VW; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline float sum_sq(const float *x, i64 n) { return dot(x, x, n); }

static inline float sum_of(const float *x, i64 n) {
    vf acc = {0};
    i64 i = 0;
    for (; i + VW <= n; i += VW) acc += vld(x + i);
    float s = vsum(acc);
    for (; i < n; i++) s += x[i];
    return s;
}

/* the largest entry (NaN entries are skipped unless all are NaN) */
static inline float max_of(const float *x, i64 n) {
    float m = -INFINITY;
    PRAGMA(omp simd reduction(max : m))
    for (i64 i = 0; i < n; i++) m = x[i] > m ? x[i] : m;
    return n && m == -INFINITY && x[0] != x[0] ? x[0] : m;
}

/* ------------------------------------------------------------------ norms and the Attention Residuals mix */

/* out[t] = w · x[t] / sqrt(mean(x[t]²) + eps)  (reference: rlk3.model.layers.common.RMSNorm) */
void rlk3_rms_norm(i64 T, i64 D, const float *x, i64 xs, const float *w, float eps, float *out, i64 os) {
    for (i64 t = 0; t < T; t++) {
        const float *xr = x + t * xs;
        float *o = out + t * os;
        float r = 1.0f / sqrtf(sum_sq(xr, D) / (float)D + eps);
        SIMD for (i64 d = 0; d < D; d++) o[d] = w[d] * (xr[d] * r);
    }
}

/* The Attention Residuals read of a sub-layer, then its pre-norm: sources src[0..n) (each [T, D], contiguous), scores
 * r_i · Σ_d v_i[d] · key_w[d] · query_w[d] with r_i = 1/sqrt(mean(v_i²) + mix_eps), softmax over i, the weighted sum,
 * then RMSNorm(norm_w, norm_eps) (norm_w NULL: no norm). n = 1 is the plain norm.
 * (reference: AttnResMixer.mix, then RMSNorm) */
#define MAX_SOURCES 64
int rlk3_mix_norm(i64 n, const float *const *src, i64 T, i64 D, const float *key_w, const float *query_w,
                  float mix_eps, const float *norm_w, float norm_eps, float *out) {
    if (n < 1 || n > MAX_SOURCES) return 1;
    float *qw = malloc(sizeof(float) * D);
    if (!qw) return 2;
    if (n > 1) {
        SIMD for (i64 d = 0; d < D; d++) qw[d] = key_w[d] * query_w[d];
    }
    float score[MAX_SOURCES];
    for (i64 t = 0; t < T; t++) {
        float *o = out + t * D;
        if (n == 1) {
            memcpy(o, src[0] + t * D, sizeof(float) * D);
        } else {
            float m = -INFINITY;
            for (i64 i = 0; i < n; i++) {
                const float *v = src[i] + t * D;
                float r = 1.0f / sqrtf(sum_sq(v, D) / (float)D + mix_eps);
                score[i] = dot(v, qw, D) * r;
                m = score[i] > m ? score[i] : m;
            }
            float total = 0.0f;
            for (i64 i = 0; i < n; i++) {
                score[i] = exp_f(score[i] - m);
                total += score[i];
            }
            const float *v0 = src[0] + t * D;
            float p0 = score[0] / total;
            SIMD for (i64 d = 0; d < D; d++) o[d] = p0 * v0[d];
            for (i64 i = 1; i < n; i++) {
                const float *v = src[i] + t * D;
                float p = score[i] / total;
                SIMD for (i64 d = 0; d < D; d++) o[d] += p * v[d];
            }
        }
        if (norm_w) {
            float r = 1.0f / sqrtf(sum_sq(o, D) / (float)D + norm_eps);
            SIMD for (i64 d = 0; d < D; d++) o[d] = norm_w[d] * (o[d] * r);
        }
    }
    free(qw);
    return 0;
}

/* ------------------------------------------------------------------ Kimi Delta Attention over the state pool */

/* N sequences of packed tokens (sequence s holds tokens cu[s] .. cu[s+1]), each continuing from the KDA state and
 * short-conv cache in pool slot slots[s], which are advanced in place. Per token, in K3's configuration:
 *   the causal depthwise conv (kernel W, weights conv_wt [W, 3HK]) over the cache and the new q|k|v inputs, SiLU;
 *   per head: q, k L2-normalised (eps 1e-6), q·scale; decay = exp(lower_bound · sigmoid(max(e^A_log · (g + dt_bias),
 *   -80))); beta = sigmoid(beta_raw); S ← S·decay (per key channel); S ← S + beta·(v − Sk) ⊗ k; o = S q;
 *   out = norm_w · o / sqrt(mean(o²) + norm_eps) · sigmoid(gate)  (the per-head gated RMSNorm).
 * proj rows (stride ps): q|k|v at column 0, beta_raw at beta_col (H), the output gate at gate_col (HK); g rows
 * (stride gs): the gate input after f_b_proj (HK). States are K-first [H, K, V] (V = K) at state_pool + slot·state_page:
 * S k and S q are then sums of rows scaled by k and q, with the value axis in vector registers, where the V-first
 * layout of FLA's kernels would need a horizontal sum per row (2.6x slower per step here). A pool is only ever
 * read by one runner, so the layouts never meet. Conv caches [W−1, 3HK] at conv_pool + slot·conv_page. out: [T, HK].
 * (reference: ModelRunner._kda, i.e. chunk_kda / fused_recurrent_kda_pool after the conv, and GatedRMSNorm) */
int rlk3_kda_recurrent(i64 N, const i64 *cu, const i64 *slots, i64 H, i64 K, i64 W, const float *proj, i64 ps,
                       i64 beta_col, i64 gate_col, const float *g, i64 gs, const float *conv_wt, float *conv_pool,
                       i64 conv_page, float *state_pool, i64 state_page, const float *A_log, const float *dt_bias,
                       float lower_bound, float scale, const float *norm_w, float norm_eps, float *out) {
    const i64 HK = H * K, C = 3 * HK;
    float *y = malloc(sizeof(float) * (C + C * (W > 1 ? W - 1 : 1) + 5 * K));
    if (!y) return 2;
    float *newcache = y + C, *qn = newcache + C * (W > 1 ? W - 1 : 1), *kn = qn + K, *decay = kn + K, *o = decay + K;
    float *sk = o + K;
    unsigned csr = ftz_begin();
    for (i64 s = 0; s < N; s++) {
        const i64 t0 = cu[s], n = cu[s + 1] - cu[s];
        if (n <= 0) continue;
        float *cache = conv_pool + slots[s] * conv_page;
        float *state = state_pool + slots[s] * state_page;
        for (i64 i = 0; i < n; i++) {
            const i64 t = t0 + i;
            /* the conv: tap j reads the input W−1−j tokens back, from this sequence's rows or its cache */
            memset(y, 0, sizeof(float) * C);
            for (i64 j = 0; j < W; j++) {
                const i64 back = W - 1 - j;
                const float *src = i >= back ? proj + (t - back) * ps : cache + (W - 1 - (back - i)) * C;
                const float *w = conv_wt + j * C;
                SIMD for (i64 c = 0; c < C; c++) y[c] += src[c] * w[c];
            }
            SIMD for (i64 c = 0; c < C; c++) y[c] = y[c] * sigmoid_f(y[c]);
            const float *grow = g + t * gs, *prow = proj + t * ps;
            float *orow = out + t * HK;
            for (i64 h = 0; h < H; h++) {
                const float *q = y + h * K, *k = y + HK + h * K, *v = y + 2 * HK + h * K;
                const float rq = scale / sqrtf(sum_sq(q, K) + 1e-6f), rk = 1.0f / sqrtf(sum_sq(k, K) + 1e-6f);
                SIMD for (i64 c = 0; c < K; c++) {
                    qn[c] = q[c] * rq;
                    kn[c] = k[c] * rk;
                }
                const float rate = exp_f(A_log[h]);
                const float *gh = grow + h * K, *bh = dt_bias + h * K;
                SIMD for (i64 c = 0; c < K; c++) {
                    float x = rate * (gh[c] + bh[c]);
                    x = x < -80.0f ? -80.0f : x;
                    decay[c] = exp_f(lower_bound * sigmoid_f(x));
                }
                const float b = sigmoid_f(prow[beta_col + h]);
                float *S = state + h * K * K; /* [K][V]: row c is key channel c */
                /* pass 1: S ← S·decay (row c by decay[c]) and sk = Sᵀk, accumulated over rows in registers */
                i64 v0 = 0;
                for (; v0 + VW <= K; v0 += VW) {
                    vf acc = {0};
                    for (i64 c = 0; c < K; c++) {
                        const vf x = vld(S + c * K + v0) * decay[c];
                        vst(S + c * K + v0, x);
                        acc += x * kn[c];
                    }
                    vst(sk + v0, acc);
                }
                for (i64 r = v0; r < K; r++) {
                    float acc = 0.0f;
                    for (i64 c = 0; c < K; c++) acc += (S[c * K + r] *= decay[c]) * kn[c];
                    sk[r] = acc;
                }
                SIMD for (i64 r = 0; r < K; r++) sk[r] = b * (v[r] - sk[r]); /* now the delta-rule correction */
                /* pass 2: S ← S + k ⊗ delta and o = Sᵀq */
                for (v0 = 0; v0 + VW <= K; v0 += VW) {
                    const vf dv = vld(sk + v0);
                    vf acc = {0};
                    for (i64 c = 0; c < K; c++) {
                        const vf x = vld(S + c * K + v0) + kn[c] * dv;
                        vst(S + c * K + v0, x);
                        acc += x * qn[c];
                    }
                    vst(o + v0, acc);
                }
                for (i64 r = v0; r < K; r++) {
                    float acc = 0.0f;
                    for (i64 c = 0; c < K; c++) acc += (S[c * K + r] += kn[c] * sk[r]) * qn[c];
                    o[r] = acc;
                }
                const float rn = 1.0f / sqrtf(sum_sq(o, K) / (float)K + norm_eps);
                const float *gate = prow + gate_col + h * K;
                float *dst = orow + h * K;
                SIMD for (i64 c = 0; c < K; c++) dst[c] = norm_w[c] * (o[c] * rn) * sigmoid_f(gate[c]);
            }
        }
        /* the new cache: the last W−1 inputs, from this sequence's rows or the old cache */
        for (i64 r = 0; r < W - 1; r++) {
            const i64 at = n - (W - 1) + r; /* index among this sequence's tokens; < 0 reaches into the old cache */
            const float *src = at >= 0 ? proj + (t0 + at) * ps : cache + (W - 1 + at) * C;
            memcpy(newcache + r * C, src, sizeof(float) * C);
        }
        memcpy(cache, newcache, sizeof(float) * C * (W - 1));
    }
    ftz_end(csr);
    free(y);
    return 0;
}

/* ------------------------------------------------------------------ MLA decode over the paged latent cache */

/* One sequence's absorbed attention: queries ql [H, L] and qr [H, R] score its S cached tokens (token s at page
 * table[s / bs], row s % bs; latent rows at latent + page·lat_page + row·lat_row, rope rows likewise), softmax(scale ·
 * scores) per head, and the weighted sum of latents → o [H, L]. scores: room for H·S floats. */
static void latent_attend(i64 H, i64 L, i64 R, const float *ql, const float *qr, const float *latent, i64 lat_page,
                          i64 lat_row, const float *rope, i64 rope_page, i64 rope_row, const i64 *table, i64 S, i64 bs,
                          float scale, float *scores, float *o) {
    const i64 Lv = L - L % VW, Rv = R - R % VW; /* the vector parts; tails are added one by one */
    i64 s0 = 0;
    for (; s0 + VW <= S; s0 += VW) { /* VW tokens at a time: their VW dot products reduced together */
        const float *lat[VW], *rp[VW];
        for (int j = 0; j < VW; j++) {
            const i64 page = table[(s0 + j) / bs], row = (s0 + j) % bs;
            lat[j] = latent + page * lat_page + row * lat_row;
            rp[j] = rope + page * rope_page + row * rope_row;
        }
        for (i64 h = 0; h < H; h++) {
            const float *qlh = ql + h * L, *qrh = qr + h * R;
            vf acc[VW];
            for (int j = 0; j < VW; j++) acc[j] = dot_lanes(qlh, lat[j], Lv) + dot_lanes(qrh, rp[j], Rv);
            vf sc = vsum_each(acc);
            for (int j = 0; j < VW; j++) {
                float tail = 0.0f;
                for (i64 l = Lv; l < L; l++) tail += qlh[l] * lat[j][l];
                for (i64 r = Rv; r < R; r++) tail += qrh[r] * rp[j][r];
                sc[j] += tail;
            }
            vst(scores + h * S + s0, sc * scale);
        }
    }
    for (i64 s = s0; s < S; s++) {
        const i64 page = table[s / bs], row = s % bs;
        const float *lat = latent + page * lat_page + row * lat_row, *rp = rope + page * rope_page + row * rope_row;
        for (i64 h = 0; h < H; h++) scores[h * S + s] = scale * (dot(ql + h * L, lat, L) + dot(qr + h * R, rp, R));
    }
    for (i64 h = 0; h < H; h++) {
        float *sc = scores + h * S;
        const float m = max_of(sc, S);
        SIMD for (i64 s = 0; s < S; s++) sc[s] = exp_f(sc[s] - m);
        const float inv = 1.0f / sum_of(sc, S);
        SIMD for (i64 s = 0; s < S; s++) sc[s] *= inv;
    }
    memset(o, 0, sizeof(float) * H * L);
    for (i64 s = 0; s < S; s++) {
        const i64 page = table[s / bs], row = s % bs;
        const float *lat = latent + page * lat_page + row * lat_row;
        for (i64 h = 0; h < H; h++) {
            const float p = scores[h * S + s];
            float *oh = o + h * L;
            SIMD for (i64 l = 0; l < L; l++) oh[l] += p * lat[l];
        }
    }
}

static i64 longest_of(const i64 *seq_lens, i64 B) {
    i64 longest = 1;
    for (i64 b = 0; b < B; b++) longest = seq_lens[b] > longest ? seq_lens[b] : longest;
    return longest;
}

/* One query per sequence, absorbed: q_lat [B, H, L] and q_rope [B, H, R] over each sequence's seq_lens[b] cached
 * tokens (its pages at tables[b·ts ...]) → the attended latent o_lat [B, H, L].
 * (reference: rlk3.model.ops.mla.paged.paged_latent_attention_torch) */
int rlk3_mla_paged_decode(i64 B, i64 H, i64 L, i64 R, const float *q_lat, const float *q_rope, const float *latent,
                          i64 lat_page, i64 lat_row, const float *rope, i64 rope_page, i64 rope_row, const i64 *tables,
                          i64 ts, const i64 *seq_lens, i64 bs, float scale, float *o_lat) {
    float *scores = malloc(sizeof(float) * H * longest_of(seq_lens, B));
    if (!scores) return 2;
    for (i64 b = 0; b < B; b++)
        latent_attend(H, L, R, q_lat + b * H * L, q_rope + b * H * R, latent, lat_page, lat_row, rope, rope_page,
                      rope_row, tables + b * ts, seq_lens[b], bs, scale, scores, o_lat + b * H * L);
    free(scores);
    return 0;
}

/* An MLA layer's attention for one decode token per sequence, from its queries to the input of o_proj: q rows
 * (stride qs) hold each head's nope | rope query (H·(Nn + R)); w_kvb [H, Nn + V, L] is kv_b_proj's weight (per head
 * W_UK's Nn rows, then W_UV's V rows). Per sequence and head: q_lat = W_UKᵀ q_nope, the latent attention above,
 * o = W_UV · o_lat, times sigmoid(gate) (gate rows at stride gs, H·V wide; NULL: no gate). out [B, H·V].
 * (reference: rlk3.model.ops.mla.paged.paged_mla_decode, then the output gate of ModelRunner._mla) */
int rlk3_mla_decode(i64 B, i64 H, i64 Nn, i64 R, i64 V, i64 L, const float *q, i64 qs, const float *w_kvb,
                    const float *latent, i64 lat_page, i64 lat_row, const float *rope, i64 rope_page, i64 rope_row,
                    const i64 *tables, i64 ts, const i64 *seq_lens, i64 bs, float scale, const float *gate, i64 gs,
                    float *out) {
    float *buf = malloc(sizeof(float) * (H * longest_of(seq_lens, B) + 2 * H * L + H * R));
    if (!buf) return 2;
    float *ql = buf, *qr = ql + H * L, *o_lat = qr + H * R, *scores = o_lat + H * L;
    for (i64 b = 0; b < B; b++) {
        const float *qb = q + b * qs;
        for (i64 h = 0; h < H; h++) { /* absorb: q_lat[h] = Σ_d q_nope[h][d] · W_UK[h][d][:] */
            const float *qn = qb + h * (Nn + R), *wk = w_kvb + h * (Nn + V) * L;
            float *dst = ql + h * L;
            memset(dst, 0, sizeof(float) * L);
            for (i64 d = 0; d < Nn; d++) {
                const float x = qn[d];
                SIMD for (i64 l = 0; l < L; l++) dst[l] += x * wk[d * L + l];
            }
            memcpy(qr + h * R, qn + Nn, sizeof(float) * R);
        }
        latent_attend(H, L, R, ql, qr, latent, lat_page, lat_row, rope, rope_page, rope_row, tables + b * ts,
                      seq_lens[b], bs, scale, scores, o_lat);
        float *ob = out + b * H * V;
        for (i64 h = 0; h < H; h++) { /* lift: o[h][v] = W_UV[h][v] · o_lat[h] */
            const float *wv = w_kvb + (h * (Nn + V) + Nn) * L;
            for (i64 v = 0; v < V; v++) ob[h * V + v] = dot(wv + v * L, o_lat + h * L, L);
        }
        if (gate) {
            const float *gb = gate + b * gs;
            SIMD for (i64 i = 0; i < H * V; i++) ob[i] *= sigmoid_f(gb[i]);
        }
    }
    free(buf);
    return 0;
}

/* ------------------------------------------------------------------ feed-forward */

/* out[j][0..O) = Σ_d x[j][d] · w[d][0..O) for the nt (<= 4) rows x[j] of a tile, w [D][O] row-major: a register
 * tile of nt rows × TV vectors, so each weight vector loaded serves every row of the tile. */
#define TV (VW == 16 ? 4 : 2)
static inline __attribute__((always_inline)) void tile_gemm(const int nt, const float *const *x, i64 D, const float *w,
                                                            i64 O, float *out) {
    i64 o = 0;
    for (; o + TV * VW <= O; o += TV * VW) {
        vf acc[4][TV];
        for (int j = 0; j < nt; j++)
            for (int q = 0; q < TV; q++) acc[j][q] = (vf){0};
        for (i64 d = 0; d < D; d++) {
            vf wv[TV];
            for (int q = 0; q < TV; q++) wv[q] = vld(w + d * O + o + q * VW);
            for (int j = 0; j < nt; j++) {
                const float xd = x[j][d];
                for (int q = 0; q < TV; q++) acc[j][q] += xd * wv[q];
            }
        }
        for (int j = 0; j < nt; j++)
            for (int q = 0; q < TV; q++) vst(out + j * O + o + q * VW, acc[j][q]);
    }
    for (; o + VW <= O; o += VW) {
        vf acc[4];
        for (int j = 0; j < nt; j++) acc[j] = (vf){0};
        for (i64 d = 0; d < D; d++) {
            const vf wv = vld(w + d * O + o);
            for (int j = 0; j < nt; j++) acc[j] += x[j][d] * wv;
        }
        for (int j = 0; j < nt; j++) vst(out + j * O + o, acc[j]);
    }
    for (; o < O; o++)
        for (int j = 0; j < nt; j++) {
            float acc = 0.0f;
            for (i64 d = 0; d < D; d++) acc += x[j][d] * w[d * O + o];
            out[j * O + o] = acc;
        }
}

static void rows_gemm(i64 n, const float *const *x, i64 D, const float *w, i64 O, float *out) {
    switch (n) { /* each case inlines tile_gemm with a constant tile height: the accumulators stay in registers */
    case 4: tile_gemm(4, x, D, w, O, out); break;
    case 3: tile_gemm(3, x, D, w, O, out); break;
    case 2: tile_gemm(2, x, D, w, O, out); break;
    default: tile_gemm(1, x, D, w, O, out); break;
    }
}


/* out[t, i] = act(y[t, gate_col + i], y[t, up_col + i]) for i < I  (reference: GLU in rlk3/model/layers/common.py) */
void rlk3_glu(i64 T, i64 I, const float *y, i64 ys, i64 gate_col, i64 up_col, int act, float beta, float linear_beta,
              float *out, i64 os) {
    for (i64 t = 0; t < T; t++) {
        const float *gt = y + t * ys + gate_col, *ut = y + t * ys + up_col;
        float *o = out + t * os;
        glu_row(gt, ut, o, I, act, beta, linear_beta);
    }
}

/* The middle of a Stable LatentMoE layer, between its two matmuls. y rows (stride ys) hold the router logits
 * (E, at column 0), the routed input at the latent width (Dl, at column E) and, when Is > 0, the shared experts'
 * gate and up halves (Is each, after it). Per token: scores = sigmoid(logits); the k experts with the largest
 * scores + bias (ties to the lower index); weights = their scores, renormalised (renorm != 0) and scaled; each
 * expert e is the gated MLP act(x W_gu[e][:I], x W_gu[e][I:]) W_d[e] (weights transposed: gu_t [E, Dl, 2I],
 * d_t [E, I, Dl]); their weighted sum, added in expert order in fp32, then RMSNorm(norm_w) (NULL: none).
 * out rows (stride os): that sum at column 0 (Dl), the shared experts' activation at column Dl (Is).
 * (reference: rlk3.engine.runner.latent_moe with K3Router and K3Experts) */
#define TILE 4 /* tokens of one expert computed together (rows_gemm's tile) */
int rlk3_latent_moe(i64 T, i64 E, i64 k, i64 Dl, i64 I, i64 Is, const float *y, i64 ys, const float *bias, int renorm,
                    float scaling, const float *gu_t, const float *d_t, int act, float beta, float linear_beta,
                    const float *norm_w, float norm_eps, float *out, i64 os) {
    if (k < 1 || k > E) return 1;
    const i64 P = T * k;
    i64 *expert_of = malloc(sizeof(i64) * (P + P + E + 1 + E));
    float *fbuf = malloc(sizeof(float) * (P + P + T * Dl + 2 * E + TILE * (2 * I + I + Dl)));
    if (!expert_of || !fbuf) {
        free(expert_of);
        free(fbuf);
        return 2;
    }
    i64 *token_sorted = expert_of + P, *start = token_sorted + P, *fill = start + E + 1;
    float *weight = fbuf, *weight_sorted = weight + P, *acc = weight_sorted + P, *score = acc + T * Dl;
    float *sel = score + E, *gu = sel + E, *a = gu + TILE * 2 * I, *ye = a + TILE * I;
    memset(acc, 0, sizeof(float) * T * Dl);
    /* routing */
    for (i64 t = 0; t < T; t++) {
        const float *logit = y + t * ys;
        SIMD for (i64 e = 0; e < E; e++) {
            score[e] = sigmoid_f(logit[e]);
            sel[e] = score[e] + bias[e];
        }
        float total = 0.0f;
        for (i64 j = 0; j < k; j++) {
            i64 best = 0;
            for (i64 e = 1; e < E; e++)
                if (sel[e] > sel[best]) best = e;
            sel[best] = -INFINITY;
            expert_of[t * k + j] = best;
            weight[t * k + j] = score[best];
            total += score[best];
        }
        for (i64 j = 0; j < k; j++) {
            float w = weight[t * k + j];
            if (renorm) w = w / (total + 1e-20f);
            weight[t * k + j] = w * scaling;
        }
    }
    /* the (token, slot) pairs grouped by expert, each group in token order: a counting sort */
    memset(start, 0, sizeof(i64) * (E + 1));
    for (i64 p = 0; p < P; p++) start[expert_of[p] + 1]++;
    for (i64 e = 0; e < E; e++) start[e + 1] += start[e];
    memcpy(fill, start, sizeof(i64) * E);
    for (i64 p = 0; p < P; p++) {
        const i64 at = fill[expert_of[p]]++;
        token_sorted[at] = p / k;
        weight_sorted[at] = weight[p];
    }
    /* the experts in expert order, so that each token's contributions are added in expert order */
    for (i64 e = 0; e < E; e++) {
        const float *wg = gu_t + e * Dl * 2 * I, *wd = d_t + e * I * Dl;
        for (i64 p0 = start[e]; p0 < start[e + 1]; p0 += TILE) {
            const i64 n = start[e + 1] - p0 < TILE ? start[e + 1] - p0 : TILE;
            const float *xs[TILE], *as[TILE];
            for (i64 j = 0; j < n; j++) xs[j] = y + token_sorted[p0 + j] * ys + E, as[j] = a + j * I;
            rows_gemm(n, xs, Dl, wg, 2 * I, gu);
            for (i64 j = 0; j < n; j++) glu_row(gu + j * 2 * I, gu + j * 2 * I + I, a + j * I, I, act, beta, linear_beta);
            rows_gemm(n, as, I, wd, Dl, ye);
            for (i64 j = 0; j < n; j++) {
                float *dst = acc + token_sorted[p0 + j] * Dl;
                const float *yj = ye + j * Dl;
                const float w = weight_sorted[p0 + j];
                SIMD for (i64 d = 0; d < Dl; d++) dst[d] += yj[d] * w;
            }
        }
    }
    for (i64 t = 0; t < T; t++) {
        const float *src = acc + t * Dl;
        float *o = out + t * os;
        if (norm_w) {
            const float r = 1.0f / sqrtf(sum_sq(src, Dl) / (float)Dl + norm_eps);
            SIMD for (i64 d = 0; d < Dl; d++) o[d] = norm_w[d] * (src[d] * r);
        } else {
            memcpy(o, src, sizeof(float) * Dl);
        }
        if (Is > 0) glu_row(y + t * ys + E + Dl, y + t * ys + E + Dl + Is, o + Dl, Is, act, beta, linear_beta);
    }
    free(expert_of);
    free(fbuf);
    return 0;
}

/* ------------------------------------------------------------------ greedy sampling */

/* Per row of logits [T, V] (stride ls): the first index of the largest value, and its log-probability under
 * softmax(row) (reference: rlk3.engine.sampling.sample_tensors for greedy rows: argmax, log_softmax). */
int rlk3_argmax_logprob(i64 T, i64 V, const float *logits, i64 ls, i64 *token, float *logprob) {
    float *e = malloc(sizeof(float) * V);
    if (!e) return 2;
    for (i64 t = 0; t < T; t++) {
        const float *x = logits + t * ls;
        const float m = max_of(x, V);
        i64 at = 0;
        while (at < V - 1 && !(x[at] == m)) at++; /* the first maximum (a NaN row: the last index, logprob NaN) */
        SIMD for (i64 v = 0; v < V; v++) e[v] = exp_f(x[v] - m);
        token[t] = at;
        logprob[t] = -logf(sum_of(e, V));
    }
    free(e);
    return 0;
}
