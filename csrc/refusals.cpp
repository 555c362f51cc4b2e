// Kernels for the tensors no nanscan kernel reads -- sparse (COO, CSR and the other compressed
// layouts), quantized and nested tensors -- registered at their dispatch keys, so that every op
// refuses them itself with the message the CPU and CUDA kernels give (csrc/inputs.h: what was wrong,
// what is accepted, what to do) instead of the dispatcher's "could not run ... with arguments from
// the 'SparseCPU' backend". The Python API goes straight to the ops (nanscan.record / records), and
// the monitor's stamp takes whatever a module returned.
#include <torch/library.h>

#include "inputs.h"

namespace nanscan {
namespace {

// normalize_input raises the TypeError naming the layout / quantization / nesting; a list reaches
// this kernel only if one of its tensors has such a key, so the loop always raises.
template <const char* kOp>
at::Tensor refuse_one(const at::Tensor& x) {
  normalize_input(x, kOp);
  TORCH_CHECK_TYPE(false, kOp, ": this tensor cannot be read (", kSupportedText, ")");
}

template <const char* kOp>
at::Tensor refuse_many(at::TensorList xs) {
  for (const at::Tensor& x : xs) normalize_input(x, kOp);
  TORCH_CHECK_TYPE(false, kOp, ": these tensors cannot be read (", kSupportedText, ")");
}

constexpr char kSummarize[] = "nanscan.summarize";
constexpr char kSummarizeMany[] = "nanscan.summarize_many";
constexpr char kTritonSummarize[] = "nanscan.triton_summarize";
constexpr char kTritonSummarizeMany[] = "nanscan.triton_summarize_many";
constexpr char kStampRows[] = "nanscan.stamp_rows_";
constexpr char kStamp[] = "nanscan.stamp";

void refuse_stamp_rows(at::Tensor& /*buffer*/, at::Tensor& /*counter*/, at::TensorList values,
                       const c10::optional<at::Tensor>& records, int64_t, int64_t, c10::string_view) {
  if (records.has_value() && records->defined()) normalize_input(*records, kStampRows);
  refuse_many<kStampRows>(values);
}

void refuse_stamp(at::TensorList values, const c10::optional<at::Tensor>& records, int64_t, int64_t,
                  c10::string_view) {
  if (records.has_value() && records->defined()) normalize_input(*records, kStamp);
  refuse_many<kStamp>(values);
}

void register_refusals(torch::Library& m) {
  m.impl("summarize", &refuse_one<kSummarize>);
  m.impl("summarize_many", &refuse_many<kSummarizeMany>);
  m.impl("triton_summarize", &refuse_one<kTritonSummarize>);
  m.impl("triton_summarize_many", &refuse_many<kTritonSummarizeMany>);
  m.impl("stamp_rows_", &refuse_stamp_rows);
  m.impl("stamp", &refuse_stamp);
}

}  // namespace
}  // namespace nanscan

TORCH_LIBRARY_IMPL(nanscan, SparseCPU, m) { nanscan::register_refusals(m); }
TORCH_LIBRARY_IMPL(nanscan, SparseCUDA, m) { nanscan::register_refusals(m); }
TORCH_LIBRARY_IMPL(nanscan, SparseMeta, m) { nanscan::register_refusals(m); }
TORCH_LIBRARY_IMPL(nanscan, SparseCsrCPU, m) { nanscan::register_refusals(m); }
TORCH_LIBRARY_IMPL(nanscan, SparseCsrCUDA, m) { nanscan::register_refusals(m); }
TORCH_LIBRARY_IMPL(nanscan, SparseCsrMeta, m) { nanscan::register_refusals(m); }
TORCH_LIBRARY_IMPL(nanscan, QuantizedCPU, m) { nanscan::register_refusals(m); }
TORCH_LIBRARY_IMPL(nanscan, QuantizedCUDA, m) { nanscan::register_refusals(m); }
TORCH_LIBRARY_IMPL(nanscan, NestedTensorCPU, m) { nanscan::register_refusals(m); }
TORCH_LIBRARY_IMPL(nanscan, NestedTensorCUDA, m) { nanscan::register_refusals(m); }
TORCH_LIBRARY_IMPL(nanscan, NestedTensorMeta, m) { nanscan::register_refusals(m); }
