// The nanscan record: one fixed-size row of float64 per summarized tensor.
//
// Every backend (C++ CPU, C++/CUDA, Triton, pure-PyTorch reference) writes exactly this layout, and
// every higher layer reads only this layout (Python mirror: nanscan/record.py, keep them in step).
//
// Why float64 for everything: counts and indices are exact integers up to 2**53 in a double, which
// the design requires, min/max of every floating dtype (fp64 included) are representable, and one
// dtype lets a single small device tensor hold a whole record, so reading it is one copy.
//
// Raw conventions (the Python decoder turns them into None):
//   finite_min = +inf and finite_max = -inf when the tensor has no finite element;
//   first_nonfinite_index = -1 when every element is finite.
// sumsq is the sum of squares of the finite elements accumulated in FP32 for 8/16/32-bit floating
// inputs (FP64 for FP64 and integer inputs); it may be +inf from accumulation overflow.
#pragma once

#include <cstdint>
#include <limits>

#if defined(__CUDACC__)
#define NANSCAN_HD __host__ __device__ __forceinline__
#else
#define NANSCAN_HD inline
#endif

namespace nanscan {

enum RecordField : int {
  kNanCount = 0,
  kPosInfCount = 1,
  kNegInfCount = 2,
  kZeroCount = 3,
  kFiniteMin = 4,
  kFiniteMax = 5,
  kSumSq = 6,
  kFirstNonfinite = 7,
  kRecordSize = 8,
};

// "No non-finite element seen yet" while reducing; min() over partials keeps the earliest index.
constexpr int64_t kNoIndex = std::numeric_limits<int64_t>::max();

// A partial record while reducing. acc_t is the sum-of-squares accumulator (float or double);
// min/max are kept in double so that every input dtype is represented exactly.
template <typename acc_t>
struct Partial {
  int64_t nan = 0, posinf = 0, neginf = 0, zero = 0;
  double min = std::numeric_limits<double>::infinity();
  double max = -std::numeric_limits<double>::infinity();
  acc_t sumsq = 0;
  int64_t first = kNoIndex;

  // Combining is associative and, for everything but the floating sum, commutative; callers combine
  // partials in a fixed order so that sumsq is deterministic too.
  NANSCAN_HD void merge(const Partial& o) {
    nan += o.nan;
    posinf += o.posinf;
    neginf += o.neginf;
    zero += o.zero;
    min = o.min < min ? o.min : min;
    max = o.max > max ? o.max : max;
    sumsq += o.sumsq;
    first = o.first < first ? o.first : first;
  }

  NANSCAN_HD void write(double* out) const {
    out[kNanCount] = static_cast<double>(nan);
    out[kPosInfCount] = static_cast<double>(posinf);
    out[kNegInfCount] = static_cast<double>(neginf);
    out[kZeroCount] = static_cast<double>(zero);
    out[kFiniteMin] = min;
    out[kFiniteMax] = max;
    out[kSumSq] = static_cast<double>(sumsq);
    out[kFirstNonfinite] = first == kNoIndex ? -1.0 : static_cast<double>(first);
  }
};

}  // namespace nanscan
