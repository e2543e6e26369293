#include "worker/gradient_fault.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace dbs {

absl::StatusOr<GradientFault> GradientFault::Parse(absl::string_view spec) {
  GradientFault f;
  if (spec.empty() || spec == "none") return f;
  const auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("--corrupt_gradient=", spec, ": ", why,
                     " (expected 'nan@N', 'scale:F@N', 'sign@N' or 'bitflip@N', N the worker's "
                     "step from which every pushed gradient is corrupted)"));
  };
  const std::vector<absl::string_view> at = absl::StrSplit(spec, '@');
  if (at.size() != 2) return bad("no '@N'");
  if (!absl::SimpleAtoi(at[1], &f.from_step) || f.from_step < 0) return bad("N is not a step");
  const std::vector<absl::string_view> how = absl::StrSplit(at[0], ':');
  if (how[0] == "nan" && how.size() == 1) {
    f.kind = Kind::kNaN;
  } else if (how[0] == "sign" && how.size() == 1) {
    f.kind = Kind::kSign;
  } else if (how[0] == "bitflip" && how.size() == 1) {
    f.kind = Kind::kBitFlip;
  } else if (how[0] == "scale" && how.size() == 2) {
    f.kind = Kind::kScale;
    if (!absl::SimpleAtod(how[1], &f.factor) || !std::isfinite(f.factor)) {
      return bad("the scale is not a number");
    }
  } else {
    return bad("unknown corruption");
  }
  return f;
}

bool GradientFault::Apply(int64_t step, absl::Span<float> gradient) const {
  if (kind == Kind::kNone || step < from_step || gradient.empty()) return false;
  switch (kind) {
    case Kind::kNaN:
      for (float& g : gradient) g = std::numeric_limits<float>::quiet_NaN();
      break;
    case Kind::kScale:
      for (float& g : gradient) g = static_cast<float>(g * factor);
      break;
    case Kind::kSign:
      for (float& g : gradient) g = -g;
      break;
    case Kind::kBitFlip: {
      std::seed_seq seeds{seed, static_cast<uint64_t>(step)};
      std::mt19937_64 rng(seeds);
      std::uniform_int_distribution<size_t> which(0, gradient.size() - 1);
      std::uniform_int_distribution<int> bit(0, 31);
      const size_t flips = std::max<size_t>(1, gradient.size() / 1000);
      for (size_t k = 0; k < flips; ++k) {
        float& g = gradient[which(rng)];
        uint32_t bits;
        std::memcpy(&bits, &g, sizeof bits);
        bits ^= 1u << bit(rng);
        std::memcpy(&g, &bits, sizeof bits);
      }
      break;
    }
    case Kind::kNone:
      break;
  }
  return true;
}

}  // namespace dbs
