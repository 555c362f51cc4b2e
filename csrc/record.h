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
// sumsq, sum and sum4 are the sums of squares, of values and of fourth powers of the finite elements,
// accumulated in FP32 for 8/16/32-bit floating inputs (FP64 for FP64, integer and bool inputs), each
// in the same blocks of at most 256 terms per accumulator (the contract: docs/summarize.md#the-record).
// sumsq and sum4 may be +inf from accumulation overflow (an FP32 x**4 overflows above |x| ~ 4.3e9,
// x**2 above ~1.8e19); sum cannot overflow while sumsq does not (|sum| <= sqrt(n * sumsq)).
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
  kSum = 8,
  kSum4 = 9,
  kRecordSize = 10,
};

// "No non-finite element seen yet" while reducing; min() over partials keeps the earliest index.
constexpr int64_t kNoIndex = std::numeric_limits<int64_t>::max();

// A partial record while reducing. acc_t is the accumulator of the sums (float or double); min/max
// are kept in double so that every input dtype is represented exactly. 16-byte aligned: the CUDA merge
// reads partials as 16-byte vectors (80 bytes for either acc_t).
template <typename acc_t>
struct alignas(16) Partial {
  int64_t nan = 0, posinf = 0, neginf = 0, zero = 0;
  double min = std::numeric_limits<double>::infinity();
  double max = -std::numeric_limits<double>::infinity();
  int64_t first = kNoIndex;
  acc_t sumsq = 0, sum = 0, sum4 = 0;

  // Combining is associative and, for everything but the floating sums, commutative; callers combine
  // partials in a fixed order so that sumsq, sum and sum4 are deterministic too.
  NANSCAN_HD void merge(const Partial& o) {
    nan += o.nan;
    posinf += o.posinf;
    neginf += o.neginf;
    zero += o.zero;
    min = o.min < min ? o.min : min;
    max = o.max > max ? o.max : max;
    sumsq += o.sumsq;
    sum += o.sum;
    sum4 += o.sum4;
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
    out[kSum] = static_cast<double>(sum);
    out[kSum4] = static_cast<double>(sum4);
  }
};

}  // namespace nanscan
