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
#include <c10/util/Exception.h>

namespace nanscan {

inline bool is_supported_real_dtype(at::ScalarType t) {
  switch (t) {
    case at::kDouble: case at::kFloat: case at::kHalf: case at::kBFloat16:
    case at::kFloat8_e4m3fn: case at::kFloat8_e5m2:
    case at::kFloat8_e4m3fnuz: case at::kFloat8_e5m2fnuz:
    case at::kBool: case at::kByte: case at::kChar: case at::kShort: case at::kInt: case at::kLong:
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
  at::Tensor t = x.is_complex() ? at::view_as_real(x.resolve_conj().resolve_neg()) : x.resolve_neg();
  TORCH_CHECK_TYPE(is_supported_real_dtype(t.scalar_type()), op, ": dtype ", x.scalar_type(),
                   " is not supported (", kSupportedText, ")");
  return t;
}

}  // namespace nanscan
