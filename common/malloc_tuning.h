#ifndef DBS_COMMON_MALLOC_TUNING_H_
#define DBS_COMMON_MALLOC_TUNING_H_

#include <optional>

namespace dbs {

// Tells tcmalloc to keep the memory it frees mapped for reuse (a release rate of 0) rather than
// hand it back to the kernel in the background: a step frees and allocates the same sizes every
// time, and memory handed back is faulted in again, page by page, on the next step. The peak RSS
// stays what it is; what is not handed back is what the next step reuses. Call once at the top of
// main; it overrides TCMALLOC_RELEASE_RATE, so the process does not depend on the environment it
// was started in. Returns false (and does nothing) under another allocator.
bool KeepFreedMemoryMapped();

// Hands the memory the allocator holds free back to the kernel at once (tcmalloc's
// ReleaseFreeMemory); what is allocated again later is faulted in again. For the end of a large
// one-time use, such as a model's registration. Returns false (and does nothing) under another
// allocator.
bool ReleaseFreedMemory();

// tcmalloc's release rate now; nullopt when the binary is not linked with tcmalloc (under
// `--define=dbs_malloc=system`, as in the sanitizer builds).
std::optional<double> MemoryReleaseRate();

}  // namespace dbs

#endif  // DBS_COMMON_MALLOC_TUNING_H_
