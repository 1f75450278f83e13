// SPDX-License-Identifier: MIT
// The build id: part of every daemon's identity, so daemons of different builds refuse to mesh.
#ifndef MM_BUILD_H
#define MM_BUILD_H

// mm_build_id returns a static string: "<version>+<git commit or 'unknown'>[-dirty]".
const char *mm_build_id(void);

#endif
