// RMSNorm and RoPE forward and backward for the training forward on CPU (miles/models/row_ops.py).
// One pass over the data each way instead of the five to eight operators (and their temporaries)
// of the composite; rows split over the threads, each row's arithmetic its own (sequential sums),
// so a row's result does not depend on the other rows or the threads.

#include <cmath>
#include <cstdint>
#include <vector>

#include <omp.h>

extern "C" {

// y = w * x * rstd, rstd = 1 / sqrt(mean(x^2) + eps), per row; rstd kept for the backward
void miles_rms_norm_forward(int64_t rows, int64_t C, const float *x, const float *w, double eps, float *y,
                            float *rstd, int64_t threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < rows; r++) {
    const float *xr = x + r * C;
    float sq = 0.f;
#pragma omp simd reduction(+ : sq)
    for (int64_t c = 0; c < C; c++) sq += xr[c] * xr[c];
    const float s = 1.0f / std::sqrt(sq / static_cast<float>(C) + static_cast<float>(eps));
    rstd[r] = s;
    float *yr = y + r * C;
#pragma omp simd
    for (int64_t c = 0; c < C; c++) yr[c] = w[c] * (xr[c] * s);
  }
}

// gx = rstd * (g*w - n * mean(g*w*n)), n = x * rstd; gw = sum over rows of g * n, in double (each
// thread sums its rows into its own partial, then the partials in thread order)
void miles_rms_norm_backward(int64_t rows, int64_t C, const float *g, const float *x, const float *w,
                             const float *rstd, float *gx, float *gw, int64_t threads) {
  std::vector<double> partial(threads * C, 0.0);
#pragma omp parallel num_threads(threads)
  {
    const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
    const int64_t r0 = rows * t / n, r1 = rows * (t + 1) / n;
    double *acc = partial.data() + t * C;
    for (int64_t r = r0; r < r1; r++) {
      const float *gr = g + r * C, *xr = x + r * C;
      const float s = rstd[r];
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t c = 0; c < C; c++) {
        const float nrm = xr[c] * s;
        acc[c] += static_cast<double>(gr[c] * nrm);
        dot += gr[c] * w[c] * nrm;
      }
      const float m = dot / static_cast<float>(C);
      if (gx != nullptr) {
        float *o = gx + r * C;
#pragma omp simd
        for (int64_t c = 0; c < C; c++) o[c] = s * (gr[c] * w[c] - xr[c] * s * m);
      }
    }
  }
  if (gw != nullptr)
    for (int64_t c = 0; c < C; c++) {
      double sum = 0.0;
      for (int64_t t = 0; t < threads; t++) sum += partial[t * C + c];
      gw[c] = static_cast<float>(sum);
    }
}

// Rotary embedding, Llama/Qwen's half-split convention, of x (B, H, T, D) by cos/sin (B, T, D):
// y[:h] = x[:h] cos[:h] - x[h:] sin[:h], y[h:] = x[h:] cos[h:] + x[:h] sin[h:] (h = D / 2).
// x and y at any strides (in elements; D contiguous): a head-major result straight from the
// projection's token-major layout. `inverse`: the transposed rotation (the backward).
void miles_rope(int64_t B, int64_t H, int64_t T, int64_t D, const float *x, int64_t xb, int64_t xh, int64_t xt,
                const float *cos, const float *sin, float *y, int64_t yb, int64_t yh, int64_t yt, int64_t inverse,
                int64_t threads) {
  const int64_t half = D / 2, s_lo = inverse ? half : 0, s_hi = inverse ? 0 : half;
  const float s = inverse ? -1.f : 1.f;
#pragma omp parallel for collapse(2) num_threads(threads) schedule(static)
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < H; h++)
      for (int64_t t = 0; t < T; t++) {
        const float *xr = x + b * xb + h * xh + t * xt, *c = cos + (b * T + t) * D, *sn = sin + (b * T + t) * D;
        float *yr = y + b * yb + h * yh + t * yt;
#pragma omp simd
        for (int64_t d = 0; d < half; d++) {
          const float lo = xr[d], hi = xr[d + half];
          yr[d] = lo * c[d] - s * (hi * sn[d + s_lo]);
          yr[d + half] = hi * c[d + half] + s * (lo * sn[d + s_hi]);
        }
      }
}

}  // extern "C"
