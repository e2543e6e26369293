#include "common/cpu_limit.h"

#include <algorithm>
#include <fstream>
#include <optional>
#include <sstream>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"

namespace dbs {
namespace {

std::optional<std::string> Slurp(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// mountinfo writes space, tab, newline and backslash in paths as octal escapes (\040 ...).
std::string Unescape(absl::string_view s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    const bool octal = s[i] == '\\' && i + 3 < s.size() &&
                       std::all_of(s.begin() + i + 1, s.begin() + i + 4,
                                   [](char c) { return c >= '0' && c <= '7'; });
    if (!octal) {
      out.push_back(s[i]);
      continue;
    }
    out.push_back(
        static_cast<char>((s[i + 1] - '0') * 64 + (s[i + 2] - '0') * 8 + (s[i + 3] - '0')));
    i += 3;
  }
  return out;
}

struct Mount {
  std::string root;   // the mount's root inside the hierarchy
  std::string point;  // where it is mounted
};

// The mount of the v2 hierarchy (`v1_controller` empty) or of the v1 hierarchy that carries the
// controller.
std::optional<Mount> FindMount(const std::string& mountinfo, absl::string_view v1_controller) {
  for (absl::string_view line : absl::StrSplit(mountinfo, '\n')) {
    std::vector<absl::string_view> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
    auto dash = std::find(f.begin(), f.end(), "-");
    if (f.size() < 5 || dash == f.end() || f.end() - dash < 4) continue;
    const absl::string_view fstype = dash[1];
    bool match = false;
    if (v1_controller.empty()) {
      match = fstype == "cgroup2";
    } else if (fstype == "cgroup") {
      for (absl::string_view opt : absl::StrSplit(dash[3], ',')) match |= opt == v1_controller;
    }
    if (match) return Mount{Unescape(f[3]), Unescape(f[4])};
  }
  return std::nullopt;
}

// The directories from the process's cgroup up to the mount point, innermost first.
std::vector<std::string> Ancestry(const std::string& root, const Mount& mount,
                                  absl::string_view cgroup_path) {
  std::string rel(cgroup_path);
  if (mount.root != "/" && absl::StartsWith(rel, mount.root)) {
    rel = rel.substr(mount.root.size());
  } else if (mount.root != "/") {
    rel.clear();  // a cgroup outside the mount (another namespace's view): the mount alone
  }
  std::vector<std::string> dirs;
  std::string base = absl::StrCat(absl::StripSuffix(root, "/"), mount.point);
  while (!rel.empty() && rel != "/") {
    dirs.push_back(absl::StrCat(base, rel));
    const size_t slash = rel.find_last_of('/');
    rel = slash == std::string::npos ? "" : rel.substr(0, slash);
  }
  dirs.push_back(base);
  return dirs;
}

absl::Status Unparsable(const std::string& path, absl::string_view text) {
  return absl::InvalidArgumentError(absl::StrCat("cannot read the CPU limit in ", path, ": '",
                                                 absl::StripAsciiWhitespace(text), "'"));
}

// The limit one directory sets (nullopt: none there).
absl::StatusOr<std::optional<double>> LimitV2(const std::string& dir) {
  const std::string path = dir + "/cpu.max";
  const std::optional<std::string> text = Slurp(path);
  if (!text.has_value()) return std::optional<double>();
  std::vector<absl::string_view> f =
      absl::StrSplit(absl::StripAsciiWhitespace(*text), ' ', absl::SkipEmpty());
  if (f.empty() || f.size() > 2) return Unparsable(path, *text);
  if (f[0] == "max") return std::optional<double>();
  double quota = 0, period = 100000;
  if (!absl::SimpleAtod(f[0], &quota) || (f.size() == 2 && !absl::SimpleAtod(f[1], &period)) ||
      !(quota > 0) || !(period > 0)) {
    return Unparsable(path, *text);
  }
  return std::optional<double>(quota / period);
}

absl::StatusOr<std::optional<double>> LimitV1(const std::string& dir) {
  const std::string quota_path = dir + "/cpu.cfs_quota_us";
  const std::optional<std::string> quota_text = Slurp(quota_path);
  const std::optional<std::string> period_text = Slurp(dir + "/cpu.cfs_period_us");
  if (!quota_text.has_value() || !period_text.has_value()) return std::optional<double>();
  double quota = 0, period = 0;
  if (!absl::SimpleAtod(absl::StripAsciiWhitespace(*quota_text), &quota)) {
    return Unparsable(quota_path, *quota_text);
  }
  if (quota < 0) return std::optional<double>();  // -1: no limit
  if (!absl::SimpleAtod(absl::StripAsciiWhitespace(*period_text), &period) || !(period > 0) ||
      !(quota > 0)) {
    return Unparsable(dir + "/cpu.cfs_period_us", *period_text);
  }
  return std::optional<double>(quota / period);
}

}  // namespace

absl::StatusOr<double> CgroupCpuLimitCores(const std::string& root) {
  const std::string base(absl::StripSuffix(root, "/"));
  const std::optional<std::string> cgroups = Slurp(base + "/proc/self/cgroup");
  const std::optional<std::string> mountinfo = Slurp(base + "/proc/self/mountinfo");
  if (!cgroups.has_value() || !mountinfo.has_value()) return 0.0;
  double limit = 0.0;  // 0: none found yet
  auto tighten = [&limit](const std::optional<double>& l) {
    if (l.has_value() && (limit == 0.0 || *l < limit)) limit = *l;
  };
  for (absl::string_view line : absl::StrSplit(*cgroups, '\n')) {
    // hierarchy-id:controllers:path (the path may itself hold ':')
    std::vector<absl::string_view> f = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (f.size() != 3) continue;
    const bool v2 = f[0] == "0" && f[1].empty();
    bool v1_cpu = false;
    for (absl::string_view c : absl::StrSplit(f[1], ',')) v1_cpu |= c == "cpu";
    if (!v2 && !v1_cpu) continue;
    const std::optional<Mount> mount = FindMount(*mountinfo, v2 ? "" : "cpu");
    if (!mount.has_value()) continue;
    for (const std::string& dir : Ancestry(base, *mount, f[2])) {
      absl::StatusOr<std::optional<double>> l = v2 ? LimitV2(dir) : LimitV1(dir);
      if (!l.ok()) return l.status();
      tighten(*l);
    }
  }
  return limit;
}

double EffectiveCpuLimit(double limit, int cpus) {
  if (!(limit > 0)) return 0.0;
  if (cpus > 0 && limit >= cpus) return 0.0;
  return limit;
}

}  // namespace dbs
