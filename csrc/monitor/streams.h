// The streams of queued device tensors. Header-only; included by grad_sink.h (and so by every part of the module).
//
// Note [streams of queued tensors]
// A device tensor is queued at its hook and summarized later, in a batch of up to 64 (one launch).
// Its producer ran on the stream that was current when the hook ran. Summarizing the batch on
// whatever stream is current when the batch fills (or when the read comes) is right only when that
// stream is ordered after every producer in it: one stream for the step, or side streams the
// program joined first. A module run on a side stream the program has not joined yet -- the batch
// fills inside another stream's `with torch.cuda.stream(...)`, or a side branch the program joins
// only later -- would be read before it is written: a record of stale memory, a silent wrong answer.
// So each batch belongs to one stream: a tensor that arrives on another stream (or device) flushes
// the batch first, and a batch is summarized on its own stream (a StreamGuard, only when that is not
// the current one), so the kernel runs after every producer in it. The read then joins each side
// stream that summarized a block into the stream it reads on (an event recorded there, waited on by
// the reader) and marks the block's memory as used on the reader's stream (record_stream), before it
// stacks the blocks. The one-stream path pays one current-stream lookup per queued tensor and one
// comparison; no guard, no event.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <ATen/ATen.h>

#include <algorithm>
#include <vector>

namespace nanscan {

inline c10::Stream current_stream(const c10::Device& device) {
  return c10::impl::getDeviceGuardImpl(device.type())->getStream(device);
}

// Summarize `fn()` on `stream`: under a guard only when `stream` is not the current one. Returns
// whether a guard was needed (the result then lives on a side stream the read must join).
template <typename Fn>
inline bool run_on(const c10::Stream& stream, at::Tensor& out, Fn&& fn) {
  if (stream.device_type() == c10::DeviceType::CPU || current_stream(stream.device()) == stream) {
    out = fn();
    return false;
  }
  c10::StreamGuard guard(stream);
  out = fn();
  return true;
}

// The side streams that summarized blocks since the last read, joined into the reader's stream.
class SideStreams {
 public:
  void note(const c10::Stream& stream, const at::Tensor& block) {
    if (std::find(streams_.begin(), streams_.end(), stream) == streams_.end()) streams_.push_back(stream);
    blocks_.push_back(block);
  }

  bool empty() const { return streams_.empty(); }

  // Called by the read, on the stream it reads on, before the blocks are used.
  void join_into_current() {
    for (const auto& side : streams_) {
      const c10::Stream reader = current_stream(side.device());
      if (reader == side) continue;
      c10::Event done(side.device_type());
      done.record(side);
      done.block(reader);
    }
    for (auto& block : blocks_) {
      const c10::Stream reader = current_stream(block.device());
      block.record_stream(reader);
    }
    streams_.clear();
    blocks_.clear();
  }

 private:
  std::vector<c10::Stream> streams_;
  std::vector<at::Tensor> blocks_;  // (made on a side stream: used on the reader's)
};

}  // namespace nanscan
