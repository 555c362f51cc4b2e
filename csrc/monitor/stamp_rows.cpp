// nanscan::stamp_rows_ : the compiled path's one write per hook (nanscan/monitor/traced.py).
//
// Inside a torch.compile graph the monitor cannot run Python per record: each watched module owns
// consecutive rows of a device buffer, and a traced hook writes the records of its values there,
// stamped with a device counter (the order in which rows were written: several graphs, graph
// breaks and forwards per step). Written with tensor indexing, that was seven graph ops per value
// (select, slice, copy_, add_, slice, copy_ and the record), functionalized into slice_scatters of
// the whole buffer: the bulk of a watched model's compile time. As one mutating op it is one node
// per hook, and inductor writes in place.
//
//   stamp_rows_(buffer, counter, values, records, first_row, owner, labels):
//     records = records if given else nanscan::summarize_many(values)
//     n = records.size(0), R = records.size(1)
//     buffer[first_row + k, 0:R] = records[k]            k = 0 .. n-1
//     buffer[first_row + k, R]   = counter + k + 1
//     buffer[first_row + k, R+1] += 1                     (when C > R + 1: the row's writes)
//     counter += n
//
// buffer: [rows, C] with C > R, counter: [1], both float64 on records' device. The write count
// tells the monitor which rows were written more than once in a read window (a module called twice
// per forward, several forwards per read): only their last value is there. `records` is given
// when another backend than the default kernels summarizes, or when a value lives on another
// device. `owner` and `labels` are not used here: the fake kernel (nanscan/_ops.py) hands them,
// with the values' dtypes and shapes, to the monitor when the graph is traced -- the one moment
// Python runs -- so nothing else is noted per hook. The write is one pass on the CPU (below) and one
// launch on CUDA (csrc/cuda/stamp_rows.cu) -- as ATen ops it was 29 calls through the dispatcher and
// six launches a stamp, host time on every hook of a compiled step and six nodes of a CUDA graph;
// every other device (meta included) takes the ops (stamp_rows.h).
//
// nanscan::stamp : the same write, into the buffer and counter named for `owner` -- the op the
// monitor's traced hooks call. They are not arguments: a buffer the compiler sees mutated costs a
// functionalization per op at compile time (AOT autograd: about 10 ms each), and tensors a hook
// captures for the backward become inputs the forward graph saves, whose version autograd checks at
// the backward -- which a later graph's stamps (graph breaks, several compiled regions per step)
// have moved on, failing the backward. So the monitor names its buffer once (`set_stamp_target`),
// and the op, mutating nothing the compiler can see, is registered as effectful (nanscan/_ops.py:
// kept, and kept in order).
//
//   stamp(values, records, owner, first_row, labels)
//     = stamp_rows_(buffer[owner], counter[owner], values, records, first_row, owner, labels)
//   (records given: one row per value, or, values empty, per row of records)
//   (nothing when no buffer is named for owner: its monitor was closed; values on another device
//   than the buffer are summarized on theirs and their records copied to the buffer's)
//
// Note [stamps counted on the host]: each stamp also adds its number of rows to a host count of
// the owner's (stamp_count), read by the eager records of the same monitor (window.h, grad_sink.h)
// as they are made: an eager record made when the host count was h comes after the compiled rows
// stamped 1..h and before row h + 1 -- the order of eager hooks and compiled graphs in one forward
// (graph breaks, frames run eagerly), without a sync. It holds while every stamp's host code ran
// once for its device write (not for a CUDA graph's replay, which writes without the host): the
// monitor checks that the host count equals the largest sequence number read back, and says
// "cannot tell" where it does not (nanscan/monitor/read.py).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "../inputs.h"
#include "stamp_rows.h"

#include <atomic>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

namespace nanscan {

at::Tensor records_to_stamp(const at::Tensor& buffer, const at::Tensor& counter, at::TensorList values,
                            const c10::optional<at::Tensor>& given, int64_t first_row) {
  at::Tensor records;
  if (given.has_value() && given->defined()) {
    records = *given;
  } else {
    if (values.empty()) return at::Tensor();
    check_one_device(values, "nanscan.stamp_rows_");
    static auto many = c10::Dispatcher::singleton()
                           .findSchemaOrThrow("nanscan::summarize_many", "")
                           .typed<at::Tensor(at::TensorList)>();
    records = many.call(values);
  }
  TORCH_CHECK(buffer.dim() == 2 && records.dim() == 2,
              "nanscan.stamp_rows_: buffer and records must be 2-D, got ", buffer.sizes(), " and ", records.sizes());
  const int64_t n = records.size(0), width = records.size(1);
  TORCH_CHECK(buffer.size(1) > width, "nanscan.stamp_rows_: buffer has ", buffer.size(1),
              " columns; it needs the ", width, " record columns and one for the sequence number");
  TORCH_CHECK(first_row >= 0 && first_row + n <= buffer.size(0), "nanscan.stamp_rows_: rows ", first_row, "..",
              first_row + n, " are outside the buffer's ", buffer.size(0), " rows");
  TORCH_CHECK(counter.numel() == 1, "nanscan.stamp_rows_: counter must hold one value, got ", counter.sizes());
  TORCH_CHECK(buffer.device() == records.device() && counter.device() == records.device(),
              "nanscan.stamp_rows_: buffer, counter and records must be on one device, got ", buffer.device(), ", ",
              counter.device(), " and ", records.device());
  TORCH_CHECK(buffer.scalar_type() == records.scalar_type() && counter.scalar_type() == records.scalar_type(),
              "nanscan.stamp_rows_: buffer, counter and records must have one dtype, got ", buffer.scalar_type(), ", ",
              counter.scalar_type(), " and ", records.scalar_type());
  if (records.is_neg()) records = records.resolve_neg();  // (the kernels read memory as it is)
  return n == 0 ? at::Tensor() : records;
}

void write_rows_with_ops(at::Tensor& buffer, at::Tensor& counter, const at::Tensor& records, int64_t first_row) {
  const int64_t n = records.size(0), width = records.size(1);
  at::Tensor block = buffer.narrow(0, first_row, n);
  block.narrow(1, 0, width).copy_(records);
  block.select(1, width).copy_(at::arange(1, n + 1, counter.options()).add_(counter.reshape({1})));
  if (buffer.size(1) > width + 1) block.select(1, width + 1).add_(1);
  counter.add_(n);
}

void stamp_rows_with_ops(at::Tensor& buffer, at::Tensor& counter, at::TensorList values,
                         const c10::optional<at::Tensor>& given, int64_t first_row, int64_t /*owner*/,
                         c10::string_view /*labels*/) {
  const at::Tensor records = records_to_stamp(buffer, counter, values, given, first_row);
  if (records.defined()) write_rows_with_ops(buffer, counter, records, first_row);
}

namespace {
// The CPU kernel: the same write in one pass over the rows (a float64 buffer, the monitor's), where
// the ATen ops were 29 calls through the dispatcher a stamp.
void stamp_rows_cpu(at::Tensor& buffer, at::Tensor& counter, at::TensorList values,
                    const c10::optional<at::Tensor>& given, int64_t first_row, int64_t owner,
                    c10::string_view labels) {
  if (!buffer.is_cpu() || buffer.scalar_type() != at::kDouble) {
    return stamp_rows_with_ops(buffer, counter, values, given, first_row, owner, labels);
  }
  const at::Tensor records = records_to_stamp(buffer, counter, values, given, first_row);
  if (!records.defined()) return;
  const int64_t n = records.size(0), width = records.size(1);
  const int64_t bs0 = buffer.stride(0), bs1 = buffer.stride(1), rs0 = records.stride(0), rs1 = records.stride(1);
  const bool writes = buffer.size(1) > width + 1;  // (the column of the row's writes)
  double* b = buffer.data_ptr<double>() + first_row * bs0;
  const double* r = records.const_data_ptr<double>();
  double* c = counter.data_ptr<double>();
  const double base = *c;
  for (int64_t k = 0; k < n; ++k) {
    double* row = b + k * bs0;
    for (int64_t j = 0; j < width; ++j) row[j * bs1] = r[k * rs0 + j * rs1];
    row[width * bs1] = base + static_cast<double>(k + 1);
    if (writes) row[(width + 1) * bs1] += 1;
  }
  *c = base + static_cast<double>(n);
}
}  // namespace

using StampCount = std::shared_ptr<std::atomic<int64_t>>;  // Note [stamps counted on the host]

namespace {
struct Target {
  at::Tensor buffer, counter;
  StampCount stamped;
};
std::mutex targets_mutex;
std::unordered_map<int64_t, Target> targets;  // owner -> where its stamps write
std::unordered_map<int64_t, StampCount> counts;  // owner -> its host count (kept while its monitor is named or not)

StampCount count_locked(int64_t owner) {
  StampCount& cell = counts[owner];
  if (!cell) cell = std::make_shared<std::atomic<int64_t>>(0);
  return cell;
}
}  // namespace

// The host count of owner's stamped rows (Note [stamps counted on the host]); made on first use.
StampCount stamp_count(int64_t owner) {
  std::lock_guard<std::mutex> lock(targets_mutex);
  return count_locked(owner);
}

// Forget owner's host count (its monitor closed): an eager record that still follows the cell
// keeps it alive.
void drop_stamp_count(int64_t owner) {
  std::lock_guard<std::mutex> lock(targets_mutex);
  counts.erase(owner);
}

void set_stamp_target(int64_t owner, const c10::optional<at::Tensor>& buffer, const c10::optional<at::Tensor>& counter) {
  std::lock_guard<std::mutex> lock(targets_mutex);
  if (buffer.has_value() && buffer->defined() && counter.has_value() && counter->defined()) {
    targets[owner] = {*buffer, *counter, count_locked(owner)};
  } else {
    targets.erase(owner);
  }
}

void stamp(at::TensorList values, const c10::optional<at::Tensor>& records, int64_t owner, int64_t first_row,
           c10::string_view labels) {
  at::Tensor buffer, counter;
  StampCount stamped;
  {
    std::lock_guard<std::mutex> lock(targets_mutex);
    auto found = targets.find(owner);
    if (found == targets.end()) return;
    buffer = found->second.buffer;
    counter = found->second.counter;
    stamped = found->second.stamped;
  }
  c10::optional<at::Tensor> given;
  if (records.has_value() && records->defined()) {
    // Records given without their values (a compiled graph's stamp, Note [a stamp given its records
    // takes no values] in nanscan/kernels/stamp_pass.py): one row per row of records.
    TORCH_CHECK(!values.empty() || records->dim() == 2,
                "nanscan.stamp: records given without values must be [rows, columns], got ", records->sizes());
    given = values.empty() ? *records : records->reshape({static_cast<int64_t>(values.size()), -1});
    if (given->device() != buffer.device()) given = given->to(buffer.device());  // (no call where it is)
  } else {
    // A value on another device than the buffer (model parallelism): summarized where it lives,
    // its record copied over -- here rather than in the traced hook, whose every line dynamo traces.
    bool elsewhere = false;
    for (const at::Tensor& v : values) elsewhere = elsewhere || v.device() != buffer.device();
    if (elsewhere) {
      static auto one = c10::Dispatcher::singleton()
                            .findSchemaOrThrow("nanscan::summarize", "")
                            .typed<at::Tensor(const at::Tensor&)>();
      std::vector<at::Tensor> rows;
      rows.reserve(values.size());
      for (const at::Tensor& v : values) rows.push_back(one.call(v).to(buffer.device()).reshape({1, -1}));
      given = at::cat(rows);
    }
  }
  // Through the dispatcher: the buffer's device picks the kernel (one write on CPU and CUDA). Given
  // records, the values are not passed: nothing reads them, and a value on another device would
  // pick another kernel.
  static auto rows = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("nanscan::stamp_rows_", "")
                         .typed<void(at::Tensor&, at::Tensor&, at::TensorList, const c10::optional<at::Tensor>&,
                                     int64_t, int64_t, c10::string_view)>();
  rows.call(buffer, counter, given.has_value() ? at::TensorList() : values, given, first_row, owner, labels);
  // (as many rows as stamp_rows_ wrote: one per value, or per row of the given records)
  const int64_t n = given.has_value() ? given->size(0) : static_cast<int64_t>(values.size());
  stamped->fetch_add(n, std::memory_order_relaxed);
}

}  // namespace nanscan

TORCH_LIBRARY_IMPL(nanscan, CompositeExplicitAutograd, m) {
  m.impl("stamp_rows_", &nanscan::stamp_rows_with_ops);
  m.impl("stamp", &nanscan::stamp);
}

TORCH_LIBRARY_IMPL(nanscan, CPU, m) { m.impl("stamp_rows_", &nanscan::stamp_rows_cpu); }
