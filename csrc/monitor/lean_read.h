// A clean read in one call: LeanRead.
// (Part of the module csrc/monitor/module.cpp builds: one translation unit.)
//
// Note [a clean read in one call]: most reads are clean, and a clean read that no consumer walks
// needs nothing of its records but the answer (Note [a clean read is decided without a Read] in
// nanscan/monitor/readback.py). Taking them one Python call at a time -- the window's take, the
// gradient sink's take, the parameter gradients' records, the hooks' reset, the test over the
// blocks -- made a Python object of every part (lists of blocks, tuples, the window's rows, the
// gradients' meta) only to drop it, and every one of those objects and calls is fetched cold: the
// step between two reads evicts the read's code and data from the caches, so on the host a read
// costs about what it touches, not what it computes (a Python call that takes 0.4 us twice in a row
// takes 10 us as a read's first, beside a 160-layer model: benchmarks/read_cost.py). LeanRead::take
// does all of it in C++ and tests the records while they are still in the cache; a clean read
// leaves nothing to Python but which parameter gradients were read. Anything else -- a record with
// a NaN / Inf, a block on a device -- comes back as the parts the separate calls return, and the
// read goes on from there exactly as before.
#pragma once

#include "hooks.h"
#include "tensor_set.h"
#include "window.h"

#include <chrono>
#include <memory>
#include <utility>
#include <vector>

namespace nanscan {

class LeanRead {
 public:
  LeanRead(std::shared_ptr<Window> window, std::shared_ptr<GradSink> sink, std::shared_ptr<TensorSet> params,
           std::shared_ptr<Hooks> hooks)
      : window_(std::move(window)), sink_(std::move(sink)), params_(std::move(params)), hooks_(std::move(hooks)) {}

  // Nanoseconds the last take() spent finishing records (the window's and the sink's last batches,
  // the gradients' records): kernel work on the CPU, launches on a device -- what the read-cost
  // benchmark times apart from the read and its decision.
  int64_t finishing_ns = 0;

  // Everything recorded since the last read, as Reading.gather takes it: the window (in order),
  // the gradient sink (its generation set to `sink_generation`), the parameters' gradients if
  // `grads`; then the hooks' running calls are forgotten. Clean -- every record on the host, none
  // with a NaN / +Inf / -Inf count -- it is dropped and what comes back says which parameter
  // gradients were read: None (not asked, or none exists), True (every one), or the indices of
  // those that exist. Otherwise the tuple (window.take(), sink.take() or None,
  // TensorSet.grad_records() or None).
  py::object take(bool grads, int64_t sink_generation) {
    const auto start = std::chrono::steady_clock::now();
    Window::Taken window = window_->take_parts();
    GradSink::Taken sink;
    if (sink_) {
      sink = sink_->take_parts();
      sink_->generation = sink_generation;
    }
    TensorSet::GradRecords param_grads;
    const bool read_grads = grads && params_ != nullptr;
    if (read_grads) param_grads = params_->grad_records_parts();
    finishing_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start)
                       .count();
    hooks_->reset();
    if (clean(window.blocks) && (!sink_ || clean(sink.records)) &&
        (!param_grads.records.defined() || clean(param_grads.records))) {
      if (!param_grads.records.defined()) return py::none();
      if (param_grads.all) return py::bool_(true);
      return py::cast(param_grads.present);
    }
    return py::make_tuple(window_->to_python(std::move(window)),
                          sink_ ? py::object(GradSink::to_python(std::move(sink))) : py::object(py::none()),
                          read_grads ? py::object(TensorSet::to_python(std::move(param_grads)))
                                     : py::object(py::none()));
  }

 private:
  // [k, >= 3] float64 records on the host with no NaN / +Inf / -Inf count (nonfinite_rows' test).
  static bool clean(const at::Tensor& block) {
    if (!block.device().is_cpu() || block.scalar_type() != at::kDouble || block.dim() != 2 || block.size(1) < 3 ||
        !block.is_contiguous()) {
      return false;  // (not decided here: the read decides it as before)
    }
    const double* r = block.const_data_ptr<double>();
    const int64_t width = block.size(1);
    for (int64_t i = 0, n = block.size(0); i < n; ++i, r += width) {
      if (r[0] + r[1] + r[2] > 0) return false;
    }
    return true;
  }

  static bool clean(const std::vector<at::Tensor>& blocks) {
    for (const auto& b : blocks) {
      if (!clean(b)) return false;
    }
    return true;
  }

  std::shared_ptr<Window> window_;
  std::shared_ptr<GradSink> sink_;
  std::shared_ptr<TensorSet> params_;
  std::shared_ptr<Hooks> hooks_;
};

}  // namespace nanscan
