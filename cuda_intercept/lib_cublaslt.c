/* rgpu's cublaslt forwarders: see rgpu/protocol/lib_cublaslt.py. */
#include "lib_door.h"
