// The monitor's backward tap: a pre-hook on the autograd node that made a recorded module output
// receives the gradient flowing into that output and hands it to a GradSink, which summarizes a
// CPU gradient on arrival (summarized_on_arrival, below) and queues the others, summarized in
// batches (nanscan::summarize_many through the dispatcher, or the Python callable of another
// kernel backend). No Python runs in the backward with the default kernels,
// and registering the hook costs a C++ call instead of a Python hook object per output per step.
//
// Python API (module nanscan._C):
//   sink = GradSink(batch, bytes, summarize=None)  summarizes every `batch` gradients or `bytes`
//                                   of them; summarize: a Python callable list -> [k, RECORD_SIZE]
//                                   (None: the nanscan::summarize_many op)
//   sink.generation                 hooks of an older generation do nothing
//   tap(tensor, sink, index)        hook tensor.grad_fn (no-op for a leaf); index: the output's slot
//   len(sink)                       gradients received since the last take()
//   sink.take() -> (records, meta)
//       records: list of [k, RECORD_SIZE] tensors (in order); meta: a GradMeta, per gradient k, in
//       the order autograd produced them: meta.index(k) (the slot index of the output it flowed
//       into), meta.stale(k) (changed in place before it was summarized), meta.dtype(k),
//       meta.shape(k), and meta.dtype_maxima() (float64 tensor: each gradient's dtype's largest
//       finite value); len(meta) gradients. Python objects are made only for the gradients asked
//       about (a non-finite one), not for the hundreds a step has.
#pragma once

#include <torch/extension.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "../inputs.h"
#include "../record.h"
#include "streams.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <type_traits>
#include <vector>

namespace nanscan {

// The tensor's version counter, -1 for an inference tensor (it has none). The same value as
// TensorBase::_version(), read inline: that one is an out-of-line call through the autograd
// VariableHooks, made several times per recorded tensor on the hooks' per-call path.
inline int64_t version_of(const at::TensorBase& t) {
  return t.is_inference() ? -1 : static_cast<int64_t>(t.unsafeGetTensorImpl()->version_counter().current_version());
}

// A tensor's autograd metadata (nullptr: none), read directly. Why: TensorBase::is_view(),
// grad_fn() and output_nr() are out-of-line calls through the autograd VariableHooks, and the
// hooks ask them of every recorded module output; for a tensor that is not a view they return
// these fields (torch/csrc/autograd/variable.cpp), so only views take the calls.
inline torch::autograd::AutogradMeta* autograd_meta_of(const at::TensorBase& t) {
  return static_cast<torch::autograd::AutogradMeta*>(t.unsafeGetTensorImpl()->autograd_meta());
}

inline bool is_view(const at::TensorBase& t) {
  const auto* meta = autograd_meta_of(t);
  return meta != nullptr && meta->is_view_;
}

inline int64_t bytes_of(const at::TensorBase& t) {
  return static_cast<int64_t>(t.numel()) * static_cast<int64_t>(t.element_size());
}

// Note [a batch bounded by what only it keeps alive]: a batch (the read window's queued tensors,
// the gradient sink's pending gradients) keeps its tensors alive until it is summarized; what that
// costs is the memory of the tensors nothing else holds. In a training forward almost every module
// output is held anyway -- saved by autograd for the backward, or the next module's input --, so
// counting every queued byte against the bound cut a transformer's forward into a batch every block
// or two (a dispatcher call and its launches each, on a device) for memory that was never extra.
// So when the queued bytes reach the bound, the bytes held by the batch alone are counted: the
// batch is summarized when those reach the bound, and otherwise the count restarts from them. What
// the batch alone keeps alive stays below about twice the bound (it grows by at most the bound
// between two counts), except where tensors it holds are let go by their other owners in between (a
// gradient the backward has consumed): those are counted at the next count.
//
// Held by the batch alone: no other owner of its TensorImpl or its storage. A tensor's Python
// object owns its TensorImpl and, while C++ holds it too, is kept alive by it (Note [PyObject
// preservation for Tensor and Storages] in c10/util/intrusive_ptr.h): a TensorImpl with a Python
// object whose only reference is that keep-alive counts it as one owner more. Where the Python
// object's count cannot be read (no GIL: the backward's threads), such a tensor counts as held by
// the batch alone -- a batch summarized early, never memory kept unbounded. (A queued tensor whose
// storage only another queued tensor shares counts as held elsewhere.)
template <typename Slot, typename = void>
struct slot_loads_pyobj : std::false_type {};
template <typename Slot>
struct slot_loads_pyobj<Slot, std::void_t<decltype(std::declval<const Slot&>().load_pyobj())>> : std::true_type {};

// The owners of t's TensorImpl other than its own Python object's keep-alive reference: 1 when
// only the caller holds it. `gil`: the Python object's reference count may be read.
inline uint32_t owners_of(const at::Tensor& t, bool gil) {
  const uint32_t owners = static_cast<uint32_t>(t.use_count());
  using Slot = std::remove_cv_t<std::remove_pointer_t<decltype(t.unsafeGetTensorImpl()->pyobj_slot())>>;
  if constexpr (slot_loads_pyobj<Slot>::value) {
    PyObject* obj = t.unsafeGetTensorImpl()->pyobj_slot()->load_pyobj();
    if (obj != nullptr && owners == 2 && (!gil || Py_REFCNT(obj) == 1)) return 1;
  }
  return owners;
}

inline int64_t bytes_held_alone(const std::vector<at::Tensor>& queued, bool gil) {
  int64_t alone = 0;
  for (const at::Tensor& t : queued) {
    if (owners_of(t, gil) > 1 || (t.has_storage() && t.storage().use_count() > 1)) continue;
    alone += bytes_of(t);
  }
  return alone;
}

// Whether a batch at `bytes` queued bytes must be summarized now for the bound (Note [a batch
// bounded by what only it keeps alive]); when not, `bytes` becomes what it alone holds. (Below the
// bound -- nearly every add -- one comparison: nothing else is asked.)
inline bool over_bound(const std::vector<at::Tensor>& queued, int64_t& bytes, int64_t bound) {
  if (bytes < bound) return false;
  bytes = bytes_held_alone(queued, PyGILState_Check() == 1);
  return bytes >= bound;
}

// csrc/cpu/summarize.cpp: the record of one CPU tensor, written to out[0:RECORD_SIZE] -- the code
// the nanscan::summarize CPU kernel runs, without a dispatcher call or an output tensor.
void summarize_cpu_row(const at::Tensor& x, double* out);

// Whether a received tensor is summarized on arrival (HostRows) rather than queued for a batch: a
// plain dense CPU tensor, with the default kernels. Why: on the CPU the kernel is synchronous and
// a small tensor's record costs less than keeping the tensor alive until its batch (the batch
// exists to amortize a device launch); summarized on arrival, a record is of the value as it was
// received -- never stale -- and no tensor is kept. Device tensors and other backends keep the
// batches. (Wrapper subclasses -- DTensor, FakeTensor -- carry the Python key: batched, through the
// dispatcher.)
inline bool summarized_on_arrival(const at::Tensor& t, bool default_kernels) {
  return default_kernels && t.device().is_cpu() && t.layout() == at::kStrided && t.has_storage() &&
         !t.key_set().has(c10::DispatchKey::Python);
}

// csrc/cpu/summarize.cpp: the record of a copy of a contiguous real tensor's values (n elements of
// `dtype` at `data`, n <= 65536) -- the same scan, the same bits as summarize_cpu_row of the tensor.
void summarize_cpu_copy(const void* data, int64_t n, at::ScalarType dtype, double* out);

// Records made on arrival, in order, kept as host rows until sealed into one [k, RECORD_SIZE]
// float64 tensor (at a read, or when a batched record must come after them).
//
// A small tensor (kCopyBytes or less, contiguous, real) is copied on arrival and summarized when
// the rows are sealed, all copies in one pass: the record is still of the value as it was when
// received (never stale, nothing kept alive), but the kernel's code runs once per read instead of
// once per module call, where it would be fetched from beyond the L1 instruction cache every time
// (the host-bound step is bound by instruction fetch: benchmarks/host_instructions.py --cache).
struct HostRows {
  static constexpr size_t kCopyBytes = 1024;

  // One row: a copy (its values at `offset` in copies_) or a record made on arrival (at `offset`
  // in made_).
  struct Entry {
    bool copied;
    at::ScalarType dtype;
    int64_t n;
    size_t offset;
  };

  bool empty() const { return entries_.empty(); }

  void add(const at::Tensor& t) {
    const int64_t n = t.numel();
    const size_t bytes = static_cast<size_t>(n) * t.element_size();
    if (bytes <= kCopyBytes && t.is_contiguous() && !t.is_complex() && !t.is_neg() &&
        is_supported_real_dtype(t.scalar_type())) {
      const size_t offset = (copies_.size() + 63) & ~size_t{63};
      copies_.resize_for_overwrite(offset + bytes);  // (no zero fill: every byte is written now)
      if (bytes > 0) std::memcpy(copies_.data() + offset, t.const_data_ptr(), bytes);
      entries_.push_back({true, t.scalar_type(), n, offset});
      return;
    }
    const size_t offset = made_.size();
    made_.resize_for_overwrite(offset + kRecordSize);
    summarize_cpu_row(t, made_.data() + offset);
    entries_.push_back({false, t.scalar_type(), n, offset});
  }

  // The rows in order, as one [k, RECORD_SIZE] float64 tensor appended to `blocks`: the copies
  // summarized now, in one pass.
  void seal_into(std::vector<at::Tensor>& blocks) {
    if (entries_.empty()) return;
    at::Tensor rows = at::empty({static_cast<int64_t>(entries_.size()), kRecordSize}, at::kDouble);
    double* out = rows.mutable_data_ptr<double>();
    for (const Entry& e : entries_) {
      if (e.copied) {
        summarize_cpu_copy(copies_.data() + e.offset, e.n, e.dtype, out);
      } else {
        std::copy_n(made_.data() + e.offset, kRecordSize, out);
      }
      out += kRecordSize;
    }
    blocks.push_back(std::move(rows));
    entries_.clear();  // (all three keep their capacity for the next window)
    copies_.clear();
    made_.clear();
  }

 private:
  std::vector<Entry> entries_;
  c10::SmallVector<uint8_t, 0> copies_;  // the copied values, each at a 64-byte aligned offset
  c10::SmallVector<double, 0> made_;
};

// csrc/monitor/stamp_rows.cpp: the host count of the rows an owner's compiled graphs stamped
// (Note [stamps counted on the host] there).
using StampCount = std::shared_ptr<std::atomic<int64_t>>;
StampCount stamp_count(int64_t owner);

// Where eager records fall among a compiled path's stamped rows (Note [stamps counted on the
// host]): a run-length list of (first record, host count) pairs -- a pair only where the count
// moved since the last record, so a model with no compiled graph (the count stays 0) adds none.
class StampMarks {
 public:
  void follow(StampCount stamped) { stamped_ = std::move(stamped); }

  // Record `k` (the k-th of its window) is being made.
  void note(int64_t k) {
    if (!stamped_) return;
    const int64_t h = stamped_->load(std::memory_order_relaxed);
    if (h == last_) return;
    marks_.push_back(k);
    marks_.push_back(h);
    last_ = h;
  }

  // A window ends: its marks become the taken ones.
  void take() {
    taken_.swap(marks_);
    marks_.clear();
    last_ = 0;
  }

  py::bytes taken() const {
    return py::bytes(reinterpret_cast<const char*>(taken_.data()), taken_.size() * sizeof(int64_t));
  }

 private:
  StampCount stamped_;
  std::vector<int64_t> marks_, taken_;
  int64_t last_ = 0;
};

// The largest finite value of a floating dtype (of the real part for complex dtypes); NaN if not floating.
inline double dtype_max(at::ScalarType dtype) {
  switch (c10::toRealValueType(dtype)) {
    case at::kDouble: return std::numeric_limits<double>::max();
    case at::kFloat: return std::numeric_limits<float>::max();
    case at::kHalf: return static_cast<double>(std::numeric_limits<c10::Half>::max());
    case at::kBFloat16: return static_cast<double>(std::numeric_limits<c10::BFloat16>::max());
    case at::kFloat8_e4m3fn: return static_cast<double>(std::numeric_limits<c10::Float8_e4m3fn>::max());
    case at::kFloat8_e5m2: return static_cast<double>(std::numeric_limits<c10::Float8_e5m2>::max());
    case at::kFloat8_e4m3fnuz: return static_cast<double>(std::numeric_limits<c10::Float8_e4m3fnuz>::max());
    case at::kFloat8_e5m2fnuz: return static_cast<double>(std::numeric_limits<c10::Float8_e5m2fnuz>::max());
    default: return std::numeric_limits<double>::quiet_NaN();
  }
}

// What a read needs to know of the gradients a GradSink received, kept in C++ until asked.
struct GradMeta {
  struct Grad {
    int64_t index;  // the slot index of the output it flowed into
    at::ScalarType dtype;
    bool stale;     // changed in place before it was summarized
    int32_t ndim;
    size_t dims_at;  // its shape: dims[dims_at, dims_at + ndim)
  };
  std::vector<Grad> grads;
  std::vector<int64_t> dims;

  void add(int64_t index, const at::Tensor& g, bool stale) {
    const auto sizes = g.sizes();
    grads.push_back({index, g.scalar_type(), stale, static_cast<int32_t>(sizes.size()), dims.size()});
    dims.insert(dims.end(), sizes.begin(), sizes.end());
  }

  int64_t size() const { return static_cast<int64_t>(grads.size()); }

  const Grad& grad(int64_t k) const {
    TORCH_CHECK(k >= 0 && k < size(), "nanscan: no gradient ", k, " in this read (", size(), ")");
    return grads[k];
  }

  int64_t index_of(int64_t k) const { return grad(k).index; }

  bool is_stale(int64_t k) const { return grad(k).stale; }

  py::object dtype(int64_t k) const {  // torch.dtype objects are static: borrowed
    return py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(torch::getTHPDtype(grad(k).dtype)));
  }

  py::tuple shape(int64_t k) const {
    const Grad& g = grad(k);
    py::tuple out(g.ndim);
    for (int32_t d = 0; d < g.ndim; ++d) out[d] = py::int_(dims[g.dims_at + d]);
    return out;
  }

  at::Tensor dtype_maxima() const {
    at::Tensor out = at::empty({size()}, at::kDouble);
    double* maxima = out.data_ptr<double>();
    for (int64_t k = 0; k < size(); ++k) maxima[k] = dtype_max(grads[k].dtype);
    return out;
  }
};

// The default kernels' summarize_many, or `summarize` (a Python callable) for another backend.
inline at::Tensor summarize_many_with(const py::object& summarize, const std::vector<at::Tensor>& xs) {
  if (!summarize || summarize.is_none()) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("nanscan::summarize_many", "")
                         .typed<at::Tensor(at::TensorList)>();
    return op.call(xs);
  }
  py::gil_scoped_acquire gil;
  return summarize(py::cast(xs)).cast<at::Tensor>();
}

class GradSink {
 public:
  GradSink(int64_t batch, int64_t batch_bytes, py::object summarize)
      : batch_(batch < 1 ? 1 : batch), batch_bytes_(batch_bytes),
        summarize_(summarize.is_none() ? py::object() : std::move(summarize)) {}

  ~GradSink() {
    if (summarize_) {  // a Python object: released with the GIL held
      py::gil_scoped_acquire gil;
      summarize_ = py::object();
    }
  }

  int64_t generation = 0;

  void follow_stamps(StampCount stamped) {
    std::lock_guard<std::mutex> lock(mu_);
    marks_.follow(std::move(stamped));
  }

  // The marks of the gradients of the last take() (StampMarks), as bytes. (Only take() writes
  // them, on the reading thread: no lock.)
  py::bytes taken_marks() const { return marks_.taken(); }

  void add(int64_t index, const at::Tensor& grad) {
    std::lock_guard<std::mutex> lock(mu_);
    marks_.note(meta_.size() + static_cast<int64_t>(pending_index_.size()));
    if (summarized_on_arrival(grad, !summarize_)) {
      flush_pending();  // (batched gradients received before this one: their records come first)
      host_.add(grad);
      meta_.add(index, grad, false);
      return;
    }
    host_.seal_into(records_);  // (gradients summarized on arrival before this one: their records come first)
    // One stream per batch (Note [streams of queued tensors], streams.h): the backward runs each
    // node on its forward's stream.
    const c10::Stream stream = current_stream(grad.device());
    if (!pending_.empty() && stream != pending_stream_) flush_pending();
    pending_stream_ = stream;
    pending_index_.push_back(index);
    pending_.push_back(grad);
    pending_version_.push_back(version_of(grad));
    pending_bytes_ += bytes_of(grad);
    // Bounded: at most `batch` gradients, and about `batch_bytes` kept alive by this batch alone.
    if (static_cast<int64_t>(pending_.size()) >= batch_ ||
        over_bound(pending_, pending_bytes_, batch_bytes_)) {
      flush_pending();
    }
  }

  int64_t size() {
    // (The GIL is released while waiting for the lock: a backward thread holding the lock may
    // need the GIL to summarize with a Python backend.)
    py::gil_scoped_release nogil;
    std::lock_guard<std::mutex> lock(mu_);
    return meta_.size() + static_cast<int64_t>(pending_index_.size());
  }

  // What take() hands over, before any Python object is made of it (see Window::Taken).
  struct Taken {
    std::vector<at::Tensor> records;
    std::shared_ptr<GradMeta> meta;
  };

  Taken take_parts() {
    Taken taken;
    taken.meta = std::make_shared<GradMeta>();
    py::gil_scoped_release nogil;
    std::lock_guard<std::mutex> lock(mu_);
    flush_locked();
    if (!side_.empty()) side_.join_into_current();  // (the read's stream: this thread's current one)
    taken.records.swap(records_);
    std::swap(*taken.meta, meta_);
    marks_.take();
    // (The next read receives about as many: no reallocations as they arrive.)
    meta_.grads.reserve(taken.meta->grads.size());
    meta_.dims.reserve(taken.meta->dims.size());
    return taken;
  }

  static py::tuple to_python(Taken&& taken) {
    py::list blocks;
    for (auto& r : taken.records) blocks.append(py::cast(std::move(r)));
    return py::make_tuple(std::move(blocks), py::cast(std::move(taken.meta)));
  }

  py::tuple take() { return to_python(take_parts()); }

 private:
  void flush_locked() {
    host_.seal_into(records_);
    flush_pending();
  }

  void flush_pending() {
    if (pending_.empty()) return;
    for (size_t k = 0; k < pending_.size(); ++k) {
      const auto& g = pending_[k];
      meta_.add(pending_index_[k], g, pending_version_[k] >= 0 && version_of(g) != pending_version_[k]);
    }
    at::Tensor block;
    if (run_on(pending_stream_, block, [&] { return summarize_many_with(summarize_, pending_); })) {
      side_.note(pending_stream_, block);
    }
    records_.push_back(std::move(block));
    pending_.clear();
    pending_index_.clear();
    pending_version_.clear();
    pending_bytes_ = 0;
  }

  int64_t batch_, batch_bytes_, pending_bytes_ = 0;
  py::object summarize_;
  std::mutex mu_;
  std::vector<at::Tensor> pending_;
  std::vector<int64_t> pending_index_, pending_version_;
  std::vector<at::Tensor> records_;
  c10::Stream pending_stream_{c10::Stream::DEFAULT, c10::Device(c10::kCPU)};  // (of every pending gradient)
  SideStreams side_;  // (streams other than the reader's that summarized blocks since the last take)
  GradMeta meta_;  // of the gradients received, in order (those pending not yet)
  StampMarks marks_;
  HostRows host_;  // (at most one of host_ and pending_ holds rows: the records stay in order)
};

struct RecordGrad : torch::autograd::FunctionPreHook {
  RecordGrad(std::weak_ptr<GradSink> sink, int64_t index, int64_t output_nr, int64_t generation)
      : sink_(std::move(sink)), index_(index), output_nr_(output_nr), generation_(generation) {}

  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    auto sink = sink_.lock();
    if (sink && sink->generation == generation_ && output_nr_ < static_cast<int64_t>(grads.size()) &&
        grads[output_nr_].defined()) {
      sink->add(index_, grads[output_nr_]);
    }
    return grads;
  }

  // Under compiled autograd this hook is not traced: the gradient is then not recorded (the
  // monitor says "cannot tell" where it would have needed it), never wrong.
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& /*args*/) const override {}

 private:
  std::weak_ptr<GradSink> sink_;
  int64_t index_, output_nr_, generation_;
};

inline void tap(const at::Tensor& tensor, const std::shared_ptr<GradSink>& sink, int64_t index) {
  const auto* meta = autograd_meta_of(tensor);
  if (meta == nullptr) return;  // (no grad_fn)
  // (A view's grad_fn may be regenerated: asked of the tensor. Any other's is the field.)
  const auto& node = meta->is_view_ ? tensor.grad_fn() : meta->grad_fn_;
  if (node) node->add_pre_hook(std::make_unique<RecordGrad>(sink, index, meta->output_nr_, sink->generation));
}

}  // namespace nanscan
