// The monitor's native module (nanscan._C): its Python surface, declared in nanscan/_C.pyi. The parts
// live in one header each -- rows.h, window.h (+ streams.h), walk.h, hooks.h, grad_sink.h,
// tensor_set.h, lean_read.h, read_helpers.h; stamp_rows.cpp is the compiled path's op -- and this file binds them.
//
// The eager forward hooks in C++, and the read window they record into.
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
//   Window(make_rows, summarize, on_stale)  one read window (forward or eval)
//     add(tensor, slot) -> entry      a Python Slot record (loss, optimizer state)
//     add_block(records, block, n)    n rows summarized already (parameters, buffers)
//     flush(), len(window), window.generation
//     take() -> (entries, records, rows or None): entries in production order (Python
//       Slot / Block objects; C++ rows appear as make_rows(rows)), their records as a list of
//       [k, RECORD_SIZE] blocks in order (a read stacks them once, with its other records), and
//       the Rows of the window
//     follow_stamps(owner)            mark each entry with owner's host stamp count (Note [stamps
//       counted on the host], stamp_rows.cpp); taken_marks() -> the last take()'s marks: bytes of
//       int64 pairs (first entry, count), a pair only where the count moved
//   Rows: row(entry) -> (kind, info, label, step, phase, dtype, shape, inputs, candidate,
//       consumers, grad, stale, inputs_changed); frame(f) -> (info, outputs); set_grads(grad_meta, start);
//       dtype_maxima() -> float64 tensor: each entry's dtype's largest finite value (NaN: not a row);
//       weight_inputs(info) -> slot entries a parameter gradient of that module depends on
//   GradSink(batch, bytes, summarize=None): the gradients of module outputs (grad_sink.h);
//     follow_stamps(owner) / taken_marks() as the Window's, per gradient in the order received
//   stamp_count(owner), reset_stamp_count(owner), drop_stamp_count(owner): the host count
//   TensorSet(tensors, summarize=None)  tensors held for the per-step checks (the parameters)
//     records() -> [n, RECORD_SIZE]; grad_records() -> (records of the grads that exist or None,
//       None if all exist else their indices); summarize: a Python callable list -> records (None:
//       the nanscan::summarize_many op)
//   param_grads(params) -> (grads that exist, None if all do else their indices)
//   nonfinite_rows(host_records, n) -> the rows < n with a NaN / +Inf / -Inf count
//   nonfinite_in_blocks(blocks) -> those rows across a read's host blocks, or None (a block elsewhere)
//   dtype_maxima(tensors) -> float64 tensor: each tensor's dtype's largest finite value
//   headroom_candidates(host, maxima, n, bits, fp16_cast, cast_floor) -> rows near overflow
//   Hooks(names, module_refs, is_root, inplace, forward, eval, sink, owner)
//     fast_hooks() -> (pre, post): pre(info, module, args, kwargs), post(info, module, args, kwargs,
//       output) as plain C functions
//     set_post_only(flags): modules hooked by post alone (it does their pre() work first)
//     owner.begin(info, args, kwargs) -> None or (phase, step); owner.forward_ends(info);
//     owner.model_loss(output) are called back for the rare events
//   LeanRead(window, sink, params, hooks): a read's takes and its clean test in one call (Note [a
//     clean read in one call], lean_read.h); take(grads, sink_generation, on_device=False,
//     may_sync=True) -> None / True / [present parameter indices] when clean, else (window.take(),
//     sink.take() or None, grad_records() or None); finishing_ns: the last take's time spent
//     finishing records
#include "grad_sink.h"
#include "hooks.h"
#include "lean_read.h"
#include "read_helpers.h"
#include "rows.h"
#include "tensor_set.h"
#include "window.h"
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
void drop_stamp_count(int64_t owner);

}  // namespace nanscan

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace nanscan;
  py::class_<GradSink, std::shared_ptr<GradSink>>(m, "GradSink")
      .def(py::init<int64_t, int64_t, py::object>(), py::arg("batch"), py::arg("batch_bytes"),
           py::arg("summarize") = py::none())
      .def_readwrite("generation", &GradSink::generation)
      .def("__len__", &GradSink::size)
      .def("take", &GradSink::take)
      .def("follow_stamps", [](GradSink& self, int64_t owner) { self.follow_stamps(stamp_count(owner)); },
           "mark each gradient with owner's host stamp count (Note [stamps counted on the host])")
      .def("taken_marks", &GradSink::taken_marks);
  py::class_<GradMeta, std::shared_ptr<GradMeta>>(m, "GradMeta")
      .def("index", &GradMeta::index_of)
      .def("stale", &GradMeta::is_stale)
      .def("dtype", &GradMeta::dtype)
      .def("shape", &GradMeta::shape)
      .def("dtype_maxima", &GradMeta::dtype_maxima)
      .def("__len__", &GradMeta::size);
  m.def("set_stamp_target", &set_stamp_target, py::arg("owner"), py::arg("buffer"), py::arg("counter"),
        "name the buffer and counter nanscan::stamp writes for owner (None: drop it)");
  m.def("stamp_count", [](int64_t owner) { return stamp_count(owner)->load(); }, py::arg("owner"),
        "rows stamped for owner since its count was last reset (Note [stamps counted on the host])");
  m.def("reset_stamp_count", [](int64_t owner) { stamp_count(owner)->store(0); }, py::arg("owner"));
  m.def("drop_stamp_count", &drop_stamp_count, py::arg("owner"));
  m.def("tap", &tap, "hook tensor.grad_fn: its incoming gradient goes to sink, as slot index");
  py::class_<TensorSet, std::shared_ptr<TensorSet>>(m, "TensorSet")
      .def(py::init<std::vector<at::Tensor>, py::object>(), py::arg("tensors"), py::arg("summarize") = py::none())
      .def("records", &TensorSet::records, "[n, RECORD_SIZE] records of the held tensors")
      .def("grad_records", &TensorSet::grad_records,
           "(records of the gradients that exist or None, None if all exist else their indices)")
      .def("__len__", &TensorSet::size);
  m.def("param_grads", &param_grads, "(grads that exist, None or the indices of their parameters)");
  m.def("nonfinite_rows", &nonfinite_rows, "rows < n of host records with a NaN / Inf count");
  m.def("nonfinite_in_blocks", &nonfinite_in_blocks, "rows of host record blocks with a NaN / Inf count, or None");
  // The row kinds, defined once (rows.h): Python reads them from here (nanscan/monitor/slots.py).
  py::dict row_kinds;
  row_kinds["OUTPUT"] = static_cast<int>(kOutput);
  row_kinds["BODY"] = static_cast<int>(kBody);
  row_kinds["BATCH_INPUT"] = static_cast<int>(kBatch);
  row_kinds["MODEL_LOSS"] = static_cast<int>(kLoss);
  m.attr("ROW_KINDS") = row_kinds;
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
      .def(py::init<py::object, py::object, py::object, int64_t, int64_t, int64_t>(), py::arg("make_rows"),
           py::arg("summarize"), py::arg("on_stale"), py::arg("n_infos"), py::arg("batch"), py::arg("batch_bytes"))
      .def("add", &Window::add_py)
      .def("add_block", &Window::add_block)
      .def("flush", &Window::flush)
      .def("take", &Window::take)
      .def("follow_stamps", [](Window& self, int64_t owner) { self.follow_stamps(stamp_count(owner)); },
           "mark each entry with owner's host stamp count (Note [stamps counted on the host])")
      .def("taken_marks", &Window::taken_marks)
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

  py::class_<LeanRead, std::shared_ptr<LeanRead>>(m, "LeanRead")
      .def(py::init<std::shared_ptr<Window>, std::shared_ptr<GradSink>, std::shared_ptr<TensorSet>,
                    std::shared_ptr<Hooks>>(),
           py::arg("window"), py::arg("sink"), py::arg("params"), py::arg("hooks"))
      .def("take", &LeanRead::take, py::arg("grads"), py::arg("sink_generation"), py::arg("on_device") = false,
           py::arg("may_sync") = true, "a read's takes and its clean test in one call (Note [a clean read in one call])")
      .def_readwrite("finishing_ns", &LeanRead::finishing_ns);
}
