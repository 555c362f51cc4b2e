// nanscan CUDA backend, device side (1 of 2): what one thread and one block reduce. The shape of a
// block, a run and a chunk (constants), the per-dtype traits, a thread's state in the first pass
// (Fast) and in the classifying pass (Acc), the warp / block tree that merges them, and the packed
// 16-bit lanes of fp16 / bf16 / float8. How chunks are walked and the kernels: kernels.cuh.
//
// Included only by summarize.cu (one translation unit): everything is in nanscan's anonymous
// namespace there, as it is here.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "../record.h"

namespace nanscan {
namespace {

constexpr int kBlock = 256;
constexpr int kWarps = kBlock / 32;
constexpr int kUnroll = 4;          // loads in flight per thread
constexpr int kVecBytes = 16;       // one LDG.128 per vector
// A chunk is walked as runs of kSegment elements: a thread's squares (values, fourth powers) are
// summed in runs of kSegment / kBlock = 256 (the record contract: FP32 sums in blocks of at most 256
// terms), and the
// packed lanes of a run are folded into 32-bit counts before the next run starts. See Note [runs]
// (kernels.cuh).
constexpr int64_t kSegment = 65536;
// Chunk sizes: See Note [chunk size] (summarize.cu).
constexpr int64_t kMinChunk = 4096, kMaxChunk = int64_t{1} << 20, kTargetChunks = 2048;
constexpr int kMaxDims = 25;        // after coalescing; beyond it we fall back to a contiguous copy
// 4 resident blocks of 256 threads per SM cap a kernel at 65536 / 1024 = 64 registers per thread.
constexpr int kMinBlocksPerSM = 4;
constexpr unsigned kFullMask = 0xffffffffu;

// Bounds of a chunk (every size a power of two). In-chunk offsets (and vector counts) are int; a
// thread's zero / NaN / Inf counts are uint32, and so are their block sums (<= kMaxChunk). A thread
// takes at most kSegment / (kVec * kBlock) vectors of a run, so a packed lane (two per 32 bits, folded
// at the end of each run) counts at most kSegment / (2 * kBlock) = 128 zeros: exact in bf16 (integers
// <= 256) and fp16 (<= 2048), whatever the chunk. Integers of <= 16 bits square to <= 2**30 and are
// summed exactly in int64: a chunk's sum stays <= kMaxChunk * 2**30 = 2**50, exact in fp64.
static_assert(kMaxChunk <= (int64_t{1} << 30), "in-chunk offsets are int");
static_assert(kMaxChunk <= int64_t{UINT32_MAX}, "per-chunk counts are uint32");
static_assert(kSegment / (2 * kBlock) <= 256, "packed zero counts must stay exact in bf16");
static_assert(kSegment / kBlock <= 256, "a thread sums at most 256 squares per run");
static_assert(kSegment % kVecBytes == 0, "runs start on 16-byte vectors (aligned: no head / tail)");
static_assert(kMinChunk <= kSegment && kMaxChunk % kSegment == 0, "a chunk is one run or whole runs");
static_assert(kMaxChunk <= (int64_t{1} << 23), "int16 squares: a chunk's sum must be exact in fp64");

// Per dtype: V, the type elements are compared in (exact for every value of the dtype); S, the
// per-thread sum of squares and of values; S4, the per-thread sum of fourth powers; A, the
// accumulator of the record contract (fp32 for <=32-bit floats, fp64 for fp64 and integers).
// Integers up to 16 bits square exactly in int32 and a thread sums at most kMaxChunk / kBlock = 4096
// of them, so their S is an exact int64 (then converted to fp64 exactly, a chunk's sum being
// <= 2**50): the value of fp64 accumulation, and byte-sized inputs avoid 64-bit compares and fp64
// FMAs. Fourth powers (<= 2**60) are summed in fp64 for every integer dtype.
template <typename T> struct Traits {
  using V = float; using S = float; using S4 = float; using A = float; static constexpr bool kFloat = true;
};
template <> struct Traits<double> {
  using V = double; using S = double; using S4 = double; using A = double; static constexpr bool kFloat = true;
};
#define NANSCAN_INT_TRAITS(T, V_, S_)                                                                  \
  template <> struct Traits<T> {                                                                       \
    using V = V_; using S = S_; using S4 = double; using A = double; static constexpr bool kFloat = false; \
  };
NANSCAN_INT_TRAITS(bool, int32_t, int64_t)
NANSCAN_INT_TRAITS(uint8_t, int32_t, int64_t)
NANSCAN_INT_TRAITS(int8_t, int32_t, int64_t)
NANSCAN_INT_TRAITS(int16_t, int32_t, int64_t)
NANSCAN_INT_TRAITS(int32_t, int64_t, double)
NANSCAN_INT_TRAITS(int64_t, int64_t, double)
#undef NANSCAN_INT_TRAITS

template <typename T> __device__ __forceinline__ typename Traits<T>::V to_val(T x) {
  return static_cast<typename Traits<T>::V>(x);
}
// c10 converts OCP float8 in software; sm_89+ has a hardware fp8 -> fp16 cvt (exact), and e5m2 is
// the top byte of an fp16 on every arch. The fnuz formats keep c10's conversion.
template <> __device__ __forceinline__ float to_val(c10::Float8_e4m3fn x) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(x.x, __NV_E4M3)));
}
template <> __device__ __forceinline__ float to_val(c10::Float8_e5m2 x) {
  __half_raw h;
  h.x = static_cast<unsigned short>(x.x << 8);
  return __half2float(__half(h));
}

template <typename T> __device__ __forceinline__ bool finite(T x) {
  if constexpr (Traits<T>::kFloat) return isfinite(to_val(x));
  else return true;
}

// min / max that drop a NaN operand (fmin / fmax) for floats; only finite values reach them in a
// record (a chunk whose first pass met a NaN is classified again).
template <typename V> __device__ __forceinline__ V vmin(V a, V b) {
  if constexpr (std::is_floating_point_v<V>) return fmin(a, b);
  else return b < a ? b : a;
}
template <typename V> __device__ __forceinline__ V vmax(V a, V b) {
  if constexpr (std::is_floating_point_v<V>) return fmax(a, b);
  else return b > a ? b : a;
}

// The assume-finite state of one thread (first pass): zero count, min, max, sums of squares, values
// and fourth powers. For integer dtypes it is the whole record. See Note [assume, then prove]
// (kernels.cuh).
template <typename T> struct Fast {
  using V = typename Traits<T>::V;
  using S = typename Traits<T>::S;
  using S4 = typename Traits<T>::S4;
  using A = typename Traits<T>::A;
  uint32_t zero = 0;
  V mn = std::numeric_limits<V>::has_infinity ? std::numeric_limits<V>::infinity() : std::numeric_limits<V>::max();
  V mx = std::numeric_limits<V>::has_infinity ? -std::numeric_limits<V>::infinity() : std::numeric_limits<V>::lowest();
  S ss = 0, s1 = 0;
  S4 s4 = 0;

  __device__ __forceinline__ void add(T raw) {
    const V v = to_val(raw);
    zero += v == V(0);
    mn = vmin(mn, v);
    mx = vmax(mx, v);
    add_sums(v);
  }

  // ss += v * v, s1 += v, s4 += (v * v) ** 2. Floats: squared in V (1e20 in fp32 gives inf, as the
  // record contract says), the square rounded before it is squared again (so x**4 = fl(x**2)**2, as
  // the CPU kernel and the reference compute it).
  __device__ __forceinline__ void add_sums(V v) {
    if constexpr (Traits<T>::kFloat) {
      ss = fma(v, v, ss);
      const V x2 = v * v;
      s4 = fma(x2, x2, s4);
      s1 += v;
    } else if constexpr (std::is_integral_v<S>) {  // <= 16-bit integers: squares <= 2**30, exact in int32
      const V x2 = v * v;
      ss += x2;
      s1 += v;
      s4 = fma(double(x2), double(x2), s4);
    } else {
      const S d = S(v);
      const S x2 = d * d;
      ss += x2;
      s1 += d;
      s4 = fma(x2, x2, s4);
    }
  }

  // True when every element added was finite (floats: a NaN / Inf square is NaN / Inf and a sum of
  // non-negative terms never gets back to finite); false also when the sum of squares overflowed.
  __device__ __forceinline__ bool clean() const {
    if constexpr (Traits<T>::kFloat) return isfinite(ss);
    else return true;
  }

  __device__ __forceinline__ void merge(const Fast& o) {
    zero += o.zero;
    mn = vmin(mn, o.mn);
    mx = vmax(mx, o.mx);
    ss += o.ss;
    s1 += o.s1;
    s4 += o.s4;
  }

  __device__ __forceinline__ Partial<A> partial() const {
    Partial<A> p;
    p.zero = zero;
    if (mn <= mx) p.min = static_cast<double>(mn), p.max = static_cast<double>(mx);  // else +-inf
    p.sumsq = static_cast<A>(ss);
    p.sum = static_cast<A>(s1);
    p.sum4 = static_cast<A>(s4);
    return p;
  }
};

template <typename T> __device__ __forceinline__ Fast<T> shfl_down(const Fast<T>& f, int o) {
  Fast<T> q;
  q.zero = __shfl_down_sync(kFullMask, f.zero, o);
  q.mn = __shfl_down_sync(kFullMask, f.mn, o);
  q.mx = __shfl_down_sync(kFullMask, f.mx, o);
  q.ss = __shfl_down_sync(kFullMask, f.ss, o);
  q.s1 = __shfl_down_sync(kFullMask, f.s1, o);
  q.s4 = __shfl_down_sync(kFullMask, f.s4, o);
  return q;
}

// The classifying state of one thread (second pass of a chunk that was not proved clean).
template <typename T> struct Acc {
  using A = typename Traits<T>::A;
  Fast<T> fin;  // the finite elements
  uint32_t nan = 0, posinf = 0, neginf = 0;
  int64_t first = kNoIndex;

  // w is the walk index; index(w) is its logical row-major index, computed for non-finite elements only.
  template <class Index>
  __device__ __forceinline__ void add(T raw, int64_t w, const Index& index) {
    if (finite(raw)) return fin.add(raw);
    const auto v = to_val(raw);
    nan += v != v;
    posinf += v > decltype(v)(0);
    neginf += v < decltype(v)(0);
    const int64_t l = index(w);
    first = l < first ? l : first;
  }

  __device__ __forceinline__ Partial<A> partial() const {
    Partial<A> p = fin.partial();
    p.nan = nan, p.posinf = posinf, p.neginf = neginf;
    p.first = first;
    return p;
  }
};

template <typename A> __device__ __forceinline__ Partial<A> shfl_down(const Partial<A>& p, int o) {
  Partial<A> q;
  q.nan = __shfl_down_sync(kFullMask, p.nan, o);
  q.posinf = __shfl_down_sync(kFullMask, p.posinf, o);
  q.neginf = __shfl_down_sync(kFullMask, p.neginf, o);
  q.zero = __shfl_down_sync(kFullMask, p.zero, o);
  q.min = __shfl_down_sync(kFullMask, p.min, o);
  q.max = __shfl_down_sync(kFullMask, p.max, o);
  q.sumsq = __shfl_down_sync(kFullMask, p.sumsq, o);
  q.sum = __shfl_down_sync(kFullMask, p.sum, o);
  q.sum4 = __shfl_down_sync(kFullMask, p.sum4, o);
  q.first = __shfl_down_sync(kFullMask, p.first, o);
  return q;
}

// Fixed-shape tree over a warp, then over the warps: the merge order never depends on timing.
template <typename R> __device__ __forceinline__ void warp_reduce(R& r) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) r.merge(shfl_down(r, o));
}

// Result valid in thread 0; every thread of the block must call it. R is Fast<T> or Partial<A>.
template <typename R> __device__ __forceinline__ R block_reduce(R r) {
  // Raw storage: __shared__ variables cannot have default member initializers.
  __shared__ __align__(16) unsigned char buf[kWarps * sizeof(R)];
  auto* s = reinterpret_cast<R*>(buf);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  warp_reduce(r);
  __syncthreads();  // warp 0 has finished reading buf in this block's previous call (reused per chunk)
  if (lane == 0) s[warp] = r;
  __syncthreads();
  if (warp == 0) {
    r = lane < kWarps ? s[lane] : R();
    warp_reduce(r);
  }
  return r;
}

// ---------------------------------------------------------------------------- packed 16-bit lanes

template <typename P> __device__ __forceinline__ P splat(float x);
template <> __device__ __forceinline__ __half2 splat<__half2>(float x) { return __float2half2_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat162 splat<__nv_bfloat162>(float x) { return __float2bfloat162_rn(x); }

template <typename P> __device__ __forceinline__ P bits_as(uint32_t w) {
  P p;
  memcpy(&p, &w, sizeof(p));
  return p;
}

// The lanes as FP32 (exact). bf16 is the top half of an fp32: one shift / one AND per lane, where
// __low2float / __high2float take a PRMT more for the high lane.
__device__ __forceinline__ float low_float(__half2 x) { return __low2float(x); }
__device__ __forceinline__ float high_float(__half2 x) { return __high2float(x); }
__device__ __forceinline__ float low_float(__nv_bfloat162 x) {
  uint32_t w;
  memcpy(&w, &x, sizeof(w));
  return __uint_as_float(w << 16);
}
__device__ __forceinline__ float high_float(__nv_bfloat162 x) {
  uint32_t w;
  memcpy(&w, &x, sizeof(w));
  return __uint_as_float(w & 0xffff0000u);
}

// Two lanes per instruction for the first pass: min and max (HMNMX2: exact, subnormals kept, a NaN
// lane does not matter since such a chunk is classified again), the zero count as packed 1.0s summed
// in the lanes' own format (HSET2 + HADD2: at most 128 per lane per run, exact), and the sums of the
// two lanes in FP32, in element order: the same sums as one element at a time (Fast::add_sums).
template <typename P> struct Lanes {
  P mn, mx, zeros;
  __device__ __forceinline__ Lanes()
      : mn(splat<P>(std::numeric_limits<float>::infinity())),
        mx(splat<P>(-std::numeric_limits<float>::infinity())),
        zeros(splat<P>(0.f)) {}

  template <typename T> __device__ __forceinline__ void add(P x, Fast<T>& f) {
    mn = __hmin2(mn, x);
    mx = __hmax2(mx, x);
    zeros = __hadd2(zeros, __heq2(x, splat<P>(0.f)));
    f.add_sums(low_float(x));
    f.add_sums(high_float(x));
  }

  template <typename T> __device__ __forceinline__ void fold_into(Fast<T>& f) const {
    f.mn = fminf(f.mn, fminf(__low2float(mn), __high2float(mn)));
    f.mx = fmaxf(f.mx, fmaxf(__low2float(mx), __high2float(mx)));
    f.zero += static_cast<uint32_t>(__low2float(zeros)) + static_cast<uint32_t>(__high2float(zeros));
  }
};

// Which dtypes take packed lanes, and the k-th lane pair of a 16-byte vector, in element order.
template <typename T> struct Packing { static constexpr bool kOn = false; };
template <> struct Packing<c10::Half> {
  static constexpr bool kOn = true;
  static constexpr int kPairs = 4;
  using P = __half2;
  static __device__ __forceinline__ P pair(const uint32_t (&w)[4], int k) { return bits_as<P>(w[k]); }
};
template <> struct Packing<c10::BFloat16> {
  static constexpr bool kOn = true;
  static constexpr int kPairs = 4;
  using P = __nv_bfloat162;
  static __device__ __forceinline__ P pair(const uint32_t (&w)[4], int k) { return bits_as<P>(w[k]); }
};
// float8 e4m3fn / e5m2: every value is exact in fp16 (one cvt per pair on sm_89+).
template <__nv_fp8_interpretation_t kFmt> struct PackingFp8 {
  static constexpr bool kOn = true;
  static constexpr int kPairs = 8;
  using P = __half2;
  static __device__ __forceinline__ P pair(const uint32_t (&w)[4], int k) {
    const auto two = static_cast<__nv_fp8x2_storage_t>(k % 2 ? w[k / 2] >> 16 : w[k / 2] & 0xffffu);
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(two, kFmt);
    P p;
    memcpy(&p, &h, sizeof(p));
    return p;
  }
};
template <> struct Packing<c10::Float8_e4m3fn> : PackingFp8<__NV_E4M3> {};
template <> struct Packing<c10::Float8_e5m2> : PackingFp8<__NV_E5M2> {};


}  // namespace
}  // namespace nanscan
