// Happens-before edges that gRPC guarantees but ThreadSanitizer cannot see.
//
// gRPC's callback API orders a reactor's operations and reactions (an operation started
// happens before its reaction; every reaction happens before OnDone) through completion queues
// and reference counts inside the uninstrumented libgrpc and libgrpc++. Under TSan
// (--config=tsan) a reactor says so itself: derive it from tsan::Reactor<gRPC's reactor> (its
// StartRead, StartWrite and Finish publish what came before them) and open each reaction
// (OnReadDone, OnWriteDone, OnCancel, OnDone) with `const auto reacting = Reacting();`. Without
// TSan all of it compiles to nothing.
#ifndef DBS_COMMON_TSAN_H_
#define DBS_COMMON_TSAN_H_

#if defined(__SANITIZE_THREAD__)
#include <sanitizer/tsan_interface.h>
#endif

namespace dbs::tsan {

inline void Release(const void* addr) {
#if defined(__SANITIZE_THREAD__)
  __tsan_release(const_cast<void*>(addr));
#else
  (void)addr;
#endif
}

inline void Acquire(const void* addr) {
#if defined(__SANITIZE_THREAD__)
  __tsan_acquire(const_cast<void*>(addr));
#else
  (void)addr;
#endif
}

// Acquires on entry to a reaction and releases on its exit.
class ReactionScope {
 public:
  explicit ReactionScope(const void* key) : key_(key) { Acquire(key_); }
  ~ReactionScope() { Release(key_); }
  ReactionScope(const ReactionScope&) = delete;
  ReactionScope& operator=(const ReactionScope&) = delete;

 private:
  const void* const key_;
};

template <typename Base>
class Reactor : public Base {
 public:
  template <typename... Args>
  void StartRead(Args&&... args) {
    Release(Key());
    Base::StartRead(static_cast<Args&&>(args)...);
  }
  template <typename... Args>
  void StartWrite(Args&&... args) {
    Release(Key());
    Base::StartWrite(static_cast<Args&&>(args)...);
  }
  template <typename... Args>
  void Finish(Args&&... args) {
    Release(Key());
    Base::Finish(static_cast<Args&&>(args)...);
  }

 protected:
  ReactionScope Reacting() const { return ReactionScope(Key()); }
  // Publishes what came before (the reactor's construction, say) to its reactions, for a
  // reaction that may come before any operation: OnCancel of a call that waits.
  void Publish() const { Release(Key()); }

 private:
  const void* Key() const { return static_cast<const Base*>(this); }
};

}  // namespace dbs::tsan

#endif  // DBS_COMMON_TSAN_H_
