// One read window: entries in production order, their records summarized in batches of one
// device and one stream.
// (Part of the module csrc/monitor/module.cpp builds: one translation unit.)
#pragma once

#include "rows.h"
#include "streams.h"

#include <c10/util/flat_hash_map.h>

#include <vector>

namespace nanscan {

// One read window: the entries in production order and their records, summarized in batches
// (see nanscan/monitor/slots.py for why batches are safe: version counters mark a record stale).
class Window {
 public:
  Window(py::object make_rows, py::object summarize, py::object on_stale, int64_t n_infos, int64_t batch,
         int64_t batch_bytes)
      : make_rows_(std::move(make_rows)),
        summarize_(summarize.is_none() ? py::object() : std::move(summarize)), on_stale_(std::move(on_stale)),
        n_infos_(n_infos), batch_(batch < 1 ? 1 : batch), batch_bytes_(batch_bytes), default_kernels_(!summarize_) {
    rows_.last_frame.assign(n_infos_, -1);
  }

  int64_t generation = 0;
  std::shared_ptr<std::vector<uint8_t>> eager;  // per module: never batch its records (set by Hooks)
  Rows rows_;

  int64_t size() const { return static_cast<int64_t>(object_of_.size()); }

  // Mark every entry from now on with the compiled path's host count of `stamped` (Note [stamps
  // counted on the host], stamp_rows.cpp).
  void follow_stamps(StampCount stamped) { marks_.follow(std::move(stamped)); }

  // The marks of the entries of the last take(): int64 pairs (first entry, host count), as bytes.
  py::bytes taken_marks() const { return marks_.taken(); }

  int64_t add_py(const at::Tensor& t, py::object slot) {
    marks_.note(size());
    const bool now = before_add(t);
    object_of_.push_back(static_cast<int32_t>(PyList_GET_SIZE(objects_.ptr())));
    objects_.append(std::move(slot));
    rows_.row_of.push_back(-1);
    return after_add(t, now);
  }

  int64_t add_row(const at::Tensor& t, const Row& row) {
    marks_.note(size());
    const bool now = before_add(t);
    object_of_.push_back(-1);
    rows_.row_of.push_back(static_cast<int32_t>(rows_.rows.size()));
    rows_.rows.push_back(row);
    return after_add(t, now);
  }

  void add_block(const at::Tensor& records, py::object block, int64_t n) {
    if (n <= 0) return;
    marks_.note(size());
    flush();
    host_.seal_into(blocks_);  // (the records before the block's, in order)
    block.attr("start") = size();
    blocks_.push_back(records);
    const int32_t object = static_cast<int32_t>(PyList_GET_SIZE(objects_.ptr()));
    objects_.append(std::move(block));
    for (int64_t k = 0; k < n; ++k) {
      object_of_.push_back(object);
      rows_.row_of.push_back(-1);
    }
  }

  void flush() {
    if (queued_.empty()) return;
    int64_t first = size() - static_cast<int64_t>(queued_.size());
    for (size_t k = 0; k < queued_.size(); ++k) {
      // Changed in place since its hook: the record would be of a later value.
      if (versions_[k] >= 0 && version_of(queued_[k]) != versions_[k]) {
        int64_t entry = first + static_cast<int64_t>(k);
        int32_t r = rows_.row_of[entry];
        if (r >= 0) {
          rows_.rows[r].stale = true;
          if (eager && rows_.rows[r].info >= 0) (*eager)[rows_.rows[r].info] = 1;
        } else {
          py::object slot = objects_[object_of_[entry]];
          slot.attr("stale") = true;
          if (!on_stale_.is_none()) on_stale_(slot);
        }
      }
    }
    at::Tensor block;
    if (run_on(stream_, block, [&] { return summarize_many_with(summarize_, queued_); })) {
      side_.note(stream_, block);
    }
    blocks_.push_back(std::move(block));
    queued_.clear();
    versions_.clear();
    bytes_ = 0;
  }

  // What take() hands over, before any Python object is made of it (LeanRead, lean_read.h,
  // drops a clean read's without making one).
  struct Taken {
    py::list objects;                // the window's Python objects (objects_)
    std::vector<int32_t> object_of;  // per entry (object_of_)
    std::vector<at::Tensor> blocks;  // [k, RECORD_SIZE] records, in order
    std::shared_ptr<Rows> rows;      // null: no C++ row
  };

  Taken take_parts() {
    flush();
    host_.seal_into(blocks_);
    if (!side_.empty()) side_.join_into_current();  // (the read's stream: the current one now)
    Taken taken;
    taken.objects = std::move(objects_);
    objects_ = py::list();
    taken.object_of.swap(object_of_);
    object_of_.reserve(taken.object_of.size());
    marks_.take();
    auto rows = std::make_shared<Rows>(std::move(rows_));
    rows_ = Rows();
    rows_.reserve_like(*rows, n_infos_);
    if (!rows->rows.empty()) taken.rows = std::move(rows);
    known_.clear();
    has_device_ = false;
    ++generation;
    taken.blocks.swap(blocks_);
    blocks_.reserve(taken.blocks.size());
    return taken;
  }

  // `taken` as take() returns it.
  py::tuple to_python(Taken&& taken) const {
    py::object proxy = taken.rows ? make_rows_(std::move(taken.rows)) : py::object(py::none());
    // The entries in order: a C++ row's is the rows' proxy (the rows know which row it is).
    const Py_ssize_t n = static_cast<Py_ssize_t>(taken.object_of.size());
    py::list entries(n);
    for (Py_ssize_t i = 0; i < n; ++i) {
      const int32_t k = taken.object_of[i];
      PyObject* entry = k >= 0 ? PyList_GET_ITEM(taken.objects.ptr(), k) : proxy.ptr();
      Py_INCREF(entry);
      PyList_SET_ITEM(entries.ptr(), i, entry);  // (steals the reference)
    }
    // The blocks as they are: the read stacks them with its other records in one cat (Copy.start).
    py::list records;
    for (auto& b : taken.blocks) records.append(py::cast(std::move(b)));
    return py::make_tuple(entries, records, proxy);
  }

  py::tuple take() { return to_python(take_parts()); }

  // The entry a live tensor was recorded at in this window (same object, same version), or -1.
  int32_t lookup(const at::Tensor& t) const {
    auto it = known_.find(t.unsafeGetTensorImpl());
    if (it == known_.end() || it->second.ref.expired()) {
      // A full alias of a recorded tensor (x.view_as(x): DTensor.from_local, which tensor
      // parallelism applies to module inputs) holds the same values: the same record.
      if (is_view(t)) {
        const at::Tensor base(t._base());
        if (base.defined() && base.sizes() == t.sizes() && base.strides() == t.strides() &&
            base.storage_offset() == t.storage_offset() && base.scalar_type() == t.scalar_type()) {
          return lookup(base);
        }
      }
      return -1;
    }
    const Known& k = it->second;
    if (k.version >= 0 && version_of(t) != k.version) return -1;
    return k.entry;
  }

  void remember(const at::Tensor& t, int32_t entry) {
    Known known{c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>(t.getIntrusivePtr()), version_of(t),
                entry};
    known_.insert_or_assign(t.unsafeGetTensorImpl(), std::move(known));
  }

 private:
  // Whether t is summarized on arrival (grad_sink.h: a CPU tensor with the default kernels) or
  // queued; the records before its own are put in order first (at most one of host_ and queued_
  // holds rows).
  bool before_add(const at::Tensor& t) {
    if (summarized_on_arrival(t, default_kernels_)) {
      flush();
      return true;
    }
    host_.seal_into(blocks_);
    // One device and one stream per batch (Note [streams of queued tensors], streams.h).
    const c10::Stream stream = current_stream(t.device());
    if (has_device_ && (t.device() != device_ || stream != stream_)) flush();
    device_ = t.device();
    stream_ = stream;
    has_device_ = true;
    return false;
  }

  int64_t after_add(const at::Tensor& t, bool now) {
    int64_t entry = size() - 1;
    if (now) {  // (never stale: summarized as it is when recorded)
      host_.add(t);
      return entry;
    }
    queued_.push_back(t);
    if (t.is_inference()) {  // no version counter to check: summarize it now
      versions_.push_back(-1);
      flush();
      return entry;
    }
    versions_.push_back(version_of(t));
    bytes_ += bytes_of(t);
    // (Note [a batch bounded by what only it keeps alive], grad_sink.h)
    if (static_cast<int64_t>(queued_.size()) >= batch_ ||
        over_bound(queued_, bytes_, batch_bytes_)) {
      flush();
    }
    return entry;
  }

  StampMarks marks_;
  py::object make_rows_, summarize_, on_stale_;
  int64_t n_infos_, batch_, batch_bytes_;
  bool default_kernels_;
  HostRows host_;  // records made on arrival, not yet sealed into a block
  // The entries, in production order: entry i is a C++ row (object_of_[i] < 0; rows_.row_of[i] says
  // which) or the Python object objects_[object_of_[i]] -- a slot, or a block (all of its entries).
  // Only a read that walks the entries makes a list of them (to_python): a clean read, taken and
  // dropped in C++, then releases a few objects, not a reference per entry fetched cold.
  py::list objects_;
  std::vector<int32_t> object_of_;
  // (Open addressing: no node allocated per recorded tensor; clear() keeps the slots for the next window.)
  ska::flat_hash_map<c10::TensorImpl*, Known> known_;
  std::vector<at::Tensor> queued_, blocks_;
  std::vector<int64_t> versions_;
  int64_t bytes_ = 0;
  c10::Device device_{c10::kCPU};
  c10::Stream stream_{c10::Stream::DEFAULT, c10::Device(c10::kCPU)};  // (of every queued tensor)
  SideStreams side_;  // (streams other than the reader's that summarized blocks since the last take)
  bool has_device_ = false;
};

}  // namespace nanscan
