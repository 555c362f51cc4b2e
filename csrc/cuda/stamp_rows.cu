// nanscan CUDA backend: the CUDA-key kernel of nanscan::stamp_rows_ (csrc/monitor/stamp_rows.cpp),
// the compiled path's one write per hook. The records (given, or nanscan::summarize_many of the
// values) are written into their rows, each stamped with the device counter, in ONE launch: as
// ATen ops the write was six (a copy of the records, an arange, an add, a copy of the stamps, the
// writes' add, the counter's add) -- host time on every stamp, and six nodes of a CUDA graph where
// the step is captured (torch.compile(mode="reduce-overhead")).
//
// One block: a stamp writes a few rows (one per value of one hook: tens of doubles each). Every
// thread reads the counter before any thread writes it (the block's barrier), so each row's stamp
// is counter + k + 1 as the ATen ops made it, and the counter moves on by n once.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../monitor/stamp_rows.h"

namespace nanscan {
namespace {

constexpr int kStampThreads = 256;

// buffer rows [0, n) (buffer points at first_row): columns [0, width) from records, column width
// the stamp, column width + 1 (when `writes`) the row's write count + 1; then counter += n.
__global__ void stamp_rows_kernel(double* __restrict__ buffer, int64_t bs0, int64_t bs1,
                                  const double* __restrict__ records, int64_t rs0, int64_t rs1,
                                  double* __restrict__ counter, int64_t n, int64_t width, bool writes) {
  const double base = *counter;
  const int64_t columns = width + 1 + (writes ? 1 : 0);
  for (int64_t i = threadIdx.x; i < n * columns; i += blockDim.x) {
    const int64_t k = i / columns, j = i - k * columns;
    double* cell = buffer + k * bs0 + j * bs1;
    if (j < width) *cell = records[k * rs0 + j * rs1];
    else if (j == width) *cell = base + static_cast<double>(k + 1);
    else *cell += 1.0;
  }
  __syncthreads();  // (every thread has read the counter)
  if (threadIdx.x == 0) *counter = base + static_cast<double>(n);
}

void stamp_rows_cuda(at::Tensor& buffer, at::Tensor& counter, at::TensorList values,
                     const c10::optional<at::Tensor>& given, int64_t first_row, int64_t owner,
                     c10::string_view labels) {
  // (the dispatcher sends a call here when any of its tensors is on a CUDA device: a buffer
  // elsewhere, or not float64, is written as the other devices write it, after the same checks)
  if (!buffer.is_cuda() || buffer.scalar_type() != at::kDouble) {
    return stamp_rows_with_ops(buffer, counter, values, given, first_row, owner, labels);
  }
  const c10::cuda::CUDAGuard guard(buffer.device());
  const at::Tensor records = records_to_stamp(buffer, counter, values, given, first_row);
  if (!records.defined()) return;
  const int64_t n = records.size(0), width = records.size(1);
  const bool writes = buffer.size(1) > width + 1;
  double* rows = buffer.data_ptr<double>() + first_row * buffer.stride(0);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(buffer.device().index());
  stamp_rows_kernel<<<1, kStampThreads, 0, stream>>>(rows, buffer.stride(0), buffer.stride(1),
                                                     records.const_data_ptr<double>(), records.stride(0),
                                                     records.stride(1), counter.data_ptr<double>(), n, width,
                                                     writes);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace
}  // namespace nanscan

TORCH_LIBRARY_IMPL(nanscan, CUDA, m) { m.impl("stamp_rows_", &nanscan::stamp_rows_cuda); }
