// Secrets: random tokens and comparing them.
#ifndef DBS_COMMON_SECRETS_H_
#define DBS_COMMON_SECRETS_H_

#include <string>

#include "absl/strings/string_view.h"

namespace dbs {

// 128 random bits from the kernel (getrandom), as 32 hex digits.
std::string RandomToken();

// Compares secrets without an early exit, so timing does not tell how much of a guess was right.
bool ConstantTimeEquals(absl::string_view a, absl::string_view b);

}  // namespace dbs

#endif  // DBS_COMMON_SECRETS_H_
