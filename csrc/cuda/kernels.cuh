// nanscan CUDA backend, device side (2 of 2): how a block reads a chunk and the __global__ kernels.
// Linear reads (16-byte vectors, scalar head / tail), strided walks, the two passes over a chunk
// (scan_chunk, then classify_chunk where the first pass did not prove the chunk clean), the merge
// of partials and the last-block ticket, and the kernels summarize_kernel, scan_many_kernel and
// combine_kernel. The per-thread arithmetic they use: reduce.cuh. Launches: summarize.cu.
//
// Included only by summarize.cu (one translation unit): everything is in nanscan's anonymous
// namespace there, as it is here.
#pragma once

#include <cstdint>
#include <cstring>

#include "../record.h"
#include "reduce.cuh"

namespace nanscan {
namespace {

// Note [assume, then prove]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// One read of every element (two for a chunk holding a NaN / Inf), as the CPU kernel's VecState.
// The first pass over a chunk (scan_chunk; fast_linear for linear memory) keeps only the zero
// count, min / max and the sums of squares, values and fourth powers -- no classification, no
// index --, reading linear memory
// with 16-byte loads, 4 in flight per thread (a scalar head / tail covers a pointer that is not
// 16-byte aligned and ragged chunk ends). fp16 / bf16 (and float8 e4m3fn / e5m2, converted exactly
// to fp16 pairs) keep min, max and the zero count two lanes at a time (Lanes, reduce.cuh: HMNMX2,
// HSET2 + HADD2; per run, at most 128 per lane: exact). A NaN or Inf makes the thread's sum of
// squares non-finite (squares are >= 0, so it never comes back), so `__syncthreads_or(!isfinite(ss))`
// proves the chunk clean; otherwise (or when the sum of squares overflowed) the chunk is read again
// by a pass (classify_chunk) that classifies every element and takes the minimum LOGICAL index of
// the non-finite ones. Both passes give a thread the same elements in the same order, so whichever
// pass ran, the sums are formed the same way.

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
      for (int k = 0; k < Packing<T>::kPairs; ++k) lanes.add(Packing<T>::pair(w, k), f);
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
// That is the price of long chunks (See Note [chunk size] in summarize.cu): one NaN in a tensor of
// 2**31 fp32 elements re-reads a whole chunk, 4 MiB, in a single block at the end of the launch.
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

// Note [walk order]
// ~~~~~~~~~~~~~~~~~
// Contiguous tensors are walked in memory order = logical order (kContig). Other tensors are walked
// in MEMORY order too (plan, summarize.cu): size-1 dims dropped, dims sorted by stride (stride-0
// expanded dims outermost, so a warp still reads consecutive addresses), neighbours merged where
// both the memory and the logical strides allow. A dense permuted tensor (transposed,
// channels_last) then reads memory linearly and takes the vector path (kDense); anything else
// (steps, expand, overlap) computes each element's offset from the coalesced sizes / strides
// (kStrided). first_nonfinite_index is the MIN over the LOGICAL row-major indices of non-finite
// elements, so it depends on neither the walk nor the reduction order; only the classifying pass
// computes logical indices, and only for non-finite elements.

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

// Note [runs]
// ~~~~~~~~~~~
// A chunk (See Note [chunk size] in summarize.cu) is read as runs of kSegment = 65536 elements (a
// chunk of <= 65536 is one run): a thread takes 256 elements of a run, sums their squares, values
// and fourth powers afresh (the record contract: FP32 sums in blocks of at most 256 terms), and
// folds its packed lanes (Lanes, reduce.cuh) into 32-bit counts at the run's end, so a packed zero
// count never passes 128 whatever the chunk; the chunk's sums are the runs' sums added in order.
// What a thread keeps between runs (those sums, the chunk's end) waits in shared memory (RunState),
// not in registers the element loops need. Up to 2**27 elements every chunk is one run, summed as if
// there were no runs (0 + x == x).

// What a thread keeps across the runs of a chunk -- the sums of the runs read so far and the chunk's
// end -- in shared memory while a run is read: a few accesses per run, where values held in
// registers across the element loops made ptxas spill inside them (fp64, strided). Volatile, so
// the compiler cannot carry them in registers after all. Slot threadIdx.x: its own thread only.
template <typename T> struct RunState {
  typename Traits<T>::S ss, s1;
  typename Traits<T>::S4 s4;
  int64_t end;

  // Starts a run: the thread's sums start afresh. Ends it: they join the chunk's (volatile: one
  // shared-memory load and store each).
  __device__ __forceinline__ void start(Fast<T>& f) volatile { f.ss = 0, f.s1 = 0, f.s4 = 0; }
  __device__ __forceinline__ void finish(const Fast<T>& f) volatile {
    ss = ss + f.ss;  // a NaN / Inf run: non-finite for good (squares are >= 0)
    s1 = s1 + f.s1;
    s4 = s4 + f.s4;
  }
  __device__ __forceinline__ void total_into(Fast<T>& f) volatile { f.ss = ss, f.s1 = s1, f.s4 = s4; }
};
template <typename T> __device__ __forceinline__ volatile RunState<T>* run_state(int64_t end) {
  __shared__ RunState<T> state[kBlock];
  volatile RunState<T>* const run = state + threadIdx.x;
  run->ss = 0, run->s1 = 0, run->s4 = 0;
  run->end = end;
  return run;
}

// Second pass over a chunk whose first pass was not proved clean: classify every element, the
// minimum logical index of the non-finite ones, *dst from thread 0. Not inlined: its registers
// (64-bit index arithmetic) stay out of the first pass, and only such chunks pay for the call.
template <typename T, Mode M>
__device__ __noinline__ void classify_chunk(const T* __restrict__ p, const Geometry* g, int64_t begin,
                                            int64_t end, Partial<typename Traits<T>::A>* dst) {
  Acc<T> acc;
  volatile RunState<T>* const run = run_state<T>(end);
  const auto runs = [&](const auto& one) {  // the runs of scan_chunk, summed the same way
    for (int64_t s = begin; s < run->end;) {
      const int64_t e = min(s + kSegment, run->end);
      run->start(acc.fin);
      one(s, e);
      run->finish(acc.fin);
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
  run->total_into(acc.fin);
  const Partial<typename Traits<T>::A> r = block_reduce(acc.partial());
  if (threadIdx.x == 0) *dst = r;
}

// Walk elements [begin, end) of p -> *dst, written by thread 0. g (shared memory) is the walk of
// kDense / kStrided tensors; unused (may be null) for kContig.
template <typename T, Mode M>
__device__ __forceinline__ void scan_chunk(const T* __restrict__ p, const Geometry* g, int64_t begin,
                                           int64_t end, Partial<typename Traits<T>::A>* dst) {
  Fast<T> f;
  // Runs of kSegment elements (See Note [runs]): each starts its sums (and, in fast_linear, its
  // packed lanes) afresh; the chunk's sums are the runs' sums added in order.
  volatile RunState<T>* const run = run_state<T>(end);
  const auto runs = [&](const auto& one) {
    for (int64_t s = begin; s < run->end;) {
      const int64_t e = min(s + kSegment, run->end);
      run->start(f);
      one(s, e);
      run->finish(f);
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
  run->total_into(f);
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
// possibly stale L1 line. (Partials are 80 bytes at 80-byte offsets of an allocator block: 16-byte
// aligned.)
template <typename A> __device__ __forceinline__ Partial<A> load_partial(const Partial<A>* q) {
  static_assert(sizeof(Partial<A>) % 16 == 0, "Partial is read as uint4");
  uint4 r[sizeof(Partial<A>) / 16];
#pragma unroll
  for (int k = 0; k < int(sizeof(Partial<A>) / 16); ++k) r[k] = __ldcg(reinterpret_cast<const uint4*>(q) + k);
  Partial<A> p;
  memcpy(&p, r, sizeof(p));
  return p;
}

// Note [the merge]
// ~~~~~~~~~~~~~~~~
// The last block of summarize_kernel (See Note [one launch] in summarize.cu), and each block of
// combine_kernel, merges partials in chunk order. The merge is not widened: it is one block of the
// scan kernel (256 threads, each merging partials t, t + 256, ... two 80-byte loads in flight, then
// the tree), and with at most 2048 partials (160 KiB, read from L2) that is <= 8 partials per
// thread for tensors up to 2**31 elements. Widening it further would take a second level of tickets
// (blocks merging groups of partials) or a second launch, for a step of a few microseconds
// (estimated, not measured).

// Block-wide merge of partials [lo, hi) in a fixed order: thread t merges t, t + 256, ... in
// ascending order, then the fixed tree. Result in thread 0; zero partials give the identity record.
template <typename A>
__device__ __forceinline__ Partial<A> merge_partials(const Partial<A>* ws, int64_t lo, int64_t hi) {
  Partial<A> p;
#pragma unroll 2  // two 80-byte partials in flight; more costs registers the scan kernels do not have
  for (int64_t i = lo + threadIdx.x; i < hi; i += kBlock) p.merge(load_partial(ws + i));
  return block_reduce(p);
}

// True, in every thread, in the one block that finishes last. Every block's partials are written by
// its thread 0, which then fences (release) and takes a ticket; the block that draws ticket
// gridDim.x - 1 knows every other block has done so, fences (acquire), and puts the ticket back to 0
// for the next kernel that uses it (nothing else touches it in this launch any more). Which ticket
// the host passes: See Note [tickets] in summarize.cu.
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

// Note [static counts]
// ~~~~~~~~~~~~~~~~~~~~
// Measured statically (no GPU has run this yet): sm_90, nvcc 13.0, the build's own nvcc command line
// (see the setup.py build log) plus `-Xptxas -v`, and `cuobjdump -sass` on the object. Earlier
// counts: benchmarks/results/HISTORY.md.
// Registers, summarize_kernel contiguous / dense (permuted) / strided, __launch_bounds__(256, 4):
//   bf16 63 / 64 / 64, fp16 62 / 64 / 64, fp32 62 / 64 / 64, fp64 64 / 64 / 64, float8 e4m3fn
//   62 / 64 / 64, e5m2 62 / 64 / 64, fnuz 64 / 64 / 64, integers 62 - 64; scan_many_kernel bf16 54,
//   fp32 55, fp64 64, float8 53, integers 54 - 64; combine_kernel 52 (fp32 partials) / 60 (fp64).
//   No spill in any element loop of the first pass but one that is cold (SASS: no STL / LDL inside
//   any innermost loop that loads from global memory, except two LDL per 4 elements in the scalar
//   head / tail loop of bf16 dense, which reads at most one element per thread of a chunk unless the
//   pointer is not element-aligned); the dense / strided kernels store a few words per chunk and run
//   (values of the chunk loop, arguments of the not-inlined classifying pass: 24 - 40 bytes, 80 - 144
//   of stack for fp32 / fp64 / fnuz strided). The classifying pass (not inlined) of strided walks
//   spills, ptxas's bytes of spill stores / loads: fp32 76 / 240, fp64 340 / 536, fnuz 56 / 108 --
//   a chunk with a NaN / Inf only.
// Hot loop (contiguous, a full round of 4 x LDG.128 per thread), SASS instructions per element:
//   bf16  6.88: FFMA 2, FMUL 1, FADD 1 (the three sums), bf16 -> fp32 1 (IMAD.U32 / LOP3),
//         VHMNMX.BF16_V2 0.5 (three-input: min or max of two pairs at once), HSET2 0.5 + HADD2 /
//         HFMA2 0.5 (zero count), LDG 0.125, loop 0.1;
//   fp16  6.88: the same with HADD2.F32 for the conversions;
//   float8 e4m3fn / e5m2  7.41: F2FP 0.5 (fp8x2 -> f16x2) + SHF 0.25, then as fp16;
//   fp32  9.5: FFMA 2, FMUL 1, FADD 1, FMNMX 2, zero count 3 (FSETP + a predicated add), LDG 0.25;
//   fp64 23.6.
//   Runs (See Note [runs]) add per 256 elements of a thread a fold of the packed lanes and a few
//   shared-memory accesses, outside these loop bodies.

// One tensor, one launch (See Note [one launch] in summarize.cu): block b reduces chunks b,
// b + gridDim.x, ... into ws[chunk]; the last block merges ws[0, nchunks) in chunk order into out
// (kRecordSize doubles).
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


}  // namespace
}  // namespace nanscan
