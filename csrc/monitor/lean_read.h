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
// costs about what it touches, not what it computes (distributed.active(), the read's first call,
// takes 11.5 us as a read begins beside a 160-layer model and 0.9 us called again at once:
// benchmarks/read_cost.py, "a cold call"). LeanRead::take
// does all of it in C++ and tests the records while they are still in the cache; a clean read
// leaves nothing to Python but which parameter gradients were read. On a device the records are
// tested by one sum there, and the 8 bytes it copies back are the read's one host sync. Anything
// else -- a record with a NaN / Inf, records on two devices -- comes back as the parts the separate
// calls return, and the read goes on from there exactly as before.
#pragma once

#include "hooks.h"
#include "read_helpers.h"
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
  // `grads`; then the hooks' running calls are forgotten. Clean -- no record with a NaN / +Inf /
  // -Inf count -- it is dropped and what comes back says which parameter gradients were read: None
  // (not asked, or none exists), True (every one), or the indices of those that exist. Otherwise
  // (a record is not finite, or the records lie on more than one device) the tuple (window.take(),
  // sink.take() or None, TensorSet.grad_records() or None). Records on the host are tested where
  // they lie; records on a device (or any, with `on_device`: the tests' way to run that path on the
  // CPU) by one sum there, whose 8 bytes are the read's one host sync (Note [a clean read comes back
  // as one number] in nanscan/monitor/readback.py) -- unless `may_sync` is false (async mode): then
  // records on a device come back as the tuple, undecided, for a copy decided a read later.
  py::object take(bool grads, int64_t sink_generation, bool on_device = false, bool may_sync = true) {
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
    std::vector<at::Tensor> blocks = window.blocks;  // (handles: the parts stay whole for the way back)
    blocks.insert(blocks.end(), sink.records.begin(), sink.records.end());
    if (param_grads.records.defined()) blocks.push_back(param_grads.records);
    if (clean(blocks, on_device, may_sync)) {
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
  static bool is_records(const at::Tensor& block) {
    return block.scalar_type() == at::kDouble && block.dim() == 2 && block.size(1) >= 3;
  }

  // Every record of `blocks` ([k, >= 3] float64) without a NaN / +Inf / -Inf count (nonfinite_row);
  // false also where that is not decided here (blocks on two devices: the read goes on as before,
  // and moves them; blocks on a device when the host may not wait for it).
  static bool clean(const std::vector<at::Tensor>& blocks, bool on_device, bool may_sync) {
    if (blocks.empty()) return true;
    const c10::Device device = blocks.front().device();
    for (const auto& b : blocks) {
      if (!is_records(b) || b.device() != device) return false;
    }
    if (device.is_cpu() && !on_device) {
      for (const auto& b : blocks) {
        if (!host_clean(b)) return false;
      }
      return true;
    }
    if (!may_sync) return false;
    // (one cat, one sum, 8 bytes back: the launches and the sync the Copy path makes, without it)
    const at::Tensor all = blocks.size() == 1 ? blocks.front() : at::cat(blocks);
    return all.narrow(1, 0, 3).sum().item<double>() == 0;
  }

  static bool host_clean(const at::Tensor& block) {
    const at::Tensor rows = block.contiguous();
    const double* r = rows.const_data_ptr<double>();
    const int64_t width = rows.size(1);
    for (int64_t i = 0, n = rows.size(0); i < n; ++i, r += width) {
      if (nonfinite_row(r)) return false;
    }
    return true;
  }

  std::shared_ptr<Window> window_;
  std::shared_ptr<GradSink> sink_;
  std::shared_ptr<TensorSet> params_;
  std::shared_ptr<Hooks> hooks_;
};

}  // namespace nanscan
