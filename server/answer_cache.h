// AnswerCache: the step's parameters serialized for the answers that go over gRPC, once per
// snapshot and shared by every answer of it. An update's values are serialized as the store
// produces them (UpdateSink), block by block while they are still in the cache; others (the first
// registration's, a restored checkpoint's) on first use. In fp32 on a little-endian machine the
// field's values are the snapshot's own memory and only its head is written; in 16 bits they are
// encoded into a pooled buffer of their own. Thread-safe.
#ifndef DBS_SERVER_ANSWER_CACHE_H_
#define DBS_SERVER_ANSWER_CACHE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/rpc/grpc_step_wire.h"
#include "common/wire_values.h"
#include "server/parameter_store.h"

namespace dbs {

class AnswerCache : public UpdateSink {
 public:
  // The values travel in `wire_dtype` (the job's). `sharing` tells whether some worker reads its
  // answers from shared memory now (SharedMemoryHost::sharing).
  AnswerCache(WireDtype wire_dtype, std::function<bool()> sharing)
      : wire_dtype_(wire_dtype), sharing_(std::move(sharing)), pool_(SlicePool::Create()) {}

  // `hook` (null: none) is called whenever an update lets go of the buffers kept for encoding
  // answers, because the last version's answers all went through shared memory. Set before use.
  void SetFreedMemoryHook(std::function<void()> hook) { freed_memory_hook_ = std::move(hook); }

  // The field that carries `snapshot`'s values.
  ValuesField ValuesOf(const ParameterSnapshot& snapshot);
  // An answer that a worker asked for in shared memory went over gRPC (its version was not in
  // the slots): the next update is serialized as it runs after all.
  void AnsweredOverGrpc() { grpc_answers_.store(true, std::memory_order_relaxed); }

  // UpdateSink: the store's update writes the new values into the next answers' field. Where
  // every answer of the last version came from the slots, it is not serialized as the update
  // runs (in 16 bits that is a pass over the model and a buffer of its own): an answer over gRPC
  // after all serializes it on first use (ValuesOf).
  void BeginUpdate(int64_t version, std::shared_ptr<const ValueBuffer> after) override;
  void WriteUpdate(size_t offset, absl::Span<const float> values) override;
  void EndUpdate(bool ok, const ParameterSnapshot& snapshot) override;

 private:
  // A field for `values` at `version`, its head written. Where the values travel as they lie in
  // memory (fp32, little-endian) its body is `values` itself and `*encode_to` is null;
  // otherwise the body is a pooled buffer that the values must be encoded to at `*encode_to`.
  ValuesField NewField(int64_t version, std::shared_ptr<const ValueBuffer> values,
                       uint8_t** encode_to);
  // Lets go of the cached field, before the next one is written.
  void ReleaseLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const WireDtype wire_dtype_;
  const std::function<bool()> sharing_;
  const std::shared_ptr<SlicePool> pool_;
  std::function<void()> freed_memory_hook_;
  // Some push's answer since the last update began went over gRPC (AnsweredOverGrpc; not a
  // registration's or a pull's, which every worker makes before it shares memory).
  std::atomic<bool> grpc_answers_{false};
  absl::Mutex mu_;
  ParameterSnapshot values_of_ ABSL_GUARDED_BY(mu_);  // what `values_` holds
  ValuesField values_ ABSL_GUARDED_BY(mu_);
  // The update in progress: its field, and where its values are encoded to (none where the
  // field's body is the update's own buffer). Only the store's update touches them, one at a
  // time.
  ValuesField updating_;
  uint8_t* updating_values_ = nullptr;
};

}  // namespace dbs

#endif  // DBS_SERVER_ANSWER_CACHE_H_
