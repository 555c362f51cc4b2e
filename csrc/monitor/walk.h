// The walk over a hook's arguments and outputs: the floating tensors in them, with where they sit.
// (Part of the module csrc/monitor/module.cpp builds: one translation unit.)
#pragma once

#include "rows.h"

#include <string>

namespace nanscan {

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
inline std::string indexed(const std::string& prefix, Py_ssize_t i) {
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
inline void add_found(c10::MaybeOwned<at::Tensor> t, const std::string& prefix, Found& out) {
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
inline PyObject* children_of(PyObject* value) {
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
inline void gather(PyObject* value, const std::string& prefix, Found& out, bool labels = true, int depth = 0,
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

}  // namespace nanscan
