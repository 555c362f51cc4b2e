// Tensors held for the per-step checks (the parameters, the buffers) and their gradients.
// (Part of the module csrc/monitor/module.cpp builds: one translation unit.)
#pragma once

#include "grad_sink.h"

#include <vector>

namespace nanscan {

// The gradients of `tensors` that exist, in order, and the indices of their tensors; true when every
// tensor has one. A sparse gradient (nn.Embedding(sparse=True)) is summarized over its stored
// values, coalesced (duplicate indices summed, as the update sees them): the kernels read strided
// tensors, and a dense copy of an embedding table's gradient every step is what sparse gradients
// exist to avoid. Its position goes into `sparse` (the record's shape is the values', not the
// parameter's).
inline bool existing_grads(const std::vector<at::Tensor>& tensors, std::vector<at::Tensor>& grads,
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

  // The gradients' records before any Python object is made of them (LeanRead, read_helpers.h).
  struct GradRecords {
    at::Tensor records;             // undefined: no tensor has a gradient
    bool all = false;               // every tensor has one
    std::vector<int64_t> present;   // else the indices of those that do
    std::vector<int64_t> sparse;    // positions among the records of sparse gradients' values
    std::vector<at::Tensor> grads;  // (kept only when one is sparse: its values)
  };

  GradRecords grad_records_parts() const {
    GradRecords out;
    out.all = existing_grads(tensors_, out.grads, out.present, &out.sparse);
    if (!out.grads.empty()) out.records = summarize_many_with(summarize_, out.grads);
    if (out.sparse.empty()) out.grads.clear();
    return out;
  }

  // grad_records() of `parts`.
  static py::tuple to_python(GradRecords&& parts) {
    if (!parts.records.defined()) return py::make_tuple(py::none(), py::list(), py::none());
    py::object sparse_values = py::none();
    if (!parts.sparse.empty()) {
      py::dict values;
      for (int64_t k : parts.sparse) values[py::int_(k)] = py::cast(parts.grads[k]);
      sparse_values = values;
    }
    return py::make_tuple(std::move(parts.records),
                          parts.all ? py::object(py::none()) : py::object(py::cast(parts.present)), sparse_values);
  }

  // (records of the gradients that exist or None if none does; None if every tensor has one, else
  // the indices of those that do; None if none is sparse, else {position among the records: the
  // values summarized}).
  py::tuple grad_records() const { return to_python(grad_records_parts()); }

  int64_t size() const { return static_cast<int64_t>(tensors_.size()); }

 private:
  std::vector<at::Tensor> tensors_;
  py::object summarize_;
};

// The parameters' gradients for the read, without a Python attribute access per parameter:
// (grads of the parameters that have one, in order; None when all have one, else their indices).
inline py::tuple param_grads(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> grads;
  std::vector<int64_t> present;
  const bool all = existing_grads(params, grads, present);
  return py::make_tuple(py::cast(grads), all ? py::object(py::none()) : py::object(py::cast(present)));
}

}  // namespace nanscan
