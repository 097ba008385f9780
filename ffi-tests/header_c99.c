/* The header must compile as strict C99 with every warning an error. */
#include "symm.h"

int main(void) {
    symm_group_config_t cfg = SYMM_GROUP_CONFIG_INIT;
    symm_bootstrap_t bs = SYMM_BOOTSTRAP_INIT;
    symm_unique_id_t id;
    int version = 0;
    (void)cfg;
    (void)bs;
    (void)id;
    return symm_get_version(&version) == SYMM_SUCCESS && version == SYMM_VERSION_CODE ? 0 : 1;
}
