/* libkda.so: kda.h as a shared library, for bench/compare_fla.py (ctypes).
 * Build: make build/libkda.so */
#define KDA_IMPLEMENTATION
#include "../kda.h"
#include <stddef.h>

/* Layout of the public structs, so a foreign mirror (ctypes) can check itself:
 * what 0..2 = sizeof kda_problem / kda_inputs / kda_fwd_outputs; 3..5 = offsetof
 * their last fields (seqlens_type, cu_seqlens_host, state_dtype); 6 = offsetof kda_problem.scale. */
size_t kda_bench_layout(int what) {
    switch (what) {
    case 0: return sizeof(kda_problem);
    case 1: return sizeof(kda_inputs);
    case 2: return sizeof(kda_fwd_outputs);
    case 3: return offsetof(kda_problem, seqlens_type);
    case 4: return offsetof(kda_inputs, cu_seqlens_host);
    case 5: return offsetof(kda_fwd_outputs, state_dtype);
    case 6: return offsetof(kda_problem, scale);
    default: return 0;
    }
}
