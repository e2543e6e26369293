#include "common/malloc_tuning.h"

#ifdef DBS_TCMALLOC
#include <gperftools/malloc_extension.h>
#endif

namespace dbs {

#ifdef DBS_TCMALLOC

bool KeepFreedMemoryMapped() {
  MallocExtension::instance()->SetMemoryReleaseRate(0.0);
  return true;
}

bool ReleaseFreedMemory() {
  MallocExtension::instance()->ReleaseFreeMemory();
  return true;
}

std::optional<double> MemoryReleaseRate() {
  return MallocExtension::instance()->GetMemoryReleaseRate();
}

#else

bool KeepFreedMemoryMapped() { return false; }
bool ReleaseFreedMemory() { return false; }
std::optional<double> MemoryReleaseRate() { return std::nullopt; }

#endif

}  // namespace dbs
