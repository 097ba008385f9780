/* The header must compile as strict C99 with every warning an error. */
#include "symm.h"

int main(void) {
    symm_group_config_t cfg = SYMM_GROUP_CONFIG_INIT;
    symm_bootstrap_t bs = SYMM_BOOTSTRAP_INIT;
    symm_unique_id_t id;
    symm_ag_mm_options_t ag = SYMM_AG_MM_OPTIONS_INIT;
    symm_mm_rs_options_t rs = SYMM_MM_RS_OPTIONS_INIT;
    symm_symmetric_args_t sa = SYMM_SYMMETRIC_ARGS_INIT;
    int64_t shape[2] = {2, 3};
    symm_tensor_t t = symm_tensor_contiguous(NULL, SYMM_DTYPE_BF16, 2, shape);
    int version = 0;
    (void)cfg;
    (void)bs;
    (void)id;
    (void)ag;
    (void)rs;
    (void)sa;
    if (t.strides[0] != 3 || t.strides[1] != 1) return 1;
    return symm_get_version(&version) == SYMM_SUCCESS && version == SYMM_VERSION_CODE ? 0 : 1;
}
