// The monitor's eager forward hooks in C++, and the read window they record into.
//
// Why C++: on a GPU the host's Python time is on the critical path of every step, and a watched
// module costs a forward pre-hook and a forward hook per call. The Python hooks that did the work
// below (walk the inputs and outputs, look tensors up in an identity map, make a record object,
// queue the tensor, tap its gradient) cost ~19 us per module per step on the host-bound benchmark
// against ~3.4 us for two no-op Python hooks (benchmarks/host_cost.py). Here the Python hook is a
// two-line wrapper (dynamo must see Python to trace the compiled path: nanscan/monitor/traced.py)
// that calls Hooks.pre / Hooks.post, and a record is a C++ Row: the Python Slot object that
// attribution reads is made only when a read is decoded and asks for that row.
//
// Semantics (the same as the Python implementation they replace, nanscan/monitor/eager.py says what
// is recorded and why): per module call a Frame (its input and output entries); per floating or
// complex tensor in a module's outputs a Row, unless the tensor is one of the module's inputs or a
// child's output returned unchanged (identity map keyed by TensorImpl, checked with a weak
// reference and the version counter); per input that no earlier record explains a Row named
// after the running parent (a value made in the parent's own body) or, with no parent, the batch.
//
// Python API (module nanscan._C):
//   Window(marker, make_rows, summarize, on_stale)  one read window (forward or eval)
//     add(tensor, slot) -> entry      a Python Slot record (loss, optimizer state)
//     add_block(records, block, n)    n rows summarized already (parameters, buffers)
//     flush(), len(window), window.generation
//     take() -> (entries, records, rows or None): entries in production order (Python
//       Slot / Block objects; C++ rows appear as make_rows(rows)), their records as a list of
//       [k, RECORD_SIZE] blocks in order (a read stacks them once, with its other records), and
//       the Rows of the window
//   Rows: row(entry) -> (kind, info, label, step, phase, dtype, shape, inputs, candidate,
//       consumers, grad, stale, inputs_changed); frame(f) -> (info, outputs); set_grads(grad_meta, start);
//       dtype_maxima() -> float64 tensor: each entry's dtype's largest finite value (NaN: not a row);
//       weight_inputs(info) -> slot entries a parameter gradient of that module depends on
//   TensorSet(tensors, summarize=None)  tensors held for the per-step checks (the parameters)
//     records() -> [n, RECORD_SIZE]; grad_records() -> (records of the grads that exist or None,
//       None if all exist else their indices); summarize: a Python callable list -> records (None:
//       the nanscan::summarize_many op)
//   param_grads(params) -> (grads that exist, None if all do else their indices)
//   nonfinite_rows(host_records, n) -> the rows < n with a NaN / +Inf / -Inf count
//   dtype_maxima(tensors) -> float64 tensor: each tensor's dtype's largest finite value
//   headroom_candidates(host, maxima, n, bits, fp16_cast, cast_floor) -> rows near overflow
//   Hooks(names, module_refs, is_root, inplace, forward, eval, sink, owner)
//     fast_hooks() -> (pre, post): pre(info, module, args, kwargs), post(info, module, args, kwargs,
//       output) as plain C functions
//     set_post_only(flags): modules hooked by post alone (it does their pre() work first)
//     owner.begin(info, args, kwargs) -> None or (phase, step); owner.forward_ends(info);
//     owner.model_loss(output) are called back for the rare events
#include "grad_sink.h"
#include "../record.h"

#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_variable.h>

#include <c10/util/flat_hash_map.h>

#include <algorithm>
#include <limits>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace nanscan {

// csrc/monitor/stamp_rows.cpp: the buffer nanscan::stamp writes for a compiled path's owner.
void set_stamp_target(int64_t owner, const c10::optional<at::Tensor>& buffer, const c10::optional<at::Tensor>& counter);

enum RowKind : uint8_t { kOutput = 0, kBody = 1, kBatch = 2, kLoss = 3 };
enum Phase : uint8_t { kNone = 0, kForward = 1, kEval = 2 };

// One record made by the hooks. Its inputs are those of `frame` (a module output, the loss: the
// module's own call; a body value: the running parent's call); a batch row has none.
//
// Rows and frames are plain structs made per module call; what varies in length (a shape, a label,
// consumers, a frame's inputs and outputs) lives in flat arrays of their Rows. Why: with inline
// vectors and a string per row, constructing, moving and destroying them was a few hundred
// instructions per call, and on the host-bound step every instruction run once per call is also
// fetched from beyond the L1 instruction cache (benchmarks/host_instructions.py --cache).
struct Row {
  uint8_t kind = kOutput;
  uint8_t phase = kForward;
  bool candidate = true;  // false: recorded for attribution only (the batch; the root after a compiled forward)
  bool stale = false;     // changed in place before it was summarized
  int32_t info = -1;      // the module named (and owner): a body value's parent, the batch's first consumer
  int32_t frame = -1;
  int32_t grad = -1;      // entry of the gradient flowing into it, once read
  int32_t label = -1;     // Rows::labels index of where in the outputs / inputs ("[1]", ".loss", "input[0]"); -1: ""
  int32_t dims_at = 0;    // the shape: Rows::dims[dims_at, dims_at + ndim)
  int32_t ndim = 0;
  int32_t first_consumer = -1, last_consumer = -1;  // Rows::consumers list: the frames that took it as an input
  at::ScalarType dtype = at::kFloat;
  int64_t step = 0;
};

struct Frame {
  int32_t info;
  int32_t inputs_at = 0, n_inputs = 0;    // Rows::frame_inputs[inputs_at, inputs_at + n_inputs)
  int32_t outputs_at = 0, n_outputs = 0;  // Rows::frame_outputs[outputs_at, outputs_at + n_outputs)
  // Whether the call changed an input in place (or took one that could not be recorded): what its
  // outputs were computed from is then unknown, although the input's own record (made on
  // arrival, before the call) is right.
  bool inputs_changed = false;
};

struct Known {
  // (Keeps the address from being reused while held. Its null type is the tensor's own, so it is
  // made from the tensor's pointer without a strong reference, which would touch the PyObject.)
  c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> ref;
  int64_t version;  // -1: an inference tensor (no version counter)
  int32_t entry;
};

const char* phase_name(uint8_t phase) { return phase == kEval ? "eval" : "forward"; }

py::object dtype_object(at::ScalarType d) {  // torch.dtype objects are static: borrowed
  return py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(torch::getTHPDtype(d)));
}

template <typename Ints>
py::tuple int_tuple(const Ints& xs) {
  py::tuple out(xs.size());
  for (size_t i = 0; i < xs.size(); ++i) out[i] = py::int_(xs[i]);
  return out;
}

// The rows of one read window, kept for decoding after the window was taken.
struct Rows {
  struct Consumer {
    int32_t frame, next;  // next: the row's next consumer, -1 at the end
  };

  std::vector<Row> rows;
  std::vector<Frame> frames;
  std::vector<int32_t> row_of;      // entry -> row, -1 for an entry that is a Python object
  std::vector<int32_t> last_frame;  // info -> frame of its last call in the window, -1 if none
  std::vector<int64_t> dims;
  std::vector<std::string> labels;
  std::vector<Consumer> consumers;
  std::vector<int32_t> frame_inputs, frame_outputs;

  void set_shape(Row& r, c10::IntArrayRef sizes) {
    r.dims_at = static_cast<int32_t>(dims.size());
    r.ndim = static_cast<int32_t>(sizes.size());
    dims.insert(dims.end(), sizes.begin(), sizes.end());
  }

  void set_label(Row& r, std::string&& label) {
    if (label.empty()) return;
    r.label = static_cast<int32_t>(labels.size());
    labels.push_back(std::move(label));
  }

  void add_consumer(Row& r, int32_t frame) {
    const int32_t at = static_cast<int32_t>(consumers.size());
    consumers.push_back({frame, -1});
    if (r.last_consumer >= 0) {
      consumers[r.last_consumer].next = at;
    } else {
      r.first_consumer = at;
    }
    r.last_consumer = at;
  }

  c10::ArrayRef<int32_t> inputs_of(const Frame& f) const {
    return c10::ArrayRef<int32_t>(frame_inputs.data() + f.inputs_at, f.n_inputs);
  }

  c10::ArrayRef<int32_t> outputs_of(const Frame& f) const {
    return c10::ArrayRef<int32_t>(frame_outputs.data() + f.outputs_at, f.n_outputs);
  }

  // Empty, keeping the capacity of what the last window recorded (most windows record about as
  // much: no reallocation as they grow).
  void reserve_like(const Rows& last, size_t n_infos) {
    last_frame.assign(n_infos, -1);
    rows.reserve(last.rows.size());
    row_of.reserve(last.row_of.size());
    frames.reserve(last.frames.size());
    dims.reserve(last.dims.size());
    consumers.reserve(last.consumers.size());
    frame_inputs.reserve(last.frame_inputs.size());
    frame_outputs.reserve(last.frame_outputs.size());
  }

  const Row& row_at(int64_t entry) const {
    TORCH_CHECK(entry >= 0 && entry < static_cast<int64_t>(row_of.size()) && row_of[entry] >= 0,
                "nanscan: entry ", entry, " is not a hook record");
    return rows[row_of[entry]];
  }

  py::tuple row(int64_t entry) const {
    const Row& r = row_at(entry);
    std::vector<int32_t> inputs;
    if (r.frame >= 0) {
      const Frame& f = frames[r.frame];
      auto in = inputs_of(f);
      inputs.assign(in.begin(), in.end());
      if (r.kind == kLoss) {  // the model's loss: from its inputs and its other outputs
        for (int32_t o : outputs_of(f)) {
          if (o != entry) inputs.push_back(o);
        }
      }
    }
    py::list consumer_frames;
    for (int32_t c = r.first_consumer; c >= 0; c = consumers[c].next) consumer_frames.append(consumers[c].frame);
    return py::make_tuple(static_cast<int>(r.kind), r.info, r.label < 0 ? std::string() : labels[r.label], r.step,
                          r.kind == kLoss ? "loss" : phase_name(r.phase), dtype_object(r.dtype),
                          int_tuple(c10::ArrayRef<int64_t>(dims.data() + r.dims_at, r.ndim)), int_tuple(inputs),
                          r.candidate, consumer_frames,
                          r.grad < 0 ? py::object(py::none()) : py::object(py::int_(r.grad)), r.stale,
                          r.kind != kBatch && r.frame >= 0 && frames[r.frame].inputs_changed);
  }

  py::tuple frame(int64_t f) const {
    TORCH_CHECK(f >= 0 && f < static_cast<int64_t>(frames.size()), "nanscan: no frame ", f);
    return py::make_tuple(frames[f].info, int_tuple(outputs_of(frames[f])));
  }

  std::vector<int64_t> steps() const {  // the steps of the rows, ascending
    std::vector<int64_t> out;
    for (const Row& r : rows) out.push_back(r.step);
    std::sort(out.begin(), out.end());
    out.erase(std::unique(out.begin(), out.end()), out.end());
    return out;
  }

  // Per entry the largest finite value of its tensor's dtype (of the real part for complex
  // dtypes; NaN for an entry that is a Python object or not floating): the headroom check
  // (nanscan/monitor/headroom.py) reads it for every row without making a Python object per row.
  at::Tensor dtype_maxima() const {
    at::Tensor out = at::full({static_cast<int64_t>(row_of.size())}, std::numeric_limits<double>::quiet_NaN(),
                              at::kDouble);
    double* maxima = out.data_ptr<double>();
    for (size_t e = 0; e < row_of.size(); ++e) {
      if (row_of[e] >= 0) maxima[e] = dtype_max(rows[row_of[e]].dtype);
    }
    return out;
  }


  std::vector<int64_t> loss_entries() const {
    std::vector<int64_t> out;
    for (size_t e = 0; e < row_of.size(); ++e) {
      if (row_of[e] >= 0 && rows[row_of[e]].kind == kLoss) out.push_back(static_cast<int64_t>(e));
    }
    return out;
  }

  // The gradients a GradSink took (meta) are slots start, start + 1, ...: each output row learns its own.
  void set_grads(const GradMeta& meta, int64_t start) {
    for (size_t k = 0; k < meta.grads.size(); ++k) {
      int64_t e = meta.grads[k].index;
      if (e >= 0 && e < static_cast<int64_t>(row_of.size()) && row_of[e] >= 0) {
        rows[row_of[e]].grad = static_cast<int32_t>(start + static_cast<int64_t>(k));
      }
    }
  }

  // What a parameter gradient of module `info` was computed from: the gradients of the module's
  // outputs (those read) and its forward inputs, in its last call of the window.
  py::tuple weight_inputs(int64_t info) const {
    if (info < 0 || info >= static_cast<int64_t>(last_frame.size()) || last_frame[info] < 0) return py::tuple();
    const Frame& f = frames[last_frame[info]];
    std::vector<int32_t> out;
    for (int32_t o : outputs_of(f)) {
      if (row_of[o] >= 0 && rows[row_of[o]].grad >= 0) out.push_back(rows[row_of[o]].grad);
    }
    auto in = inputs_of(f);
    out.insert(out.end(), in.begin(), in.end());
    return int_tuple(out);
  }
};

// One read window: the entries in production order and their records, summarized in batches
// (see nanscan/monitor/slots.py for why batches are safe: version counters mark a record stale).
class Window {
 public:
  Window(py::object marker, py::object make_rows, py::object summarize, py::object on_stale, int64_t n_infos,
         int64_t batch, int64_t batch_bytes)
      : marker_(std::move(marker)), make_rows_(std::move(make_rows)),
        summarize_(summarize.is_none() ? py::object() : std::move(summarize)), on_stale_(std::move(on_stale)),
        n_infos_(n_infos), batch_(batch < 1 ? 1 : batch), batch_bytes_(batch_bytes), default_kernels_(!summarize_) {
    rows_.last_frame.assign(n_infos_, -1);
  }

  int64_t generation = 0;
  std::shared_ptr<std::vector<uint8_t>> eager;  // per module: never batch its records (set by Hooks)
  Rows rows_;

  int64_t size() const { return static_cast<int64_t>(PyList_GET_SIZE(entries_.ptr())); }

  int64_t add_py(const at::Tensor& t, py::object slot) {
    const bool now = before_add(t);
    entries_.append(std::move(slot));
    rows_.row_of.push_back(-1);
    return after_add(t, now);
  }

  int64_t add_row(const at::Tensor& t, const Row& row) {
    const bool now = before_add(t);
    entries_.append(marker_);
    rows_.row_of.push_back(static_cast<int32_t>(rows_.rows.size()));
    rows_.rows.push_back(row);
    return after_add(t, now);
  }

  void add_block(const at::Tensor& records, py::object block, int64_t n) {
    if (n <= 0) return;
    flush();
    host_.seal_into(blocks_);  // (the records before the block's, in order)
    block.attr("start") = size();
    blocks_.push_back(records);
    for (int64_t k = 0; k < n; ++k) {
      entries_.append(block);
      rows_.row_of.push_back(-1);
    }
  }

  void flush() {
    if (queued_.empty()) return;
    int64_t first = size() - static_cast<int64_t>(queued_.size());
    for (size_t k = 0; k < queued_.size(); ++k) {
      // Changed in place since its hook: the record would be of a later value.
      if (versions_[k] >= 0 && version_of(queued_[k]) != versions_[k]) {
        int64_t entry = first + static_cast<int64_t>(k);
        int32_t r = rows_.row_of[entry];
        if (r >= 0) {
          rows_.rows[r].stale = true;
          if (eager && rows_.rows[r].info >= 0) (*eager)[rows_.rows[r].info] = 1;
        } else {
          py::object slot = entries_[entry];
          slot.attr("stale") = true;
          if (!on_stale_.is_none()) on_stale_(slot);
        }
      }
    }
    at::Tensor block;
    if (run_on(stream_, block, [&] { return summarize_many_with(summarize_, queued_); })) {
      side_.note(stream_, block);
    }
    blocks_.push_back(std::move(block));
    queued_.clear();
    versions_.clear();
    bytes_ = 0;
  }

  py::tuple take() {
    flush();
    host_.seal_into(blocks_);
    if (!side_.empty()) side_.join_into_current();  // (the read's stream: the current one now)
    py::list entries = entries_;
    entries_ = py::list();
    auto rows = std::make_shared<Rows>(std::move(rows_));
    rows_ = Rows();
    rows_.reserve_like(*rows, n_infos_);
    known_.clear();
    has_device_ = false;
    ++generation;
    py::object proxy = py::none();
    if (!rows->rows.empty()) {
      proxy = make_rows_(rows);
      PyObject* marker = marker_.ptr();
      for (Py_ssize_t i = 0, n = PyList_GET_SIZE(entries.ptr()); i < n; ++i) {
        if (PyList_GET_ITEM(entries.ptr(), i) == marker) {
          Py_INCREF(proxy.ptr());
          PyList_SetItem(entries.ptr(), i, proxy.ptr());  // (steals the reference, releases the marker)
        }
      }
    }
    // The blocks as they are: the read stacks them with its other records in one cat (Copy.start).
    py::list records;
    for (auto& b : blocks_) records.append(py::cast(std::move(b)));
    blocks_.clear();
    return py::make_tuple(entries, records, proxy);
  }

  // The entry a live tensor was recorded at in this window (same object, same version), or -1.
  int32_t lookup(const at::Tensor& t) const {
    auto it = known_.find(t.unsafeGetTensorImpl());
    if (it == known_.end() || it->second.ref.expired()) {
      // A full alias of a recorded tensor (x.view_as(x): DTensor.from_local, which tensor
      // parallelism applies to module inputs) holds the same values: the same record.
      if (is_view(t)) {
        const at::Tensor base(t._base());
        if (base.defined() && base.sizes() == t.sizes() && base.strides() == t.strides() &&
            base.storage_offset() == t.storage_offset() && base.scalar_type() == t.scalar_type()) {
          return lookup(base);
        }
      }
      return -1;
    }
    const Known& k = it->second;
    if (k.version >= 0 && version_of(t) != k.version) return -1;
    return k.entry;
  }

  void remember(const at::Tensor& t, int32_t entry) {
    Known known{c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>(t.getIntrusivePtr()), version_of(t),
                entry};
    known_.insert_or_assign(t.unsafeGetTensorImpl(), std::move(known));
  }

 private:
  // Whether t is summarized on arrival (grad_sink.h: a CPU tensor with the default kernels) or
  // queued; the records before its own are put in order first (at most one of host_ and queued_
  // holds rows).
  bool before_add(const at::Tensor& t) {
    if (summarized_on_arrival(t, default_kernels_)) {
      flush();
      return true;
    }
    host_.seal_into(blocks_);
    // One device and one stream per batch (Note [streams of queued tensors], streams.h).
    const c10::Stream stream = current_stream(t.device());
    if (has_device_ && (t.device() != device_ || stream != stream_)) flush();
    device_ = t.device();
    stream_ = stream;
    has_device_ = true;
    return false;
  }

  int64_t after_add(const at::Tensor& t, bool now) {
    int64_t entry = size() - 1;
    if (now) {  // (never stale: summarized as it is when recorded)
      host_.add(t);
      return entry;
    }
    queued_.push_back(t);
    if (t.is_inference()) {  // no version counter to check: summarize it now
      versions_.push_back(-1);
      flush();
      return entry;
    }
    versions_.push_back(version_of(t));
    bytes_ += static_cast<int64_t>(t.numel()) * static_cast<int64_t>(t.element_size());
    if (static_cast<int64_t>(queued_.size()) >= batch_ || bytes_ >= batch_bytes_) flush();
    return entry;
  }

  py::object marker_, make_rows_, summarize_, on_stale_;
  int64_t n_infos_, batch_, batch_bytes_;
  bool default_kernels_;
  HostRows host_;  // records made on arrival, not yet sealed into a block
  py::list entries_;
  // (Open addressing: no node allocated per recorded tensor; clear() keeps the slots for the next window.)
  ska::flat_hash_map<c10::TensorImpl*, Known> known_;
  std::vector<at::Tensor> queued_, blocks_;
  std::vector<int64_t> versions_;
  int64_t bytes_ = 0;
  c10::Device device_{c10::kCPU};
  c10::Stream stream_{c10::Stream::DEFAULT, c10::Device(c10::kCPU)};  // (of every queued tensor)
  SideStreams side_;  // (streams other than the reader's that summarized blocks since the last take)
  bool has_device_ = false;
};

// A floating / complex tensor found in a hook's arguments or output, with where it sits. The handle
// is borrowed from the Python object that holds it (alive for the whole hook call: no reference
// count traffic per tensor), owned only for a subclass's local tensor.
struct FoundTensor {
  std::string label;
  c10::MaybeOwned<at::Tensor> tensor;
};
struct Found : c10::SmallVector<FoundTensor, 4> {  // (inline: one per hook call)
  // A floating tensor was left out (nested, a __torch_dispatch__ wrapper), or -- walking outputs --
  // a value nanscan cannot see into (a generator, an object of a type it does not know): what it
  // holds is unknown.
  bool unrecorded = false;
};

// prefix + "[i]", without the temporaries of string concatenation (one per tuple item per call).
std::string indexed(const std::string& prefix, Py_ssize_t i) {
  std::string out;
  out.reserve(prefix.size() + 8);
  out += prefix;
  out += '[';
  if (i < 10) {
    out += static_cast<char>('0' + i);
  } else {
    out += std::to_string(i);
  }
  out += ']';
  return out;
}

// A tensor found at `prefix`: kept if floating or complex. A nested floating tensor
// (nn.TransformerEncoder's fast path in eval) has no sizes and the kernels do not take it: it is
// not recorded, the call goes on, and `out` says that something it holds is unknown.
void add_found(c10::MaybeOwned<at::Tensor> t, const std::string& prefix, Found& out) {
  if (!t->is_floating_point() && !t->is_complex()) return;
  // A __torch_dispatch__ subclass (a wrapper made with _make_wrapper_subclass: float8, NF4, ...)
  // may hold no data of its own, and what it means is its own dispatch's business: left out, as
  // a nested tensor is.
  if (t->is_nested() || t->key_set().has(c10::DispatchKey::Python)) {
    out.unrecorded = true;
    return;
  }
  out.push_back({prefix, std::move(t)});
}

// nanscan.monitor.eager.children: the items of a value of another type (dataclasses, types
// registered with torch's pytree), [] for a known leaf, None for a value it cannot see into.
PyObject* children_of(PyObject* value) {
  static PyObject* children = nullptr;  // (kept for the process: no destructor at interpreter exit)
  if (children == nullptr) {
    children = py::object(py::module_::import("nanscan.monitor.eager").attr("children")).release().ptr();
  }
  return PyObject_CallOneArg(children, value);
}

// Every floating / complex tensor inside `value` (tensors, tuples, lists, dicts and other mappings
// such as HF ModelOutput, dataclasses, pytree-registered types), labelled like
// nanscan.monitor.eager.float_tensors. Without `labels`, every label is left empty (no string is
// built: most calls need none). `outputs`: a value it cannot see into marks `out.unrecorded`
// (inputs of such types -- a KV cache object, a config -- are their producers' business).
void gather(PyObject* value, const std::string& prefix, Found& out, bool labels = true, int depth = 0,
            bool outputs = false) {
  // (Exact types first: THPVariable_Check of a non-tensor is an isinstance() through torch.Tensor's
  // metaclass, a few hundred instructions, and every hook call walks an args tuple.)
  if (THPVariable_CheckExact(value)) {
    add_found(c10::MaybeOwned<at::Tensor>::borrowed(THPVariable_Unpack(value)), prefix, out);
    return;
  }
  if (value == Py_None || PyLong_Check(value) || PyFloat_Check(value) || PyUnicode_Check(value) ||
      PyBytes_Check(value)) {
    return;
  }
  if (!PyTuple_Check(value) && !PyList_Check(value) && !PyDict_Check(value) && THPVariable_Check(value)) {
    // A tensor subclass. A DTensor (tensor parallelism hands modules DTensor inputs and may
    // return DTensor outputs) is recorded by its local shard, like the monitor's parameters:
    // the kernels take plain tensors, and a rank's record describes what it holds.
    PyObject* local = PyObject_GetAttrString(value, "_local_tensor");
    if (local != nullptr && THPVariable_Check(local)) {
      at::Tensor t = THPVariable_Unpack(local);
      Py_DECREF(local);
      add_found(c10::MaybeOwned<at::Tensor>::owned(std::move(t)), prefix, out);
      return;
    }
    Py_XDECREF(local);
    PyErr_Clear();
    add_found(c10::MaybeOwned<at::Tensor>::borrowed(THPVariable_Unpack(value)), prefix, out);
    return;
  }
  if (depth > 32) return;
  if (PyTuple_Check(value)) {
    for (Py_ssize_t i = 0, n = PyTuple_GET_SIZE(value); i < n; ++i) {
      gather(PyTuple_GET_ITEM(value, i), labels ? indexed(prefix, i) : std::string(), out, labels, depth + 1,
             outputs);
    }
    return;
  }
  if (PyList_Check(value)) {
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(value); ++i) {
      gather(PyList_GET_ITEM(value, i), labels ? indexed(prefix, i) : std::string(), out, labels, depth + 1,
             outputs);
    }
    return;
  }
  if (PyDict_CheckExact(value)) {
    PyObject *key, *item;
    Py_ssize_t pos = 0;
    while (PyDict_Next(value, &pos, &key, &item)) {
      gather(item, labels ? prefix + "." + py::str(key).cast<std::string>() : std::string(), out, labels, depth + 1,
             outputs);
    }
    return;
  }
  // Dict subclasses (ModelOutput is an OrderedDict) and other mappings: their own items().
  if (PyDict_Check(value) || (PyObject_HasAttrString(value, "items") && PyObject_HasAttrString(value, "keys"))) {
    py::object items = py::reinterpret_borrow<py::object>(value).attr("items")();
    for (py::handle kv : items) {
      py::tuple pair = py::reinterpret_borrow<py::tuple>(kv);
      py::object key = pair[0], item = pair[1];
      gather(item.ptr(), labels ? prefix + "." + py::str(key).cast<std::string>() : std::string(), out, labels,
             depth + 1, outputs);
    }
    return;
  }
  if (!outputs) return;
  PyObject* items = children_of(value);
  if (items == nullptr) {  // (nanscan's own failure: what the value holds is unknown)
    PyErr_Clear();
    out.unrecorded = true;
    return;
  }
  py::object owned = py::reinterpret_steal<py::object>(items);
  if (owned.is_none()) {
    out.unrecorded = true;
    return;
  }
  for (py::handle kv : owned) {
    py::tuple pair = py::reinterpret_borrow<py::tuple>(kv);
    gather(pair[1].ptr(), labels ? prefix + "." + py::str(pair[0]).cast<std::string>() : std::string(), out, labels,
           depth + 1, outputs);
  }
}

struct Info {
  std::string name;
  py::object module_ref;  // weakref.ref(module): a copy of the model (deepcopy, EMA) carries the hooks
  bool is_root, inplace;
};

struct StackEntry {
  int32_t frame;  // -1: a call that is not recorded
  const Window* window;  // the frame's window, in its generation
  int64_t generation;
  size_t versions_at;  // its inputs' versions: Hooks::input_versions_[versions_at, ...) up to the next call's
};

// What the hooks know of the calls running on one thread.
struct ThreadState {
  std::vector<StackEntry> stack;
  // The inputs of the running calls and their versions when each began (-1: an inference tensor),
  // in stack order: post() tells whether its call changed one in place.
  std::vector<std::pair<const c10::TensorImpl*, int64_t>> input_versions;
  uint8_t phase = kNone;
  int64_t step = 0;
  // Where the running outermost forward's rows begin (abort_forward).
  Window* forward_window = nullptr;
  int64_t forward_generation = 0;
  size_t forward_first_row = 0;
};

class Hooks {
 public:
  Hooks(std::vector<std::string> names, py::list module_refs, std::vector<bool> is_root, std::vector<bool> inplace,
        std::shared_ptr<Window> forward, std::shared_ptr<Window> eval, std::shared_ptr<GradSink> sink,
        py::object owner)
      : forward_(std::move(forward)), eval_(std::move(eval)), sink_(std::move(sink)), owner_(std::move(owner)) {
    TORCH_CHECK(names.size() == module_refs.size() && names.size() == is_root.size() &&
                    names.size() == inplace.size(), "nanscan: Hooks needs one name, module, root and inplace flag per module");
    for (size_t i = 0; i < names.size(); ++i) {
      infos_.push_back(Info{names[i], module_refs[i], static_cast<bool>(is_root[i]), static_cast<bool>(inplace[i])});
    }
    eager_ = std::make_shared<std::vector<uint8_t>>(names.size(), 0);
    unwatched_children_.assign(names.size(), 0);
    forward_->eager = eager_;
    eval_->eager = eager_;
  }

  bool record_grads = false;
  bool root_late = false;  // the root's outputs come after a compiled forward's rows: attribution only

  void pre(int64_t idx, py::handle module, py::handle args, py::handle kwargs) {
    ThreadState& ts = state();
    const Info& info = infos_.at(idx);
    if (PyWeakref_GetObject(info.module_ref.ptr()) != module.ptr()) return;  // a copy of the model
    if (torch::autograd::get_current_graph_task_id() != -1) {  // recomputed inside a backward (checkpointing)
      push_unrecorded(ts);
      return;
    }
    if (ts.stack.empty() || info.is_root) {
      if (!ts.stack.empty()) abort_forward(ts);  // frames a forward that raised left behind
      clear_stack(ts);
      begin(ts, idx, args, kwargs);
    }
    if (ts.phase == kNone) {
      push_unrecorded(ts);
      return;
    }
    Window& w = window(ts);
    const StackEntry* parent =
        (!ts.stack.empty() && ts.stack.back().frame >= 0 && ts.stack.back().window == &w &&
         ts.stack.back().generation == w.generation) ? &ts.stack.back() : nullptr;
    // Only the batch rows (inputs with no parent call) keep a label: no strings built otherwise.
    static const std::string kInput = "input";
    const bool labels = parent == nullptr;
    Found found;
    gather(args.ptr(), kInput, found, labels);
    if (kwargs.ptr() != nullptr && kwargs.ptr() != Py_None && PyDict_Size(kwargs.ptr()) > 0) {
      gather(kwargs.ptr(), kInput, found, labels);
    }
    Rows& rows = w.rows_;
    const int32_t fid = static_cast<int32_t>(rows.frames.size());
    // (An input that could not be recorded -- nested -- leaves what the call computed from unknown.)
    // (A module given a new child after watch -- `model.head = nn.Linear(...)` -- computes from
    // values nanscan never saw made: its outputs and body values are "cannot tell" too.)
    rows.frames.push_back(Frame{static_cast<int32_t>(idx), static_cast<int32_t>(rows.frame_inputs.size()),
                                static_cast<int32_t>(found.size()), 0, 0,
                                found.unrecorded || unwatched_children_[idx] != 0});
    const size_t versions_at = ts.input_versions.size();
    for (auto& f : found) {
      const at::Tensor& t = *f.tensor;
      int32_t entry = w.lookup(t);
      if (entry >= 0) {
        int32_t r = rows.row_of[entry];
        if (r >= 0) rows.add_consumer(rows.rows[r], fid);
      } else {
        Row row;
        row.phase = ts.phase;
        row.step = ts.step;
        row.dtype = t.scalar_type();
        rows.set_shape(row, t.sizes());
        if (parent != nullptr) {  // made by an op in the parent's own body
          row.kind = kBody;
          row.frame = parent->frame;
          row.info = rows.frames[parent->frame].info;
        } else {  // the batch: recorded for attribution only
          row.kind = kBatch;
          row.info = static_cast<int32_t>(idx);
          row.candidate = false;
          rows.set_label(row, std::move(f.label));
        }
        rows.add_consumer(row, fid);
        entry = static_cast<int32_t>(w.add_row(t, row));
        w.remember(t, entry);
      }
      rows.frame_inputs.push_back(entry);
      ts.input_versions.emplace_back(t.unsafeGetTensorImpl(), version_of(t));
    }
    if (info.inplace && !found.empty()) w.flush();
    ts.stack.push_back({fid, &w, w.generation, versions_at});
  }

  // A module with no pre-hook (set_post_only: a torch.nn leaf that does not work in place) has its
  // inputs handled here, before its outputs: no other hook ran since its call began, and its
  // forward did not change them, so the records and the production order are what pre() would
  // have made -- for one Python hook frame less per call.
  void set_post_only(const std::vector<bool>& flags) {
    TORCH_CHECK(flags.size() == infos_.size(), "nanscan: set_post_only needs one flag per module");
    post_only_.assign(flags.begin(), flags.end());
  }

  void post(int64_t idx, py::handle module, py::handle args, py::handle kwargs, py::handle output) {
    if (!post_only_.empty() && post_only_.at(idx)) pre(idx, module, args, kwargs);
    ThreadState& ts = state();
    const Info& info = infos_.at(idx);
    if (PyWeakref_GetObject(info.module_ref.ptr()) != module.ptr()) return;
    if (ts.stack.empty()) return;
    StackEntry top = ts.stack.back();
    ts.stack.pop_back();
    if (top.frame < 0) return;  // a call that is not recorded
    Window& w = window(ts);
    if (top.window != &w || top.generation != w.generation || w.rows_.frames[top.frame].info != idx) {
      clear_stack(ts);  // out of step: a forward raised and left its frames behind
      return;
    }
    Rows& rows = w.rows_;
    if (!info.inplace) {  // (the inputs are alive: the call's arguments hold them)
      // A module that declares it works in place (nn.ReLU(inplace=True) ...) computes from what
      // its inputs held when the call began: their records (made before it ran) say that.
      for (size_t k = top.versions_at; k < ts.input_versions.size(); ++k) {
        const auto& [impl, version] = ts.input_versions[k];
        if (version >= 0 && static_cast<int64_t>(impl->version_counter().current_version()) != version) {
          rows.frames[top.frame].inputs_changed = true;
          break;
        }
      }
    }
    ts.input_versions.resize(top.versions_at);
    Found found;
    static const std::string kOutputs;
    gather(output.ptr(), kOutputs, found, true, 0, /*outputs=*/true);
    if (found.unrecorded && !ts.stack.empty()) {
      // Part of the output could not be seen into: what the caller computes from it is unknown,
      // so the caller's own values and outputs are "cannot tell" (never "produced there").
      const StackEntry& parent = ts.stack.back();
      if (parent.frame >= 0 && parent.window == &w && parent.generation == w.generation) {
        w.rows_.frames[parent.frame].inputs_changed = true;
      }
    }
    const bool candidate = !(info.is_root && root_late);
    const bool tap_grads = record_grads && ts.phase == kForward && sink_ != nullptr;
    // (Nothing else adds frame outputs until this call's are in: they are contiguous.)
    const int32_t outputs_at = static_cast<int32_t>(rows.frame_outputs.size());
    bool made_loss = false;
    for (auto& f : found) {
      const at::Tensor& t = *f.tensor;
      int32_t entry = w.lookup(t);
      if (entry >= 0) {  // an input or a child's output, returned unchanged
        rows.frame_outputs.push_back(entry);
        continue;
      }
      Row row;
      row.kind = kOutput;
      row.phase = ts.phase;
      row.step = ts.step;
      row.candidate = candidate;
      row.info = static_cast<int32_t>(idx);
      row.frame = top.frame;
      row.dtype = t.scalar_type();
      rows.set_shape(row, t.sizes());
      if (info.is_root && ts.phase == kForward && f.label == ".loss") {  // HF-style: the model returns its loss
        row.kind = kLoss;
        made_loss = true;
      }
      rows.set_label(row, std::move(f.label));
      entry = static_cast<int32_t>(w.add_row(t, row));
      w.remember(t, entry);
      if (tap_grads) tap(t, sink_, entry);
      rows.frame_outputs.push_back(entry);
    }
    Frame& frame = rows.frames[top.frame];
    frame.outputs_at = outputs_at;
    frame.n_outputs = static_cast<int32_t>(rows.frame_outputs.size()) - outputs_at;
    rows.last_frame[idx] = top.frame;
    if (made_loss) owner_.attr("model_loss")(output);
    if ((*eager_)[idx]) w.flush();
    if (ts.stack.empty()) {  // the forward ends: summarize before the loop can edit its tensors in place
      w.flush();
      if (info.is_root) {
        auto out = w.rows_.outputs_of(w.rows_.frames[top.frame]);
        root_outputs_.assign(out.begin(), out.end());
      }
      owner_.attr("forward_ends")(idx);
    }
  }

  void reset() { clear_stack(state()); }

  // Module `idx` was given a child after watch (not hooked: nanscan cannot see what it makes).
  void set_unwatched_child(int64_t idx) { unwatched_children_.at(idx) = 1; }

  void release() { owner_ = py::none(); }

  py::object phase() {
    const ThreadState& ts = state();
    return ts.phase == kNone ? py::object(py::none()) : py::object(py::str(phase_name(ts.phase)));
  }

  py::tuple root_outputs() const { return int_tuple(root_outputs_); }

 private:
  // The calling thread's state (the GIL is held: one hook runs at a time; a Python callback inside
  // a hook may let another thread's hooks run, so each entry point holds its own reference).
  ThreadState& state() {
    const unsigned long id = PyThread_get_thread_ident();
    if (id == last_thread_ && last_state_ != nullptr) return *last_state_;
    std::unique_ptr<ThreadState>& slot = threads_[id];
    if (!slot) slot = std::make_unique<ThreadState>();
    last_thread_ = id;
    last_state_ = slot.get();
    return *slot;
  }

  Window& window(ThreadState& ts) { return ts.phase == kEval ? *eval_ : *forward_; }

  void push_unrecorded(ThreadState& ts) { ts.stack.push_back({-1, nullptr, 0, ts.input_versions.size()}); }

  void clear_stack(ThreadState& ts) {
    ts.stack.clear();
    ts.input_versions.clear();
  }

  // An outermost watched call starts: the monitor decides the phase and the step (None: not recorded).
  void begin(ThreadState& ts, int64_t idx, py::handle args, py::handle kwargs) {
    ts.phase = kNone;
    ts.forward_window = nullptr;
    if (owner_.is_none()) return;
    py::object decided = owner_.attr("begin")(idx, args, kwargs);
    if (decided.is_none()) return;
    py::tuple pair = decided.cast<py::tuple>();
    ts.phase = pair[0].cast<std::string>() == "eval" ? kEval : kForward;
    ts.step = pair[1].cast<int64_t>();
    Window& w = window(ts);
    ts.forward_window = &w;
    ts.forward_generation = w.generation;
    ts.forward_first_row = w.rows_.rows.size();
  }

  // The root is called again while frames of its last forward are still on the stack: that forward
  // raised (a batch the loop skipped, an out-of-memory it caught). What it recorded is not part of
  // the step -- its outputs fed no backward and no update -- so its rows stay for attribution only
  // (never an incident: a NaN the loop's own check raised on must not stop the next, clean step).
  void abort_forward(ThreadState& ts) {
    Window* w = ts.forward_window;
    if (w != nullptr && w->generation == ts.forward_generation) {
      auto& rows = w->rows_.rows;
      for (size_t r = ts.forward_first_row; r < rows.size(); ++r) rows[r].candidate = false;
    }
    ts.forward_window = nullptr;
    if (!owner_.is_none()) owner_.attr("forward_aborted")();
  }

  std::vector<Info> infos_;
  std::vector<uint8_t> post_only_;
  std::vector<uint8_t> unwatched_children_;  // per module: given a child after watch
  std::shared_ptr<std::vector<uint8_t>> eager_;
  std::shared_ptr<Window> forward_, eval_;
  std::shared_ptr<GradSink> sink_;
  py::object owner_;
  std::vector<int32_t> root_outputs_;
  // Per thread: a thread running eval forwards beside the training loop (a background evaluator)
  // has its own stack and phase, so its records never join the other thread's calls.
  std::unordered_map<unsigned long, std::unique_ptr<ThreadState>> threads_;
  unsigned long last_thread_ = 0;
  ThreadState* last_state_ = nullptr;
};

// Hooks.pre / Hooks.post as plain METH_FASTCALL functions bound to one Hooks object: called for
// every module call, where pybind11's argument dispatch would cost as much as the work itself.
template <bool kPre>
PyObject* fast_hook(PyObject* capsule, PyObject* const* args, Py_ssize_t nargs) {
  auto* hooks = static_cast<std::shared_ptr<Hooks>*>(PyCapsule_GetPointer(capsule, "nanscan.Hooks"));
  if (hooks == nullptr) return nullptr;
  if (nargs != (kPre ? 4 : 5)) {
    PyErr_Format(PyExc_TypeError, "nanscan hook: expected %d arguments (index, module, args, kwargs%s), got %zd",
                 kPre ? 4 : 5, kPre ? "" : ", output", nargs);
    return nullptr;
  }
  const long long index = PyLong_AsLongLong(args[0]);
  if (index == -1 && PyErr_Occurred()) return nullptr;
  try {
    if constexpr (kPre) {
      (*hooks)->pre(index, args[1], args[2], args[3]);
    } else {
      (*hooks)->post(index, args[1], args[2], args[3], args[4]);
    }
  } catch (py::error_already_set& e) {
    e.restore();
    return nullptr;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyMethodDef kPreDef = {"pre", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&fast_hook<true>)),
                       METH_FASTCALL, "pre(index, module, args, kwargs): a module call begins"};
PyMethodDef kPostDef = {"post", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&fast_hook<false>)),
                        METH_FASTCALL, "post(index, module, args, kwargs, output): a module call ended"};

// (pre, post) callables of `hooks`; they keep it alive.
py::tuple fast_hooks(const std::shared_ptr<Hooks>& hooks) {
  auto make = [&](PyMethodDef* def) {
    py::capsule capsule(new std::shared_ptr<Hooks>(hooks), "nanscan.Hooks", [](PyObject* c) {
      delete static_cast<std::shared_ptr<Hooks>*>(PyCapsule_GetPointer(c, "nanscan.Hooks"));
    });
    PyObject* fn = PyCFunction_New(def, capsule.ptr());
    if (fn == nullptr) throw py::error_already_set();
    return py::reinterpret_steal<py::object>(fn);
  };
  return py::make_tuple(make(&kPreDef), make(&kPostDef));
}

// The gradients of `tensors` that exist, in order, and the indices of their tensors; true when every
// tensor has one. A sparse gradient (nn.Embedding(sparse=True)) is summarized over its stored
// values, coalesced (duplicate indices summed, as the update sees them): the kernels read strided
// tensors, and a dense copy of an embedding table's gradient every step is what sparse gradients
// exist to avoid. Its position goes into `sparse` (the record's shape is the values', not the
// parameter's).
bool existing_grads(const std::vector<at::Tensor>& tensors, std::vector<at::Tensor>& grads,
                    std::vector<int64_t>& present, std::vector<int64_t>* sparse = nullptr) {
  grads.reserve(tensors.size());
  for (size_t k = 0; k < tensors.size(); ++k) {
    const at::Tensor& g = tensors[k].grad();
    if (g.defined()) {
      if (g.layout() == at::kStrided) {
        grads.push_back(g);
      } else {
        grads.push_back(g.is_sparse() ? g.coalesce()._values() : g.values());
        if (sparse != nullptr) sparse->push_back(static_cast<int64_t>(grads.size() - 1));
      }
      present.push_back(static_cast<int64_t>(k));
    }
  }
  return grads.size() == tensors.size();
}

// The parameters the monitor checks every step, held in C++: their records after the update and
// their gradients' records are one call each, with no Python list of hundreds of tensors to convert
// (an nn.Parameter argument also costs a __torch_function__ check) and no Python object made per
// gradient. The held tensors are the parameters themselves: `param.data = ...` (module.to) changes
// what they hold, not which tensors they are.
class TensorSet {
 public:
  TensorSet(std::vector<at::Tensor> tensors, py::object summarize)
      : tensors_(std::move(tensors)), summarize_(summarize.is_none() ? py::object() : std::move(summarize)) {}

  // [n, RECORD_SIZE] records of the tensors, by the default kernels' summarize_many or `summarize`.
  at::Tensor records() const {
    TORCH_CHECK(!tensors_.empty(), "nanscan: TensorSet.records of no tensors");
    return summarize_many_with(summarize_, tensors_);
  }

  // (records of the gradients that exist or None if none does; None if every tensor has one, else
  // the indices of those that do; None if none is sparse, else {position among the records: the
  // values summarized}).
  py::tuple grad_records() const {
    std::vector<at::Tensor> grads;
    std::vector<int64_t> present, sparse;
    const bool all = existing_grads(tensors_, grads, present, &sparse);
    if (grads.empty()) return py::make_tuple(py::none(), py::list(), py::none());
    py::object sparse_values = py::none();
    if (!sparse.empty()) {
      py::dict values;
      for (int64_t k : sparse) values[py::int_(k)] = py::cast(grads[k]);
      sparse_values = values;
    }
    return py::make_tuple(summarize_many_with(summarize_, grads),
                          all ? py::object(py::none()) : py::object(py::cast(present)), sparse_values);
  }

  int64_t size() const { return static_cast<int64_t>(tensors_.size()); }

 private:
  std::vector<at::Tensor> tensors_;
  py::object summarize_;
};

// The parameters' gradients for the read, without a Python attribute access per parameter:
// (grads of the parameters that have one, in order; None when all have one, else their indices).
py::tuple param_grads(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> grads;
  std::vector<int64_t> present;
  const bool all = existing_grads(params, grads, present);
  return py::make_tuple(py::cast(grads), all ? py::object(py::none()) : py::object(py::cast(present)));
}

// Per tensor, its dtype's largest finite value (NaN if not floating): the headroom check's maxima
// for blocks of parameters, gradients and buffers, without a Python loop over them.
at::Tensor tensor_dtype_maxima(const std::vector<at::Tensor>& tensors) {
  at::Tensor out = at::empty({static_cast<int64_t>(tensors.size())}, at::kDouble);
  double* maxima = out.data_ptr<double>();
  for (size_t k = 0; k < tensors.size(); ++k) maxima[k] = dtype_max(tensors[k].scalar_type());
  return out;
}

// The headroom check's candidates (nanscan/monitor/headroom.py): rows i < n of the landed records
// whose largest finite magnitude amax = max(|finite_min|, |finite_max|) is within `bits` of the
// limit -- maxima[i] (NaN: unknown, skipped), float16's 65504 instead of float32's max when
// `fp16_cast`, and at most `cast_floor` (a declared cast's max; +inf when none):
// log2(limit / amax) < bits. Rows with no finite or no non-zero value are not candidates.
std::vector<int64_t> headroom_candidates(const at::Tensor& host, const at::Tensor& maxima, int64_t n, double bits,
                                         bool fp16_cast, double cast_floor) {
  TORCH_CHECK(host.device().is_cpu() && host.scalar_type() == at::kDouble && host.dim() == 2 &&
                  host.size(1) >= kRecordSize && n <= host.size(0) && maxima.scalar_type() == at::kDouble &&
                  maxima.numel() >= n,
              "nanscan: headroom_candidates expects [rows >= n, >= 8] float64 host records and n float64 maxima");
  const at::Tensor rows = host.contiguous();
  const at::Tensor limits = maxima.contiguous();
  const double* data = rows.const_data_ptr<double>();
  const double* maxes = limits.const_data_ptr<double>();
  const int64_t width = rows.size(1);
  const double fp32_max = std::numeric_limits<float>::max();
  const double fp16_max = static_cast<double>(std::numeric_limits<c10::Half>::max());
  const double scale = std::exp2(bits);
  std::vector<int64_t> out;
  for (int64_t i = 0; i < n; ++i) {
    const double* r = data + i * width;
    const double amax = std::max(std::fabs(r[kFiniteMin]), std::fabs(r[kFiniteMax]));
    double limit = maxes[i];
    if (!(amax > 0) || !std::isfinite(amax) || std::isnan(limit)) continue;
    if (fp16_cast && limit == fp32_max) limit = fp16_max;
    limit = std::min(limit, cast_floor);
    if (amax * scale > limit) out.push_back(i);  // log2(limit / amax) < bits
  }
  return out;
}

// Rows i < n of a landed read ([rows, columns] float64 on the host) holding a NaN / +Inf / -Inf
// count: the rows a read decodes. (One pass in C++ instead of four tensor ops per read.)
std::vector<int64_t> nonfinite_rows(const at::Tensor& host, int64_t n) {
  TORCH_CHECK(host.device().is_cpu() && host.scalar_type() == at::kDouble && host.dim() == 2 &&
                  host.size(1) >= 3 && n <= host.size(0),
              "nanscan: nonfinite_rows expects [rows >= n, >= 3] float64 host records");
  const at::Tensor rows = host.contiguous();
  const double* data = rows.const_data_ptr<double>();
  const int64_t width = rows.size(1);
  std::vector<int64_t> out;
  for (int64_t i = 0; i < n; ++i) {
    const double* r = data + i * width;
    if (r[0] + r[1] + r[2] > 0) out.push_back(i);
  }
  return out;
}

}  // namespace nanscan

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace nanscan;
  py::class_<GradSink, std::shared_ptr<GradSink>>(m, "GradSink")
      .def(py::init<int64_t, int64_t, py::object>(), py::arg("batch"), py::arg("batch_bytes"),
           py::arg("summarize") = py::none())
      .def_readwrite("generation", &GradSink::generation)
      .def("__len__", &GradSink::size)
      .def("take", &GradSink::take);
  py::class_<GradMeta, std::shared_ptr<GradMeta>>(m, "GradMeta")
      .def("index", &GradMeta::index_of)
      .def("stale", &GradMeta::is_stale)
      .def("dtype", &GradMeta::dtype)
      .def("shape", &GradMeta::shape)
      .def("dtype_maxima", &GradMeta::dtype_maxima)
      .def("__len__", &GradMeta::size);
  m.def("set_stamp_target", &set_stamp_target, py::arg("owner"), py::arg("buffer"), py::arg("counter"),
        "name the buffer and counter nanscan::stamp writes for owner (None: drop it)");
  m.def("tap", &tap, "hook tensor.grad_fn: its incoming gradient goes to sink, as slot index");
  py::class_<TensorSet, std::shared_ptr<TensorSet>>(m, "TensorSet")
      .def(py::init<std::vector<at::Tensor>, py::object>(), py::arg("tensors"), py::arg("summarize") = py::none())
      .def("records", &TensorSet::records, "[n, RECORD_SIZE] records of the held tensors")
      .def("grad_records", &TensorSet::grad_records,
           "(records of the gradients that exist or None, None if all exist else their indices)")
      .def("__len__", &TensorSet::size);
  m.def("param_grads", &param_grads, "(grads that exist, None or the indices of their parameters)");
  m.def("nonfinite_rows", &nonfinite_rows, "rows < n of host records with a NaN / Inf count");
  m.def("headroom_candidates", &headroom_candidates, "rows < n within `bits` of their dtype's (or cast's) max");
  m.def("dtype_maxima", &tensor_dtype_maxima, "per tensor, its dtype's largest finite value (NaN: not floating)");

  py::class_<Rows, std::shared_ptr<Rows>>(m, "Rows")
      .def("row", &Rows::row)
      .def("frame", &Rows::frame)
      .def("set_grads", &Rows::set_grads)
      .def("steps", &Rows::steps)
      .def("loss_entries", &Rows::loss_entries)
      .def("dtype_maxima", &Rows::dtype_maxima)
      .def("weight_inputs", &Rows::weight_inputs)
      .def("__len__", [](const Rows& r) { return r.rows.size(); });

  py::class_<Window, std::shared_ptr<Window>>(m, "Window")
      .def(py::init<py::object, py::object, py::object, py::object, int64_t, int64_t, int64_t>(), py::arg("marker"),
           py::arg("make_rows"), py::arg("summarize"), py::arg("on_stale"), py::arg("n_infos"), py::arg("batch"),
           py::arg("batch_bytes"))
      .def("add", &Window::add_py)
      .def("add_block", &Window::add_block)
      .def("flush", &Window::flush)
      .def("take", &Window::take)
      .def("__len__", &Window::size)
      .def_readonly("generation", &Window::generation);

  py::class_<Hooks, std::shared_ptr<Hooks>>(m, "Hooks")
      .def(py::init<std::vector<std::string>, py::list, std::vector<bool>, std::vector<bool>, std::shared_ptr<Window>,
                    std::shared_ptr<Window>, std::shared_ptr<GradSink>, py::object>())
      .def("fast_hooks", [](const std::shared_ptr<Hooks>& self) { return fast_hooks(self); },
           "(pre, post) with the same arguments, as plain functions (no pybind11 dispatch per call)")
      .def("reset", &Hooks::reset)
      .def("set_unwatched_child", &Hooks::set_unwatched_child, "module idx was given a child after watch")
      .def("set_post_only", &Hooks::set_post_only)
      .def("release", &Hooks::release)
      .def_property_readonly("phase", &Hooks::phase)
      .def_property_readonly("root_outputs", &Hooks::root_outputs)
      .def_readwrite("record_grads", &Hooks::record_grads)
      .def_readwrite("root_late", &Hooks::root_late);
}
