/* rgpu's cudnn forwarders: see rgpu/protocol/lib_cudnn.py. */
#include "lib_door.h"
