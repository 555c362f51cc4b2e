// The parts of nanscan::stamp_rows_ (stamp_rows.cpp) that every device's kernel shares: the checks
// and the records to write, and the write as ATen ops (the devices with no kernel of their own).
// Its CPU and CUDA kernels (stamp_rows.cpp, csrc/cuda/stamp_rows.cu) write the rows in one pass.
#pragma once

#include <ATen/ATen.h>

namespace nanscan {

// The records stamp_rows_ writes -- `given`, else nanscan::summarize_many(values) -- after the
// checks (shapes, rows inside the buffer, one device, one dtype); undefined when there is nothing
// to write.
at::Tensor records_to_stamp(const at::Tensor& buffer, const at::Tensor& counter, at::TensorList values,
                            const c10::optional<at::Tensor>& given, int64_t first_row);

// buffer[first_row + k, :R] = records[k], [.., R] = counter + k + 1, [.., R + 1] += 1 (when the
// buffer has that column), counter += n, as ATen ops (six launches on a device).
void write_rows_with_ops(at::Tensor& buffer, at::Tensor& counter, const at::Tensor& records, int64_t first_row);

// stamp_rows_ on a device with no kernel of its own (meta, and any other), and the CPU / CUDA
// kernels' way for a buffer that is not theirs or not float64.
void stamp_rows_with_ops(at::Tensor& buffer, at::Tensor& counter, at::TensorList values,
                         const c10::optional<at::Tensor>& given, int64_t first_row, int64_t owner,
                         c10::string_view labels);

}  // namespace nanscan
