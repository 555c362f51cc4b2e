// Every nanscan op schema, in one place. Backends only register implementations:
//   csrc/cpu/summarize.cpp   -> CPU     (C++, at::vec + at::parallel_for)
//   csrc/cuda/summarize.cu   -> CUDA    (C++/CUDA)
//   nanscan/kernels/triton.py -> CUDA, and CPU under TRITON_INTERPRET=1, for the triton_* ops
//   nanscan/_ops.py           -> fake (meta) kernels for all of them
// Each op returns float64 records laid out as in csrc/record.h: shape [kRecordSize] (10) for one tensor,
// [len(xs), kRecordSize] for a list.
#include <torch/library.h>

TORCH_LIBRARY(nanscan, m) {
  m.def("summarize(Tensor x) -> Tensor");
  m.def("summarize_many(Tensor[] xs) -> Tensor");
  m.def("triton_summarize(Tensor x) -> Tensor");
  m.def("triton_summarize_many(Tensor[] xs) -> Tensor");
  // The monitor's compiled path: records written into rows of a buffer, stamped by a counter
  // (csrc/monitor/stamp_rows.cpp, CompositeExplicitAutograd: every device, and meta).
  m.def("stamp_rows_(Tensor(a!) buffer, Tensor(b!) counter, Tensor[] values, Tensor? records, int first_row, "
        "int owner, str labels) -> ()");
  // The same into the buffer named for `owner` (effectful: see stamp_rows.cpp).
  m.def("stamp(Tensor[] values, Tensor? records, int owner, int first_row, str labels) -> ()");
}

// Records are statistics, not differentiable values: autograd falls through, so a record never
// requires grad nor holds a reference to the autograd graph of the tensor it describes, and the
// monitor's hooks need no .detach() per tensor on the hot path.
TORCH_LIBRARY_IMPL(nanscan, Autograd, m) {
  m.impl("summarize", torch::CppFunction::makeFallthrough());
  m.impl("summarize_many", torch::CppFunction::makeFallthrough());
  m.impl("triton_summarize", torch::CppFunction::makeFallthrough());
  m.impl("triton_summarize_many", torch::CppFunction::makeFallthrough());
  m.impl("stamp_rows_", torch::CppFunction::makeFallthrough());
  m.impl("stamp", torch::CppFunction::makeFallthrough());
}
