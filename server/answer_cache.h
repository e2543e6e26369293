// AnswerCache: the step's parameters encoded for the answers that go over the socket, once per
// snapshot and shared by every answer of it. An update's values are encoded as the store
// produces them (UpdateSink), block by block while they are still in the cache; others (the first
// registration's, a restored checkpoint's) on first use. In fp32 on a little-endian machine the
// encoded values are the snapshot's own memory; in 16 bits they are encoded into a pooled buffer
// of their own. The service adapter turns them into gRPC slices (FieldOf) outside every lock of
// the store's. Thread-safe.
#ifndef DBS_SERVER_ANSWER_CACHE_H_
#define DBS_SERVER_ANSWER_CACHE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/byte_pool.h"
#include "common/step_wire.h"
#include "common/wire_values.h"
#include "server/parameter_store.h"

namespace dbs {

class AnswerCache : public UpdateSink {
 public:
  // The values travel in `wire_dtype` (the job's). `sharing` tells whether some worker reads its
  // answers from shared memory now (SharedMemoryHost::sharing).
  AnswerCache(WireDtype wire_dtype, std::function<bool()> sharing)
      : wire_dtype_(wire_dtype), sharing_(std::move(sharing)), pool_(BytePool::Create()) {}

  // `hook` (null: none) is called whenever an update lets go of the buffers kept for encoding
  // answers, because the last version's answers all went through shared memory. Set before use.
  void SetFreedMemoryHook(std::function<void()> hook) { freed_memory_hook_ = std::move(hook); }

  // `snapshot`'s values as the answers carry them.
  EncodedValues ValuesOf(const ParameterSnapshot& snapshot);
  // An answer that a worker asked for in shared memory went over the socket (its version was
  // not in the slots): the next update is encoded as it runs after all.
  void AnsweredOverSocket() { socket_answers_.store(true, std::memory_order_relaxed); }

  // UpdateSink: the store's update writes the new values into the next answers' encoding. Where
  // every answer of the last version came from the slots, it is not encoded as the update runs
  // (in 16 bits that is a pass over the model and a buffer of its own): an answer over the
  // socket after all encodes it on first use (ValuesOf).
  void BeginUpdate(int64_t version, std::shared_ptr<const ValueBuffer> after) override;
  void WriteUpdate(size_t offset, absl::Span<const float> values) override;
  void EndUpdate(bool ok, const ParameterSnapshot& snapshot) override;

 private:
  // `values` at `version` as the answers carry them. Where they travel as they lie in memory
  // (fp32, little-endian) they are `values` itself and `*encode_to` is null; otherwise they are
  // a pooled buffer that the values must be encoded to at `*encode_to`.
  EncodedValues NewEncoding(int64_t version, std::shared_ptr<const ValueBuffer> values,
                            uint8_t** encode_to);

  const WireDtype wire_dtype_;
  const std::function<bool()> sharing_;
  const std::shared_ptr<BytePool> pool_;
  std::function<void()> freed_memory_hook_;
  // Some push's answer since the last update began went over the socket (AnsweredOverSocket;
  // not a registration's or a pull's, which every worker makes before it shares memory).
  std::atomic<bool> socket_answers_{false};
  absl::Mutex mu_;
  ParameterSnapshot values_of_ ABSL_GUARDED_BY(mu_);  // what `values_` holds
  EncodedValues values_ ABSL_GUARDED_BY(mu_);
  // The update in progress: its encoding, and where its values are encoded to (none where the
  // encoding is the update's own buffer). Only the store's update touches them, one at a time.
  EncodedValues updating_;
  uint8_t* updating_values_ = nullptr;
};

}  // namespace dbs

#endif  // DBS_SERVER_ANSWER_CACHE_H_
