// CallObserver: what a service adapter reports about every call it answers (for metrics).
#ifndef DBS_COMMON_CALL_OBSERVER_H_
#define DBS_COMMON_CALL_OBSERVER_H_

#include <cstddef>

namespace dbs {

class CallObserver {
 public:
  virtual ~CallObserver() = default;
  // `method`: its name; `received`/`sent`: request and reply bytes; `code`: the gRPC status
  // code it ended with (0: OK). Thread-safe.
  virtual void OnCall(const char* method, size_t received, size_t sent, int code) = 0;
  // The parameter service's shared memory (docs/dataplane.md#shared-memory): how many workers
  // push through it now, after each attach or removal; and each answer a sharing worker asked
  // for in shared memory that went over gRPC instead (its version was not in the slots).
  virtual void OnSharedMemoryWorkers(int workers) {}
  virtual void OnSharedAnswerOverGrpc() {}
};

}  // namespace dbs

#endif  // DBS_COMMON_CALL_OBSERVER_H_
