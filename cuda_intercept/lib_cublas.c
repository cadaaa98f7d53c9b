/* rgpu's cublas forwarders: see rgpu/protocol/lib_cublas.py. */
#include "lib_door.h"
