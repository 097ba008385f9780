// The header must compile as C++ with every warning an error, and link.
#include "symm.h"

#include <cstdio>

int main() {
    symm_group_config_t cfg = SYMM_GROUP_CONFIG_INIT;
    symm_bootstrap_t bs = SYMM_BOOTSTRAP_INIT;
    symm_ag_mm_options_t ag = SYMM_AG_MM_OPTIONS_INIT;
    symm_mm_rs_options_t rs = SYMM_MM_RS_OPTIONS_INIT;
    symm_symmetric_args_t sa = SYMM_SYMMETRIC_ARGS_INIT;
    const int64_t shape[3] = {2, 3, 4};
    symm_tensor_t t = symm_tensor_contiguous(nullptr, SYMM_DTYPE_F16, 3, shape);
    (void)cfg;
    (void)bs;
    (void)ag;
    (void)rs;
    (void)sa;
    if (t.strides[0] != 12 || t.strides[2] != 1) return 1;
    int version = 0;
    if (symm_get_version(&version) != SYMM_SUCCESS) return 1;
    std::printf("symm %d, %s\n", version, symm_status_string(SYMM_ERROR_TIMEOUT));
    return version == SYMM_VERSION_CODE ? 0 : 1;
}
