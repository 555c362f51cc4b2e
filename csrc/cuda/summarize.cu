// nanscan CUDA backend: the CUDA-key kernels of nanscan::summarize and nanscan::summarize_many.
// This file is the host side: dtype dispatch, the chunk size, grids, tickets, the plan of a walk,
// the single-tensor launch, the many-tensor table cache and the op registration. The device code:
//   reduce.cuh   constants, dtype traits, a thread's state in either pass (packed 16-bit lanes
//                included), the warp / block tree
//   kernels.cuh  linear reads, strided walks, the two passes over a chunk, the merge of partials,
//                the last-block ticket, the __global__ kernels
//
// Algorithm: one read of every element (two for a chunk holding a NaN / Inf), no host sync, no
// float atomics, deterministic.
//   chunks            See Note [chunk size] (pick_chunk, below) and Note [runs] (kernels.cuh)
//   two passes        See Note [assume, then prove] (kernels.cuh)
//   one launch        See Note [one launch], Note [tickets] (below), Note [the merge] (kernels.cuh)
//   walk order        See Note [walk order] (kernels.cuh)
//   summarize_many    See Note [summarize_many] (below)
//   registers, SASS   See Note [static counts] (kernels.cuh)
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAMacros.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <limits>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "../inputs.h"
#include "../record.h"
#include "kernels.cuh"
#include "reduce.cuh"

namespace nanscan {
namespace {

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

// Note [chunk size]
// ~~~~~~~~~~~~~~~~~
// A tensor is cut into chunks of `chunk` elements in walk order: the smallest power of two in
// [kMinChunk, kMaxChunk] = [4096, 2**20] that makes at most kTargetChunks = 2048 chunks, picked from
// numel alone (the same for every dtype, never a function of the GPU), so small tensors still spread
// over the SMs and big ones leave the merge at most 2048 partials up to 2**31 elements. For example
// 1 GiB of fp32 (2**28 elements): 2048 chunks of 2**17; 1 GiB of bf16 (2**29): 2048 of 2**18; 2**31
// elements: 2048 of 2**20. One block of 256 threads reduces one chunk to one Partial (record.h) in
// a workspace from the caching allocator. Each thread of the block takes the same elements of the
// chunk whichever block runs it, then a fixed shuffle + shared-memory tree merges the 256 thread
// results. A chunk is read as runs of 65536 elements: See Note [runs] (kernels.cuh).

// Smallest power-of-two chunk (>= kMinChunk) that keeps the chunk count near kTargetChunks; depends
// only on numel -- never on the GPU --, which keeps the merge order (and so the sums) reproducible.
int64_t pick_chunk(int64_t numel) {
  int64_t c = kMinChunk;
  while (c < kMaxChunk && ceil_div(numel, c) > kTargetChunks) c *= 2;
  return c;
}

dim3 grid_of(int64_t blocks) {
  TORCH_CHECK(blocks <= std::numeric_limits<int32_t>::max(), "nanscan: grid of ", blocks, " blocks");
  return dim3(static_cast<unsigned>(blocks));
}

// Note [one launch]
// ~~~~~~~~~~~~~~~~~
// summarize of one tensor is one kernel launch (launch_one). The grid is min(chunks, SMs x resident
// blocks per SM) (occupancy query, cached per device and kernel: max_grid); block b reduces chunks
// b, b + grid, ... Each chunk's partial goes to its own slot, so the grid size (and so the GPU
// model) changes only which block computes a chunk, never a result. The last block to finish (a
// ticket: See Note [tickets]; last_block in kernels.cuh) merges the partials in CHUNK order with the
// same fixed tree (See Note [the merge] in kernels.cuh) and writes the float64 [kRecordSize] row: the record
// is a function of the tensor's contents, shape, strides and address alignment (the vector split),
// bitwise, never of the GPU model or of the order in which blocks finish.

// SMs x resident blocks per SM of summarize_kernel<T, M> on `device` (the current device), queried
// once per device and kernel. Only the grid depends on it, never a result: See Note [one launch].
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

// Note [tickets]
// ~~~~~~~~~~~~~~
// The last block of a launch is the one that draws the last ticket (last_block, kernels.cuh). A
// grid of one block needs none. Otherwise, outside stream capture, one ticket per (device, stream),
// allocated and zeroed once on that stream, kept for the life of the process: kernels on one stream
// run one after another, so a ticket is never used by two kernels at once, and each kernel's last
// block puts it back to 0 for the next one; calls on other streams use other tickets. While the
// stream is being captured into a CUDA graph, the ticket is allocated with the workspace (the
// graph's private pool keeps it for the graph's life) and zeroed by a captured cudaMemsetAsync, so a
// replay -- on any stream, beside eager calls or other graphs -- never shares a ticket; the kernel's
// reset is redundant there. (A ticket per call would be as safe, but zeroing it is a second stream
// operation on every eager call, which is what one launch is meant to save.)

// The eager ticket of (device, stream), zeroed once on that stream (See Note [tickets]). Keyed by
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
// See Note [one launch] and Note [tickets].
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

// Chooses the walk of t (See Note [walk order] in kernels.cuh) and fills g for kDense / kStrided.
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

// Single-tensor path into out_row (kRecordSize doubles on the device). Graph capturable.
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

// Note [summarize_many]
// ~~~~~~~~~~~~~~~~~~~~~
// The inputs are borrowed (normalized_input, inputs.h): a tensor read as it is costs no handle copy
// (no reference-count traffic); only a converted one (a complex tensor's real view, a resolved
// negation) is owned, for the call. Contiguous tensors of one dtype run as ONE scan launch, one
// block per chunk of the group (chunked as a whole: chunk from the group's total numel, each tensor
// cut from its own start), then one combine launch per dtype that merges each tensor's partials in
// chunk order; the groups' partials share one workspace, allocated once a call. The blocks read a
// device table, int64 [ptr[n], numel[n], prefix[n+1], row[n]] followed by int32 tix[blocks] (block
// b's tensor: prefix[tix[b]] <= b < prefix[tix[b] + 1]), so a block finds its tensor with one load --
// 32 n + 4 chunks bytes (scan_many_kernel, kernels.cuh).
// Tables are cached (many_table: up to 256, most recently used kept), keyed IN FULL by device,
// stream, dtype and each tensor's (data pointer, numel, output row), of which the table is a pure
// function: calling with the list of the previous step copies nothing to the device; any other list
// builds its table in pinned memory and copies it non-blocking. Non-contiguous tensors take the
// single-tensor path into their row. While the stream is being captured into a CUDA graph every
// tensor takes the single-tensor path, because a graph would re-read a pinned staging buffer that
// the host allocator recycles after the call, or a cached table that an eager call may evict.

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
// recycled before the copy ran); a hit (the monitor's case: the same parameter list every step)
// makes no pinned allocation and no host-to-device copy. Never used under stream capture
// (summarize_many_cuda): a graph must not depend on a table that an eager call may evict.
struct TableKey {
  int device = 0;
  unsigned long long stream = 0;
  int dtype = 0;
  std::vector<int64_t> words;  // 3 per tensor: data pointer, numel, output row
  uint64_t hash = 0;           // of all the above (seal()): compared first, so a miss costs one word
  void seal() {
    uint64_t h = 1469598103934665603ull ^ (uint64_t(device) << 40) ^ (uint64_t(dtype) << 32) ^ stream;
    for (int64_t w : words) h = (h ^ uint64_t(w)) * 1099511628211ull;
    hash = h;
  }
  bool operator==(const TableKey& o) const {
    return hash == o.hash && device == o.device && stream == o.stream && dtype == o.dtype && words == o.words;
  }
};
struct ManyTable {
  at::Tensor meta;  // int64 on the device: [ptr[n], numel[n], prefix[n+1], row[n]], then int32 tix[blocks]
  int64_t chunk = 0, blocks = 0;
};
// Most recently used kept; a table is ~ 32 n + 4 blocks bytes. A watched step makes one call per
// flush of a read window or the gradient sink, one group per dtype: on GPT-2-small about 90 groups
// a step, whose tensors the caching allocator puts at the same addresses step after step -- 16
// entries missed every one of them (each miss a pinned allocation and a host-to-device copy).
constexpr size_t kTableCacheEntries = 256;

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

// The table of the contiguous tensors ts[idx] of one dtype (See Note [summarize_many]): the group
// is chunked as a whole (chunk from the group's total numel).
ManyTable group_table(const std::vector<c10::MaybeOwned<at::Tensor>>& ts, const std::vector<int64_t>& idx,
                      const at::TensorOptions& dev, unsigned long long stream_id) {
  const int64_t n = static_cast<int64_t>(idx.size());
  TableKey key;
  key.device = dev.device().index();
  key.stream = stream_id;
  key.dtype = static_cast<int>(ts[idx[0]]->scalar_type());
  key.words.resize(3 * n);
  for (int64_t k = 0; k < n; ++k) {
    const at::Tensor& t = *ts[idx[k]];
    key.words[3 * k] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.data_ptr()));
    key.words[3 * k + 1] = t.numel();
    key.words[3 * k + 2] = idx[k];
  }
  key.seal();
  return many_table(std::move(key), dev);
}

// One scan launch + one combine launch for the n tensors of one dtype group, whose partials go to
// wp (table.blocks of them). See Note [summarize_many].
template <typename T>
void launch_group(const ManyTable& table, int64_t n, Partial<typename Traits<T>::A>* wp, double* out,
                  cudaStream_t stream) {
  using A = typename Traits<T>::A;
  const int64_t* m = static_cast<const int64_t*>(table.meta.data_ptr());
  const int32_t* tix = reinterpret_cast<const int32_t*>(m + 4 * n + 1);
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

// See Note [summarize_many].
at::Tensor summarize_many_cuda(at::TensorList xs) {
  const int64_t n = static_cast<int64_t>(xs.size());
  // No tensor, no device: the empty result lives on the CPU. (The dispatcher does not route an
  // empty list here by itself; this covers direct calls.)
  if (n == 0) return at::empty({0, kRecordSize}, at::TensorOptions().dtype(at::kDouble));
  check_one_device(xs, "nanscan.summarize_many");  // (first: nothing is read from a mixed list)
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
  // Every group's table first, then ONE workspace for all their partials (each group's at a
  // 256-byte aligned offset), then the launches: an allocation a call, not one a dtype group.
  struct Planned { at::ScalarType dtype; int64_t n; ManyTable table; int64_t offset; };
  std::vector<Planned> planned;
  int64_t ws_bytes = 0;
  unsigned long long stream_id = 0;
  for (size_t s = 0; s < groups.size(); ++s) {
    if (groups[s].empty()) continue;
    if (planned.empty()) C10_CUDA_CHECK(cudaStreamGetId(stream, &stream_id));
    const auto dtype = static_cast<at::ScalarType>(s);
    Planned p{dtype, static_cast<int64_t>(groups[s].size()), group_table(ts, groups[s], dev, stream_id), ws_bytes};
    int64_t partial = 0;
    dispatch(dtype, [&](auto tag) { partial = sizeof(Partial<typename Traits<typename decltype(tag)::type>::A>); });
    ws_bytes += (p.table.blocks * partial + 255) / 256 * 256;
    planned.push_back(std::move(p));
  }
  if (planned.empty()) return out;
  const at::Tensor ws = at::empty({std::max<int64_t>(ws_bytes, 1)}, dev.dtype(at::kByte));
  char* base = static_cast<char*>(ws.data_ptr());
  for (const Planned& p : planned) {
    dispatch(p.dtype, [&](auto tag) {
      using T = typename decltype(tag)::type;
      launch_group<T>(p.table, p.n, reinterpret_cast<Partial<typename Traits<T>::A>*>(base + p.offset), o, stream);
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
