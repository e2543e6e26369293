// GoogleTest matchers for absl::Status and absl::StatusOr, in the style of Abseil's internal
// StatusIs: EXPECT_THAT(s, StatusIs(absl::StatusCode::kNotFound, HasSubstr("declared dead"))).
#ifndef DBS_TESTS_STATUS_MATCHERS_H_
#define DBS_TESTS_STATUS_MATCHERS_H_

#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"

namespace dbs {
namespace testing_internal {

inline const absl::Status& GetStatus(const absl::Status& s) { return s; }
template <typename T>
const absl::Status& GetStatus(const absl::StatusOr<T>& s) {
  return s.status();
}

// What a failed IsOk prints: the status, or for other status types (grpc::Status) its message.
inline std::string Describe(const absl::Status& s) { return s.ToString(); }
template <typename T>
std::string Describe(const absl::StatusOr<T>& s) {
  return s.status().ToString();
}
template <typename S>
auto Describe(const S& s) -> decltype(s.error_message()) {
  return s.error_message();
}

}  // namespace testing_internal

MATCHER_P2(StatusIs, code, message_matcher,
           std::string(negation ? "is not " : "is ") + absl::StatusCodeToString(code) +
               " with a message that " +
               ::testing::DescribeMatcher<std::string>(message_matcher, negation)) {
  const absl::Status& s = testing_internal::GetStatus(arg);
  *result_listener << "whose status is " << s;
  return s.code() == code && ::testing::Matches(message_matcher)(std::string(s.message()));
}

MATCHER_P(StatusCodeIs, code,
          std::string(negation ? "is not " : "is ") + absl::StatusCodeToString(code)) {
  const absl::Status& s = testing_internal::GetStatus(arg);
  *result_listener << "whose status is " << s;
  return s.code() == code;
}

// Any status type with ok(): absl::Status, absl::StatusOr, grpc::Status.
MATCHER(IsOk, std::string(negation ? "is not OK" : "is OK")) {
  *result_listener << "whose status is " << testing_internal::Describe(arg);
  return arg.ok();
}

}  // namespace dbs

#endif  // DBS_TESTS_STATUS_MATCHERS_H_
