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
};

}  // namespace dbs

#endif  // DBS_COMMON_CALL_OBSERVER_H_
