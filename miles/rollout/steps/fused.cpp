// A decode step or a prefill, the whole model in one call (miles/rollout/steps/fused.py).
//
// Every sequence's tokens are independent of the other sequences' (their own KV-cache slot, their
// own experts), so with many tokens the sequences are split once over the threads and each
// thread runs its own through every layer: one parallel region a call instead of a fork and join
// per operator. With few tokens a thread, the threads work on every product together, each on
// its share of the outputs in 16-column units (Team), so each weight is read once. The projections are GEMMs
// on weights transposed, (in, out), and packed in contiguous column panels of 64; a
// register-blocked kernel of up to 6 rows x 64 outputs streams a panel once per 128 rows; each
// MoE layer runs each chosen expert on the rows that chose it. A token's arithmetic never
// depends on which other tokens share its call, its row block or its thread.
//
// Plain C++ (no torch headers): it compiles in a few seconds with `-O3 -march=native -fopenmp`
// and is called through ctypes. fp32 throughout; summation orders differ from ATen's, so
// results are the general forward's to fp32 rounding (tests/test_fused_step.py).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include <omp.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

extern "C" {

struct FusedConfig {
  int64_t hidden, heads, kv_heads, head_dim, vocab, layers, max_len;
  int64_t experts, top_k, normalize, inner, threads;  // inner: the largest layer's I
  int64_t wide_below;  // tokens a thread below which the threads share each product
  int64_t every_token;  // 1: logits of every token (speculative verification); 0: of each sequence's last
  double eps;
};

// A projection's (in, out) weight packed in column panels (gemm_range): fp32 (group 0), or
// INT4 codes (group G > 0): panel p's K rows of width / 2 bytes, in each 16-column unit's 8
// bytes byte b holding column b's code + 8 in its low nibble and column b + 8's in its high
// one; scales (K / G, out) packed in fp32 panels the same way; the weight is code * scale.
struct FusedWeight {
  const void *data;
  const float *scales;
  int64_t group;
};

// Shapes below (in, out).
struct FusedLayer {
  const float *in_norm, *post_norm;  // (hidden)
  FusedWeight qkv;                   // (hidden, (H + 2KV) * D): q, k, v projections side by side
  const float *qkv_bias;             // ((H + 2KV) * D) or null
  const float *q_norm, *k_norm;      // (D) or null (Qwen3's per-head RMSNorm)
  FusedWeight o;                     // (H * D, hidden)
  const float *o_bias;               // (hidden) or null
  const float *router;               // (hidden, E) fp32; null: a dense MLP
  FusedWeight gate_up;               // MoE E x (hidden, 2I), one after another; dense (hidden, 2I): gate then up
  FusedWeight down;                  // MoE E x (I, hidden); dense (I, hidden)
  float *keys, *values;              // this layer's cache, (slots, KV, max_len, D)
  int64_t inner;                     // I: the (expert) MLP's intermediate size
  FusedWeight shared_gate_up;        // (hidden, 2Is) or null data: Qwen2-MoE's shared expert
  FusedWeight shared_down;           // (Is, hidden)
  const float *shared_gate;          // (hidden, 1) fp32: its sigmoid gate
  int64_t shared_inner;              // Is
};

}  // extern "C"

namespace {

constexpr int64_t W = 16;  // floats in a vector

#if defined(__AVX512F__)
typedef float vf __attribute__((vector_size(64)));
typedef float vfu __attribute__((vector_size(64), aligned(4)));  // unaligned access
typedef int32_t vi __attribute__((vector_size(64)));

inline vf load(const float *p) { return *reinterpret_cast<const vfu *>(p); }
inline void store(float *p, vf v) { *reinterpret_cast<vfu *>(p) = v; }
inline vf at_least(vf x, vf lo) { return x < lo ? lo : x; }
inline vf at_most(vf x, vf hi) { return x > hi ? hi : x; }
inline vi as_int(vf x) { return (vi)x; }  // vector casts reinterpret the bits
inline vf as_float(vi x) { return (vf)x; }
#else
// Without AVX-512, GCC lowers a 16-float vector type through memory (every broadcast and
// temporary on the stack). A vector of 16 is then two native vectors of 8, lane for lane the
// same arithmetic (so the same bits, and the same horizontal sums in hsum).
typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));
typedef int32_t vi8 __attribute__((vector_size(32)));
struct vf {
  v8 lo, hi;
};
struct vi {
  vi8 lo, hi;
};
inline vf load(const float *p) {
  return {*reinterpret_cast<const v8u *>(p), *reinterpret_cast<const v8u *>(p + 8)};
}
inline void store(float *p, vf v) {
  *reinterpret_cast<v8u *>(p) = v.lo;
  *reinterpret_cast<v8u *>(p + 8) = v.hi;
}
inline vf operator+(vf a, vf b) { return {a.lo + b.lo, a.hi + b.hi}; }
inline vf operator-(vf a, vf b) { return {a.lo - b.lo, a.hi - b.hi}; }
inline vf operator*(vf a, vf b) { return {a.lo * b.lo, a.hi * b.hi}; }
inline vf operator/(vf a, vf b) { return {a.lo / b.lo, a.hi / b.hi}; }
inline vf operator+(vf a, float b) { return {a.lo + b, a.hi + b}; }
inline vf operator-(vf a, float b) { return {a.lo - b, a.hi - b}; }
inline vf operator*(vf a, float b) { return {a.lo * b, a.hi * b}; }
inline vf operator+(float a, vf b) { return {a + b.lo, a + b.hi}; }
inline vf operator*(float a, vf b) { return {a * b.lo, a * b.hi}; }
inline vf operator-(vf a) { return {-a.lo, -a.hi}; }
inline vf &operator+=(vf &a, vf b) { return a = a + b; }
inline vi operator-(vi a, vi b) { return {a.lo - b.lo, a.hi - b.hi}; }
inline vi operator+(vi a, int32_t b) { return {a.lo + b, a.hi + b}; }
inline vi operator<<(vi a, int b) { return {a.lo << b, a.hi << b}; }
inline vf at_least(vf x, vf lo) { return {x.lo < lo.lo ? lo.lo : x.lo, x.hi < lo.hi ? lo.hi : x.hi}; }
inline vf at_most(vf x, vf hi) { return {x.lo > hi.lo ? hi.lo : x.lo, x.hi > hi.hi ? hi.hi : x.hi}; }
inline vi as_int(vf x) { return {(vi8)x.lo, (vi8)x.hi}; }
inline vf as_float(vi x) { return {(v8)x.lo, (v8)x.hi}; }
#endif

// The GEMM's register block in the machine's own vector width. A 16-float vector on a CPU
// without AVX-512 is lowered by GCC through memory (each broadcast and accumulator on the
// stack: ~3 GFLOP/s), so there the block uses 8-float vectors and at most one 16-column unit
// (6 rows x 2 vectors: 12 of the 16 registers). Every output is the same sum over k in the same
// order whatever the block, so the bits do not depend on it.
#if defined(__AVX512F__)
typedef float vg __attribute__((vector_size(64)));
constexpr int MAX_NV = 4;  // 6 rows x 4 vectors: 24 of the 32 registers
#else
typedef float vg __attribute__((vector_size(32)));
constexpr int MAX_NV = 1;  // 6 rows x 2 vectors: 12 of the 16 registers
#endif
constexpr int64_t MB = 6;  // rows of a register block
typedef float vgu __attribute__((vector_size(sizeof(vg)), aligned(4)));
constexpr int64_t GW = sizeof(vg) / sizeof(float), PER_UNIT = W / GW;  // floats, vectors per 16 columns

// Rows of B requested this far ahead of the FMAs: with a few rows of A the block's arithmetic
// stalls the loads of a weight streamed from memory, and the hardware prefetcher alone falls
// behind. Only the row block that streams a run from memory requests (the others read it from
// L1). For fp32 panels a short distance measured best (8 rows, 2 KB of a 64-column panel; 32
// was ~10% slower over a SmolLM2 decode step at 64 rows, and no faster at 1 or 16). An INT4
// panel's row is an eighth of the bytes, so it looks further ahead in rows (32 rows, 1 KB: at 8
// a SmolLM2 INT4 step at batch 1 took ~1.35x as long).
constexpr int64_t PREFETCH_AHEAD = 8, INT4_PREFETCH_AHEAD = 32;
// C[MR x NV*16] (+)= A[MR x K] @ B[K x NV*16] (row strides lda, ldb, ldc); `add`: onto C's
// partial sums (a later run of k: the same sum in the same order as one run over all k).
// `ahead`: `lines` cache lines from there are requested over the K steps (see panel()).
template <int MR, int NV, bool STREAM>
inline void block(int64_t K, const float *A, int64_t lda, const float *B, int64_t ldb, float *C,
                  int64_t ldc, bool add = false, const float *ahead = nullptr, int64_t lines = 0) {
  constexpr int V = NV * PER_UNIT;
  const int64_t per_step = (lines + K - 1) / K;
  vg c[MR][V];
  for (int i = 0; i < MR; i++)
    for (int j = 0; j < V; j++) c[i][j] = add ? *reinterpret_cast<const vgu *>(C + i * ldc + j * GW) : vg{};
  for (int64_t k = 0; k < K; k++) {
    vg b[V];
    if constexpr (STREAM)
      for (int j = 0; j < NV; j++) __builtin_prefetch(B + (k + PREFETCH_AHEAD) * ldb + j * W, 0, 3);
    for (int64_t l = 0; l < per_step && lines > 0; l++, lines--, ahead += W) __builtin_prefetch(ahead, 0, 3);
    for (int j = 0; j < V; j++) b[j] = *reinterpret_cast<const vgu *>(B + k * ldb + j * GW);
    for (int i = 0; i < MR; i++) {
      const float a = A[i * lda + k];
      for (int j = 0; j < V; j++) c[i][j] += a * b[j];
    }
  }
  for (int i = 0; i < MR; i++)
    for (int j = 0; j < V; j++) *reinterpret_cast<vgu *>(C + i * ldc + j * GW) = c[i][j];
}

// block() on the next min(rows, MB) rows (MB rows x MAX_NV vectors: 24 of AVX-512's 32 registers
// accumulate, so each k step's weight loads serve 6 rows' FMAs instead of 4)
template <int NV, bool STREAM>
inline void rows_block(int64_t rows, int64_t K, const float *A, int64_t lda, const float *B, int64_t ldb, float *C,
                       int64_t ldc, bool add, const float *ahead = nullptr, int64_t lines = 0) {
  switch (std::min<int64_t>(rows, MB)) {
    case 6: block<6, NV, STREAM>(K, A, lda, B, ldb, C, ldc, add, ahead, lines); break;
    case 5: block<5, NV, STREAM>(K, A, lda, B, ldb, C, ldc, add, ahead, lines); break;
    case 4: block<4, NV, STREAM>(K, A, lda, B, ldb, C, ldc, add, ahead, lines); break;
    case 3: block<3, NV, STREAM>(K, A, lda, B, ldb, C, ldc, add, ahead, lines); break;
    case 2: block<2, NV, STREAM>(K, A, lda, B, ldb, C, ldc, add, ahead, lines); break;
    case 1: block<1, NV, STREAM>(K, A, lda, B, ldb, C, ldc, add, ahead, lines); break;
    default: break;
  }
}

constexpr int64_t PANEL = 64;  // columns of a packed weight panel
// Rows of a panel that every row block works through while they are in L1 (KC x PANEL floats).
constexpr int64_t KC = 64;

// C[R x NV*16] = A[R x K] @ B[K x NV*16] (B's row stride ldb): one column panel (in strips of
// MAX_NV units), its rows in blocks of MB. With more than one row block the panel is worked in
// runs of KC of its rows: the first row block streams a run from memory, the others read it
// from L1 and meanwhile request the following run (or `next`, the first of the next panel's),
// so memory streams weights while every row block computes (one block per panel pass instead:
// memory idles while the later blocks compute, and 16 rows of a decode step cost ~1.3x 8).
template <int NV>
inline void panel(int64_t R, int64_t K, const float *A, const float *B, int64_t ldb, float *C, int64_t ldc,
                  const float *next = nullptr, int64_t next_floats = 0) {
  if constexpr (NV > MAX_NV) {
    panel<MAX_NV>(R, K, A, B, ldb, C, ldc, next, next_floats);
    panel<NV - MAX_NV>(R, K, A, B + MAX_NV * W, ldb, C + MAX_NV * W, ldc);
  } else {
    const int64_t blocks = (R + MB - 1) / MB, run = blocks > 1 ? KC : K;
    for (int64_t k0 = 0; k0 < K; k0 += run) {
      const int64_t kc = std::min(run, K - k0);
      const float *follow = k0 + kc < K ? B + (k0 + kc) * ldb : next;
      const int64_t follow_lines =
          (k0 + kc < K ? std::min(run, K - k0 - kc) * ldb : std::min(next_floats, KC * PANEL)) / W;
      const float *a = A + k0, *b = B + k0 * ldb;
      for (int64_t j = 0, r = 0; r < R; j++, r += MB) {  // row block j takes its share of the requests
        const int64_t first = j == 0 ? 0 : follow_lines * (j - 1) / (blocks - 1);
        const int64_t lines = j == 0 ? 0 : follow_lines * j / (blocks - 1) - first;
        const float *ahead = follow ? follow + first * W : nullptr;
        if (j == 0)  // the first row block streams the run from memory; the others read it from L1
          rows_block<NV, true>(R - r, kc, a + r * K, K, b, ldb, C + r * ldc, ldc, k0 > 0, ahead, lines);
        else
          rows_block<NV, false>(R - r, kc, a + r * K, K, b, ldb, C + r * ldc, ldc, k0 > 0, ahead, lines);
      }
    }
  }
}

constexpr int64_t ROW_CHUNK = 128;  // rows per pass over B: that many rows of A stay in L2
constexpr int64_t UNITS = PANEL / W;  // 16-column units of a panel

inline int64_t panels(int64_t N) { return (N + PANEL - 1) / PANEL; }
inline int64_t units(int64_t N) { return (N + W - 1) / W; }

// Units [u0, u1) of 16 columns (the last one N's final N % 16 columns) of C[R x N] = A[R x K] @ B
// (+ bias). B is the (in, out) weight packed in column panels: panel p, columns [64p, min(64p + 64,
// N)), lies contiguous as K rows of its width, so a panel is one sequential read of memory (a
// share of its units, a strided one). Each panel is read once per ROW_CHUNK rows (once for a
// decode step's rows) while the rows stream through it in blocks of MB. Splitting the threads by
// units rather than panels keeps a 576-wide product even over two (9 panels would go 5/4).
void gemm_range(int64_t R, int64_t K, int64_t N, const float *A, const float *B, const float *bias, float *C,
                int64_t u0, int64_t u1) {
  if (u0 >= u1) return;
  const int64_t p0 = u0 / UNITS, p1 = (u1 - 1) / UNITS + 1;
  for (int64_t r0 = 0; r0 < R; r0 += ROW_CHUNK) {
    const int64_t rows = std::min(ROW_CHUNK, R - r0);
    const float *a = A + r0 * K;
    float *c = C + r0 * N;
    for (int64_t p = p0; p < p1; p++) {
      const int64_t n = p * PANEL, width = std::min(PANEL, N - n), full = width / W;
      const int64_t j0 = p == p0 ? u0 % UNITS : 0, j1 = std::min(p == p1 - 1 ? u1 - p * UNITS : UNITS, units(width));
      const float *b = B + K * n + j0 * W;
      const float *next = p + 1 < p1 ? B + K * (n + width) : nullptr;
      const int64_t next_floats = next ? K * std::min(PANEL, N - n - width) : 0;
      float *cj = c + n + j0 * W;
      switch (std::min(j1, full) - j0) {
        case 4: panel<4>(rows, K, a, b, width, cj, N, next, next_floats); break;
        case 3: panel<3>(rows, K, a, b, width, cj, N, next, next_floats); break;
        case 2: panel<2>(rows, K, a, b, width, cj, N, next, next_floats); break;
        case 1: panel<1>(rows, K, a, b, width, cj, N, next, next_floats); break;
        default: break;
      }
      if (j1 > full) {  // the panel's last width % 16 outputs
        const float *bp = B + K * n;
        for (int64_t i = 0; i < rows; i++)
          for (int64_t m = full * W; m < width; m++) {
            float sum = 0.f;
            for (int64_t k = 0; k < K; k++) sum += a[i * K + k] * bp[k * width + m];
            c[i * N + n + m] = sum;
          }
      }
    }
  }
  if (bias)
    for (int64_t i = 0; i < R; i++)
      for (int64_t m = u0 * W; m < std::min(u1 * W, N); m++) C[i * N + m] += bias[m];
}

void gemm(int64_t R, int64_t K, int64_t N, const float *A, const float *B, const float *bias, float *C) {
  gemm_range(R, K, N, A, B, bias, C, 0, units(N));
}

// 16 weights of one INT4 row: (stored code - 8) * scale, the product dequantize_int4 forms
inline void dequant16(const uint8_t *bytes, const float *scale, float *out) {
#if defined(__AVX512F__)
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i *>(bytes)), low = _mm_set1_epi8(15);
  const __m128i codes = _mm_unpacklo_epi64(_mm_and_si128(b, low), _mm_and_si128(_mm_srli_epi16(b, 4), low));
  const __m512 q = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(codes)), _mm512_set1_ps(8.0f));
  _mm512_storeu_ps(out, _mm512_mul_ps(q, _mm512_loadu_ps(scale)));
#else
  for (int m = 0; m < 8; m++) {
    out[m] = (static_cast<float>(bytes[m] & 15) - 8.0f) * scale[m];
    out[m + 8] = (static_cast<float>(bytes[m] >> 4) - 8.0f) * scale[m + 8];
  }
#endif
}

// panel() on an INT4 panel's NV units: each run of KC rows dequantized into `buf` (in L1), then
// every row block through it. The fp32 weights are those dequantize_int4 gives, summed in the
// fp32 panel's order: the product is the fp32 step's on the fake-quantized weight, bit for bit.
template <int NV>
inline void panel_int4(int64_t R, int64_t K, const float *A, const uint8_t *B, int64_t ldb, const float *S,
                       int64_t lds, int64_t G, float *C, int64_t ldc, float *buf) {
  if constexpr (NV > MAX_NV) {
    panel_int4<MAX_NV>(R, K, A, B, ldb, S, lds, G, C, ldc, buf);
    panel_int4<NV - MAX_NV>(R, K, A, B + MAX_NV * W / 2, ldb, S + MAX_NV * W, lds, G, C + MAX_NV * W, ldc, buf);
  } else {
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
      const int64_t kc = std::min(KC, K - k0);
      for (int64_t k = 0; k < kc; k++) {
        const uint8_t *row = B + (k0 + k) * ldb;
        __builtin_prefetch(row + INT4_PREFETCH_AHEAD * ldb, 0, 3);
        const float *scale = S + (k0 + k) / G * lds;
        for (int j = 0; j < NV; j++) dequant16(row + j * W / 2, scale + j * W, buf + (k * NV + j) * W);
      }
      for (int64_t r = 0; r < R; r += MB)
        rows_block<NV, false>(R - r, kc, A + r * K + k0, K, buf, NV * W, C + r * ldc, ldc, k0 > 0);
    }
  }
}

// gemm_range on an INT4 weight (N a multiple of 16: every unit whole)
void gemm_range_int4(int64_t R, int64_t K, int64_t N, const float *A, const FusedWeight &B, const float *bias,
                     float *C, int64_t u0, int64_t u1) {
  if (u0 >= u1) return;
  alignas(64) static thread_local float buf[KC * PANEL];
  const uint8_t *codes = static_cast<const uint8_t *>(B.data);
  const int64_t p0 = u0 / UNITS, p1 = (u1 - 1) / UNITS + 1, groups = K / B.group;
  for (int64_t r0 = 0; r0 < R; r0 += ROW_CHUNK) {
    const int64_t rows = std::min(ROW_CHUNK, R - r0);
    for (int64_t p = p0; p < p1; p++) {
      const int64_t n = p * PANEL, width = std::min(PANEL, N - n);
      const int64_t j0 = p == p0 ? u0 % UNITS : 0, j1 = std::min(p == p1 - 1 ? u1 - p * UNITS : UNITS, width / W);
      const uint8_t *b = codes + K * n / 2 + j0 * W / 2;
      const float *s = B.scales + groups * n + j0 * W;
      float *c = C + r0 * N + n + j0 * W;
      const float *a = A + r0 * K;
      switch (j1 - j0) {
        case 4: panel_int4<4>(rows, K, a, b, width / 2, s, width, B.group, c, N, buf); break;
        case 3: panel_int4<3>(rows, K, a, b, width / 2, s, width, B.group, c, N, buf); break;
        case 2: panel_int4<2>(rows, K, a, b, width / 2, s, width, B.group, c, N, buf); break;
        case 1: panel_int4<1>(rows, K, a, b, width / 2, s, width, B.group, c, N, buf); break;
        default: break;
      }
    }
  }
  if (bias)
    for (int64_t i = 0; i < R; i++)
      for (int64_t m = u0 * W; m < std::min(u1 * W, N); m++) C[i * N + m] += bias[m];
}

void gemm_range(int64_t R, int64_t K, int64_t N, const float *A, const FusedWeight &B, const float *bias, float *C,
                int64_t u0, int64_t u1) {
  if (B.group > 0)
    gemm_range_int4(R, K, N, A, B, bias, C, u0, u1);
  else
    gemm_range(R, K, N, A, static_cast<const float *>(B.data), bias, C, u0, u1);
}

inline FusedWeight fp32(const float *B) { return {B, nullptr, 0}; }

// expert e's (K, N) weight of E stacked one after another
inline FusedWeight expert(const FusedWeight &B, int64_t e, int64_t K, int64_t N) {
  if (B.group > 0)
    return {static_cast<const uint8_t *>(B.data) + e * K * N / 2, B.scales + e * K / B.group * N, B.group};
  return fp32(static_cast<const float *>(B.data) + e * K * N);
}

// The threads working on one set of tokens: one thread alone (each thread its own rows), or all
// of them on every product, each its share of the output columns, meeting at a barrier after
// each step that the next reads (few rows: every weight is then read once, not once a thread).
struct Team {
  int64_t t, T;
  int64_t begin(int64_t n) const { return n * t / T; }
  int64_t end(int64_t n) const { return n * (t + 1) / T; }
  void sync() const {
    if (T > 1) {
#pragma omp barrier
    }
  }
  void gemm(int64_t R, int64_t K, int64_t N, const float *A, const FusedWeight &B, const float *bias, float *C) const {
    if (R > 0) gemm_range(R, K, N, A, B, bias, C, begin(units(N)), end(units(N)));
    sync();
  }
};

// e^x to about 1 ulp (Cephes' expf polynomial) over x in [-87.3, 88.7] (clamped), 16 at a time.
// n = round(x / ln 2) by the 1.5 * 2^23 trick, so the integer n is in the sum's low bits.
inline vf exp_vec(vf x) {
  const vf lo = vf{} - 87.3f, hi = vf{} + 88.7f, magic = vf{} + 12582912.0f;
  x = at_least(x, lo);
  x = at_most(x, hi);
  const vf t = x * 1.44269504088896341f + magic, n = t - magic;
  vf r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  vf p = vf{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const vi bits = ((as_int(t) - as_int(magic)) + 127) << 23;
  return p * as_float(bits);
}

// y[i] = e^(x[i] - shift), in vectors, the tail through a padded one
inline void exp_shifted(int64_t n, const float *x, float shift, float *y) {
  int64_t i = 0;
  for (; i + W <= n; i += W) store(y + i, exp_vec(load(x + i) - shift));
  if (i < n) {
    float in[W] = {}, out[W];
    std::memcpy(in, x + i, (n - i) * sizeof(float));
    store(out, exp_vec(load(in) - shift));
    std::memcpy(y + i, out, (n - i) * sizeof(float));
  }
}

// out = weight * (x * rsqrt(mean(x^2) + eps)), the model's RMSNorm order
inline void rms_norm(int64_t n, const float *x, const float *weight, double eps, float *out) {
  float sq = 0.f;
#pragma omp simd reduction(+ : sq)
  for (int64_t i = 0; i < n; i++) sq += x[i] * x[i];
  const float scale = 1.0f / std::sqrt(sq / static_cast<float>(n) + static_cast<float>(eps));
#pragma omp simd
  for (int64_t i = 0; i < n; i++) out[i] = x[i] * scale * weight[i];
}

// x (heads, D) rotated at one position: x * cos + roll(x, D/2) * signed_sin
inline void rope(int64_t heads, int64_t D, float *x, const float *cos, const float *ssin, float *tmp) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; h++) {
    float *v = x + h * D;
#pragma omp simd
    for (int64_t d = 0; d < half; d++) tmp[d] = v[d] * cos[d] + v[d + half] * ssin[d];
#pragma omp simd
    for (int64_t d = half; d < D; d++) tmp[d] = v[d] * cos[d] + v[d - half] * ssin[d];
    std::memcpy(v, tmp, D * sizeof(float));
  }
}

inline float hsum(vf v) {
  typedef float h8 __attribute__((vector_size(32)));
  typedef float v4 __attribute__((vector_size(16)));
#if defined(__AVX512F__)
  const h8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  const h8 a = v.lo + v.hi;
#endif
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// the G query heads q (G, D) that share one KV head, over its positions [0, length): out (G, D).
// The model's order: scores scaled, softmax (exp(s - max) / sum), then the weighted sum of V.
// DV = D / 16 vectors per head row (0: any D, scalar loops).
template <int DV>
void attend(int64_t G, int64_t D, int64_t length, const float *q, const float *K, const float *V, float scale,
            float *scores, float *out) {
  for (int64_t g = 0; g < G; g++) {
    float *s = scores + g * length;
    const float *qg = q + g * D;
    if constexpr (DV > 0) {
      vf qv[DV];
      for (int j = 0; j < DV; j++) qv[j] = load(qg + j * W);
      for (int64_t t = 0; t < length; t++) {
        vf acc = qv[0] * load(K + t * D);
        for (int j = 1; j < DV; j++) acc += qv[j] * load(K + t * D + j * W);
        s[t] = hsum(acc) * scale;
      }
    } else {
      for (int64_t t = 0; t < length; t++) {
        float acc = 0.f;
        for (int64_t d = 0; d < D; d++) acc += qg[d] * K[t * D + d];
        s[t] = acc * scale;
      }
    }
    float top = s[0];
#pragma omp simd reduction(max : top)
    for (int64_t t = 0; t < length; t++) top = std::max(top, s[t]);
    exp_shifted(length, s, top, s);
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t t = 0; t < length; t++) total += s[t];
#pragma omp simd
    for (int64_t t = 0; t < length; t++) s[t] /= total;
    float *o = out + g * D;
    if constexpr (DV > 0) {
      vf acc[DV] = {};
      for (int64_t t = 0; t < length; t++)
        for (int j = 0; j < DV; j++) acc[j] += s[t] * load(V + t * D + j * W);
      for (int j = 0; j < DV; j++) store(o + j * W, acc[j]);
    } else {
      std::fill(o, o + D, 0.f);
      for (int64_t t = 0; t < length; t++)
        for (int64_t d = 0; d < D; d++) o[d] += s[t] * V[t * D + d];
    }
  }
}

using Attend = decltype(&attend<0>);

Attend attend_for(int64_t D) {
  switch (D) {
    case 16: return attend<1>;
    case 32: return attend<2>;
    case 64: return attend<4>;
    case 128: return attend<8>;
    default: return attend<0>;
  }
}

// act[r, i] = silu(gate) * up for columns [i0, i1) of `rows` rows (gu: gate then up, 2 * inner wide);
// an element's arithmetic is the same whichever range it falls in (i0 a multiple of 16)
inline void swiglu(int64_t rows, int64_t inner, int64_t i0, int64_t i1, const float *gu, float *act) {
  for (int64_t r = 0; r < rows; r++) {
    const float *g = gu + r * 2 * inner, *u = g + inner;
    float *a = act + r * inner;
    int64_t i = i0;
    for (; i + W <= i1; i += W) {
      const vf gv = load(g + i);
      store(a + i, gv / (1.0f + exp_vec(-gv)) * load(u + i));
    }
    for (; i < i1; i++) a[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
  }
}

// A thread's working buffers, kept between calls (a prefill's are megabytes: allocating and
// zeroing them again each call cost a tenth of it); they only grow.
struct Scratch {
  std::vector<float> h, x, qkv, attn, proj, gu, act, gathered, scores, tmp, moe, cos, ssin;
  std::vector<float> router, weight, scale, gate;
  std::vector<int64_t> chosen, rows;
};

template <typename T>
inline std::vector<T> &grown(std::vector<T> &v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  return v;
}

// A thread's share of the batch: sequences [s0, s1), their tokens [r0, r0 + R) of the flattened batch.
struct Tokens {
  const FusedConfig &c;
  const int64_t *starts, *slots;  // sequence s holds tokens [starts[s], starts[s + 1]) and cache slot slots[s]
  int64_t s0, s1, r0, R;
  Scratch &b;
  // the residual stream and its normed copy: in a wide team each thread's own (mine(), every
  // thread norming every row, so no barrier after a norm), else the share's
  float *h, *x;
  std::vector<float> &qkv, &attn, &proj, &gu, &act, &gathered, &moe, &cos, &ssin;

  Tokens(const FusedConfig &cfg, const int64_t *starts_, const int64_t *slots_, int64_t first, int64_t last,
         Scratch &scratch)
      : c(cfg), starts(starts_), slots(slots_), s0(first), s1(last), r0(starts_[first]),
        R(starts_[last] - starts_[first]), b(scratch), h(grown(b.h, R * c.hidden).data()),
        x(grown(b.x, R * c.hidden).data()),
        qkv(grown(b.qkv, R * (c.heads + 2 * c.kv_heads) * c.head_dim)),
        attn(grown(b.attn, R * c.heads * c.head_dim)), proj(grown(b.proj, R * c.hidden)),
        gu(grown(b.gu, R * 2 * c.inner)), act(grown(b.act, R * c.inner)), gathered(grown(b.gathered, R * c.hidden)),
        moe(grown(b.moe, R * c.hidden)), cos(grown(b.cos, R * c.head_dim)), ssin(grown(b.ssin, R * c.head_dim)) {
    grown(b.router, R * std::max<int64_t>(c.experts, 1)), grown(b.weight, R * c.top_k);
    grown(b.chosen, R * c.top_k), grown(b.gate, R);
  }

  // this share seen by one thread of a wide team: the shared buffers, its own h and x
  Tokens mine(Scratch &own) const {
    Tokens view(*this);
    view.h = grown(own.h, R * c.hidden).data(), view.x = grown(own.x, R * c.hidden).data();
    return view;
  }

  // every token's keys and values written at its position of its sequence's slot, then each
  // token attends to positions [0, its own]: causal within a sequence of several tokens. Both
  // by (token, KV head) pairs: with one token a sequence a pair reads only the positions it
  // wrote itself (now or in earlier calls), so only several tokens a sequence need a barrier
  // between writing and attending. `mine`: this thread's own buffers (scores)
  void attention(const Team &team, const FusedLayer &L, const int64_t *positions, Scratch &mine) {
    const int64_t H = c.heads, KV = c.kv_heads, D = c.head_dim, G = H / KV, n = (H + 2 * KV) * D;
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    const Attend attend_d = attend_for(D);
    float *scores = grown(mine.scores, c.max_len * G).data(), *tmp = grown(mine.tmp, D).data();
    const int64_t pairs = R * KV, p0 = team.begin(pairs), p1 = team.end(pairs);
    for (int64_t s = s0, pair = p0; pair < p1; pair++) {  // this pair's q heads and k head, rotated and cached
      const int64_t row = r0 + pair / KV, j = pair % KV;
      while (starts[s + 1] <= row) s++;
      float *q = qkv.data() + (row - r0) * n + j * G * D, *k = qkv.data() + (row - r0) * n + (H + j) * D;
      const float *v = k + KV * D;
      if (L.q_norm) {
        for (int64_t hd = 0; hd < G; hd++) rms_norm(D, q + hd * D, L.q_norm, c.eps, q + hd * D);
        rms_norm(D, k, L.k_norm, c.eps, k);
      }
      const float *cs = cos.data() + (row - r0) * D, *sn = ssin.data() + (row - r0) * D;
      rope(G, D, q, cs, sn, tmp);
      rope(1, D, k, cs, sn, tmp);
      const int64_t at = ((slots[s] * KV + j) * c.max_len + positions[row]) * D;
      std::memcpy(L.keys + at, k, D * sizeof(float));
      std::memcpy(L.values + at, v, D * sizeof(float));
    }
    if (R > s1 - s0) team.sync();
    for (int64_t s = s0, pair = p0; pair < p1; pair++) {
      const int64_t row = r0 + pair / KV, j = pair % KV;
      while (starts[s + 1] <= row) s++;
      const int64_t base = (slots[s] * KV + j) * c.max_len * D;
      attend_d(G, D, positions[row] + 1, qkv.data() + (row - r0) * n + j * G * D, L.keys + base, L.values + base,
               scale, scores, attn.data() + (row - r0) * H * D + j * G * D);
    }
    team.sync();
  }

  // rows [0, R) of x through the router: chosen experts and their weights, recorded in chosen_out
  void route(const Team &team, const FusedLayer &L, int64_t *chosen_out, int64_t stride) {
    const int64_t E = c.experts, K = c.top_k;
    float *logits = b.router.data(), *weight = b.weight.data();
    int64_t *chosen = b.chosen.data();
    const int64_t i0 = team.begin(R), i1 = team.end(R);
    gemm(i1 - i0, c.hidden, E, x + i0 * c.hidden, L.router, nullptr, logits + i0 * E);
    for (int64_t i = i0; i < i1; i++) {
      float *l = logits + i * E;
      const float top = *std::max_element(l, l + E);
      float total = 0.f;
      for (int64_t e = 0; e < E; e++) total += (l[e] = std::exp(l[e] - top));
      for (int64_t e = 0; e < E; e++) l[e] /= total;
      float picked = 0.f;
      for (int64_t k = 0; k < K; k++) {  // the k-th largest probability, ties to the lower index
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++) {
          bool taken = false;
          for (int64_t j = 0; j < k; j++) taken |= chosen[i * K + j] == e;
          if (!taken && (best < 0 || l[e] > l[best])) best = e;
        }
        chosen[i * K + k] = best, weight[i * K + k] = l[best], picked += l[best];
      }
      for (int64_t k = 0; k < K; k++) {
        if (c.normalize) weight[i * K + k] /= picked;
        chosen_out[(r0 + i) * stride + k] = chosen[i * K + k];
      }
    }
    std::fill(moe.begin() + i0 * c.hidden, moe.begin() + i1 * c.hidden, 0.f);
    team.sync();
  }

  // the routed experts of each row, summed with their weights into moe, each expert on the rows
  // that chose it (`mine`: this thread's list of them)
  void experts(const Team &team, const FusedLayer &L, Scratch &mine) {
    const int64_t E = c.experts, K = c.top_k, hid = c.hidden, I = L.inner;
    const int64_t *chosen = b.chosen.data();
    const float *weight = b.weight.data();
    std::vector<int64_t> &rows = mine.rows;
    std::vector<float> &scale = mine.scale;
    for (int64_t e = 0; e < E; e++) {
      rows.clear(), scale.clear();
      for (int64_t i = 0; i < R; i++)
        for (int64_t k = 0; k < K; k++)
          if (chosen[i * K + k] == e) rows.push_back(i), scale.push_back(weight[i * K + k]);
      const int64_t n = rows.size();
      if (n == 0) continue;
      for (int64_t j = team.begin(n); j < team.end(n); j++)
        std::memcpy(gathered.data() + j * hid, x + rows[j] * hid, hid * sizeof(float));
      team.sync();
      mlp(team, n, gathered.data(), expert(L.gate_up, e, hid, 2 * I), expert(L.down, e, I, hid), I);
      for (int64_t j = team.begin(n); j < team.end(n); j++) {
        float *dst = moe.data() + rows[j] * hid;
        const float *src = proj.data() + j * hid, w = scale[j];
#pragma omp simd
        for (int64_t m = 0; m < hid; m++) dst[m] += w * src[m];
      }
      team.sync();
    }
  }

  // proj[0, n) = down(silu(gate(a)) * up(a)) for rows a[0, n): a SwiGLU MLP of inner size I.
  // With I a multiple of 16 each thread computes the gate and up columns of the same units and
  // their SwiGLU (one barrier, before down); else the rows' SwiGLU after a barrier.
  void mlp(const Team &team, int64_t n, const float *a, const FusedWeight &gate_up, const FusedWeight &down,
           int64_t I) {
    const int64_t hid = c.hidden;
    if (I % W == 0) {
      const int64_t u = I / W, u0 = team.begin(u), u1 = team.end(u);
      if (n > 0) {
        gemm_range(n, hid, 2 * I, a, gate_up, nullptr, gu.data(), u0, u1);
        gemm_range(n, hid, 2 * I, a, gate_up, nullptr, gu.data(), u + u0, u + u1);
      }
      swiglu(n, I, u0 * W, u1 * W, gu.data(), act.data());
    } else {
      const int64_t i0 = team.begin(n), i1 = team.end(n);
      team.gemm(n, hid, 2 * I, a, gate_up, nullptr, gu.data());
      swiglu(i1 - i0, I, 0, I, gu.data() + i0 * 2 * I, act.data() + i0 * I);
    }
    team.sync();
    team.gemm(n, I, hid, act.data(), down, nullptr, proj.data());
  }

  // moe += sigmoid(x . gate) * SwiGLU MLP(x), the shared expert every row goes through
  void shared_expert(const Team &team, const FusedLayer &L) {
    const int64_t hid = c.hidden, i0 = team.begin(R), i1 = team.end(R);
    float *gate = b.gate.data();
    mlp(team, R, x, L.shared_gate_up, L.shared_down, L.shared_inner);
    gemm(i1 - i0, hid, 1, x + i0 * hid, L.shared_gate, nullptr, gate + i0);
    for (int64_t i = i0; i < i1; i++) {
      const float g = 1.0f / (1.0f + std::exp(-gate[i]));
      for (int64_t m = 0; m < hid; m++) moe[i * hid + m] += g * proj[i * hid + m];
    }
    team.sync();
  }

  // each token's rotary cos and rotate-half-signed sin, as the model computes them:
  // cos(float(position) * inv_freq), the D/2 frequencies repeated
  void rotary(const Team &team, const int64_t *positions, const float *inv_freq) {
    const int64_t D = c.head_dim, half = D / 2;
    for (int64_t i = team.begin(R); i < team.end(R); i++)
      for (int64_t d = 0; d < half; d++) {
        const float angle = static_cast<float>(positions[r0 + i]) * inv_freq[d];
        const float cv = std::cos(angle), sv = std::sin(angle);
        cos[i * D + d] = cos[i * D + d + half] = cv;
        ssin[i * D + d] = -sv, ssin[i * D + d + half] = sv;
      }
  }

  // every row: h += add (unless null), then x = RMSNorm(h), into this thread's own h and x
  void residual_norm(const float *add, const float *weight) {
    const int64_t hid = c.hidden;
    for (int64_t i = 0; i < R; i++) {
      if (add)
        for (int64_t m = i * hid; m < (i + 1) * hid; m++) h[m] += add[m];
      rms_norm(hid, h + i * hid, weight, c.eps, x + i * hid);
    }
  }

  void run(const Team &team, Scratch &mine, const FusedLayer *layers, const int64_t *ids,
           const int64_t *positions, const float *inv_freq, const float *embed, const float *final_norm,
           const float *lm_head, float *logits, int64_t *routed, float *hidden) {
    const int64_t hid = c.hidden, n = (c.heads + 2 * c.kv_heads) * c.head_dim;
    rotary(team, positions, inv_freq);
    for (int64_t i = 0; i < R; i++) std::memcpy(h + i * hid, embed + ids[r0 + i] * hid, hid * sizeof(float));
    int64_t moe_index = 0, moe_layers = 0;
    for (int64_t l = 0; l < c.layers; l++) moe_layers += layers[l].router != nullptr;
    const float *pending = nullptr;  // the last sublayer's output, added to h with the next norm
    for (int64_t l = 0; l < c.layers; l++) {
      const FusedLayer &L = layers[l];
      residual_norm(pending, L.in_norm);
      team.gemm(R, hid, n, x, L.qkv, L.qkv_bias, qkv.data());
      attention(team, L, positions, mine);
      team.gemm(R, c.heads * c.head_dim, hid, attn.data(), L.o, L.o_bias, proj.data());
      residual_norm(proj.data(), L.post_norm);
      if (L.router) {
        route(team, L, routed + moe_index * c.top_k, moe_layers * c.top_k);
        moe_index++;
        experts(team, L, mine);
        if (L.shared_gate_up.data) shared_expert(team, L);
        pending = moe.data();
      } else {
        mlp(team, R, x, L.gate_up, L.down, L.inner);
        pending = proj.data();
      }
    }
    for (int64_t m = 0; m < R * hid; m++) h[m] += pending[m];
    if (c.every_token) {  // logits of every token: rows [r0, r0 + R) of the flattened batch
      for (int64_t i = 0; i < R; i++) rms_norm(hid, h + i * hid, final_norm, c.eps, x + i * hid);
      if (hidden)
        for (int64_t i = team.begin(R); i < team.end(R); i++)
          std::memcpy(hidden + (r0 + i) * hid, x + i * hid, hid * sizeof(float));
      team.gemm(R, hid, c.vocab, x, fp32(lm_head), nullptr, logits + r0 * c.vocab);
      return;
    }
    const int64_t S = s1 - s0;
    for (int64_t s = s0; s < s1; s++)  // logits of each sequence's last token
      rms_norm(hid, h + (starts[s + 1] - 1 - r0) * hid, final_norm, c.eps, x + (s - s0) * hid);
    if (hidden)
      for (int64_t s = s0 + team.begin(S); s < s0 + team.end(S); s++)
        std::memcpy(hidden + s * hid, x + (s - s0) * hid, hid * sizeof(float));
    team.gemm(S, hid, c.vocab, x, fp32(lm_head), nullptr, logits + s0 * c.vocab);
  }
};

}  // namespace

extern "C" {

// Sequences [0, S), sequence s holding tokens [starts[s], starts[s + 1]) of the flattened batch at
// cache slot slots[s]; per token: ids and positions; inv_freq: RoPE's D/2 frequencies. A decode step is S
// sequences of one token; a prefill, each prompt's tokens. Out: logits (S, vocab) of each
// sequence's last token (with cfg->every_token: (tokens, vocab), every token's), routed (tokens,
// MoE layers, top_k) (unused for a dense model), and, unless null, hidden: the final-normed hidden
// state those logits are computed from (rows as logits', hidden wide).
// With at least cfg->wide_below tokens a thread (and a sequence each), each thread takes
// consecutive sequences holding about equal numbers of tokens through the whole model alone;
// with fewer, all threads work on every product together (Team).
void miles_fused_forward(const FusedConfig *cfg, const FusedLayer *layers, int64_t S, const int64_t *starts,
                         const int64_t *slots, const int64_t *ids, const int64_t *positions, const float *inv_freq,
                         const float *embed, const float *final_norm, const float *lm_head,
                         float *logits, int64_t *routed, float *hidden) {
  const int64_t threads = std::max<int64_t>(1, cfg->threads), total = starts[S];
  const bool wide = threads > 1 && (S < threads || total < cfg->wide_below * threads);
  // a team no larger than the narrowest products' panels (hidden wide) can keep busy
  const int64_t team = std::min(threads, std::max<int64_t>(2, panels(cfg->hidden)));
  static thread_local Scratch shared_scratch;  // the calling thread's: a wide team's shared buffers
  std::optional<Tokens> all;  // a wide team's one share: every token
  if (wide) all.emplace(*cfg, starts, slots, 0, S, shared_scratch);
#pragma omp parallel num_threads(wide ? team : std::min(threads, S))
  {
    static thread_local Scratch scratch;
    const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
    if (wide) {
      all->mine(scratch).run(Team{t, T}, scratch, layers, ids, positions, inv_freq, embed, final_norm, lm_head, logits, routed, hidden);
    } else {
      // the first sequence starting at or past token total * t / T, for t and t + 1
      const int64_t first = t == 0 ? 0 : std::lower_bound(starts, starts + S, total * t / T) - starts;
      const int64_t last = t + 1 == T ? S : std::lower_bound(starts, starts + S, total * (t + 1) / T) - starts;
      if (last > first) {
        Tokens part(*cfg, starts, slots, first, last, scratch);
        part.run(Team{0, 1}, scratch, layers, ids, positions, inv_freq, embed, final_norm, lm_head, logits, routed, hidden);
      }
    }
  }
}

}  // extern "C"

// The step's building blocks, for tests and benchmarks/decode_bound.py: C = A @ B (+ bias); a
// list of such products back to back, each one's rows or panels split over the threads as the
// step splits them (the step's GEMMs alone); and the exponential.
extern "C" {

void miles_fused_gemm_list(int64_t count, const int64_t *R, const int64_t *K, const int64_t *N,
                           const int64_t *A, const int64_t *B, const int64_t *C, int64_t threads, int64_t columns) {
#pragma omp parallel num_threads(threads)
  {
    const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
    for (int64_t i = 0; i < count; i++) {
      const float *a = reinterpret_cast<const float *>(A[i]), *b = reinterpret_cast<const float *>(B[i]);
      float *c = reinterpret_cast<float *>(C[i]);
      if (columns) {  // each thread its share of the output units, all rows (as a team does)
        Team{t, T}.gemm(R[i], K[i], N[i], a, fp32(b), nullptr, c);
      } else {  // each thread its share of the rows, all panels
        const int64_t first = R[i] * t / T, rows = R[i] * (t + 1) / T - first;
        if (rows > 0) gemm(rows, K[i], N[i], a + first * K[i], b, nullptr, c + first * N[i]);
      }
    }
  }
}

void miles_fused_gemm(int64_t R, int64_t K, int64_t N, const float *A, const float *B, const float *bias,
                      float *C) {
  gemm(R, K, N, A, B, bias, C);
}

void miles_fused_exp(int64_t n, const float *x, float *y) { exp_shifted(n, x, 0.f, y); }

}  // extern "C"
