// The rows a read window holds: row kinds and phases, Row, Frame, the identity map's entry, Rows (decoded
// for Python only when a read asks).
// (Part of the module csrc/monitor/module.cpp builds: one translation unit.)
#pragma once

#include "grad_sink.h"

#include <torch/csrc/DynamicTypes.h>

#include <string>
#include <vector>

namespace nanscan {

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

inline const char* phase_name(uint8_t phase) { return phase == kEval ? "eval" : "forward"; }

inline py::object dtype_object(at::ScalarType d) {  // torch.dtype objects are static: borrowed
  return py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(torch::getTHPDtype(d)));
}

template <typename Ints>
inline py::tuple int_tuple(const Ints& xs) {
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

}  // namespace nanscan
