// What a read does in C++ over the host copy of its records: dtype maxima, rows near overflow,
// non-finite rows.
// (Part of the module csrc/monitor/module.cpp builds: one translation unit.)
#pragma once

#include "grad_sink.h"

#include <cmath>
#include <vector>

namespace nanscan {

// Per tensor, its dtype's largest finite value (NaN if not floating): the headroom check's maxima
// for blocks of parameters, gradients and buffers, without a Python loop over them.
inline at::Tensor tensor_dtype_maxima(const std::vector<at::Tensor>& tensors) {
  at::Tensor out = at::empty({static_cast<int64_t>(tensors.size())}, at::kDouble);
  double* maxima = out.data_ptr<double>();
  for (size_t k = 0; k < tensors.size(); ++k) maxima[k] = dtype_max(tensors[k].scalar_type());
  return out;
}

// The headroom check's candidates (nanscan/monitor/headroom.py): rows i < n of the landed records
// whose largest finite magnitude amax = max(|finite_min|, |finite_max|) is within `bits` of the
// limit -- maxima[i] (NaN: unknown, skipped), float16's 65504 instead of float32's max when
// `fp16_cast`, and at most `cast_floor` (a declared cast's max; +inf when none):
// log2(limit / amax) < bits. Rows with no finite or no non-zero value are not candidates.
inline std::vector<int64_t> headroom_candidates(const at::Tensor& host, const at::Tensor& maxima, int64_t n, double bits,
                                         bool fp16_cast, double cast_floor) {
  TORCH_CHECK(host.device().is_cpu() && host.scalar_type() == at::kDouble && host.dim() == 2 &&
                  host.size(1) >= kRecordSize && n <= host.size(0) && maxima.scalar_type() == at::kDouble &&
                  maxima.numel() >= n,
              "nanscan: headroom_candidates expects [rows >= n, >= ", kRecordSize,
              "] float64 host records and n float64 maxima");
  const at::Tensor rows = host.contiguous();
  const at::Tensor limits = maxima.contiguous();
  const double* data = rows.const_data_ptr<double>();
  const double* maxes = limits.const_data_ptr<double>();
  const int64_t width = rows.size(1);
  const double fp32_max = std::numeric_limits<float>::max();
  const double fp16_max = static_cast<double>(std::numeric_limits<c10::Half>::max());
  const double scale = std::exp2(bits);
  std::vector<int64_t> out;
  for (int64_t i = 0; i < n; ++i) {
    const double* r = data + i * width;
    const double amax = std::max(std::fabs(r[kFiniteMin]), std::fabs(r[kFiniteMax]));
    double limit = maxes[i];
    if (!(amax > 0) || !std::isfinite(amax) || std::isnan(limit)) continue;
    if (fp16_cast && limit == fp32_max) limit = fp16_max;
    limit = std::min(limit, cast_floor);
    if (amax * scale > limit) out.push_back(i);  // log2(limit / amax) < bits
  }
  return out;
}

// A record row (its first three fields: the NaN / +Inf / -Inf counts) holds a non-finite element:
// the one test of a row, wherever a read makes it (here, LeanRead in lean_read.h).
inline bool nonfinite_row(const double* r) { return r[0] + r[1] + r[2] > 0; }

// Rows i < n of a landed read ([rows, columns] float64 on the host) holding a NaN / +Inf / -Inf
// count: the rows a read decodes. (One pass in C++ instead of four tensor ops per read.)
inline std::vector<int64_t> nonfinite_rows(const at::Tensor& host, int64_t n) {
  TORCH_CHECK(host.device().is_cpu() && host.scalar_type() == at::kDouble && host.dim() == 2 &&
                  host.size(1) >= 3 && n <= host.size(0),
              "nanscan: nonfinite_rows expects [rows >= n, >= 3] float64 host records");
  const at::Tensor rows = host.contiguous();
  const double* data = rows.const_data_ptr<double>();
  const int64_t width = rows.size(1);
  std::vector<int64_t> out;
  for (int64_t i = 0; i < n; ++i) {
    if (nonfinite_row(data + i * width)) out.push_back(i);
  }
  return out;
}

// The rows of a read's record blocks ([k, >= 3] float64 each, counted across the blocks in order)
// holding a NaN / +Inf / -Inf count, or None where a block is not on the host (a device read is
// decided on its device). One call a read: a Python loop over the blocks cost a call, an attribute
// and a shape per block, most of a clean CPU read's decision beside a large model.
inline py::object nonfinite_in_blocks(const std::vector<at::Tensor>& blocks) {
  for (const auto& b : blocks) {
    if (!b.device().is_cpu()) return py::none();
  }
  std::vector<int64_t> out;
  int64_t start = 0;
  for (const auto& b : blocks) {
    const int64_t n = b.dim() == 2 ? b.size(0) : 0;  // (nonfinite_rows names what else was wrong)
    for (int64_t i : nonfinite_rows(b, n)) out.push_back(start + i);
    start += n;
  }
  return py::cast(out);
}

}  // namespace nanscan
