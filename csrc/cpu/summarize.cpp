// CPU kernels for nanscan::summarize and nanscan::summarize_many.
//
// Algorithm (multi-tensor-apply style, also for a single tensor):
//   1. Every input is cut into chunks of kChunk logical elements; the work list is the
//      concatenation of all chunks of all tensors.
//   2. at::parallel_for over the work list; each chunk produces one Partial (record.h) into its own
//      slot, so no thread ever shares an accumulator.
//   3. Each tensor's partials are merged sequentially in chunk order.
// The chunking depends only on the shapes, never on the thread count, so every field -- the FP32
// sums included -- is bitwise identical for any number of threads. Extra memory is one
// Partial per chunk, O(numel / kChunk).
//
// fp64 / fp32 / fp16 / bf16 chunks of contiguous or dense permuted (transposed, channels_last)
// tensors take a vectorized path (at::vec) over memory that assumes the chunk is clean and proves
// it afterwards (see VecState); a chunk holding a NaN / Inf is rescanned by the scalar path, which
// classifies NaN / +Inf / -Inf and maps the memory offset of each to its logical index (LogicalOf).
// Everything else (steps, expanded dims, overlap, float8, integers, bool) uses the scalar path; for
// non-dense strides it walks logical row-major indices directly.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/SmallVector.h>
#include <c10/util/Float8_e4m3fnuz.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Float8_e5m2fnuz.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <type_traits>
#include <vector>

#include "../inputs.h"
#include "../record.h"

namespace nanscan {
namespace {

// 1M elements. Every chunk ends its vector loop, reduces its lanes and restarts: with 64K-element
// chunks that cost bf16 a tenth of a 16M-element record against torch.sum on one thread (1.23 ->
// 1.08 with 1M chunks, benchmarks/record_ratio.py); larger chunks leave fewer to share among threads.
// Every per-lane counter stays exact in its integer type (at most kChunk / 4 elements per lane) and
// every FP32 accumulator takes at most kBlock terms (ChunkPartial).
constexpr int64_t kChunk = int64_t{1} << 20;

// Threads only past this many elements in all (summarize_into).
constexpr int64_t kThreadsFrom = int64_t{1} << 18;

// Floating types narrower than 64 bits: compared and squared in float32, summed in float32.
template <typename T>
constexpr bool kNarrowFloat =
    std::is_same_v<T, float> || std::is_same_v<T, c10::Half> || std::is_same_v<T, c10::BFloat16> ||
    std::is_same_v<T, c10::Float8_e4m3fn> || std::is_same_v<T, c10::Float8_e5m2> ||
    std::is_same_v<T, c10::Float8_e4m3fnuz> || std::is_same_v<T, c10::Float8_e5m2fnuz>;

// Compute type: float32 for narrow floats, float64 for float64, integers and bool. It is also the
// accumulator type of the sums (of values, squares and fourth powers).
template <typename scalar_t>
using cmp_t = std::conditional_t<kNarrowFloat<scalar_t>, float, double>;

inline bool sums_in_fp32(at::ScalarType t) {
  return at::isFloatingType(t) && t != at::kDouble;
}

template <typename scalar_t>
constexpr bool kVectorized = std::is_same_v<scalar_t, double> || std::is_same_v<scalar_t, float> ||
                             std::is_same_v<scalar_t, c10::Half> || std::is_same_v<scalar_t, c10::BFloat16>;

// Maps the position a loop walks (a memory offset for dense permuted tensors) to the logical
// row-major index first_nonfinite_index is defined on. Only called for non-finite elements.
struct Identity {
  int64_t operator()(int64_t i) const { return i; }
};

template <typename acc_t, typename Map = Identity>
inline void note_nonfinite(Partial<acc_t>& p, acc_t v, int64_t index, const Map& map = Map{}) {
  if (std::isnan(v)) {
    ++p.nan;
  } else if (v > 0) {
    ++p.posinf;
  } else {
    ++p.neginf;
  }
  p.first = std::min(p.first, map(index));
}

template <typename acc_t, typename Map = Identity>
inline void accumulate(Partial<acc_t>& p, acc_t v, int64_t index, const Map& map = Map{}) {
  if (!std::isfinite(v)) {
    note_nonfinite(p, v, index, map);
    return;
  }
  p.zero += (v == 0);
  p.min = std::min(p.min, static_cast<double>(v));
  p.max = std::max(p.max, static_cast<double>(v));
  const acc_t x2 = v * v;  // in acc_t: an FP32 square of 1e20 is +inf, as the record contract says
  p.sumsq += x2;
  p.sum += v;
  p.sum4 += x2 * x2;
}

// Every FP32 accumulator (of squares, values or fourth powers) takes at most kBlock terms before its
// sum is set aside and a new one starts; the block sums are then added (and a tensor's chunk sums, in
// merge_chunks, in blocks of kBlock too). The scalar loops' blocks are kBlock consecutive elements, the vector
// loops' (scan_contiguous) kBlock elements per lane, and the CUDA and Triton kernels' threads /
// lanes see at most 256 elements of a chunk, so every path, contiguous or strided, rounds sums of
// the same size. Why it matters: each addition's rounding error scales with the running sum, and
// the squares of 8-16-bit floats have few significant bits whose low ones are biased (the square
// of an integer mantissa is 0 or 1 mod 4), so the roundings do not average out: a sequential FP32
// sum over a 64K chunk of bf16 randn squares comes out ~4e-6 low, a blocked one ~3e-7.
constexpr int64_t kBlock = 256;

// One chunk's partial, fed the partials of its parts -- blocks of the scalar loops, vector runs,
// rows of a strided walk -- kBlock parts at a time: their sums are added into a run, and every
// kBlock parts the run is set aside into `done`, so no FP32 accumulator takes more than kBlock terms
// however many parts a chunk has. (A chunk of at most kBlock parts gives the bits of adding them
// all in order: done is empty, and 0 + x == x.)
template <typename acc_t>
struct ChunkPartial {
  Partial<acc_t> done, run;
  int64_t parts = 0;

  inline void merge(const Partial<acc_t>& part) {
    run.merge(part);
    if (++parts % kBlock == 0) {
      done.merge(run);
      run = Partial<acc_t>();
    }
  }

  Partial<acc_t> result() const {
    Partial<acc_t> all = done;
    all.merge(run);
    return all;
  }
};

template <typename scalar_t, typename Load, typename Map = Identity>
void scan_scalar(int64_t begin, int64_t end, ChunkPartial<cmp_t<scalar_t>>& p, Load load, const Map& map = Map{}) {
  using acc_t = cmp_t<scalar_t>;
  for (int64_t b = begin; b < end; b += kBlock) {
    Partial<acc_t> block;
    const int64_t e = std::min(end, b + kBlock);
    for (int64_t i = b; i < e; ++i) accumulate(block, static_cast<acc_t>(load(i)), i, map);
    p.merge(block);
  }
}

// Logical row-major walk over a strided tensor, after merging dimensions that are contiguous with
// each other (a contiguous tensor collapses to one dimension of stride 1).
struct Geometry {
  // (Inline storage: summarize_many over thousands of small tensors -- a model's parameters and
  // gradients, every step -- makes one Geometry per tensor; heap vectors were most of its cost.)
  c10::SmallVector<int64_t, 6> sizes, strides;  // outermost first
  bool contiguous = false;
  // Dense but permuted (transposed, channels_last): the elements fill [data, data + numel) in
  // some order, so the loops read memory linearly -- vectorized -- and only a non-finite
  // element's memory offset is mapped back to its logical index, with (memory stride, logical
  // stride) pairs sorted by memory stride, outermost first.
  bool dense = false;
  c10::SmallVector<std::pair<int64_t, int64_t>, 6> memory_order;

  explicit Geometry(const at::Tensor& t) {
    // (The common case -- a model's parameters, gradients, activations -- in one cached flag: the
    // dimension walk below was a fifth of summarizing a small tensor.)
    if (t.is_contiguous()) {
      contiguous = true;
      return;
    }
    const auto t_sizes = t.sizes();
    const auto t_strides = t.strides();
    for (size_t d = 0; d < t_sizes.size(); ++d) {
      if (t_sizes[d] == 1) continue;
      if (!sizes.empty() && strides.back() == t_sizes[d] * t_strides[d]) {
        sizes.back() *= t_sizes[d];
        strides.back() = t_strides[d];
      } else {
        sizes.push_back(t_sizes[d]);
        strides.push_back(t_strides[d]);
      }
    }
    contiguous = sizes.empty() || (sizes.size() == 1 && strides[0] == 1);
    dense = !contiguous && t.is_non_overlapping_and_dense();
    if (dense) {
      int64_t logical = 1;
      for (int64_t d = static_cast<int64_t>(sizes.size()) - 1; d >= 0; --d) {
        memory_order.emplace_back(strides[d], logical);
        logical *= sizes[d];
      }
      std::sort(memory_order.begin(), memory_order.end(), [](auto a, auto b) { return a.first > b.first; });
    }
  }
};

struct LogicalOf {
  const Geometry* g;
  int64_t operator()(int64_t offset) const {
    int64_t logical = 0;
    for (const auto& [memory_stride, logical_stride] : g->memory_order) {
      const int64_t q = offset / memory_stride;
      offset -= q * memory_stride;
      logical += q * logical_stride;
    }
    return logical;
  }
};

// The build's vector ISA, as at::vec was compiled for it (setup.py picks the widest the build machine
// has: AVX-512 (F, BW, VL, DQ), else AVX2 + FMA + F16C, else at::vec's portable code).
#if defined(CPU_CAPABILITY_AVX512)
#define NANSCAN_X86_VEC 512
#elif defined(CPU_CAPABILITY_AVX2)
#define NANSCAN_X86_VEC 256
#endif

// A comparison mask (all-one bits in true lanes) reinterpreted as integers, i.e. -1 where true.
// at::vec's generic cast goes through memory; on x86 this is a free register bitcast.
template <typename acc_t>
inline at::vec::Vectorized<at::vec::int_same_size_t<acc_t>> mask_as_int(const at::vec::Vectorized<acc_t>& m) {
#if NANSCAN_X86_VEC == 512
  if constexpr (std::is_same_v<acc_t, float>) {
    return _mm512_castps_si512(m);
  } else {
    return _mm512_castpd_si512(m);
  }
#elif NANSCAN_X86_VEC == 256
  if constexpr (std::is_same_v<acc_t, float>) {
    return _mm256_castps_si256(m);
  } else {
    return _mm256_castpd_si256(m);
  }
#else
  return at::vec::cast<at::vec::int_same_size_t<acc_t>>(m);
#endif
}

// Vectorized fast path, written for the common case of a chunk with no NaN, no Inf and no
// overflowing square: min / max / the three sums (VecState) and the zero count (ZeroCount; fp16 /
// bf16: Raw16) run over raw lanes with no masking, eight instructions per vector of lanes (min, max,
// multiply + add for the square and its sum, FMA for the fourth power, add for the sum, compare +
// integer subtract for the zero count; AVX-512: a compare into a mask register + a masked
// subtract). A NaN or ±Inf input makes its lane's sum of squares NaN or +inf, so "every lane's
// sumsq is finite" proves the chunk clean; otherwise (a non-finite input, or finite squares that
// overflowed FP32) the chunk is rescanned by the scalar path, which classifies every element.
// Those are the rare cases; at worst (all NaN) a chunk is read twice. A fourth power that overflows
// while the squares do not (FP32, |x| ~ 4.3e9 -- 1.8e19) leaves sum4 +inf in a clean chunk: what the
// scalar path gives too. The sum needs no check: |sum| <= sqrt(n * sumsq) stays finite while sumsq
// does.
template <typename acc_t>
struct VecState {
  using Vec = at::vec::Vectorized<acc_t>;
  using IVec = at::vec::Vectorized<at::vec::int_same_size_t<acc_t>>;
  Vec vmin = Vec(std::numeric_limits<acc_t>::infinity());
  Vec vmax = Vec(-std::numeric_limits<acc_t>::infinity());
  Vec sumsq = Vec(acc_t(0)), sum = Vec(acc_t(0)), sum4 = Vec(acc_t(0));  // this block's sums, per lane
  // The finished blocks' sums, per lane: touched once per block, kept out of the element loop's registers.
  Vec blocks_sumsq = Vec(acc_t(0)), blocks_sum = Vec(acc_t(0)), blocks_sum4 = Vec(acc_t(0));

  inline void add(const Vec& v) {
    vmin = at::vec::clamp_max(vmin, v);  // min(vmin, v); NaN lanes only matter on the rescan
    vmax = at::vec::clamp_min(vmax, v);
    add_sums(v);
  }

  // The three sums only (fp16 / bf16 take the rest from their raw lanes: Raw16).
  inline void add_sums(const Vec& v) {
    // The square rounded to acc_t and added, as the scalar path does (not an FMA: the same rounding
    // on every path, and the add runs beside the multiplies; for fp16 / bf16 the square is exact).
    const Vec x2 = v * v;
    sumsq = sumsq + x2;
    sum4 = at::vec::fmadd(x2, x2, sum4);
    sum = sum + v;
  }

  // Sets the block's per-lane sums aside (see kBlock): three adds per vector of lanes per block.
  inline void end_block() {
    blocks_sumsq = blocks_sumsq + sumsq;
    blocks_sum = blocks_sum + sum;
    blocks_sum4 = blocks_sum4 + sum4;
    sumsq = sum = sum4 = Vec(acc_t(0));
  }

  // Reduction of several states in a fixed order -- lanewise across the states first, then one
  // horizontal pass (for small tensors this reduction is most of the work) --; false if the sum of
  // squares is not finite (a non-finite input, or an overflow: the caller rescans, and the scalar
  // path says which).
  template <size_t N>
  static bool flush(VecState (&states)[N], Partial<acc_t>& p) {
    constexpr int n = Vec::size();
    for (auto& state : states) state.end_block();
    Vec vmin = states[0].vmin, vmax = states[0].vmax;
    Vec sumsq = states[0].blocks_sumsq, sum = states[0].blocks_sum, sum4 = states[0].blocks_sum4;
    for (size_t k = 1; k < N; ++k) {
      vmin = at::vec::clamp_max(vmin, states[k].vmin);
      vmax = at::vec::clamp_min(vmax, states[k].vmax);
      sumsq = sumsq + states[k].blocks_sumsq;  // (squares are >= 0: the sum is finite iff every part is)
      sum = sum + states[k].blocks_sum;
      sum4 = sum4 + states[k].blocks_sum4;
    }
#if defined(NANSCAN_X86_VEC)
    if constexpr (std::is_same_v<acc_t, float>) {
      // Three (AVX2) or four (AVX-512) shuffle steps per field instead of a loop over the lanes. The
      // lane sums are >= 0 (or NaN): their total is finite iff every lane is and the total did not
      // overflow.
      const float total = at::vec::vec_reduce_all<float>(std::plus<Vec>(), sumsq);
      if (!std::isfinite(total)) return false;
      p.sumsq += total;
      p.sum += at::vec::vec_reduce_all<float>(std::plus<Vec>(), sum);
      p.sum4 += at::vec::vec_reduce_all<float>(std::plus<Vec>(), sum4);
      p.min = std::min(p.min, static_cast<double>(at::vec::vec_reduce_all<float>(
                                  [](const Vec& a, const Vec& b) { return at::vec::clamp_max(a, b); }, vmin)));
      p.max = std::max(p.max, static_cast<double>(at::vec::vec_reduce_all<float>(
                                  [](const Vec& a, const Vec& b) { return at::vec::clamp_min(a, b); }, vmax)));
      return true;
    }
#endif
    acc_t lmin[n], lmax[n], lsq[n], lsum[n], lsum4[n];
    vmin.store(lmin);
    vmax.store(lmax);
    sumsq.store(lsq);
    sum.store(lsum);
    sum4.store(lsum4);
    for (int i = 0; i < n; ++i) {
      if (!std::isfinite(lsq[i])) return false;
    }
    for (int i = 0; i < n; ++i) {
      p.min = std::min(p.min, static_cast<double>(lmin[i]));
      p.max = std::max(p.max, static_cast<double>(lmax[i]));
      p.sumsq += lsq[i];
      p.sum += lsum[i];
      p.sum4 += lsum4[i];
    }
    return true;
  }
};

// The zero count of a vector loop, one counter for all its accumulator sets (its chain is one integer
// add per vector: no latency to hide): each true lane of (v == 0) adds -1. A lane counts at most
// kChunk / Vec::size() elements: exact in its integer type.
template <typename acc_t>
struct ZeroCount {
  using Vec = at::vec::Vectorized<acc_t>;
  using IVec = at::vec::Vectorized<at::vec::int_same_size_t<acc_t>>;
  IVec neg_zeros = IVec(0);

  inline void add(const Vec& v) {
#if NANSCAN_X86_VEC == 512
    // AVX-512 compares into a mask register: one masked subtract, not a mask widened to a vector and added.
    if constexpr (std::is_same_v<acc_t, float>) {
      neg_zeros = _mm512_mask_sub_epi32(neg_zeros, _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_EQ_OQ),
                                        neg_zeros, _mm512_set1_epi32(1));
    } else {
      neg_zeros = _mm512_mask_sub_epi64(neg_zeros, _mm512_cmp_pd_mask(v, _mm512_setzero_pd(), _CMP_EQ_OQ),
                                        neg_zeros, _mm512_set1_epi64(1));
    }
#else
    neg_zeros = neg_zeros + mask_as_int(v == Vec(acc_t(0)));
#endif
  }

  inline void write(Partial<acc_t>& p) const {
    at::vec::int_same_size_t<acc_t> lanes[IVec::size()];
    neg_zeros.store(lanes);
    for (int i = 0; i < IVec::size(); ++i) p.zero -= static_cast<int64_t>(lanes[i]);
  }
};

#if defined(NANSCAN_X86_VEC)
// The raw 16-bit lanes of one vector register, at the build's width: the few integer operations
// Raw16 needs, in one place for both widths.
namespace raw {
#if NANSCAN_X86_VEC == 512
using Vec = __m512i;
inline Vec load(const void* p) { return _mm512_loadu_si512(p); }
inline void store(void* p, Vec v) { _mm512_storeu_si512(p, v); }
inline Vec zero() { return _mm512_setzero_si512(); }
inline Vec set1_16(int16_t x) { return _mm512_set1_epi16(x); }
inline Vec max_i16(Vec a, Vec b) { return _mm512_max_epi16(a, b); }
inline Vec min_u16(Vec a, Vec b) { return _mm512_min_epu16(a, b); }
inline Vec max_u16(Vec a, Vec b) { return _mm512_max_epu16(a, b); }
// The number of 16-bit lanes of v whose bits but the sign are zero (+-0 in fp16 and bf16): a test
// into a mask register and a popcount on the scalar side, off the vector pipes the sums need.
struct ZeroCount16 {
  int64_t zeros = 0;
  inline void add(Vec v) { zeros += __builtin_popcount(_cvtmask32_u32(_mm512_testn_epi16_mask(v, set1_16(0x7FFF)))); }
  inline void end_block() {}
  inline int64_t total() const { return zeros; }
};
// bf16 -> fp32 is "bits << 16": interleaving with zeros widens a register in two instructions. The
// lanes come out permuted, which no field depends on.
inline __m512 bf16_lo(Vec v) { return _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero(), v)); }
inline __m512 bf16_hi(Vec v) { return _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero(), v)); }
inline __m512 fp16_lo(Vec v) { return _mm512_cvtph_ps(_mm512_castsi512_si256(v)); }
inline __m512 fp16_hi(Vec v) { return _mm512_cvtph_ps(_mm512_extracti64x4_epi64(v, 1)); }
#else
using Vec = __m256i;
inline Vec load(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline void store(void* p, Vec v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
inline Vec zero() { return _mm256_setzero_si256(); }
inline Vec set1_16(int16_t x) { return _mm256_set1_epi16(x); }
inline Vec max_i16(Vec a, Vec b) { return _mm256_max_epi16(a, b); }
inline Vec min_u16(Vec a, Vec b) { return _mm256_min_epu16(a, b); }
inline Vec max_u16(Vec a, Vec b) { return _mm256_max_epu16(a, b); }
// The same on AVX2 (no mask registers): (bits << 1) == 0 is -1 in a zero's lane, added to a 16-bit
// counter that takes at most one per vector and is folded into 32 bits every block (<= 256 vectors).
struct ZeroCount16 {
  Vec neg16 = zero(), neg32 = zero();
  inline void add(Vec v) { neg16 = _mm256_add_epi16(neg16, _mm256_cmpeq_epi16(_mm256_add_epi16(v, v), zero())); }
  inline void end_block() {
    neg32 = _mm256_add_epi32(neg32, _mm256_madd_epi16(neg16, set1_16(1)));
    neg16 = zero();
  }
  inline int64_t total() const {
    int32_t lanes[8];
    store(lanes, neg32);
    int64_t zeros = 0;
    for (int32_t lane : lanes) zeros -= lane;
    return zeros;
  }
};
inline __m256 bf16_lo(Vec v) { return _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero(), v)); }
inline __m256 bf16_hi(Vec v) { return _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero(), v)); }
inline __m256 fp16_lo(Vec v) { return _mm256_cvtph_ps(_mm256_castsi256_si128(v)); }
inline __m256 fp16_hi(Vec v) { return _mm256_cvtph_ps(_mm256_extracti128_si256(v, 1)); }
#endif
constexpr int kLanes16 = sizeof(Vec) / 2;
}  // namespace raw

// The zero count, min and max of fp16 / bf16 vectors, taken on their raw 16-bit lanes before they are
// widened, one set for all the accumulator sets: five (AVX2: six) integer instructions per register
// of 16-bit lanes where the widened floats take eight (two compares, two adds, two min, two max), and
// a set of registers per accumulator set that AVX2's 16 do not have (a set that does not fit is
// spilled to the stack inside the loop, its chains waiting on store-to-load forwarding).
//   zeros: raw::ZeroCount16.
//   min / max: both formats are sign-magnitude, so as signed 16-bit integers the non-negative values
//     order as their floats (and above every negative one), and as unsigned integers the negative
//     values order by magnitude (above every non-negative one). The largest float is the signed
//     maximum when it is >= 0, else (all negative) the unsigned minimum; the smallest float is the
//     unsigned maximum when it is negative, else (none negative) the unsigned minimum. Exact; a NaN
//     or Inf lane does not matter (such a chunk is rescanned).
struct Raw16 {
  raw::ZeroCount16 zeros;
  raw::Vec smax = raw::set1_16(INT16_MIN), umin = raw::set1_16(-1), umax = raw::zero();

  inline void add(raw::Vec v) {
    zeros.add(v);
    smax = raw::max_i16(smax, v);
    umin = raw::min_u16(umin, v);
    umax = raw::max_u16(umax, v);
  }

  inline void end_block() { zeros.end_block(); }

  // Adds the zero count, min and max to p.
  template <typename scalar_t>
  void write(Partial<float>& p) {
    end_block();
    p.zero += zeros.total();
    int16_t sm[raw::kLanes16];
    uint16_t un[raw::kLanes16], ux[raw::kLanes16];
    raw::store(sm, smax);
    raw::store(un, umin);
    raw::store(ux, umax);
    const int16_t hs = *std::max_element(std::begin(sm), std::end(sm));
    const uint16_t hn = *std::min_element(std::begin(un), std::end(un));
    const uint16_t hx = *std::max_element(std::begin(ux), std::end(ux));
    const auto as_float = [](uint16_t bits) {
      return static_cast<double>(static_cast<float>(scalar_t(bits, scalar_t::from_bits())));
    };
    p.max = std::max(p.max, hs >= 0 ? as_float(static_cast<uint16_t>(hs)) : as_float(hn));
    p.min = std::min(p.min, hx >= 0x8000 ? as_float(hx) : as_float(hn));
  }
};
#endif

template <typename scalar_t, typename Map = Identity>
void scan_contiguous(const scalar_t* data, int64_t begin, int64_t end, ChunkPartial<cmp_t<scalar_t>>& p,
                     const Map& map = Map{}) {
  using acc_t = cmp_t<scalar_t>;
  auto load = [&](int64_t i) { return data[i]; };
  if constexpr (kVectorized<scalar_t>) {
    using In = at::vec::Vectorized<scalar_t>;
    // Two independent accumulator sets: enough to hide the FMA / add latency of the loop-carried
    // chains behind eight instructions per vector, and few enough registers for AVX2's 16 -- 2 x 5
    // accumulators and one zero counter (2 x 3 sums and one Raw16 set for fp16 / bf16), the loaded
    // vector and temporaries; a set that does not fit is spilled to the stack inside the loop, which
    // costs more than the latency the extra set would hide (four sets did). (AVX-512's 32
    // registers hold four sets, but they measured no faster: the loop is throughput-bound.)
    constexpr int64_t kUnroll = 2;
    constexpr int64_t kStep = kUnroll * In::size();
    VecState<acc_t> states[kUnroll];
    ZeroCount<acc_t> zeros;
#if defined(NANSCAN_X86_VEC)
    constexpr bool kRaw16 = std::is_same_v<scalar_t, c10::BFloat16> || std::is_same_v<scalar_t, c10::Half>;
    struct None {};
    std::conditional_t<kRaw16, Raw16, None> raw16;  // fp16 / bf16: zero count, min and max (zeros unused)
#endif
    auto add = [&](VecState<acc_t>& state, const scalar_t* src) {
#if defined(NANSCAN_X86_VEC)
      if constexpr (kRaw16) {
        const raw::Vec v = raw::load(src);
        raw16.add(v);
        if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
          state.add_sums(raw::bf16_lo(v));
          state.add_sums(raw::bf16_hi(v));
        } else {
          state.add_sums(raw::fp16_lo(v));
          state.add_sums(raw::fp16_hi(v));
        }
        return;
      }
#endif
      const In v = In::loadu(src);
      if constexpr (std::is_same_v<scalar_t, acc_t>) {
        state.add(v);
        zeros.add(v);
      } else {
        auto [lo, hi] = at::vec::convert_to_float<scalar_t>(v);
        state.add(lo);
        zeros.add(lo);
        state.add(hi);
        zeros.add(hi);
      }
    };
    // A step gives every lane In::size() / Vec::size() elements (two for fp16 / bf16, widened into
    // two float vectors); a block gives every lane kBlock of them, as the scalar loops' blocks.
    constexpr int64_t kPerLane = In::size() / at::vec::Vectorized<acc_t>::size();
    constexpr int64_t kBlockElems = kStep * (kBlock / kPerLane);
    static_assert(kBlock % kPerLane == 0, "a block is whole steps");
    const int64_t unrolled_end = begin + (end - begin) / kStep * kStep;
    for (int64_t i = begin; i < unrolled_end;) {
      const int64_t block_end = std::min(unrolled_end, i + kBlockElems);
      for (; i < block_end; i += kStep) {
        for (int64_t u = 0; u < kUnroll; ++u) add(states[u], data + i + u * In::size());
      }
      for (auto& state : states) state.end_block();
#if defined(NANSCAN_X86_VEC)
      if constexpr (kRaw16) raw16.end_block();
#endif
    }
    // The whole vectors left (all of a tensor shorter than one unrolled step: a bias, an
    // activation of a small layer) go into the first state; only the last partial vector is scalar.
    const int64_t vec_end = begin + (end - begin) / In::size() * In::size();
    for (int64_t i = unrolled_end; i < vec_end; i += In::size()) add(states[0], data + i);
    if (vec_end > begin) {  // (a tensor shorter than one vector has no vector part to reduce)
      Partial<acc_t> vec_part;
      if (VecState<acc_t>::flush(states, vec_part)) {
#if defined(NANSCAN_X86_VEC)
        if constexpr (kRaw16) {
          raw16.template write<scalar_t>(vec_part);
        } else {
          zeros.write(vec_part);
        }
#else
        zeros.write(vec_part);
#endif
        p.merge(vec_part);
      } else {
        scan_scalar<scalar_t>(begin, vec_end, p, load, map);  // a NaN, an Inf, or an FP32 overflow
      }
    }
    scan_scalar<scalar_t>(vec_end, end, p, load, map);
  } else {
    scan_scalar<scalar_t>(begin, end, p, load, map);
  }
}

template <typename scalar_t>
void scan_strided(const scalar_t* data, const Geometry& g, int64_t begin, int64_t end,
                  ChunkPartial<cmp_t<scalar_t>>& p) {
  using acc_t = cmp_t<scalar_t>;
  const int64_t nd = static_cast<int64_t>(g.sizes.size());
  if (nd == 0) {  // 0-dim or all-ones shape: a single element
    scan_scalar<scalar_t>(begin, end, p, [&](int64_t) { return data[0]; });
    return;
  }
  std::vector<int64_t> counter(nd);
  int64_t rest = begin;
  for (int64_t d = nd - 1; d >= 0; --d) {
    counter[d] = rest % g.sizes[d];
    rest /= g.sizes[d];
  }
  const int64_t inner_stride = g.strides[nd - 1];
  int64_t index = begin;
  while (index < end) {
    int64_t offset = 0;
    for (int64_t d = 0; d < nd; ++d) offset += counter[d] * g.strides[d];
    const int64_t run = std::min(g.sizes[nd - 1] - counter[nd - 1], end - index);
    const scalar_t* row = data + offset - index * inner_stride;  // row[i * inner_stride], i logical
    if (inner_stride == 1) {
      // Rows that are contiguous but not adjacent (x[:, a:b], the q / k / v views of a fused
      // projection): each run takes the vectorized path, indexed by its logical positions.
      scan_contiguous(row, index, index + run, p);
    } else {
      scan_scalar<scalar_t>(index, index + run, p, [&](int64_t i) { return row[i * inner_stride]; });
    }
    index += run;
    counter[nd - 1] += run;
    for (int64_t d = nd - 1; d > 0 && counter[d] == g.sizes[d]; --d) {
      counter[d] = 0;
      ++counter[d - 1];
    }
  }
}

// Partials are stored uniformly as Partial<double>; FP32 sums are carried exactly and rounded back to
// FP32 at every merge (merge_chunks), so the accumulation stays FP32 end to end.
template <typename acc_t>
Partial<double> widened(const Partial<acc_t>& p) {
  Partial<double> out;
  out.nan = p.nan;
  out.posinf = p.posinf;
  out.neginf = p.neginf;
  out.zero = p.zero;
  out.min = p.min;
  out.max = p.max;
  out.first = p.first;
  out.sumsq = p.sumsq;
  out.sum = p.sum;
  out.sum4 = p.sum4;
  return out;
}

template <typename scalar_t>
void scan_chunk(const at::Tensor& t, const Geometry& g, int64_t begin, int64_t end, Partial<double>& out) {
  ChunkPartial<cmp_t<scalar_t>> p;
  const scalar_t* data = t.const_data_ptr<scalar_t>();
  if (g.contiguous) {
    scan_contiguous(data, begin, end, p);
  } else if (g.dense) {
    scan_contiguous(data, begin, end, p, LogicalOf{&g});
  } else {
    scan_strided(data, g, begin, end, p);
  }
  out = widened(p.result());
}

#define NANSCAN_CPU_CASE(enum_type, cpp_type) \
  case at::enum_type:                          \
    return scan_chunk<cpp_type>(t, g, begin, end, out);

void scan_any(const at::Tensor& t, const Geometry& g, int64_t begin, int64_t end, Partial<double>& out) {
  switch (t.scalar_type()) {
    NANSCAN_FORALL_REAL_DTYPES(NANSCAN_CPU_CASE)
    default:
      TORCH_CHECK_TYPE(false, "nanscan: unexpected dtype ", t.scalar_type(), " (", kSupportedText, ")");
  }
}
#undef NANSCAN_CPU_CASE

struct WorkItem {
  int64_t tensor, begin, end;
};

// One input's record from its chunks, scanned and merged in order: each FP32 sum (of squares,
// values, fourth powers) of an FP32 input is the FP32 sum of the chunks' FP32 sums, as in the
// threaded path below -- in blocks of kBlock chunks too (a tensor of more than 256M elements has more
// than kBlock chunks).
template <typename Scan>
void merge_chunks(const at::Tensor& input, int64_t n_chunks, Scan scan, double* out) {
  Partial<double> total;
  Partial<float> sums32, block32;  // (only the sums are used)
  for (int64_t c = 0; c < n_chunks; ++c) {
    const Partial<double>& part = scan(c);
    total.merge(part);
    block32.sumsq += static_cast<float>(part.sumsq);
    block32.sum += static_cast<float>(part.sum);
    block32.sum4 += static_cast<float>(part.sum4);
    if ((c + 1) % kBlock == 0) {
      sums32.merge(block32);
      block32 = Partial<float>();
    }
  }
  sums32.merge(block32);
  if (sums_in_fp32(input.scalar_type())) {
    total.sumsq = sums32.sumsq;
    total.sum = sums32.sum;
    total.sum4 = sums32.sum4;
  }
  total.write(out);
}

// One tensor's record, its chunks scanned and merged in order on this thread: the serial path (the
// threaded one below merges the same chunks in the same order, so the bits do not depend on the path).
// The record of n <= kChunk contiguous elements of `dtype` at `data`: one chunk, so the chunk's
// partial, its FP32 sums as they are (what merge_chunks makes of one chunk: 0 + x == x).
void summarize_contiguous_chunk(const void* data, int64_t n, at::ScalarType dtype, double* out) {
#define NANSCAN_CPU_CASE(enum_type, cpp_type)                     \
  case at::enum_type: {                                           \
    ChunkPartial<cmp_t<cpp_type>> p;                              \
    scan_contiguous(static_cast<const cpp_type*>(data), 0, n, p); \
    widened(p.result()).write(out);                               \
    return;                                                       \
  }
  switch (dtype) {
    NANSCAN_FORALL_REAL_DTYPES(NANSCAN_CPU_CASE)
    default:
      TORCH_CHECK_TYPE(false, "nanscan: unexpected dtype ", dtype, " (", kSupportedText, ")");
  }
#undef NANSCAN_CPU_CASE
}

void summarize_serial(const at::Tensor& t, double* out) {
  const int64_t n = t.numel();
  if (n <= kChunk && t.is_contiguous()) {
    // One contiguous chunk -- nearly every tensor a monitor summarizes: the same scan as below (the
    // same bits) without the chunk machinery, which cost more than scanning a small tensor.
    summarize_contiguous_chunk(t.const_data_ptr(), n, t.scalar_type(), out);
    return;
  }
  const Geometry g(t);
  Partial<double> part;
  merge_chunks(t, (n + kChunk - 1) / kChunk, [&](int64_t c) -> const Partial<double>& {
    part = Partial<double>();
    scan_any(t, g, c * kChunk, std::min(n, (c + 1) * kChunk), part);
    return part;
  }, out);
}

// Inputs as the kernels read them (normalized_input): borrowed handles where nothing was converted.
using Inputs = c10::SmallVector<c10::MaybeOwned<at::Tensor>, 1>;

// Writes one record per input into rows of `out` ([n, kRecordSize] float64, contiguous).
void summarize_into(const Inputs& inputs, double* out) {
  int64_t total = 0;
  for (const auto& x : inputs) total += x->numel();
  // Threads only past kThreadsFrom elements (256K) in all, and never for a single chunk: many small
  // tensors (a model's parameters and gradients, summarized by the monitor every step) are a few
  // microseconds of work, less than waking the pool -- and on a busy machine a descheduled pool
  // thread makes the whole call wait. Then each tensor is scanned and written in turn, with no work
  // list.
  if (total <= kThreadsFrom || (inputs.size() == 1 && total <= kChunk)) {
    for (size_t k = 0; k < inputs.size(); ++k) summarize_serial(*inputs[k], out + k * kRecordSize);
    return;
  }
  std::vector<Geometry> geometry;
  std::vector<WorkItem> work;
  std::vector<int64_t> first_item(inputs.size() + 1, 0);
  geometry.reserve(inputs.size());
  for (size_t k = 0; k < inputs.size(); ++k) {
    geometry.emplace_back(*inputs[k]);
    first_item[k] = static_cast<int64_t>(work.size());
    const int64_t n = inputs[k]->numel();
    for (int64_t b = 0; b < n; b += kChunk) work.push_back({static_cast<int64_t>(k), b, std::min(n, b + kChunk)});
  }
  first_item[inputs.size()] = static_cast<int64_t>(work.size());

  std::vector<Partial<double>> partials(work.size());
  const int64_t n_items = static_cast<int64_t>(work.size());
  at::parallel_for(0, n_items, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t w = lo; w < hi; ++w) {
      const WorkItem& item = work[w];
      scan_any(*inputs[item.tensor], geometry[item.tensor], item.begin, item.end, partials[w]);
    }
  });

  for (size_t k = 0; k < inputs.size(); ++k) {
    const int64_t first = first_item[k];
    merge_chunks(*inputs[k], first_item[k + 1] - first,
                 [&](int64_t c) -> const Partial<double>& { return partials[first + c]; }, out + k * kRecordSize);
  }
}

Inputs normalize_all(at::TensorList xs, const char* op) {
  check_one_device(xs, op);
  Inputs inputs;
  inputs.reserve(xs.size());
  for (const at::Tensor& x : xs) {
    TORCH_CHECK_VALUE(!x.defined() || x.device().is_cpu(), op, ": this is the CPU kernel, got a tensor on ",
                      x.device());
    inputs.push_back(normalized_input(x, op));
  }
  return inputs;
}

at::Tensor summarize_cpu(const at::Tensor& x) {
  auto inputs = normalize_all({x}, "nanscan.summarize");
  at::Tensor out = at::empty({kRecordSize}, x.options().dtype(at::kDouble));
  summarize_into(inputs, out.mutable_data_ptr<double>());
  return out;
}

at::Tensor summarize_many_cpu(at::TensorList xs) {
  auto inputs = normalize_all(xs, "nanscan.summarize_many");
  at::Tensor out = at::empty({static_cast<int64_t>(xs.size()), kRecordSize},
                             at::TensorOptions().dtype(at::kDouble).device(at::kCPU));
  summarize_into(inputs, out.mutable_data_ptr<double>());
  return out;
}

}  // namespace

// The record of a contiguous real tensor's copy (n elements of `dtype` at `data`, n <= kChunk): what
// summarize_cpu computes for the tensor (the same scan, the same bits), for records whose values
// were copied on arrival and are summarized later, in one pass (grad_sink.h: HostRows).
void summarize_cpu_copy(const void* data, int64_t n, at::ScalarType dtype, double* out) {
  TORCH_CHECK(n <= kChunk, "nanscan: summarize_cpu_copy takes at most ", kChunk, " elements, got ", n);
  summarize_contiguous_chunk(data, n, dtype, out);
}

// One CPU tensor's record into out[0:RECORD_SIZE]: what summarize_cpu computes (the same chunks,
// the same bits), for the monitor's records made on arrival (csrc/monitor/grad_sink.h).
void summarize_cpu_row(const at::Tensor& x, double* out) {
  TORCH_CHECK_VALUE(x.device().is_cpu(), "nanscan.summarize: this is the CPU kernel, got a tensor on ", x.device());
  const auto t = normalized_input(x, "nanscan.summarize");
  if (t->numel() <= std::max(kThreadsFrom, kChunk)) {  // (summarize_into's serial path, without a list of one)
    summarize_serial(*t, out);
    return;
  }
  Inputs inputs;
  inputs.push_back(c10::MaybeOwned<at::Tensor>::borrowed(*t));
  summarize_into(inputs, out);
}

TORCH_LIBRARY_IMPL(nanscan, CPU, m) {
  m.impl("summarize", &summarize_cpu);
  m.impl("summarize_many", &summarize_many_cpu);
}

}  // namespace nanscan
