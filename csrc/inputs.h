// Input validation and normalization shared by the C++ CPU and CUDA backends.
//
// Accepted: strided (dense) tensors of every floating dtype (fp64, fp32, fp16, bf16, the float8
// formats), integer and bool dtypes (finite by definition), and complex dtypes, which are summarized
// as torch.view_as_real(x): each real and imaginary part is one element of the record.
// Rejected with TypeError: sparse / mkldnn / other layouts, nested and quantized tensors, and dtypes
// outside that list (e.g. the barebones uint16/uint32/uint64, bits types).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/view_as_real.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e4m3fnuz.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Float8_e5m2fnuz.h>
#include <c10/util/Half.h>
#include <c10/util/MaybeOwned.h>

#include <cstdint>

// The real dtypes the kernels read, as (ScalarType enumerator, C++ element type): the one list that
// validation (below) and the CPU and CUDA dispatch switches expand, so a dtype is added in one place.
// (Complex tensors arrive as their real views. The Python reference keeps its own set, checked
// against this one over every torch dtype by tests/test_summarize.py.)
#define NANSCAN_FORALL_REAL_DTYPES(_)                                                               \
  _(kDouble, double) _(kFloat, float) _(kHalf, c10::Half) _(kBFloat16, c10::BFloat16)               \
  _(kFloat8_e4m3fn, c10::Float8_e4m3fn) _(kFloat8_e5m2, c10::Float8_e5m2)                           \
  _(kFloat8_e4m3fnuz, c10::Float8_e4m3fnuz) _(kFloat8_e5m2fnuz, c10::Float8_e5m2fnuz)               \
  _(kBool, bool) _(kByte, uint8_t) _(kChar, int8_t) _(kShort, int16_t) _(kInt, int32_t) _(kLong, int64_t)

namespace nanscan {

inline bool is_supported_real_dtype(at::ScalarType t) {
  switch (t) {
#define NANSCAN_SUPPORTED_CASE(enum_type, cpp_type) case at::enum_type:
    NANSCAN_FORALL_REAL_DTYPES(NANSCAN_SUPPORTED_CASE)
#undef NANSCAN_SUPPORTED_CASE
      return true;
    default:
      return false;
  }
}

constexpr const char* kSupportedText =
    "supported: float64, float32, float16, bfloat16, float8_e4m3fn, float8_e5m2, float8_e4m3fnuz, "
    "float8_e5m2fnuz, bool, uint8, int8, int16, int32, int64, complex64, complex128, complex32, "
    "as dense strided tensors";

// Returns the tensor the kernels actually read: x itself, or view_as_real(x) for complex x.
// Copies only a lazily conjugated / negated view (x.conj(), x.conj().imag), which has no real view.
inline at::Tensor normalize_input(const at::Tensor& x, const char* op) {
  TORCH_CHECK_TYPE(x.defined(), op, ": got an undefined tensor");
  TORCH_CHECK_TYPE(!x.is_nested(), op, ": nested tensors are not supported (",
                   kSupportedText, "); summarize each component with .unbind()");
  TORCH_CHECK_TYPE(!x.is_quantized(), op, ": quantized tensors (dtype ", x.scalar_type(),
                   ") are not supported (", kSupportedText, "); dequantize first");
  TORCH_CHECK_TYPE(x.layout() == at::kStrided, op, ": layout ", x.layout(),
                   " is not supported (", kSupportedText, "); convert with .to_dense()");
  // (is_neg() first: resolve_neg is a dispatcher call even when there is nothing to resolve, and
  // summarize_many makes one per tensor.)
  at::Tensor t = x.is_complex() ? at::view_as_real(x.resolve_conj().resolve_neg()) : (x.is_neg() ? x.resolve_neg() : x);
  TORCH_CHECK_TYPE(is_supported_real_dtype(t.scalar_type()), op, ": dtype ", x.scalar_type(),
                   " is not supported (", kSupportedText, ")");
  return t;
}

// All tensors of a list on one device, checked before anything else reads them. Why every op
// checks for itself: the dispatcher sends the whole list to one device's kernel (cpu + cuda to the
// CUDA kernel, cpu + meta to the fake kernel, which has no values to read), and the Python API
// hands lists straight to the ops. (Undefined tensors are left to normalize_input's refusal.)
inline void check_one_device(at::TensorList xs, const char* op) {
  const at::Tensor* first = nullptr;
  size_t first_at = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    if (!xs[i].defined()) continue;
    if (first == nullptr) {
      first = &xs[i];
      first_at = i;
      continue;
    }
    TORCH_CHECK_VALUE(xs[i].device() == first->device(), op, ": all tensors must be on one device, but xs[", i,
                      "] is on ", xs[i].device(), " and xs[", first_at, "] on ", first->device(),
                      "; summarize each device's tensors in a call of their own");
  }
}

// normalize_input without a copy of the handle when x is read as it is (every real tensor that is
// not a lazily negated view): the per-tensor path of summarize_many over a model's parameters,
// where a Tensor copy is two atomic reference-count updates per tensor per call.
inline c10::MaybeOwned<at::Tensor> normalized_input(const at::Tensor& x, const char* op) {
  if (x.defined() && !x.is_complex() && x.layout() == at::kStrided && !x.is_nested() && !x.is_quantized() &&
      !x.is_neg() && is_supported_real_dtype(x.scalar_type())) {
    return c10::MaybeOwned<at::Tensor>::borrowed(x);
  }
  return c10::MaybeOwned<at::Tensor>::owned(normalize_input(x, op));
}

}  // namespace nanscan
