// The runtime library of tokenserve's op libraries: the process's one helper team (see
// chunks.h). The loader builds it like an op library and makes its symbols global before it
// loads any op library, so every op library's weak reference to tokenserve_helper_team
// resolves here and they all share one team: two teams polling at once would take both
// cores of a two-core machine from the thread that runs the ops.
#include "chunks.h"

extern "C" void* tokenserve_helper_team(int64_t workers) {
  static tokenserve::chunks_internal::HelperTeam* const team =
      tokenserve::chunks_internal::NewHelperTeam(workers);
  return team;
}
