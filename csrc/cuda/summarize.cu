// nanscan CUDA backend: the CUDA-key kernels of nanscan::summarize and nanscan::summarize_many.
//
// Algorithm: one read of every element (two for a chunk holding a NaN / Inf), no host sync, no
// float atomics, deterministic.
//  1. Chunks. A tensor is cut into chunks of `chunk` elements in walk order: the smallest power of
//     two in [4096, 2**20] that makes at most 2048 chunks, picked from numel alone (pick_chunk; the
//     same for every dtype, never a function of the GPU), so small tensors still spread over the
//     SMs and big ones leave the merge at most 2048 partials up to 2**31 elements. One block of 256
//     threads reduces one chunk to one Partial (record.h) in a workspace from the caching allocator.
//     Each thread of the block takes the same elements of the chunk whichever block runs it, then a
//     fixed shuffle + shared-memory tree merges the 256 thread results.
//     Runs. A chunk is read as runs of 65536 elements (kSegment; a chunk of <= 65536 is one run):
//     a thread takes 256 elements of a run, sums their squares afresh (the record contract: FP32
//     sums in blocks of at most 256 squares), and folds its packed lanes (below) into 32-bit counts
//     at the run's end, so a packed zero count never passes 128 whatever the chunk; the chunk's sum
//     is the runs' sums added in order. What a thread keeps between runs (that sum, the chunk's end)
//     waits in shared memory, not in registers the element loops need. Until 2**27 elements every
//     chunk is one run and every record is bitwise what it was with chunks capped at 65536.
//     Numbers (fp32 / any dtype, same numel): 1 GiB fp32 (2**28) 2048 chunks of 2**17, was 4096 of
//     65536; 2**31 elements 2048 of 2**20, was 32768; 1 GiB bf16 (2**29) 2048 of 2**18, was 8192.
//  2. Assume, then prove (as the CPU kernel's VecState). The first pass over a chunk keeps only the
//     zero count, min / max and the sum of squares -- no classification, no index --, reading linear
//     memory with 16-byte loads, 4 in flight per thread (a scalar head / tail covers a pointer that is
//     not 16-byte aligned and ragged chunk ends). fp16 / bf16 (and float8 e4m3fn / e5m2, converted
//     exactly to fp16 pairs) keep min, max and the zero count two lanes at a time (HMNMX2, HSET2 +
//     HADD2; per run, at most 128 per lane: exact). A NaN or Inf makes the thread's sum of squares
//     non-finite (squares are >= 0, so it never comes back), so `__syncthreads_or(!isfinite(ss))`
//     proves the chunk clean; otherwise (or when the sum of squares overflowed) the chunk is read
//     again by a pass that classifies every element and takes the minimum LOGICAL index of the
//     non-finite ones. Both passes give a thread the same elements in the same order (as the one-pass
//     kernel before them did), so whichever pass ran, the sums are formed the same way.
//  3. One launch (summarize). The grid is min(chunks, SMs x resident blocks per SM) (occupancy
//     query, cached per device and kernel); block b reduces chunks b, b + grid, ... Each chunk's
//     partial goes to its own slot, so the grid size (and so the GPU model) changes only which block
//     computes a chunk, never a result. The last block to finish (ticket, see last_block) merges the
//     partials in CHUNK order with the same fixed tree and writes the float64 [8] row: the record is
//     a function of the tensor's contents, shape, strides and address alignment (the vector split),
//     bitwise, never of the GPU model or of the order in which blocks finish.
//     The merge is not widened: it is one block of the scan kernel (256 threads, each merging
//     partials t, t + 256, ... two 64-byte loads in flight, then the tree), and with at most 2048
//     partials (128 KiB, read from L2) that is <= 8 partials per thread for tensors up to 2**31
//     elements, where 65536-element chunks gave 128 at 2**31. Widening it further would take a
//     second level of tickets (blocks merging groups of partials) or a second launch, for a step
//     that is now a few microseconds (estimated, not measured). The price of longer chunks is in
//     the rare case: a chunk holding a NaN / Inf is read again by its one block alone at the end,
//     so one NaN in a tensor of 2**31 fp32 elements re-reads 4 MiB, not 256 KiB, in a single block;
//     the classifying pass therefore keeps two 16-byte loads in flight per thread (was one).
//     Tickets: a grid of one block needs none. Otherwise, outside stream capture, one ticket per
//     (device, stream), allocated and zeroed once on that stream, kept for the life of the process:
//     kernels on one stream run one after another, so a ticket is never used by two kernels at once,
//     and each kernel's last block puts it back to 0 for the next one; calls on other streams use
//     other tickets. While the stream is being captured into a CUDA graph, the ticket is allocated
//     with the workspace (the graph's private pool keeps it for the graph's life) and zeroed by a
//     captured cudaMemsetAsync, so a replay -- on any stream, beside eager calls or other graphs --
//     never shares a ticket; the kernel's reset is redundant there. (A ticket per call would be as
//     safe, but zeroing it is a second stream operation on every eager call, which is what one
//     launch is meant to save.)
// Walk order. Contiguous tensors are walked in memory order = logical order. Other tensors are
// walked in MEMORY order too: size-1 dims dropped, dims sorted by stride (stride-0 expanded dims
// outermost, so a warp still reads consecutive addresses), neighbours merged where both the memory
// and the logical strides allow. A dense permuted tensor (transposed, channels_last) then reads
// memory linearly and takes the vector path; anything else (steps, expand, overlap) computes each
// element's offset from the coalesced sizes/strides. first_nonfinite_index is the MIN over the
// LOGICAL row-major indices of non-finite elements, so it depends on neither the walk nor the
// reduction order; only the classifying pass computes logical indices, and only for non-finite
// elements.
// summarize_many. The inputs are borrowed (normalized_input, inputs.h): a tensor read as it is
// costs no handle copy (no reference-count traffic); only a converted one (a complex tensor's real
// view, a resolved negation) is owned, for the call. Contiguous tensors of one dtype run as ONE
// scan launch, one block per chunk of the group (chunked as a whole: chunk from the group's total
// numel, each tensor cut from its own start), then one combine launch per dtype that merges each
// tensor's partials in chunk order. The blocks read a device table, int64 [ptr[n], numel[n],
// prefix[n+1], row[n]] followed by int32 tix[blocks] (block b's tensor: prefix[tix[b]] <= b <
// prefix[tix[b] + 1]), so a block finds its tensor with one load -- 32 n + 4 chunks bytes. Tables
// are cached (many_table: up to 16, most recently used kept), keyed IN FULL by device, stream,
// dtype and each tensor's (data pointer, numel, output row), of which the table is a pure function:
// calling with the list of the previous step copies nothing to the device; any other list builds
// its table in pinned memory and copies it non-blocking, as every call did before. Non-contiguous
// tensors take the single-tensor path into their row. While the stream is being captured into a
// CUDA graph every tensor takes the single-tensor path, because a graph would re-read a pinned
// staging buffer that the host allocator recycles after the call, or a cached table that an eager
// call may evict.
//
// Measured statically (no GPU has run this yet): sm_90, nvcc 13.0, the build's own nvcc command line
// (see the setup.py build log) plus `-Xptxas -v`, and `cuobjdump -sass` on the object.
// Registers, summarize_kernel contiguous / dense (permuted) / strided, __launch_bounds__(256, 4):
//   bf16 56 / 64 / 64, fp16 56 / 64 / 64, fp32 56 / 64 / 64, fp64 61 / 64 / 64, float8 e4m3fn
//   56 / 64 / 64, e5m2 56 / 64 / 64, fnuz 55 / 64 / 64, integers 56 - 64; scan_many_kernel bf16 52,
//   fp32 52, fp64 64, integers 47 - 64; combine_kernel 48. With chunks capped at 65536 (no runs):
//   fp32 55 / 64 / 64, fp64 63 / 64 / 64, e4m3fn 58, e5m2 62 (contiguous), the rest as now but
//   scan_many_kernel integers 49 - 64. Before that (scan_one_kernel, __launch_bounds__(256)):
//   bf16 71 / 73 / 62, fp16 57 / 59 / 62, fp32 48 / 56 / 62, float8 106 - 112 (contiguous);
//   scan_many_kernel bf16 80.
//   No spill in any element loop of the first pass (SASS: no STL / LDL inside any loop that loads
//   from global memory); the dense / strided kernels store a few words per chunk and run (values of
//   the chunk loop, arguments of the not-inlined classifying pass). The classifying pass of strided
//   walks spills inside its loops, as it did before runs: fp32 24 spill instructions (was 18), fp64
//   44 / 55 in its two loops (was 36 / 50), fnuz 8 / 14 (was 8 / 8) -- a chunk with a NaN / Inf only.
// Hot loop (contiguous, a full round of 4 x LDG.128 per thread), SASS instructions per element:
//   bf16  3.75: FFMA 1, bf16 -> fp32 1 (IMAD.U32 / LOP3), VHMNMX.BF16_V2 0.5 (three-input: min or
//         max of two pairs at once), HSET2 0.5 + HADD2 / HFMA2 0.5 (zero count), LDG 0.125, loop 0.1;
//   fp16  3.75: the same with HADD2.F32 for the conversions;
//   float8 e4m3fn / e5m2  4.4: F2FP 0.5 (fp8x2 -> f16x2) + SHF 0.25, then as fp16;
//   fp32  6.5: FFMA 1, FMNMX 2, zero count 3 (FSETP + a predicated add), LDG 0.25;  fp64 21.4.
//   Runs left these loop bodies as they were (same SASS lengths); they add per 256 elements of a
//   thread a fold of the packed lanes and a few shared-memory accesses.
//   Before: about 10 for bf16 / fp32 on the all-finite path (issue 12's desk review), which tested
//   every element for finiteness and converted bf16 / fp16 to fp32 for every min / max.
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAMacros.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <type_traits>
#include <utility>
#include <vector>

#include "../inputs.h"
#include "../record.h"

namespace nanscan {
namespace {

constexpr int kBlock = 256;
constexpr int kWarps = kBlock / 32;
constexpr int kUnroll = 4;          // loads in flight per thread
constexpr int kVecBytes = 16;       // one LDG.128 per vector
// A chunk is walked as runs of kSegment elements: a thread's squares are summed in runs of
// kSegment / kBlock = 256 (the record contract: FP32 sums in blocks of at most 256 squares), and the
// packed lanes of a run are folded into 32-bit counts before the next run starts.
constexpr int64_t kSegment = 65536;
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
// per-thread sum of squares; A, the sumsq accumulator of the record contract (fp32 for <=32-bit
// floats, fp64 for fp64 and integers). Integers up to 16 bits square exactly in int32 and a thread
// sums at most kMaxChunk / kBlock = 4096 of them, so their S is an exact int64 (then converted to fp64 exactly):
// same value as fp64 accumulation, and byte-sized inputs avoid 64-bit compares and fp64 FMAs.
template <typename T> struct Traits { using V = float; using S = float; using A = float; static constexpr bool kFloat = true; };
template <> struct Traits<double> { using V = double; using S = double; using A = double; static constexpr bool kFloat = true; };
#define NANSCAN_INT_TRAITS(T, V_, S_) \
  template <> struct Traits<T> { using V = V_; using S = S_; using A = double; static constexpr bool kFloat = false; };
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

// The assume-finite state of one thread (first pass): zero count, min, max, sum of squares. For
// integer dtypes it is the whole record.
template <typename T> struct Fast {
  using V = typename Traits<T>::V;
  using S = typename Traits<T>::S;
  using A = typename Traits<T>::A;
  uint32_t zero = 0;
  V mn = std::numeric_limits<V>::has_infinity ? std::numeric_limits<V>::infinity() : std::numeric_limits<V>::max();
  V mx = std::numeric_limits<V>::has_infinity ? -std::numeric_limits<V>::infinity() : std::numeric_limits<V>::lowest();
  S ss = 0;

  __device__ __forceinline__ void add(T raw) {
    const V v = to_val(raw);
    zero += v == V(0);
    mn = vmin(mn, v);
    mx = vmax(mx, v);
    if constexpr (Traits<T>::kFloat) ss += v * v;  // squared in V: 1e20 in fp32 gives inf, as the record contract says
    else if constexpr (std::is_integral_v<S>) ss += v * v;  // <= 2**30: exact in int32
    else ss += S(v) * S(v);
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
  }

  __device__ __forceinline__ Partial<A> partial() const {
    Partial<A> p;
    p.zero = zero;
    if (mn <= mx) p.min = static_cast<double>(mn), p.max = static_cast<double>(mx);  // else +-inf
    p.sumsq = static_cast<A>(ss);
    return p;
  }
};

template <typename T> __device__ __forceinline__ Fast<T> shfl_down(const Fast<T>& f, int o) {
  Fast<T> q;
  q.zero = __shfl_down_sync(kFullMask, f.zero, o);
  q.mn = __shfl_down_sync(kFullMask, f.mn, o);
  q.mx = __shfl_down_sync(kFullMask, f.mx, o);
  q.ss = __shfl_down_sync(kFullMask, f.ss, o);
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
// in the lanes' own format (HSET2 + HADD2: at most 128 per lane per run, exact), and the two squares
// in FP32 (two FFMA, in element order: the same sum as one element at a time).
template <typename P> struct Lanes {
  P mn, mx, zeros;
  __device__ __forceinline__ Lanes()
      : mn(splat<P>(std::numeric_limits<float>::infinity())),
        mx(splat<P>(-std::numeric_limits<float>::infinity())),
        zeros(splat<P>(0.f)) {}

  __device__ __forceinline__ void add(P x, float& ss) {
    mn = __hmin2(mn, x);
    mx = __hmax2(mx, x);
    zeros = __hadd2(zeros, __heq2(x, splat<P>(0.f)));
    const float lo = low_float(x), hi = high_float(x);
    ss = fmaf(lo, lo, ss);
    ss = fmaf(hi, hi, ss);
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

// ---------------------------------------------------------------------------------- linear reads

template <typename T> struct alignas(kVecBytes) Vec { T v[kVecBytes / sizeof(T)]; };

// Explicit LDG.128 (read-only path): the multi-tensor kernel reads its pointers from a table, and
// the compiler would otherwise emit generic-address loads for them.
template <typename T> __device__ __forceinline__ Vec<T> load_vec(const Vec<T>* p) {
  const uint4 r = __ldg(reinterpret_cast<const uint4*>(p));
  Vec<T> v;
  memcpy(&v, &r, sizeof(v));
  return v;
}

// [vbeg, vend): the 16-byte aligned middle of [begin, end) of linear memory p; the scalar head is
// [begin, vbeg), the tail [vend, end), each shorter than one vector. A pointer that is not even
// element aligned (from_blob) gets no middle: everything is head.
struct Split { int64_t vbeg, vend; };
template <typename T>
__device__ __forceinline__ Split split_linear(const T* p, int64_t begin, int64_t end) {
  constexpr int64_t kVec = kVecBytes / sizeof(T);
  const auto addr = reinterpret_cast<uintptr_t>(p);
  if (addr % sizeof(T) != 0) return {end, end};
  const int64_t mis = static_cast<int64_t>(addr % kVecBytes / sizeof(T));  // p - mis is aligned
  const int64_t vbeg = (begin + mis + kVec - 1) / kVec * kVec - mis;
  const int64_t vend = (end + mis) / kVec * kVec - mis;
  return vbeg < vend ? Split{vbeg, vend} : Split{end, end};
}

// First pass over elements [begin, end) of linear memory p (at most one chunk). Thread t takes
// vectors t, t + 256, t + 512, ... in that order: full rounds of kUnroll loads without bounds checks,
// then at most kUnroll - 1 single vectors.
template <typename T>
__device__ __forceinline__ void fast_linear(Fast<T>& f, const T* __restrict__ p, int64_t begin, int64_t end) {
  constexpr int kVec = kVecBytes / sizeof(T);
  const Split s = split_linear(p, begin, end);
  for (int64_t w = begin + threadIdx.x; w < s.vbeg; w += kBlock) f.add(p[w]);
  const uint4* __restrict__ vp = reinterpret_cast<const uint4*>(p + s.vbeg);
  const int nv = static_cast<int>((s.vend - s.vbeg) / kVec);
  int i = threadIdx.x;
  if constexpr (Packing<T>::kOn) {
    Lanes<typename Packing<T>::P> lanes;
    const auto add = [&](const uint4& r) {
      const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
      for (int k = 0; k < Packing<T>::kPairs; ++k) lanes.add(Packing<T>::pair(w, k), f.ss);
    };
    for (; i + (kUnroll - 1) * kBlock < nv; i += kUnroll * kBlock) {
      uint4 r[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) r[u] = __ldg(vp + i + u * kBlock);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) add(r[u]);
    }
    for (; i < nv; i += kBlock) add(__ldg(vp + i));
    lanes.fold_into(f);
  } else {
    const Vec<T>* __restrict__ vv = reinterpret_cast<const Vec<T>*>(vp);
    const auto add = [&](const Vec<T>& v) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) f.add(v.v[e]);
    };
    for (; i + (kUnroll - 1) * kBlock < nv; i += kUnroll * kBlock) {
      Vec<T> v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) v[u] = load_vec(vv + i + u * kBlock);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) add(v[u]);
    }
    for (; i < nv; i += kBlock) add(load_vec(vv + i));
  }
  for (int64_t w = s.vend + threadIdx.x; w < end; w += kBlock) f.add(p[w]);
}

// Classifying pass over linear memory: the same head / vector / tail split and the same element to
// thread assignment and order as fast_linear. kClassifyUnroll vectors in flight: this pass runs only
// for chunks that hold a NaN / Inf or overflow, but such a chunk is re-read by its one block alone,
// at the latency-bound rate of one block (one vector in flight per thread: ~4 KiB per round trip).
constexpr int kClassifyUnroll = 2;
template <typename T, class Index>
__device__ __forceinline__ void classify_linear(Acc<T>& acc, const T* __restrict__ p, int64_t begin,
                                                int64_t end, const Index& index) {
  constexpr int kVec = kVecBytes / sizeof(T);
  const Split s = split_linear(p, begin, end);
  for (int64_t w = begin + threadIdx.x; w < s.vbeg; w += kBlock) acc.add(p[w], w, index);
  const Vec<T>* __restrict__ vp = reinterpret_cast<const Vec<T>*>(p + s.vbeg);
  const int nv = static_cast<int>((s.vend - s.vbeg) / kVec);
  const auto add = [&](const Vec<T>& v, int i) {
    const int64_t w = s.vbeg + int64_t(i) * kVec;
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc.add(v.v[e], w + e, index);
  };
  int i = threadIdx.x;
  for (; i + (kClassifyUnroll - 1) * kBlock < nv; i += kClassifyUnroll * kBlock) {
    Vec<T> v[kClassifyUnroll];
#pragma unroll
    for (int u = 0; u < kClassifyUnroll; ++u) v[u] = load_vec(vp + i + u * kBlock);
#pragma unroll
    for (int u = 0; u < kClassifyUnroll; ++u) add(v[u], i + u * kBlock);
  }
  for (; i < nv; i += kBlock) add(load_vec(vp + i), i);
  for (int64_t w = s.vend + threadIdx.x; w < end; w += kBlock) acc.add(p[w], w, index);
}

// ------------------------------------------------------------------------------- strided walks

// Coalesced walk of a non-contiguous tensor, innermost dim first.
struct Geometry {
  int64_t numel;
  int64_t ndim;
  int64_t size[kMaxDims], mstride[kMaxDims], lstride[kMaxDims];  // memory / logical strides
};

// Maps walk index w to sum(coord[d] * stride[d]). I = uint32_t when numel < 2**32: 32-bit division
// is several times cheaper than 64-bit.
template <typename I>
__host__ __device__ __forceinline__ int64_t walk_to(const Geometry& g, int64_t w, const int64_t* stride) {
  I r = static_cast<I>(w);
  int64_t off = 0;
  for (int64_t d = 0; d + 1 < g.ndim; ++d) {
    const I s = static_cast<I>(g.size[d]), q = r / s;
    off += static_cast<int64_t>(r - q * s) * stride[d];
    r = q;
  }
  return off + static_cast<int64_t>(r) * stride[g.ndim - 1];
}

enum Mode { kContig, kDense, kStrided };  // memory == logical / memory == walk / neither

struct Identity {
  __device__ __forceinline__ int64_t operator()(int64_t w) const { return w; }
};
template <typename I> struct MemOffset {  // walk index -> element offset in memory
  const Geometry* g;
  __device__ __forceinline__ int64_t operator()(int64_t w) const { return walk_to<I>(*g, w, g->mstride); }
};
// Walk index -> logical row-major index, for non-finite elements only (the classifying pass). Not
// inlined: the 64-bit divisions would otherwise load registers onto that pass and so the kernel.
__device__ __noinline__ int64_t logical_index(const Geometry* g, int64_t w) {
  return walk_to<uint64_t>(*g, w, g->lstride);
}
struct LogicalIndex {
  const Geometry* g;
  __device__ __forceinline__ int64_t operator()(int64_t w) const { return logical_index(g, w); }
};

// Elements [begin, end) of the walk, element w at p[off(w)]; kUnroll loads issued before use.
template <typename T, class Off, class Visit>
__device__ __forceinline__ void scan_elems(const T* __restrict__ p, int64_t begin, int64_t end,
                                           const Off& off, const Visit& visit) {
  for (int64_t i = begin + threadIdx.x; i < end; i += int64_t(kBlock) * kUnroll) {
    T v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (i + u * kBlock < end) v[u] = p[off(i + u * kBlock)];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (i + u * kBlock < end) visit(v[u], i + u * kBlock);
  }
}

// ------------------------------------------------------------------------------------- a chunk

// What a thread keeps across the runs of a chunk -- the sum of the runs read so far and the chunk's
// end -- in shared memory while a run is read: a few accesses per run, where values held in
// registers across the element loops made ptxas spill inside them (fp64, strided). Volatile, so
// the compiler cannot carry them in registers after all. Slot threadIdx.x: its own thread only.
template <typename S> struct RunState { S total; int64_t end; };
template <typename S> __device__ __forceinline__ volatile RunState<S>* run_state() {
  __shared__ RunState<S> state[kBlock];
  return state + threadIdx.x;
}

// Second pass over a chunk whose first pass was not proved clean: classify every element, the
// minimum logical index of the non-finite ones, *dst from thread 0. Not inlined: its registers
// (64-bit index arithmetic) stay out of the first pass, and only such chunks pay for the call.
template <typename T, Mode M>
__device__ __noinline__ void classify_chunk(const T* __restrict__ p, const Geometry* g, int64_t begin,
                                            int64_t end, Partial<typename Traits<T>::A>* dst) {
  using S = typename Traits<T>::S;
  Acc<T> acc;
  volatile RunState<S>* const run = run_state<S>();
  run->total = 0;
  run->end = end;
  const auto runs = [&](const auto& one) {  // the runs of scan_chunk, summed the same way
    for (int64_t s = begin; s < run->end;) {
      const int64_t e = min(s + kSegment, run->end);
      acc.fin.ss = 0;
      one(s, e);
      run->total = run->total + acc.fin.ss;
      s = e;
    }
  };
  if constexpr (M == kContig) {
    runs([&](int64_t s, int64_t e) { classify_linear(acc, p, s, e, Identity{}); });
  } else if constexpr (M == kDense) {
    runs([&](int64_t s, int64_t e) { classify_linear(acc, p, s, e, LogicalIndex{g}); });
  } else {
    const auto add = [&](T raw, int64_t w) { acc.add(raw, w, LogicalIndex{g}); };
    // (the walk's index width chosen outside the run loop: inside it, fp64 spilled in the element loop)
    const MemOffset<uint32_t> narrow{g};
    const MemOffset<uint64_t> wide{g};
    if (g->numel <= int64_t(UINT32_MAX)) runs([&](int64_t s, int64_t e) { scan_elems(p, s, e, narrow, add); });
    else runs([&](int64_t s, int64_t e) { scan_elems(p, s, e, wide, add); });
  }
  acc.fin.ss = run->total;
  const Partial<typename Traits<T>::A> r = block_reduce(acc.partial());
  if (threadIdx.x == 0) *dst = r;
}

// Walk elements [begin, end) of p -> *dst, written by thread 0. g (shared memory) is the walk of
// kDense / kStrided tensors; unused (may be null) for kContig.
template <typename T, Mode M>
__device__ __forceinline__ void scan_chunk(const T* __restrict__ p, const Geometry* g, int64_t begin,
                                           int64_t end, Partial<typename Traits<T>::A>* dst) {
  using S = typename Traits<T>::S;
  Fast<T> f;
  // Runs of kSegment elements: each starts its sum of squares (and, in fast_linear, its packed
  // lanes) afresh; the chunk's sum is the runs' sums added in order. A chunk of one run (every chunk
  // of a tensor of <= 2**27 elements) computes exactly what it did before runs existed (0 + x == x).
  volatile RunState<S>* const run = run_state<S>();
  run->total = 0;
  run->end = end;
  const auto runs = [&](const auto& one) {
    for (int64_t s = begin; s < run->end;) {
      const int64_t e = min(s + kSegment, run->end);
      f.ss = 0;
      one(s, e);
      run->total = run->total + f.ss;  // a NaN / Inf run: non-finite for good (terms are >= 0)
      s = e;
    }
  };
  if constexpr (M == kStrided) {
    const auto add = [&](T raw, int64_t) { f.add(raw); };
    // (the walk's index width chosen outside the run loop: inside it, fp64 spilled in the element loop)
    const MemOffset<uint32_t> narrow{g};
    const MemOffset<uint64_t> wide{g};
    if (g->numel <= int64_t(UINT32_MAX)) runs([&](int64_t s, int64_t e) { scan_elems(p, s, e, narrow, add); });
    else runs([&](int64_t s, int64_t e) { scan_elems(p, s, e, wide, add); });
  } else {
    runs([&](int64_t s, int64_t e) { fast_linear(f, p, s, e); });
  }
  f.ss = run->total;
  if constexpr (Traits<T>::kFloat) {
    if (__syncthreads_or(!f.clean())) {  // block-uniform; rare: a NaN / Inf, or a sum that overflowed
      classify_chunk<T, M>(p, g, begin, end, dst);
      return;
    }
  }
  const Fast<T> r = block_reduce(f);
  if (threadIdx.x == 0) *dst = r.partial();
}

// ------------------------------------------------------------------------------- combining

// A partial written by another block of this kernel: read through L2 (ld.global.cg), never from a
// possibly stale L1 line. (Partials are 64 bytes at 64-byte offsets of an allocator block.)
template <typename A> __device__ __forceinline__ Partial<A> load_partial(const Partial<A>* q) {
  static_assert(sizeof(Partial<A>) % 16 == 0, "Partial is read as uint4");
  uint4 r[sizeof(Partial<A>) / 16];
#pragma unroll
  for (int k = 0; k < int(sizeof(Partial<A>) / 16); ++k) r[k] = __ldcg(reinterpret_cast<const uint4*>(q) + k);
  Partial<A> p;
  memcpy(&p, r, sizeof(p));
  return p;
}

// Block-wide merge of partials [lo, hi) in a fixed order: thread t merges t, t + 256, ... in
// ascending order, then the fixed tree. Result in thread 0; zero partials give the identity record.
template <typename A>
__device__ __forceinline__ Partial<A> merge_partials(const Partial<A>* ws, int64_t lo, int64_t hi) {
  Partial<A> p;
#pragma unroll 2  // two 64-byte partials in flight; more costs registers the scan kernels do not have
  for (int64_t i = lo + threadIdx.x; i < hi; i += kBlock) p.merge(load_partial(ws + i));
  return block_reduce(p);
}

// True, in every thread, in the one block that finishes last. Every block's partials are written by
// its thread 0, which then fences (release) and takes a ticket; the block that draws ticket
// gridDim.x - 1 knows every other block has done so, fences (acquire), and puts the ticket back to 0
// for the next kernel that uses it (nothing else touches it in this launch any more).
__device__ __forceinline__ bool last_block(unsigned int* ticket) {
  if (gridDim.x == 1) return true;  // the host passes no ticket for a one-block grid
  __shared__ bool last;
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(ticket, 1u) == gridDim.x - 1;
    if (last) {
      __threadfence();
      *ticket = 0u;
    }
  }
  __syncthreads();
  return last;
}

// ------------------------------------------------------------------------------------ kernels

// One tensor, one launch: block b reduces chunks b, b + gridDim.x, ... into ws[chunk]; the last
// block merges ws[0, nchunks) in chunk order into out (8 doubles).
template <typename T, Mode M>
__global__ void __launch_bounds__(kBlock, kMinBlocksPerSM)
    summarize_kernel(const T* __restrict__ p, const Geometry g, int64_t chunk, int64_t nchunks,
                     Partial<typename Traits<T>::A>* ws, unsigned int* ticket, double* __restrict__ out) {
  // Shared copy of the walk: the dims are indexed dynamically, which kernel parameters serve poorly.
  __shared__ Geometry sg;
  if constexpr (M != kContig) {
    for (int i = threadIdx.x; i < int(sizeof(Geometry) / 8); i += kBlock)
      reinterpret_cast<int64_t*>(&sg)[i] = reinterpret_cast<const int64_t*>(&g)[i];
    __syncthreads();
  }
  for (int64_t c = blockIdx.x; c < nchunks; c += gridDim.x) {
    const int64_t begin = c * chunk;
    scan_chunk<T, M>(p, &sg, begin, min(begin + chunk, g.numel), ws + c);
  }
  if (!last_block(ticket)) return;
  const auto r = merge_partials(ws, 0, nchunks);
  if (threadIdx.x == 0) r.write(out);
}

// Multi-tensor scan. meta = [ptr[n], numel[n], prefix[n+1], row[n]] (int64), then tix[blocks]
// (int32, at meta + 4n + 1): block b scans chunk b - prefix[r] of tensor r = tix[b], the one tensor
// with prefix[r] <= b < prefix[r+1] (empty tensors own no chunk) -- one load, then three
// independent ones, where a binary search made ~log2(n) dependent loads.
template <typename T>
__global__ void __launch_bounds__(kBlock, kMinBlocksPerSM)
    scan_many_kernel(const int64_t* __restrict__ meta, const int32_t* __restrict__ tix, int64_t n,
                     int64_t chunk, Partial<typename Traits<T>::A>* __restrict__ ws) {
  const int64_t b = blockIdx.x;
  const int64_t r = tix[b];
  const T* p = reinterpret_cast<const T*>(meta[r]);
  const int64_t begin = (b - meta[2 * n + r]) * chunk;
  scan_chunk<T, kContig>(p, nullptr, begin, min(begin + chunk, meta[n + r]), ws + b);
}

// Block r merges partials [prefix[r], prefix[r+1]) into out row rows[r].
template <typename A>
__global__ void __launch_bounds__(kBlock)
    combine_kernel(const Partial<A>* __restrict__ ws, const int64_t* __restrict__ prefix,
                   const int64_t* __restrict__ rows, double* __restrict__ out) {
  const auto r = merge_partials(ws, prefix[blockIdx.x], prefix[blockIdx.x + 1]);
  if (threadIdx.x == 0) r.write(out + rows[blockIdx.x] * kRecordSize);
}

// ---------------------------------------------------------------------------------------- host

template <typename T> struct Tag { using type = T; };

template <typename F> void dispatch(at::ScalarType st, const F& f) {
  switch (st) {
#define NANSCAN_CUDA_CASE(enum_type, cpp_type) \
  case at::enum_type:                           \
    return f(Tag<cpp_type>{});
    NANSCAN_FORALL_REAL_DTYPES(NANSCAN_CUDA_CASE)
#undef NANSCAN_CUDA_CASE
    default: TORCH_CHECK_TYPE(false, "nanscan: dtype ", st, " is not supported (", kSupportedText, ")");
  }
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Smallest power-of-two chunk (>= kMinChunk) that keeps the chunk count near kTargetChunks; depends
// only on numel -- never on the GPU --, which keeps the merge order (and so sumsq) reproducible.
int64_t pick_chunk(int64_t numel) {
  int64_t c = kMinChunk;
  while (c < kMaxChunk && ceil_div(numel, c) > kTargetChunks) c *= 2;
  return c;
}

dim3 grid_of(int64_t blocks) {
  TORCH_CHECK(blocks <= std::numeric_limits<int32_t>::max(), "nanscan: grid of ", blocks, " blocks");
  return dim3(static_cast<unsigned>(blocks));
}

// SMs x resident blocks per SM of summarize_kernel<T, M> on `device` (the current device), queried
// once per device and kernel. Only the grid depends on it, never a result (see the header).
template <typename T, Mode M>
int64_t max_grid(c10::DeviceIndex device) {
  static std::array<std::atomic<int64_t>, C10_COMPILE_TIME_MAX_GPUS> cache{};
  TORCH_CHECK(device >= 0 && device < C10_COMPILE_TIME_MAX_GPUS, "nanscan: device index ", int(device));
  int64_t grid = cache[device].load(std::memory_order_relaxed);
  if (grid == 0) {
    int sms = 0, per_sm = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, summarize_kernel<T, M>, kBlock, 0));
    grid = std::max<int64_t>(1, int64_t(sms) * per_sm);
    cache[device].store(grid, std::memory_order_relaxed);
  }
  return grid;
}

// The eager ticket of (device, stream), zeroed once on that stream (see the header). Keyed by
// cudaStreamGetId, unique for the life of the program, so a destroyed stream's handle reused by a
// new stream gets a new ticket. The map is never freed: it must outlive CUDA's teardown at exit.
unsigned int* stream_ticket(c10::DeviceIndex device, cudaStream_t stream) {
  unsigned long long id = 0;
  C10_CUDA_CHECK(cudaStreamGetId(stream, &id));
  static std::mutex mutex;
  static auto* tickets = new std::map<std::pair<int, unsigned long long>, at::Tensor>();
  const std::lock_guard<std::mutex> lock(mutex);
  const std::pair<int, unsigned long long> key(device, id);
  auto it = tickets->find(key);
  if (it == tickets->end()) {  // the caller's current stream is `stream`: the zero fill runs on it
    const auto opts = at::TensorOptions().device(at::Device(at::kCUDA, device)).dtype(at::kInt);
    it = tickets->emplace(key, at::zeros({1}, opts)).first;
  }
  return reinterpret_cast<unsigned int*>(it->second.data_ptr());
}

// Single-tensor path: one launch (plus, under stream capture, a 4-byte memset) into out_row.
template <typename T, Mode M>
void launch_one(const T* p, const Geometry& g, double* out_row, const at::TensorOptions& dev,
                c10::DeviceIndex device, cudaStream_t stream) {
  using A = typename Traits<T>::A;
  const int64_t chunk = pick_chunk(g.numel), nchunks = ceil_div(g.numel, chunk);
  const int64_t grid = std::max<int64_t>(1, std::min(nchunks, max_grid<T, M>(device)));  // empty: 1 block
  bool captured = false;
  if (grid > 1) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
    captured = status != cudaStreamCaptureStatusNone;
  }
  const int64_t ws_bytes = nchunks * int64_t(sizeof(Partial<A>));
  at::Tensor ws = at::empty({ws_bytes + (captured ? kVecBytes : 0)}, dev.dtype(at::kByte));
  auto* wp = static_cast<Partial<A>*>(ws.data_ptr());
  unsigned int* ticket = nullptr;
  if (captured) {
    ticket = reinterpret_cast<unsigned int*>(static_cast<char*>(ws.data_ptr()) + ws_bytes);
    C10_CUDA_CHECK(cudaMemsetAsync(ticket, 0, sizeof(unsigned int), stream));
  } else if (grid > 1) {
    ticket = stream_ticket(device, stream);
  }
  summarize_kernel<T, M><<<grid_of(grid), kBlock, 0, stream>>>(p, g, chunk, nchunks, wp, ticket, out_row);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Chooses the walk of t (see the header comment) and fills g for kDense / kStrided.
Mode plan(const at::Tensor& t, Geometry& g) {
  g.numel = t.numel();
  g.ndim = 0;
  if (t.is_contiguous()) return kContig;
  struct Dim { int64_t size, mstride, lstride; };
  std::vector<Dim> dims;
  int64_t lstride = 1;
  for (int64_t d = t.dim() - 1; d >= 0; --d) {
    if (t.size(d) != 1) dims.push_back({t.size(d), t.stride(d), lstride});
    lstride *= t.size(d);
  }
  const auto key = [](const Dim& d) { return d.mstride == 0 ? std::numeric_limits<int64_t>::max() : d.mstride; };
  std::stable_sort(dims.begin(), dims.end(), [&](const Dim& a, const Dim& b) { return key(a) < key(b); });
  std::vector<Dim> c;
  for (const Dim& d : dims) {
    if (!c.empty() && d.mstride == c.back().mstride * c.back().size &&
        d.lstride == c.back().lstride * c.back().size)
      c.back().size *= d.size;
    else
      c.push_back(d);
  }
  if (c.empty()) c.push_back({1, 1, 1});  // unreachable (is_contiguous), but keeps ndim >= 1
  g.ndim = static_cast<int64_t>(c.size());
  bool dense = true;
  int64_t expect = 1;
  for (size_t d = 0; d < c.size() && d < size_t(kMaxDims); ++d) {
    g.size[d] = c[d].size, g.mstride[d] = c[d].mstride, g.lstride[d] = c[d].lstride;
    dense = dense && c[d].mstride == expect;
    expect *= c[d].size;
  }
  return dense ? kDense : kStrided;
}

// Single-tensor path into out_row (8 doubles on the device). Graph capturable.
void summarize_into(const at::Tensor& x, double* out_row, const at::TensorOptions& dev) {
  Geometry g;
  Mode mode = plan(x, g);
  c10::MaybeOwned<at::Tensor> read = c10::MaybeOwned<at::Tensor>::borrowed(x);
  if (g.ndim > kMaxDims) {  // > 25 dims that no stride pattern merges: pathological, copy once
    read = c10::MaybeOwned<at::Tensor>::owned(x.contiguous());
    mode = plan(*read, g);
  }
  const at::Tensor& t = *read;
  const c10::DeviceIndex device = t.device().index();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device);
  dispatch(t.scalar_type(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* p = static_cast<const T*>(t.data_ptr());
    if (mode == kContig) launch_one<T, kContig>(p, g, out_row, dev, device, stream);
    else if (mode == kDense) launch_one<T, kDense>(p, g, out_row, dev, device, stream);
    else launch_one<T, kStrided>(p, g, out_row, dev, device, stream);
  });
}

// The device table of one summarize_many dtype group (layout: scan_many_kernel), cached. The table
// is a pure function of `words` -- (data pointer, numel, output row) of each tensor of the group, in
// order: chunk, prefix and tix follow from the numels -- so a cached table whose key equals the
// call's key in FULL (every word compared, no hash) is byte for byte the table a fresh build would
// copy: a changed list (another tensor, another offset, another length or order) misses, and new
// values in the same buffers need no new table (it holds no values). The key also holds the device,
// the dtype and the stream (cudaStreamGetId, unique for the life of the program): a table is
// allocated, copied and only ever read on its own stream, so stream order alone makes a hit wait for
// its copy, and an evicted table's memory goes back to the caching allocator on that stream, after
// every kernel that read it. A miss builds the table in pinned memory from the host caching
// allocator and copies it non-blocking (the allocator records an event, so the buffer is not
// recycled before the copy ran) -- as every call did before; a hit (the monitor's case: the same
// parameter list every step) makes no pinned allocation and no host-to-device copy. Never used
// under stream capture (summarize_many_cuda): a graph must not depend on a table that an eager call
// may evict.
struct TableKey {
  int device = 0;
  unsigned long long stream = 0;
  int dtype = 0;
  std::vector<int64_t> words;  // 3 per tensor: data pointer, numel, output row
  bool operator==(const TableKey& o) const {
    return device == o.device && stream == o.stream && dtype == o.dtype && words == o.words;
  }
};
struct ManyTable {
  at::Tensor meta;  // int64 on the device: [ptr[n], numel[n], prefix[n+1], row[n]], then int32 tix[blocks]
  int64_t chunk = 0, blocks = 0;
};
constexpr size_t kTableCacheEntries = 16;  // most recently used kept; a table is ~ 32 n + 4 blocks bytes

ManyTable many_table(TableKey key, const at::TensorOptions& dev) {
  struct Entry { TableKey key; ManyTable table; };
  static std::mutex mutex;
  static auto* cache = new std::vector<Entry>();  // most recently used first; never freed (as tickets)
  {
    const std::lock_guard<std::mutex> lock(mutex);
    for (size_t i = 0; i < cache->size(); ++i) {
      if ((*cache)[i].key == key) {
        std::rotate(cache->begin(), cache->begin() + i, cache->begin() + i + 1);
        return cache->front().table;  // a copy: its tensor stays alive until the caller's launches are queued
      }
    }
  }
  const int64_t n = static_cast<int64_t>(key.words.size() / 3);
  TORCH_CHECK(n <= std::numeric_limits<int32_t>::max(), "nanscan.summarize_many: ", n, " tensors of one dtype");
  ManyTable t;
  int64_t total = 0;
  for (int64_t k = 0; k < n; ++k) total += key.words[3 * k + 1];
  t.chunk = pick_chunk(total);
  for (int64_t k = 0; k < n; ++k) t.blocks += ceil_div(key.words[3 * k + 1], t.chunk);
  const int64_t words = 4 * n + 1 + (t.blocks + 1) / 2;  // tix: 2 int32 per int64 word
  at::Tensor host = at::empty({words}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* h = static_cast<int64_t*>(host.data_ptr());
  int64_t* prefix = h + 2 * n;
  int32_t* tix = reinterpret_cast<int32_t*>(h + 4 * n + 1);
  prefix[0] = 0;
  for (int64_t k = 0; k < n; ++k) {
    h[k] = key.words[3 * k];
    h[n + k] = key.words[3 * k + 1];
    prefix[k + 1] = prefix[k] + ceil_div(key.words[3 * k + 1], t.chunk);
    h[3 * n + 1 + k] = key.words[3 * k + 2];
    for (int64_t c = prefix[k]; c < prefix[k + 1]; ++c) tix[c] = static_cast<int32_t>(k);
  }
  if (t.blocks % 2 != 0) tix[t.blocks] = 0;  // padding of the last word: never read, but defined
  t.meta = host.to(dev.device(), at::kLong, /*non_blocking=*/true);  // on the current stream = key.stream
  const std::lock_guard<std::mutex> lock(mutex);
  cache->insert(cache->begin(), Entry{std::move(key), t});  // a concurrent miss may add a twin: harmless
  if (cache->size() > kTableCacheEntries) cache->pop_back();
  return t;
}

// One scan launch + one combine launch for contiguous tensors ts[idx] of one dtype, chunking the
// group as a whole (chunk from the group's total numel).
template <typename T>
void summarize_group(const std::vector<c10::MaybeOwned<at::Tensor>>& ts, const std::vector<int64_t>& idx,
                     double* out, const at::TensorOptions& dev, cudaStream_t stream) {
  using A = typename Traits<T>::A;
  const int64_t n = static_cast<int64_t>(idx.size());
  TableKey key;
  key.device = dev.device().index();
  C10_CUDA_CHECK(cudaStreamGetId(stream, &key.stream));
  key.dtype = static_cast<int>(ts[idx[0]]->scalar_type());
  key.words.resize(3 * n);
  for (int64_t k = 0; k < n; ++k) {
    const at::Tensor& t = *ts[idx[k]];
    key.words[3 * k] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.data_ptr()));
    key.words[3 * k + 1] = t.numel();
    key.words[3 * k + 2] = idx[k];
  }
  const ManyTable table = many_table(std::move(key), dev);
  const int64_t* m = static_cast<const int64_t*>(table.meta.data_ptr());
  const int32_t* tix = reinterpret_cast<const int32_t*>(m + 4 * n + 1);
  at::Tensor ws = at::empty({table.blocks * int64_t(sizeof(Partial<A>))}, dev.dtype(at::kByte));
  auto* wp = static_cast<Partial<A>*>(ws.data_ptr());
  if (table.blocks > 0) {
    scan_many_kernel<T><<<grid_of(table.blocks), kBlock, 0, stream>>>(m, tix, n, table.chunk, wp);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  combine_kernel<A><<<grid_of(n), kBlock, 0, stream>>>(wp, m + 2 * n, m + 3 * n + 1, out);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor summarize_cuda(const at::Tensor& x) {
  const c10::MaybeOwned<at::Tensor> input = normalized_input(x, "nanscan.summarize");
  const at::Tensor& t = *input;
  const c10::cuda::CUDAGuard guard(t.device());
  const auto dev = at::TensorOptions().device(t.device());
  at::Tensor out = at::empty({kRecordSize}, dev.dtype(at::kDouble));
  summarize_into(t, static_cast<double*>(out.data_ptr()), dev);
  return out;
}

at::Tensor summarize_many_cuda(at::TensorList xs) {
  const int64_t n = static_cast<int64_t>(xs.size());
  // No tensor, no device: the empty result lives on the CPU. (The dispatcher does not route an
  // empty list here by itself; this covers direct calls.)
  if (n == 0) return at::empty({0, kRecordSize}, at::TensorOptions().dtype(at::kDouble));
  // The tensors as the kernels read them: borrowed from xs (which outlives this call) where nothing
  // was converted -- no reference-count traffic per tensor --, owned where normalization made a new
  // tensor (a complex tensor's real view, a resolved negation).
  std::vector<c10::MaybeOwned<at::Tensor>> ts;
  ts.reserve(n);
  for (const at::Tensor& x : xs) ts.push_back(normalized_input(x, "nanscan.summarize_many"));
  const at::Device device = ts[0]->device();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK_VALUE(ts[i]->is_cuda() && ts[i]->device() == device,
                      "nanscan.summarize_many: all tensors must be on one CUDA device, but xs[", i,
                      "] is on ", ts[i]->device(), " and xs[0] is on ", device);
  const c10::cuda::CUDAGuard guard(device);
  const auto dev = at::TensorOptions().device(device);
  at::Tensor out = at::empty({n, kRecordSize}, dev.dtype(at::kDouble));
  double* o = static_cast<double*>(out.data_ptr());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));

  std::array<std::vector<int64_t>, static_cast<size_t>(at::ScalarType::NumOptions)> groups;
  for (int64_t i = 0; i < n; ++i) {
    if (capture == cudaStreamCaptureStatusNone && ts[i]->is_contiguous())
      groups[static_cast<size_t>(ts[i]->scalar_type())].push_back(i);
    else
      summarize_into(*ts[i], o + i * kRecordSize, dev);
  }
  for (size_t s = 0; s < groups.size(); ++s) {
    if (groups[s].empty()) continue;
    dispatch(static_cast<at::ScalarType>(s), [&](auto tag) {
      summarize_group<typename decltype(tag)::type>(ts, groups[s], o, dev, stream);
    });
  }
  return out;
}

}  // namespace
}  // namespace nanscan

TORCH_LIBRARY_IMPL(nanscan, CUDA, m) {
  m.impl("summarize", &nanscan::summarize_cuda);
  m.impl("summarize_many", &nanscan::summarize_many_cuda);
}
