// nanscan CUDA backend: the CUDA-key kernels of nanscan::summarize and nanscan::summarize_many.
//
// Algorithm: one read of every element, no host sync, no atomics, deterministic.
//  1. Scan. A tensor is cut into chunks of `chunk` elements in walk order (a power of two in
//     [4096, 65536] picked from numel, so small tensors still spread over the SMs). One block of 256
//     threads reduces one chunk: each thread folds elements into registers (uint32 counts, min/max
//     in the compute type, sumsq in the accumulation type, min logical index of a non-finite), the
//     block merges the 256 thread results with a fixed shuffle + shared-memory tree, and thread 0
//     writes one Partial (record.h) to a workspace from the caching allocator.
//     Linear memory is read with 16-byte vector loads, 4 in flight per thread; a scalar head/tail
//     covers a pointer that is not 16-byte aligned and ragged chunk ends.
//  2. Combine. One block per tensor merges that tensor's partials in a fixed order (thread t takes
//     partials t, t+256, ...; then the same fixed tree) and writes the float64 [8] row. The chunking
//     depends only on numel, so sumsq is bitwise reproducible run to run.
// Walk order. Contiguous tensors are walked in memory order = logical order. Other tensors are
// walked in MEMORY order too: size-1 dims dropped, dims sorted by stride (stride-0 expanded dims
// outermost, so a warp still reads consecutive addresses), neighbours merged where both the memory
// and the logical strides allow. A dense permuted tensor (transposed, channels_last) then reads
// memory linearly and takes the vector path; anything else (steps, expand, overlap) computes each
// element's offset from the coalesced sizes/strides. first_nonfinite_index is the MIN over the
// LOGICAL row-major indices of non-finite elements, so it depends on neither the walk nor the
// reduction order; for permuted walks a chunk that met a NaN/Inf re-reads itself once to compute
// logical indices (rescan_first), keeping index arithmetic out of the hot loop.
// summarize_many. Contiguous tensors of one dtype run as ONE scan launch whose blocks find their
// tensor by binary search over a device table (data pointer, numel, chunk prefix, output row) that
// is filled in pinned host memory and copied non-blocking; then one combine launch per dtype.
// Non-contiguous tensors take the single-tensor path into their row. While the stream is being
// captured into a CUDA graph every tensor takes the single-tensor path, because a graph would
// re-read a pinned staging buffer that the host allocator recycles after the call.
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "../inputs.h"
#include "../record.h"

namespace nanscan {
namespace {

constexpr int kBlock = 256;
constexpr int kWarps = kBlock / 32;
constexpr int kUnroll = 4;          // loads in flight per thread
constexpr int kVecBytes = 16;       // one LDG.128 per vector
constexpr int64_t kMinChunk = 4096, kMaxChunk = 65536, kTargetBlocks = 2048;
constexpr int kMaxDims = 25;        // after coalescing; beyond it we fall back to a contiguous copy

// Per dtype: V, the type elements are compared in (exact for every value of the dtype); S, the
// per-thread sum of squares; A, the sumsq accumulator of the record contract (fp32 for <=32-bit
// floats, fp64 for fp64 and integers). Integers up to 16 bits square exactly in int32 and a thread
// sums at most a few hundred of them, so their S is an exact int64 (then converted to fp64 exactly):
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

// One thread's running result. Per-thread counts fit uint32 since a chunk is <= 65536 elements.
template <typename T> struct Acc {
  using V = typename Traits<T>::V;
  using S = typename Traits<T>::S;
  using A = typename Traits<T>::A;
  uint32_t nan = 0, posinf = 0, neginf = 0, zero = 0;
  V mn = std::numeric_limits<V>::has_infinity ? std::numeric_limits<V>::infinity() : std::numeric_limits<V>::max();
  V mx = std::numeric_limits<V>::has_infinity ? -std::numeric_limits<V>::infinity() : std::numeric_limits<V>::lowest();
  S ss = 0;
  int64_t first = kNoIndex;

  // The caller has checked finite(raw): no branch per element on the hot path.
  __device__ __forceinline__ void add_finite(T raw) {
    const V v = to_val(raw);
    zero += v == V(0);
    if constexpr (Traits<T>::kFloat) {
      mn = fmin(mn, v);
      mx = fmax(mx, v);
      ss += v * v;  // squared in V: an fp32 input of 1e20 gives inf, as the record contract says
    } else {
      mn = v < mn ? v : mn;
      mx = v > mx ? v : mx;
      if constexpr (std::is_integral_v<S>) ss += v * v;  // <= 2**30: exact in int32
      else ss += S(v) * S(v);
    }
  }

  // w is the walk index: the logical index for contiguous walks; for the others it only flags the
  // chunk for the index pass (see rescan_first).
  __device__ __forceinline__ void add(T raw, int64_t w) {
    if (finite(raw)) return add_finite(raw);
    const V v = to_val(raw);
    nan += v != v;
    posinf += v > V(0);
    neginf += v < V(0);
    first = w < first ? w : first;
  }

  __device__ __forceinline__ Partial<A> partial() const {
    Partial<A> p;
    p.nan = nan, p.posinf = posinf, p.neginf = neginf, p.zero = zero;
    if (mn <= mx) p.min = static_cast<double>(mn), p.max = static_cast<double>(mx);  // else +-inf
    p.sumsq = static_cast<A>(ss);
    p.first = first;
    return p;
  }
};

// Fixed-shape tree over a warp, then over the warps: the merge order never depends on timing.
template <typename A> __device__ __forceinline__ void warp_merge(Partial<A>& p) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    Partial<A> q;
    q.nan = __shfl_down_sync(0xffffffffu, p.nan, o);
    q.posinf = __shfl_down_sync(0xffffffffu, p.posinf, o);
    q.neginf = __shfl_down_sync(0xffffffffu, p.neginf, o);
    q.zero = __shfl_down_sync(0xffffffffu, p.zero, o);
    q.min = __shfl_down_sync(0xffffffffu, p.min, o);
    q.max = __shfl_down_sync(0xffffffffu, p.max, o);
    q.sumsq = __shfl_down_sync(0xffffffffu, p.sumsq, o);
    q.first = __shfl_down_sync(0xffffffffu, p.first, o);
    p.merge(q);
  }
}

// Result valid in thread 0. Called once per kernel, so the shared buffer is never reused.
template <typename A> __device__ __forceinline__ Partial<A> block_merge(Partial<A> p) {
  // Raw storage: __shared__ variables cannot have Partial's default member initializers.
  __shared__ __align__(16) unsigned char buf[kWarps * sizeof(Partial<A>)];
  auto* s = reinterpret_cast<Partial<A>*>(buf);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  warp_merge(p);
  if (lane == 0) s[warp] = p;
  __syncthreads();
  if (warp == 0) {
    p = lane < kWarps ? s[lane] : Partial<A>();
    warp_merge(p);
  }
  return p;
}

struct Identity {
  __device__ __forceinline__ int64_t operator()(int64_t w) const { return w; }
};

// Elements [begin, end) of the walk, element w at p[off(w)]; kUnroll loads issued before use.
template <typename T, class Off>
__device__ __forceinline__ void scan_elems(Acc<T>& acc, const T* __restrict__ p, int64_t begin,
                                           int64_t end, const Off& off) {
  for (int64_t i = begin + threadIdx.x; i < end; i += int64_t(kBlock) * kUnroll) {
    T v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (i + u * kBlock < end) v[u] = p[off(i + u * kBlock)];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (i + u * kBlock < end) acc.add(v[u], i + u * kBlock);
  }
}

template <typename T> struct alignas(kVecBytes) Vec { T v[kVecBytes / sizeof(T)]; };

// Explicit LDG.128 (read-only path): the multi-tensor kernel reads its pointers from a table, and
// the compiler would otherwise emit generic-address loads for them.
template <typename T> __device__ __forceinline__ Vec<T> load_vec(const Vec<T>* p) {
  const uint4 r = __ldg(reinterpret_cast<const uint4*>(p));
  Vec<T> v;
  memcpy(&v, &r, sizeof(v));
  return v;
}

// Elements [begin, end) of linear memory p: a scalar head up to the first 16-byte boundary, vector
// body, scalar tail. A pointer that is not even element aligned (from_blob) stays scalar.
template <typename T>
__device__ __forceinline__ void scan_linear(Acc<T>& acc, const T* __restrict__ p, int64_t begin,
                                            int64_t end) {
  constexpr int64_t kVec = kVecBytes / sizeof(T);
  const auto addr = reinterpret_cast<uintptr_t>(p);
  int64_t vbeg = end, vend = end;
  if (addr % sizeof(T) == 0) {
    const int64_t mis = static_cast<int64_t>(addr % kVecBytes / sizeof(T));  // p - mis is aligned
    vbeg = (begin + mis + kVec - 1) / kVec * kVec - mis;
    vend = (end + mis) / kVec * kVec - mis;
    if (vbeg >= vend) vbeg = vend = end;
  }
  scan_elems(acc, p, begin, vbeg, Identity{});
  const Vec<T>* __restrict__ vp = reinterpret_cast<const Vec<T>*>(p + vbeg);
  const int64_t nv = (vend - vbeg) / kVec;
  for (int64_t i = threadIdx.x; i < nv; i += int64_t(kBlock) * kUnroll) {
    Vec<T> v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (i + u * kBlock < nv) v[u] = load_vec(vp + i + u * kBlock);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (i + u * kBlock < nv) {
        const int64_t w = vbeg + (i + u * kBlock) * kVec;
        bool all = true;  // one branch per vector: NaN/Inf are rare
#pragma unroll
        for (int e = 0; e < kVec; ++e) all &= finite(v[u].v[e]);
        if (all) {
#pragma unroll
          for (int e = 0; e < kVec; ++e) acc.add_finite(v[u].v[e]);
        } else {
#pragma unroll
          for (int e = 0; e < kVec; ++e) acc.add(v[u].v[e], w + e);
        }
      }
  }
  scan_elems(acc, p, vend, end, Identity{});
}

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

// Index pass for a non-contiguous chunk that holds a non-finite element: the main pass only knew
// walk indices, whose minimum need not be the minimum logical index. Re-reads the chunk once and
// takes the minimum logical index; this keeps index arithmetic out of the hot loop, and only
// chunks that contain NaN/Inf (the failure case) pay for it.
template <typename T, class Off>
__device__ __noinline__ int64_t rescan_first(const T* __restrict__ p, int64_t begin, int64_t end,
                                             const Geometry& g, const Off& off) {
  int64_t first = kNoIndex;
  for (int64_t w = begin + threadIdx.x; w < end; w += kBlock) {
    if (!finite(p[off(w)])) {
      const int64_t l = walk_to<uint64_t>(g, w, g.lstride);
      first = l < first ? l : first;
    }
  }
  return first;
}

template <typename T, Mode M>
__global__ void __launch_bounds__(kBlock)
    scan_one_kernel(const T* __restrict__ p, const Geometry g, int64_t chunk,
                    Partial<typename Traits<T>::A>* __restrict__ ws) {
  const int64_t begin = int64_t(blockIdx.x) * chunk, end = min(begin + chunk, g.numel);
  Acc<T> acc;
  if constexpr (M == kContig) {
    scan_linear(acc, p, begin, end);
  } else {
    // Shared copy: the dims are indexed dynamically, which kernel parameters serve poorly.
    __shared__ Geometry sg;
    for (int i = threadIdx.x; i < int(sizeof(Geometry) / 8); i += kBlock)
      reinterpret_cast<int64_t*>(&sg)[i] = reinterpret_cast<const int64_t*>(&g)[i];
    __syncthreads();
    const auto off32 = [&](int64_t w) { return walk_to<uint32_t>(sg, w, sg.mstride); };
    const auto off64 = [&](int64_t w) { return walk_to<uint64_t>(sg, w, sg.mstride); };
    const bool small = g.numel <= int64_t(UINT32_MAX);
    if constexpr (M == kDense) scan_linear(acc, p, begin, end);
    else if (small) scan_elems(acc, p, begin, end, off32);
    else scan_elems(acc, p, begin, end, off64);
    if constexpr (!Traits<T>::kFloat) {
      // integers are finite: no index pass
    } else if (__syncthreads_or(acc.first != kNoIndex)) {  // block-uniform
      if constexpr (M == kDense) acc.first = rescan_first(p, begin, end, sg, Identity{});
      else if (small) acc.first = rescan_first(p, begin, end, sg, off32);
      else acc.first = rescan_first(p, begin, end, sg, off64);
    }
  }
  const auto r = block_merge(acc.partial());
  if (threadIdx.x == 0) ws[blockIdx.x] = r;
}

// Multi-tensor scan. meta = [ptr[n], numel[n], prefix[n+1], row[n]]; block b scans chunk
// b - prefix[r] of tensor r, the largest r with prefix[r] <= b (empty tensors own no chunk).
template <typename T>
__global__ void __launch_bounds__(kBlock)
    scan_many_kernel(const int64_t* __restrict__ meta, int64_t n, int64_t chunk,
                     Partial<typename Traits<T>::A>* __restrict__ ws) {
  const int64_t* prefix = meta + 2 * n;
  const int64_t b = blockIdx.x;
  int64_t lo = 0, hi = n - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (prefix[mid] <= b) lo = mid; else hi = mid - 1;
  }
  const T* p = reinterpret_cast<const T*>(meta[lo]);
  const int64_t begin = (b - prefix[lo]) * chunk, end = min(begin + chunk, meta[n + lo]);
  Acc<T> acc;
  scan_linear(acc, p, begin, end);
  const auto r = block_merge(acc.partial());
  if (threadIdx.x == 0) ws[b] = r;
}

// Block r merges partials [prefix[r], prefix[r+1]) into out row rows[r]; with prefix == nullptr
// (single tensor) it merges [0, count) into out. Zero partials give the identity record.
template <typename A>
__global__ void __launch_bounds__(kBlock)
    combine_kernel(const Partial<A>* __restrict__ ws, const int64_t* __restrict__ prefix,
                   const int64_t* __restrict__ rows, int64_t count, double* __restrict__ out) {
  int64_t lo = 0, hi = count;
  if (prefix != nullptr) {
    lo = prefix[blockIdx.x], hi = prefix[blockIdx.x + 1];
    out += rows[blockIdx.x] * kRecordSize;
  }
  Partial<A> p;
  for (int64_t i = lo + threadIdx.x; i < hi; i += kBlock) p.merge(ws[i]);
  p = block_merge(p);
  if (threadIdx.x == 0) p.write(out);
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

// Smallest power-of-two chunk (>= kMinChunk) that keeps the grid near kTargetBlocks; depends only
// on numel, which keeps the merge order (and so sumsq) reproducible.
int64_t pick_chunk(int64_t numel) {
  int64_t c = kMinChunk;
  while (c < kMaxChunk && ceil_div(numel, c) > kTargetBlocks) c *= 2;
  return c;
}

dim3 grid_of(int64_t blocks) {
  TORCH_CHECK(blocks <= std::numeric_limits<int32_t>::max(), "nanscan: grid of ", blocks, " blocks");
  return dim3(static_cast<unsigned>(blocks));
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

// Single-tensor path: scan + combine into out_row (8 doubles on the device). Graph capturable.
void summarize_into(at::Tensor t, double* out_row, const at::TensorOptions& dev) {
  Geometry g;
  Mode mode = plan(t, g);
  if (g.ndim > kMaxDims) {  // > 25 dims that no stride pattern merges: pathological, copy once
    t = t.contiguous();
    mode = plan(t, g);
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch(t.scalar_type(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = typename Traits<T>::A;
    const int64_t chunk = pick_chunk(g.numel), blocks = ceil_div(g.numel, chunk);
    at::Tensor ws = at::empty({blocks * int64_t(sizeof(Partial<A>))}, dev.dtype(at::kByte));
    auto* wp = static_cast<Partial<A>*>(ws.data_ptr());
    if (blocks > 0) {  // no zero-size grid: an empty tensor goes straight to the combine
      const T* p = static_cast<const T*>(t.data_ptr());
      if (mode == kContig) scan_one_kernel<T, kContig><<<grid_of(blocks), kBlock, 0, stream>>>(p, g, chunk, wp);
      else if (mode == kDense) scan_one_kernel<T, kDense><<<grid_of(blocks), kBlock, 0, stream>>>(p, g, chunk, wp);
      else scan_one_kernel<T, kStrided><<<grid_of(blocks), kBlock, 0, stream>>>(p, g, chunk, wp);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    combine_kernel<A><<<1, kBlock, 0, stream>>>(wp, nullptr, nullptr, blocks, out_row);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

// One scan launch + one combine launch for contiguous tensors ts[idx] of one dtype.
template <typename T>
void summarize_group(const std::vector<at::Tensor>& ts, const std::vector<int64_t>& idx, double* out,
                     const at::TensorOptions& dev, cudaStream_t stream) {
  using A = typename Traits<T>::A;
  const int64_t n = static_cast<int64_t>(idx.size());
  int64_t total = 0;
  for (int64_t i : idx) total += ts[i].numel();
  const int64_t chunk = pick_chunk(total);
  at::Tensor host = at::empty({4 * n + 1}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* h = static_cast<int64_t*>(host.data_ptr());
  int64_t* prefix = h + 2 * n;
  prefix[0] = 0;
  for (int64_t k = 0; k < n; ++k) {
    const at::Tensor& t = ts[idx[k]];
    h[k] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.data_ptr()));
    h[n + k] = t.numel();
    prefix[k + 1] = prefix[k] + ceil_div(t.numel(), chunk);
    h[3 * n + 1 + k] = idx[k];
  }
  const int64_t blocks = prefix[n];
  // Pinned source + non_blocking: an async copy on the current stream; the host allocator records
  // an event so the buffer is not recycled before the copy ran.
  const at::Tensor meta = host.to(dev.device(), at::kLong, /*non_blocking=*/true);
  const int64_t* m = static_cast<const int64_t*>(meta.data_ptr());
  at::Tensor ws = at::empty({blocks * int64_t(sizeof(Partial<A>))}, dev.dtype(at::kByte));
  auto* wp = static_cast<Partial<A>*>(ws.data_ptr());
  if (blocks > 0) {
    scan_many_kernel<T><<<grid_of(blocks), kBlock, 0, stream>>>(m, n, chunk, wp);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  combine_kernel<A><<<grid_of(n), kBlock, 0, stream>>>(wp, m + 2 * n, m + 3 * n + 1, 0, out);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor summarize_cuda(const at::Tensor& x) {
  const at::Tensor t = normalize_input(x, "nanscan.summarize");
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
  std::vector<at::Tensor> ts;
  ts.reserve(n);
  for (const at::Tensor& x : xs) ts.push_back(normalize_input(x, "nanscan.summarize_many"));
  const at::Device device = ts[0].device();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK_VALUE(ts[i].is_cuda() && ts[i].device() == device,
                      "nanscan.summarize_many: all tensors must be on one CUDA device, but xs[", i,
                      "] is on ", ts[i].device(), " and xs[0] is on ", device);
  const c10::cuda::CUDAGuard guard(device);
  const auto dev = at::TensorOptions().device(device);
  at::Tensor out = at::empty({n, kRecordSize}, dev.dtype(at::kDouble));
  double* o = static_cast<double*>(out.data_ptr());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));

  std::array<std::vector<int64_t>, static_cast<size_t>(at::ScalarType::NumOptions)> groups;
  for (int64_t i = 0; i < n; ++i) {
    if (capture == cudaStreamCaptureStatusNone && ts[i].is_contiguous())
      groups[static_cast<size_t>(ts[i].scalar_type())].push_back(i);
    else
      summarize_into(ts[i], o + i * kRecordSize, dev);
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
