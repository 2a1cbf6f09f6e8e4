// bf16 kernels for the CPU decode path: linear layers and attention whose every output row
// is computed by the same instructions in the same order however many rows share the call.
// That makes a k-token verification round exactly as k one-token steps (batch invariance),
// so greedy bf16 decoding stays token-exact against bf16 AR without fp64 attention or row
// chunks, and a one-token step streams the weights once, near the memory-bandwidth limit.
//
// Built by bench/core/cpu_kernels.py for one of three instruction tiers:
//   SB_AMX (with SB_AVX512BF16): linear layers on AMX tiles, everything else as AVX512-BF16
//   SB_AVX512BF16: AVX512-BF16 (vdpbf16ps: two bf16 products per fp32 lane, fp32 sums)
//   otherwise AVX2 + FMA (bf16 widened to fp32, one FMA per product)
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#if defined(SB_AMX)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

using bf16 = at::BFloat16;

#if defined(SB_AVX512BF16)
constexpr int64_t LANES = 16;  // fp32 lanes per vector; a packed block holds this many outputs
using vec = __m512;
static inline vec vzero() { return _mm512_setzero_ps(); }
static inline vec vset1(float a) { return _mm512_set1_ps(a); }
static inline vec vfmadd(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vsum(vec a) { return _mm512_reduce_add_ps(a); }
static inline void vstore(float* p, vec a) { _mm512_storeu_ps(p, a); }
static inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
static inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
static inline vec vload_bf16(const bf16* p) {  // 16 bf16 -> fp32 (exact: a shift)
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
constexpr int64_t KSTEP = 2;  // reduction indices per packed step (a bf16 pair per lane)
#else
constexpr int64_t LANES = 8;
using vec = __m256;
static inline vec vzero() { return _mm256_setzero_ps(); }
static inline vec vset1(float a) { return _mm256_set1_ps(a); }
static inline vec vfmadd(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vsum(vec a) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  return _mm_cvtss_f32(_mm_add_ss(lo, _mm_movehdup_ps(lo)));
}
static inline void vstore(float* p, vec a) { _mm256_storeu_ps(p, a); }
static inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
static inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
static inline vec vload_bf16(const bf16* p) {
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
constexpr int64_t KSTEP = 1;
#endif

// ---------------------------------------------------------------------------- linear
// Outputs go in groups of GROUP = NR * LANES. Packed weight [N, K] ->
// [ceil(N / GROUP), ceil(K / KSTEP), NR, LANES, KSTEP]: one step of the reduction for a whole
// group is NR consecutive vectors, so a group's weights are one sequential stream (a one-row
// pass is a read of the weights front to back). Padding is zero.
constexpr int64_t NR = 4, GROUP = NR * LANES;

torch::Tensor pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "pack takes a 2-D bf16 weight");
  const int64_t n = w.size(0), k = w.size(1);
  const int64_t np = (n + GROUP - 1) / GROUP * GROUP, kp = (k + KSTEP - 1) / KSTEP * KSTEP;
  auto padded = torch::zeros({np, kp}, w.options());
  padded.slice(0, 0, n).slice(1, 0, k).copy_(w);
  return padded.view({np / GROUP, NR, LANES, kp / KSTEP, KSTEP}).permute({0, 3, 1, 2, 4}).contiguous();
}

// MR rows x one group. Each output has one accumulator lane that takes the reduction steps in
// order 0, 1, ...: the same sequence for every MR, so rows never see each other.
// `ahead` is a share of the next group's weights, `lines` cache lines of it, `per_step` a step:
// fetched into L2 while this tile's sums run, so a k-row pass streams the weights during its
// arithmetic instead of between it (prefetches change no arithmetic).
template <int MR>
static inline void tile(const bf16* x, int64_t ldx, const bf16* w, int64_t steps, float* y, int64_t ldy,
                        const char* ahead, int64_t lines, int64_t per_step) {
  vec acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = vzero();
  for (int64_t s = 0; s < steps; ++s) {
    const bf16* ws = w + s * GROUP * KSTEP;
    for (int64_t q = s * per_step; q < std::min(lines, (s + 1) * per_step); ++q)
      _mm_prefetch(ahead + q * 64, _MM_HINT_T1);
#if defined(SB_AVX512BF16)
    __m512bh wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(ws + j * LANES * KSTEP);
    for (int i = 0; i < MR; ++i) {
      int32_t pair;
      std::memcpy(&pair, x + i * ldx + s * KSTEP, sizeof(pair));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
    }
#else
    vec wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = vload_bf16(ws + j * LANES);
    for (int i = 0; i < MR; ++i) {
      const vec xv = vset1(static_cast<float>(x[i * ldx + s]));
      for (int j = 0; j < NR; ++j) acc[i][j] = vfmadd(xv, wv[j], acc[i][j]);
    }
#endif
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) vstore(y + i * ldy + j * LANES, acc[i][j]);
}

// Up to 4 rows x one group (one unit of `linear`'s split).
static void row_tile(const bf16* x, int64_t ldx, int64_t m, const bf16* w, int64_t steps, float* y, int64_t ldy,
                     const char* ahead, int64_t lines, int64_t per_step) {
  switch (m) {
    case 4: tile<4>(x, ldx, w, steps, y, ldy, ahead, lines, per_step); break;
    case 3: tile<3>(x, ldx, w, steps, y, ldy, ahead, lines, per_step); break;
    case 2: tile<2>(x, ldx, w, steps, y, ldy, ahead, lines, per_step); break;
    case 1: tile<1>(x, ldx, w, steps, y, ldy, ahead, lines, per_step); break;
    default: break;
  }
}

#if defined(SB_AMX)
// AMX: the packed layout is already what a tile dot product reads. For one group and one of its
// NR blocks of LANES outputs, 16 consecutive reduction steps are 16 rows of LANES bf16 pairs,
// GROUP * KSTEP elements apart: a B tile. A tile of up to 16 input rows times 16 steps is the A
// tile. tdpbf16ps computes each row of C from that row of A alone, and every pass takes the
// steps in the same order, so a row's bits do not depend on how many rows share the tile: the
// same invariance as `tile` above, at a fraction of its cost per row (a k-row pass streams the
// weights once for up to 16 rows).
constexpr int64_t AMX_STEPS = 16;  // reduction steps (bf16 pairs) per tile

// The kernel grants a process the tile data state only on request (Linux 5.16+).
static bool amx_permitted() {
  static const bool ok = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0-3: the NR accumulators, tmm4: the rows' 16 steps, tmm5-7: weight tiles in turn.
static void amx_configure(int rows) {
  static_assert(NR == 4 && LANES == 16 && KSTEP == 2, "the AMX path reads the AVX512 packed layout");
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = t < 5 ? rows : AMX_STEPS;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

// `rows` (<= 16, the configured count) rows x one group, steps a multiple of AMX_STEPS.
static void amx_group(const bf16* x, int64_t ldx, const bf16* w, int64_t steps, float* y, int64_t ldy) {
  constexpr int64_t block = LANES * KSTEP, wstride = GROUP * KSTEP * sizeof(bf16);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t s = 0; s < steps; s += AMX_STEPS) {
    const bf16* ws = w + s * GROUP * KSTEP;
    _tile_loadd(4, x + s * KSTEP, ldx * sizeof(bf16));
    _tile_loadd(5, ws, wstride);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, ws + block, wstride);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(7, ws + 2 * block, wstride);
    _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, ws + 3 * block, wstride);
    _tile_dpbf16ps(3, 4, 5);
  }
  const int64_t ystride = ldy * sizeof(float);
  _tile_stored(0, y, ystride);
  _tile_stored(1, y + LANES, ystride);
  _tile_stored(2, y + 2 * LANES, ystride);
  _tile_stored(3, y + 3 * LANES, ystride);
}
#endif

// x [..., K] bf16 @ W.T, W packed by `pack` from [n, K]; returns fp32 [..., n].
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t n) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 && packed.dim() == 5,
              "linear takes bf16 rows and a packed bf16 weight");
  const int64_t k = x.size(-1), m = x.numel() / std::max<int64_t>(k, 1);
  const int64_t groups = packed.size(0), steps = packed.size(1), kp = steps * KSTEP, stride = steps * GROUP * KSTEP;
  TORCH_CHECK(kp >= k && kp - k < KSTEP && n <= groups * GROUP, "packed weight does not match the rows");
  auto rows = x.reshape({m, k});
  if (kp != k) rows = torch::constant_pad_nd(rows, {0, kp - k});
  rows = rows.contiguous();
  const int64_t ld = groups * GROUP;
  auto y = torch::empty({m, ld}, x.options().dtype(at::kFloat));
  const bf16* xp = rows.data_ptr<bf16>();
  const bf16* wp = packed.data_ptr<bf16>();
  float* yp = y.data_ptr<float>();
  constexpr int64_t ROWS = 16;  // a group's weights are reused by up to ROWS rows while in cache
#if defined(SB_AMX)
  // Whether a weight runs on tiles depends on its shape only, never on the rows, so a one-row
  // step and a k-row pass of the same weight take the same path.
  if (steps % AMX_STEPS == 0 && amx_permitted()) {
    at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
      int configured = 0;
      for (int64_t r0 = 0; r0 < m; r0 += ROWS) {
        const int rows = static_cast<int>(std::min(ROWS, m - r0));
        if (rows != configured) amx_configure(configured = rows);
        for (int64_t g = g0; g < g1; ++g)
          amx_group(xp + r0 * kp, kp, wp + g * stride, steps, yp + r0 * ld + g * GROUP, ld);
      }
      if (configured) _tile_release();
    });
  } else
#endif
  {  // braced: the AMX branch's `else` takes this whole block, not its first declaration
    // The threads split (row chunk, group, tile of 4 rows) units, in that order: a weight with few
    // groups (an o or down projection: 9 of them) still keeps both cores busy at 16 rows, and a
    // thread's consecutive tiles of one group read its weights from cache.
    // From 9 rows (3 tiles a group) each tile prefetches its share of the next group's weights, the
    // group the thread takes next (but at the end of its range); fewer rows stream at the memory's
    // pace and the hardware prefetcher serves them better (scripts.kernels_ab, AMD EPYC).
    const int64_t tiles = (std::min(ROWS, m) + 3) / 4, chunks = (m + ROWS - 1) / ROWS;
    const int64_t group_lines = stride * static_cast<int64_t>(sizeof(bf16)) / 64;
    const int64_t per_step = (group_lines / steps + tiles - 1) / tiles, share = per_step * steps;
    at::parallel_for(0, chunks * groups * tiles, 1, [&](int64_t u0, int64_t u1) {
      for (int64_t u = u0; u < u1; ++u) {
        const int64_t t = u % tiles, r = u / (groups * tiles) * ROWS + t * 4, g = u / tiles % groups;
        const char* ahead = reinterpret_cast<const char*>(wp + (g + 1) % groups * stride) + t * share * 64;
        const int64_t lines = tiles < 3 ? 0 : std::clamp<int64_t>(group_lines - t * share, 0, share);
        if (r < m)
          row_tile(xp + r * kp, kp, std::min<int64_t>(4, m - r), wp + g * stride, steps, yp + r * ld + g * GROUP, ld,
                   ahead, lines, per_step);
      }
    });
  }
  auto out = ld == n ? y : y.slice(1, 0, n);
  auto shape = x.sizes().vec();
  shape.back() = n;
  return out.reshape(shape);
}

// ------------------------------------------------------------------------- attention
// q [heads, n, D], keys/values [kv_heads, span, D] (rows of D contiguous), visible [n, span]
// bool: softmax(q k^T * scale) v per row, fp32 inside, bf16 out. A row reads only its visible
// slots, in slot order, and everything it computes is a function of that sequence: its
// scores, their max, exps, sum (by position in the sequence) and the weighted sum of values.
// A tree row whose ancestors sit at scattered slots therefore gets the bits of the same row
// in a chain pass, and no row depends on the others or on n.
// exp on fp32 lanes: 2^n * p(r), r = x - n ln2 in two parts, p a degree-6 Taylor polynomial
// (|r| <= ln2 / 2: relative error ~2e-7), inputs clamped to [-87, 88].
#if defined(SB_AVX512BF16)
static inline vec vexp(vec x) {
  x = _mm512_min_ps(_mm512_max_ps(x, vset1(-87.0f)), vset1(88.0f));
  const vec n = _mm512_roundscale_ps(_mm512_mul_ps(x, vset1(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
  vec r = _mm512_fnmadd_ps(n, vset1(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, vset1(1.428606765330187045e-06f), r);
  vec p = vset1(1.0f / 720);
  for (float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = _mm512_fmadd_ps(p, r, vset1(c));
  return _mm512_scalef_ps(p, n);
}
static inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
static inline float vmaxall(vec a) { return _mm512_reduce_max_ps(a); }
static inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
static inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
#else
static inline vec vexp(vec x) {
  x = _mm256_min_ps(_mm256_max_ps(x, vset1(-87.0f)), vset1(88.0f));
  const vec n = _mm256_round_ps(_mm256_mul_ps(x, vset1(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  vec r = _mm256_fnmadd_ps(n, vset1(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, vset1(1.428606765330187045e-06f), r);
  vec p = vset1(1.0f / 720);
  for (float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = _mm256_fmadd_ps(p, r, vset1(c));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
static inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
static inline float vmaxall(vec a) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
static inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
static inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
#endif

// A tile of LANES consecutive slots' keys, one vector per head dimension (pair): lane l holds
// slot j0 + l. A lane's score sums its slot's head dimensions in order on its own, so the
// score of (row, slot) is the same whichever lane, tile or pass it is computed in.
#if defined(SB_AVX512BF16)
using tile_t = __m512i;  // dimension pair p of 16 slots
constexpr int64_t TILE_DIMS = 2;
// 16 x 16 transpose of 32-bit words (r[i] word j -> r[j] word i).
static inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 16; i += 8)
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
  }
}

// Rows of 16 slots loaded whole and transposed 16 words (dimension pairs) at a time; slots
// past `valid` read as zeros.
static inline void load_tile(const bf16* k, int64_t slot_stride, int64_t valid, int64_t d, tile_t* tile) {
  const int64_t words = d / 2;
  for (int64_t w0 = 0; w0 < words; w0 += 16) {
    const int64_t width = std::min<int64_t>(16, words - w0);
    const __mmask16 mask = width >= 16 ? 0xffff : static_cast<__mmask16>((1u << width) - 1u);
    __m512i r[16];
    for (int64_t l = 0; l < 16; ++l)
      r[l] = l < valid ? _mm512_maskz_loadu_epi32(mask, k + l * slot_stride + 2 * w0) : _mm512_setzero_si512();
    transpose16(r);
    for (int64_t p = 0; p < width; ++p) tile[w0 + p] = r[p];
  }
}
static inline vec dp_pair(vec acc, const tile_t* tile, const bf16* q, int64_t p) {
  int32_t pair;
  std::memcpy(&pair, q + 2 * p, sizeof(pair));
  return _mm512_dpbf16_ps(acc, (__m512bh)tile[p], (__m512bh)_mm512_set1_epi32(pair));
}
// Pair p into chain p % 4: four short chains, named so they stay in registers (d / 2 is a
// multiple of 8: check_heads).
static inline vec tile_scores(const tile_t* tile, const bf16* q, int64_t d) {
  vec a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
  for (int64_t p = 0; p < d / 2; p += 4) {
    a0 = dp_pair(a0, tile, q, p);
    a1 = dp_pair(a1, tile, q, p + 1);
    a2 = dp_pair(a2, tile, q, p + 2);
    a3 = dp_pair(a3, tile, q, p + 3);
  }
  return vadd(vadd(a0, a1), vadd(a2, a3));
}
#else
using tile_t = __m256;  // dimension p of 8 slots, fp32
constexpr int64_t TILE_DIMS = 1;
static inline void load_tile(const bf16* k, int64_t slot_stride, int64_t valid, int64_t d, tile_t* tile) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i base = _mm256_mullo_epi32(lane, _mm256_set1_epi32(static_cast<int32_t>(slot_stride / 2)));
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(valid)), lane);
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xffff0000u));
  const int* words = reinterpret_cast<const int*>(k);
  for (int64_t p = 0; p < d / 2; ++p) {
    const __m256i w = _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), words,
                                                  _mm256_add_epi32(base, _mm256_set1_epi32(static_cast<int32_t>(p))), mask, 4);
    tile[2 * p] = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    tile[2 * p + 1] = _mm256_castsi256_ps(_mm256_and_si256(w, high));
  }
}
// Dimension i into chain i % 4, named so they stay in registers (d is a multiple of 8).
static inline vec tile_scores(const tile_t* tile, const bf16* q, int64_t d) {
  vec a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
  for (int64_t i = 0; i < d; i += 4) {
    a0 = vfmadd(vset1(static_cast<float>(q[i])), tile[i], a0);
    a1 = vfmadd(vset1(static_cast<float>(q[i + 1])), tile[i + 1], a1);
    a2 = vfmadd(vset1(static_cast<float>(q[i + 2])), tile[i + 2], a2);
    a3 = vfmadd(vset1(static_cast<float>(q[i + 3])), tile[i + 3], a3);
  }
  return vadd(vadd(a0, a1), vadd(a2, a3));
}
#endif

constexpr int64_t MAXC = 512 / LANES, MAXG = 16;  // head_dim up to 512, up to 16 heads per K/V head
constexpr int64_t TOKENS = 8;                       // query tokens per task

// The query rows of one task, all on one K/V head: token t (< tokens), head g of the head's
// group (g_begin <= g < g_end). Row (t, g) reads q + t * q_token + g * q_head, writes
// out + t * out_token + g * out_head, and sees slot j where vis[t * vis_token + j].
struct Rows {
  const bf16* q;
  int64_t q_token, q_head;
  float* out;
  int64_t out_token, out_head;
  const bool* vis;
  int64_t vis_token, tokens, group, g_begin, g_end;
};

// out[g] = sum_i w[g][i] v(order[i]) * inv[g] for gn heads, the sums over i in order. With
// compile-time GN heads and CH vectors per head the accumulators are named registers; the
// runtime form takes any head_dim. Both add the same products in the same order.
template <int GN, int CH>
static void weighted_values_fixed(const int32_t* order, int64_t count, const float* const* w, float* const* out,
                                  const float* inv, const bf16* vh, int64_t vs_slot) {
  vec acc[GN][CH];
  for (int g = 0; g < GN; ++g)
    for (int c = 0; c < CH; ++c) acc[g][c] = vzero();
  for (int64_t i = 0; i < count; ++i) {
    const bf16* vr = vh + order[i] * vs_slot;
    vec wv[GN];
    for (int g = 0; g < GN; ++g) wv[g] = vset1(w[g][i]);
    for (int c = 0; c < CH; ++c) {
      const vec v = vload_bf16(vr + c * LANES);
      for (int g = 0; g < GN; ++g) acc[g][c] = vfmadd(wv[g], v, acc[g][c]);
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int c = 0; c < CH; ++c) vstore(out[g] + c * LANES, vmul(acc[g][c], vset1(inv[g])));
}

static void weighted_values(const int32_t* order, int64_t count, const float* const* w, float* const* out,
                            const float* inv, int64_t gn, int64_t chunks, const bf16* vh, int64_t vs_slot) {
  if (chunks * LANES == 64) {  // head_dim 64 (Llama-style small models)
    constexpr int CH = 64 / LANES;
    switch (gn) {
      case 4: return weighted_values_fixed<4, CH>(order, count, w, out, inv, vh, vs_slot);
      case 3: return weighted_values_fixed<3, CH>(order, count, w, out, inv, vh, vs_slot);
      case 2: return weighted_values_fixed<2, CH>(order, count, w, out, inv, vh, vs_slot);
      default: return weighted_values_fixed<1, CH>(order, count, w, out, inv, vh, vs_slot);
    }
  }
  vec acc[4][MAXC];
  for (int64_t g = 0; g < gn; ++g)
    for (int64_t c = 0; c < chunks; ++c) acc[g][c] = vzero();
  for (int64_t i = 0; i < count; ++i) {
    const bf16* vr = vh + order[i] * vs_slot;
    for (int64_t c = 0; c < chunks; ++c) {
      const vec v = vload_bf16(vr + c * LANES);
      for (int64_t g = 0; g < gn; ++g) acc[g][c] = vfmadd(vset1(w[g][i]), v, acc[g][c]);
    }
  }
  for (int64_t g = 0; g < gn; ++g)
    for (int64_t c = 0; c < chunks; ++c) vstore(out[g] + c * LANES, vmul(acc[g][c], vset1(inv[g])));
}

// One task's attention over `span` slots of one K/V head. Each slot's key and value are
// widened once for every row that sees it; a row's sums run over its own slots in slot order,
// indexed by their position in that sequence.
static void attend_rows(const Rows& r, const bf16* kh, int64_t ks_slot, const bf16* vh, int64_t vs_slot,
                        int64_t span, int64_t d, float s, std::vector<float>& weights, std::vector<int32_t>& slots) {
  const int64_t chunks = d / LANES, padded = (span + LANES - 1) / LANES * LANES, group = r.group;
  weights.resize(TOKENS * group * padded);
  slots.resize(TOKENS * span);
  int64_t count[TOKENS] = {0};
  auto row_weights = [&](int64_t t, int64_t g) { return weights.data() + (t * group + g) * padded; };
  // scores, a tile of slots at a time, kept in each row's own slot sequence
  tile_t tile[512 / TILE_DIMS];
  for (int64_t j0 = 0; j0 < span; j0 += LANES) {
    const int64_t valid = std::min(LANES, span - j0);
    int64_t seen_in_tile[TOKENS] = {0}, any = 0;
    for (int64_t t = 0; t < r.tokens; ++t) {
      const bool* vr = r.vis + t * r.vis_token + j0;
      for (int64_t l = 0; l < valid; ++l) seen_in_tile[t] += vr[l];
      any += seen_in_tile[t];
    }
    if (!any) continue;
    load_tile(kh + j0 * ks_slot, ks_slot, valid, d, tile);
    for (int64_t t = 0; t < r.tokens; ++t) {
      if (!seen_in_tile[t]) continue;
      const bool* vr = r.vis + t * r.vis_token + j0;
      const bool whole = seen_in_tile[t] == LANES;  // every slot visible (the prefix): no compaction
      for (int64_t g = r.g_begin; g < r.g_end; ++g) {
        const vec scores = vmul(tile_scores(tile, r.q + t * r.q_token + g * r.q_head, d), vset1(s));
        float* w = row_weights(t, g) + count[t];
        if (whole) {
          vstore(w, scores);
          continue;
        }
        alignas(64) float lanes[LANES];
        vstore(lanes, scores);
        for (int64_t l = 0, i = 0; l < valid; ++l)
          if (vr[l]) w[i++] = lanes[l];
      }
      int32_t* order = slots.data() + t * span + count[t];
      for (int64_t l = 0, i = 0; l < valid; ++l)
        if (vr[l]) order[i++] = static_cast<int32_t>(j0 + l);
      count[t] += seen_in_tile[t];
    }
  }
  // softmax numerators and their sums, lanes by position in the row's slot sequence
  float total[TOKENS][MAXG];
  for (int64_t t = 0; t < r.tokens; ++t) {
    const int64_t m = count[t], full = m / LANES * LANES;
    for (int64_t g = r.g_begin; g < r.g_end; ++g) {
      float* w = row_weights(t, g);
      float top = -std::numeric_limits<float>::infinity();
      if (full) {
        vec mx = vload(w);
        for (int64_t i = LANES; i < full; i += LANES) mx = vmax(mx, vload(w + i));
        top = vmaxall(mx);
      }
      for (int64_t i = full; i < m; ++i) top = std::max(top, w[i]);
      vec sum = vzero();
      for (int64_t i = 0; i < full; i += LANES) {
        const vec e = vexp(vsub(vload(w + i), vset1(top)));
        vstore(w + i, e);
        sum = vadd(sum, e);
      }
      float rest = 0.0f;
      if (full < m) {  // the tail through the same vector exp; padding lanes are dropped
        alignas(64) float tail[LANES];
        for (int64_t i = 0; i < LANES; ++i) tail[i] = full + i < m ? w[full + i] - top : -100.0f;
        vstore(tail, vexp(vload(tail)));
        for (int64_t i = full; i < m; ++i) rest += (w[i] = tail[i - full]);
      }
      total[t][g] = m ? vsum(sum) + rest : 1.0f;
    }
  }
  // weighted values: per token, its heads' sums over its own slot sequence, in order
  for (int64_t t = 0; t < r.tokens; ++t) {
    const int32_t* order = slots.data() + t * span;
    for (int64_t g0 = r.g_begin; g0 < r.g_end; g0 += 4) {  // up to 4 heads x 4 vectors of accumulators in registers
      const int64_t gn = std::min<int64_t>(4, r.g_end - g0);
      const float* w[4];
      float* out[4];
      float inv[4];
      for (int64_t g = 0; g < gn; ++g) {
        w[g] = row_weights(t, g0 + g);
        out[g] = r.out + t * r.out_token + (g0 + g) * r.out_head;
        inv[g] = 1.0f / total[t][g0 + g];
      }
      weighted_values(order, count[t], w, out, inv, gn, chunks, vh, vs_slot);
    }
  }
}

static void check_heads(int64_t heads, int64_t kv_heads, int64_t d) {
  TORCH_CHECK(d % LANES == 0 && d / LANES <= MAXC && heads % kv_heads == 0 && heads / kv_heads <= MAXG,
              "attention: unsupported shapes (head_dim a multiple of the vector width up to 512, "
              "at most 16 heads per K/V head)");
}

// q [heads, n, D], keys/values [kv_heads, span, D] (rows of D contiguous), visible [n, span].
torch::Tensor attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values, torch::Tensor visible,
                        double scale) {
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 3 && values.dim() == 3 && visible.dim() == 2, "attention shapes");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && keys.scalar_type() == at::kBFloat16 &&
                  values.scalar_type() == at::kBFloat16 && visible.scalar_type() == at::kBool,
              "attention takes bf16 q/keys/values and a bool mask");
  const int64_t heads = q.size(0), n = q.size(1), d = q.size(2), kv_heads = keys.size(0), span = keys.size(1);
  check_heads(heads, kv_heads, d);
  TORCH_CHECK(keys.stride(2) == 1 && values.stride(2) == 1 && values.size(1) == span && visible.size(0) == n &&
                  visible.size(1) == span, "attention: keys, values and mask disagree");
  const int64_t group = heads / kv_heads;
  auto qc = q.contiguous();
  auto seen = visible.contiguous();
  auto result = torch::empty({heads, n, d}, q.options().dtype(at::kFloat));
  const bf16* qb = qc.data_ptr<bf16>();
  const bool* vis = seen.data_ptr<bool>();
  const bf16* kp = keys.data_ptr<bf16>();
  const bf16* vp = values.data_ptr<bf16>();
  float* op = result.data_ptr<float>();
  const float s = static_cast<float>(scale);
  const int64_t blocks = (n + TOKENS - 1) / TOKENS;
  // Fewer tasks than threads (one K/V head): split each task's heads too, so every core works;
  // a row's arithmetic is the same in any split.
  const int64_t splits = kv_heads * blocks < at::get_num_threads() ? group : 1, per = group / splits;
  at::parallel_for(0, kv_heads * blocks * splits, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> weights;
    std::vector<int32_t> slots;
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t part = task % splits, h = task / splits / blocks, first = (task / splits % blocks) * TOKENS;
      const int64_t base = h * group * n + first;
      const Rows rows{qb + base * d, d, n * d, op + base * d, d, n * d, vis + first * span, span,
                      std::min(n, first + TOKENS) - first, group, part * per, part * per + per};
      attend_rows(rows, kp + h * keys.stride(0), keys.stride(1), vp + h * values.stride(0), values.stride(1),
                  span, d, s, weights, slots);
    }
  });
  return result.to(at::kBFloat16);
}

// Many sequences, one new token each: q [B, heads, D]; keys/values [B, kv_heads, capacity, D];
// row b sees its first lengths[b] slots. Each row's bits are those `attention` gives the same
// token alone over its sequence (the same per-row arithmetic).
torch::Tensor slot_attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values, torch::Tensor lengths,
                             double scale) {
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 4 && values.dim() == 4 && q.scalar_type() == at::kBFloat16 &&
                  keys.scalar_type() == at::kBFloat16 && values.scalar_type() == at::kBFloat16,
              "slot_attention takes bf16 q [B, heads, D] and caches [B, kv_heads, capacity, D]");
  const int64_t batch = q.size(0), heads = q.size(1), d = q.size(2), kv_heads = keys.size(1), capacity = keys.size(2);
  check_heads(heads, kv_heads, d);
  TORCH_CHECK(keys.size(0) >= batch && values.size(0) >= batch && keys.stride(3) == 1 && values.stride(3) == 1,
              "slot_attention: caches do not match the rows");
  auto lens = lengths.to(at::kLong).contiguous();
  TORCH_CHECK(lens.numel() == batch, "slot_attention: one length per row");
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) TORCH_CHECK(lp[b] >= 0 && lp[b] <= capacity, "slot_attention: length past capacity");
  const int64_t group = heads / kv_heads;
  auto qc = q.contiguous();
  auto result = torch::empty({batch, heads, d}, q.options().dtype(at::kFloat));
  const bf16* qb = qc.data_ptr<bf16>();
  float* op = result.data_ptr<float>();
  const float s = static_cast<float>(scale);
  std::vector<char> ones_storage(capacity + 1, 1);
  const bool* ones = reinterpret_cast<const bool*>(ones_storage.data());
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> weights;
    std::vector<int32_t> slots;
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t b = task / kv_heads, h = task % kv_heads, base = b * heads + h * group;
      const Rows rows{qb + base * d, 0, d, op + base * d, 0, d, ones, 0, 1, group, 0, group};
      attend_rows(rows, keys.data_ptr<bf16>() + b * keys.stride(0) + h * keys.stride(1), keys.stride(2),
                  values.data_ptr<bf16>() + b * values.stride(0) + h * values.stride(1), values.stride(2), lp[b], d, s,
                  weights, slots);
    }
  });
  return result.to(at::kBFloat16);
}

// ------------------------------------------------------------------ decoder layer halves
// The rest of a Llama decoder layer around the attention, one call per half, with the
// roundings of the model's own bf16 arithmetic (each op's result rounded to bf16, norms
// in fp32), every row on its own.
static inline float round_bf16(float a) { return static_cast<float>(static_cast<bf16>(a)); }

// The same rounding on whole vectors (c10's round-to-nearest-even, NaN to 0x7fc0), so the
// elementwise ops below run vectorised with the scalar ops' bits: every step is one IEEE
// operation (mul, add, div: correctly rounded either way) followed by that rounding.
#if defined(SB_AVX512BF16)
static inline vec vround(vec a) {
  const __m512i u = _mm512_castps_si512(a);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  r = _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u)));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc00000));
  return _mm512_castsi512_ps(r);
}
static inline void vstore_bf16(bf16* p, vec a) {
  const __m512i high = _mm512_srli_epi32(_mm512_castps_si512(vround(a)), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(high));
}
static inline vec vdiv(vec a, vec b) { return _mm512_div_ps(a, b); }
static inline vec vneg(vec a) { return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_set1_epi32(INT32_MIN))); }
#else
static inline vec vround(vec a) {
  const __m256i u = _mm256_castps_si256(a);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  r = _mm256_and_si256(r, _mm256_set1_epi32(static_cast<int32_t>(0xffff0000u)));
  const __m256 nan = _mm256_cmp_ps(a, a, _CMP_UNORD_Q);
  return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)), nan);
}
static inline void vstore_bf16(bf16* p, vec a) {
  const __m256i high = _mm256_srli_epi32(_mm256_castps_si256(vround(a)), 16);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(high, high), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
static inline vec vdiv(vec a, vec b) { return _mm256_div_ps(a, b); }
static inline vec vneg(vec a) { return _mm256_xor_ps(a, _mm256_set1_ps(-0.0f)); }
#endif

// to[i] = bf16(x[i] + round(add[i])) for n values: a residual add (to may be x).
static void residual_into(const bf16* x, const float* add, int64_t n, bf16* to) {
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) vstore_bf16(to + i, vadd(vload_bf16(x + i), vround(vload(add + i))));
  for (; i < n; ++i) to[i] = static_cast<bf16>(static_cast<float>(x[i]) + round_bf16(add[i]));
}

// HF's LlamaRMSNorm: x * rsqrt(mean(x^2) + eps) in fp32, rounded, times the weight, rounded.
static void rms_norm_rows(const bf16* x, const bf16* w, int64_t rows, int64_t d, double eps, bf16* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const bf16* xr = x + r * d;
    vec acc = vzero();
    int64_t i = 0;
    for (; i + LANES <= d; i += LANES) {
      const vec v = vload_bf16(xr + i);
      acc = vfmadd(v, v, acc);
    }
    float sum = vsum(acc);
    for (; i < d; ++i) sum += static_cast<float>(xr[i]) * static_cast<float>(xr[i]);
    const float scale = 1.0f / std::sqrt(sum / static_cast<float>(d) + static_cast<float>(eps));
    const vec vscale = vset1(scale);
    int64_t j = 0;
    for (; j + LANES <= d; j += LANES)
      vstore_bf16(out + r * d + j, vmul(vload_bf16(w + j), vround(vmul(vload_bf16(xr + j), vscale))));
    for (; j < d; ++j)
      out[r * d + j] = static_cast<bf16>(static_cast<float>(w[j]) * round_bf16(static_cast<float>(xr[j]) * scale));
  }
}

// rms_norm -> qkv projection (+ bias) -> RoPE (HF's rotate_half) on q and k.
// x [rows, d]; cos, sin [rows, head_dim]; returns q [heads, rows, D], k and v [kv_heads, rows, D].
std::vector<torch::Tensor> layer_inputs(torch::Tensor x, torch::Tensor norm, torch::Tensor qkv, int64_t qkv_n,
                                        c10::optional<torch::Tensor> bias, torch::Tensor cos, torch::Tensor sin,
                                        int64_t heads, int64_t kv_heads, double eps) {
  const int64_t rows = x.size(0), d = x.size(1), dim = cos.size(1), half = dim / 2;
  TORCH_CHECK(qkv_n == (heads + 2 * kv_heads) * dim && cos.size(0) == rows && sin.size(0) == rows,
              "layer_inputs: shapes");
  x = x.contiguous(); cos = cos.contiguous(); sin = sin.contiguous();
  auto h = torch::empty_like(x);
  rms_norm_rows(x.data_ptr<bf16>(), norm.contiguous().data_ptr<bf16>(), rows, d, eps, h.data_ptr<bf16>());
  auto y = linear(h, qkv, qkv_n);  // fp32 [rows, qkv_n]
  if (bias.has_value() && bias->defined()) y.add_(bias->to(at::kFloat));
  auto q = torch::empty({heads, rows, dim}, x.options());
  auto k = torch::empty({kv_heads, rows, dim}, x.options());
  auto v = torch::empty({kv_heads, rows, dim}, x.options());
  const float* yp = y.data_ptr<float>();
  const bf16* cp = cos.data_ptr<bf16>();
  const bf16* sp = sin.data_ptr<bf16>();
  bf16* qp = q.data_ptr<bf16>();
  bf16* kp = k.data_ptr<bf16>();
  bf16* vp = v.data_ptr<bf16>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* yr = yp + r * qkv_n;
    const bf16* cr = cp + r * dim;
    const bf16* sr = sp + r * dim;
    for (int64_t head = 0; head < heads + kv_heads; ++head) {
      bf16* out = head < heads ? qp + (head * rows + r) * dim : kp + ((head - heads) * rows + r) * dim;
      const float* in = yr + head * dim;
      if (half % LANES == 0) {  // out = round(round(in) cos) + round(rotate_half(round(in)) sin)
        for (int64_t i = 0; i < half; i += LANES) {
          const vec lo = vround(vload(in + i)), hi = vround(vload(in + half + i));
          const vec c_lo = vload_bf16(cr + i), c_hi = vload_bf16(cr + half + i);
          const vec s_lo = vload_bf16(sr + i), s_hi = vload_bf16(sr + half + i);
          vstore_bf16(out + i, vadd(vround(vmul(lo, c_lo)), vround(vmul(vneg(hi), s_lo))));
          vstore_bf16(out + half + i, vadd(vround(vmul(hi, c_hi)), vround(vmul(lo, s_hi))));
        }
        continue;
      }
      for (int64_t i = 0; i < dim; ++i) {
        const float xi = round_bf16(in[i]);
        const float rot = i < half ? -round_bf16(in[i + half]) : round_bf16(in[i - half]);
        out[i] = static_cast<bf16>(round_bf16(xi * static_cast<float>(cr[i])) + round_bf16(rot * static_cast<float>(sr[i])));
      }
    }
    for (int64_t head = 0; head < kv_heads; ++head) {
      int64_t i = 0;
      for (; i + LANES <= dim; i += LANES)
        vstore_bf16(vp + (head * rows + r) * dim + i, vload(yr + (heads + kv_heads + head) * dim + i));
      for (; i < dim; ++i) vp[(head * rows + r) * dim + i] = static_cast<bf16>(yr[(heads + kv_heads + head) * dim + i]);
    }
  }
  return {q, k, v};
}

static inline void round_into(const torch::Tensor& from, bf16* to) {  // fp32 -> bf16, same shape
  const float* f = from.data_ptr<float>();
  for (int64_t i = 0, n = from.numel(); i < n; ++i) to[i] = static_cast<bf16>(f[i]);
}

// o projection, residual, rms_norm, gate/up projection, silu(gate) * up, down projection,
// residual. x [rows, d]; attn [rows, heads * D] (rows in x's order); returns the new x.
torch::Tensor layer_outputs(torch::Tensor x, torch::Tensor attn, torch::Tensor o, torch::Tensor norm,
                            torch::Tensor gate_up, int64_t gate_up_n, torch::Tensor down, double eps) {
  const int64_t rows = x.size(0), d = x.size(1), inter = gate_up_n / 2;
  x = x.contiguous();
  auto out = torch::empty_like(x);
  bf16* xo = out.data_ptr<bf16>();
  const bf16* xi = x.data_ptr<bf16>();
  {
    auto projected = linear(attn.contiguous(), o, d);
    residual_into(xi, projected.data_ptr<float>(), rows * d, xo);
  }
  auto h = torch::empty_like(x);
  rms_norm_rows(xo, norm.contiguous().data_ptr<bf16>(), rows, d, eps, h.data_ptr<bf16>());
  auto gu = linear(h, gate_up, gate_up_n);  // fp32 [rows, 2 * inter]
  auto act = torch::empty({rows, inter}, x.options());
  {
    const float* g = gu.data_ptr<float>();
    bf16* a = act.data_ptr<bf16>();
    for (int64_t r = 0; r < rows; ++r) {
      const float* gr = g + r * gate_up_n;
      int64_t i = 0;
      alignas(64) float lanes[LANES];
      for (; i + LANES <= inter; i += LANES) {  // silu(gate) = gate / (1 + exp(-gate)), rounded; then * up, rounded
        const vec gate = vround(vload(gr + i));
        const vec silu = vround(vdiv(gate, vadd(vset1(1.0f), vexp(vneg(gate)))));
        vstore_bf16(a + r * inter + i, vmul(silu, vround(vload(gr + inter + i))));
      }
      for (; i < inter; i += LANES) {  // the tail, lane by lane
        const int64_t m = std::min(LANES, inter - i);
        for (int64_t l = 0; l < LANES; ++l) lanes[l] = l < m ? -round_bf16(gr[i + l]) : 0.0f;
        vstore(lanes, vexp(vload(lanes)));
        for (int64_t l = 0; l < m; ++l) {
          const float gate = round_bf16(gr[i + l]);
          const float silu = round_bf16(gate / (1.0f + lanes[l]));
          a[r * inter + i + l] = static_cast<bf16>(silu * round_bf16(gr[inter + i + l]));
        }
      }
    }
  }
  auto mlp = linear(act, down, d);
  residual_into(xo, mlp.data_ptr<float>(), rows * d, xo);
  return out;
}

// A whole decoder layer of a batch-1 pass after the prefill, in one call: the n new rows'
// K/V written at slots [start, start + n) of this layer's cache [kv_heads, capacity, D], their
// attention over the first visible.size(1) slots as `visible` [n, span] allows, then the rest
// of the layer. The same arithmetic as layer_inputs, attention and layer_outputs in turn.
torch::Tensor layer_step(torch::Tensor x, torch::Tensor in_norm, torch::Tensor qkv, int64_t qkv_n,
                         c10::optional<torch::Tensor> bias, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                         torch::Tensor v_cache, int64_t start, torch::Tensor visible, double scale, torch::Tensor o,
                         torch::Tensor post_norm, torch::Tensor gate_up, int64_t gate_up_n, torch::Tensor down,
                         int64_t heads, int64_t kv_heads, double eps) {
  const int64_t n = x.size(0), span = visible.size(1);
  TORCH_CHECK(start + n <= span && span <= k_cache.size(1), "layer_step: the rows do not fit the cache");
  auto qkv_rows = layer_inputs(x, in_norm, qkv, qkv_n, bias, cos, sin, heads, kv_heads, eps);
  k_cache.slice(1, start, start + n).copy_(qkv_rows[1]);
  v_cache.slice(1, start, start + n).copy_(qkv_rows[2]);
  auto attn = attention(qkv_rows[0], k_cache.slice(1, 0, span), v_cache.slice(1, 0, span), visible, scale);
  return layer_outputs(x, attn.transpose(0, 1).reshape({n, -1}), o, post_norm, gate_up, gate_up_n, down, eps);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "bf16 weight [n, K] -> the packed layout `linear` reads");
  m.def("linear", &linear, "rows [..., K] bf16 @ packed weight -> fp32 [..., n], row-invariant");
  m.def("attention", &attention, "row-invariant bf16 attention over a masked span");
  m.def("slot_attention", &slot_attention, "one new token per sequence, each over its own filled slots");
  m.def("layer_inputs", &layer_inputs, "rms_norm, qkv projection and RoPE of a decoder layer");
  m.def("layer_outputs", &layer_outputs, "o projection, residual, MLP and residual of a decoder layer");
  m.def("layer_step", &layer_step, "a whole decoder layer of a batch-1 pass, its K/V written into the cache");
}
