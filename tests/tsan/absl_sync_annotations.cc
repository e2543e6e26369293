// Makes Debian's uninstrumented Abseil locks visible to ThreadSanitizer.
//
// Debian builds libabsl_synchronization without -fsanitize=thread, so its annotations
// (ABSL_TSAN_MUTEX_*) are compiled out: TSan sees neither the lock nor the happens-before edge
// that an absl::Mutex gives, and reports every pair of accesses guarded by one as a race. gRPC's
// own locks (grpc_core::Mutex, gpr_mu) are absl::Mutex too.
//
// This file, linked into each test binary under --config=tsan (tests/cc_test.bzl), defines the
// absl::Mutex, absl::CondVar and absl::Notification entry points itself. Every call to them from
// the test, from our libraries and from libgrpc/libgpr goes through the PLT to these definitions
// (the executable comes first in symbol lookup), which tell TSan what the lock does
// (__tsan_mutex_* from <sanitizer/tsan_interface.h>, the interface Abseil itself uses when it is
// built with TSan) and then call Abseil's own function, found with dlsym(RTLD_NEXT).
//
// Blocking calls that release and re-acquire the lock (Await, LockWhen, CondVar::Wait) are
// told to TSan as "unlock, then lock": TSan ignores the accesses made inside the real call, which
// include the waiters' conditions that absl::Mutex evaluates on whichever thread releases it.
// Await and CondVar::Wait assume the lock is held exclusively, as everywhere in this code base.

#if defined(__SANITIZE_THREAD__)

#include <dlfcn.h>
#include <sanitizer/tsan_interface.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/base/options.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace {

#define DBS_TSAN_STR2(x) #x
#define DBS_TSAN_STR(x) DBS_TSAN_STR2(x)

// Abseil's own definition of `absl::<inline namespace>::<cls>::<fn>`, mangled as
// _ZN4absl<len><ns><len><cls><fn> (_ZNK4absl... for a const member function); fn already
// carries its length and parameter types.
void* RealSymbol(const char* cls, const char* fn, bool is_const = false) {
  const std::string ns = DBS_TSAN_STR(ABSL_OPTION_INLINE_NAMESPACE_NAME);
  const std::string name = std::string(is_const ? "_ZNK4absl" : "_ZN4absl") +
                           std::to_string(ns.size()) + ns + std::to_string(std::strlen(cls)) + cls +
                           fn;
  void* real = dlsym(RTLD_NEXT, name.c_str());
  if (real == nullptr) {
    std::fprintf(stderr, "tests/tsan: no %s in the loaded Abseil: %s\n", name.c_str(), dlerror());
    std::abort();
  }
  return real;
}

template <typename Fn>
Fn RealFn(const char* cls, const char* fn, bool is_const = false) {
  return reinterpret_cast<Fn>(RealSymbol(cls, fn, is_const));
}

constexpr unsigned kExclusive = 0;
constexpr unsigned kShared = __tsan_mutex_read_lock;

// Abseil's own entry points call each other (AwaitWithTimeout calls AwaitWithDeadline through
// the PLT, so it comes back here): only the outermost call on a thread is told to TSan.
thread_local int t_depth = 0;

template <typename Call>
auto Real(Call call) {
  ++t_depth;
  auto result = call();
  --t_depth;
  return result;
}

// The lock is held on entry and on return; in between the real call may release it.
template <typename Call>
auto Reacquire(void* mu, Call call) {
  if (t_depth > 0) return call();
  const int recursion = __tsan_mutex_pre_unlock(mu, kExclusive);
  __tsan_mutex_post_unlock(mu, kExclusive);
  __tsan_mutex_pre_lock(mu, kExclusive);
  auto result = Real(call);
  __tsan_mutex_post_lock(mu, kExclusive, recursion);
  return result;
}

// The lock is not held on entry and is held on return.
template <typename Call>
auto Acquire(void* mu, unsigned mode, Call call) {
  if (t_depth > 0) return call();
  __tsan_mutex_pre_lock(mu, mode);
  auto result = Real(call);
  __tsan_mutex_post_lock(mu, mode, 0);
  return result;
}

template <typename Call>
bool TryAcquire(void* mu, unsigned mode, Call call) {
  if (t_depth > 0) return call();
  __tsan_mutex_pre_lock(mu, mode | __tsan_mutex_try_lock);
  const bool locked = Real(call);
  __tsan_mutex_post_lock(
      mu, mode | __tsan_mutex_try_lock | (locked ? 0 : __tsan_mutex_try_lock_failed), 0);
  return locked;
}

template <typename Call>
void Release(void* mu, unsigned mode, Call call) {
  if (t_depth > 0) {
    call();
    return;
  }
  __tsan_mutex_pre_unlock(mu, mode);
  Real(call);
  __tsan_mutex_post_unlock(mu, mode);
}

struct Unit {};

using MutexFn = void (*)(absl::Mutex*);
using MutexBoolFn = bool (*)(absl::Mutex*);
using CondFn = void (*)(absl::Mutex*, const absl::Condition&);
using CondTimeoutFn = bool (*)(absl::Mutex*, const absl::Condition&, absl::Duration);
using CondDeadlineFn = bool (*)(absl::Mutex*, const absl::Condition&, absl::Time);
using CvWaitFn = void (*)(absl::CondVar*, absl::Mutex*);
using CvTimeoutFn = bool (*)(absl::CondVar*, absl::Mutex*, absl::Duration);
using CvDeadlineFn = bool (*)(absl::CondVar*, absl::Mutex*, absl::Time);
using NotifyFn = void (*)(absl::Notification*);
using WaitFn = void (*)(const absl::Notification*);
using WaitTimeoutFn = bool (*)(const absl::Notification*, absl::Duration);
using WaitDeadlineFn = bool (*)(const absl::Notification*, absl::Time);

// absl::Notification is {Mutex mutex_; std::atomic<bool> notified_yet_;}. HasBeenNotified() is
// inline, an instrumented acquire load of notified_yet_; Notify() stores it in uninstrumented
// code, so Notify releases on that address here for the load to acquire. The WaitForNotification
// family loads it in uninstrumented code too (and returns at once, taking no lock, when Notify
// already ran), so each acquires on that address here once it has seen the notification.
struct NotificationLayout {
  absl::Mutex mutex;
  std::atomic<bool> notified_yet;
};
static_assert(sizeof(NotificationLayout) == sizeof(absl::Notification),
              "absl::Notification's layout changed: update tests/tsan");

void AcquireNotified(const absl::Notification* n) {
  __tsan_acquire(const_cast<std::atomic<bool>*>(
      &reinterpret_cast<const NotificationLayout*>(n)->notified_yet));
}

}  // namespace

namespace absl {
ABSL_NAMESPACE_BEGIN

void Mutex::Lock() {
  static const auto real = RealFn<MutexFn>("Mutex", "4LockEv");
  Acquire(this, kExclusive, [&] { return (real(this), Unit{}); });
}

void Mutex::ReaderLock() {
  static const auto real = RealFn<MutexFn>("Mutex", "10ReaderLockEv");
  Acquire(this, kShared, [&] { return (real(this), Unit{}); });
}

bool Mutex::TryLock() {
  static const auto real = RealFn<MutexBoolFn>("Mutex", "7TryLockEv");
  return TryAcquire(this, kExclusive, [&] { return real(this); });
}

bool Mutex::ReaderTryLock() {
  static const auto real = RealFn<MutexBoolFn>("Mutex", "13ReaderTryLockEv");
  return TryAcquire(this, kShared, [&] { return real(this); });
}

void Mutex::Unlock() {
  static const auto real = RealFn<MutexFn>("Mutex", "6UnlockEv");
  Release(this, kExclusive, [&] { return (real(this), Unit{}); });
}

void Mutex::ReaderUnlock() {
  static const auto real = RealFn<MutexFn>("Mutex", "12ReaderUnlockEv");
  Release(this, kShared, [&] { return (real(this), Unit{}); });
}

void Mutex::LockWhen(const Condition& cond) {
  static const auto real = RealFn<CondFn>("Mutex", "8LockWhenERKNS0_9ConditionE");
  Acquire(this, kExclusive, [&] { return (real(this, cond), Unit{}); });
}

void Mutex::ReaderLockWhen(const Condition& cond) {
  static const auto real = RealFn<CondFn>("Mutex", "14ReaderLockWhenERKNS0_9ConditionE");
  Acquire(this, kShared, [&] { return (real(this, cond), Unit{}); });
}

bool Mutex::LockWhenWithTimeout(const Condition& cond, Duration timeout) {
  static const auto real =
      RealFn<CondTimeoutFn>("Mutex", "19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  return Acquire(this, kExclusive, [&] { return real(this, cond, timeout); });
}

bool Mutex::ReaderLockWhenWithTimeout(const Condition& cond, Duration timeout) {
  static const auto real =
      RealFn<CondTimeoutFn>("Mutex", "25ReaderLockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  return Acquire(this, kShared, [&] { return real(this, cond, timeout); });
}

bool Mutex::LockWhenWithDeadline(const Condition& cond, Time deadline) {
  static const auto real =
      RealFn<CondDeadlineFn>("Mutex", "20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  return Acquire(this, kExclusive, [&] { return real(this, cond, deadline); });
}

bool Mutex::ReaderLockWhenWithDeadline(const Condition& cond, Time deadline) {
  static const auto real =
      RealFn<CondDeadlineFn>("Mutex", "26ReaderLockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  return Acquire(this, kShared, [&] { return real(this, cond, deadline); });
}

void Mutex::Await(const Condition& cond) {
  static const auto real = RealFn<CondFn>("Mutex", "5AwaitERKNS0_9ConditionE");
  Reacquire(this, [&] { return (real(this, cond), Unit{}); });
}

bool Mutex::AwaitWithTimeout(const Condition& cond, Duration timeout) {
  static const auto real =
      RealFn<CondTimeoutFn>("Mutex", "16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  return Reacquire(this, [&] { return real(this, cond, timeout); });
}

bool Mutex::AwaitWithDeadline(const Condition& cond, Time deadline) {
  static const auto real =
      RealFn<CondDeadlineFn>("Mutex", "17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  return Reacquire(this, [&] { return real(this, cond, deadline); });
}

void CondVar::Wait(Mutex* mu) {
  static const auto real = RealFn<CvWaitFn>("CondVar", "4WaitEPNS0_5MutexE");
  Reacquire(mu, [&] { return (real(this, mu), Unit{}); });
}

bool CondVar::WaitWithTimeout(Mutex* mu, Duration timeout) {
  static const auto real =
      RealFn<CvTimeoutFn>("CondVar", "15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE");
  return Reacquire(mu, [&] { return real(this, mu, timeout); });
}

bool CondVar::WaitWithDeadline(Mutex* mu, Time deadline) {
  static const auto real =
      RealFn<CvDeadlineFn>("CondVar", "16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE");
  return Reacquire(mu, [&] { return real(this, mu, deadline); });
}

void Notification::Notify() {
  static const auto real = RealFn<NotifyFn>("Notification", "6NotifyEv");
  __tsan_release(&reinterpret_cast<NotificationLayout*>(this)->notified_yet);
  real(this);
}

void Notification::WaitForNotification() const {
  static const auto real = RealFn<WaitFn>("Notification", "19WaitForNotificationEv", true);
  real(this);
  AcquireNotified(this);
}

bool Notification::WaitForNotificationWithTimeout(Duration timeout) const {
  static const auto real = RealFn<WaitTimeoutFn>(
      "Notification", "30WaitForNotificationWithTimeoutENS0_8DurationE", true);
  const bool notified = real(this, timeout);
  if (notified) AcquireNotified(this);
  return notified;
}

bool Notification::WaitForNotificationWithDeadline(Time deadline) const {
  static const auto real =
      RealFn<WaitDeadlineFn>("Notification", "31WaitForNotificationWithDeadlineENS0_4TimeE", true);
  const bool notified = real(this, deadline);
  if (notified) AcquireNotified(this);
  return notified;
}

ABSL_NAMESPACE_END
}  // namespace absl

// gRPC hands calls and buffers between its threads through its completion queues, executor
// and reference counts, whose atomic operations are compiled into the uninstrumented libgrpc and
// libgrpc++, so TSan cannot see those hand-offs. What is not checked because of that:
// - what the memory functions and the allocator see when called from a library that is not
//   instrumented (ignore_noninstrumented_modules): buffers that gRPC, upb and Abseil own;
// - gRPC's own per-call objects, which its header code (compiled into our binaries) fills on
//   one thread and completes or destroys on another: a racing access made by gRPC's
//   grpc::internal code itself (race_top: the top frame, not merely a caller, is gRPC's), and
//   any access inside the gRPC functions that only fill, clear or destroy those objects and
//   call no code of ours (race: the batch of operations, a unary callback tag's constructor,
//   the callback tag's Set and Clear, the interceptor batch, a unary call's destructor, and
//   the reference count of a callback call, set when its handler creates it on one of gRPC's
//   threads and counted down when its Finish completes on another: ServerCallbackCall::Unref,
//   which calls no code of ours).
// Our code's accesses, including those it makes on gRPC's threads and from its callbacks, are
// still checked. A suppression can match an earlier access only while TSan still holds its
// stack: history_size=4 keeps enough of it that a loaded machine does not lose the stack of a
// callback tag's Set and report gRPC's own hand-off as a race.
extern "C" const char* __tsan_default_options() {
  return "ignore_noninstrumented_modules=1:history_size=4";
}

extern "C" const char* __tsan_default_suppressions() {
  return "race_top:grpc::internal::\n"
         "race:grpc::internal::CallOpSet\n"
         "race:grpc::internal::CallOpServerSendStatus\n"
         "race:grpc::internal::CallbackWithStatusTag::CallbackWithStatusTag\n"
         "race:grpc::internal::CallbackWithSuccessTag::Set\n"
         "race:grpc::internal::CallbackWithSuccessTag::Clear\n"
         "race:grpc::internal::InterceptorBatchMethodsImpl\n"
         "race:ServerCallbackUnaryImpl::~ServerCallbackUnaryImpl\n"
         "race:grpc::internal::ServerCallbackCall::Unref\n";
}

#endif  // defined(__SANITIZE_THREAD__)
