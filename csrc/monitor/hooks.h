// The eager forward hooks: per-thread call stacks, the pre / post work per module call, the C entry
// points Python calls.
// (Part of the module csrc/monitor/module.cpp builds: one translation unit.)
#pragma once

#include "grad_sink.h"
#include "rows.h"
#include "walk.h"
#include "window.h"

#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <limits>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace nanscan {

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
inline PyObject* fast_hook(PyObject* capsule, PyObject* const* args, Py_ssize_t nargs) {
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
inline py::tuple fast_hooks(const std::shared_ptr<Hooks>& hooks) {
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

}  // namespace nanscan
