// Batch-invariant CPU kernels for the target engine.
//
// Every output element is computed by one fixed sequence of IEEE operations that depends only
// on the element's own inputs (its row of activations, the weights, the keys it may see), never
// on how many rows run in the same call, where a row sits among them, or how the work is split
// over threads. That is what makes a verify forward of k rows give each row the bits a one-row
// decode step gives it, by construction rather than by luck:
//
// - dot products accumulate in 16 lanes, lane l taking the products of elements l, l + 16, ...
//   in order, then fold the lanes in one fixed tree (`hsum`); register blocking over rows and
//   outputs only changes which registers hold which sums, never the sequence of operations of a
//   sum (as ggml computes each output as one dot product, whatever the batch);
// - threads split the outputs (never a reduction) between them;
// - attention visits a row's visible keys as one list, in order, with no masked entries at all,
//   so a tree node that gathers its ancestors sees the same sequence of keys as the plain step
//   that saw them as a contiguous prefix;
// - transcendental functions are our own polynomials, applied lane-wise: a value's result does
//   not depend on whether it fell in a full vector or a tail.
//
// The file is compiled on the machine that runs it (-march=native, -ffp-contract=off so the
// compiler never fuses or reorders floating-point operations on its own). The lane abstraction
// below is one 16-float vector on AVX-512, two on AVX2, plain arrays elsewhere: the same
// arithmetic in the same order on each.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
// Every CPU with AMX-BF16 has AMX-INT8 too (the screen's tiles); the path asks for both.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__) && defined(__linux__)
#define DFLASH_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

using bf16 = uint16_t;
constexpr int W = 16;  // lanes per vector, on every instruction set

inline float bf16_to_float(bf16 h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even, as torch and the AVX-512 BF16 instructions do.
inline bf16 float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<bf16>(u >> 16);
}

// --- the 16-lane vector ----------------------------------------------------------------------

#if defined(__AVX512F__)
struct V {
  __m512 v;
};
inline V vzero() { return {_mm512_setzero_ps()}; }
inline V vset(float s) { return {_mm512_set1_ps(s)}; }
inline V vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline V vloadn(const float* p, int n) { return {_mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1u), p)}; }
inline V vload(const bf16* p) {
  __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(x, 16))};
}
inline V vloadn(const bf16* p, int n) {
  __m256i h = _mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1u), p);
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
}
inline void vstore(float* p, V a) { _mm512_storeu_ps(p, a.v); }
inline void vstoren(float* p, V a, int n) { _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1u), a.v); }
inline V vfma(V a, V b, V c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline V vadd(V a, V b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V vsub(V a, V b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline V vmul(V a, V b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V vdiv(V a, V b) { return {_mm512_div_ps(a.v, b.v)}; }
inline V vmax(V a, V b) { return {_mm512_max_ps(a.v, b.v)}; }
inline V vmin(V a, V b) { return {_mm512_min_ps(a.v, b.v)}; }
inline V vfloor(V a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)}; }
inline V vpow2i(V n) {  // 2^n for integral n in [-126, 127]
  __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n.v), _mm512_set1_epi32(127)), 23);
  return {_mm512_castsi512_ps(e)};
}
inline void vlanes(V a, float* out) { _mm512_storeu_ps(out, a.v); }
#elif defined(__AVX2__) && defined(__FMA__)
struct V {
  __m256 a, b;
};
inline V vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V vset(float s) { return {_mm256_set1_ps(s), _mm256_set1_ps(s)}; }
inline V vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline V vloadn(const float* p, int n) {
  alignas(64) float t[W] = {0};
  std::memcpy(t, p, sizeof(float) * n);
  return vload(t);
}
inline V vload(const bf16* p) {
  __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  __m256i lo = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(x)), 16);
  __m256i hi = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(x, 1)), 16);
  return {_mm256_castsi256_ps(lo), _mm256_castsi256_ps(hi)};
}
inline V vloadn(const bf16* p, int n) {
  alignas(64) bf16 t[W] = {0};
  std::memcpy(t, p, sizeof(bf16) * n);
  return vload(t);
}
inline void vstore(float* p, V x) {
  _mm256_storeu_ps(p, x.a);
  _mm256_storeu_ps(p + 8, x.b);
}
inline void vstoren(float* p, V x, int n) {
  alignas(64) float t[W];
  vstore(t, x);
  std::memcpy(p, t, sizeof(float) * n);
}
inline V vfma(V x, V y, V z) { return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)}; }
inline V vadd(V x, V y) { return {_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)}; }
inline V vsub(V x, V y) { return {_mm256_sub_ps(x.a, y.a), _mm256_sub_ps(x.b, y.b)}; }
inline V vmul(V x, V y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
inline V vdiv(V x, V y) { return {_mm256_div_ps(x.a, y.a), _mm256_div_ps(x.b, y.b)}; }
inline V vmax(V x, V y) { return {_mm256_max_ps(x.a, y.a), _mm256_max_ps(x.b, y.b)}; }
inline V vmin(V x, V y) { return {_mm256_min_ps(x.a, y.a), _mm256_min_ps(x.b, y.b)}; }
inline V vfloor(V x) { return {_mm256_floor_ps(x.a), _mm256_floor_ps(x.b)}; }
inline V vpow2i(V n) {
  __m256i b = _mm256_set1_epi32(127);
  __m256i ea = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n.a), b), 23);
  __m256i eb = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n.b), b), 23);
  return {_mm256_castsi256_ps(ea), _mm256_castsi256_ps(eb)};
}
inline void vlanes(V x, float* out) { vstore(out, x); }
#else
struct V {
  float v[W];
};
inline V vzero() {
  V r;
  for (int l = 0; l < W; l++) r.v[l] = 0.0f;
  return r;
}
inline V vset(float s) {
  V r;
  for (int l = 0; l < W; l++) r.v[l] = s;
  return r;
}
inline V vload(const float* p) {
  V r;
  for (int l = 0; l < W; l++) r.v[l] = p[l];
  return r;
}
inline V vloadn(const float* p, int n) {
  V r = vzero();
  for (int l = 0; l < n; l++) r.v[l] = p[l];
  return r;
}
inline V vload(const bf16* p) {
  V r;
  for (int l = 0; l < W; l++) r.v[l] = bf16_to_float(p[l]);
  return r;
}
inline V vloadn(const bf16* p, int n) {
  V r = vzero();
  for (int l = 0; l < n; l++) r.v[l] = bf16_to_float(p[l]);
  return r;
}
inline void vstore(float* p, V a) {
  for (int l = 0; l < W; l++) p[l] = a.v[l];
}
inline void vstoren(float* p, V a, int n) {
  for (int l = 0; l < n; l++) p[l] = a.v[l];
}
#define LANEWISE(name, expr)      \
  inline V name(V a, V b) {       \
    V r;                          \
    for (int l = 0; l < W; l++) { \
      float x = a.v[l], y = b.v[l]; \
      r.v[l] = (expr);            \
    }                             \
    return r;                     \
  }
LANEWISE(vadd, x + y)
LANEWISE(vsub, x - y)
LANEWISE(vmul, x * y)
LANEWISE(vdiv, x / y)
LANEWISE(vmax, x > y ? x : y)
LANEWISE(vmin, x < y ? x : y)
#undef LANEWISE
inline V vfma(V a, V b, V c) {
  V r;
  for (int l = 0; l < W; l++) r.v[l] = std::fma(a.v[l], b.v[l], c.v[l]);
  return r;
}
inline V vfloor(V a) {
  V r;
  for (int l = 0; l < W; l++) r.v[l] = std::floor(a.v[l]);
  return r;
}
inline V vpow2i(V n) {
  V r;
  for (int l = 0; l < W; l++) {
    uint32_t e = static_cast<uint32_t>(static_cast<int32_t>(n.v[l]) + 127) << 23;
    std::memcpy(&r.v[l], &e, 4);
  }
  return r;
}
inline void vlanes(V a, float* out) { vstore(out, a); }
#endif

// The one order in which 16 lanes become a sum: t[l] += t[l + h] for h = 8, 4, 2, 1.
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
inline float hsum8(__m256 s8) {  // lanes l + 8 already added: h = 4, 2, 1
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}
#endif
#if defined(__AVX512F__)
inline float hsum(V a) {
  return hsum8(_mm256_add_ps(_mm512_castps512_ps256(a.v), _mm512_extractf32x8_ps(a.v, 1)));
}
#elif defined(__AVX2__) && defined(__FMA__)
inline float hsum(V a) { return hsum8(_mm256_add_ps(a.a, a.b)); }
#else
inline float hsum(V a) {
  alignas(64) float t[W];
  vlanes(a, t);
  for (int h = W / 2; h >= 1; h /= 2)
    for (int l = 0; l < h; l++) t[l] = t[l] + t[l + h];
  return t[0];
}
#endif

inline float hmax(V a) {
  alignas(64) float t[W];
  vlanes(a, t);
  float m = t[0];
  for (int l = 1; l < W; l++) m = t[l] > m ? t[l] : m;
  return m;
}

// exp by Cephes' expf polynomial (about 1 ulp): x = n ln2 + r, |r| <= ln2 / 2.
inline V vexp(V x) {
  x = vmin(vmax(x, vset(-87.33654f)), vset(88.37626f));
  V n = vfloor(vfma(x, vset(1.44269504088896341f), vset(0.5f)));
  V r = vfma(n, vset(-0.693359375f), x);
  r = vfma(n, vset(2.12194440e-4f), r);
  V p = vset(1.9875691500e-4f);
  p = vfma(p, r, vset(1.3981999507e-3f));
  p = vfma(p, r, vset(8.3334519073e-3f));
  p = vfma(p, r, vset(4.1665795894e-2f));
  p = vfma(p, r, vset(1.6666665459e-1f));
  p = vfma(p, r, vset(5.0000001201e-1f));
  p = vfma(p, vmul(r, r), vadd(r, vset(1.0f)));
  // n = -127 would not be a normal exponent: 2^n as two halves keeps the clamp's low end exact.
  V half = vfloor(vmul(n, vset(0.5f)));
  return vmul(vmul(p, vpow2i(half)), vpow2i(vsub(n, half)));
}

// --- linear: out[m, n] = (sum_k x[m, k] w[n, k] (+ bias[n])) (+ residual[m, n]) ------------------
//
// Outer-product form: a panel of 64 outputs is four vectors of accumulators per row, and each
// output's sum runs over k = 0, 1, ..., K - 1 in order (one FMA per k, or one VDPBF16PS per pair
// of k). Rows are register-blocked up to six at a time and panels split between threads; neither
// changes any output's sequence of operations, only which registers and which thread hold it.
//
// Weights are packed once (pack.py): fp32 as [N/64][K][64], bf16 as [N/64][K/2][64][2] (pairs of
// k side by side, the layout VDPBF16PS reads), N padded to 64 and K to even with zeros.

constexpr int PANEL = 64;  // outputs per panel: four vectors
constexpr int PV = PANEL / W;
constexpr int MB = 6;  // rows per register block
constexpr int64_t PREFETCH_BYTES = 32768;  // how far ahead of the weight stream to fetch

// Where the weights fetched ahead land: 0 the L1 cache, 1 the L2. Which streams faster depends on
// the CPU (on a 2-core Xeon with AMX, L2 made a one-row step 13% faster), so the Python side
// measures it once per machine (`prefetch_level`); it changes no bit, only when bytes arrive.
int prefetch_to = 0;

int64_t prefetch_level(int64_t want) {
  if (want == 0 || want == 1) prefetch_to = static_cast<int>(want);
  return prefetch_to;
}

template <typename T>
inline void prefetch(const T* p) {
#if defined(__AVX2__) || defined(__AVX512F__)
  if (prefetch_to)
    _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1);
  else
    _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
#else
  if (prefetch_to)
    __builtin_prefetch(p, 0, 2);
  else
    __builtin_prefetch(p, 0, 3);
#endif
}

inline V vbroadcast(const float* p) { return vset(*p); }

// The weight stream fetched ahead by one register block: `lines` cache lines a step of k from
// `at`, none past `end`. With several row blocks over one panel, each fetches its share of what
// comes after it, so the memory keeps streaming while the later blocks compute from the cache
// (when only the first block fetched, a seventh verify row cost a Zen 4 core what five more rows
// in the first block did).
struct Ahead {
  const char* at = nullptr;
  int lines = 4;
  const char* end = nullptr;

  inline void fetch(int64_t k) const {
    if (!at) return;
    const char* p = at + k * lines * 64;
    for (int l = 0; l < lines; l++)
      if (p + l * 64 < end) prefetch(p + l * 64);
  }
};

// One register block: rows x[0..R) against one fp32 panel [K][64]; sums into acc (R x 64).
template <int R>
void panel_f32(const float* x, int64_t ldx, const float* w, int64_t K, float* acc, const Ahead& ahead) {
  V a[R][PV];
  for (int r = 0; r < R; r++)
    for (int v = 0; v < PV; v++) a[r][v] = vzero();
  for (int64_t k = 0; k < K; k++) {
    const float* wk = w + k * PANEL;
    ahead.fetch(k);
    V wv[PV];
    for (int v = 0; v < PV; v++) wv[v] = vload(wk + v * W);
    for (int r = 0; r < R; r++) {
      V xv = vbroadcast(x + r * ldx + k);
      for (int v = 0; v < PV; v++) a[r][v] = vfma(xv, wv[v], a[r][v]);
    }
  }
  for (int r = 0; r < R; r++)
    for (int v = 0; v < PV; v++) vstore(acc + r * PANEL + v * W, a[r][v]);
}

// The same over a bf16 panel [K/2][64][2], activations already rounded to bf16 (as pairs).
template <int R>
void panel_bf16(const uint32_t* xpairs, int64_t ldx, const bf16* w, int64_t K2, float* acc, const Ahead& ahead) {
#if defined(__AVX512BF16__)
  __m512 a[R][PV];
  for (int r = 0; r < R; r++)
    for (int v = 0; v < PV; v++) a[r][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K2; k++) {
    const bf16* wk = w + k * PANEL * 2;
    ahead.fetch(k);
    __m512bh wv[PV];
    for (int v = 0; v < PV; v++) wv[v] = (__m512bh)_mm512_loadu_si512(wk + v * 2 * W);
    for (int r = 0; r < R; r++) {
      __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(xpairs[r * ldx + k]));
      for (int v = 0; v < PV; v++) a[r][v] = _mm512_dpbf16_ps(a[r][v], xv, wv[v]);
    }
  }
  for (int r = 0; r < R; r++)
    for (int v = 0; v < PV; v++) _mm512_storeu_ps(acc + r * PANEL + v * W, a[r][v]);
#else
  // No native bf16 dot products: the pair (k, k + 1) of each lane widened exactly, two FMAs in
  // VDPBF16PS's order, k + 1 first (k first, 1 output in 3 differed from a CPU that has it: an audit).
  V a[R][PV];
  for (int r = 0; r < R; r++)
    for (int v = 0; v < PV; v++) a[r][v] = vzero();
  for (int64_t k = 0; k < K2; k++) {
    const bf16* wk = w + k * PANEL * 2;
    ahead.fetch(k);
    V lo[PV], hi[PV];
    for (int v = 0; v < PV; v++) {
      alignas(64) float l[W], h[W];
      for (int c = 0; c < W; c++) {
        l[c] = bf16_to_float(wk[(v * W + c) * 2]);
        h[c] = bf16_to_float(wk[(v * W + c) * 2 + 1]);
      }
      lo[v] = vload(l), hi[v] = vload(h);
    }
    for (int r = 0; r < R; r++) {
      const uint32_t pair = xpairs[r * ldx + k];
      V x0 = vset(bf16_to_float(static_cast<bf16>(pair & 0xffffu)));
      V x1 = vset(bf16_to_float(static_cast<bf16>(pair >> 16)));
      for (int v = 0; v < PV; v++) a[r][v] = vfma(x0, lo[v], vfma(x1, hi[v], a[r][v]));
    }
  }
  for (int r = 0; r < R; r++)
    for (int v = 0; v < PV; v++) vstore(acc + r * PANEL + v * W, a[r][v]);
#endif
}

// A row of activations rounded to bf16 (round to nearest even), in order: as uint32 words, the pairs
// (k, k + 1) the bf16 panels read. One conversion for every row, whatever its length.
inline void round_row_bf16(const float* x, int64_t K, bf16* out) {
#if defined(__AVX512BF16__)
  for (int64_t k = 0; k < K; k += W) {
    const int n = static_cast<int>(std::min<int64_t>(W, K - k));
    const __mmask16 mask = (__mmask16)((1u << n) - 1u);
    const __m256bh h = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, x + k));
    _mm256_mask_storeu_epi16(out + k, mask, (__m256i)h);
  }
#else
  for (int64_t k = 0; k < K; k++) out[k] = float_to_bf16(x[k]);
#endif
}

// --- the same bf16 sums on AMX tiles ----------------------------------------------------------------
//
// On a CPU with AMX-BF16 one TDPBF16PS multiplies up to 16 rows by a block of 16 pairs of k x 16
// outputs, the work of 256 VDPBF16PS, in about the time one row's share of them takes: a verify of 9
// or 16 rows then streams the weights once for about the price of one row. The packed bf16 panel is
// already the layout a B tile reads (pairs of k side by side), and the activation pairs are an A
// tile's rows. Each output element is computed from its own row and column alone, 16 pairs of k per
// instruction in order of k, so a row's bits do not depend on the other rows of its tile or on how
// many there are (tests/test_engine.py: widths 1 to 37). The instruction rounds in its own way (its
// results differ from VDPBF16PS's in the last bits), so every bf16 matmul of a process takes one
// path or the other, chosen once (`linear_path`, measured per machine by the Python side): a verify
// row and a plain step's row are then the same bits on either path.

#if defined(DFLASH_AMX)
constexpr int TILE_ROWS = 16;  // rows of an A or C tile
constexpr int TILE_PAIRS = 16;  // pairs of k per A tile row and per B tile

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Up to 16 rows: tiles 0-3 accumulate the panel's four groups of 16 outputs, tile 4 holds the rows'
// activations, tiles 5-7 take turns holding weights (`panel_amx`). 17 to 32 rows: tiles 0-1 and
// 2-3 accumulate two groups of outputs for the first 16 rows and for the rest, tiles 4-5 hold those
// two row tiles, 6-7 the weights (`panel_amx2`), so the weights stream once for all of them.
inline void configure_tiles(int rows) {
  TileConfig c;
  const int first = std::min(rows, TILE_ROWS), rest = rows - first;
  for (int t = 0; t < 8; t++) {
    c.colsb[t] = 64;
    if (rows <= TILE_ROWS)
      c.rows[t] = static_cast<uint8_t>(t < 5 ? rows : TILE_PAIRS);
    else
      c.rows[t] = static_cast<uint8_t>(t == 0 || t == 1 || t == 4 ? first : t < 6 ? rest : TILE_PAIRS);
  }
  _tile_loadconfig(&c);
}

inline void prefetch_chunk(const char* ahead, int64_t k, const char* end) {
  const char* p = ahead + k * PANEL * 2 * sizeof(bf16);  // the weights of 16 pairs of k: 4 KB
  for (int line = 0; line < TILE_PAIRS * PANEL * 2 * 2 && p + line < end; line += 64) prefetch(p + line);
}

// A tile product: bf16 pairs into fp32 (TDPBF16PS) or, for the screen, unsigned by signed byte quads
// into exact int32 (TDPBUSD, VPDPBUSD's sums). Both read a panel as 256 bytes a step of k (64 outputs
// x a pair of bf16 or a quad of int8) and a row as 4 bytes a step, so one loop serves both.
#define DFLASH_TILE_DOT(I8, c, a, b) \
  do {                               \
    if constexpr (I8)                \
      _tile_dpbusd(c, a, b);         \
    else                             \
      _tile_dpbf16ps(c, a, b);       \
  } while (0)

// Rows x[0..rows) (as configured; 4-byte steps of k, ldx apart) against one panel of K steps (bf16
// [K][64][2] or int8 [K][64][4]); sums into acc (rows x 64, fp32 or int32).
template <bool I8 = false>
inline void panel_amx(const uint32_t* x, int64_t ldx, const void* w, int64_t K, void* acc, const char* ahead,
                      const char* end) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  constexpr int64_t step = PANEL * 4;  // bytes from one step of k to the next
  for (int64_t k = 0; k < K; k += TILE_PAIRS) {
    const char* wk = static_cast<const char*>(w) + k * step;
    if (ahead) prefetch_chunk(ahead, k, end);
    _tile_loadd(4, x + k, ldx * sizeof(uint32_t));
    _tile_loadd(5, wk, step);
    DFLASH_TILE_DOT(I8, 0, 4, 5);
    _tile_loadd(6, wk + 64, step);
    DFLASH_TILE_DOT(I8, 1, 4, 6);
    _tile_loadd(7, wk + 128, step);
    DFLASH_TILE_DOT(I8, 2, 4, 7);
    _tile_loadd(5, wk + 192, step);
    DFLASH_TILE_DOT(I8, 3, 4, 5);
  }
  char* out = static_cast<char*>(acc);
  _tile_stored(0, out, step);
  _tile_stored(1, out + 64, step);
  _tile_stored(2, out + 128, step);
  _tile_stored(3, out + 192, step);
}

// Rows x[0..rows), 17 to 32 (as configured), against one panel; sums into acc (rows x 64). Half the
// panel's outputs at a time, each weight tile used by both row tiles.
template <bool I8 = false>
inline void panel_amx2(const uint32_t* x, int64_t ldx, const void* w, int64_t K, void* acc, const char* ahead,
                       const char* end) {
  constexpr int64_t step = PANEL * 4;
  const int64_t lda = ldx * sizeof(uint32_t);
  for (int half = 0; half < 2; half++) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k = 0; k < K; k += TILE_PAIRS) {
      const char* wk = static_cast<const char*>(w) + k * step + half * 128;
      if (ahead && half == 0) prefetch_chunk(ahead, k, end);
      _tile_loadd(4, x + k, lda);
      _tile_loadd(5, x + TILE_ROWS * ldx + k, lda);
      _tile_loadd(6, wk, step);
      _tile_loadd(7, wk + 64, step);
      DFLASH_TILE_DOT(I8, 0, 4, 6);
      DFLASH_TILE_DOT(I8, 1, 4, 7);
      DFLASH_TILE_DOT(I8, 2, 5, 6);
      DFLASH_TILE_DOT(I8, 3, 5, 7);
    }
    char* out = static_cast<char*>(acc) + half * 128;
    _tile_stored(0, out, step);
    _tile_stored(1, out + 64, step);
    _tile_stored(2, out + TILE_ROWS * step, step);
    _tile_stored(3, out + TILE_ROWS * step + 64, step);
  }
}

// Every panel of a weight stream against rows x [M] (4-byte steps of k, K of them a row): the rows in
// tiles of up to 32, each panel's sums (acc, rows x 64, fp32 or int32) handed to done(acc, m, rows, p).
// The panels are split over threads; each configures its tiles as the row count changes.
template <bool I8, typename Acc, typename Done>
void amx_panels(const uint32_t* x, int64_t M, int64_t K, const char* wbase, int64_t panels, int64_t panel_bytes,
                Done&& done) {
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    const char* end = wbase + p1 * panel_bytes;
    alignas(64) Acc acc[2 * TILE_ROWS * PANEL];
    int configured = 0;
    for (int64_t p = p0; p < p1; p++) {
      const char* panel = wbase + p * panel_bytes;
      for (int64_t m = 0; m < M; m += 2 * TILE_ROWS) {
        const int rows = static_cast<int>(std::min<int64_t>(2 * TILE_ROWS, M - m));
        if (rows != configured) configure_tiles(rows), configured = rows;
        const char* ahead = m == 0 ? panel + PREFETCH_BYTES : nullptr;
        if (rows <= TILE_ROWS)
          panel_amx<I8>(x + m * K, K, panel, K, acc, ahead, end);
        else
          panel_amx2<I8>(x + m * K, K, panel, K, acc, ahead, end);
        done(acc, m, rows, p);
      }
    }
    _tile_release();
  });
}

// Linux hands out AMX state only to a process that asks for it (arch_prctl ARCH_REQ_XCOMP_PERM).
bool amx_granted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return granted;
}
#else
bool amx_granted() { return false; }
#endif

// 0: AVX-512 (or its fallback) for every bf16 matmul; 1: AMX tiles where the reduction is whole tiles.
int bf16_path = -1;  // not chosen yet

int64_t linear_path(int64_t want) {
  if (want >= 0) bf16_path = want == 1 && amx_granted() ? 1 : 0;
  if (bf16_path < 0) bf16_path = amx_granted() ? 1 : 0;
  return bf16_path;
}

// 0: VNNI for the screen's int8 sums; 1: AMX tiles (TDPBUSD) where a row's quads are whole tiles. Both
// give the same exact int32 sums, so the choice is speed alone (`Engine._screen_rows` measures it).
int i8_path = -1;  // not chosen yet

int64_t screen_path(int64_t want) {
  if (want >= 0) i8_path = want == 1 && amx_granted() ? 1 : 0;
  if (i8_path < 0) i8_path = amx_granted() ? 1 : 0;
  return i8_path;
}

template <typename Block>
void dispatch_rows(int rows, Block&& block) {
  switch (rows) {
    case 6: block(std::integral_constant<int, 6>{}); break;
    case 5: block(std::integral_constant<int, 5>{}); break;
    case 4: block(std::integral_constant<int, 4>{}); break;
    case 3: block(std::integral_constant<int, 3>{}); break;
    case 2: block(std::integral_constant<int, 2>{}); break;
    default: block(std::integral_constant<int, 1>{}); break;
  }
}

void check(bool ok, const char* what) { TORCH_CHECK(ok, "dflash kernels: ", what); }

// Sums of one row block (acc, rows x PANEL) plus bias, then plus residual, into out's rows m.. and
// columns n0..n0 + cols: the same two additions after either path's sums.
inline void finish_rows(const float* acc, int rows, int64_t cols, const float* b, const float* res, int64_t ldr,
                        float* o, int64_t ldo, int64_t m, int64_t n0) {
  for (int r = 0; r < rows; r++)
    for (int64_t c = 0; c < cols; c++) {
      float s = acc[r * PANEL + c];
      if (b) s = s + b[n0 + c];
      if (res) s = res[(m + r) * ldr + n0 + c] + s;
      o[(m + r) * ldo + n0 + c] = s;
    }
}

// x [M, K] fp32; w packed (see above) for N outputs; out [M, N] fp32 (may be `residual`).
void linear(const at::Tensor& x, const at::Tensor& w, int64_t N, const c10::optional<at::Tensor>& bias,
            const c10::optional<at::Tensor>& residual, at::Tensor& out) {
  check(x.dim() == 2 && out.dim() == 2, "linear: 2-D activations");
  check(x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat, "linear: fp32 activations");
  check(x.stride(1) == 1 && w.is_contiguous() && out.stride(1) == 1, "linear: row-major");
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t panels = (N + PANEL - 1) / PANEL;
  const bool half = w.scalar_type() == at::kBFloat16;
  check(half || w.scalar_type() == at::kFloat, "linear: fp32 or bf16 weights");
  const int64_t kw = half ? (K + 1) / 2 * 2 : K;  // the packed reduction length
  check(w.numel() == panels * PANEL * kw, "linear: packed weights of another shape");
  check(out.size(0) == M && out.size(1) == N, "linear: output shape");
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
  const float* res = residual ? residual->data_ptr<float>() : nullptr;
  const int64_t ldr = residual ? residual->stride(0) : 0;
  if (residual) check(residual->stride(1) == 1 && residual->size(0) == M && residual->size(1) == N, "linear: residual");
  float* o = out.data_ptr<float>();
  const int64_t ldo = out.stride(0);
  const float* xs = x.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  // bf16: activations rounded once per call and stored as pairs (k, k + 1), zero past K.
  const int64_t k2 = kw / 2;
  std::vector<uint32_t> xpairs;
  if (half) {
    xpairs.assign(M * k2, 0u);
    for (int64_t m = 0; m < M; m++) round_row_bf16(xs + m * ldx, K, reinterpret_cast<bf16*>(&xpairs[m * k2]));
  }
  const int64_t panel_bytes = PANEL * kw * (half ? 2 : 4);
  const char* wbase = reinterpret_cast<const char*>(w.data_ptr());
#if defined(DFLASH_AMX)
  if (half && k2 % TILE_PAIRS == 0 && linear_path(-1) == 1) {
    amx_panels<false, float>(xpairs.data(), M, k2, wbase, panels, panel_bytes,
                             [&](const float* acc, int64_t m, int rows, int64_t p) {
                               const int64_t n0 = p * PANEL, cols = std::min<int64_t>(PANEL, N - n0);
                               finish_rows(acc, rows, cols, b, res, ldr, o, ldo, m, n0);
                             });
    return;
  }
#endif
  // Each block fetches ceil(4 / blocks) lines a step of k: one panel ahead in all for 1, 2 or 4 blocks, somewhat
  // more for others (a prefill's many blocks run further ahead, harmlessly). No rows: one block, nothing fetched.
  const int64_t blocks = std::max<int64_t>(1, (M + MB - 1) / MB);
  const int lines = static_cast<int>((4 + blocks - 1) / blocks);
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    const char* end = wbase + p1 * panel_bytes;
    alignas(64) float acc[MB * PANEL];
    for (int64_t p = p0; p < p1; p++) {
      const char* panel = wbase + p * panel_bytes;
      const int64_t n0 = p * PANEL, cols = std::min<int64_t>(PANEL, N - n0);
      for (int64_t m = 0; m < M; m += MB) {
        const int rows = static_cast<int>(std::min<int64_t>(MB, M - m));
        // Block m / MB fetches its share of the stream ahead, after the shares of the blocks before it.
        const int64_t block = m / MB;
        const Ahead ahead{panel + PREFETCH_BYTES + block * (half ? k2 : K) * lines * 64, lines, end};
        dispatch_rows(rows, [&](auto R) {
          if (half)
            panel_bf16<R.value>(xpairs.data() + m * k2, k2, reinterpret_cast<const bf16*>(panel), k2, acc, ahead);
          else
            panel_f32<R.value>(xs + m * ldx, ldx, reinterpret_cast<const float*>(panel), K, acc, ahead);
        });
        finish_rows(acc, rows, cols, b, res, ldr, o, ldo, m, n0);
      }
    }
  });
}

// --- RMSNorm: out = w * (x / sqrt(mean(x^2) + eps)), per row of H --------------------------------

// One row; `out` may be `x`. Gemma-style norms scale by (1 + w).
inline void rms_row(const float* x, const float* w, int64_t H, float eps, bool plus_one, float* out) {
  V acc = vzero();
  int64_t k = 0;
  for (; k + W <= H; k += W) {
    V v = vload(x + k);
    acc = vfma(v, v, acc);
  }
  if (k < H) {
    V v = vloadn(x + k, static_cast<int>(H - k));
    acc = vfma(v, v, acc);
  }
  const float inv = 1.0f / std::sqrt(hsum(acc) / static_cast<float>(H) + eps);
  for (int64_t j = 0; j < H; j++) {
    const float g = plus_one ? 1.0f + w[j] : w[j];
    out[j] = g * (x[j] * inv);
  }
}

void rmsnorm(const at::Tensor& x, const at::Tensor& weight, double eps, bool plus_one, at::Tensor& out) {
  check(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "rmsnorm: fp32");
  check(x.is_contiguous() && out.is_contiguous() && weight.is_contiguous(), "rmsnorm: contiguous");
  const int64_t H = weight.numel(), R = x.numel() / H;
  check(x.numel() == R * H && out.numel() == x.numel(), "rmsnorm: shapes");
  const float* xs = x.data_ptr<float>();
  const float* ws = weight.data_ptr<float>();
  float* os = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, R, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) rms_row(xs + r * H, ws, H, e, plus_one, os + r * H);
  });
}

// --- argmax per row: torch.argmax's answer, the first maximum (the first NaN where a row has one) ---

// Two passes over a row that stays in L1/L2: the maximum (and whether any lane is NaN), then the
// first position equal to it. -0.0 == 0.0, so the first of either wins, as in torch.
inline int64_t argmax_row(const float* x, int64_t n) {
  int64_t k = 0;
  float m = -std::numeric_limits<float>::infinity();
  bool nan = false;
#if defined(__AVX512F__)
  __m512 best = _mm512_set1_ps(m);
  __mmask16 unordered = 0;
  for (; k + W <= n; k += W) {
    const __m512 v = _mm512_loadu_ps(x + k);
    unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    best = _mm512_max_ps(best, v);
  }
  m = _mm512_reduce_max_ps(best);
  nan = unordered != 0;
#endif
  for (; k < n; k++) {
    if (std::isnan(x[k])) nan = true;
    else if (x[k] > m) m = x[k];
  }
  k = 0;
  if (nan) {
    for (; k < n; k++)
      if (std::isnan(x[k])) return k;
  }
#if defined(__AVX512F__)
  const __m512 target = _mm512_set1_ps(m);
  for (; k + W <= n; k += W) {
    const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + k), target, _CMP_EQ_OQ);
    if (eq) return k + __builtin_ctz(eq);
  }
#endif
  for (; k < n; k++)
    if (x[k] == m) return k;
  return 0;  // only a row of NaN-free values below -inf could get here: there are none
}

void argmax(const at::Tensor& x, at::Tensor& out) {
  check(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "argmax: fp32 rows");
  check(x.size(1) > 0, "argmax: empty rows");
  check(out.scalar_type() == at::kLong && out.is_contiguous() && out.numel() == x.size(0), "argmax: int64 out");
  const float* xs = x.data_ptr<float>();
  const int64_t ld = x.stride(0), n = x.size(1);
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, x.size(0), 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) o[r] = argmax_row(xs + r * ld, n);
  });
}

// --- the LM head's greedy screen ----------------------------------------------------------------------
//
// Greedy decoding needs each row's argmax alone, and the LM head is a fifth of a plain step's weight
// stream (SmolLM2: 57 of 270 MB in bf16). The screen reads the head once more as int8, a scale per
// token (half the bytes of bf16, a quarter of fp32), against the row as two int8 parts. VNNI's
// integer dot products are exact, so every token's logit is known to within a bound the caller proves
// (dflash_kernels.pack_screen says how). A token can hold the row's largest logit only if its upper
// bound reaches the row's best lower bound; only those tokens' logits are then computed, by `linear`
// over their own columns, each by the same operations as in the whole head: the argmax is the whole
// head's, bit for bit, ties to the first as there.
//
// Int8 weights are packed [N/64][K/4][64][4] (four k side by side, the layout VPDPBUSD reads, and
// AMX's TDPBUSD as B tiles: a CPU with AMX sums up to 16 rows' parts per tile, `screen_path`); a row
// goes in as unsigned bytes q + 128, undone by each token's sum of its q (`colsum`).

#if defined(__AVX512VNNI__)
// The lanes of a vector that hold the first n of what is left (all 16 where n >= 16).
inline __mmask16 first_lanes(int64_t n) { return (__mmask16)(n >= W ? 0xffffu : (1u << n) - 1u); }

// One register block: quantized rows xq[0..R) (as quads) against one int8 panel; exact int32 sums.
template <int R>
void panel_i8(const uint32_t* xq, int64_t ldx, const int8_t* w, int64_t K4, int32_t* acc, const Ahead& ahead) {
  __m512i a[R][PV];
  for (int r = 0; r < R; r++)
    for (int v = 0; v < PV; v++) a[r][v] = _mm512_setzero_si512();
  for (int64_t k = 0; k < K4; k++) {
    const int8_t* wk = w + k * PANEL * 4;
    ahead.fetch(k);
    __m512i wv[PV];
    for (int v = 0; v < PV; v++) wv[v] = _mm512_loadu_si512(wk + v * 4 * W);
    for (int r = 0; r < R; r++) {
      const __m512i xv = _mm512_set1_epi32(static_cast<int>(xq[r * ldx + k]));
      for (int v = 0; v < PV; v++) a[r][v] = _mm512_dpbusd_epi32(a[r][v], xv, wv[v]);
    }
  }
  for (int r = 0; r < R; r++)
    for (int v = 0; v < PV; v++) _mm512_storeu_si512(acc + r * PANEL + v * W, a[r][v]);
}
#endif

bool screen_available() {
#if defined(__AVX512VNNI__)
  return true;
#else
  return false;
#endif
}

// Rounded up a little, so a float made from a double never falls below it.
inline float above(double x) { return static_cast<float>(x * (1.0 + 0x1p-20)); }

// A row as the matmul sees it (rounded to bf16 where the weights are bf16) as two int8 parts: the row at
// scale t1, then what that leaves at scale t2 (one part leaves an error set by the row's largest entry,
// and final hidden states have a few channels far larger than the rest). Quads of bytes q + 128, zero
// (128) past K; the norms the bound needs: of the row, and of what the two parts leave. False where
// the row is not finite or so large its logits could overflow.
struct RowParts {
  float t1 = 0, t2 = 0, norm = 0, rest = 0;
};

bool split_row(const float* x, int64_t K, bool round_bf16, int64_t K4, uint8_t* q1, uint8_t* q2, RowParts& out) {
  std::vector<double> h(K);
  if (round_bf16) {
    std::vector<bf16> b(K);
    round_row_bf16(x, K, b.data());
    for (int64_t k = 0; k < K; k++) h[k] = bf16_to_float(b[k]);
  } else {
    for (int64_t k = 0; k < K; k++) h[k] = x[k];
  }
  double norm2 = 0;
  for (int64_t k = 0; k < K; k++) {
    if (!std::isfinite(h[k])) return false;
    norm2 += h[k] * h[k];
  }
  if (!(norm2 < 1e30)) return false;
  // Part by part: the scale from what is left, any integer in [-127, 127] (what it leaves is computed
  // from the one chosen, exactly in double: a float times a small integer, then a close difference).
  auto part = [&](uint8_t* q) {
    double top = 0;
    for (int64_t k = 0; k < K; k++) top = std::max(top, std::fabs(h[k]));
    const float t = static_cast<float>(top / 127.0);
    const double inv = t > 0 ? 1.0 / t : 0.0;
    std::memset(q, 128, K4 * 4);
    for (int64_t k = 0; k < K; k++) {
      const int v = static_cast<int>(std::clamp(std::nearbyint(h[k] * inv), -127.0, 127.0));
      q[k] = static_cast<uint8_t>(v + 128);
      h[k] -= static_cast<double>(t) * v;
    }
    return t;
  };
  const float t1 = part(q1), t2 = part(q2);
  double rest2 = 0;
  for (int64_t k = 0; k < K; k++) rest2 += h[k] * h[k];
  out = {t1, t2, above(std::sqrt(norm2)), above(std::sqrt(rest2))};
  return true;
}

// Bounds of every token's logit for rows x [M, K]: hi [M, Np] (upper bounds) and each row's best lower
// bound (floor [M]). w8 the int8 panels for N tokens; coef [3, Np]: each token's scale s and its
// bound's factors a (of the row's norm) and b (of what the row's int8 form leaves); colsum [Np].
bool screen_bounds(const at::Tensor& x, bool round_bf16, const at::Tensor& w8, int64_t N, const at::Tensor& coef,
                   const at::Tensor& colsum, std::vector<float>& hi, std::vector<float>& floor) {
#if !defined(__AVX512VNNI__)
  check(false, "the screen needs AVX512-VNNI (screen_available)");
  return false;
#else
  const int64_t M = x.size(0), K = x.size(1), K4 = (K + 3) / 4;
  const int64_t panels = (N + PANEL - 1) / PANEL, Np = panels * PANEL;
  check(w8.scalar_type() == at::kChar && w8.is_contiguous(), "screen: int8 panels");
  check(w8.numel() == panels * PANEL * K4 * 4, "screen: packed weights of another shape");
  check(coef.scalar_type() == at::kFloat && coef.is_contiguous() && coef.numel() == 3 * Np, "screen: coef");
  check(colsum.scalar_type() == at::kInt && colsum.is_contiguous() && colsum.numel() == Np, "screen: colsum");
  // Two quantized rows per row: its first part at row 2m, the second at 2m + 1.
  const int64_t Q = 2 * M;
  std::vector<uint32_t> xq(Q * K4);
  std::vector<RowParts> parts(M);
  for (int64_t m = 0; m < M; m++) {
    auto* q1 = reinterpret_cast<uint8_t*>(&xq[2 * m * K4]);
    if (!split_row(x.data_ptr<float>() + m * x.stride(0), K, round_bf16, K4, q1, q1 + K4 * 4, parts[m])) return false;
  }
  const float *s = coef.data_ptr<float>(), *a = s + Np, *b = a + Np;
  const int32_t* cs = colsum.data_ptr<int32_t>();
  hi.assign(M * Np, 0.0f);
  std::vector<float> best(M * panels);
  const int64_t panel_bytes = PANEL * K4 * 4;
  const char* wbase = reinterpret_cast<const char*>(w8.data_ptr());
  // Quantized rows m.. (rows of them, both parts of each) summed into acc against panel p: their bounds.
  auto bound_rows = [&](const int32_t* acc, int64_t m, int rows, int64_t p) {
    const int64_t n0 = p * PANEL, cols = std::min<int64_t>(PANEL, N - n0);
    for (int r = 0; r < rows; r += 2) {
      const int64_t row = (m + r) / 2;
      const RowParts& pr = parts[row];
      __m512 low = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      for (int v = 0; v < PV && v * W < cols; v++) {
        const int64_t j = n0 + v * W;
        const __mmask16 real = first_lanes(cols - v * W);
        // Exact int32 sums (K 255 127 fits for any K below 66,000); `round` covers their conversion.
        const __m512i undo = _mm512_slli_epi32(_mm512_loadu_si512(cs + j), 7);
        const __m512i d1 = _mm512_sub_epi32(_mm512_loadu_si512(acc + r * PANEL + v * W), undo);
        const __m512i d2 = _mm512_sub_epi32(_mm512_loadu_si512(acc + (r + 1) * PANEL + v * W), undo);
        const __m512 p1 = _mm512_mul_ps(_mm512_cvtepi32_ps(d1), _mm512_set1_ps(pr.t1));
        const __m512 p2 = _mm512_mul_ps(_mm512_cvtepi32_ps(d2), _mm512_set1_ps(pr.t2));
        const __m512 sj = _mm512_loadu_ps(s + j);
        const __m512 val = _mm512_mul_ps(_mm512_add_ps(p1, p2), sj);
        // The bound, then the rounding of the conversions, the products and the sum, and of val +- bound.
        const __m512 mag = _mm512_add_ps(_mm512_mul_ps(_mm512_add_ps(_mm512_abs_ps(p1), _mm512_abs_ps(p2)), sj),
                                         _mm512_abs_ps(val));
        __m512 bound = _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(a + j), _mm512_set1_ps(pr.norm)),
                                     _mm512_mul_ps(_mm512_loadu_ps(b + j), _mm512_set1_ps(pr.rest)));
        bound = _mm512_add_ps(bound, _mm512_mul_ps(mag, _mm512_set1_ps(0x1p-19f)));
        bound = _mm512_add_ps(_mm512_mul_ps(bound, _mm512_set1_ps(1.0f + 0x1p-20f)), _mm512_set1_ps(1e-30f));
        _mm512_storeu_ps(hi.data() + row * Np + j, _mm512_add_ps(val, bound));
        low = _mm512_mask_max_ps(low, real, low, _mm512_sub_ps(val, bound));
      }
      best[row * panels + p] = _mm512_reduce_max_ps(low);
    }
  };
#if defined(DFLASH_AMX)
  if (K4 % TILE_PAIRS == 0 && screen_path(-1) == 1) {
    // A tile pair holds 32 quantized rows, an even count: both parts of each of its rows.
    amx_panels<true, int32_t>(xq.data(), Q, K4, wbase, panels, panel_bytes, bound_rows);
  } else
#endif
  {
    const int64_t blocks = std::max<int64_t>(1, (Q + MB - 1) / MB);
    const int lines = static_cast<int>((4 + blocks - 1) / blocks);
    at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
      const char* end = wbase + p1 * panel_bytes;
      alignas(64) int32_t acc[MB * PANEL];
      for (int64_t p = p0; p < p1; p++) {
        const char* panel = wbase + p * panel_bytes;
        for (int64_t m = 0; m < Q; m += MB) {  // MB is even: a block holds both parts of its rows
          const int rows = static_cast<int>(std::min<int64_t>(MB, Q - m));
          const Ahead ahead{panel + PREFETCH_BYTES + (m / MB) * K4 * lines * 64, lines, end};
          dispatch_rows(rows, [&](auto R) {
            panel_i8<R.value>(xq.data() + m * K4, K4, reinterpret_cast<const int8_t*>(panel), K4, acc, ahead);
          });
          bound_rows(acc, m, rows, p);
        }
      }
    });
  }
  floor.assign(M, -std::numeric_limits<float>::infinity());
  for (int64_t m = 0; m < M; m++)
    for (int64_t p = 0; p < panels; p++) floor[m] = std::max(floor[m], best[m * panels + p]);
  return true;
#endif
}

// The tokens of `rows` ([N, K], the head's weights as `linear`'s packed copy holds them) packed as
// weights of their own, pack.py's layout: a `linear` over them gives each the bits the whole head does.
at::Tensor pack_tokens(const at::Tensor& rows, const std::vector<int64_t>& tokens) {
  const int64_t K = rows.size(1), n = static_cast<int64_t>(tokens.size());
  const int64_t panels = (n + PANEL - 1) / PANEL;
  if (rows.scalar_type() == at::kBFloat16) {
    const int64_t K2 = (K + 1) / 2;
    at::Tensor out = at::zeros({panels, K2, PANEL, 2}, rows.options());
    const bf16* src = reinterpret_cast<const bf16*>(rows.data_ptr());
    bf16* dst = reinterpret_cast<bf16*>(out.data_ptr());
    for (int64_t i = 0; i < n; i++) {
      bf16* to = dst + (i / PANEL) * K2 * PANEL * 2 + (i % PANEL) * 2;
      const bf16* from = src + tokens[i] * K;
      for (int64_t k = 0; k < K; k++) to[(k / 2) * PANEL * 2 + k % 2] = from[k];
    }
    return out;
  }
  at::Tensor out = at::zeros({panels, K, PANEL}, rows.options());
  const float* src = rows.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  for (int64_t i = 0; i < n; i++) {
    float* to = dst + (i / PANEL) * K * PANEL + i % PANEL;
    const float* from = src + tokens[i] * K;
    for (int64_t k = 0; k < K; k++) to[k * PANEL] = from[k];
  }
  return out;
}

// Greedy choices for rows x [M, K] under the head `head` (packed, N tokens) whose rows are `rows`
// [N, K] and whose screen is (w8, coef, colsum): out [M] the argmax of each row's fp32 logits, kept [M]
// how many tokens the screen kept for it. A row that keeps more than `limit` computes the whole head.
// False (nothing written) where a row is not finite: the caller computes the whole head.
bool screen_argmax(const at::Tensor& x, const at::Tensor& head, int64_t N, const at::Tensor& rows,
                   const at::Tensor& w8, const at::Tensor& coef, const at::Tensor& colsum, int64_t limit,
                   at::Tensor& out, at::Tensor& kept) {
  check(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "screen_argmax: fp32 rows");
  check(rows.dim() == 2 && rows.is_contiguous() && rows.size(0) == N && rows.size(1) == x.size(1) &&
            rows.scalar_type() == head.scalar_type(),
        "screen_argmax: the head's rows");
  check(out.scalar_type() == at::kLong && kept.scalar_type() == at::kLong && out.numel() == x.size(0) &&
            kept.numel() == x.size(0),
        "screen_argmax: int64 out and kept");
#if !defined(__AVX512VNNI__)
  check(false, "the screen needs AVX512-VNNI (screen_available)");
  return false;
#else
  const int64_t M = x.size(0), Np = (N + PANEL - 1) / PANEL * PANEL;
  std::vector<float> hi, floor;
  if (!screen_bounds(x, rows.scalar_type() == at::kBFloat16, w8, N, coef, colsum, hi, floor)) return false;
  int64_t* o = out.data_ptr<int64_t>();
  int64_t* counts = kept.data_ptr<int64_t>();
  // Each row's kept tokens, ascending; then one `linear` over every row and the union of the tokens the
  // rows below `limit` kept: an output reads only its own row and column, so each row's logit of each of
  // its tokens is the bits a call of its own would give, for one packing and one call in all.
  std::vector<std::vector<int64_t>> tokens(M);
  std::vector<int64_t> all;
  for (int64_t m = 0; m < M; m++) {
    const float* h = hi.data() + m * Np;
    const __m512 f = _mm512_set1_ps(floor[m]);
    for (int64_t j = 0; j < N; j += W) {
      const __mmask16 any = first_lanes(N - j);
      for (unsigned bits = _mm512_mask_cmp_ps_mask(any, _mm512_loadu_ps(h + j), f, _CMP_GE_OQ); bits; bits &= bits - 1)
        tokens[m].push_back(j + __builtin_ctz(bits));
    }
    counts[m] = static_cast<int64_t>(tokens[m].size());
    if (counts[m] > limit) {  // a flat row: the whole head
      at::Tensor logits = at::empty({1, N}, x.options());
      linear(x.narrow(0, m, 1), head, N, c10::nullopt, c10::nullopt, logits);
      o[m] = argmax_row(logits.data_ptr<float>(), N);
    } else {
      all.insert(all.end(), tokens[m].begin(), tokens[m].end());
    }
  }
  if (all.empty()) return true;
  std::sort(all.begin(), all.end());
  all.erase(std::unique(all.begin(), all.end()), all.end());
  const int64_t U = static_cast<int64_t>(all.size());
  at::Tensor logits = at::empty({M, U}, x.options());
  linear(x, pack_tokens(rows, all), U, c10::nullopt, c10::nullopt, logits);
  std::vector<float> mine;
  for (int64_t m = 0; m < M; m++) {
    if (counts[m] > limit) continue;
    const float* row = logits.data_ptr<float>() + m * U;
    mine.clear();
    for (const int64_t t : tokens[m]) mine.push_back(row[std::lower_bound(all.begin(), all.end(), t) - all.begin()]);
    o[m] = tokens[m][argmax_row(mine.data(), counts[m])];  // ascending: the first of ties
  }
  return true;
#endif
}

// --- SwiGLU: out[m, i] = silu(gu[m, i]) * gu[m, I + i] ----------------------------------------------

void silu_mul(const at::Tensor& gu, at::Tensor& out) {
  check(gu.scalar_type() == at::kFloat && gu.is_contiguous() && out.is_contiguous(), "silu_mul: fp32, contiguous");
  const int64_t M = gu.size(0), I = gu.size(1) / 2;
  check(out.size(0) == M && out.size(1) == I, "silu_mul: shapes");
  const float* g = gu.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, M, 8, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; m++) {
      const float* gr = g + m * 2 * I;
      float* orow = o + m * I;
      for (int64_t i = 0; i < I; i += W) {
        int n = static_cast<int>(std::min<int64_t>(W, I - i));
        V a = vloadn(gr + i, n), u = vloadn(gr + I + i, n);
        V s = vdiv(a, vadd(vset(1.0f), vexp(vsub(vzero(), a))));
        vstoren(orow + i, vmul(s, u), n);
      }
    }
  });
}

// --- rotary embedding and the KV cache write ----------------------------------------------------------

// Rotate-half RoPE on [heads, D] rows at one position: x1' = x1 c - x2 s, x2' = x2 c + x1 s.
inline void rope_row(float* x, int64_t heads, int64_t D, const float* c, const float* s) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; h++) {
    float* v = x + h * D;
    for (int64_t i = 0; i < half; i++) {
      float a = v[i], b = v[i + half];
      v[i] = a * c[i] - b * s[i];
      v[i + half] = b * c[i + half] + a * s[i + half];
    }
  }
}

template <typename T>
inline void store_row(T* dst, const float* src, int64_t n);
template <>
inline void store_row<float>(float* dst, const float* src, int64_t n) {
  std::memcpy(dst, src, sizeof(float) * n);
}
template <>
inline void store_row<bf16>(bf16* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; i++) dst[i] = float_to_bf16(src[i]);
}

// qkv [M, (Hq + 2 Hkv) D]: q and k rotated in place at each row's position (cos/sin rows [M, D]),
// then k and v written to the cache [S, Hkv, C, D] at (slot[m], index[m]).
template <typename T>
void rope_store_impl(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& kc, at::Tensor& vc,
                     const at::Tensor& slot, const at::Tensor& index, int64_t hq, int64_t hkv, const float* qn,
                     const float* kn, float eps) {
  const int64_t M = qkv.size(0), D = kc.size(3), C = kc.size(2);
  float* base = qkv.data_ptr<float>();
  const int64_t ld = qkv.stride(0);
  const float* cs = cos.data_ptr<float>();
  const float* sn = sin.data_ptr<float>();
  const int32_t* sl = slot.data_ptr<int32_t>();
  const int32_t* ix = index.data_ptr<int32_t>();
  T* kp = reinterpret_cast<T*>(kc.data_ptr());
  T* vp = reinterpret_cast<T*>(vc.data_ptr());
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; m++) {
      float* row = base + m * ld;
      if (qn)
        for (int64_t h = 0; h < hq; h++) rms_row(row + h * D, qn, D, eps, false, row + h * D);
      if (kn)
        for (int64_t h = hq; h < hq + hkv; h++) rms_row(row + h * D, kn, D, eps, false, row + h * D);
      rope_row(row, hq + hkv, D, cs + m * D, sn + m * D);
      for (int64_t h = 0; h < hkv; h++) {
        const int64_t at_ = ((static_cast<int64_t>(sl[m]) * hkv + h) * C + ix[m]) * D;
        store_row<T>(kp + at_, row + (hq + h) * D, D);
        store_row<T>(vp + at_, row + (hq + hkv + h) * D, D);
      }
    }
  });
}

void rope_store(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& kc, at::Tensor& vc,
                const at::Tensor& slot, const at::Tensor& index, int64_t hq, int64_t hkv,
                const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm, double eps) {
  check(qkv.scalar_type() == at::kFloat && qkv.stride(1) == 1, "rope_store: fp32 qkv rows");
  check(cos.is_contiguous() && sin.is_contiguous() && kc.is_contiguous() && vc.is_contiguous(), "rope_store: layout");
  check(slot.scalar_type() == at::kInt && index.scalar_type() == at::kInt, "rope_store: int32 slots and indices");
  check(qkv.size(1) == (hq + 2 * hkv) * kc.size(3), "rope_store: head counts");
  // Rows of cos and sin are read head_dim apart: narrower ones were read past their end (an audit).
  check(cos.dim() == 2 && cos.size(0) >= qkv.size(0) && cos.size(1) == kc.size(3) && sin.sizes() == cos.sizes(),
        "rope_store: a cos and sin row of head_dim per qkv row");
  const float* qn = q_norm ? q_norm->data_ptr<float>() : nullptr;
  const float* kn = k_norm ? k_norm->data_ptr<float>() : nullptr;
  const float e = static_cast<float>(eps);
  if (kc.scalar_type() == at::kBFloat16)
    rope_store_impl<bf16>(qkv, cos, sin, kc, vc, slot, index, hq, hkv, qn, kn, e);
  else
    rope_store_impl<float>(qkv, cos, sin, kc, vc, slot, index, hq, hkv, qn, kn, e);
}

// --- attention over each row's list of visible keys ---------------------------------------------------
//
// Row m sees cache rows [lo[m], hi[m]) of its slot, then extra[m, 0..count[m]), in that order: its
// keys as one list, so whether they sit contiguously or are gathered never changes the arithmetic.
// Per query head: score_j = hsum(q * k_j) * scale; p_j = exp(score_j - max); the sum of p in 16
// lanes by list index; out = (sum_j p_j v_j, j in list order) / sum. The heads that share a key
// head are computed together (each key and value is read once for all of them); that changes
// which registers hold a head's numbers, not its operations.

constexpr int HB = 4;  // query heads of one group computed together

#if defined(__AVX512F__)
// Sixteen horizontal sums at once, each by hsum's own additions (lanes l + 8, then + 4, + 2, + 1,
// the same operands in the same order), so each sum has the bits hsum gives it alone; the shuffles
// only move lanes. Sum i lands in lane 4 * (i % 4) + i / 4.
inline __m512 hsum16(const __m512* x) {
  __m512 y[8], z[4], w[2];
  for (int i = 0; i < 8; i++)  // a[l] + a[l + 8]: two sums a vector
    y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 4; i++)  // + 4: four sums a vector, one a 128-bit lane
    z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; i++)  // + 2
    w[i] = _mm512_add_ps(_mm512_shuffle_ps(z[2 * i], z[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(z[2 * i], z[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),  // + 1
                       _mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

template <typename T, int DV, int NH>
void head_block(const float* const* q, const T* kb, const T* vb, const int64_t* keys, int64_t L, float sc,
                float* const* p, float* const* out) {
  constexpr int64_t D = DV * W;
  V qv[NH][DV];
  for (int h = 0; h < NH; h++)
    for (int c = 0; c < DV; c++) qv[h][c] = vload(q[h] + c * W);
  float best[NH];
  for (int h = 0; h < NH; h++) best[h] = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
#if defined(__AVX512F__)
  // Four keys at a time: their dot products with up to four heads summed together (hsum16), each
  // score the bits of the one-key loop below.
  for (; j + 4 <= L; j += 4) {
    __m512 dots[16];
    for (int u = 0; u < 4; u++) {
      const T* kr = kb + keys[j + u] * D;
      V a[NH];
      for (int h = 0; h < NH; h++) a[h] = vzero();
      for (int c = 0; c < DV; c++) {
        const V kv = vload(kr + c * W);
        for (int h = 0; h < NH; h++) a[h] = vfma(qv[h][c], kv, a[h]);
      }
      for (int h = 0; h < 4; h++) dots[4 * u + h] = h < NH ? a[h].v : _mm512_setzero_ps();
    }
    alignas(64) float sums[W];
    _mm512_store_ps(sums, hsum16(dots));
    for (int u = 0; u < 4; u++)
      for (int h = 0; h < NH; h++) {
        const float s = sums[4 * h + u] * sc;  // sum 4u + h
        p[h][j + u] = s;
        best[h] = s > best[h] ? s : best[h];
      }
  }
#endif
  for (; j < L; j++) {
    const T* kr = kb + keys[j] * D;
    V a[NH];
    for (int h = 0; h < NH; h++) a[h] = vzero();
    for (int c = 0; c < DV; c++) {
      const V kv = vload(kr + c * W);
      for (int h = 0; h < NH; h++) a[h] = vfma(qv[h][c], kv, a[h]);
    }
    for (int h = 0; h < NH; h++) {
      const float s = hsum(a[h]) * sc;
      p[h][j] = s;
      best[h] = s > best[h] ? s : best[h];
    }
  }
  float denom[NH];
  for (int h = 0; h < NH; h++) {
    V total = vzero();
    const V top = vset(best[h]);
    for (int64_t j = 0; j < L; j += W) {
      const int n = static_cast<int>(std::min<int64_t>(W, L - j));
      V e = vexp(vsub(vloadn(&p[h][j], n), top));
      if (n < W) {  // lanes past the list are not keys: they add nothing
        alignas(64) float t[W];
        vlanes(e, t);
        for (int l = n; l < W; l++) t[l] = 0.0f;
        e = vload(t);
      }
      vstoren(&p[h][j], e, n);
      total = vadd(total, e);
    }
    denom[h] = hsum(total);
  }
  V acc[NH][DV];
  for (int h = 0; h < NH; h++)
    for (int c = 0; c < DV; c++) acc[h][c] = vzero();
  for (int64_t j = 0; j < L; j++) {
    const T* vr = vb + keys[j] * D;
    for (int c = 0; c < DV; c++) {
      const V vv = vload(vr + c * W);
      for (int h = 0; h < NH; h++) acc[h][c] = vfma(vset(p[h][j]), vv, acc[h][c]);
    }
  }
  for (int h = 0; h < NH; h++) {
    const V dv = vset(denom[h]);
    for (int c = 0; c < DV; c++) vstore(out[h] + c * W, vdiv(acc[h][c], dv));
  }
}

// Any head size: the same operations, with partial vectors at the end of a head.
template <typename T>
void head_generic(const float* q, const T* kb, const T* vb, const int64_t* keys, int64_t L, int64_t D, float sc,
                  float* p, float* out) {
  float best = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < L; j++) {
    const T* kr = kb + keys[j] * D;
    V a = vzero();
    for (int64_t d = 0; d < D; d += W) {
      const int n = static_cast<int>(std::min<int64_t>(W, D - d));
      a = vfma(vloadn(q + d, n), vloadn(kr + d, n), a);
    }
    const float s = hsum(a) * sc;
    p[j] = s;
    best = s > best ? s : best;
  }
  V total = vzero();
  const V top = vset(best);
  for (int64_t j = 0; j < L; j += W) {
    const int n = static_cast<int>(std::min<int64_t>(W, L - j));
    V e = vexp(vsub(vloadn(&p[j], n), top));
    if (n < W) {
      alignas(64) float t[W];
      vlanes(e, t);
      for (int l = n; l < W; l++) t[l] = 0.0f;
      e = vload(t);
    }
    vstoren(&p[j], e, n);
    total = vadd(total, e);
  }
  const float denom = hsum(total);
  for (int64_t d = 0; d < D; d += W) {
    const int n = static_cast<int>(std::min<int64_t>(W, D - d));
    V acc = vzero();
    for (int64_t j = 0; j < L; j++) acc = vfma(vset(p[j]), vloadn(vb + keys[j] * D + d, n), acc);
    vstoren(out + d, vdiv(acc, vset(denom)), n);
  }
}

template <typename T, int DV>
void group_heads(int64_t nh, const float* const* q, const T* kb, const T* vb, const int64_t* keys, int64_t L,
                 float sc, float* const* p, float* const* out) {
  switch (nh) {
    case 4: head_block<T, DV, 4>(q, kb, vb, keys, L, sc, p, out); break;
    case 3: head_block<T, DV, 3>(q, kb, vb, keys, L, sc, p, out); break;
    case 2: head_block<T, DV, 2>(q, kb, vb, keys, L, sc, p, out); break;
    default: head_block<T, DV, 1>(q, kb, vb, keys, L, sc, p, out); break;
  }
}

template <typename T>
void attention_impl(const at::Tensor& qkv, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& slot,
                    const at::Tensor& lo, const at::Tensor& hi, const at::Tensor& extra, const at::Tensor& count,
                    int64_t hq, double scale, at::Tensor& out) {
  const int64_t M = qkv.size(0), hkv = kc.size(1), C = kc.size(2), D = kc.size(3);
  const int64_t group = hq / hkv, E = extra.size(1);
  const float* q = qkv.data_ptr<float>();
  const int64_t ldq = qkv.stride(0);
  const T* kp = reinterpret_cast<const T*>(kc.data_ptr());
  const T* vp = reinterpret_cast<const T*>(vc.data_ptr());
  const int32_t *sl = slot.data_ptr<int32_t>(), *l0 = lo.data_ptr<int32_t>(), *h0 = hi.data_ptr<int32_t>();
  const int32_t *ex = extra.data_ptr<int32_t>(), *cn = count.data_ptr<int32_t>();
  float* o = out.data_ptr<float>();
  const int64_t ldo = out.stride(0);
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, M * hkv, 1, [&](int64_t t0, int64_t t1) {
    std::vector<int64_t> keys;
    std::vector<float> scores;
    for (int64_t t = t0; t < t1; t++) {
      const int64_t m = t / hkv, g = t % hkv;
      const int64_t span = h0[m] - l0[m];
      const int64_t L = span + cn[m];
      keys.resize(L);
      for (int64_t j = 0; j < span; j++) keys[j] = l0[m] + j;
      for (int64_t j = 0; j < cn[m]; j++) keys[span + j] = ex[m * E + j];
      const int64_t stride = ((L + W - 1) / W) * W;
      scores.resize(HB * stride);
      const T* kb = kp + (static_cast<int64_t>(sl[m]) * hkv + g) * C * D;
      const T* vb = vp + (static_cast<int64_t>(sl[m]) * hkv + g) * C * D;
      for (int64_t h0_ = 0; h0_ < group; h0_ += HB) {
        const int64_t nh = std::min<int64_t>(HB, group - h0_);
        const float* qs[HB];
        float* ps[HB];
        float* os[HB];
        for (int64_t i = 0; i < nh; i++) {
          const int64_t h = g * group + h0_ + i;
          qs[i] = q + m * ldq + h * D;
          ps[i] = scores.data() + i * stride;
          os[i] = o + m * ldo + h * D;
        }
        switch (D) {
          case 16: group_heads<T, 1>(nh, qs, kb, vb, keys.data(), L, sc, ps, os); break;
          case 32: group_heads<T, 2>(nh, qs, kb, vb, keys.data(), L, sc, ps, os); break;
          case 64: group_heads<T, 4>(nh, qs, kb, vb, keys.data(), L, sc, ps, os); break;
          case 128: group_heads<T, 8>(nh, qs, kb, vb, keys.data(), L, sc, ps, os); break;
          default:
            for (int64_t i = 0; i < nh; i++) head_generic<T>(qs[i], kb, vb, keys.data(), L, D, sc, ps[i], os[i]);
        }
      }
    }
  });
}

void attention(const at::Tensor& qkv, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& slot,
               const at::Tensor& lo, const at::Tensor& hi, const at::Tensor& extra, const at::Tensor& count, int64_t hq,
               double scale, at::Tensor& out) {
  check(qkv.scalar_type() == at::kFloat && qkv.stride(1) == 1 && out.is_contiguous(), "attention: fp32 rows");
  check(kc.is_contiguous() && vc.is_contiguous(), "attention: cache layout");
  check(extra.is_contiguous() && extra.scalar_type() == at::kInt, "attention: int32 extra keys");
  check(hq % kc.size(1) == 0, "attention: query heads a multiple of key/value heads");
  if (kc.scalar_type() == at::kBFloat16)
    attention_impl<bf16>(qkv, kc, vc, slot, lo, hi, extra, count, hq, scale, out);
  else
    attention_impl<float>(qkv, kc, vc, slot, lo, hi, extra, count, hq, scale, out);
}

}  // namespace

TORCH_LIBRARY(dflash, m) {
  m.def("linear(Tensor x, Tensor w, int n, Tensor? bias, Tensor? residual, Tensor(a!) out) -> ()");
  m.def("linear_path(int want) -> int", &linear_path);
  m.def("screen_path(int want) -> int", &screen_path);
  m.def("prefetch_level(int want) -> int", &prefetch_level);
  m.def("rmsnorm(Tensor x, Tensor weight, float eps, bool plus_one, Tensor(a!) out) -> ()");
  m.def("silu_mul(Tensor gu, Tensor(a!) out) -> ()");
  m.def("argmax(Tensor x, Tensor(a!) out) -> ()");
  m.def("screen_available() -> bool", &screen_available);
  m.def(
      "screen_argmax(Tensor x, Tensor head, int n, Tensor rows, Tensor w8, Tensor coef, Tensor colsum, int limit, "
      "Tensor(a!) out, Tensor(b!) kept) -> bool");
  m.def(
      "rope_store(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) kc, Tensor(c!) vc, Tensor slot, Tensor index, "
      "int hq, int hkv, Tensor? q_norm, Tensor? k_norm, float eps) -> ()");
  m.def(
      "attention(Tensor qkv, Tensor kc, Tensor vc, Tensor slot, Tensor lo, Tensor hi, Tensor extra, Tensor count, "
      "int hq, float scale, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(dflash, CPU, m) {
  m.impl("linear", &linear);
  m.impl("rmsnorm", &rmsnorm);
  m.impl("silu_mul", &silu_mul);
  m.impl("argmax", &argmax);
  m.impl("screen_argmax", &screen_argmax);
  m.impl("rope_store", &rope_store);
  m.impl("attention", &attention);
}
