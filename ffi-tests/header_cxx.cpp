// The header must compile as C++ with every warning an error, and link.
#include "symm.h"

#include <cstdio>

int main() {
    symm_group_config_t cfg = SYMM_GROUP_CONFIG_INIT;
    symm_bootstrap_t bs = SYMM_BOOTSTRAP_INIT;
    (void)cfg;
    (void)bs;
    int version = 0;
    if (symm_get_version(&version) != SYMM_SUCCESS) return 1;
    std::printf("symm %d, %s\n", version, symm_status_string(SYMM_ERROR_TIMEOUT));
    return version == SYMM_VERSION_CODE ? 0 : 1;
}
