// Status propagation macros (Debian's Abseil 20220623 has no ABSL_RETURN_IF_ERROR).
#ifndef DBS_COMMON_STATUS_MACROS_H_
#define DBS_COMMON_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define DBS_CONCAT_INNER_(a, b) a##b
#define DBS_CONCAT_(a, b) DBS_CONCAT_INNER_(a, b)

// Returns the status from the enclosing function if `expr` is not OK.
#define DBS_RETURN_IF_ERROR(expr)              \
  do {                                         \
    ::absl::Status dbs_status_ = (expr);       \
    if (!dbs_status_.ok()) return dbs_status_; \
  } while (false)

// `DBS_ASSIGN_OR_RETURN(auto x, StatusOrExpr())`: unwraps or returns the error.
#define DBS_ASSIGN_OR_RETURN(lhs, expr) \
  DBS_ASSIGN_OR_RETURN_IMPL_(DBS_CONCAT_(dbs_statusor_, __LINE__), lhs, expr)

#define DBS_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                               \
  if (!tmp.ok()) return tmp.status();              \
  lhs = std::move(tmp).value()

#endif  // DBS_COMMON_STATUS_MACROS_H_
